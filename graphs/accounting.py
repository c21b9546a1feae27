"""Counting what graphs cost: bytes the captured graphs hold, the eager step's peak, ops and host time per replay.

* :func:`held_bytes` -- bytes of the distinct storages a :class:`graphs.dispatch.GraphSet` of the ``torch`` /
  ``emulate`` backend keeps for good (static inputs, outputs, grad-outputs, grad-inputs) plus its per-parameter
  gradient buffers, by category.  On the ``emulate`` backend these are exactly the tensors a real capture keeps
  outside its pool's transient blocks.
* :func:`pool_bytes` -- what the graphs' memory pool reserves: on the ``torch`` backend the caching allocator's
  segments of the graphs' private pool (``torch.cuda.memory_snapshot`` filtered by the pool id,
  :func:`pool_segments`); on the ``emulate`` backend its model of one, the peak of the bytes its capture walk
  allocated and kept alive at once (the blocks a pool must reserve when every freed block is reused, capture order
  = runtime order) and the bytes still alive after it.
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

__all__ = ["held_bytes", "pool_bytes", "pool_segments", "LiveBytes", "OpCounter"]


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


def pool_segments(snapshot: list[dict], pool_id) -> dict[str, int]:
    """Sum of the segments of ``snapshot`` (``torch.cuda.memory_snapshot()``'s list) owned by the memory pool
    ``pool_id`` (``torch.cuda.graph_pool_handle()``, matched against each segment's ``segment_pool_id``):
    ``{"reserved": total_size, "allocated": allocated_size, "segments": count}`` in bytes."""
    want = tuple(pool_id)
    mine = [seg for seg in snapshot if tuple(seg.get("segment_pool_id", ())) == want]
    return {"reserved": sum(seg["total_size"] for seg in mine),
            "allocated": sum(seg["allocated_size"] for seg in mine), "segments": len(mine)}


def pool_bytes(graphs) -> dict[str, int | None] | None:
    """What the memory pool of a captured :class:`GraphSet` reserves (module docstring), in bytes:
    ``{"reserved", "allocated", "segments"}`` -- ``torch``: the pool's segments now (synchronise first for a settled
    figure); ``emulate``: ``reserved`` = the capture's peak of live bytes, ``allocated`` = those alive after it,
    ``segments`` = ``None``.  ``None`` for other backends or without a pool."""
    if graphs is None:
        return None
    model = graphs.extra.get("pool_model")
    if model is not None:
        return {"reserved": model["peak"], "allocated": model["held"], "segments": None}
    pool_id = graphs.extra.get("pool_id")
    if pool_id is None or not torch.cuda.is_available():
        return None
    try:  # the installed torch (2.13) filters by pool itself; pool_segments filters again either way
        snapshot = torch.cuda.memory_snapshot(mempool_id=pool_id, include_traces=False)
    except Exception:  # noqa: BLE001 - an older signature, or a pool id it does not take: the whole snapshot
        snapshot = torch.cuda.memory_snapshot()
    return pool_segments(snapshot, pool_id)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created inside the mode and alive at the same time (``.peak``, ``.current()``).

    Storages are followed through weak references, so a tensor freed by Python or autograd stops counting; the
    live set is re-evaluated after every op, or with ``per_op=False`` only at :meth:`sample` (cheap enough to
    follow a whole capture; the peak is then the largest sample); ``.final`` is the live bytes when the mode
    exits.  Only plain tensors are followed: a wrapper subclass (DTensor) has no storage of its own, and the local
    tensors its ops create are made beneath the mode.
    """

    def __init__(self, per_op: bool = True):
        super().__init__()
        self._live: dict[int, tuple[int, int]] = {}  # storage key -> (weak ref, nbytes)
        self.peak = 0
        self.final = 0
        self.per_op = per_op

    def sample(self) -> int:
        """The live bytes now (the peak updated)."""
        now = self.current()
        self.peak = max(self.peak, now)
        return now

    def current(self) -> int:
        dead = [k for k, (ref, _) in self._live.items() if torch.UntypedStorage._expired(ref)]
        for k in dead:
            torch.UntypedStorage._free_weak_ref(self._live.pop(k)[0])
        return sum(n for _, n in self._live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter):
                s = t.untyped_storage()
                if s._cdata not in self._live:
                    self._live[s._cdata] = (s._weak_ref(), s.nbytes())
        if self.per_op:
            self.sample()
        return out

    def __exit__(self, *exc):
        self.final = self.sample()
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
