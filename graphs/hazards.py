"""Frozen-replay hazards: what a CUDA graph freezes at capture that an eager re-run would not.

A replayed graph re-launches the captured kernels on the captured addresses; no Python runs.  So a layer that
works eagerly can be wrong, or fail, under a graph (torch's CUDA Graphs notes list the same constraints):

* **host syncs** -- ``.item()``, ``bool(tensor)`` (a data-dependent branch), ``nonzero``, ``masked_select``,
  ``unique``, a copy between the host and the device: illegal inside a capture, and a value read once is frozen;
* **randomness from an unregistered generator** -- an op that takes ``generator=g`` for a ``g`` the graphs do not
  know replays the same mask every time (pytorch#84614);
* **tensors read from outside the call** (parameters, buffers, closures) whose storage changes after capture --
  ``p.data = ...``, ``load_state_dict(assign=True)``, a rebound closure tensor: the graph keeps reading the old
  storage (TE PR #869);
* **Python state read in forward** (a scalar attribute, a Python-level branch): the graph replays the ops and
  constants of its capture.

:class:`HazardCheck` is a dispatch mode that sees every aten op of one layer call.  It raises :class:`HazardError`
at the first host sync or unregistered generator, naming the layer, the op and the user's source line; and it
records the call's *trace* (op names, scalar arguments, the storages of tensors read from outside the call), which
:meth:`HazardCheck.compare` checks against the capture-time trace on every emulated replay.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HazardError", "HazardCheck", "CallTrace", "HOST_SYNC_OPS"]

HOST_SYNC_OPS = {  # aten op name -> what the user wrote
    "_local_scalar_dense": ".item() / float(t) / bool(t) (a data-dependent branch)",
    "item": ".item()", "is_nonzero": "bool(t) (a data-dependent branch)", "equal": "torch.equal",
    "nonzero": "nonzero / torch.where(cond) (data-dependent shape)", "masked_select": "masked_select / t[mask]",
    "_unique": "unique", "_unique2": "unique", "unique_dim": "unique", "unique_consecutive": "unique_consecutive",
    "bincount": "bincount", "repeat_interleave": "repeat_interleave with tensor repeats",
}
_COPIES = {"_to_copy", "copy_", "copy", "to"}
_HERE = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.path.abspath(__file__)))


class HazardError(RuntimeError):
    """A layer does something a frozen graph replay would not reproduce."""


@dataclass
class CallTrace:
    """What one layer call did: ``ops`` (name + scalar arguments, in order) and ``external`` (storage key and a
    description of every tensor read that the call did not produce, in first-use order)."""

    ops: list[tuple] = field(default_factory=list)
    external: list[tuple[int, str]] = field(default_factory=list)


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def _user_line() -> str:
    """``file:line in function`` of the innermost frame outside torch and graphs (where the user wrote the op)."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_HERE):
            return f"{os.path.relpath(frame.filename)}:{frame.lineno} in {frame.name}"
    return "?"


