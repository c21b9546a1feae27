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
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..models import family_names, get_family
from .errors import ConfigError
from .schema import TrainConfig

__all__ = ["ARCHITECTURE_FIELDS", "read_hf_config", "model_fields", "resolve_init_from", "check_init_from",
           "weight_files", "weight_headers", "BUFFERS"]

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
    except ValueError as exc:  # registry.unsupported / hf_value: "key=value, ... (why); the fix"
        raise ConfigError(f"model.init_from: {where} has {exc}") from None
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
    given_moe = explicit.get("moe") if isinstance(explicit, dict) else None  # the raw section: its keys were given
    explicit = set(explicit)
    heads = fields["num_attention_heads"]
    moe = fields.pop("moe", None)
    for name, value in fields.items():
        if name in explicit and not _same(name, getattr(m, name), value, heads):
            raise ConfigError(f"model.{name}={getattr(m, name)!r} disagrees with model.init_from's {where} "
                              f"({name} = {value!r}); remove model.{name} from the config (it comes from "
                              f"config.json) or set it to {value!r}")
    if moe is not None:
        fields["moe"] = _moe_section(m.moe if "moe" in explicit else None, moe, where,
                                     set(given_moe) if isinstance(given_moe, dict) else set())
    return dataclasses.replace(config, model=dataclasses.replace(m, **fields))


def _moe_section(given, hf_moe: dict, where: str, named: set):
    """``model.moe`` from a family's ``moe`` fields of ``config.json`` (``hf_moe``): those fields over the
    config's own section when it has one, whose ``named`` keys (given in the YAML or as overrides) must agree
    (``aux_loss_coeff``, a training weight, stays the config's when named).

    Raises:
        ConfigError: a ``model.moe`` field that disagrees with ``config.json``."""
    from .schema import MoEConfig
    if given is None:
        return MoEConfig(**hf_moe)
    taken = {k: v for k, v in hf_moe.items() if not (k == "aux_loss_coeff" and k in named)}
    for key, value in taken.items():
        if key in named and not _same(key, getattr(given, key), value, 0):
            raise ConfigError(f"model.moe.{key}={getattr(given, key)!r} disagrees with model.init_from's {where} "
                              f"({key} = {value!r}); remove it from model.moe (it comes from config.json) or set "
                              f"it to {value!r}")
    return dataclasses.replace(given, **taken)


def check_init_from(config: TrainConfig) -> None:
    """Validation of ``model.init_from`` (part of ``validate``): every architecture field equals the folder's
    (:func:`resolve_init_from` with all fields explicit), every weights file is whole (its header checked against
    the file, :func:`weight_headers`: a truncated, damaged or missing file, or a tensor that is not floating point,
    is refused naming it), and the data's tokens mean what the checkpoint's vocabulary means.  The tensors against
    the model: :func:`engine.training.checkpoint.init_from.check_init_weights` (the launchers call it beside the
    data check: it builds the model's parts).

    Raises:
        ConfigError: naming the field or file, both values and the fix."""
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
    """Hugging Face tensor name -> the ``.safetensors`` file holding it (one file, or a sharded index), every
    file's header checked (:func:`weight_headers`).

    Raises:
        ConfigError: as :func:`weight_headers`."""
    return weight_headers(folder)[0]


_AGAIN = "copy, download or export (pipecast export --format hf) the folder again"
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}  # safetensors' dtypes (its format spec)
BUFFERS = re.compile(r".*(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")
"""Names of old checkpoints' buffers (attention masks, rotary frequencies): no parameter takes them."""


def weight_headers(folder: Path) -> tuple[dict[str, Path], dict[Path, dict]]:
    """``({Hugging Face tensor name: the .safetensors file holding it}, {file: its header entries})`` of one file
    or a sharded index, every file's header read and checked against the file (:func:`_safetensors_header`).

    Raises:
        ConfigError: no weights file, an unreadable index or one naming a file that lacks the tensor, or a file the
            header check refuses -- naming it and the fix."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        single = folder / "model.safetensors"
        if not single.is_file():
            raise ConfigError(f"model.init_from={str(folder)!r} has no model.safetensors (nor a sharded "
                              f"model.safetensors.index.json); pipecast reads safetensors weights only -- save "
                              f"the model with save_pretrained(..., safe_serialization=True)")
        header = _safetensors_header(single)
        return {k: single for k in header}, {single: header}
    try:
        weight_map: Any = json.loads(index.read_text())["weight_map"]
        files = {str(k): folder / str(v) for k, v in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"model.init_from: {str(index)!r} is not a safetensors index ({exc}); {_AGAIN}") from None
    headers = {path: _safetensors_header(path) for path in sorted(set(files.values()))}
    for name, path in files.items():
        if name not in headers[path]:
            raise ConfigError(f"model.init_from: {str(index)!r} places tensor {name!r} in {str(path)!r}, which "
                              f"does not hold it; {_AGAIN}")
    return files, headers


def _safetensors_header(path: Path) -> dict:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}`` from the header of the safetensors file ``path``
    (stdlib: an 8-byte little-endian header size, the JSON header, then the data), checked against the file: the
    header whole, each entry's bytes ``prod(shape) x itemsize``, floating-point weights, and the file exactly as
    long as the data the header describes (a truncated copy is shorter).  The format:
    github.com/huggingface/safetensors (README).

    Raises:
        ConfigError: naming the file, what is wrong and the fix."""
    where = f"model.init_from: {str(path)!r}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = json.loads(fh.read(length).decode("utf-8")) if 2 <= length <= size - 8 else None
    except FileNotFoundError:
        raise ConfigError(f"{where} is missing; {_AGAIN}") from None
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror or exc}; check the file's permissions") from None
    except ValueError as exc:  # not JSON / not UTF-8
        raise ConfigError(f"{where} has a damaged header ({exc}); {_AGAIN}") from None
    if header is None:
        raise ConfigError(f"{where} is not a whole safetensors file ({size:,} bytes, no complete header); {_AGAIN}")
    if not isinstance(header, dict):
        raise ConfigError(f"{where} has a damaged header (a JSON {type(header).__name__}); {_AGAIN}")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((_entry_end(where, name, e) for name, e in entries.items()), default=0)
    ints = [k for k, e in entries.items() if not e["dtype"].startswith(("F", "BF")) and not BUFFERS.match(k)]
    if ints:
        raise ConfigError(f"{where}: tensor {ints[0]!r} is {entries[ints[0]]['dtype']}, not floating point; model "
                          f"weights are F32 / F16 / BF16 -- {_AGAIN}")
    if size != 8 + length + end:
        state = "truncated" if size < 8 + length + end else "damaged (longer than its header describes)"
        raise ConfigError(f"{where} is {state}: {size:,} bytes, its header describes {8 + length + end:,}; "
                          f"{_AGAIN}")
    return entries


def _entry_end(where: str, name: str, entry) -> int:
    """The end offset of one header entry's bytes, after checking that they hold ``prod(shape)`` elements."""
    try:
        start, end = (int(x) for x in entry["data_offsets"])
        count = math.prod(int(x) for x in entry["shape"])
        itemsize = _ITEMSIZE[entry["dtype"]]
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{where} has a damaged header entry for tensor {name!r} ({entry!r}); {_AGAIN}") from None
    if not 0 <= start <= end or end - start != count * itemsize:
        raise ConfigError(f"{where}: tensor {name!r} has {end - start:,} bytes for shape {entry['shape']} of "
                          f"{entry['dtype']}; the header is damaged -- {_AGAIN}")
    return end
