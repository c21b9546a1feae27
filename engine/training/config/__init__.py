"""Typed training configuration: YAML is storage, these dataclasses are the source of truth.

``load_config(path, overrides)`` reads a YAML file with a safe loader (:class:`ConfigLoader`: ``yaml.SafeLoader``
that also reads exponent floats such as ``1e-3`` as floats and rejects duplicate keys), applies ``section.key=value``
overrides (values parsed as YAML scalars by the same loader), checks every key and type against the dataclasses
below and validates the whole run (:func:`validate`) before any process group exists.  Every error is a :class:`ConfigError` (a ``ValueError``)
or ``TypeError`` that names the field, the value and the fix.

Sections: ``model``, ``parallel``, ``data``, ``optimizer``, ``training``, ``checkpoint``, ``logging``,
``cuda_graphs``, ``profile``.  ``docs/config`` in the README lists every field; the defaults here are the
reference.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from ...plan.registry import auto_schedule, config_choices, get_schedule, schedule_names, virtual_or_none
from ...plan.resolve import ResolvedSchedule, resolve_schedule
from ...plan.table import validate_interleaved_microbatches
from ...plan.types import placement_of
from .ranges import MAX_STEPS, RANGES, check_ranges  # noqa: F401 - MAX_STEPS, RANGES re-exported
from .errors import ConfigError

__all__ = ["ConfigError", "ModelConfig", "ParallelConfig", "DataConfig", "OptimizerConfig", "TrainingConfig",
           "CheckpointConfig", "LoggingConfig", "CudaGraphsConfig", "ProfileConfig", "TrainConfig",
           "load_config", "config_from_dict", "config_to_dict", "apply_overrides", "parse_override_args",
           "validate", "validate_parallel", "validate_tensor_parallel", "validate_plans", "run_plans", "validate_model_family",
           "validate_world_size", "dump_config", "ConfigLoader", "check_fresh_run"]




class ScheduleName(str):
    """The type of ``parallel.schedule``: ``auto``, a schedule of the registry (:mod:`engine.plan.registry`,
    including schedules registered before the config is loaded) or ``tuned``."""


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no Python objects are ever constructed) with two changes for config files:

    * exponent floats without a dot (``1e-3``, ``3E-4``, ``1e+5``) are floats, as in YAML 1.2 and Python; PyYAML's
      YAML 1.1 resolver reads them as strings;
    * a key given twice in one mapping is an error naming the key and its line (PyYAML keeps the last silently).
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key: SafeLoader reports it below
                    continue
                if first is not None:
                    raise ConfigError(f"duplicate key {key!r} on line {key_node.start_mark.line + 1} (first given "
                                      f"on line {first}); remove one of them")
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _yaml_load(text: str):
    """Parse YAML text with :class:`ConfigLoader` (safe: plain data only)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - ConfigLoader is a SafeLoader


@dataclass
class ModelConfig:
    """Decoder-only transformer of one ``family``: ``gpt2`` (learned positions, LayerNorm, GELU MLP, biases) or
    ``llama`` (rotary embeddings, RMSNorm, SwiGLU MLP, grouped-query attention, no biases).  Shapes: activations
    between pipeline stages are ``[seq_length, micro_batch_size, hidden_size]`` (Megatron's ``[s, b, h]``).
    ``init_from``: a Hugging Face model folder whose ``config.json`` sets the architecture fields and whose
    weights start the run (:mod:`engine.training.checkpoint.hf`)."""

    family: Literal["gpt2", "llama"] = "gpt2"
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # None -> 4 * hidden_size
    seq_length: int = 128
    vocab_size: int = 256  # bytes; set to the tokenizer's size for .bin token files
    dropout: float = 0.0
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = True
    transformer_engine: bool = False  # use Transformer Engine layers when importable and on CUDA
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16 = autocast on CUDA; parameters stay fp32
    num_query_groups: int | None = None  # llama: key / value heads (grouped-query attention); None -> heads
    rope_theta: float = 10000.0  # llama: rotary base
    max_position_embeddings: int | None = None  # gpt2: learned position rows; llama: context recorded; None -> seq
    activation: Literal["gelu", "gelu_tanh"] = "gelu"  # gpt2 MLP: exact GELU or its tanh approximation
    init_from: str | None = None  # a Hugging Face folder (config.json + model.safetensors) to start from


