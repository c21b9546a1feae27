"""``model.init_from``'s tensors against the model the config describes, before any rank starts.

The config's validation checks the folder's ``config.json`` and each weights file's header against the file
(:func:`engine.training.config.init_from.check_init_from`); this builds the model's parts (meta device) to compare
every tensor with the parameter that takes it, so ``pipecast train`` and ``pipecast tune`` call
:func:`check_init_weights` beside the data check.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..config.errors import ConfigError
from ..config.init_from import _AGAIN, BUFFERS, weight_headers
from ..models.chunk import canonical_shapes
from .hf import _hf, _hf_name

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["check_init_weights"]


def check_init_weights(config: TrainConfig) -> None:
    """Every tensor the model of ``config`` takes is in ``model.init_from``'s files with its shape (as stored: the
    family's ``[in, out]`` weights transposed), and no other tensor is there (old checkpoints' buffers aside; a tied
    model may carry ``lm_head.weight``).  Nothing without ``model.init_from``.

    Raises:
        ConfigError: naming the folder or file, the tensors, both shapes and the fix."""
    if not config.model.init_from:
        return
    folder, cfg, hf = Path(config.model.init_from), config.model, _hf(config.model.family)
    files, headers = weight_headers(folder)
    stored = {(k if k.startswith(hf.prefix) or k == "lm_head.weight" else hf.prefix + k): k for k in files}
    expected = {}
    for name, shape in canonical_shapes(cfg, config.ffn_hidden_size).items():
        target, transposed = _hf_name(hf, name)
        expected[target] = (name, shape[::-1] if transposed else shape)
    extra = sorted(k for full, k in stored.items() if full not in expected and not BUFFERS.match(k)
                   and not (full == "lm_head.weight" and cfg.tie_embeddings))
    if extra:
        raise ConfigError(f"model.init_from={str(folder)!r}: tensors {extra[:4]} (of {len(extra)}) have no place "
                          f"in pipecast's {cfg.family} model; its config.json does not describe these weights")
    missing = [target for target in expected if target not in stored]
    if missing:
        raise ConfigError(f"model.init_from={str(folder)!r}: tensors {missing[:4]} (of {len(missing)}) are missing "
                          f"from its safetensors files; {_AGAIN}")
    for target, (name, shape) in expected.items():
        key = stored[target]
        entry = headers[files[key]][key]
        if tuple(entry["shape"]) != shape:
            raise ConfigError(f"model.init_from: {str(files[key])!r}: tensor {key!r} has shape {list(entry['shape'])}"
                              f", but config.json's model needs {list(shape)} (pipecast {name!r}); the weights and "
                              f"config.json are of different models -- {_AGAIN}")
