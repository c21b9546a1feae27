"""Model families of the training recipe (``model.family``) and the model chunks built from them.

A family is one :class:`FamilySpec` in the registry (:mod:`.registry`): its embedding, block and final norm
builders, the block's tensor-parallel plan, its checks, its Hugging Face names and ``config.json``, its ``--help``
line.  :class:`engine.training.models.chunk.ModelChunk` assembles a family's modules into pipeline model chunks;
the chunk protocol, the output head and tied embeddings are shared by every family.

A new family is one module that builds its modules and calls :func:`register_family` at import (as
``tests/training/models/tiny_family.py`` does); one inside this package also gets an import line below.  The
built-in ones, :mod:`.gpt2`, :mod:`.llama` and :mod:`.llama_moe`, keep their torch modules in a ``layers`` module
beside their entry, because a config is loaded (and its family checked) before torch is imported.
"""
from __future__ import annotations

from .registry import FamilySpec, HuggingFace, family_names, get_family, hf_value, register_family, unsupported
from . import gpt2, llama, llama_moe  # noqa: F401 - the built-in families register at import

__all__ = ["FamilySpec", "HuggingFace", "register_family", "get_family", "family_names", "unsupported", "hf_value",
           "DEFAULT_FAMILY"]

DEFAULT_FAMILY = gpt2.SPEC.name
"""``model.family`` when a config does not set it."""