@dataclass
class ParallelConfig:
    """Pipeline (``pipeline``) x data (``data``) parallelism; ``virtual`` model chunks per pipeline rank."""

    pipeline: int = 1
    virtual: int = 1  # > 1 selects interleaved 1F1B (with schedule: auto)
    # auto: Megatron's choice from pipeline / virtual; a registered schedule (engine.plan.registry); tuned: the best
    # schedule of the last `pipecast tune` (RUN_DIR/tune.json), resolved by the entry points (tune_result)
    schedule: ScheduleName = "auto"
    max_in_flight: int | None = None  # schedules taking it (zb): per-rank in-flight limit (None: virtual*(P-r))
    data: int | None = None  # None -> world size // (pipeline x tensor) (1 when the launcher spawns ranks)
    tensor: int = 1  # tensor-parallel ranks per stage (engine.training.parallel.tensor_parallel); world = pipeline x data x tensor
    # with tensor > 1: norms, residual stream and stage-boundary messages hold each rank's [s/T, b, h] sequence shard
    sequence_parallel: bool = False
    microbatch_group_size_per_vp_stage: int | None = None  # None -> pipeline (Megatron's default)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: float = 60.0  # communication timeout; a lost peer fails the job after this long
    batch_p2p_comm: bool = True
    overlap_p2p_comm: bool = False
    deallocate_pipeline_outputs: bool = True
    overlap_grad_reduce: bool = True  # start each chunk's data-parallel all-reduce when its last backward ends
    # none: every data-parallel replica holds all optimizer state; optimizer: ZeRO-1 (engine.training.parallel.zero1:
    # gradients reduce-scattered, AdamW state 1/dp per rank, parameters all-gathered after the step); full: FSDP2
    # (engine.training.parallel.fsdp: fully_shard per model chunk, parameters / gradients / AdamW state 1/dp per rank between
    # steps, gathered for the step, one reduce-scatter per chunk after its last W); both run as none at data = 1
    shard: Literal["none", "optimizer", "full"] = "none"


@dataclass
class DataConfig:
    """Training text.  ``source``: ``stdlib`` (this Python's standard library ``.py`` files), ``text`` (files or
    folders in ``paths``) or ``bin`` (token files: nanoGPT's raw uint16 or llm.c's headered uint16 / uint32; a
    folder with ``train.bin`` / ``val.bin``, or one ``.bin`` file that is split).  ``tokenizer`` applies to text
    sources: ``bytes`` (one token per byte) or ``bpe`` (a byte-level BPE of ``model.vocab_size`` tokens trained on
    the training split, cached in ``cache_dir``)."""

    source: Literal["stdlib", "text", "bin"] = "stdlib"
    paths: list[str] = field(default_factory=list)
    suffixes: list[str] = field(default_factory=lambda: [".txt", ".md", ".py", ".rst"])
    val_fraction: float = 0.05
    split_block_bytes: int = 4096  # train/val split granularity (every k-th block goes to validation)
    max_bytes: int | None = None  # cap the corpus size (None: all of it)
    tokenizer: Literal["bytes", "bpe"] = "bytes"
    cache_dir: str | None = None  # BPE tokenizer + tokenized splits; None -> $XDG_CACHE_HOME or ~/.cache, /pipecast


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr``; global grad-norm clipping."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    # stop with an error when the loss or the global grad norm is NaN / inf (Megatron's
    # check_for_nan_in_loss_and_grad, default on); the step is not applied and no checkpoint is written
    check_for_nan_in_loss_and_grad: bool = True


@dataclass
class TrainingConfig:
    """The step: ``num_microbatches`` microbatches of ``micro_batch_size`` sequences per data-parallel rank."""

    steps: int = 100
    micro_batch_size: int = 4
    num_microbatches: int = 4
    eval_interval: int = 50  # 0: evaluate only at the end
    eval_iters: int = 1  # forward-only schedule calls per evaluation
    eval_microbatches: int | None = None  # None -> num_microbatches
    seed: int = 1234
    deterministic: bool = True


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None -> <run_dir>/checkpoints
    interval: int = 0  # 0: only at the end
    keep: int = 2  # completed checkpoints kept (oldest removed)
    save_at_end: bool = True


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    log_interval: int = 1
    progress_bar: bool | Literal["auto"] = "auto"  # tqdm bar on the logging rank; auto: when stderr is a terminal
    level: Literal["DEBUG", "INFO", "WARNING"] = "INFO"
    tensorboard: bool = False  # also write RUN_DIR/tensorboard (pip install -e '.[tensorboard]')
    peak_tflops: float | None = None  # per-GPU peak for MFU; None -> the GPU's known dense bf16 peak
    sample_every_eval: int = 0  # tokens of a sample printed at each evaluation (0: none)


@dataclass
class CudaGraphsConfig:
    enabled: bool = False
    # auto: Transformer Engine when importable, else pipecast's own capture (torch = pipecast); emulate: the CPU
    # backend with static-buffer semantics (for tests); eager: no graphs
    backend: Literal["auto", "te", "torch", "pipecast", "emulate", "eager"] = "auto"
    warmup_steps: int = 2


