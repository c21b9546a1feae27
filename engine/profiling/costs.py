"""Per-action costs from recorded spans, as the simulator takes them (:func:`engine.plan.simulate.simulate`): the
mean or median duration of each ``(op, rank, chunk)``, the runtime's time per action outside compute and
communication, and the plan simulated with them."""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Sequence

from ..plan.build import Action
from .bubble import steps_of, union_ns
from .timeline import Span

__all__ = ["parse_action_label", "action_costs", "median_action_ms", "action_overhead_ms", "simulate_costs",
           "simulate_measured"]


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


def median_action_ms(rank_spans) -> dict:
    """Median duration (ms) of each ``(op, rank, chunk)``'s compute spans: the median, not the mean, so that a
    few actions slowed by other work on the machine do not move the cost."""
    durations: dict = {}
    for rank, spans in enumerate(rank_spans):
        for s in spans:
            parsed = parse_action_label(s.label) if s.category == "compute" else None
            if parsed is not None:
                durations.setdefault((parsed[0], rank, parsed[1]), []).append(s.duration_ns / 1e6)
    return {k: statistics.median(v) for k, v in durations.items()}


def action_overhead_ms(rank_spans) -> float:
    """Median over ranks and steps of (the rank's span of the step - time covered by its spans) / its actions."""
    values = []
    for step in steps_of(rank_spans):
        for spans in rank_spans:
            top = [s for s in spans if s.step == step and s.depth == 0]
            actions = sum(1 for s in top if s.category == "compute")
            if actions:
                window = max(s.end_ns for s in top) - min(s.start_ns for s in top)
                values.append((window - union_ns((s.start_ns, s.end_ns) for s in top)) / actions / 1e6)
    return statistics.median(values) if values else 0.0


def simulate_costs(plan, costs_ms: dict, overhead_ms: float = 0.0, transfer_ms: float = 0.0):
    """:func:`engine.plan.simulate.simulate` of ``plan`` with ``costs_ms[(op, rank, chunk)]`` (ms) plus
    ``overhead_ms`` per action, and ``transfer_ms`` per message.

    Raises ``ValueError`` if some ``(op, rank, chunk)`` the plan runs has no cost (a step was not fully recorded).
    """
    from ..plan.simulate import simulate
    tables = {}
    for op in ("F", "B", "W"):
        needed = any(a.op.value == op for acts in plan.actions for a in acts)
        missing = [(r, c) for r in range(plan.pp_size) for c in range(plan.num_model_chunks)
                   if (op, r, c) not in costs_ms]
        if needed and missing:
            raise ValueError(f"no measured '{op}' span for (rank, chunk) {missing}; record a full step of the plan")
        tables[op] = [[costs_ms.get((op, r, c), 0.0) + (overhead_ms if needed else 0.0)
                       for c in range(plan.num_model_chunks)] for r in range(plan.pp_size)]
    return simulate(plan, tables["F"], tables["B"], transfer_ms, tables["W"])


def simulate_measured(plan, rank_spans, transfer_ms: float = 0.0):
    """:func:`simulate_costs` with the median measured cost of each ``(op, rank, chunk)`` and the measured
    per-action overhead (:func:`median_action_ms`, :func:`action_overhead_ms`)."""
    return simulate_costs(plan, median_action_ms(rank_spans), action_overhead_ms(rank_spans), transfer_ms)
