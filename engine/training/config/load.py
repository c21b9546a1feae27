"""Reading a config: YAML (:class:`ConfigLoader`, safe), ``section.key=value`` overrides, keys and types checked
against the dataclasses of :mod:`.schema`, ``model.init_from`` resolved (:mod:`.init_from`), the whole run validated
(:func:`.validate.validate`); and writing the resolved config back as YAML (:func:`dump_config`).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from .errors import ConfigError
from .fields import RegisteredName, subsection_type, type_name
from .init_from import resolve_init_from
from .schema import TrainConfig
from .validate import validate

__all__ = ["ConfigLoader", "load_config", "config_from_dict", "config_to_dict", "apply_overrides",
           "parse_override_args", "dump_config"]


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


def _coerce(value: Any, tp, where: str):
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats; a mapping for a subsection
    (``model.moe``) is built into its dataclass.  Returns the value."""
    sub = subsection_type(tp)
    if sub is not None and isinstance(value, (dict, sub)):
        return value if isinstance(value, sub) else _build_section(sub, value, where)
    if isinstance(tp, type) and issubclass(tp, RegisteredName):
        if value not in tp.choices():
            raise ConfigError(f"{where}={value!r} is not allowed; use one of {type_name(tp)}{tp.hint}")
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except (TypeError, ConfigError):
                continue
        raise TypeError(f"{where}={value!r} has type {type(value).__name__}; expected {type_name(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}={value!r} is not allowed; use one of {type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise TypeError(f"{where}={value!r} has type {type(value).__name__}; expected {type_name(tp)}")
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
        raise TypeError(f"{where}={value!r} has type {type(value).__name__}; expected {type_name(tp)}")
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
        if len(parts) not in (2, 3) or not all(parts):
            raise ConfigError(f"override {dotted!r} must name section.key (e.g. training.steps) or "
                              f"section.subsection.key (e.g. model.moe.num_experts)")
        where = data
        for i, part in enumerate(parts[:-1]):
            if where.get(part) is None:
                where[part] = {}
            where = where[part]
            if not isinstance(where, dict):
                raise TypeError(f"config {'section' if i == 0 else 'subsection'} {'.'.join(parts[:i + 1])!r} is not "
                                f"a mapping; cannot set {dotted}")
        where[parts[-1]] = copy.deepcopy(value)  # a mapping value (model.moe) must not alias the caller's
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

    ``parallel.schedule: tuned`` is kept as it is: the entry points (``pipecast train``, users of
    :func:`engine.training.launch_ranks`) resolve it with :func:`engine.training.tune.result.resolve_tuned`.

    ``model.init_from`` sets the architecture fields from the folder's ``config.json``
    (:func:`.init_from.resolve_init_from`); a field also given here must agree.

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
    if config.model.init_from:  # the architecture fields come from the folder's config.json
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
