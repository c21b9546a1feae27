"""Split-backward (zero-bubble) plans: ZB-H1, ZB-V and memory-budgeted plans, built by one list scheduler.

Qi et al. ("Zero Bubble Pipeline Parallelism", ICLR 2024) split each backward into an input-gradient pass ``B``
and a weight-gradient pass ``W``.  ``W`` depends only on its own ``B`` and sends nothing, so it can fill the bubbles
a rank would otherwise spend waiting.  pipecast builds these plans by one deterministic list scheduler run on
nominal costs (``F = B = W = 1`` unless given), in the spirit of the paper's automatic scheduler:

* each rank, whenever it is free, runs the first available of: a ``B`` whose gradient has arrived (deepest stage
  first), an ``F`` whose activation has arrived (deepest stage first), a pending ``W`` (oldest first); else it
  waits for the next arrival;
* memory: a microbatch is admitted on a rank by the ``F`` of the rank's first chunk only if the activations
  reserved by admitted microbatches (one per chunk of the rank each will pass, released by each ``B``) stay within
  the rank's limit; later chunks' ``F`` never wait for memory, so the limit can never deadlock the pipeline and
  the activations held (forward done, ``B`` not) never exceed it;
* a rank whose pending ``W`` count reached its limit runs a ``W`` before anything else;
* ``F`` and ``B`` of one model chunk run in microbatch order, ``W`` first-in first-out, so each chunk's weight
  gradients accumulate in microbatch order (the order of 1F1B: the sums are the same).

Schedules (``P`` ranks, ``M`` microbatches):

* ``zb_h1``: looped placement, one chunk per rank, in-flight limit ``min(P - r, M)`` on rank ``r`` -- 1F1B's
  activation memory; ``W`` passes fill the cooldown, bubble ``(P-1)(F+B-W)`` for equal costs (paper, sec. 3.1).
* ``zbv``: V placement (:func:`engine.plan.types.v_placement`), two chunks per rank, in-flight limit ``2P``
  chunk activations on every rank (each chunk holds half a rank's layers: 1F1B's peak), near-zero bubble when
  ``F = B = W``.
* ``zb``: looped placement, ``C`` chunks, any per-rank in-flight limit: ``P - r`` gives ZB-H1-like plans, about
  ``2P`` ZB-H2-like plans with no bubble.

The plans are deadlock-free by construction (they are a simulated execution) and are checked by
:func:`engine.plan.validate.validate_plan` like every plan, including the in-flight and pending-``W`` limits they
carry.  Pure: no torch.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from .types import Action, Op, Plan, placement_of

__all__ = ["ZeroBubbleCosts", "list_schedule", "zero_bubble_plan", "zb_h1_limits", "zbv_limits",
           "budget_limits", "per_rank"]

_OPS = {"F": Op.FORWARD, "B": Op.BACKWARD, "W": Op.WEIGHT}


@dataclass(frozen=True)
class ZeroBubbleCosts:
    """Nominal costs the list scheduler orders by (time units); the plan's order, not these, is what runs."""

    forward: float = 1.0
    backward: float = 1.0
    weight: float = 1.0
    transfer: float = 0.0


class _Rank:
    """One rank's state in the list scheduler."""

    def __init__(self, rank: int, stages: list[int], in_flight_limit: int, pending_w_limit: int):
        self.rank, self.stages = rank, stages          # stages[c] = virtual stage of chunk c
        self.next_f = [0] * len(stages)                # next microbatch to run F for, per chunk
        self.next_b = [0] * len(stages)
        self.pending_w: list[tuple[int, int]] = []     # (chunk, microbatch) with B done, W not, oldest first
        self.in_flight = 0
        self.reserved = 0                              # activations reserved by microbatches admitted here
        self.entry = min(range(len(stages)), key=lambda c: stages[c])  # the chunk where microbatches enter
        self.in_flight_limit, self.pending_w_limit = in_flight_limit, pending_w_limit
        self.clock = 0.0
        self.actions: list[tuple[str, int, int]] = []
        self.peak_in_flight = self.peak_pending_w = 0


