"""Static-argument layout of one graphed layer call.

A CUDA graph reads its inputs from fixed addresses and freezes everything that is not a tensor argument
(torch's CUDA Graphs constraints).  :class:`CallSpec` records, for one layer call, which positional and
keyword arguments are tensors (with shape, dtype, device and ``requires_grad``) and which are constants; it can
flatten a call into its tensors, rebuild a call from tensors, check that a runtime call matches the capture (TE
does not check shapes, so pipecast does), and make fresh static input tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["TensorSpec", "CallSpec", "AutocastState", "current_autocast", "autocast_context", "flatten_outputs",
           "unflatten_outputs"]


@dataclass(frozen=True, slots=True)
class AutocastState:
    """Which autocast regions are active: ``(device_type, dtype)`` pairs, e.g. ``(("cuda", torch.bfloat16),)``.

    A graph freezes the dtypes its kernels were captured with, so it must be captured under the autocast state it
    is replayed in (with the cast cache off, which capture requires: torch and TE reject autocast caching).
    """

    regions: tuple[tuple[str, torch.dtype], ...] = ()

    def __str__(self) -> str:
        return ", ".join(f"{d}:{str(t).replace('torch.', '')}" for d, t in self.regions) or "off"


def current_autocast() -> AutocastState:
    """The autocast state of the calling thread (CUDA and CPU regions)."""
    regions = []
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            regions.append((device, torch.get_autocast_dtype(device)))
    return AutocastState(tuple(regions))


def autocast_context(state: AutocastState):
    """A context entering exactly ``state`` (regions not in it are switched off), cache disabled."""
    import contextlib

    stack = contextlib.ExitStack()
    enabled = dict(state.regions)
    for device in ("cuda", "cpu"):
        if device in enabled:
            stack.enter_context(torch.autocast(device, dtype=enabled[device], cache_enabled=False))
        elif torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape, dtype, device and ``requires_grad`` of one static tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), t.dtype, t.device, bool(t.requires_grad))

    def matches(self, t: torch.Tensor) -> bool:
        return (tuple(t.shape) == self.shape and t.dtype == self.dtype and t.device == self.device
                and bool(t.requires_grad) == self.requires_grad)

    def make(self, fill: float = 1.0) -> torch.Tensor:
        """A new contiguous tensor of this spec filled with ``fill`` (Megatron uses ones for sample inputs)."""
        t = torch.full(self.shape, fill, dtype=self.dtype, device=self.device)
        return t.requires_grad_(self.requires_grad and t.is_floating_point())

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"{dtype}{list(self.shape)}@{self.device}{' grad' if self.requires_grad else ''}"


_TENSOR = object()  # placeholder for a tensor slot in a CallSpec


@dataclass(frozen=True)
class CallSpec:
    """Layout of ``layer(*args, **kwargs)``: per argument either a :class:`TensorSpec` or a frozen constant."""

    args: tuple[Any, ...]           # TensorSpec or constant, per positional argument
    kwargs: tuple[tuple[str, Any], ...]  # (key, TensorSpec or constant), in call order

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> "CallSpec":
        kwargs = kwargs or {}
        conv = (lambda v: TensorSpec.of(v) if isinstance(v, torch.Tensor) else v)
        return cls(tuple(conv(a) for a in args), tuple((k, conv(v)) for k, v in kwargs.items()))

    def __str__(self) -> str:
        parts = [str(a) if isinstance(a, TensorSpec) else _short(a) for a in self.args]
        parts += [f"{k}={v if isinstance(v, TensorSpec) else _short(v)}" for k, v in self.kwargs]
        return f"({', '.join(parts)})"

    @property
    def tensor_specs(self) -> list[TensorSpec]:
        """Specs of the tensor arguments in flattening order (positional, then keyword)."""
        return [v for v in self.args if isinstance(v, TensorSpec)] + \
               [v for _, v in self.kwargs if isinstance(v, TensorSpec)]

    @property
    def kwarg_keys(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.kwargs)

    def tensor_kwarg_keys(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.kwargs if isinstance(v, TensorSpec))

    def flatten(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> list[torch.Tensor]:
        """The tensors of a call, positional then keyword, in this spec's order."""
        kwargs = kwargs or {}
        out = [a for a, s in zip(args, self.args) if isinstance(s, TensorSpec)]
        out += [kwargs[k] for k, s in self.kwargs if isinstance(s, TensorSpec)]
        return out

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with the tensor slots filled from ``tensors`` and the constants as captured."""
        it = iter(tensors)
        args = tuple(next(it) if isinstance(s, TensorSpec) else s for s in self.args)
        kwargs = {k: (next(it) if isinstance(s, TensorSpec) else s) for k, s in self.kwargs}
        return args, kwargs

    def make_static(self, fill: float = 1.0) -> list[torch.Tensor]:
        """Fresh static input tensors, one per tensor argument."""
        return [s.make(fill) for s in self.tensor_specs]

    def matches(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> bool:
        """``mismatch(args, kwargs) is None``, fast for the usual call of positional tensors only (the replay
        hot path); anything else goes through :meth:`mismatch`."""
        fast = self._positional_tensors
        if kwargs or fast is None or len(args) != len(fast):
            return self.mismatch(args, kwargs) is None
        for a, (shape, dtype, device, grad) in zip(args, fast):
            if type(a) is not torch.Tensor and not isinstance(a, torch.Tensor):
                return False
            if a.shape != shape or a.dtype != dtype or a.device != device or a.requires_grad != grad:
                return False
        return True

    @property
    def _positional_tensors(self):
        """``(shape, dtype, device, requires_grad)`` per argument if every argument is a positional tensor."""
        cached = self.__dict__.get("_fast", False)
        if cached is False:
            ok = not self.kwargs and all(isinstance(a, TensorSpec) for a in self.args)
            cached = tuple((a.shape, a.dtype, a.device, a.requires_grad) for a in self.args) if ok else None
            object.__setattr__(self, "_fast", cached)
        return cached

    def mismatch(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> str | None:
        """``None`` if the call matches this spec, else a sentence saying what differs."""
        kwargs = kwargs or {}
        if len(args) != len(self.args):
            return f"{len(args)} positional arguments, captured with {len(self.args)}"
        if tuple(kwargs) != self.kwarg_keys and set(kwargs) != set(self.kwarg_keys):
            return f"keyword arguments {sorted(kwargs)}, captured with {sorted(self.kwarg_keys)}"
        pairs = [(f"args[{i}]", a, s) for i, (a, s) in enumerate(zip(args, self.args))]
        pairs += [(f"kwargs[{k!r}]", kwargs[k], s) for k, s in self.kwargs]
        for name, value, spec in pairs:
            if isinstance(spec, TensorSpec):
                if not isinstance(value, torch.Tensor):
                    return f"{name} is {type(value).__name__}, captured as a tensor {spec}"
                if not spec.matches(value):
                    return f"{name} is {TensorSpec.of(value)}, captured as {spec}"
            elif isinstance(value, torch.Tensor) or not _same_constant(value, spec):
                return f"{name}={_short(value)} differs from the captured constant {_short(spec)}"
        return None


def _same_constant(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - objects without a usable __eq__
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def flatten_outputs(out: Any) -> tuple[list[torch.Tensor], Any]:
    """Outputs of a layer -> ``(tensors, structure)``; a layer returns a tensor or a tuple/list of tensors.

    Raises:
        TypeError: any other output (a graph can only return tensors).
    """
    if isinstance(out, torch.Tensor):
        return [out], None
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return list(out), type(out)
    raise TypeError(f"a graphed layer must return a tensor or a tuple of tensors, got {type(out).__name__}")


def unflatten_outputs(tensors: Sequence[torch.Tensor], structure: Any) -> Any:
    """Inverse of :func:`flatten_outputs`."""
    if structure is None:
        return tensors[0]
    return structure(tensors)
