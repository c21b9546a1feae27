"""Hugging Face checkpoints out and in: ``config.json`` + ``model.safetensors`` folders (the layout
``transformers``' ``save_pretrained`` writes and ``from_pretrained`` reads) of any family whose registry entry gives
Hugging Face names (:class:`engine.training.models.registry.HuggingFace`).

Out (``pipecast export CHECKPOINT --format hf --out DIR``, :func:`write_hf_folder`): ``config.json`` written here
(no ``transformers`` needed; the family's keys plus the common ones), the weights renamed by the family's rules
(transposed where it stores ``[in, out]``), and for BPE runs ``tokenizer.json`` + ``tokenizer_config.json``.  In
(``model.init_from: DIR``): the config side is :mod:`engine.training.config.init_from`; :func:`load_hf_weights`
reads the tensors a rank's model chunks hold (``safe_open``: only those).

Names are pipecast's layout-independent ones (:func:`engine.training.models.chunk.canonical_module`); a tied head is
not written (as ``save_pretrained``) and reads the word embedding.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

from ..config import ConfigError, ModelConfig
from ..config.init_from import BUFFERS, weight_files
from ..files import write_folder
from ..models import HuggingFace, get_family
from ..models.chunk import canonical_names

__all__ = ["hf_config", "to_hf_tensors", "load_hf_weights", "write_hf_folder", "hf_tensor_names"]



def _hf(family: str) -> HuggingFace:
    """The Hugging Face entry of ``family``.

    Raises:
        ConfigError: the family gives none."""
    spec = get_family(family)
    if spec.hf is None:
        raise ConfigError(f"model.family={family} has no Hugging Face names (its FamilySpec gives no hf), so it "
                          f"cannot be exported to or initialised from a Hugging Face folder")
    return spec.hf


def _hf_name(hf: HuggingFace, name: str) -> tuple[str, bool]:
    for pattern, target, transposed in hf.rules:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, target, name), transposed
    raise KeyError(f"pipecast parameter {name!r} has no Hugging Face name in the {hf.model_type} mapping")


def hf_tensor_names(family: str, names: Iterable[str]) -> dict[str, str]:
    """pipecast name -> Hugging Face name for ``names`` (layout-independent checkpoint names)."""
    hf = _hf(family)
    return {n: _hf_name(hf, n)[0] for n in names}


def to_hf_tensors(family: str, state: dict) -> dict:
    """pipecast state dict (layout-independent names) -> Hugging Face tensors (contiguous; the family's
    ``[in, out]`` weights transposed)."""
    hf, out = _hf(family), {}
    for name, tensor in state.items():
        target, transposed = _hf_name(hf, name)
        out[target] = (tensor.t() if transposed else tensor).contiguous()
    return out


def hf_config(cfg: ModelConfig, ffn_hidden_size: int, dtype: str = "float32") -> dict:
    """The ``config.json`` of ``cfg`` for ``transformers``: the family's architecture and keys
    (:attr:`~engine.training.models.registry.HuggingFace.config`) and the common ones.

    Raises:
        ConfigError: the family has no Hugging Face names."""
    hf = _hf(cfg.family)
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype,
              "initializer_range": cfg.init_std, "bos_token_id": None, "eos_token_id": None, "use_cache": True}
    return {"architectures": [hf.architectures[0]], "model_type": hf.model_type,
            **hf.config(cfg, ffn_hidden_size), **common}


def write_hf_folder(out: str | os.PathLike, cfg: ModelConfig, ffn_hidden_size: int, state: dict,
                    dtype: str = "float32", tokenizer_json: str | None = None, overwrite: bool = False) -> list[Path]:
    """Write ``config.json``, ``model.safetensors`` (and, given ``tokenizer_json``, ``tokenizer.json`` +
    ``tokenizer_config.json``) as the content of folder ``out`` (:func:`engine.training.files.write_folder`: a
    folder that holds files is refused unless ``overwrite``, then replaced whole once every file is complete, so no
    stale file of an earlier export stays beside the new ones).  Returns the paths written.

    Raises:
        ValueError: the parent folder of ``out`` does not exist, ``out`` is a file, or ``out`` holds files and
            ``overwrite`` is false.
        WriteError: a file or ``out`` could not be written (read-only or full disk, no permission), naming it and
            the operating system's reason; ``out`` is left as it was.
        ConfigError: the family has no Hugging Face names."""
    import torch
    from safetensors.torch import save_file
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out={str(out)!r} is a file; --format hf writes a folder (config.json, "
                         f"model.safetensors): pass a folder path")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    config = hf_config(cfg, ffn_hidden_size, dtype)  # first: it refuses what the architecture cannot express
    tensors = {k: v.detach().to(torch_dtype).contiguous() for k, v in to_hf_tensors(cfg.family, state).items()}
    writes = [("model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"})),
              ("config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))]
    if tokenizer_json is not None:
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_length}
        writes += [("tokenizer.json", lambda p: p.write_text(tokenizer_json)),
                   ("tokenizer_config.json", lambda p: p.write_text(json.dumps(tok_config, indent=2) + "\n"))]
    return write_folder(out, writes, overwrite=overwrite)


def load_hf_weights(folder: str | os.PathLike, cfg: ModelConfig, names: Iterable[str]) -> dict:
    """The tensors of pipecast parameters ``names`` (layout-independent names; ``[in, out]`` weights transposed
    back), read from ``folder``'s safetensors; a tied head reads the word embedding.

    Raises:
        ConfigError: a tensor missing from the files, or tensors in the files that no parameter takes (e.g.
            biases the config did not announce) -- naming them."""
    from safetensors import safe_open
    folder = Path(folder)
    files, hf = weight_files(folder), _hf(cfg.family)
    prefix = hf.prefix
    stored = {(k if k.startswith(prefix) or k == "lm_head.weight" else prefix + k): k for k in files}
    known = {_hf_name(hf, n)[0] for n in canonical_names(cfg, cfg.ffn_hidden_size or 4 * cfg.hidden_size)}
    extra = sorted(k for full, k in stored.items() if full not in known and not BUFFERS.match(k)
                   and not (full == "lm_head.weight" and cfg.tie_embeddings))
    if extra:
        raise ConfigError(f"model.init_from={str(folder)!r}: tensors {extra[:4]} (of {len(extra)}) have no place "
                          f"in pipecast's {cfg.family} model; its config.json does not describe these weights")
    out, handles = {}, {}
    try:
        for name in names:
            target, transposed = _hf_name(hf, name)
            key = stored.get(target)
            if key is None:
                raise ConfigError(f"model.init_from={str(folder)!r}: tensor {target!r} (pipecast {name!r}) is missing "
                                  f"from its safetensors files")
            path = files[key]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt").__enter__()
            tensor = handles[path].get_tensor(key)
            out[name] = tensor.t().contiguous() if transposed else tensor
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return out
