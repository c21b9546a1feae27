"""Discrete-event simulation of a plan: makespan, per-rank timeline, bubble and in-flight activations.

Model (the runtime's, see :mod:`engine.plan.validate`): each rank runs its actions in plan order, one at a time; an
action starts when the previous action of its rank has ended and its input message has arrived (producer's end
plus ``transfer_time``; a hand-off between two chunks of one rank, as on the V placement's last rank, arrives at
once); sends never wait.  Compute costs are per op and optionally per ``(rank, chunk)``.

Mixture-of-experts all-to-all (``a2a_time``: the expert all-to-all time of one forward of a chunk -- dispatch and
combine of all its MoE layers; its backward exchanges as much): an action that runs alone waits for its
all-to-alls, so a forward costs ``t_F + a`` and a backward ``t_B + a``.  With ``overlap=True`` an overlapped cell
(:meth:`~engine.plan.types.Plan.overlap_cells`, run as :mod:`engine.runtime.overlap` runs it: both inputs first,
its outputs after it) is one unit of cost ``t_F + t_BW + max(0, a_F - t_BW) + max(0, a_B - t_F)`` with ``t_BW``
the backward's compute plus its ``W``: each side's all-to-all hides behind the other side's compute (DualPipe's
and Megatron's combined-1F1B overlap; two resources, compute and communication, as in DeepSeek-AI,
arXiv:2412.19437, sec. 3.2.1) and only the excess is exposed.  Every part of a cell is reported with the cell's
start and end.

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

__all__ = ["Cost", "Simulation", "simulate", "simulate_nominal", "max_buffered_messages", "placed_costs"]

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
             weight_time: Cost = 0.0, a2a_time: Cost = 0.0, overlap: bool = False) -> Simulation:
    """Simulate one step of ``plan`` (model in the module doc).

    Args:
        plan: a valid plan (checked; see :func:`engine.plan.graph.plan_graph`).
        forward_time: cost of one forward of one model chunk (time units, e.g. ms), without its all-to-alls.
        backward_time: cost of one backward (input and weight gradients unless the plan splits off ``W``).
        transfer_time: latency of every message between two ranks (producer end to consumer availability), ``>= 0``.
        weight_time: cost of a split weight-gradient action (``W``; then ``backward_time`` is the input-gradient
            pass ``B`` alone).
        a2a_time: expert all-to-all time of one forward (and of one backward) of a chunk (module doc).
        overlap: run the plan's overlapped cells as units that hide each side's all-to-all behind the other's
            compute (module doc); without it every action waits for its own all-to-alls.

    Raises:
        ValueError: a negative or non-finite cost, or a per-``(rank, chunk)`` cost of the wrong shape.
        PlanError: the plan is invalid or deadlocks.
    """
    _check_time("transfer_time", transfer_time)
    graph = plan_graph(plan)
    table = np.array([_cost_table(name, value, plan.pp_size, plan.num_model_chunks) for name, value in
                      (("forward_time", forward_time), ("backward_time", backward_time),
                       ("weight_time", weight_time), ("a2a_time", a2a_time))], dtype=np.float64)  # [op, r, c]
    sizes = np.diff(np.asarray(graph.base, dtype=np.int64))
    rank_of = np.repeat(np.arange(plan.pp_size), sizes)
    mbs, stride = plan.num_microbatches, plan.num_model_chunks * plan.num_microbatches
    op = graph.keys // stride
    chunk = (graph.keys % stride) // mbs
    compute = table[op, rank_of, chunk]
    a2a = np.where(op < 2, table[3, rank_of, chunk], 0.0)  # F and B exchange; W does not
    cells = [plan.overlap_cells(r) for r in range(plan.pp_size)] if overlap else []
    if any(cells):
        units = _cell_units(plan, graph, cells, compute, a2a, op)
        start, end, clock = _run_units(plan, graph, units, float(transfer_time))
        busy = tuple(sum(c for _, _, c in units[r]) for r in range(plan.pp_size))
    else:
        cost = compute + a2a
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


def placed_costs(plan: Plan, per_stage: Sequence[float], overhead: float = 0.0) -> list[list[float]]:
    """``[rank][chunk]`` costs (a :data:`Cost` for :func:`simulate`) from per-stage costs (one per virtual stage, in
    stage order: e.g. :func:`engine.plan.layout.stage_costs` of an uneven layout) through the plan's placement, each
    plus ``overhead``.

    Raises:
        ValueError: ``per_stage`` does not have one entry per stage of the plan.
    """
    if len(per_stage) != plan.num_stages:
        raise ValueError(f"{len(per_stage)} per-stage costs for a plan of {plan.num_stages} stages "
                         f"({plan.pp_size} ranks x {plan.num_model_chunks} chunks); give one per stage")
    return [[per_stage[plan.stage(r, c)] + overhead for c in range(plan.num_model_chunks)]
            for r in range(plan.pp_size)]


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
    deps, owner, n = graph.deps, graph.owner, graph.num_actions
    end = [0.0] * (n + 1)
    end[n] = -math.inf  # "receives nothing": always available
    start = [0.0] * n
    clock = [0.0] * plan.pp_size
    for rank, lo, hi in segments:
        t = clock[rank]
        for i in range(lo, hi):
            d = deps[i]
            e = end[d] + (transfer if owner[d] != rank else 0.0)
            if e > t:
                t = e
            start[i] = t
            t += cost[i]
            end[i] = t
        clock[rank] = t
    end.pop()
    return start, end, clock


def _cell_units(plan: Plan, graph: PlanGraph, cells, compute, a2a, op) -> list:
    """Per rank, its units in order as ``(lo, hi, cost)`` over global action indices: an overlapped cell (module
    doc's cost) or a single action (its compute plus its all-to-all)."""
    units = []
    for rank in range(plan.pp_size):
        base, n, at, mine = graph.base[rank], graph.base[rank + 1] - graph.base[rank], 0, []
        for lo, hi in list(cells[rank]) + [(n, n)]:
            mine += [(base + i, base + i + 1, float(compute[base + i] + a2a[base + i])) for i in range(at, lo)]
            if lo < n:
                idx = range(base + lo, base + hi)
                t_f = sum(float(compute[i]) for i in idx if op[i] == 0)
                t_bw = sum(float(compute[i]) for i in idx if op[i] != 0)
                a_f = sum(float(a2a[i]) for i in idx if op[i] == 0)
                a_b = sum(float(a2a[i]) for i in idx if op[i] != 0)
                mine.append((base + lo, base + hi, t_f + t_bw + max(0.0, a_f - t_bw) + max(0.0, a_b - t_f)))
            at = hi
        units.append(mine)
    return units


def _run_units(plan: Plan, graph: PlanGraph, units, transfer: float):
    """Times of every action when each rank runs ``units`` (:func:`_cell_units`) in order, a unit starting once
    the rank is free and every input of its actions has arrived: an event-driven pass like
    :func:`engine.plan.graph.deadlock_free_segments`.  Raises :class:`~engine.plan.graph.PlanError` at a
    deadlock (a cell waiting for an input its own outputs lead to)."""
    deps, n = graph.deps, graph.num_actions
    done = bytearray(n + 1)
    done[n] = 1
    end, start = [0.0] * (n + 1), [0.0] * n
    end[n] = -math.inf
    at, clock = [0] * plan.pp_size, [0.0] * plan.pp_size
    waiters: list[list[int]] = [[] for _ in range(plan.pp_size)]
    ready = list(range(plan.pp_size - 1, -1, -1))
    while ready:
        rank = ready.pop()
        mine, before = units[rank], at[rank]
        while at[rank] < len(mine):
            lo, hi, cost = mine[at[rank]]
            missing = next((deps[i] for i in range(lo, hi) if not done[deps[i]] and not lo <= deps[i] < hi), None)
            if missing is not None:
                waiters[graph.owner[missing]].append(rank)
                break
            t = max([clock[rank]] + [end[deps[i]] + (transfer if graph.owner[deps[i]] != rank else 0.0)
                                     for i in range(lo, hi)])
            for i in range(lo, hi):
                start[i], end[i], done[i] = t, t + cost, 1
            clock[rank] = t + cost
            at[rank] += 1
        if at[rank] > before:  # progress: wake the ranks waiting for this one
            ready.extend(waiters[rank])
            waiters[rank] = []
    stuck = [r for r in range(plan.pp_size) if at[r] < len(units[r])]
    if stuck:
        from .graph import PlanError
        lo = units[stuck[0]][at[stuck[0]]][0]
        r, i, action = graph.locate(plan, lo)
        raise PlanError(r, i, action, "deadlock: this overlapped cell waits for an input that depends on its own "
                                      "outputs; run the plan without overlap")
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