def list_schedule(placement, pp_size: int, num_microbatches: int, in_flight_limit, pending_w_limit=None,
                  costs: ZeroBubbleCosts = ZeroBubbleCosts(), forward_only: bool = False):
    """Order every rank's ``F`` / ``B`` / ``W`` actions by the list scheduler of the module doc.

    Args:
        placement: stage -> ``(rank, chunk)`` (see :data:`engine.plan.types.Placement`).
        in_flight_limit / pending_w_limit: per rank, the limits (``pending_w_limit`` None: no limit).
        forward_only: forwards only (evaluation plans of the same placement).

    Returns:
        ``(actions, peaks)``: per rank a list of ``(op, chunk, microbatch)`` with op ``"F"``, ``"B"`` or ``"W"``,
        and per rank ``(peak in-flight activations, peak pending W)`` of that order.

    Raises:
        ValueError: a limit below 1 (no forward could ever run).
    """
    num_stages = len(placement)
    ranks = [_Rank(r, [s for s, (rr, _) in sorted(enumerate(placement), key=lambda x: x[1][1]) if rr == r],
                   in_flight_limit[r], None if pending_w_limit is None else pending_w_limit[r])
             for r in range(pp_size)]
    for rk in ranks:
        if rk.in_flight_limit < 1 or (rk.pending_w_limit is not None and rk.pending_w_limit < 1):
            raise ValueError(f"rank {rk.rank}: in-flight limit {rk.in_flight_limit} and pending-W limit "
                             f"{rk.pending_w_limit} must be >= 1, else no forward can run")
    arrivals: dict[tuple[str, int, int], float] = {}   # ("act"|"grad", stage, microbatch) -> time available
    total = sum(len(rk.stages) for rk in ranks) * num_microbatches * (1 if forward_only else 3)
    done, heap, parked = 0, [(0.0, r) for r in range(pp_size)], {}
    while done < total:
        if not heap:
            raise RuntimeError(f"list scheduler stuck: ranks {sorted(parked)} wait for inputs nobody produces")
        t, r = heapq.heappop(heap)
        rk = ranks[r]
        step = _next_action(rk, t, arrivals, num_stages, num_microbatches, forward_only)
        if step is None:
            wake = _next_arrival(rk, t, arrivals, num_stages, num_microbatches, forward_only)
            if wake is None:
                parked[r] = t  # nothing is on its way yet: re-examined once another rank publishes something
            else:
                heapq.heappush(heap, (wake, r))
            continue
        rk.clock = t + _run(rk, step, t, arrivals, placement, num_stages, costs)
        done += 1
        heapq.heappush(heap, (rk.clock, r))
        for q, tq in parked.items():
            heapq.heappush(heap, (tq, q))
        parked.clear()
    return [rk.actions for rk in ranks], [(rk.peak_in_flight, rk.peak_pending_w) for rk in ranks]


def _ready(rk: _Rank, kind: str, chunk: int, t: float, arrivals, num_stages: int, mbs: int) -> bool:
    s = rk.stages[chunk]
    if kind == "F":
        mb = rk.next_f[chunk]
        return mb < mbs and (s == 0 or arrivals.get(("act", s, mb), float("inf")) <= t)
    mb = rk.next_b[chunk]
    return mb < rk.next_f[chunk] and (s == num_stages - 1 or arrivals.get(("grad", s, mb), float("inf")) <= t)


def _next_action(rk: _Rank, t: float, arrivals, num_stages: int, mbs: int, forward_only: bool):
    """The action the rank runs now at time ``t`` (``(op, chunk)``), or None to wait."""
    deepest = sorted(range(len(rk.stages)), key=lambda c: -rk.stages[c])
    if rk.pending_w and rk.pending_w_limit is not None and len(rk.pending_w) >= rk.pending_w_limit:
        return ("W", rk.pending_w[0][0])
    if not forward_only:
        for c in deepest:
            if _ready(rk, "B", c, t, arrivals, num_stages, mbs):
                return ("B", c)
    for c in deepest:
        if _ready(rk, "F", c, t, arrivals, num_stages, mbs) and (
                forward_only or c != rk.entry or rk.reserved + len(rk.stages) <= rk.in_flight_limit):
            return ("F", c)
    if rk.pending_w:
        return ("W", rk.pending_w[0][0])
    return None


