"""Hugging Face checkpoints in and out: ``config.json`` + ``model.safetensors`` folders of ``GPT2LMHeadModel`` and
``LlamaForCausalLM`` (the layout ``transformers``' ``save_pretrained`` writes and ``from_pretrained`` reads).

Out (``pipecast export CHECKPOINT --format hf --out DIR``, :func:`write_hf_folder`): ``config.json`` written here
(no ``transformers`` needed), the weights renamed (gpt2: ``Conv1D`` weights transposed, ``[in, out]``), and for BPE
runs ``tokenizer.json`` + ``tokenizer_config.json``.  In (``model.init_from: DIR``): :func:`model_fields` maps
``config.json`` onto ``model.*`` fields (options pipecast's model cannot reproduce are refused, naming the
``config.json`` key), :func:`resolve_init_from` fills them into a config (a YAML value that disagrees is an error
naming both), :func:`load_hf_weights` reads the tensors a rank's model chunks hold (``safe_open``: only those).

Name mapping (pipecast's layout-independent names, :func:`engine.training.models.chunk.canonical_module`):

* gpt2: ``embedding.word`` -> ``transformer.wte``, ``embedding.pos`` -> ``transformer.wpe``, ``layers.<i>.ln1 / qkv
  / proj / ln2 / fc1 / fc2`` -> ``transformer.h.<i>.ln_1 / attn.c_attn / attn.c_proj / ln_2 / mlp.c_fc /
  mlp.c_proj``, ``final_norm`` -> ``transformer.ln_f``;
* llama: ``embedding.word`` -> ``model.embed_tokens``, ``layers.<i>.*`` -> ``model.layers.<i>.*`` (the same module
  names), ``final_norm`` -> ``model.norm``;
* untied head: ``output_head.word.weight`` -> ``lm_head.weight`` (tied: not written, as ``save_pretrained``).

Sources: ``transformers`` ``models/gpt2/modeling_gpt2.py`` and ``models/llama/modeling_llama.py`` (module names,
``Conv1D`` layout, rotate-half rotary on q / k as stored), their ``configuration_*.py`` (keys and defaults).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..config.errors import ConfigError
from ..files import write_folder

if TYPE_CHECKING:  # annotations only: engine.training.config imports this module to resolve model.init_from
    from ..config import ModelConfig, TrainConfig

__all__ = ["ARCHITECTURE_FIELDS", "hf_config", "to_hf_tensors", "model_fields", "read_hf_config",
           "resolve_init_from", "check_init_from", "load_hf_weights", "write_hf_folder", "hf_tensor_names"]

ARCHITECTURE_FIELDS = ("family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                       "ffn_hidden_size", "vocab_size", "norm_epsilon", "rope_theta", "max_position_embeddings",
                       "tie_embeddings", "activation")
"""The ``model.*`` fields a Hugging Face ``config.json`` sets (``model.init_from``; gpt2 has no rotary embedding
and leaves ``rope_theta`` as it is)."""

# (pipecast name pattern, Hugging Face name, transposed): gpt2's Conv1D stores [in, out]
_GPT2_RULES = (
    (r"embedding\.word\.weight", "transformer.wte.weight", False),
    (r"embedding\.pos\.weight", "transformer.wpe.weight", False),
    (r"layers\.(\d+)\.ln1\.(weight|bias)", r"transformer.h.\1.ln_1.\2", False),
    (r"layers\.(\d+)\.ln2\.(weight|bias)", r"transformer.h.\1.ln_2.\2", False),
    (r"layers\.(\d+)\.qkv\.weight", r"transformer.h.\1.attn.c_attn.weight", True),
    (r"layers\.(\d+)\.qkv\.bias", r"transformer.h.\1.attn.c_attn.bias", False),
    (r"layers\.(\d+)\.proj\.weight", r"transformer.h.\1.attn.c_proj.weight", True),
    (r"layers\.(\d+)\.proj\.bias", r"transformer.h.\1.attn.c_proj.bias", False),
    (r"layers\.(\d+)\.fc1\.weight", r"transformer.h.\1.mlp.c_fc.weight", True),
    (r"layers\.(\d+)\.fc1\.bias", r"transformer.h.\1.mlp.c_fc.bias", False),
    (r"layers\.(\d+)\.fc2\.weight", r"transformer.h.\1.mlp.c_proj.weight", True),
    (r"layers\.(\d+)\.fc2\.bias", r"transformer.h.\1.mlp.c_proj.bias", False),
    (r"final_norm\.(weight|bias)", r"transformer.ln_f.\1", False),
    (r"output_head\.word\.weight", "lm_head.weight", False),
)
_LLAMA_RULES = (
    (r"embedding\.word\.weight", "model.embed_tokens.weight", False),
    (r"layers\.(\d+)\.((?:input_layernorm|post_attention_layernorm)\.weight)", r"model.layers.\1.\2", False),
    (r"layers\.(\d+)\.((?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight)", r"model.layers.\1.\2", False),
    (r"final_norm\.weight", "model.norm.weight", False),
    (r"output_head\.word\.weight", "lm_head.weight", False),
)
_RULES = {"gpt2": _GPT2_RULES, "llama": _LLAMA_RULES}
_PREFIX = {"gpt2": "transformer.", "llama": "model."}  # bare GPT2Model / LlamaModel folders lack it
_ARCHITECTURES = {"gpt2": ("GPT2LMHeadModel", "GPT2Model"), "llama": ("LlamaForCausalLM", "LlamaModel")}
_BUFFERS = re.compile(r".*(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")  # old checkpoints' buffers
_GELU = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def _hf_name(family: str, name: str) -> tuple[str, bool]:
    for pattern, target, transposed in _RULES[family]:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, target, name), transposed
    raise KeyError(f"pipecast parameter {name!r} has no Hugging Face name in the {family} mapping")


def hf_tensor_names(family: str, names: Iterable[str]) -> dict[str, str]:
    """pipecast name -> Hugging Face name for ``names`` (layout-independent checkpoint names)."""
    return {n: _hf_name(family, n)[0] for n in names}


def to_hf_tensors(family: str, state: dict) -> dict:
    """pipecast state dict (layout-independent names) -> Hugging Face tensors (contiguous; gpt2 Conv1D weights
    transposed to ``[in, out]``)."""
    out = {}
    for name, tensor in state.items():
        hf, transposed = _hf_name(family, name)
        out[hf] = (tensor.t() if transposed else tensor).contiguous()
    return out


# ---- config.json out -------------------------------------------------------------------------------------------

def hf_config(cfg: ModelConfig, ffn_hidden_size: int, dtype: str = "float32") -> dict:
    """The ``config.json`` of ``cfg`` for ``transformers`` (``GPT2Config`` / ``LlamaConfig`` keys).

    Raises:
        ValueError: a setting with no Hugging Face equivalent."""
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype,
              "initializer_range": cfg.init_std, "bos_token_id": None, "eos_token_id": None, "use_cache": True}
    positions = cfg.max_position_embeddings or cfg.seq_length
    if cfg.family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": cfg.num_layers,
                "n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads, "n_inner": ffn_hidden_size,
                "n_positions": positions, "n_ctx": positions, "layer_norm_epsilon": cfg.norm_epsilon,
                "activation_function": "gelu_pytorch_tanh" if cfg.activation == "gelu_tanh" else "gelu",
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, **common}
    heads = cfg.num_attention_heads
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "intermediate_size": ffn_hidden_size, "num_attention_heads": heads,
            "num_key_value_heads": cfg.num_query_groups or heads, "head_dim": cfg.hidden_size // heads,
            "hidden_act": "silu", "max_position_embeddings": positions, "rms_norm_eps": cfg.norm_epsilon,
            "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": cfg.dropout, "pretraining_tp": 1, **common}


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
            the operating system's reason; ``out`` is left as it was."""
    import torch
    from safetensors.torch import save_file
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out={str(out)!r} is a file; --format hf writes a folder (config.json, "
                         f"model.safetensors): pass a folder path")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    tensors = {k: v.detach().to(torch_dtype).contiguous() for k, v in to_hf_tensors(cfg.family, state).items()}
    config = hf_config(cfg, ffn_hidden_size, dtype)
    writes = [("model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"})),
              ("config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))]
    if tokenizer_json is not None:
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_length}
        writes += [("tokenizer.json", lambda p: p.write_text(tokenizer_json)),
                   ("tokenizer_config.json", lambda p: p.write_text(json.dumps(tok_config, indent=2) + "\n"))]
    return write_folder(out, writes, overwrite=overwrite)


