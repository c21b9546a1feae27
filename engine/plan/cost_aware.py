"""Cost-aware split-backward plans: the order that minimises the simulated step under per-pass costs and a memory
budget.

In the spirit of the automatic scheduler of Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (sec. 3.1; its
problem is stated in appendix G): given the time of ``F``, ``B`` and ``W`` per ``(rank, chunk)``, the transfer
latency and, per rank, an activation budget and a pending-``W`` limit, find each rank's order of its ``F``, ``B``
and ``W`` passes with the smallest step time.  The model of time is the simulator's
(:mod:`engine.plan.simulate`): a rank runs its actions in order, an action starts once the previous one has ended
and its input has arrived (the producer's end plus the transfer latency when the producer is another rank);
the builder's step time equals ``simulate(plan, **costs.simulation()).makespan`` (a test checks it).

Memory, per rank: an in-flight activation (``F`` done, ``B`` not) counts 1, a pending ``W`` (``B`` done, ``W``
not) counts ``costs.weight_memory`` of its ``(rank, chunk)``; their sum never exceeds the activation budget
``max_in_flight``, and the pending ``W`` count never exceeds ``max_pending_w`` (the paper's ``M_limit`` with
``M_W / M_B = weight_memory``, plus a count limit of pipecast's own).

The search (deterministic, bounded by counts, not by time: every rank builds the same plan):

1. *Orders of ``F`` and ``B``*: the list scheduler's (:func:`engine.plan.zero_bubble.list_schedule`, seeds handed
   in by :func:`engine.plan.zero_bubble.zero_bubble_plan`: under nominal and under the mean costs); for one chunk
   per rank also 1F1B-shaped orders whose warmup forwards cover the first backward's round trip (rank ``r``: the
   forwards that fit before the gradient of microbatch 0 returns, rounded down and up, within the budget); for
   several chunks a timed greedy (:func:`_greedy`) that keeps a slot for each later chunk.
2. *``W`` placement*, for each such order: one timed pass puts a pending ``W`` where the rank would otherwise wait
   for its next input (when it ends by the input's arrival, or overruns it by at most ``alpha * W``, ``alpha`` in
   {0, 1/2, 1}), and where the budget or the pending limit demands one; the rest after the last ``B``.  The
   hand-made plans of the same limits (the list scheduler's and, with one chunk, ZB-H1's) are candidates as
   they are, when they fit the budget.
3. *Local search* from the best few: first, while it helps, every ``F`` followed by a ``B`` whose gradient arrived
   before the ``F``'s input trades places with it (the backward chain no longer waits behind a late forward, as
   at the end of the steady phase); then single swaps of adjacent ``F`` / ``B`` of a rank where an action waited
   and at the end of each rank's warmup (one forward fewer or more); where a ``W`` filling a gap delayed an input,
   that pass of that microbatch (its ``F`` or ``B`` chain) with every rank's ``W`` before it made to end by the
   input's arrival (a delay on the chain otherwise moves on to the next rank); and one rank's ``alpha`` changed;
   keeping each move that improves the objective; at most :func:`_evaluations` timed passes, by the plan's size.

Objective: the makespan (the step time), then the longest rank's span from its first action to its last (the
paper's cost).  Each chunk's ``F``, ``B`` and ``W`` run in microbatch order (the sums of 1F1B).  Pure: no torch.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .pass_costs import PassCosts
from .types import Action, Op, Placement

__all__ = ["cost_aware_order", "place_weights", "CostAwareResult"]

_OPS = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)
_EPS = 1e-9


@dataclass(frozen=True)
class CostAwareResult:
    """The chosen order: ``actions`` per rank (``Action`` s), its ``makespan`` and ``span`` (time units), the
    per-rank peaks of ``memory`` (activations plus weighted pending ``W``) and of pending ``W`` count."""

    actions: tuple[tuple[Action, ...], ...]
    makespan: float
    span: float
    peak_memory: tuple[float, ...]
    peak_pending_w: tuple[int, ...]


class _Problem:
    """One build's sizes, costs and limits, precomputed per ``(rank, op, chunk)`` for the timed pass."""

    def __init__(self, placement: Placement, pp: int, mbs: int, costs: PassCosts, budget, pending_limit):
        chunks = len(placement) // pp
        self.P, self.C, self.M, self.S = pp, chunks, mbs, len(placement)
        self.placement, self.T = placement, costs.transfer
        self.stage = [[0] * chunks for _ in range(pp)]
        for s, (r, c) in enumerate(placement):
            self.stage[r][c] = s
        tab = {n: costs.table(n, pp, chunks) for n in ("forward", "backward", "weight", "weight_memory")}
        self.w_cost, self.w_mem = tab["weight"], tab["weight_memory"]
        self.budget = [float(x) for x in budget]
        self.cap = [math.inf if x is None else x for x in pending_limit]
        # per rank, per op*C + chunk: (own key base, dependency key base or -1, dependency on another rank, cost)
        self.info = [[self._info(r, op, c, tab["forward" if op == 0 else "backward"][r][c])
                      for op in (0, 1) for c in range(chunks)] for r in range(pp)]

    def _info(self, r: int, op: int, c: int, cost: float):
        s, S, M = self.stage[r][c], self.S, self.M
        dep = (s - 1 if s > 0 else -1) if op == 0 else (s + 1 if s < S - 1 else -1)
        base = (op * S + s) * M
        dep_base = (op * S + dep) * M if dep >= 0 else -1
        remote = dep >= 0 and self.placement[dep][0] != r
        return base, dep_base, remote, cost