@dataclass
class ProfileConfig:
    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 2


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cuda_graphs: CudaGraphsConfig = field(default_factory=CudaGraphsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    # ---- derived values -------------------------------------------------------------------------------------
    @property
    def ffn_hidden_size(self) -> int:
        return self.model.ffn_hidden_size or 4 * self.model.hidden_size

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data or 1

    @property
    def world_size(self) -> int:
        return self.parallel.pipeline * self.data_parallel_size * self.parallel.tensor

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.training.micro_batch_size * self.training.num_microbatches * self.data_parallel_size

    @property
    def eval_microbatches(self) -> int:
        return self.training.eval_microbatches or self.training.num_microbatches

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.logging.run_dir) / "checkpoints"

    @property
    def schedule_name(self) -> str:
        """The schedule that runs: ``parallel.schedule``, or for ``auto`` Megatron's choice from
        ``parallel.pipeline`` / ``parallel.virtual`` (:func:`engine.plan.registry.auto_schedule`)."""
        p = self.parallel
        if p.schedule != "auto":
            return p.schedule
        return auto_schedule(p.pipeline, virtual_or_none(p.virtual))

    def resolve_schedule(self) -> ResolvedSchedule:
        """The run's one :class:`~engine.plan.resolve.ResolvedSchedule` (schedule, sizes and options; it gives
        every plan of the run).

        Raises:
            ConfigError: ``parallel.schedule: tuned`` not resolved yet
                (:func:`engine.training.tune.result.resolve_tuned`), or settings the schedule does not take.
        """
        p = self.parallel
        if p.schedule == "tuned":
            raise ConfigError("parallel.schedule=tuned was not resolved: resolve it with "
                              "engine.training.tune.result.resolve_tuned(config), which reads the best schedule from "
                              "RUN_DIR/tune.json (run `pipecast tune CONFIG` first); pipecast train does this")
        try:
            return resolve_schedule(p.schedule, p.pipeline, p.virtual, p.microbatch_group_size_per_vp_stage,
                                    p.max_in_flight)
        except ValueError as exc:
            raise ConfigError(f"parallel.schedule={p.schedule}: {exc}") from None


# ---- typed loading --------------------------------------------------------------------------------------------

def _type_name(tp) -> str:
    if tp is ScheduleName:
        return " | ".join(repr(a) for a in config_choices())
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, where: str):
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats.  Returns the value."""
    if tp is ScheduleName:
        if value not in config_choices():
            raise ConfigError(f"{where}={value!r} is not allowed; use one of {_type_name(tp)}")
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except (TypeError, ConfigError):
                continue
        raise TypeError(f"{where}={value!r} has type {type(value).__name__}; expected {_type_name(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}={value!r} is not allowed; use one of {_type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise TypeError(f"{where}={value!r} has type {type(value).__name__}; expected {_type_name(tp)}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is type(None):
        if value is not None:
            raise TypeError(f"{where}={value!r}: expected null")
        return None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            number = float(value.strip().replace("_", ""))
        except ValueError:
            raise TypeError(f"{where}={value!r} has type str; expected a number such as 0.001 or 1e-3") from None
        if not math.isfinite(number):
            raise ConfigError(f"{where}={value!r} is not a finite number; use a finite value such as 0.001")
        return number
    if tp in (int, float) and isinstance(value, bool) or not isinstance(value, tp):
        raise TypeError(f"{where}={value!r} has type {type(value).__name__}; expected {_type_name(tp)}")
    return value


def _build_section(cls, data: Any, name: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise TypeError(f"config section {name!r} must be a mapping of keys to values, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key {name}.{unknown[0]} (value {data[unknown[0]]!r}); {name} accepts: "
                          f"{', '.join(sorted(known))}")
    return cls(**{k: _coerce(v, hints[k], f"{name}.{k}") for k, v in data.items()})


def config_from_dict(data: dict | None) -> TrainConfig:
    """Build a :class:`TrainConfig` from a nested dict (e.g. parsed YAML), checking keys and types only."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise TypeError(f"a config must be a mapping of sections, got {type(data).__name__}")
    sections = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    if "schedule" in data:
        raise ConfigError(f"config section 'schedule' is now called 'training' ({', '.join(data['schedule'] or [])}): "
                          "rename the section 'schedule:' to 'training:' (overrides: --training.steps=...)")
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ConfigError(f"unknown config section {unknown[0]!r}; sections are: {', '.join(sections)}")
    return TrainConfig(**{k: _build_section(hints[k], v, k) for k, v in data.items()})


def config_to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)


def parse_override_args(args: list[str]) -> list[str]:
    """``["--model.num_layers=8", "--training.steps", "10"]`` -> ``["model.num_layers=8", "training.steps=10"]``.

    Raises:
        ConfigError: an argument that is not ``--section.key=value`` (or ``--section.key value``).
    """
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unrecognized argument {arg!r}; overrides look like --section.key=value "
                              f"(e.g. --training.steps=50)")
        if "=" in arg:
            out.append(arg[2:])
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append(f"{arg[2:]}={args[i + 1]}")
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value; write {arg}=VALUE")
        i += 1
    return out


def apply_overrides(data: dict, overrides: list[str] | dict[str, Any] | None) -> dict:
    """Apply ``section.key=value`` overrides (value parsed with ``yaml.safe_load``) to a nested config dict."""
    if isinstance(overrides, (str, bytes)):
        raise TypeError(f"overrides={overrides!r} is a string; pass a list such as [{overrides!r}] or a dict "
                        f"{{'section.key': value}}")
    if not overrides:
        return data
    items = overrides.items() if isinstance(overrides, dict) else [_split_override(o) for o in overrides]
    for dotted, value in items:
        parts = dotted.split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"override {dotted!r} must name section.key (e.g. training.steps)")
        section, key = parts
        if not isinstance(data.setdefault(section, {}), dict):
            raise TypeError(f"config section {section!r} is not a mapping; cannot set {dotted}")
        data[section][key] = value
    return data


