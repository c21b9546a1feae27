"""Model families of the YAML trainer (``model.family``): each gives the first stage's embedding (a module with
``.word``, an ``nn.Embedding``, and optionally ``.pos``), the transformer block (``[s, b, h] -> [s, b, h]``, with
``reset_parameters(std, num_layers, generator)``) and the final norm.  :class:`engine.training.models.chunk.GPTChunk`
assembles them into pipeline model chunks; the chunk protocol, the output head and tied embeddings are shared.

``gpt2``: :mod:`.gpt2`; ``llama``: :mod:`.llama`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..config import ModelConfig
from . import gpt2, llama

__all__ = ["Family", "FAMILIES", "family_of"]


@dataclass(frozen=True)
class Family:
    """The modules of one model family."""

    name: str
    embedding: Callable[[ModelConfig], nn.Module]
    block: Callable[[ModelConfig, int], nn.Module]  # (config, ffn_hidden_size)
    final_norm: Callable[[ModelConfig], nn.Module]
    memory_counts: Callable[[ModelConfig, int], dict]  # (config, ffn_hidden_size): see engine.training.memory


FAMILIES = {
    "gpt2": Family("gpt2", gpt2.Embedding, gpt2.Block, gpt2.final_norm, gpt2.memory_counts),
    "llama": Family("llama", llama.Embedding, llama.Block, llama.final_norm, llama.memory_counts),
}


def family_of(cfg: ModelConfig) -> Family:
    """The :class:`Family` of ``cfg.family`` (``gpt2`` when the field is absent).

    Raises:
        ValueError: an unknown family name."""
    name = getattr(cfg, "family", "gpt2")
    if name not in FAMILIES:
        raise ValueError(f"model.family={name!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[name]