def _next_arrival(rk: _Rank, t: float, arrivals, num_stages: int, mbs: int, forward_only: bool):
    """Earliest future time at which one of the rank's next inputs is available (None: nothing is coming yet)."""
    times = []
    for c, s in enumerate(rk.stages):
        if rk.next_f[c] < mbs and s > 0:
            times.append(arrivals.get(("act", s, rk.next_f[c])))
        if not forward_only and rk.next_b[c] < rk.next_f[c] and s < num_stages - 1:
            times.append(arrivals.get(("grad", s, rk.next_b[c])))
    times = [x for x in times if x is not None and x > t]
    return min(times, default=None)


def _run(rk: _Rank, step, t: float, arrivals, placement, num_stages: int, costs: ZeroBubbleCosts) -> float:
    """Record ``step`` on the rank at time ``t``; publish its output; return its cost."""
    op, c = step
    s = rk.stages[c]
    if op == "F":
        mb = rk.next_f[c]
        rk.next_f[c] += 1
        rk.in_flight += 1
        if c == rk.entry:  # admit the microbatch: one activation for each chunk of this rank it will pass
            rk.reserved += len(rk.stages)
        cost = costs.forward
        if s < num_stages - 1:
            local = placement[s + 1][0] == rk.rank
            arrivals[("act", s + 1, mb)] = t + cost + (0.0 if local else costs.transfer)
    elif op == "B":
        mb = rk.next_b[c]
        rk.next_b[c] += 1
        rk.in_flight -= 1
        rk.reserved -= 1
        rk.pending_w.append((c, mb))
        cost = costs.backward
        if s > 0:
            local = placement[s - 1][0] == rk.rank
            arrivals[("grad", s - 1, mb)] = t + cost + (0.0 if local else costs.transfer)
    else:
        c, mb = rk.pending_w.pop(0)
        cost = costs.weight
    rk.actions.append((op, c, mb))
    rk.peak_in_flight = max(rk.peak_in_flight, rk.in_flight)
    rk.peak_pending_w = max(rk.peak_pending_w, len(rk.pending_w))
    return cost


def zb_h1_limits(pp_size: int, num_microbatches: int, num_model_chunks: int, max_in_flight=None):
    """ZB-H1's per-rank ``(in-flight limits, pending-W limits)``: ``min(P - r, M)`` and ``P`` (module doc)."""
    return tuple(min(pp_size - r, num_microbatches) for r in range(pp_size)), (pp_size,) * pp_size


def zbv_limits(pp_size: int, num_microbatches: int, num_model_chunks: int, max_in_flight=None):
    """ZB-V's per-rank limits: ``max_in_flight`` (default ``2P`` chunk activations, 1F1B's peak) for both the
    activations held and the pending ``W`` (module doc).

    Raises:
        ValueError: as :func:`budget_limits`.
    """
    return budget_limits(pp_size, num_microbatches, num_model_chunks, max_in_flight, default=2 * pp_size)


def budget_limits(pp_size: int, num_microbatches: int, num_model_chunks: int, max_in_flight=None,
                  default: int | None = None):
    """The memory-budgeted schedule's limits: ``max_in_flight`` (one number or one per rank; default ``default``
    on every rank, else ``C*(P - r)``, 1F1B's) for both activations held and pending ``W``.

    Raises:
        ValueError: ``max_in_flight`` is not a number >= 1 or one per rank.
    """
    P, C = pp_size, num_model_chunks
    if max_in_flight is None:
        limits = (default,) * P if default is not None else tuple(C * (P - r) for r in range(P))
    else:
        limits = per_rank("max_in_flight", max_in_flight, P)
    return limits, limits


def per_rank(name: str, value, pp_size: int) -> tuple[int, ...]:
    """``value`` (one integer >= 1, or one per rank) as a per-rank tuple.

    Raises:
        ValueError: naming ``name`` and the fix.
    """
    limits = (value,) * pp_size if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        limits = tuple(limits)
    except TypeError:
        limits = ()
    if len(limits) != pp_size or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in limits):
        raise ValueError(f"{name}={value!r} is invalid: use a number >= 1 or one per pipeline rank ({pp_size} "
                         f"numbers)")
    return limits