def _split_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} has no value; write {text}=VALUE")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}={raw!r} is not a YAML value: {exc}") from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | dict[str, Any] | None = None,
                *, check: bool = True) -> TrainConfig:
    """Read a YAML config (``None``: all defaults), apply overrides, check keys and types, and validate.

    Args:
        path: YAML file (read by :class:`ConfigLoader`, a ``yaml.SafeLoader``: no Python objects are constructed;
            ``1e-3`` is a float; duplicate keys are an error).
        overrides: ``["section.key=value", ...]`` or ``{"section.key": value}``.
        check: run :func:`validate` (cross-field checks, data paths).

    ``parallel.schedule: tuned`` is kept as it is: the entry points (``pipecast train``, :func:`engine.training.run`
    users) resolve it with :func:`engine.training.tune.result.resolve_tuned`.

    ``model.init_from`` sets the architecture fields from the folder's ``config.json``
    (:func:`engine.training.checkpoint.hf.resolve_init_from`); a field also given here must agree.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConfigError: ``path`` is a folder, unreadable, not UTF-8 text or not YAML (the message names the file).
        ConfigError / TypeError: unknown keys, wrong types, invalid values (message names the field and fix);
            TypeError also when ``overrides`` is a string instead of a list.
    """
    if isinstance(overrides, (str, bytes)):
        raise TypeError(f"load_config(overrides={overrides!r}): overrides must be a list such as [{overrides!r}] "
                        f"or a dict {{'section.key': value}}, not a string")
    data: Any = {}
    if path is not None:
        data = _read_config_file(Path(path))
        if not isinstance(data, dict):
            raise TypeError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    data = apply_overrides(data, overrides)
    config = config_from_dict(data)
    if config.model.init_from:
        from ..checkpoint.hf import resolve_init_from  # the architecture fields come from the folder's config.json
        model_section = data.get("model") if isinstance(data.get("model"), dict) else {}
        config = resolve_init_from(config, explicit=model_section)
    if check:
        validate(config)
    return config


def _read_config_file(path: Path) -> Any:
    """The YAML data in ``path``; every failure names the file (a folder, unreadable, not text, not YAML)."""
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a folder, not a file; pass a YAML file such as "
                          f"{str(path / 'default.yaml')!r} or configs/default.yaml")
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist; pass a YAML file such as "
                                f"configs/default.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); it "
                          f"looks binary -- pass a YAML file such as configs/default.yaml") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        return _yaml_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    except ConfigError as exc:  # a duplicate key
        raise ConfigError(f"config file {str(path)!r}: {exc}") from None


