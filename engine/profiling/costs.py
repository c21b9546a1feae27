"""Per-action costs from recorded spans, as the simulator takes them (``engine.plan.simulate``): the median
duration of each ``(op, rank, chunk)`` and the runtime's time per action outside compute and communication."""
from __future__ import annotations

import statistics

from .bubble import steps_of, union_ns
from .gantt import parse_action_label

__all__ = ["median_action_ms", "action_overhead_ms", "simulate_measured"]


def simulate_measured(plan, rank_spans, transfer_ms: float = 0.0):
    """:func:`engine.plan.simulate.simulate` of ``plan`` with the median measured cost of each ``(op, rank,
    chunk)`` plus the measured per-action overhead, and ``transfer_ms`` per message.

    Raises ``ValueError`` if some ``(op, rank, chunk)`` of the plan was never measured."""
    from ..plan.simulate import simulate
    costs, overhead = median_action_ms(rank_spans), action_overhead_ms(rank_spans)
    tables = {}
    for op in ("F", "B", "W"):
        needed = any(a.op.value == op for acts in plan.actions for a in acts)
        missing = [(r, c) for r in range(plan.pp_size) for c in range(plan.num_model_chunks) if (op, r, c) not in costs]
        if needed and missing:
            raise ValueError(f"no measured '{op}' span for (rank, chunk) {missing}; record a full step of the plan")
        tables[op] = [[costs.get((op, r, c), 0.0) + (overhead if needed else 0.0) for c in range(plan.num_model_chunks)]
                      for r in range(plan.pp_size)]
    return simulate(plan, tables["F"], tables["B"], transfer_ms, tables["W"])


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