# ---- config.json in --------------------------------------------------------------------------------------------

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


def _refuse(where: str, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"model.init_from: {where} has {key}={value!r}, which pipecast's model cannot reproduce "
                       f"({why}); use a checkpoint without it")


def _get(hf: dict, key: str, default, where: str, kind: type = int):
    """``hf[key]`` (``default`` when absent or null) checked to be a ``kind`` (int; float accepts ints; bool)."""
    value = hf.get(key)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool)) or (
        kind is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"model.init_from: {where} has {key}={value!r}, not {_KIND[kind]}; the file is damaged or "
                          f"hand-edited -- fix that value or {_AGAIN}")
    return float(value) if kind is float else value


_KIND = {int: "an integer", float: "a number", bool: "true or false"}


def _gpt2_fields(hf: dict, where: str) -> dict:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU:
        raise _refuse(where, "activation_function", act, f"supported: {', '.join(_GELU)}")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if hf.get(key, want) != want:
            raise _refuse(where, key, hf[key], f"pipecast's gpt2 attention has {key}={want}")
    hidden = _get(hf, "n_embd", 768, where)
    return {"family": "gpt2", "num_layers": _get(hf, "n_layer", 12, where), "hidden_size": hidden,
            "num_attention_heads": _get(hf, "n_head", 12, where), "num_query_groups": None,
            "ffn_hidden_size": _get(hf, "n_inner", 0, where) or 4 * hidden,
            "vocab_size": _get(hf, "vocab_size", 50257, where),
            "norm_epsilon": _get(hf, "layer_norm_epsilon", 1e-5, where, float),
            "max_position_embeddings": _get(hf, "n_positions", 1024, where),
            "tie_embeddings": _get(hf, "tie_word_embeddings", True, where, bool), "activation": _GELU[act]}


