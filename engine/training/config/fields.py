"""How a config field is described: :func:`setting` writes its meaning and, for a number, its :class:`Range` into
the dataclass field's metadata, the one place they are written (:mod:`.schema`).  ``pipecast train --help``
(:mod:`.help`), the range check (:func:`check_ranges`, the first step of :func:`engine.training.config.validate`)
and the type errors (:func:`type_name`) read them from there.

A range bounds a number by what the code can represent and use: finite floats (``.inf`` and ``.nan`` are refused),
learning rates and epsilons that do not overflow an fp32 update (``optimizer.lr=1e300`` makes the first AdamW step
``inf``), AdamW's betas in ``[0, 1)`` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
arXiv:1711.05101), sizes well inside int64 once multiplied (tokens per step, plan actions), seeds that
``torch.Generator.manual_seed`` takes after the per-step offset (:class:`engine.training.data.corpus.Batches`) and
timeouts that ``datetime.timedelta`` holds.  Rules between fields (``min_lr <= lr``, divisibility, the plans a
config implies) live in :mod:`.validate` and :mod:`.layout`.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Union

__all__ = ["Range", "RegisteredName", "setting", "field_help", "field_range", "config_fields", "type_name",
           "subsection_type", "field_value", "check_ranges", "MAX_STEPS", "MAX_TOKENS_PER_STEP"]

MAX_STEPS = 10**9  # the upper bound of training.steps (at one step per millisecond: 11 days)
MAX_TOKENS_PER_STEP = 1 << 40  # data x num_microbatches x micro_batch_size x seq_length


@dataclass(frozen=True)
class Range:
    """``low`` / ``high`` bounds (``None``: unbounded); ``*_open``: the bound itself is excluded; ``fix``: what to
    write instead, appended to the error."""

    low: float | None
    high: float | None
    fix: str
    low_open: bool = False
    high_open: bool = False

    def violation(self, value) -> str | None:
        """Why ``value`` is outside the range (``None`` when inside)."""
        kind = "an integer " if isinstance(value, int) else ""
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return f"must be {kind}{'>' if self.low_open else '>='} {self.low}"
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return (f"must be below {self.high}" if self.high_open else
                    f"is over the upper bound {self.high:_}" if isinstance(self.high, int) else
                    f"is over the upper bound {self.high}")
        return None


class RegisteredName(str):
    """The type of a field whose values are the entries of a registry, read when a value is checked or the help is
    shown (so entries registered after this module was imported count); a subclass gives :meth:`choices` and may
    give ``hint``, appended to the error for another value."""

    hint = ""

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        raise NotImplementedError


def setting(default=dataclasses.MISSING, text: str | Callable[[], str] = "", bounds: Range | None = None, *,
            factory=dataclasses.MISSING) -> dataclasses.Field:
    """A dataclass field with its default (or ``factory``), its meaning ``text`` (a function when the text is read
    from a registry at the time it is shown) and, for a number, its ``bounds``."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": text, "range": bounds})


def field_help(f: dataclasses.Field) -> str:
    """The meaning of field ``f`` (``""`` when it has none)."""
    text = f.metadata.get("help", "")
    return text() if callable(text) else text


def field_range(f: dataclasses.Field) -> Range | None:
    """The bounds of field ``f`` (``None``: not a number, or unbounded)."""
    return f.metadata.get("range")


def subsection_type(tp):
    """The dataclass of a field annotated ``SomeConfig`` or ``SomeConfig | None`` (a subsection such as
    ``model.moe``), else ``None``."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        return next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)
    return None


def config_fields(config_type) -> Iterator[tuple[str, object, dataclasses.Field]]:
    """``(section.field, annotation, field)`` of every field of ``config_type`` (a config class whose fields are
    the section dataclasses), in dataclass order; a subsection field (``model.moe``) is followed by its own fields
    (``model.moe.num_experts``, ...)."""
    sections = typing.get_type_hints(config_type)
    for section in dataclasses.fields(config_type):
        yield from _fields_of(sections[section.name], section.name)


def _fields_of(cls, prefix: str):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f"{prefix}.{f.name}", hints[f.name], f
        sub = subsection_type(hints[f.name])
        if sub is not None:
            yield from _fields_of(sub, f"{prefix}.{f.name}")


def field_value(config, dotted: str):
    """The value of field ``dotted`` (``section.field`` or ``section.sub.field``) of ``config`` (None under a null
    subsection)."""
    value = config
    for part in dotted.split("."):
        if value is None:
            return None
        value = getattr(value, part)
    return value


def type_name(tp) -> str:
    """The annotation ``tp`` as the help and the type errors show it (``'a' | 'b'``, ``int | null``, ...)."""
    if isinstance(tp, type) and issubclass(tp, RegisteredName):
        return " | ".join(repr(a) for a in tp.choices())
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _show(value) -> str:
    return repr(value) if not isinstance(value, int) or abs(value) < 10**6 else f"{value:_}"


def _check_section(values, where: str, error) -> None:
    """:func:`check_ranges` over one section (and its non-null subsections)."""
    for f in dataclasses.fields(values):
        value, name = getattr(values, f.name), f"{where}.{f.name}"
        if dataclasses.is_dataclass(value):
            _check_section(value, name, error)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise error(f"{name}={value!r} is not a finite number; use a finite value")
        rule = field_range(f)
        why = rule.violation(value) if rule is not None else None
        if why is not None:
            raise error(f"{name}={_show(value)} {why}; {rule.fix}")


def check_ranges(config, error: type[Exception] = ValueError) -> None:
    """Check every numeric field of ``config`` (a :class:`~engine.training.config.TrainConfig`) against the range
    in its metadata, in dataclass order; ``None`` (null) values are left to the field's meaning.

    Raises:
        error: (a ``ValueError``; :func:`engine.training.config.validate` passes its ``ConfigError``) naming the
            field, its value, the bound and the fix.
    """
    for section in dataclasses.fields(config):
        _check_section(getattr(config, section.name), section.name, error)
    s, m = config.training, config.model
    tokens = (config.parallel.data or 1) * s.num_microbatches * s.micro_batch_size * m.seq_length
    if tokens > MAX_TOKENS_PER_STEP:
        raise error(f"training.num_microbatches={s.num_microbatches} x training.micro_batch_size="
                    f"{s.micro_batch_size} x model.seq_length={m.seq_length} x data replicas = {tokens:_} "
                    f"tokens per step is over the upper bound {MAX_TOKENS_PER_STEP:_}; use fewer microbatches "
                    f"or smaller microbatches")