@dataclass
class _Timed:
    """One timed pass: the full orders (codes ``(op*C + chunk)*M + mb``), the objective and where ranks waited."""

    orders: list
    makespan: float
    span: float
    waits: list          # per rank, indices into its F/B order of actions that started after an idle gap
    peak_memory: list
    peak_pending: list

    @property
    def key(self) -> tuple[float, float]:
        return self.makespan, self.span


def _evaluate(pb: _Problem, fb: list, alpha: tuple | None, fit: frozenset = frozenset()) -> _Timed | None:
    """Time the per-rank orders ``fb`` (module doc, step 2): ``alpha`` None runs them as given (they hold their
    ``W``); else ``fb`` holds ``F`` / ``B`` only and the pass places the ``W`` with rank ``r``'s ``alpha[r]``, except
    that a ``W`` before a pass whose code is in ``fit`` must end by the pass's input's arrival.
    ``None``: the order deadlocks or breaks a limit."""
    P, M = pb.P, pb.M
    end = [-1.0] * (2 * pb.S * M)
    state = _RankState(pb)
    blocked: dict[int, int] = {}
    ready = list(range(P - 1, -1, -1))
    while ready:
        r = ready.pop()
        woken = state.run(r, fb[r], end, blocked, None if alpha is None else alpha[r], fit, M)
        if woken is False:
            return None
        ready.extend(woken)
    if any(state.at[r] < len(fb[r]) for r in range(P)):
        return None
    state.finish()
    spans = [state.clock[r] - state.first[r] for r in range(P)]
    timed = _Timed(state.out, max(state.clock), max(spans), state.waits, state.peak, state.peak_pending)
    timed.arrive, timed.start, timed.overruns = state.arrive, state.start, state.overruns
    return timed


