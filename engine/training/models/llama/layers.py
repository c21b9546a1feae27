"""The torch modules of the ``llama`` family (its entry: :mod:`engine.training.models.llama`): token embedding only
(no learned positions), pre-norm blocks with RMSNorm, rotary position embeddings on queries and keys, grouped-query
attention and a SwiGLU MLP, no biases (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models",
arXiv:2302.13971; rotary: Su et al., arXiv:2104.09864; GQA: Ainslie et al., arXiv:2305.13245; SwiGLU: Shazeer,
arXiv:2002.05202).

Module names map 1:1 onto Hugging Face ``LlamaForCausalLM``'s ``model.layers.<i>``: ``input_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``.  Rotary uses the
rotate-half layout (dimension ``j`` pairs with ``j + d/2``), the layout of the q / k projections as Hugging Face
stores them, so weights are exchanged without permutation.  Norms are ``torch.nn.RMSNorm`` (:class:`RMSNorm`),
whose ``F.rms_norm`` the split backward's layer-level deferral handles (:mod:`engine.runtime.split_backward`).
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

__all__ = ["RMSNorm", "Embedding", "Attention", "MLP", "Block", "final_norm", "rotary_tables", "apply_rotary",
           "mlp_projections", "init_projections"]


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` (``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, Zhang & Sennrich,
    arXiv:1910.07467) whose input reaches the norm through one view node.

    ``F.rms_norm`` decomposes into several ops reading ``x``; their input gradients would otherwise be summed into
    ``x``'s gradient one by one together with the residual branch's, while the split backward's deferral runs the
    norm as its own graph and hands back their sum.  With the view both paths add the same two partial sums in
    the same order: the split-backward schedules stay bitwise equal to 1F1B (tests/training/models/test_llama_reference.py).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.view_as(x), self.normalized_shape, self.weight, self.eps)


class Embedding(nn.Module):
    """Token embedding: ``[b, s]`` token ids -> ``[s, b, h]`` (positions enter through rotary in attention)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word(tokens).transpose(0, 1).contiguous()


def rotary_tables(seq_length: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[seq_length, head_dim]`` fp32: angle ``p * theta^(-2i/d)`` at position ``p`` for
    frequency ``i < d/2``, repeated for the two halves (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.int64).float(), inv_freq)  # [s, d/2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, heads, s, d]`` by the tables ``[s, d]``: ``x cos + rotate_half(x) sin`` with
    ``rotate_half([x1, x2]) = [-x2, x1]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query attention with rotary q / k: ``[s, b, h] -> [s, b, h]``.  ``num_query_groups`` key /
    value heads; query head ``j`` reads group ``j // (heads / groups)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.heads, self.groups = heads, cfg.num_query_groups or heads
        self.head_dim = h // heads
        self.core = CoreAttention(cfg.dropout)
        self.q_proj = nn.Linear(h, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.groups * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.groups * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, h, bias=False)
        cos, sin = rotary_tables(max(cfg.seq_length, cfg.max_position_embeddings or 0), self.head_dim,
                                 cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        s, b, _ = y.shape
        return y.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3)  # [b, n, s, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        # head counts from the shapes: heads / T and groups / T of them under tensor parallelism
        q = apply_rotary(self._heads(self.q_proj(x)), cos, sin)
        k = apply_rotary(self._heads(self.k_proj(x)), cos, sin)
        v = self._heads(self.v_proj(x))
        heads, groups, d = q.shape[1], k.shape[1], self.head_dim
        if groups != heads:  # each key / value head serves heads / groups consecutive query heads
            rep = heads // groups
            k = k[:, :, None].expand(b, groups, rep, s, d).reshape(b, heads, s, d)
            v = v[:, :, None].expand(b, groups, rep, s, d).reshape(b, heads, s, d)
        y = self.core(q, k, v)  # [b, nh, s, d]
        return self.o_proj(y.permute(2, 0, 1, 3).reshape(s, b, heads * d))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, ``[s, b, h] -> [s, b, h]``."""

    def __init__(self, cfg: ModelConfig, ffn_hidden_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm Llama block: ``x + attn(rms(x))``, ``x + mlp(rms(x))``.  ``[s, b, h] -> [s, b, h]``."""

    def __init__(self, cfg: ModelConfig, ffn_hidden_size: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
        self.mlp = MLP(cfg, ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    @torch.no_grad()
    def reset_parameters(self, std: float, num_layers: int, generator: torch.Generator) -> None:
        """normal(0, std) projections, the residual ones (``o_proj``, ``down_proj``) scaled by ``1/sqrt(2L)``
        (GPT-2's rule); norm weights one."""
        init_projections(self, mlp_projections(self.mlp), std, num_layers, generator)


def mlp_projections(mlp: nn.Module) -> list:
    """``(linear, residual)`` of a SwiGLU MLP's projections in init order: gate, up, then the residual down."""
    return [(mlp.gate_proj, False), (mlp.up_proj, False), (mlp.down_proj, True)]


@torch.no_grad()
def init_projections(block: nn.Module, mlp: list, std: float, num_layers: int, generator: torch.Generator) -> None:
    """A llama-style block's init: normal(0, std) attention projections, then ``mlp``'s ``(linear, residual)``
    projections in order, the residual ones (``o_proj`` and each marked one) scaled by ``1/sqrt(2L)`` (GPT-2's
    rule), drawn in that order from ``generator``; both norm weights one."""
    scale = 1 / math.sqrt(2 * num_layers)
    a = block.self_attn
    projections = [(a.q_proj, False), (a.k_proj, False), (a.v_proj, False), (a.o_proj, True)] + list(mlp)
    for lin, residual in projections:
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=generator) * (std * (scale if residual else 1.0)))
    block.input_layernorm.weight.fill_(1.0)
    block.post_attention_layernorm.weight.fill_(1.0)


def final_norm(cfg: ModelConfig) -> nn.Module:
    """The RMSNorm before the output head."""
    return RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