def _storage_key(t: torch.Tensor) -> int:
    """The storage identity of ``t``; a wrapper subclass (DTensor: a fresh wrapper per call, no storage of its own)
    is identified by its first inner tensor (``__tensor_flatten__``: the local shard)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        return _storage_key(getattr(t, inner[0]))
    return t.untyped_storage()._cdata


class HazardCheck(TorchDispatchMode):
    """Dispatch mode over one layer call: raises on host syncs and unregistered generators, records a trace.

    Args:
        where: names the layer in messages (``"chunk 0 layer 1 (Block)"``).
        generators: generators registered with the graphs (the device's default generator always is).
        names: storage key -> name (``"parameter fc1.weight"``, ``"argument 0"``) for the messages.
    """

    def __init__(self, where: str, generators: Sequence[torch.Generator] = (), names: dict[int, str] | None = None):
        super().__init__()
        self.where = where
        self.generators = list(generators)
        self.names = names or {}
        self.trace = CallTrace()
        self._produced: set[int] = set()
        self._seen: set[int] = set()

    def _fail(self, what: str, fix: str) -> None:
        raise HazardError(f"{self.where}: {what} at {_user_line()}; {fix}")

    def _check_op(self, name: str, args, kwargs) -> None:
        if name in HOST_SYNC_OPS and not (name == "repeat_interleave" and not isinstance(args[0], torch.Tensor)):
            self._fail(f"aten.{name} ({HOST_SYNC_OPS[name]}) is a host sync",
                       "a CUDA graph cannot capture it and would freeze the value it reads -- keep the value on the "
                       "device (torch.where, masks) or compute it outside the graphed layer")
        gen = kwargs.get("generator")
        if gen is not None and not any(_same(gen, g) for g in self.generators) and not _same(gen, _default_for(gen)):
            self._fail(f"aten.{name} draws from a torch.Generator that is not registered with the graphs",
                       "a replay would repeat the same random numbers (pytorch#84614) -- pass the generator in "
                       "capture(generators=...) / GraphRuntime(generators=...)")
        if name in _COPIES:
            self._check_copy(name, args, kwargs)

    def _check_copy(self, name, args, kwargs) -> None:
        src = args[1] if name == "copy_" else args[0]
        dst = kwargs.get("device") if name != "copy_" else args[0].device
        if not isinstance(src, torch.Tensor) or dst is None:
            return
        kinds = {src.device.type, torch.device(dst).type}
        if "cpu" in kinds and len(kinds) > 1:
            self._fail(f"aten.{name} copies between the host and {sorted(kinds - {'cpu'})[0]}",
                       "a graph copies the host memory of its capture on every replay (a pageable copy also "
                       "syncs) -- move the data before the graphed layer")

    def _record(self, name: str, args, kwargs, out) -> None:
        flat, _ = tree_flatten((args, kwargs))
        scalars = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                key = _storage_key(a)
                if key not in self._produced and key not in self._seen:
                    self._seen.add(key)
                    self.trace.external.append((key, self.names.get(key, f"a {tuple(a.shape)} tensor")))
            elif isinstance(a, (int, float, bool, str, torch.dtype)) or a is None:
                scalars.append(a)
        self.trace.ops.append((name, tuple(scalars)))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage_key(t) not in self._seen:
                self._produced.add(_storage_key(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        self._check_op(name, args, kwargs)
        out = func(*args, **kwargs)
        self._record(name, args, kwargs, out)
        return out

    def compare(self, captured: CallTrace) -> None:
        """Raise :class:`HazardError` if this call's trace differs from the capture-time ``captured`` one."""
        mine = self.trace
        for i, (a, b) in enumerate(zip(captured.ops, mine.ops)):
            if a != b:
                raise HazardError(
                    f"{self.where}: op {i} is aten.{b[0]}{list(b[1])} but the graph captured aten.{a[0]}{list(a[1])}"
                    f" -- the layer reads Python state or branches on data; a graph replays its captured ops and "
                    f"constants only")
        if len(captured.ops) != len(mine.ops):
            raise HazardError(f"{self.where}: {len(mine.ops)} ops but the graph captured {len(captured.ops)} -- the "
                              f"layer branches on Python state; a graph replays its captured ops only")
        old = dict(captured.external)
        for key, desc in mine.external:
            if key not in old:
                raise HazardError(
                    f"{self.where}: reads {desc} from storage the graph did not capture -- it was replaced (p.data = "
                    f"..., load_state_dict(assign=True), a rebound closure tensor); the graph keeps reading the old "
                    f"storage: update tensors in place (p.copy_(new)) or recapture")


def _same(a: torch.Generator, b: torch.Generator) -> bool:
    """One generator (dispatch hands ops a fresh Python wrapper of the same C++ generator)."""
    return a._cdata == b._cdata


def _default_for(gen: torch.Generator) -> torch.Generator:
    if gen.device.type == "cuda":
        return torch.cuda.default_generators[gen.device.index or 0]
    return torch.default_generator


def storage_names(module: torch.nn.Module, static_inputs: Sequence[torch.Tensor]) -> dict[int, str]:
    """Storage key -> name for a layer's parameters, buffers and static inputs (for :class:`HazardCheck`)."""
    names = {_storage_key(t): f"argument {i}" for i, t in enumerate(static_inputs)}
    names.update({_storage_key(p): f"parameter {n}" for n, p in module.named_parameters()})
    names.update({_storage_key(b): f"buffer {n}" for n, b in module.named_buffers()})
    return names


def describe(module: Any, chunk: int, layer: int) -> str:
    return f"chunk {chunk} layer {layer} ({type(module).__name__})"


class GeneratorsSeen(TorchDispatchMode):
    """Dispatch mode collecting every non-default ``torch.Generator`` passed to an op (``.generators``, in first-use
    order): the generators a graph must register so that its random numbers advance per replay."""

    def __init__(self, into: list[torch.Generator] | None = None):
        super().__init__()
        self.generators = into if into is not None else []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gen = kwargs.get("generator")
        if gen is not None and not _same(gen, _default_for(gen)) and not any(_same(gen, g) for g in self.generators):
            self.generators.append(gen)
        return func(*args, **kwargs)