def _rope_theta(hf: dict, where: str) -> float:
    """``rope_theta`` (transformers 4) or ``rope_parameters.rope_theta`` (5); scaled variants refused."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling or {})):
        if not isinstance(value, dict):
            raise ConfigError(f"model.init_from: {where} has {key}={value!r}, not a JSON object; the file is "
                              f"damaged or hand-edited -- fix that value or {_AGAIN}")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        kind = (value or {}).get("rope_type", (value or {}).get("type", "default"))
        if value and kind != "default":
            raise _refuse(where, key, value, "rotary scaling (YaRN, linear, dynamic, llama3) is not implemented")
    return _get(hf, "rope_theta", _get(params, "rope_theta", 10000.0, where, float), where, float)


def _llama_fields(hf: dict, where: str) -> dict:
    checks = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1),
              ("sliding_window", None), ("use_sliding_window", False))
    for key, want in checks:
        if hf.get(key, want) not in (want,) + ((None,) if key == "pretraining_tp" else ()):
            raise _refuse(where, key, hf[key], f"pipecast's llama has {key}={want}")
    hidden, heads = _get(hf, "hidden_size", 4096, where), _get(hf, "num_attention_heads", 32, where)
    if _get(hf, "head_dim", None, where) not in (None, hidden // max(heads, 1)):
        raise _refuse(where, "head_dim", hf["head_dim"], f"pipecast's head size is hidden_size / "
                      f"num_attention_heads = {hidden // max(heads, 1)}")
    groups = _get(hf, "num_key_value_heads", 0, where) or heads
    return {"family": "llama", "num_layers": _get(hf, "num_hidden_layers", 32, where), "hidden_size": hidden,
            "num_attention_heads": heads, "num_query_groups": None if groups == heads else groups,
            "ffn_hidden_size": _get(hf, "intermediate_size", 11008, where),
            "vocab_size": _get(hf, "vocab_size", 32000, where),
            "norm_epsilon": _get(hf, "rms_norm_eps", 1e-6, where, float), "rope_theta": _rope_theta(hf, where),
            "max_position_embeddings": _get(hf, "max_position_embeddings", 2048, where),
            "tie_embeddings": _get(hf, "tie_word_embeddings", False, where, bool), "activation": "gelu"}


def model_fields(hf: dict, where: str = "config.json") -> dict:
    """``model.*`` field values (:data:`ARCHITECTURE_FIELDS`) of a Hugging Face ``config.json`` (missing keys take
    ``transformers``' defaults).

    Raises:
        ConfigError: another ``model_type`` / ``architectures``, or an option pipecast cannot reproduce (rotary
            scaling, attention / MLP biases in llama, sliding windows, another activation or attention scaling)."""
    family = hf.get("model_type")
    if family not in _RULES:
        raise ConfigError(f"model.init_from: {where} has model_type={family!r}; pipecast reads 'gpt2' "
                          f"(GPT2LMHeadModel) and 'llama' (LlamaForCausalLM) folders")
    archs = hf.get("architectures") or []
    bad = [a for a in archs if a not in _ARCHITECTURES[family]]
    if bad:
        raise ConfigError(f"model.init_from: {where} has architectures={archs!r}; pipecast reads "
                          f"{' / '.join(_ARCHITECTURES[family])} weights for model_type={family!r}")
    return _gpt2_fields(hf, where) if family == "gpt2" else _llama_fields(hf, where)


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

    Every weights file is checked from its header against the file (:func:`_weight_files`, stdlib): a truncated,
    damaged or missing file, or a tensor that is not floating point, is a ``ConfigError`` naming the file (and the
    tensor) and the fix.  The tensors against the model: :func:`engine.training.checkpoint.init_from.check_init_weights`
    (it builds the model, whose package imports the config: the launchers call it beside the data check).

    Raises:
        ConfigError: naming the field or file, both values and the fix."""
    resolve_init_from(config, ARCHITECTURE_FIELDS)
    folder, d = Path(config.model.init_from), config.data
    _weight_files(folder)
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


# ---- weights in ------------------------------------------------------------------------------------------------

_AGAIN = "copy, download or export (pipecast export --format hf) the folder again"
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}  # safetensors' dtypes (its format spec)