def dump_config(config: TrainConfig, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (loadable again with :func:`load_config`).  Raises
    :class:`~engine.training.files.WriteError` naming ``path`` when the operating system refuses (a full disk)."""
    from ..files import writing
    with writing(path):
        Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


# ---- cross-field validation -----------------------------------------------------------------------------------

def validate(config: TrainConfig) -> None:
    """Cross-field checks of a whole run, before any process group exists (no communication).

    Checks: every numeric field against its row of :data:`engine.training.config.ranges.RANGES` (finite, within
    what the code represents); ``hidden_size`` divisible by heads; ``num_layers`` divisible into
    ``pipeline x virtual`` model chunks; the microbatch counts Megatron's schedule accepts (interleaved:
    ``P <= G <= M`` and ``M mod G`` in ``{0} U [P, G)``, Megatron-Core 0.16.1); every plan the run builds, built
    and validated (:func:`validate_plans`); sequence length and vocabulary; data paths.

    Raises:
        ConfigError (ValueError) / RuntimeError naming field, value and fix.
    """
    m, o = config.model, config.optimizer
    check_ranges(config, ConfigError)  # every numeric field against its row of RANGES (finite, bounds)
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                          f"{m.num_attention_heads}; choose heads that divide the hidden size")
    if config.data.source in ("stdlib", "text") and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is too small for byte-level data "
                          f"(data.source={config.data.source!r}); set model.vocab_size >= 256")
    validate_model_family(m)
    if m.init_from:
        from ..checkpoint.hf import check_init_from
        check_init_from(config)
    validate_parallel(config)
    if not o.min_lr <= o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must be in [0, optimizer.lr={o.lr}]")
    _validate_data(config)
    _validate_logging(config)
    _validate_device(config)  # last: the only check that may import torch


def validate_model_family(m: ModelConfig) -> None:
    """The family-specific model fields (part of :func:`validate`): grouped-query attention divides the heads,
    rotary needs an even head size, gpt2-only and llama-only options are refused in the other family.

    Raises:
        ConfigError: naming the field, its value and the fix.
    """
    groups = m.num_query_groups
    if groups is not None and (isinstance(groups, bool) or groups < 1 or m.num_attention_heads % groups):
        raise ConfigError(f"model.num_query_groups={groups} must be a positive divisor of model.num_attention_heads="
                          f"{m.num_attention_heads} (key / value heads shared by equal groups of query heads); use "
                          f"a divisor or null (one group per head)")
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.seq_length:
        raise ConfigError(f"model.max_position_embeddings={m.max_position_embeddings} is below model.seq_length="
                          f"{m.seq_length}; use >= {m.seq_length} or null (= seq_length)")
    if m.family == "gpt2":
        if groups is not None and groups != m.num_attention_heads:
            raise ConfigError(f"model.num_query_groups={groups} needs model.family=llama (gpt2 attention has one "
                              f"key / value head per query head); remove it or set model.family=llama")
        return
    head = m.hidden_size // m.num_attention_heads
    if head % 2:
        raise ConfigError(f"model.family=llama: the head size hidden_size / num_attention_heads = "
                          f"{m.hidden_size} / {m.num_attention_heads} = {head} must be even for rotary embeddings; "
                          f"change model.hidden_size or model.num_attention_heads")
    if m.activation != "gelu":
        raise ConfigError(f"model.activation={m.activation!r} applies to model.family=gpt2 only (llama's MLP is "
                          f"SwiGLU); remove it")
    if m.transformer_engine:
        raise ConfigError("model.transformer_engine=true is for model.family=gpt2 (Transformer Engine's layer is "
                          "GPT-shaped); set it to false for model.family=llama")


def _validate_device(config: TrainConfig) -> None:
    """``parallel.device=cuda`` / ``parallel.backend=nccl`` need CUDA on this machine.  torch is imported only for
    configs that ask for CUDA (so the other bad-config paths stay fast)."""
    p = config.parallel
    if p.device != "cuda" and p.backend != "nccl":
        return
    import torch
    if torch.cuda.is_available():
        return
    field_, value = ("parallel.device", p.device) if p.device == "cuda" else ("parallel.backend", p.backend)
    raise ConfigError(f"{field_}={value!r} needs CUDA, but torch.cuda.is_available() is False on this machine "
                      f"(torch {torch.__version__}); set parallel.device=auto or parallel.device=cpu and "
                      f"parallel.backend=auto (or gloo), or run on a machine with CUDA GPUs")


def check_fresh_run(config: TrainConfig, resume: bool) -> None:
    """A fresh run (no ``--resume``) must not start in a folder that already holds checkpoints: the other run's
    newer checkpoints would outrank this run's in the keep-newest rotation and a later ``--resume`` would continue
    the other run.  Pure (reads the folder listing); call it before spawning ranks; the trainer calls it too.

    Raises:
        ConfigError: ``checkpoint.dir`` holds complete checkpoints and ``resume`` is False.
    """
    if resume:
        return
    directory = config.checkpoint_dir
    if not directory.is_dir():
        return
    found = sorted(p.name for p in directory.iterdir()
                   if re.fullmatch(r"step_\d{8}", p.name) and (p / ".metadata").is_file())
    if found:
        shown = ", ".join(found[-3:]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(f"checkpoint.dir {str(directory)!r} already holds checkpoints ({shown}) of another run "
                          f"(logging.run_dir={config.logging.run_dir!r}); pass --resume to continue it, use a new "
                          f"logging.run_dir (or checkpoint.dir) for a fresh run, or delete that folder")


def _takers(option: str) -> str:
    return " / ".join(n for n in schedule_names() if option in get_schedule(n).options)


def _validate_schedule(config: TrainConfig) -> None:
    """``parallel.schedule`` against the pipeline / virtual sizes and the options its registry entry takes
    (``tuned`` is checked when it is resolved, :func:`engine.training.tune.result.resolve_tuned`)."""
    p = config.parallel
    if p.schedule == "tuned":
        _validate_shard(config)
        return
    spec = get_schedule(config.schedule_name)
    if p.max_in_flight is not None and "max_in_flight" not in spec.options:
        raise ConfigError(f"parallel.max_in_flight={p.max_in_flight} only applies to parallel.schedule="
                          f"{_takers('max_in_flight')} (got parallel.schedule={p.schedule}); remove it or set "
                          f"parallel.schedule={_takers('max_in_flight')}")
    why = spec.fits(p.pipeline, p.virtual)
    if why is not None:
        picked = f" (Megatron's choice: {spec.name})" if p.schedule == "auto" else ""
        hint = ("; parallel.virtual > 1 needs parallel.pipeline >= 2 (interleaved 1F1B runs on at least two "
                "pipeline ranks): set parallel.virtual=1 or parallel.pipeline >= 2") if p.schedule == "auto" else ""
        raise ConfigError(f"parallel.schedule={p.schedule}{picked} does not fit parallel.pipeline={p.pipeline}, "
                          f"parallel.virtual={p.virtual}: {why}{hint}")
    if spec.splits_backward and config.cuda_graphs.enabled and config.cuda_graphs.backend == "te":
        raise ConfigError(f"parallel.schedule={p.schedule} (split backward) with cuda_graphs.backend=te: Transformer "
                          "Engine's capture has no weight-gradient (W) graphs for these layers; set "
                          "cuda_graphs.backend=torch (pipecast's capture: F, B and W graphs) or auto")
    _refuse_te_layers_with_split(config, spec)
    if p.microbatch_group_size_per_vp_stage is not None and "group_size" not in spec.options:
        raise ConfigError(f"parallel.microbatch_group_size_per_vp_stage={p.microbatch_group_size_per_vp_stage} only "
                          f"applies to parallel.schedule={_takers('group_size')} (interleaved 1F1B), not "
                          f"{spec.name}; remove it or set parallel.virtual >= 2")
    _validate_shard(config, spec)
    if p.overlap_p2p_comm and not spec.overlap_p2p:
        raise ConfigError(f"parallel.overlap_p2p_comm=true is not supported by {spec.name} (as in Megatron-Core's "
                          "1F1B); set parallel.virtual >= 2 or parallel.overlap_p2p_comm=false")


def _refuse_te_layers_with_split(config: TrainConfig, spec) -> None:
    """Transformer Engine layers under a split-backward schedule are refused (issue 24 item 2).

    The split W re-runs a node's backward after B (``engine.runtime.split_backward``, ``graphs.backends.split``),
    while TE's backward functions free the tensors they saved once they ran, so W would read cleared tensors.
    TE's own deferral (modules built with ``delay_wgrad_compute=True`` and their ``backward_dw()``) is not wired
    into pipecast's W pass, so the combination is refused here, before any rank starts.

    Raises:
        ConfigError: ``model.transformer_engine=true`` with a ``parallel.schedule`` whose registry entry splits the
            backward (``zb_h1``, ``zbv``, ...).
    """
    if config.model.transformer_engine and spec.splits_backward:
        raise ConfigError(
            f"model.transformer_engine=true with parallel.schedule={config.parallel.schedule} (split backward, "
            f"{spec.name}): the W pass re-runs a layer's backward after B, but Transformer Engine's backward frees "
            f"the tensors it saved, so W would read cleared tensors -- set model.transformer_engine=false (torch "
            f"layers, which split correctly) or use a schedule without split backward (parallel.schedule=1f1b, "
            f"interleaved or auto)")


def validate_parallel(config: TrainConfig) -> None:
    """The ``parallel`` section against the model and schedule sizes (part of :func:`validate`)."""
    m, p, s = config.model, config.parallel, config.training
    validate_tensor_parallel(config)
    _validate_schedule(config)
    chunks = p.pipeline * p.virtual
    if m.num_layers % chunks:
        raise ConfigError(f"model.num_layers={m.num_layers} cannot be split into parallel.pipeline x "
                          f"parallel.virtual = {p.pipeline} x {p.virtual} = {chunks} model chunks of equal size; "
                          f"use a multiple of {chunks} layers or change the pipeline / virtual sizes")
    if p.overlap_p2p_comm and p.batch_p2p_comm:
        raise ConfigError("parallel.overlap_p2p_comm=true needs parallel.batch_p2p_comm=false (Megatron: the two "
                          "are mutually exclusive)")
    if p.schedule != "tuned" and "group_size" in get_schedule(config.schedule_name).options:
        group = p.microbatch_group_size_per_vp_stage or p.pipeline
        if p.microbatch_group_size_per_vp_stage is not None:  # the field the user set is named first
            for count in (s.num_microbatches, config.eval_microbatches):
                if not p.pipeline <= group <= count:
                    raise ConfigError(
                        f"parallel.microbatch_group_size_per_vp_stage={group} is invalid for interleaved 1F1B "
                        f"(parallel.pipeline={p.pipeline}, training.num_microbatches={s.num_microbatches}, "
                        f"eval microbatches={config.eval_microbatches}): it must be in [parallel.pipeline, "
                        f"num_microbatches] = [{p.pipeline}, {count}]; set it in that range or remove it (default: "
                        f"parallel.pipeline)")
        for where, count in [("training.num_microbatches", s.num_microbatches),
                             ("training.eval_microbatches", config.eval_microbatches)]:
            try:
                validate_interleaved_microbatches(count, p.pipeline, group)
            except (ValueError, RuntimeError) as exc:
                raise type(exc)(f"{where}={count} is invalid for interleaved 1F1B "
                                f"(parallel.pipeline={p.pipeline}, parallel.virtual={p.virtual}): {exc}") from None
    if p.device == "cpu" and p.backend == "nccl":
        raise ConfigError("parallel.backend='nccl' needs CUDA; use parallel.backend=gloo (or auto) with "
                          "parallel.device=cpu")
    validate_plans(config)


def run_plans(config: TrainConfig) -> list[tuple[str, int, bool]]:
    """``(what, num_microbatches, forward_only)`` of every plan a run of ``config`` builds: the training step
    (``training.num_microbatches``), evaluation's forward-only plan (``training.eval_microbatches``) and, when
    ``logging.sample_every_eval`` asks for samples, sampling's forward-only plan (one microbatch; a whole group
    for schedules that group microbatches, see :meth:`engine.training.trainer.Trainer.sample`)."""
    s, p = config.training, config.parallel
    plans = [("training.num_microbatches", s.num_microbatches, False),
             ("training.eval_microbatches", config.eval_microbatches, True)]
    if config.logging.sample_every_eval:
        grouped = "group_size" in get_schedule(config.schedule_name).options
        plans.append(("logging.sample_every_eval", (p.microbatch_group_size_per_vp_stage or p.pipeline)
                      if grouped else 1, True))
    return plans


def validate_plans(config: TrainConfig) -> None:
    """Build and validate (:meth:`~engine.plan.resolve.ResolvedSchedule.checked_plan`) every plan of
    :func:`run_plans` before any rank starts, so that a schedule that cannot run (e.g. ``parallel.schedule=zb``
    with a ``parallel.max_in_flight`` too small for the placement: the builder's list scheduler gets stuck) is
    refused here, naming the field and the smallest ``max_in_flight`` that works.  ``tuned`` is checked once it
    is resolved.  Pure (no torch); a few milliseconds for the sizes of a config.

    Raises:
        ConfigError: naming the field, its value and the fix.
    """
    p = config.parallel
    if p.schedule == "tuned":
        return
    resolved = config.resolve_schedule()
    for where, count, forward_only in run_plans(config):
        try:
            resolved.checked_plan(count, forward_only)
        except (ValueError, RuntimeError) as exc:
            sizes = (f"parallel.schedule={config.schedule_name}, parallel.pipeline={p.pipeline}, parallel.virtual="
                     f"{p.virtual}, {count} microbatches")
            if p.max_in_flight is not None and not forward_only:
                least = resolved.smallest_max_in_flight(count)
                fix = (f"use parallel.max_in_flight >= {least} (the smallest that gives a valid plan) or remove it "
                       f"(1F1B's limit)") if least is not None else "remove parallel.max_in_flight (1F1B's limit)"
                raise ConfigError(f"parallel.max_in_flight={p.max_in_flight} is too small for {sizes}: the plan "
                                  f"cannot be built ({exc}); {fix}") from None
            if where == "logging.sample_every_eval":
                raise ConfigError(f"logging.sample_every_eval={config.logging.sample_every_eval}: sampling's "
                                  f"forward-only plan cannot be built for {sizes}: {exc}; set "
                                  f"logging.sample_every_eval=0 or change parallel.schedule") from None
            what = "evaluation" if forward_only else "the training step"
            raise ConfigError(f"{where}={count}: the plan of {what} cannot be built for {sizes}: {exc}; change "
                              f"{where} or parallel.schedule") from None


def _validate_data(config: TrainConfig) -> None:
    d = config.data
    if d.source == "bin" and d.tokenizer != "bytes":
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} does not apply to data.source='bin' (its files hold "
                          f"token ids already); remove data.tokenizer, or use data.source=text / stdlib")
    if d.tokenizer == "bpe" and config.model.vocab_size < 257:
        raise ConfigError(f"model.vocab_size={config.model.vocab_size} is too small for data.tokenizer='bpe': a "
                          f"byte-level BPE starts from the 256 byte tokens; set model.vocab_size > 256 (e.g. 4096)")
    if d.source == "stdlib":
        if d.paths:
            raise ConfigError(f"data.paths={d.paths} is set but data.source='stdlib' ignores it; set "
                              f"data.source=text or data.source=bin, or remove data.paths")
        return
    if not d.paths:
        raise ConfigError(f"data.source={d.source!r} needs data.paths (files or folders); none given")
    for i, raw in enumerate(d.paths):
        if not Path(raw).exists():
            raise ConfigError(f"data.paths[{i}]={raw!r} does not exist; fix the path or use data.source=stdlib")


def _validate_logging(config: TrainConfig) -> None:
    lg = config.logging
    if lg.tensorboard:
        import importlib.util
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("logging.tensorboard=true needs the tensorboard package, which is not installed; "
                              "run pip install -e '.[tensorboard]' or set logging.tensorboard=false")


def _validate_shard(config: TrainConfig, spec=None) -> None:
    """``parallel.shard`` (every rank, before any collective).  ``optimizer`` (ZeRO-1) and ``full`` (FSDP2 per
    model chunk) with ``parallel.data = 1`` run as ``none`` (one shard is the whole state).

    Raises:
        ConfigError: an unknown value; ``optimizer`` / ``full`` with ``parallel.tensor > 1``; ``full`` with
            ``cuda_graphs.enabled`` or with tied embeddings whose two ends the placement puts on one rank (a V
            placement; any placement of several chunks on one pipeline rank) (``spec``: the schedule's
            registry entry, None for ``tuned``: the trainer checks the resolved one).
    """
    shard, p = config.parallel.shard, config.parallel
    if shard not in ("none", "optimizer", "full"):
        raise ConfigError(f"parallel.shard={shard!r} is not one of none, optimizer, full")
    if shard != "none" and p.tensor > 1:
        why = ("the sharded optimizer flattens plain tensors, not DTensor shards" if shard == "optimizer" else
               "fully_shard over the data-parallel dimension of tensor-parallel DTensors is not wired")
        raise ConfigError(f"parallel.shard={shard} with parallel.tensor={p.tensor} is not available in this version "
                          f"({why}); use parallel.shard=none with tensor parallelism, or parallel.tensor=1")
    if shard != "full":
        return
    if config.cuda_graphs.enabled:
        raise ConfigError("parallel.shard=full with cuda_graphs.enabled=true is not available: the captured graphs "
                          "would hold the gathered parameters' storage, which FSDP frees after each step; set "
                          "cuda_graphs.enabled=false or parallel.shard=optimizer")
    stages = () if spec is None else placement_of(spec.placement, p.pipeline, p.virtual)
    if config.model.tie_embeddings and len(stages) > 1 and stages[0][0] == stages[-1][0]:
        raise ConfigError(f"parallel.shard=full with parallel.schedule={p.schedule} ({spec.name}, {spec.placement} "
                          f"placement) at parallel.pipeline={p.pipeline}, parallel.virtual={p.virtual} and "
                          "model.tie_embeddings=true: the first and the last stage are two chunks of one rank sharing "
                          "one Parameter, which two fully_shard units cannot share; use a looped schedule (1f1b, "
                          "interleaved, zb_h1) on parallel.pipeline >= 2, model.tie_embeddings=false, or "
                          "parallel.shard=optimizer")


def validate_tensor_parallel(config: TrainConfig) -> None:
    """Pure checks of ``parallel.tensor`` (every rank, before any collective; the layers:
    :mod:`engine.training.parallel.tensor_parallel`).

    Raises:
        ConfigError: ``T`` not dividing ``model.num_attention_heads``, ``model.num_query_groups`` (llama),
            ``model.ffn_hidden_size`` or ``model.vocab_size``; ``T > 1`` with ``cuda_graphs.enabled`` or
            ``model.transformer_engine``.  Split-backward schedules (``zb_h1``, ``zbv``, ``dualpipev``) are
            accepted: their W passes issue no tensor-parallel collective (:mod:`engine.training.parallel.tensor_parallel`).
    """
    m, t = config.model, config.parallel.tensor
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ConfigError(f"parallel.tensor={t!r} must be an integer >= 1 (tensor-parallel ranks per stage)")
    _validate_sequence_parallel(config)
    if t == 1:
        return
    sizes = [("model.num_attention_heads", m.num_attention_heads), ("model.ffn_hidden_size", config.ffn_hidden_size),
             ("model.vocab_size", m.vocab_size)]
    if getattr(m, "family", "gpt2") == "llama":
        sizes.insert(1, ("model.num_query_groups", m.num_query_groups or m.num_attention_heads))
    for where, value in sizes:
        if value % t:
            fix = (f"round it up to {-(-value // t) * t}" if where == "model.vocab_size" else
                   f"choose parallel.tensor dividing {value}")
            raise ConfigError(f"parallel.tensor={t} does not divide {where}={value}: each tensor-parallel rank holds "
                              f"{where.split('.')[1]} / parallel.tensor of it; {fix}")
    if config.cuda_graphs.enabled:
        raise ConfigError(f"parallel.tensor={t} with cuda_graphs.enabled=true: pipecast's capture records plain "
                          "tensors per layer and has no DTensor support; set cuda_graphs.enabled=false or "
                          "parallel.tensor=1")
    if m.transformer_engine:
        raise ConfigError(f"parallel.tensor={t} with model.transformer_engine=true: Transformer Engine layers "
                          "bring their own tensor parallelism, not wired here; set model.transformer_engine=false")


def _validate_sequence_parallel(config: TrainConfig) -> None:
    """``parallel.sequence_parallel`` needs ``parallel.tensor > 1`` dividing ``model.seq_length`` (each rank holds
    ``seq_length / T`` positions of the residual stream)."""
    sp, t, s = config.parallel.sequence_parallel, config.parallel.tensor, config.model.seq_length
    if not isinstance(sp, bool):
        raise ConfigError(f"parallel.sequence_parallel={sp!r} must be true or false")
    if not sp:
        return
    if t == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor > 1 (it shards the sequence over "
                          "the tensor-parallel ranks), got parallel.tensor=1; set parallel.tensor=2 or more, or "
                          "parallel.sequence_parallel=false")
    if s % t:
        raise ConfigError(f"parallel.sequence_parallel=true with parallel.tensor={t} does not divide "
                          f"model.seq_length={s}: each tensor-parallel rank holds seq_length / tensor positions; "
                          f"choose a seq_length that is a multiple of {t}")


def validate_world_size(config: TrainConfig, world_size: int) -> TrainConfig:
    """Resolve ``parallel.data`` from the job's world size and check ``world = pipeline x data``.

    Returns the config with ``parallel.data`` filled in.

    Raises:
        ConfigError: the world size is not ``parallel.pipeline x parallel.data``.
    """
    p = config.parallel
    if p.tensor > 1:
        return _validate_world_size_tp(config, world_size)
    if world_size % p.pipeline:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.pipeline={p.pipeline}; start "
                          f"a multiple of {p.pipeline} ranks or change parallel.pipeline")
    data = world_size // p.pipeline
    if p.data is not None and p.data != data:
        raise ConfigError(f"world size {world_size} != parallel.pipeline x parallel.data = {p.pipeline} x {p.data}"
                          f" = {p.pipeline * p.data}; start {p.pipeline * p.data} ranks or set parallel.data="
                          f"{data}")
    return dataclasses.replace(config, parallel=dataclasses.replace(p, data=data))


def _validate_world_size_tp(config: TrainConfig, world_size: int) -> TrainConfig:
    """:func:`validate_world_size` with ``parallel.tensor > 1``: ``world = pipeline x data x tensor``."""
    p = config.parallel
    mp = p.pipeline * p.tensor
    if world_size % mp:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.pipeline x parallel.tensor = "
                          f"{p.pipeline} x {p.tensor}; start a multiple of {mp} ranks or change the sizes")
    data = world_size // mp
    if p.data is not None and p.data != data:
        raise ConfigError(f"world size {world_size} != parallel.pipeline x parallel.data x parallel.tensor = "
                          f"{p.pipeline} x {p.data} x {p.tensor} = {mp * p.data}; start {mp * p.data} ranks or set "
                          f"parallel.data={data}")
    return dataclasses.replace(config, parallel=dataclasses.replace(p, data=data))