class _RankState:
    """Per-rank clocks, pending ``W`` queues and memory of one timed pass."""

    def __init__(self, pb: _Problem):
        P = pb.P
        self.pb, self.at, self.clock, self.first = pb, [0] * P, [0.0] * P, [0.0] * P
        self.pending = [deque() for _ in range(P)]
        self.mem, self.peak, self.peak_pending = [0.0] * P, [0.0] * P, [0] * P
        self.out = [[] for _ in range(P)]
        self.waits = [[] for _ in range(P)]
        self.arrive = [[] for _ in range(P)]
        self.start = [[] for _ in range(P)]
        self.overruns = set()  # codes of passes whose input arrived while a W ran

    def run(self, r: int, seq: list, end: list, blocked: dict, alpha, fit, M: int):
        """Run rank ``r`` until its next input is not produced yet (``fit``: as :func:`_evaluate` says); the
        ranks it woke, or False (a limit broken, or a ``W`` out of first-in first-out order)."""
        pb, info, C = self.pb, self.pb.info[r], self.pb.C
        pending, w_cost, w_mem, out = self.pending[r], pb.w_cost[r], pb.w_mem[r], self.out[r]
        arrivals, starts, waits = self.arrive[r], self.start[r], self.waits[r]
        budget, cap, T, woken, fill = pb.budget[r] + _EPS, pb.cap[r], pb.T, [], alpha is not None
        over = 0.0 if alpha is None else 1.0 - alpha
        t, i, n, mem, peak = self.clock[r], self.at[r], len(seq), self.mem[r], self.peak[r]
        while i < n:
            oc, mb = divmod(seq[i], M)
            if oc >= 2 * C:  # a W given in the order (alpha None): the oldest pending one, as planned
                if not pending or pending[0] != (oc - 2 * C, mb):
                    return False
                t, mem = self._weight(r, t, mem)
                i += 1
                continue
            base, dep_base, remote, cost = info[oc]
            arrive = -math.inf
            if dep_base >= 0:
                arrive = end[dep_base + mb]
                if arrive < 0:
                    blocked[dep_base + mb] = r
                    break
                if remote:
                    arrive += T
            delta = 1.0 if oc < C else w_mem[oc - C] - 1.0
            while mem + delta > budget or (oc >= C and len(pending) >= cap):
                if not fill or not pending:
                    return False
                t, mem = self._weight(r, t, mem)
            filled, overrun = t, 1.0 if seq[i] in fit else over
            while fill and pending and t + w_cost[pending[0][0]] * overrun <= arrive + _EPS:
                t, mem = self._weight(r, t, mem)
            if t > filled and t > arrive + _EPS:
                self.overruns.add(seq[i])
            arrivals.append(arrive)
            if arrive > t + _EPS:
                waits.append(i)
                t = arrive
            starts.append(t)
            if i == 0:
                self.first[r] = t
            t += cost
            end[base + mb] = t
            out.append(seq[i])
            mem += delta
            if oc >= C:
                pending.append((oc - C, mb))
                if len(pending) > self.peak_pending[r]:
                    self.peak_pending[r] = len(pending)
            if mem > peak:
                peak = mem
            waiter = blocked.pop(base + mb, None)
            if waiter is not None and waiter != r:
                woken.append(waiter)
            i += 1
        self.clock[r], self.at[r], self.mem[r], self.peak[r] = t, i, mem, peak
        return woken

    def _weight(self, r: int, t: float, mem: float) -> tuple[float, float]:
        """Run rank ``r``'s oldest pending ``W`` at ``t``; the rank's time and memory after it."""
        c, mb = self.pending[r].popleft()
        pb = self.pb
        self.out[r].append((2 * pb.C + c) * pb.M + mb)
        return t + pb.w_cost[r][c], mem - pb.w_mem[r][c]

    def finish(self) -> None:
        for r in range(self.pb.P):
            t, mem = self.clock[r], self.mem[r]
            while self.pending[r]:
                t, mem = self._weight(r, t, mem)
            self.clock[r] = t


# ---- step 1: orders of F and B -------------------------------------------------------------------------------------
def _strip(orders: list, C: int, M: int) -> list:
    return [[code for code in acts if code < 2 * C * M] for acts in orders]


