"""Counting what graphs cost: bytes the captured graphs hold, the eager step's peak, ops and host time per replay.

* :func:`held_bytes` -- bytes of the distinct storages a :class:`graphs.dispatch.GraphSet` of the ``torch`` /
  ``emulate`` backend keeps for good (static inputs, outputs, grad-outputs, grad-inputs) plus its per-parameter
  gradient buffers, by category.  On the ``emulate`` backend these are exactly the tensors a real capture keeps
  outside its pool's transient blocks.
* :class:`LiveBytes` -- a dispatch mode that follows every tensor storage created inside it and reports the peak of
  the bytes alive at once (works on CPU and on the ``meta`` device, so GPU-sized configs can be counted here).
* :class:`OpCounter` -- a dispatch mode counting aten ops, with :meth:`OpCounter.paused` to leave out regions (the
  graph replay itself) so what remains is the host-side work around each replay.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["held_bytes", "LiveBytes", "OpCounter"]


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def held_bytes(graphs) -> dict[str, int]:
    """Bytes a captured :class:`GraphSet` (``torch``/``emulate``) holds, per category and ``"total"``.

    Categories: ``static_inputs``, ``static_outputs``, ``grad_outputs``, ``grad_inputs``, ``weight_inputs`` (split
    backward: the gradients ``B`` records for ``W``; each storage counted once, so chained buffers count once) and
    ``param_grad_buffers`` (the per-parameter accumulation buffers, which take
    the place of eager's ``param.grad``).  Units: bytes.
    """
    seen: set[int] = set()
    out = {"static_inputs": 0, "static_outputs": 0, "grad_outputs": 0, "grad_inputs": 0, "weight_inputs": 0}
    fields = (("static_inputs", "static_inputs"), ("static_outputs", "static_outputs"),
              ("grad_outputs", "static_grad_outputs"), ("grad_inputs", "static_grad_inputs"))
    for slot in graphs.callables:
        recorded = [g for r in getattr(slot, "static_weight_inputs", ()) for g in (r or ())]
        for category, tensors in [(c, getattr(slot, a)) for c, a in fields] + [("weight_inputs", recorded)]:
            for t in tensors:
                if t is not None and t.untyped_storage()._cdata not in seen:
                    seen.add(t.untyped_storage()._cdata)
                    out[category] += _nbytes(t)
    buffers = graphs.extra.get("grad_buffers")
    out["param_grad_buffers"] = buffers.nbytes() if buffers is not None else 0
    out["total"] = sum(out.values())
    return out


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created inside the mode and alive at the same time (``.peak``, ``.current()``).

    Storages are followed through weak references, so a tensor freed by Python or autograd stops counting; the
    live set is re-evaluated after every op.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[int, int]] = {}  # storage key -> (weak ref, nbytes)
        self.peak = 0

    def current(self) -> int:
        dead = [k for k, (ref, _) in self._live.items() if torch.UntypedStorage._expired(ref)]
        for k in dead:
            torch.UntypedStorage._free_weak_ref(self._live.pop(k)[0])
        return sum(n for _, n in self._live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata not in self._live:
                    self._live[s._cdata] = (s._weak_ref(), s.nbytes())
        self.peak = max(self.peak, self.current())
        return out

    def __exit__(self, *exc):
        for ref, _ in self._live.values():
            torch.UntypedStorage._free_weak_ref(ref)
        self._live = {}
        return super().__exit__(*exc)


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name (``.counts``, ``.total``); ops inside :meth:`paused` are not counted."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self._paused = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused:
            name = func._schema.name.split("::")[-1]
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
