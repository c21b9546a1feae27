"""Measured pipeline bubble: the fraction of a step each rank spends not computing.

For one step, the *window* is common to all ranks: from the earliest start to the latest end of any compute span
on any rank (the step's makespan).  A rank is *busy* while inside a ``compute`` or ``graph`` span and not inside a
``p2p`` or ``sync`` span nested in it (a wait inside an action is idle time).  Its bubble fraction is
``1 - busy / window``, the same definition as the simulator's (idle time over makespan, per rank), so the two can
be set side by side.  Reference for the bubble of 1F1B, ``(p-1)/(m+p-1)`` with equal stage costs: Narayanan et
al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21), section 2.2.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from .timeline import Span

__all__ = ["union_ns", "busy_ns", "step_window", "measured_bubble", "steps_of"]

BUSY = ("compute", "graph")
IDLE = ("p2p", "sync")


def _merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def union_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    return sum(e - s for s, e in _merge(intervals))


def _intersection_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def busy_ns(spans: Iterable[Span]) -> int:
    """Time covered by compute/graph spans minus the p2p/sync time nested inside them (ns)."""
    spans = list(spans)
    busy = _merge((s.start_ns, s.end_ns) for s in spans if s.category in BUSY)
    idle = _merge((s.start_ns, s.end_ns) for s in spans if s.category in IDLE)
    return sum(e - s for s, e in busy) - _intersection_ns(busy, idle)


def steps_of(rank_spans: Sequence[Iterable[Span]]) -> list[int]:
    """The step indices present in the spans (``-1``, spans outside a step, excluded), sorted."""
    return sorted({s.step for spans in rank_spans for s in spans if s.step >= 0})


def step_window(rank_spans: Sequence[Iterable[Span]], step: int | None = None) -> tuple[int, int]:
    """``(start_ns, end_ns)`` of the step's makespan over all ranks (``step=None``: all spans).

    Raises:
        ValueError: no compute span in that step.
    """
    starts, ends = [], []
    for spans in rank_spans:
        for s in spans:
            if s.category in BUSY and (step is None or s.step == step):
                starts.append(s.start_ns)
                ends.append(s.end_ns)
    if not starts:
        raise ValueError(f"no compute span recorded for step={step}; record spans inside recorder.step(i)")
    return min(starts), max(ends)


def measured_bubble(rank_spans: Sequence[Iterable[Span]], steps: Iterable[int] | None = None) -> list[float]:
    """Per rank, the bubble fraction averaged over ``steps`` (default: every recorded step, or all spans as one
    step when none was recorded inside ``recorder.step``).

    Returns:
        ``[bubble_rank0, bubble_rank1, ...]``, each in ``[0, 1]``.

    Raises:
        ValueError: a requested step has no compute span.
    """
    rank_spans = [list(s) for s in rank_spans]
    steps = list(steps) if steps is not None else (steps_of(rank_spans) or [None])
    totals = [0.0] * len(rank_spans)
    for step in steps:
        lo, hi = step_window(rank_spans, step)
        window = hi - lo
        for r, spans in enumerate(rank_spans):
            mine = [s for s in spans if step is None or s.step == step]
            totals[r] += 1.0 - busy_ns(mine) / window if window > 0 else 0.0
    return [t / len(steps) for t in totals]