def _codes(actions, C: int, M: int) -> list:
    """Per rank, the list scheduler's ``(op, chunk, microbatch)`` tuples as codes."""
    index = {"F": 0, "B": 1, "W": 2}
    return [[(index[op] * C + c) * M + mb for op, c, mb in acts] for acts in actions]


def _one_f_one_b(pb: _Problem, warmup: list) -> list:
    """One chunk per rank: ``warmup[r]`` forwards, then one backward and one forward alternately."""
    M, out = pb.M, []
    for r in range(pb.P):
        k = max(1, min(warmup[r], M))
        seq, f = list(range(k)), k
        for mb in range(M):
            seq.append(M + mb)
            if f < M:
                seq.append(f)
                f += 1
        out.append(seq)
    return out


def _round_trip_warmups(pb: _Problem) -> list[list[int]]:
    """Per rank, the forwards that fit before the gradient of microbatch 0 is back (rounded down, rounded up),
    within the budget: ``(sum of F over stages >= r + sum of B over stages > r + 2 T (P-1-r)) / F_r``."""
    P, T = pb.P, pb.T
    f = [pb.info[r][0][3] for r in range(P)]
    b = [pb.info[r][1][3] for r in range(P)]
    out = []
    for up in (False, True):
        warm = []
        for r in range(P):
            trip = sum(f[r:]) + sum(b[r + 1:]) + 2 * T * (P - 1 - r)
            k = trip / f[r] if f[r] > 0 else pb.M
            k = math.ceil(k - 1e-6) if up else math.floor(k + 1e-6)
            warm.append(max(1, min(int(pb.budget[r]), k)))
        out.append(warm)
    return out


def _greedy(pb: _Problem, lookahead: bool) -> list | None:
    """An order of ``F`` and ``B`` by a timed greedy run under the costs: a free rank runs a ``B`` whose gradient
    has arrived (deepest stage first), else an ``F`` whose input has arrived (deepest first) if the rank keeps a
    free slot for each later chunk a microbatch passes on it (``C - 1 - c`` for chunk ``c``), else waits;
    ``lookahead``: not an ``F`` that would end after the next ``B``'s gradient arrives.  None if it gets stuck."""
    import heapq
    P, C, M = pb.P, pb.C, pb.M
    end = [-1.0] * (2 * pb.S * M)
    nf, nb, held = [[0] * C for _ in range(P)], [[0] * C for _ in range(P)], [0] * P
    out, heap, parked, done = [[] for _ in range(P)], [(0.0, r) for r in range(P)], [], 0
    deepest = [sorted(range(C), key=lambda c, r=r: -pb.stage[r][c]) for r in range(P)]
    while done < 2 * P * C * M:
        if not heap:
            return None
        t, r = heapq.heappop(heap)
        step, wake = _greedy_step(pb, r, t, end, nf, nb, held, deepest[r], lookahead)
        if step is None:
            heapq.heappush(heap, (wake, r)) if wake is not None else parked.append(r)
            continue
        op, c, mb, cost = step
        base = pb.info[r][op * C + c][0]
        end[base + mb] = t + cost
        out[r].append((op * C + c) * M + mb)
        done += 1
        heapq.heappush(heap, (t + cost, r))
        for q in parked:
            heapq.heappush(heap, (t, q))
        parked.clear()
    return out


def _greedy_step(pb: _Problem, r: int, t: float, end, nf, nb, held, deepest, lookahead: bool):
    """The greedy's choice for rank ``r`` free at ``t``: ``((op, chunk, mb, cost), None)`` or ``(None, wake)``."""
    C, M, info, T = pb.C, pb.M, pb.info[r], pb.T
    times = []
    for op, nxt in ((1, nb), (0, nf)):
        for c in deepest:
            mb = nxt[r][c]
            if mb >= M or (op == 1 and mb >= nf[r][c]):
                continue
            base, dep_base, remote, cost = info[op * C + c]
            arrive = -math.inf if dep_base < 0 else end[dep_base + mb]
            if dep_base >= 0 and arrive < 0:
                continue
            arrive += T if remote else 0.0
            times.append((op, c, mb, cost, arrive))
    for op, c, mb, cost, arrive in times:
        if arrive > t + _EPS or (op == 0 and held[r] + 1 + (C - 1 - c) > pb.budget[r] + _EPS):
            continue
        if op == 0 and lookahead and any(o == 1 and a < t + cost - _EPS for o, _, _, _, a in times):
            break
        (nb if op else nf)[r][c] += 1
        held[r] += -1 if op else 1
        return (op, c, mb, cost), None
    later = [a for *_, a in times if a > t + _EPS]
    return None, min(later, default=None)


