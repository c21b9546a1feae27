"""The attention core the built-in families share: causal scaled-dot-product attention over ``q``, ``k``, ``v``
as its own module, so that selective recomputation (``model.recompute: selective``) can recompute it alone
(Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198,
sec. 5: the scores, softmax, dropout and weighted sum of values -- no parameters, little compute per byte kept).
A family names its core in :attr:`engine.training.models.registry.FamilySpec.attention_core`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CoreAttention"]


class CoreAttention(nn.Module):
    """``softmax(q k^T / sqrt(d) + causal mask) v`` with attention dropout ``dropout`` (training only), through
    ``F.scaled_dot_product_attention``: ``q`` ``[b, nh, s, d]``, ``k`` / ``v`` ``[b, nh, s, d]`` (key / value
    heads already repeated to ``nh``) -> ``[b, nh, s, d]``."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)