def zero_bubble_plan(name: str, placement: str, limits, pp_size: int, num_microbatches: int,
                     num_model_chunks: int, forward_only: bool = False, max_in_flight=None, max_pending_w=None,
                     costs=None) -> Plan:
    """The plan named ``name`` of a split-backward schedule over placement ``placement`` (``"looped"`` or ``"v"``)
    under ``limits(P, M, C, max_in_flight)`` (e.g. :func:`zb_h1_limits`), ``max_pending_w`` (one number or one
    per rank) replacing its pending-``W`` limit: the list scheduler of the module doc, or with ``costs`` (a
    :class:`~engine.plan.pass_costs.PassCosts`) the cost-aware order of :mod:`engine.plan.cost_aware`.

    Raises:
        ValueError: as ``limits`` raises, a bad ``max_pending_w``, or (cost-aware) no order fits the limits.
    """
    stage_map = placement_of(placement, pp_size, num_model_chunks)
    in_flight, pending = limits(pp_size, num_microbatches, num_model_chunks, max_in_flight)
    if max_pending_w is not None:
        pending = per_rank("max_pending_w", max_pending_w, pp_size)
    if costs is not None and not forward_only:
        return _cost_aware_plan(name, stage_map, pp_size, num_microbatches, costs, in_flight, pending,
                                max_pending_w is not None)
    order, _ = list_schedule(stage_map, pp_size, num_microbatches, in_flight, pending, forward_only=forward_only)
    limits_held = (None, None) if forward_only else (in_flight, pending)
    return _plan(name, stage_map, pp_size, num_model_chunks, num_microbatches, forward_only, _actions(order),
                 *limits_held)


def _actions(order) -> tuple[tuple[Action, ...], ...]:
    shared: dict = {}
    return tuple(tuple(shared.setdefault(a, Action(_OPS[a[0]], a[1], a[2])) for a in acts) for acts in order)


def _plan(name, stage_map, pp_size, chunks, mbs, forward_only, actions, in_flight, pending) -> Plan:
    warmup = tuple(next((i for i, a in enumerate(acts) if a.op is not Op.FORWARD), len(acts)) for acts in actions)
    return Plan(name, pp_size, chunks, mbs, mbs, forward_only, warmup, actions, stage_map, in_flight, pending)


def _cost_aware_plan(name, stage_map, pp_size, mbs, costs, in_flight, pending, pending_given: bool) -> Plan:
    """The cost-aware plan (:func:`engine.plan.cost_aware.cost_aware_order`): the activation budget is
    ``in_flight``; the pending-``W`` limit is ``pending`` when given or when ``costs.weight_memory`` is 0 (pending
    ``W`` then hold no budget, so they keep the schedule's own limit), else none (the budget bounds them).  The
    list scheduler's plans of these limits (and, with one chunk, ZB-H1's) are tried as they are; its order under
    the mean costs seeds the search."""
    from .cost_aware import cost_aware_order, mean_costs
    chunks = len(stage_map) // pp_size
    weighted = any(x > 0 for row in costs.table("weight_memory", pp_size, chunks) for x in row)
    cap = pending if pending_given or not weighted else None
    caps = cap or (None,) * pp_size
    shapes = [((in_flight, pending), ZeroBubbleCosts(), True),
              ((in_flight, caps), ZeroBubbleCosts(*mean_costs(costs, pp_size, chunks)), False)]
    if chunks == 1:
        shapes.append((zb_h1_limits(pp_size, mbs, 1), ZeroBubbleCosts(), True))
    hand_made, seeds = [], []
    for limits, nominal, as_is in shapes:
        try:
            order = list_schedule(stage_map, pp_size, mbs, *limits, costs=nominal)[0]
        except (ValueError, RuntimeError):
            continue
        (hand_made if as_is else seeds).append(order)
    found = cost_aware_order(stage_map, pp_size, mbs, costs, in_flight, caps, hand_made, seeds)
    plan = _plan(name, stage_map, pp_size, chunks, mbs, False, found.actions, in_flight, cap)
    plan.__dict__["costs"] = costs  # what it was built for, beside the fields (not pickled): ResolvedSchedule.of_plan
    return plan
