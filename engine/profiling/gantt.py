"""Gantt chart of an executed schedule, with each rank's measured bubble beside the simulator's prediction.

The measured spans of one step become :class:`engine.plan.plotting.Bar` s (actions coloured by ``F`` / ``B`` /
``W``; communication waits between actions, ``p2p``, and sync hooks, ``sync``, in their own colours) drawn by
:func:`engine.plan.plotting.plot_timeline`, the same chart the simulator draws for a plan.  The prediction runs
:func:`engine.plan.simulate.simulate` on the same plan with the *measured* mean cost of each ``(op, rank, chunk)`` and
no transfer time, so the two bubbles differ exactly by what the simulator's model leaves out (communication,
scheduling delays, runtime overhead).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from .bubble import measured_bubble, step_window, steps_of
from .costs import action_costs, parse_action_label, simulate_costs
from .timeline import Span

__all__ = ["parse_action_label", "action_costs", "simulated_bubble", "timeline_rows", "plot_measured_timeline"]
# parse_action_label and action_costs live in .costs; they are imported here for the callers that knew them here


def simulated_bubble(plan, rank_spans: Sequence[Sequence[Span]], steps: Sequence[int] | None = None):
    """The simulator's per-rank bubble for ``plan`` with the measured mean action costs (no transfer time).

    Returns ``(bubbles, simulation)``.  Raises ``ValueError`` if some ``(op, rank, chunk)`` of the plan was never
    measured.
    """
    costs = {k: ns / 1e6 for k, ns in action_costs(rank_spans, steps).items()}  # ms
    sim = simulate_costs(plan, costs)
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
        title += f"; bubble measured (right) / simulated at the measured costs: {sims}"
    out = plot_timeline(timeline_rows(rank_spans, step), Path(path), title, bubbles=measured, time_unit="ms")
    return {"path": str(out), "step": step, "measured_bubble": measured, "simulated_bubble": simulated,
            "step_ms": (hi - lo) / 1e6}
