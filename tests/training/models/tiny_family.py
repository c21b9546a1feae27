"""A model family defined outside pipecast's package, in this one file: ``model.family: tiny_relu2``.

A GPT variant: token embedding only, pre-norm blocks with RMSNorm (no biases), causal attention with separate
query / key / value projections, and a squared-ReLU MLP (``down(relu(up(x))^2)``, So et al. 2021, "Primer",
arXiv:2109.08668).  Registering it at import is all it takes for YAML configs, ``--help``, tensor parallelism, the
Hugging Face export and ``model.init_from``; ranks started by :func:`engine.training.spawn` (or the tests'
``run_ranks``) import the module of the function they run, and with it this one.

Its Hugging Face names are made up (``model_type: pipecast_tiny_relu2``; no ``transformers`` class reads them):
enough to write a folder and read it back, with one weight stored transposed (``[in, out]``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.training.models import FamilySpec, HuggingFace, register_family, unsupported

NAME = "tiny_relu2"


class Embedding(nn.Module):
    """``[b, s]`` token ids -> ``[s, b, h]``."""

    def __init__(self, cfg):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word(tokens).transpose(0, 1).contiguous()


class Block(nn.Module):
    """``x + attn(rms(x))``, ``x + down(relu(up(rms(x)))^2)``: ``[s, b, h] -> [s, b, h]``; the local head count
    comes from the shapes (``heads / T`` under tensor parallelism)."""

    def __init__(self, cfg, ffn_hidden_size: int):
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = h // cfg.num_attention_heads
        self.norm1 = nn.RMSNorm(h, eps=cfg.norm_epsilon)
        self.q, self.k, self.v = (nn.Linear(h, h, bias=False) for _ in range(3))
        self.out = nn.Linear(h, h, bias=False)
        self.norm2 = nn.RMSNorm(h, eps=cfg.norm_epsilon)
        self.up = nn.Linear(h, ffn_hidden_size, bias=False)
        self.down = nn.Linear(ffn_hidden_size, h, bias=False)

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        s, b, _ = y.shape
        return y.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3)  # [b, heads, s, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        y = self.norm1(x)
        a = F.scaled_dot_product_attention(self._heads(self.q(y)), self._heads(self.k(y)), self._heads(self.v(y)),
                                           is_causal=True)
        x = x + self.out(a.permute(2, 0, 1, 3).reshape(s, b, -1))
        return x + self.down(F.relu(self.up(self.norm2(x))).square())

    @torch.no_grad()
    def reset_parameters(self, std: float, num_layers: int, generator: torch.Generator) -> None:
        for lin, scale in ((self.q, 1.0), (self.k, 1.0), (self.v, 1.0), (self.out, 1 / math.sqrt(2 * num_layers)),
                           (self.up, 1.0), (self.down, 1 / math.sqrt(2 * num_layers))):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=generator) * (std * scale))
        self.norm1.weight.fill_(1.0)
        self.norm2.weight.fill_(1.0)


def final_norm(cfg) -> nn.Module:
    return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)


def check(m) -> str | None:
    if m.num_query_groups not in (None, m.num_attention_heads):
        return f"model.num_query_groups={m.num_query_groups}: model.family={NAME} has one key / value head per head"
    return None


def hf_config(cfg, ffn_hidden_size: int) -> dict:
    return {"num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "intermediate_size": ffn_hidden_size,
            "num_attention_heads": cfg.num_attention_heads, "rms_norm_eps": cfg.norm_epsilon}


def hf_fields(hf: dict) -> dict:
    if hf.get("attention_bias", False):
        raise unsupported("attention_bias", hf["attention_bias"], f"{NAME} has no biases")
    return {"num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
            "ffn_hidden_size": hf["intermediate_size"], "num_attention_heads": hf["num_attention_heads"],
            "num_query_groups": None, "vocab_size": hf["vocab_size"], "norm_epsilon": hf["rms_norm_eps"],
            "tie_embeddings": hf["tie_word_embeddings"]}


SPEC = register_family(FamilySpec(
    name=NAME,
    summary="test family: RMSNorm, separate q / k / v, squared-ReLU MLP, no biases",
    embedding=Embedding, block=Block, final_norm=final_norm,
    tensor_parallel={"norm1": "norm", "q": "colwise", "k": "colwise", "v": "colwise", "out": "rowwise",
                     "norm2": "norm", "up": "colwise", "down": "rowwise"},
    check=check,
    hf=HuggingFace(
        model_type="pipecast_tiny_relu2", architectures=("TinyRelu2ForCausalLM",), prefix="model.",
        rules=((r"embedding\.word\.weight", "model.embed.weight", False),
               (r"layers\.(\d+)\.down\.weight", r"model.layers.\1.mlp_down.weight", True),
               (r"layers\.(\d+)\.(norm1|q|k|v|out|norm2|up)\.weight", r"model.layers.\1.\2.weight", False),
               (r"final_norm\.weight", "model.norm.weight", False),
               (r"output_head\.word\.weight", "lm_head.weight", False)),
        config=hf_config, fields=hf_fields),
))
