"""Discrete-event simulation of a plan: makespan, per-rank timeline, bubble and in-flight activations.

Model (the runtime's, see :mod:`engine.plan.validate`): each rank runs its actions in plan order, one at a time; an
action starts when the previous action of its rank has ended and its input message has arrived (producer's end
plus ``transfer_time``); sends never wait.  Compute costs are per op and optionally per ``(rank, chunk)``.

Closed forms the tests check (uniform costs, no transfer time; ``p`` ranks, ``m`` microbatches, ``v`` chunks):

* 1F1B (PipeDream-flush; Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21, eq. 1): bubble time ``(p-1)(t_f+t_b)`` per rank, i.e. a bubble fraction
  ``(p-1)/(m+p-1)`` of the makespan on every rank.
* Interleaved 1F1B (same paper, eq. 2): with per-chunk costs ``t_f/v``, ``t_b/v`` the bubble time shrinks to
  ``(p-1)(t_f+t_b)/v``, i.e. ``(p-1)/(v*m)`` of the ideal (busy) time ``m(t_f+t_b)``, for ``m`` a multiple of ``p``.
* Peak in-flight activations (forwards done whose backward has not finished): ``p-r`` on rank ``r`` for 1F1B
  (``m >= p``); ``W+1`` (warmup count + 1) for interleaved ranks whose warmup is below the total.

Cost: one linear pass over the validator's execution order (:func:`engine.plan.graph.deadlock_free_segments`, computed and
cached if the plan was not validated yet); ``benchmarks/plan_scale.py`` times it for P=64, C=8, M=1024.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Union

import numpy as np

from .graph import PlanGraph, deadlock_free_segments, memory_levels, plan_graph
from .plotting import Bar
from .types import Plan

__all__ = ["Cost", "Simulation", "simulate", "simulate_nominal", "max_buffered_messages"]

Cost = Union[float, Mapping[tuple[int, int], float], Sequence[Sequence[float]]]
"""A compute cost in time units: one number for every ``(rank, chunk)``, a mapping ``{(rank, chunk): cost}`` (every
pair present), or a nested sequence ``cost[rank][chunk]``."""


@dataclass(frozen=True, eq=False)
class Simulation:
    """Result of :func:`simulate`.  Times are in the cost unit; index ``i`` of a rank's lists is
    ``plan.actions[rank][i]``.

    Attributes:
        plan: the simulated plan.
        makespan: time at which the last action of any rank ends (the step time).
        busy: per rank, total compute time.
        peak_in_flight: per rank, the maximum number of ``(chunk, microbatch)`` activations held at once
            (forward done, backward -- the input-gradient pass when the plan splits it -- not yet finished);
            0 for forward-only plans, which keep nothing for a backward.
        peak_pending_w: per rank, the maximum number of weight-gradient passes pending at once (``B`` done,
            ``W`` not); 0 for plans without ``W``.
        transfer_time: the message latency used.
        flat_start, flat_end: start / end times of all actions in the global numbering of
            :class:`~engine.plan.graph.PlanGraph` (``base[rank] + i``).
        base: ``[P+1]`` offsets of each rank in the flat lists.
    """

    plan: Plan
    makespan: float
    busy: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_pending_w: tuple[int, ...]
    transfer_time: float
    flat_start: list[float]
    flat_end: list[float]
    base: tuple[int, ...]

    @cached_property
    def start(self) -> tuple[list[float], ...]:
        """Per rank, start time of every action."""
        return tuple(self.flat_start[a:b] for a, b in zip(self.base, self.base[1:]))

    @cached_property
    def end(self) -> tuple[list[float], ...]:
        """Per rank, end time of every action."""
        return tuple(self.flat_end[a:b] for a, b in zip(self.base, self.base[1:]))

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank, time not spent computing within the makespan."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble(self) -> tuple[float, ...]:
        """Per rank, bubble fraction ``idle / makespan`` (0 for an empty plan)."""
        return tuple(i / self.makespan if self.makespan > 0 else 0.0 for i in self.idle)

    @property
    def bubble_overall(self) -> float:
        """Idle fraction of all ranks together: ``sum(idle) / (P * makespan)``."""
        total = self.makespan * len(self.busy)
        return sum(self.idle) / total if total > 0 else 0.0

    @property
    def bubble_of_ideal(self) -> tuple[float, ...]:
        """Per rank, ``idle / busy``: the bubble relative to the ideal (compute-only) time, as in Megatron-LM's
        ``(p-1)/(v*m)``."""
        return tuple(i / b if b > 0 else 0.0 for i, b in zip(self.idle, self.busy))

    def bars(self) -> list[Bar]:
        """Every action as a :class:`~engine.plan.plotting.Bar` (for the Gantt chart) (``kind`` = ``"F"``, ``"B"`` or ``"W"``)."""
        out = []
        for rank, acts in enumerate(self.plan.actions):
            starts, ends = self.start[rank], self.end[rank]
            out.extend(Bar(rank, s, e, f"{a.microbatch}.{a.chunk}", a.op.value)
                       for a, s, e in zip(acts, starts, ends))
        return out


def simulate(plan: Plan, forward_time: Cost = 1.0, backward_time: Cost = 2.0, transfer_time: float = 0.0,
             weight_time: Cost = 0.0) -> Simulation:
    """Simulate one step of ``plan`` (model in the module doc).

    Args:
        plan: a valid plan (checked; see :func:`engine.plan.graph.plan_graph`).
        forward_time: cost of one forward of one model chunk (time units, e.g. ms).
        backward_time: cost of one backward (input and weight gradients unless the plan splits off ``W``).
        transfer_time: latency of every message (producer end to consumer availability), ``>= 0``.
        weight_time: cost of a split weight-gradient action (``W``; then ``backward_time`` is the input-gradient
            pass ``B`` alone).

    Raises:
        ValueError: a negative or non-finite cost, or a per-``(rank, chunk)`` cost of the wrong shape.
        PlanError: the plan is invalid or deadlocks.
    """
    _check_time("transfer_time", transfer_time)
    graph = plan_graph(plan)
    table = np.array([_cost_table(name, value, plan.pp_size, plan.num_model_chunks) for name, value in
                      (("forward_time", forward_time), ("backward_time", backward_time),
                       ("weight_time", weight_time))], dtype=np.float64)  # [op, rank, chunk]
    sizes = np.diff(np.asarray(graph.base, dtype=np.int64))
    rank_of = np.repeat(np.arange(plan.pp_size), sizes)
    mbs, stride = plan.num_microbatches, plan.num_model_chunks * plan.num_microbatches
    op = graph.keys // stride
    chunk = (graph.keys % stride) // mbs
    cost = table[op, rank_of, chunk]
    start, end, clock = _run(plan, graph, cost.tolist(), float(transfer_time))
    busy = tuple(float(cost[a:b].sum()) for a, b in zip(graph.base, graph.base[1:]))
    makespan = max(clock, default=0.0)
    levels = memory_levels(plan)
    return Simulation(plan, makespan, busy, tuple(x for x, _ in levels), tuple(w for _, w in levels),
                      float(transfer_time), start, end, graph.base)


def simulate_nominal(plan: Plan) -> Simulation:
    """:func:`simulate` of ``plan`` at nominal costs, before anything is measured: a forward 1, a backward 2 (a
    split plan: ``B`` 1 and ``W`` 1), no transfer time.  Its ``bubble_overall`` is a run's "simulated bubble" --
    what ``pipecast train`` prints at start-up and the ``--timeline`` summary repeats beside the simulation at the
    measured costs -- one definition for both."""
    if plan.splits_backward:
        return simulate(plan, 1.0, 1.0, 0.0, 1.0)
    return simulate(plan)


def _check_time(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid: use a finite number >= 0 (time units)")


def _cost_table(name: str, value: Cost, pp: int, chunks: int) -> list[list[float]]:
    """``[rank][chunk]`` costs from a number, a ``{(rank, chunk): cost}`` mapping or a nested sequence."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_time(name, value)
        return [[float(value)] * chunks for _ in range(pp)]
    if isinstance(value, Mapping):
        missing = [(r, c) for r in range(pp) for c in range(chunks) if (r, c) not in value]
        if missing:
            raise ValueError(f"{name} has no cost for (rank, chunk)={missing[0]}; give every (rank, chunk) of "
                             f"{pp} ranks x {chunks} chunks, or one number")
        rows = [[value[(r, c)] for c in range(chunks)] for r in range(pp)]
    elif isinstance(value, Sequence) and len(value) == pp and all(
            isinstance(row, Sequence) and len(row) == chunks for row in value):
        rows = [list(row) for row in value]
    else:
        raise ValueError(f"{name}={value!r} is invalid: use a number, a {{(rank, chunk): cost}} mapping or a "
                         f"[{pp}][{chunks}] nested list")
    for r, row in enumerate(rows):
        for c, x in enumerate(row):
            _check_time(f"{name}[{r}][{c}]", x)
    return [[float(x) for x in row] for row in rows]


