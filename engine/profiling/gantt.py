"""Gantt chart of an executed schedule, with each rank's measured bubble beside the simulator's prediction.

The measured spans of one step become :class:`engine.plan.plotting.Span` bars (actions coloured by ``F`` / ``B`` /
``W``; communication waits between actions, ``p2p``, and sync hooks, ``sync``, in their own colours) drawn by
:func:`engine.plan.plotting.plot_timeline`, the same chart the simulator draws for a plan.  The prediction runs
:func:`engine.plan.simulate.simulate` on the same plan with the *measured* mean cost of each ``(op, rank, chunk)`` and
no transfer time, so the two bubbles differ exactly by what the simulator's model leaves out (communication,
scheduling delays, runtime overhead).
"""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from ..plan.build import Action
from .bubble import measured_bubble, step_window, steps_of
from .timeline import Span

__all__ = ["parse_action_label", "action_costs", "simulated_bubble", "timeline_rows", "plot_measured_timeline"]

def parse_action_label(label: str) -> tuple[str, int, int] | None:
    """``"F3.1"`` (:meth:`engine.plan.build.Action.parse`) -> ``("F", 1, 3)`` (op, chunk, microbatch); ``None``
    for a label that is not an action's."""
    try:
        a = Action.parse(label)
    except ValueError:
        return None
    return a.op.value, a.chunk, a.microbatch


def action_costs(rank_spans: Sequence[Sequence[Span]], steps: Sequence[int] | None = None) -> dict:
    """Mean duration (ns) of each ``(op, rank, chunk)`` over the compute spans of ``steps`` (default: all)."""
    sums: dict[tuple[str, int, int], list[int]] = defaultdict(lambda: [0, 0])
    for rank, spans in enumerate(rank_spans):
        for s in spans:
            parsed = parse_action_label(s.label) if s.category == "compute" else None
            if parsed is None or (steps is not None and s.step not in steps):
                continue
            acc = sums[(parsed[0], rank, parsed[1])]
            acc[0] += s.duration_ns
            acc[1] += 1
    return {k: total / n for k, (total, n) in sums.items()}


def simulated_bubble(plan, rank_spans: Sequence[Sequence[Span]], steps: Sequence[int] | None = None):
    """The simulator's per-rank bubble for ``plan`` with the measured mean action costs (no transfer time).

    Returns ``(bubbles, simulation)``.  Raises ``ValueError`` if some ``(op, rank, chunk)`` of the plan was never
    measured.
    """
    from ..plan.simulate import simulate
    costs = action_costs(rank_spans, steps)
    tables = {}
    for op in ("F", "B", "W"):
        table = [[costs.get((op, r, c)) for c in range(plan.num_model_chunks)] for r in range(plan.pp_size)]
        needed = any(a.op.value == op for acts in plan.actions for a in acts)
        if needed and any(v is None for row in table for v in row):
            missing = [(r, c) for r, row in enumerate(table) for c, v in enumerate(row) if v is None]
            raise ValueError(f"no measured '{op}' span for (rank, chunk) {missing}; record a full step of the plan")
        tables[op] = [[(v or 0.0) / 1e6 for v in row] for row in table]  # ms
    sim = simulate(plan, forward_time=tables["F"], backward_time=tables["B"], weight_time=tables["W"])
    return list(sim.bubble), sim


def timeline_rows(rank_spans: Sequence[Sequence[Span]], step: int | None = None) -> list:
    """The bars of one step: compute/graph spans at nesting depth 0 and the p2p/sync spans outside them, times in
    ms from the step's start."""
    from ..plan.plotting import Bar
    lo, _ = step_window(rank_spans, step)
    rows = []
    for rank, spans in enumerate(rank_spans):
        for s in spans:
            if s.depth != 0 or (step is not None and s.step != step):
                continue
            parsed = parse_action_label(s.label) if s.category == "compute" else None
            kind = parsed[0] if parsed else s.category
            label = f"{parsed[2]}.{parsed[1]}" if parsed else ""
            rows.append(Bar(rank, (s.start_ns - lo) / 1e6, (s.end_ns - lo) / 1e6, label, kind))
    return rows


def plot_measured_timeline(rank_spans: Sequence[Sequence[Span]], path: str | os.PathLike, plan=None,
                           step: int | None = None, title: str | None = None) -> dict:
    """Draw the Gantt chart of one measured step (default: the last recorded step) to ``path`` (PNG).

    Returns ``{"path", "step", "measured_bubble", "simulated_bubble", "step_ms"}`` (``simulated_bubble`` is
    ``None`` without a plan).
    """
    from ..plan.plotting import plot_timeline
    steps = steps_of(rank_spans)
    if step is None and steps:
        step = steps[-1]
    measured = measured_bubble(rank_spans, [step])
    simulated = simulated_bubble(plan, rank_spans, [step] if step is not None else None)[0] if plan else None
    lo, hi = step_window(rank_spans, step)
    if title is None:
        what = f"{plan.schedule} pp={plan.pp_size} vp={plan.num_model_chunks} m={plan.num_microbatches}" \
            if plan else "measured timeline"
        title = f"{what}, step {step}: {(hi - lo) / 1e6:.1f} ms"
    if simulated is not None:  # one line: plot_timeline leaves room for a one-line title
        sims = (", ".join(f"r{r} {100 * b:.1f}%" for r, b in enumerate(simulated)) if len(simulated) <= 8
                else f"mean {100 * sum(simulated) / len(simulated):.1f}%")
        title += f"; bubble measured (right) / simulated: {sims}"
    out = plot_timeline(timeline_rows(rank_spans, step), Path(path), title, bubbles=measured, time_unit="ms")
    return {"path": str(out), "step": step, "measured_bubble": measured, "simulated_bubble": simulated,
            "step_ms": (hi - lo) / 1e6}
