"""The timeline recorder: start and end of every span of one rank, cheap enough to leave on in benchmarks.

On CPU a span costs two ``time.perf_counter_ns`` reads and one list append (about 1 us in CPython); on CUDA it
records two ``torch.cuda.Event`` s (from a pool reused across steps) on the current stream, resolved to times only
when the spans are collected, so recording never synchronizes the device.

Times are nanoseconds relative to the recorder's *anchor*: the moment :meth:`TimelineRecorder.anchor` returned
(after a barrier when a process group is given, so that ranks on different hosts share a time origin within one
barrier latency; on one host the monotonic clock is already common to all processes).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

__all__ = ["Span", "TimelineRecorder"]


@dataclass(frozen=True, slots=True)
class Span:
    """One recorded span of one rank.

    Attributes:
        category: ``"compute"``, ``"p2p"``, ``"graph"`` or ``"sync"`` (see :mod:`engine.runtime.tracing`).
        label: e.g. ``"F3.1"``, ``"recv act F2.0"``.
        start_ns, end_ns: nanoseconds since the recorder's anchor.
        step: the training step it belongs to (``-1`` outside :meth:`TimelineRecorder.step`).
        depth: nesting depth (0 = outermost span).
    """

    category: str
    label: str
    start_ns: int
    end_ns: int
    step: int = -1
    depth: int = 0

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def to_dict(self) -> dict:
        return asdict(self)


class _CpuClock:
    """Monotonic host clock: a mark is the time itself."""

    def mark(self):
        return time.perf_counter_ns()

    def resolve(self, marks, reuse=True):
        return list(marks)


class _CudaClock:
    """CUDA events on the current stream; a mark is an event, resolved against a reference event and host time."""

    def __init__(self, torch):
        self._torch = torch
        self._pool = []
        self._used = 0
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record()
        self._ref_host_ns = time.perf_counter_ns()

    def mark(self):
        if self._used == len(self._pool):
            self._pool.append(self._torch.cuda.Event(enable_timing=True))
        ev = self._pool[self._used]
        self._used += 1
        ev.record()
        return ev

    def resolve(self, marks, reuse=True):
        self._torch.cuda.synchronize()
        ref, host = self._ref, self._ref_host_ns
        out = [host + int(ref.elapsed_time(ev) * 1e6) for ev in marks]
        if reuse:  # no open span holds an event: the pool may be recycled
            self._used = 0
        else:
            self._pool, self._used = [], 0
        self._ref = self._torch.cuda.Event(enable_timing=True)
        self._ref.record()
        self._ref_host_ns = time.perf_counter_ns()
        return out


class TimelineRecorder:
    """A :class:`engine.runtime.tracing.Tracer` that records every span with its start and end time.

    Use ``with recorder.step(i): ...`` around each training step (so spans carry the step index), then
    :meth:`spans` to read them back.  Only one span context is live per nesting level, so ``span()`` returns the
    recorder itself (no allocation per span).

    Args:
        rank: pipeline rank recorded with the spans (used by the merged trace and the Gantt chart).
        device: ``"cpu"`` (monotonic clock) or ``"cuda"`` (CUDA events on the current stream).
        enabled: when False, ``span`` records nothing (still a valid tracer).

    Raises:
        ValueError: unknown ``device``, or ``"cuda"`` without an available CUDA device.
    """

    def __init__(self, rank: int = 0, device: str = "cpu", enabled: bool = True):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r} is unknown; use 'cpu' (monotonic clock) or 'cuda' (CUDA events)")
        if device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but torch.cuda.is_available() is False; use device='cpu'")
            self._clock = _CudaClock(torch)
        else:
            self._clock = _CpuClock()
        self.rank = rank
        self.device = device
        self.enabled = enabled
        self._anchor_ns = time.perf_counter_ns()
        self._pending: tuple[str, str] | None = None
        self._stack: list[tuple[str, str, object]] = []
        self._raw: list[tuple[str, str, object, object, int, int]] = []
        self._resolved: list[Span] = []
        self._step = -1

    # -- clock -------------------------------------------------------------------------------------------------
    def anchor(self, group=None) -> None:
        """Reset the time origin to now; with a process group, after a barrier on it (all ranks agree on zero)."""
        if group is not None:
            import torch.distributed as dist
            dist.barrier(group=group)
        self._flush()
        self._anchor_ns = time.perf_counter_ns()

    def now_ns(self) -> int:
        """Host time since the anchor (ns)."""
        return time.perf_counter_ns() - self._anchor_ns

    # -- tracer protocol -----------------------------------------------------------------------------------------
    def span(self, category: str, label: str) -> "TimelineRecorder":
        self._pending = (category, label)
        return self

    def __enter__(self) -> None:
        if self._pending is None:
            raise RuntimeError("TimelineRecorder entered without span(category, label); use `with rec.span(...)`")
        category, label = self._pending
        self._pending = None
        self._stack.append((category, label, self._clock.mark() if self.enabled else None))

    def __exit__(self, *exc) -> None:
        category, label, start = self._stack.pop()
        if self.enabled:
            self._raw.append((category, label, start, self._clock.mark(), self._step, len(self._stack)))

    # -- intervals (engine.runtime.tracing: begin / end, need not nest with the spans) ------------------------
    def begin(self, category: str, label: str):
        """Start an interval (e.g. an all-to-all in flight); returns the token for :meth:`end`."""
        return (category, label, self._clock.mark() if self.enabled else None, self._step)

    def end(self, token) -> None:
        """End the interval ``token`` of :meth:`begin` (recorded at depth 0)."""
        category, label, start, step = token
        if self.enabled:
            self._raw.append((category, label, start, self._clock.mark(), step, 0))

    # -- steps -----------------------------------------------------------------------------------------------
    def step(self, index: int) -> "_StepScope":
        """Context manager: spans recorded inside belong to training step ``index``."""
        return _StepScope(self, index)

    # -- results ---------------------------------------------------------------------------------------------
    def _flush(self) -> None:
        if not self._raw:
            return
        raw, self._raw = self._raw, []
        n = len(raw)
        times = self._clock.resolve([r[2] for r in raw] + [r[3] for r in raw], reuse=not self._stack)  # one sync
        anchor = self._anchor_ns
        for i, (cat, label, _, _, step, depth) in enumerate(raw):
            self._resolved.append(Span(cat, label, times[i] - anchor, times[n + i] - anchor, step, depth))

    def spans(self) -> list[Span]:
        """Every span recorded so far, in the order they ended (synchronizes the device on CUDA)."""
        self._flush()
        return list(self._resolved)

    def clear(self) -> None:
        """Forget the recorded spans (the anchor is kept)."""
        self._flush()
        self._resolved.clear()


class _StepScope:
    __slots__ = ("_rec", "_index", "_prev")

    def __init__(self, rec: TimelineRecorder, index: int):
        self._rec, self._index = rec, index

    def __enter__(self):
        self._prev = self._rec._step
        self._rec._step = self._index
        return self._rec

    def __exit__(self, *exc):
        self._rec._step = self._prev