def _run(plan: Plan, graph: PlanGraph, cost: list[float], transfer: float):
    """Times of every action: one pass over a deadlock-free execution order (:func:`deadlock_free_segments`).

    Any topological order gives the same times: an action starts at ``max(end of the rank's previous action,
    end of its producer + transfer)``.  Returns ``(start, end, clock)``: flat times and each rank's finishing time.
    """
    segments = deadlock_free_segments(plan)
    deps, n = graph.deps, graph.num_actions
    end = [0.0] * (n + 1)
    end[n] = -math.inf  # "receives nothing": always available
    start = [0.0] * n
    clock = [0.0] * plan.pp_size
    for rank, lo, hi in segments:
        t = clock[rank]
        for i in range(lo, hi):
            e = end[deps[i]] + transfer
            if e > t:
                t = e
            start[i] = t
            t += cost[i]
            end[i] = t
        clock[rank] = t
    end.pop()
    return start, end, clock


# -- buffering ---------------------------------------------------------------------------------------------------
def max_buffered_messages(plan: Plan, simulation=None, **costs) -> tuple[int, ...]:
    """Per rank, the peak number of messages received but not yet consumed (buffer memory of the receiver).

    A message is buffered on its receiver from its arrival (producer's end + transfer time) until its consuming
    action starts; arrivals at the very moment the consumer starts are not buffered.  Timing comes from
    ``simulation`` (a :class:`engine.plan.simulate.Simulation` of this plan) or from ``simulate(plan, **costs)``.

    Raises:
        PlanError: the plan is invalid.
        ValueError: ``simulation`` belongs to another plan.
    """
    if simulation is not None and simulation.plan is not plan:
        raise ValueError("simulation is of another plan: pass the Simulation that simulate(plan) returned for this "
                         "plan, or no simulation (it is then computed from the cost keywords)")
    sim = simulate(plan, **costs) if simulation is None else simulation
    graph = plan_graph(plan)
    n = graph.num_actions
    deps = np.asarray(graph.deps[:n], dtype=np.int64)
    start, end = np.asarray(sim.flat_start), np.asarray(sim.flat_end)
    consumers = np.flatnonzero(deps < n)
    arrival = end[deps[consumers]] + sim.transfer_time
    used = start[consumers]
    held = arrival < used
    consumers, arrival, used = consumers[held], arrival[held], used[held]
    peaks = []
    for rank in range(plan.pp_size):
        sel = (consumers >= graph.base[rank]) & (consumers < graph.base[rank + 1])
        times = np.concatenate([used[sel], arrival[sel]])
        delta = np.concatenate([-np.ones(int(sel.sum()), dtype=np.int64), np.ones(int(sel.sum()), dtype=np.int64)])
        order = np.lexsort((delta, times))  # at equal times, consumptions (-1) before arrivals (+1)
        level = np.cumsum(delta[order])
        peaks.append(int(level.max()) if level.size else 0)
    return tuple(peaks)