def _fb_orders(pb: _Problem, seeds: list) -> list[list]:
    """Step 1 of the module doc: the candidate orders of ``F`` and ``B`` -- the ``seeds`` (list scheduler orders)
    without their ``W``, 1F1B-shaped orders (one chunk) or timed greedy ones (several chunks)."""
    C, M = pb.C, pb.M
    orders = [_strip(_codes(acts, C, M), C, M) for acts in seeds]
    if C == 1:
        orders += [_one_f_one_b(pb, warm) for warm in _round_trip_warmups(pb)]
    else:
        orders += [o for o in (_greedy(pb, lookahead) for lookahead in (False, True)) if o is not None]
    unique = []
    for order in orders:
        if order not in unique:
            unique.append(order)
    return unique


def mean_costs(costs: PassCosts, pp_size: int, num_model_chunks: int) -> tuple[float, float, float, float]:
    """``(F, B, W, transfer)`` averaged over ``(rank, chunk)``: nominal costs for the list scheduler's seed."""
    def mean(name):
        rows = costs.table(name, pp_size, num_model_chunks)
        return sum(map(sum, rows)) / (pp_size * num_model_chunks)
    return mean("forward"), mean("backward"), mean("weight"), costs.transfer


# ---- step 3: local search ------------------------------------------------------------------------------------------
def _evaluations(num_actions: int) -> int:
    """Timed passes the local search may spend: ~400 on small plans, fewer on large ones (a pass is linear in the
    actions; about 1 s in all for P = 32, M = 256)."""
    return max(4, min(400, 400_000 // max(1, num_actions)))


def _swap_ok(pb: _Problem, seq: list, i: int) -> bool:
    """Whether actions ``i`` and ``i+1`` of a rank's ``F`` / ``B`` order may trade places: not two passes of one
    ``(op, chunk)`` (microbatch order) and not a chunk's ``F`` and ``B`` of one microbatch."""
    if i < 0 or i + 1 >= len(seq):
        return False
    a, b = divmod(seq[i], pb.M), divmod(seq[i + 1], pb.M)
    if a[0] == b[0]:
        return False
    C = pb.C
    same_chunk = a[0] % C == b[0] % C
    return not (same_chunk and a[1] == b[1])


def _held_ok(pb: _Problem, r: int, seq: list) -> bool:
    """In-flight activations of the order never exceed the rank's budget."""
    held, C, M, budget = 0, pb.C, pb.M, pb.budget[r] + _EPS
    for code in seq:
        held += 1 if code // M < C else -1
        if held > budget:
            return False
    return True


def _moves(pb: _Problem, fb: list, timed: _Timed):
    """Candidate swaps ``(rank, i)`` (module doc, step 3): where an action waited, then each warmup's end."""
    seen = set()
    for r in range(pb.P):
        for i in timed.waits[r]:
            for j in (i, i - 1):
                if (r, j) not in seen and _swap_ok(pb, fb[r], j):
                    seen.add((r, j))
                    yield r, j
    for r in range(pb.P):
        first_b = next((i for i, code in enumerate(fb[r]) if code // pb.M >= pb.C), None)
        for j in (() if first_b is None else (first_b - 1, first_b)):
            if (r, j) not in seen and _swap_ok(pb, fb[r], j):
                seen.add((r, j))
                yield r, j


def _local_search(pb: _Problem, fb: list, best: _Timed, alpha: tuple, budget: int) -> _Timed:
    """Step 3 of the module doc: first whole-order repairs (:func:`_ready_first`) while they improve, then single
    moves (:func:`_neighbours`), keeping each that improves the objective, until none does or ``budget`` passes are
    spent."""
    while budget > 0:
        trial = _ready_first(pb, fb, best)
        if trial is None:
            break
        timed = _evaluate(pb, trial, alpha)
        budget -= 1
        if timed is None or not _better(timed, best):
            break
        fb, best = trial, timed
    state, improved = (fb, alpha, frozenset()), True
    while improved and budget > 0:
        improved = False
        for trial in _neighbours(pb, *state, best):
            timed = _evaluate(pb, *trial)
            budget -= 1
            if timed is not None and _better(timed, best):
                state, best, improved = trial, timed, True
                break
            if budget <= 0:
                break
    return best


def _neighbours(pb: _Problem, fb: list, alpha: tuple, fit: frozenset, timed: _Timed):
    """The local search's moves from ``(fb, alpha, fit)`` (:func:`_evaluate`'s arguments): the swaps of
    :func:`_moves` that keep the rank within its budget; where a ``W`` delayed an input, every rank's ``W`` made to
    end by the input of that pass (``F`` or ``B``) of that microbatch -- a delay on the chain would otherwise move on
    to the next rank -- besides or instead of those made to so far; one rank's ``alpha`` changed to another of
    :data:`_ALPHAS`."""
    for r, i in _moves(pb, fb, timed):
        seq = fb[r][:]
        seq[i], seq[i + 1] = seq[i + 1], seq[i]
        if _held_ok(pb, r, seq):
            yield fb[:r] + [seq] + fb[r + 1:], alpha, fit
    C, M = pb.C, pb.M
    for op, mb in dict.fromkeys((code // M // C, code % M) for code in sorted(timed.overruns)):
        chain = frozenset((op * C + c) * M + mb for c in range(C))
        yield fb, alpha, fit | chain
        yield fb, alpha, chain
    for r in range(pb.P):
        for a in _ALPHAS:
            if a != alpha[r]:
                yield fb, alpha[:r] + (a,) + alpha[r + 1:], fit


def _ready_first(pb: _Problem, fb: list, timed: _Timed) -> list | None:
    """Every rank's order with each ``F`` that is followed by a ``B`` whose gradient arrived before the ``F``'s
    activation swapped with that ``B`` (the backward chain then does not wait behind a late forward, as at the end
    of the steady phase); None when nothing changes."""
    C, M, out, changed = pb.C, pb.M, [], False
    for r in range(pb.P):
        seq, arrive, i = fb[r][:], timed.arrive[r], 0
        while i < len(seq) - 1:
            if seq[i] // M < C <= seq[i + 1] // M and arrive[i + 1] + _EPS < arrive[i] and _swap_ok(pb, seq, i):
                seq[i], seq[i + 1] = seq[i + 1], seq[i]
                changed = True
                i += 2
                continue
            i += 1
        out.append(seq)
    return out if changed else None


_STARTS = 3  # orders the local search starts from
_ALPHAS = (0.0, 0.5, 1.0)  # how far a W may overrun its gap, in W (module doc, step 2)


def _distinct_best(tried: list, k: int) -> list:
    """The ``k`` best ``(timed, order, alpha)`` of ``tried`` whose plans differ."""
    out = []
    for t in sorted(tried, key=lambda t: t[0].key):
        if all(t[0].orders != o[0].orders for o in out):
            out.append(t)
        if len(out) == k:
            break
    return out


def _better(a: _Timed, b: _Timed) -> bool:
    if a.makespan < b.makespan - _EPS:
        return True
    return a.makespan <= b.makespan + _EPS and a.span < b.span - _EPS


# ---- the builder ---------------------------------------------------------------------------------------------------
def cost_aware_order(placement: Placement, pp_size: int, num_microbatches: int, costs: PassCosts,
                     max_in_flight, max_pending_w, hand_made=(), seeds=()) -> CostAwareResult:
    """The best order found (module doc) for ``costs`` under per-rank limits.

    Args:
        placement: stage -> ``(rank, chunk)``.
        max_in_flight: per rank, the activation budget (activations plus weighted pending ``W``).
        max_pending_w: per rank, the pending ``W`` limit (``None`` entries: no limit).
        hand_made: per-rank ``(op, chunk, microbatch)`` orders of hand-made plans, tried as they are and as seeds.
        seeds: more such orders whose ``F`` and ``B`` order is tried (step 1 of the module doc).

    Raises:
        ValueError: no order fits the limits (the message names them).
    """
    pb = _Problem(placement, pp_size, num_microbatches, costs, max_in_flight, max_pending_w)
    C, M = pb.C, pb.M
    tried = [(_evaluate(pb, _codes(acts, C, M), None), None, None) for acts in hand_made]
    for fb in _fb_orders(pb, [*hand_made, *seeds]):
        for a in _ALPHAS:
            alpha = (a,) * pp_size
            tried.append((_evaluate(pb, fb, alpha), fb, alpha))
    tried = [t for t in tried if t[0] is not None]
    if not tried:
        raise ValueError(f"no order fits max_in_flight={tuple(max_in_flight)} and max_pending_w="
                         f"{tuple(max_pending_w)} (with weight_memory={costs.weight_memory}); raise the budget")
    best = min((t[0] for t in tried), key=lambda timed: timed.key)
    starts = _distinct_best([t for t in tried if t[1] is not None], _STARTS)
    budget = _evaluations(3 * pp_size * C * M)
    for timed, fb, alpha in starts:  # the local search from each of the best few, sharing the budget
        found = _local_search(pb, fb, timed, alpha, budget // len(starts))
        if _better(found, best):
            best = found
    return _result(pb, best)


def place_weights(placement: Placement, pp_size: int, num_microbatches: int, costs: PassCosts, max_in_flight,
                  orders) -> CostAwareResult:
    """``orders`` (per rank, ``(op, chunk, microbatch)`` with ``op`` in ``"FBW"``; their ``W`` are dropped) with each
    rank's ``W`` passes placed by the timed pass of step 2 (module doc) with ``alpha = 0``: first in, first out, where
    the rank would otherwise wait for its next input and ends by its arrival, where the activation budget
    ``max_in_flight`` (per rank) demands one before an ``F``, and the rest after the rank's last ``B``.

    Raises:
        ValueError: the orders deadlock, or an ``F`` does not fit ``max_in_flight`` with every pending ``W`` done.
    """
    pb = _Problem(placement, pp_size, num_microbatches, costs, max_in_flight, (None,) * pp_size)
    timed = _evaluate(pb, _strip(_codes(orders, pb.C, pb.M), pb.C, pb.M), (0.0,) * pp_size)
    if timed is None:
        raise ValueError(f"the F / B orders deadlock or do not fit max_in_flight={tuple(max_in_flight)}; raise the "
                         "budget or fix the orders")
    return _result(pb, timed)


def _result(pb: _Problem, timed: _Timed) -> CostAwareResult:
    C, M, shared = pb.C, pb.M, {}

    def action(code: int) -> Action:
        oc, mb = divmod(code, M)
        key = (oc, mb)
        if key not in shared:
            shared[key] = Action(_OPS[oc // C], oc % C, mb)
        return shared[key]

    actions = tuple(tuple(action(code) for code in acts) for acts in timed.orders)
    return CostAwareResult(actions, timed.makespan, timed.span, tuple(timed.peak_memory),
                           tuple(timed.peak_pending))
