"""The torch modules of the ``llama_moe`` family (its entry: :mod:`engine.training.models.llama_moe`): the llama
block (:mod:`engine.training.models.llama.layers`) whose MLP is a mixture of experts (:class:`engine.moe.MoELayer`)
in the layers ``model.moe`` makes MoE layers; the other layers are llama's own blocks.

Module names map onto Hugging Face ``MixtralForCausalLM``'s ``model.layers.<i>`` as the family's rules say:
``moe.router.linear`` -> ``block_sparse_moe.gate``, ``moe.experts.<e>.{gate,up,down}_proj`` ->
``block_sparse_moe.experts.<e>.{w1,w3,w2}`` (experts are named by their global index whatever
``parallel.expert``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ....moe import MoELayer
from ..llama.layers import Attention, Block, RMSNorm, init_projections, mlp_projections

if TYPE_CHECKING:  # annotations only: the config reads the family registry
    from ...config import ModelConfig

__all__ = ["Block", "MoEBlock", "moe_layer"]  # Block: llama's, the dense layers'


def moe_layer(cfg: ModelConfig, index: int) -> MoELayer:
    """Layer ``index``'s :class:`~engine.moe.MoELayer` from ``model.moe`` (all experts; ``[..., h] -> [..., h]``)."""
    moe = cfg.moe
    width = moe.ffn_hidden_size or cfg.ffn_hidden_size or 4 * cfg.hidden_size
    return MoELayer(cfg.hidden_size, width, moe.num_experts, moe.top_k, shared_ffn_hidden_size=moe.shared_experts * width,
                    name=f"L{index}", score_function=moe.router, normalize_top_k=moe.normalize_top_k,
                    aux_loss_coeff=moe.aux_loss_coeff, capacity_factor=moe.capacity_factor)


class MoEBlock(nn.Module):
    """Pre-norm llama block with a mixture-of-experts MLP: ``x + attn(rms(x))``, ``x + moe(rms(x))``.
    ``[s, b, h] -> [s, b, h]``."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
        self.moe = moe_layer(cfg, index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.moe(self.post_attention_layernorm(x))

    @torch.no_grad()
    def reset_parameters(self, std: float, num_layers: int, generator: torch.Generator) -> None:
        """llama's init (:func:`~engine.training.models.llama.layers.init_projections`) with the MoE's projections
        after attention's: the router normal(0, std), then every expert in global order and the shared experts,
        each as llama's MLP (the down projection a residual one) -- the same draws whatever ``parallel.expert``."""
        moe = self.moe
        mlp = [(moe.router.linear, False)] + [p for e in moe.experts.local for p in mlp_projections(e)]
        if moe.shared_experts is not None:
            mlp += mlp_projections(moe.shared_experts)
        init_projections(self, mlp, std, num_layers, generator)
