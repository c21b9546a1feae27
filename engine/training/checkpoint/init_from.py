"""``model.init_from``'s tensors against the model the config describes, before any rank starts.

Separate from :mod:`engine.training.checkpoint.hf` (whose header and ``config.json`` checks run inside the config's
validation) because it builds the model, whose package imports the config: ``pipecast train`` and ``pipecast tune``
call :func:`check_init_weights` beside the data check.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config.errors import ConfigError
from ..models.chunk import build_model_chunks, canonical_module
from .hf import _AGAIN, _BUFFERS, _hf_name, _stored_names, _weight_files

if TYPE_CHECKING:
    from ..config import ModelConfig, TrainConfig

__all__ = ["check_init_weights"]


def _expected_tensors(cfg: ModelConfig, ffn_hidden_size: int) -> dict[str, tuple[str, tuple]]:
    """Hugging Face name -> (pipecast name, shape as stored) of every tensor ``cfg``'s model takes: its parameters
    built on the meta device (no memory, no initialisation), gpt2's ``Conv1D`` weights transposed."""
    with torch.device("meta"):
        chunks = build_model_chunks(cfg, ffn_hidden_size, 1, 0, 1, 0, device="meta")
    out = {}
    for name, param in canonical_module(chunks).named_parameters():
        hf, transposed = _hf_name(cfg.family, name)
        out[hf] = (name, tuple(param.shape)[::-1] if transposed else tuple(param.shape))
    return out


def check_init_weights(config: TrainConfig) -> None:
    """``model.init_from``'s tensors against the model the config describes, before any rank starts (``pipecast
    train`` and ``tune`` call it after :func:`~engine.training.checkpoint.hf.check_init_from`): every tensor the model takes is in the folder's
    files with its shape, and no other tensor is there (old checkpoints' attention-mask buffers aside; a tied model
    may carry ``lm_head.weight``).  Nothing without ``model.init_from``.

    Raises:
        ConfigError: naming the folder or file, the tensors, both shapes and the fix."""
    if not config.model.init_from:
        return
    folder, cfg = Path(config.model.init_from), config.model
    files, headers = _weight_files(folder)
    stored = _stored_names(cfg, files)
    expected = _expected_tensors(cfg, config.ffn_hidden_size)
    extra = sorted(k for full, k in stored.items() if full not in expected and not _BUFFERS.match(k)
                   and not (full == "lm_head.weight" and cfg.tie_embeddings))
    if extra:
        raise ConfigError(f"model.init_from={str(folder)!r}: tensors {extra[:4]} (of {len(extra)}) have no place "
                          f"in pipecast's {cfg.family} model; its config.json does not describe these weights")
    missing = [hf for hf in expected if hf not in stored]
    if missing:
        raise ConfigError(f"model.init_from={str(folder)!r}: tensors {missing[:4]} (of {len(missing)}) are missing "
                          f"from its safetensors files; {_AGAIN}")
    for hf, (name, shape) in expected.items():
        key = stored[hf]
        entry, where = headers[files[key]][key], f"model.init_from: {str(files[key])!r}: tensor {key!r}"
        if tuple(entry["shape"]) != shape:
            raise ConfigError(f"{where} has shape {list(entry['shape'])}, but config.json's model needs "
                              f"{list(shape)} (pipecast {name!r}); the weights and config.json are of different "
                              f"models -- {_AGAIN}")
