"""``model.init_from: DIR``: a Hugging Face model folder (``config.json`` + ``model.safetensors``, as
``transformers``' ``save_pretrained`` writes it) sets the architecture fields of a config and starts its weights.

:func:`model_fields` maps ``config.json`` onto ``model.*`` fields through the family whose
:class:`~engine.training.models.registry.HuggingFace` entry has its ``model_type`` (options the family cannot
reproduce are refused, naming the ``config.json`` key); :func:`resolve_init_from` fills them into a config (a YAML
value that disagrees is an error naming both; :func:`engine.training.config.load_config` calls it);
:func:`check_init_from` is the validation step.  The weights are read on the ranks
(:func:`engine.training.checkpoint.hf.load_hf_weights`, through :func:`weight_files`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..models import family_names, get_family
from .errors import ConfigError
from .schema import TrainConfig

__all__ = ["ARCHITECTURE_FIELDS", "read_hf_config", "model_fields", "resolve_init_from", "check_init_from",
           "weight_files"]

ARCHITECTURE_FIELDS = ("family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                       "ffn_hidden_size", "vocab_size", "norm_epsilon", "rope_theta", "max_position_embeddings",
                       "tie_embeddings", "activation")
"""The ``model.*`` fields a Hugging Face ``config.json`` may set (a family sets those its architecture has)."""


def read_hf_config(folder: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of ``folder``.

    Raises:
        ConfigError: no such folder, no ``config.json``, or not JSON (naming ``model.init_from``)."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise ConfigError(f"model.init_from={str(folder)!r} is not a folder; pass a Hugging Face model folder "
                          f"(config.json + model.safetensors, e.g. written by save_pretrained or pipecast export "
                          f"--format hf)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"model.init_from={str(folder)!r} has no config.json; pass a Hugging Face model "
                          f"folder") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.init_from: {str(path)!r} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.init_from: {str(path)!r} holds {type(data).__name__}, not a JSON object")
    return data


def model_fields(hf: dict, where: str = "config.json") -> dict:
    """``model.*`` field values (:data:`ARCHITECTURE_FIELDS`) of a Hugging Face ``config.json``: ``family`` is the
    registered family with its ``model_type``, the others come from that family's
    :attr:`~engine.training.models.registry.HuggingFace.fields` (missing keys take ``transformers``' defaults).

    Raises:
        ConfigError: a ``model_type`` no family reads, other ``architectures``, or an option the family cannot
            reproduce (naming the ``config.json`` key)."""
    model_type = hf.get("model_type")
    readers = [get_family(n) for n in family_names() if get_family(n).hf is not None]
    family = next((f for f in readers if f.hf.model_type == model_type), None)
    if family is None:
        known = " and ".join(f"{f.hf.model_type!r} ({f.hf.architectures[0]})" for f in readers)
        raise ConfigError(f"model.init_from: {where} has model_type={model_type!r}; pipecast reads {known} folders")
    archs = hf.get("architectures") or []
    bad = [a for a in archs if a not in family.hf.architectures]
    if bad:
        raise ConfigError(f"model.init_from: {where} has architectures={archs!r}; pipecast reads "
                          f"{' / '.join(family.hf.architectures)} weights for model_type={model_type!r}")
    try:
        fields = family.hf.fields(hf)
    except ValueError as exc:  # registry.unsupported: "key=value, which ... cannot reproduce (why)"
        raise ConfigError(f"model.init_from: {where} has {exc}; use a checkpoint without it") from None
    return {"family": family.name, **fields}


def _same(field: str, a, b, heads: int) -> bool:
    if field == "num_query_groups":
        return (a or heads) == (b or heads)
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and float(a) == float(b)
    return a == b


def resolve_init_from(config: TrainConfig, explicit: Iterable[str] = ()) -> TrainConfig:
    """``config`` with the architecture fields of ``model.init_from``'s ``config.json``; fields named in
    ``explicit`` (given in the YAML or as overrides) must already agree.

    Raises:
        ConfigError: a disagreeing field (naming the YAML value and the ``config.json`` value), or what
            :func:`model_fields` / :func:`read_hf_config` raise."""
    m = config.model
    where = str(Path(m.init_from) / "config.json")
    fields = model_fields(read_hf_config(m.init_from), where)
    explicit = set(explicit)
    heads = fields["num_attention_heads"]
    for name, value in fields.items():
        if name in explicit and not _same(name, getattr(m, name), value, heads):
            raise ConfigError(f"model.{name}={getattr(m, name)!r} disagrees with model.init_from's {where} "
                              f"({name} = {value!r}); remove model.{name} from the config (it comes from "
                              f"config.json) or set it to {value!r}")
    return dataclasses.replace(config, model=dataclasses.replace(m, **fields))


def check_init_from(config: TrainConfig) -> None:
    """Validation of ``model.init_from`` (part of ``validate``): every architecture field equals the folder's
    (:func:`resolve_init_from` with all fields explicit), the weights file exists, and the data's tokens mean
    what the checkpoint's vocabulary means.

    Raises:
        ConfigError: naming the field, both values and the fix."""
    resolve_init_from(config, ARCHITECTURE_FIELDS)
    folder, d = Path(config.model.init_from), config.data
    weight_files(folder)
    if d.source != "bin" and d.tokenizer == "bpe":
        raise ConfigError(f"model.init_from={str(folder)!r} with data.tokenizer='bpe': pipecast would train its "
                          f"own BPE, whose token ids do not match the checkpoint's vocabulary; tokenize the text "
                          f"with the checkpoint's tokenizer into .bin files (data.source=bin)")
    has_tokenizer = any((folder / n).is_file() for n in ("tokenizer.json", "vocab.json", "tokenizer.model"))
    if d.source != "bin" and has_tokenizer:
        raise ConfigError(f"model.init_from={str(folder)!r} comes with a tokenizer (vocabulary of "
                          f"{config.model.vocab_size} tokens) but data.tokenizer='bytes' feeds byte ids 0..255, "
                          f"which mean other tokens there; tokenize the text with that tokenizer into .bin files "
                          f"(data.source=bin)")


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the ``.safetensors`` file holding it (one file, or a sharded index).

    Raises:
        ConfigError: no ``model.safetensors`` and no readable ``model.safetensors.index.json``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: Any = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"model.init_from: {str(index)!r} is not a safetensors index ({exc})") from None
        return {k: folder / v for k, v in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"model.init_from={str(folder)!r} has no model.safetensors (nor a sharded "
                          f"model.safetensors.index.json); pipecast reads safetensors weights only -- save the "
                          f"model with save_pretrained(..., safe_serialization=True)")
    from safetensors import safe_open
    with safe_open(str(single), framework="pt") as fh:
        return {k: single for k in fh.keys()}
