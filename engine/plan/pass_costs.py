"""What the passes of a split-backward step cost: :class:`PassCosts`, its notation, its per-``(rank, chunk)`` tables.

The cost-aware builder (:mod:`engine.plan.cost_aware`) orders a plan for these costs; they reach it as the ``costs``
option of a schedule entry (:mod:`engine.plan.registry`), from ``pipecast schedule --cost-aware``, from
``parallel.schedule_costs`` in a config, or from ``pipecast tune``'s measurements.  One notation everywhere (the
config value, the tune result, the CLI's summary), fields named as in the dataclass::

    forward=18.5 backward=18.1 weight=9.3 transfer=0.6 weight_memory=0.37

A value is one number for every ``(rank, chunk)``, or per rank separated by ``/`` with the chunks of a rank
separated by ``,`` (``forward=1.0,1.1/1.2,1.3``: two ranks, two chunks each); ``transfer`` is one number.
``PassCosts.parse(str(c)) == c``.  Pure: no torch.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

__all__ = ["PassCosts"]

_NAMES = ("forward", "backward", "weight", "transfer", "weight_memory")
_NUMBER = r"[0-9.eE+-]+"
_VALUE = re.compile(rf"^{_NUMBER}(,{_NUMBER})*(/{_NUMBER}(,{_NUMBER})*)*$")


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"PassCosts {name}={value!r} is invalid: use a finite number >= 0")
    return float(value)


def _normal(name: str, value):
    """A number as ``float``, a per-``(rank, chunk)`` nested sequence as a tuple of tuples of ``float``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number(name, value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(row, (list, tuple)) and row for row in value):
        return tuple(tuple(_number(f"{name}[{r}][{c}]", x) for c, x in enumerate(row)) for r, row in enumerate(value))
    raise ValueError(f"PassCosts {name}={value!r} is invalid: use a number >= 0 or a [rank][chunk] nested list of them")


@dataclass(frozen=True)
class PassCosts:
    """Time of each pass of one ``(rank, chunk)`` and one microbatch, and the memory a pending ``W`` holds.

    Attributes:
        forward, backward, weight: time of ``F``, ``B`` (the input-gradient pass) and ``W`` (time units, e.g. ms):
            one number, or ``[rank][chunk]``.
        transfer: latency of a message between two ranks (a hand-off between chunks of one rank costs none).
        weight_memory: the memory one pending ``W`` (``B`` done, ``W`` not) holds, as a fraction of one in-flight
            activation of the same ``(rank, chunk)`` (``F`` done, ``B`` not): one number or ``[rank][chunk]``.
            Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Table 1: ``32 h / (34 h + 5 a s)`` for a
            GPT layer (``h`` hidden, ``a`` heads, ``s`` sequence); 0 counts pending ``W`` apart (a limit of its own).

    Raises:
        ValueError: a value that is not a finite number >= 0 (or a non-empty nested list of them).
    """

    forward: object = 1.0
    backward: object = 1.0
    weight: object = 1.0
    transfer: float = 0.0
    weight_memory: object = 0.0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            normal = _number(f.name, value) if f.name == "transfer" else _normal(f.name, value)
            object.__setattr__(self, f.name, normal)

    def __str__(self) -> str:
        return " ".join(f"{name}={_format(getattr(self, name))}" for name in _NAMES)

    @classmethod
    def parse(cls, text: str) -> "PassCosts":
        """The costs written ``text`` (module doc); names left out keep their defaults.

        Raises:
            ValueError: not ``name=value`` words, an unknown or repeated name, or a bad value (the message names it).
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"costs {text!r} are empty: write e.g. 'forward=1.0 backward=1.0 weight=0.5 transfer=0.05'")
        given: dict = {}
        for word in text.split():
            name, eq, value = word.partition("=")
            if not eq or name not in _NAMES or name in given or not _VALUE.match(value):
                why = ("is repeated" if name in given else "is not one of " + ", ".join(_NAMES)
                       if eq and name not in _NAMES else "is not name=number or name=a,b/c,d")
                raise ValueError(f"costs {text!r}: {word!r} {why}; write e.g. 'forward=1.0 backward=1.0 weight=0.5 "
                                 f"transfer=0.05 weight_memory=0.4'")
            given[name] = _parse_value(name, value)
        return cls(**given)

    @classmethod
    def of(cls, value) -> "PassCosts | None":
        """``value`` as costs: a :class:`PassCosts` as it is, a string parsed (:meth:`parse`), ``None`` as ``None``.

        Raises:
            TypeError: anything else.
            ValueError: as :meth:`parse`.
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        raise TypeError(f"costs={value!r} has type {type(value).__name__}; pass a PassCosts or its notation "
                        f"('forward=1.0 backward=1.0 weight=0.5 transfer=0.05')")

    def table(self, name: str, pp_size: int, num_model_chunks: int) -> list[list[float]]:
        """``[rank][chunk]`` values of field ``name`` for ``pp_size`` ranks of ``num_model_chunks`` chunks.

        Raises:
            ValueError: a nested value of another shape (the message names the field and the sizes).
        """
        value = getattr(self, name)
        if isinstance(value, float):
            return [[value] * num_model_chunks for _ in range(pp_size)]
        if len(value) != pp_size or any(len(row) != num_model_chunks for row in value):
            raise ValueError(f"costs {name} has {len(value)} ranks x {[len(r) for r in value]} chunks; the plan has "
                             f"{pp_size} ranks x {num_model_chunks} chunks: give one number or a [rank][chunk] table "
                             f"of that shape")
        return [list(row) for row in value]

    def simulation(self) -> dict:
        """The keyword arguments of :func:`engine.plan.simulate.simulate` for a split plan under these costs."""
        return dict(forward_time=_nested(self.forward), backward_time=_nested(self.backward),
                    weight_time=_nested(self.weight), transfer_time=self.transfer)


def _nested(value):
    return value if isinstance(value, float) else [list(row) for row in value]


def _parse_value(name: str, text: str):
    try:
        rows = [[float(x) for x in row.split(",")] for row in text.split("/")]
    except ValueError:
        raise ValueError(f"costs {name}={text!r}: not numbers; write a number or ranks as a,b/c,d") from None
    return rows[0][0] if len(rows) == 1 and len(rows[0]) == 1 else rows


def _format(value) -> str:
    if isinstance(value, float):
        return repr(value)
    return "/".join(",".join(repr(x) for x in row) for row in value)
