"""The torch modules of the ``gpt2`` family (its entry: :mod:`engine.training.models.gpt2`).

Parameter names inside a block: ``ln1``, ``qkv`` (``[3h, h]``: rows ``q | k | v``, each head-major), ``proj``,
``ln2``, ``fc1``, ``fc2`` (the family's entry maps them onto Hugging Face ``GPT2LMHeadModel``); the attention core
``core`` (:class:`~engine.training.models.attention.CoreAttention`) has none.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import CoreAttention

if TYPE_CHECKING:  # annotations only: the config reads the family registry
    from ...config import ModelConfig

__all__ = ["Embedding", "Block", "final_norm"]


class Embedding(nn.Module):
    """Token + learned position embedding: ``[b, s]`` token ids -> ``[s, b, h]``.  ``pos`` has
    ``max_position_embeddings`` rows (default ``seq_length``); position ``i`` of a sequence reads row ``i``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_position_embeddings or cfg.seq_length, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.word(tokens) + self.pos(torch.arange(s, device=tokens.device))[None]
        return self.drop(x.transpose(0, 1).contiguous())


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, ``x + mlp(ln(x))``; causal attention through its ``core``
    (``F.scaled_dot_product_attention``), GELU MLP (``model.activation``: exact or tanh).  ``[s, b, h] -> [s, b,
    h]``."""

    def __init__(self, cfg: ModelConfig, ffn_hidden_size: int):
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        self.ln1 = nn.LayerNorm(h, eps=cfg.norm_epsilon)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h, eps=cfg.norm_epsilon)
        self.fc1 = nn.Linear(h, ffn_hidden_size)
        self.fc2 = nn.Linear(ffn_hidden_size, h)
        self.core = CoreAttention(cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape  # heads from the shape: heads / T of them under tensor parallelism (local qkv rows)
        q, k, v = self.qkv(x).view(s, b, 3, -1, h // self.heads).permute(2, 1, 3, 0, 4)  # [b, nh, s, d]
        y = self.core(q, k, v)  # [b, nh, s, d]
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.ln1(x)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.approximate)))

    @torch.no_grad()
    def reset_parameters(self, std: float, num_layers: int, generator: torch.Generator) -> None:
        """GPT-2 initialisation: normal(0, std) weights, residual projections scaled by ``1/sqrt(2L)``."""
        for lin, scale in ((self.qkv, 1.0), (self.proj, 1 / math.sqrt(2 * num_layers)), (self.fc1, 1.0),
                           (self.fc2, 1 / math.sqrt(2 * num_layers))):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=generator) * (std * scale))
            lin.bias.zero_()
        for ln in (self.ln1, self.ln2):
            ln.weight.fill_(1.0)
            ln.bias.zero_()


def final_norm(cfg: ModelConfig) -> nn.Module:
    """The LayerNorm before the output head."""
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