def _weight_files(folder: Path) -> tuple[dict[str, Path], dict[Path, dict]]:
    """``({Hugging Face tensor name: the .safetensors file holding it}, {file: its header entries})`` of one
    file or a sharded index; every file's header read and checked (:func:`_safetensors_header`).

    Raises:
        ConfigError: no weights file, an unreadable index, or a file the header check refuses (naming it)."""
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
        weight_map = json.loads(index.read_text())["weight_map"]
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
    header whole, each entry's bytes ``prod(shape) x itemsize``, and the file exactly as long as the data the
    header describes (a truncated copy is shorter).  The format: github.com/huggingface/safetensors (README).

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
    ints = [k for k, e in entries.items() if not e["dtype"].startswith(("F", "BF")) and not _BUFFERS.match(k)]
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


def _stored_names(cfg: ModelConfig, files: dict) -> dict[str, str]:
    """Hugging Face name with its model prefix -> the name stored in ``files`` (bare ``GPT2Model`` /
    ``LlamaModel`` folders lack the prefix)."""
    prefix = _PREFIX[cfg.family]
    return {(k if k.startswith(prefix) or k == "lm_head.weight" else prefix + k): k for k in files}


def load_hf_weights(folder: str | os.PathLike, cfg: ModelConfig, names: Iterable[str]) -> dict:
    """The tensors of pipecast parameters ``names`` (layout-independent names; gpt2 Conv1D weights transposed
    back), read from ``folder``'s safetensors; a tied head reads the word embedding.  :func:`check_init_from`
    (part of the config's validation) checked the files against the model before.

    Raises:
        ConfigError: a damaged file (:func:`_weight_files`) or a tensor missing from the files."""
    from safetensors import safe_open
    folder = Path(folder)
    files, _ = _weight_files(folder)
    stored = _stored_names(cfg, files)
    out, handles = {}, {}
    try:
        for name in names:
            hf, transposed = _hf_name(cfg.family, name)
            key = stored.get(hf)
            if key is None:
                raise ConfigError(f"model.init_from={str(folder)!r}: tensor {hf!r} (pipecast {name!r}) is missing "
                                  f"from its safetensors files; {_AGAIN}")
            path = files[key]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt").__enter__()
            tensor = handles[path].get_tensor(key)
            out[name] = tensor.t().contiguous() if transposed else tensor
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return out
