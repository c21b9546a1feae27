"""A plan's dependency graph, a deadlock-free execution order, and the memory walks over a rank's actions.

Both the validator (:mod:`engine.plan.validate`) and the simulator (:mod:`engine.plan.simulate`) build on this
module (neither imports the other).  :func:`plan_graph` checks the plan's structure and data flow (checks 1-4 of
:mod:`engine.plan.validate`) while it builds the graph; :func:`deadlock_free_segments` runs the plan's actions in an
event-driven pass and raises :class:`PlanError` at a deadlock; :func:`memory_levels` walks each rank's order for
its activations held and weight-gradient passes pending.  The graph and the order are cached on the plan.  Pure.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace

import numpy as np

from .types import Action, Message, Op, Plan

__all__ = ["PlanError", "PlanGraph", "plan_graph", "deadlock_free_segments", "memory_levels", "deadlock_error"]

_OPS = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)  # key order of Plan.action_keys


class PlanError(ValueError):
    """A plan that cannot run: names the first violating action.

    Attributes:
        rank: pipeline rank of the action (``None`` for plan-level errors).
        index: position of the action in the rank's list (``None`` when the action is missing).
        action: the offending :class:`Action` (``None`` for plan-level errors).
        reason: what is wrong, in words.
    """

    def __init__(self, rank: int | None, index: int | None, action: Action | None, reason: str):
        self.rank, self.index, self.action, self.reason = rank, index, action, reason
        shown = action if isinstance(action, Action) else repr(action)
        if rank is None:
            where = "plan"
        elif action is None:
            where = f"rank {rank}"
        elif index is None:
            where = f"rank {rank}, action {shown}"
        else:
            where = f"rank {rank}, action {index} ({shown})"
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True, eq=False)
class PlanGraph:
    """The dependency graph of a plan over global action indices (rank ``r``'s action ``i`` is ``base[r] + i``).

    Attributes:
        num_actions: ``N``, the number of actions over all ranks.
        base: ``[P+1]`` offsets of each rank's actions in the global numbering (``base[P] == N``).
        keys: ``[N]`` int64 action keys (:attr:`Plan.action_keys`), concatenated over ranks.
        deps: ``N+1`` ints: the global index of the action producing each action's input message, or ``N``
            (a sentinel that is always done) when the action receives nothing; ``deps[N] == N``.
        owner: ``N+1`` ints: the rank of each global action index (``owner[N] == -1``).
        has_weight: per rank, whether it runs split weight-gradient (``W``) actions.
    """

    num_actions: int
    base: tuple[int, ...]
    keys: np.ndarray
    deps: list[int]
    owner: list[int]
    has_weight: tuple[bool, ...]

    def rank_of(self, node: int) -> int:
        """Pipeline rank of global action index ``node``."""
        return bisect_right(self.base, node) - 1

    def locate(self, plan: Plan, node: int) -> tuple[int, int, Action]:
        """``(rank, index, action)`` of global action index ``node``."""
        rank = self.rank_of(node)
        return rank, node - self.base[rank], plan.actions[rank][node - self.base[rank]]


def plan_graph(plan: Plan) -> PlanGraph:
    """Check the plan's structure and data flow (checks 1-4 of the module doc) and return its dependency graph.

    Cached on the plan (plans are immutable).  Raises :class:`PlanError`.
    """
    cached = plan.__dict__.get("_plan_graph")
    if cached is None:
        cached = _build_graph(plan)
        plan.__dict__["_plan_graph"] = cached
    return cached


# -- structure ---------------------------------------------------------------------------------------------------
def _build_graph(plan: Plan) -> PlanGraph:
    pp, chunks, mbs = plan.pp_size, plan.num_model_chunks, plan.num_microbatches
    if len(plan.actions) != pp:
        raise PlanError(None, None, None, f"has action lists for {len(plan.actions)} ranks but pp_size={pp}")
    if chunks < 1 or mbs < 1:
        raise PlanError(None, None, None, f"num_model_chunks={chunks} and num_microbatches={mbs} must be >= 1")
    stride = chunks * mbs
    keys_per_rank = plan.action_keys
    sizes = [len(k) for k in keys_per_rank]
    base = [0]
    for n in sizes:
        base.append(base[-1] + n)
    total = base[-1]
    keys = np.concatenate([np.asarray(ks, dtype=np.int64) for ks in keys_per_rank]) if pp else \
        np.zeros(0, dtype=np.int64)
    rank_of = np.repeat(np.arange(pp, dtype=np.int64), sizes)
    index = np.arange(total, dtype=np.int64)

    bad = np.flatnonzero(keys < 0)
    if bad.size:
        rank, i, action = _locate(plan, base, int(bad[0]))
        raise PlanError(rank, i, action, f"is not an action of this plan: needs an Op, 0 <= chunk < {chunks} and "
                                         f"0 <= microbatch < {mbs}")

    # position of each (rank, key) in the global numbering, -1 when the rank never runs it
    pos = np.full((pp, 3 * stride), -1, dtype=np.int64)
    pos[rank_of, keys] = index
    dup = np.flatnonzero(pos[rank_of, keys] != index)
    if dup.size:
        _raise_duplicate(plan, base, keys, rank_of, dup)

    present = pos >= 0
    ops_on = [[bool(present[r, o * stride:(o + 1) * stride].any()) for o in range(3)] for r in range(pp)]
    _check_complete(plan, base, pos, present, ops_on, stride)
    _check_local_order(plan, base, pos, ops_on, stride)
    _check_memory(plan, base, keys, stride)
    deps = _message_deps(plan, base, keys, pos, ops_on, total)
    owner = rank_of.tolist()
    owner.append(-1)
    return PlanGraph(total, tuple(base), keys, deps, owner, tuple(o[2] for o in ops_on))


def _locate(plan: Plan, base, node: int) -> tuple[int, int, Action]:
    rank = bisect_right(base, node) - 1
    return rank, node - base[rank], plan.actions[rank][node - base[rank]]


def _raise_duplicate(plan: Plan, base, keys, rank_of, dup) -> None:
    first = int(dup[0])
    rank, key = int(rank_of[first]), int(keys[first])
    lo, hi = base[rank], base[rank + 1]
    where = [int(i) - lo for i in np.flatnonzero(keys[lo:hi] == key) + lo]
    action = plan.actions[rank][where[1]]
    raise PlanError(rank, where[1], action, f"runs {action} again (also at index {where[0]}); each (op, chunk, "
                                            f"microbatch) runs once per rank")


def _key_action(key: int, chunks: int, mbs: int) -> Action:
    stride = chunks * mbs
    return Action(_OPS[key // stride], (key % stride) // mbs, key % mbs)


def _check_complete(plan: Plan, base, pos, present, ops_on, stride: int) -> None:
    chunks, mbs = plan.num_model_chunks, plan.num_microbatches
    for rank in range(plan.pp_size):
        if plan.forward_only and (ops_on[rank][1] or ops_on[rank][2]):
            node = int(pos[rank, stride:][present[rank, stride:]].min())
            _, i, action = _locate(plan, base, node)
            raise PlanError(rank, i, action, "a forward-only plan runs no backward or weight-gradient pass")
        needed = [0] if plan.forward_only else ([0, 1, 2] if ops_on[rank][2] else [0, 1])
        for op in needed:
            missing = np.flatnonzero(~present[rank, op * stride:(op + 1) * stride])
            if missing.size:
                action = _key_action(op * stride + int(missing[0]), chunks, mbs)
                raise PlanError(rank, None, action, f"never runs {action}: every (chunk, microbatch) of the rank's "
                                                    f"{chunks} model chunks and {mbs} microbatches runs once per op")


def _check_local_order(plan: Plan, base, pos, ops_on, stride: int) -> None:
    for rank in range(plan.pp_size):
        for before, after in ((0, 1), (1, 2)):
            if not (ops_on[rank][before] and ops_on[rank][after]):
                continue
            first, second = pos[rank, before * stride:(before + 1) * stride], pos[rank, after * stride:(after + 1) *
                                                                                   stride]
            wrong = np.flatnonzero(second < first)
            if wrong.size:
                node = int(second[wrong].min())
                k = int(wrong[np.argmin(second[wrong])])
                _, i, action = _locate(plan, base, node)
                earlier = _key_action(before * stride + k, plan.num_model_chunks, plan.num_microbatches)
                raise PlanError(rank, i, action, f"runs before {earlier} (index {int(first[k]) - base[rank]}); a "
                                                 f"{_OPS[after].name.lower()} pass needs its "
                                                 f"{_OPS[before].name.lower()} pass first")


# -- memory ------------------------------------------------------------------------------------------------------
def _levels(keys: np.ndarray, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """After each action of one rank: activations held (forwards done minus input-gradient passes done) and
    weight-gradient passes pending (``B`` done minus ``W`` done; zero on a rank without ``W``)."""
    op = keys // stride
    f, b, w = (op == 0).astype(np.int64), (op == 1).astype(np.int64), (op == 2).astype(np.int64)
    pending = np.cumsum(b - w) if w.any() else np.zeros(len(keys), dtype=np.int64)
    return np.cumsum(f - b), pending


def memory_levels(plan: Plan) -> tuple[tuple[int, int], ...]:
    """Per rank, ``(peak activations held, peak pending W)`` of the plan's order (forward-only plans hold
    nothing for a backward: ``(0, 0)``).  One activation is one ``(chunk, microbatch)``'s saved forward state;
    a pending W is what a weight-gradient pass needs (see :mod:`engine.runtime.split_backward`).

    Raises:
        PlanError: the plan is invalid.
    """
    graph = plan_graph(plan)
    if plan.forward_only:
        return ((0, 0),) * plan.pp_size
    stride = plan.num_model_chunks * plan.num_microbatches
    out = []
    for r in range(plan.pp_size):
        held, pending = _levels(graph.keys[graph.base[r]:graph.base[r + 1]], stride)
        out.append((int(held.max(initial=0)), int(pending.max(initial=0))))
    return tuple(out)


def _check_memory(plan: Plan, base, keys, stride: int) -> None:
    """The plan's own limits (:attr:`Plan.max_in_flight`, :attr:`Plan.max_pending_w`) hold after every action."""
    if plan.forward_only or (plan.max_in_flight is None and plan.max_pending_w is None):
        return
    for rank in range(plan.pp_size):
        held, pending = _levels(keys[base[rank]:base[rank + 1]], stride)
        for name, level, limits in (("activations held", held, plan.max_in_flight),
                                    ("pending weight-gradient passes", pending, plan.max_pending_w)):
            if limits is None:
                continue
            over = np.flatnonzero(level > limits[rank])
            if over.size:
                i = int(over[0])
                raise PlanError(rank, i, plan.actions[rank][i], f"{name} reach {int(level[i])}, over the plan's "
                                                                f"limit {limits[rank]} for this rank")


# -- messages ----------------------------------------------------------------------------------------------------
def _message_deps(plan: Plan, base, keys, pos, ops_on, total: int) -> list[int]:
    """Producer of each action's input message, as a global index (``total`` = receives nothing)."""
    pp, chunks, mbs = plan.pp_size, plan.num_model_chunks, plan.num_microbatches
    stride = chunks * mbs
    kinds = [(r, o, c) for r in range(pp) for o in range(3) if ops_on[r][o] for c in range(chunks)]
    # messages of microbatch 0 per (rank, op, chunk); the microbatch carries through (module doc)
    inputs = {k: plan.input_message(k[0], Action(_OPS[k[1]], k[2], 0)) for k in kinds}
    outputs = {k: plan.output_message(k[0], Action(_OPS[k[1]], k[2], 0)) for k in kinds}
    receivers: dict[Message, list] = {}
    senders: dict[Message, list] = {}
    for k in kinds:
        _check_fits(plan, pos, base, k, inputs[k], "input")
        _check_fits(plan, pos, base, k, outputs[k], "output")
        _check_carries_microbatch(plan, pos, base, k, inputs[k], outputs[k])
        if inputs[k] is not None:
            receivers.setdefault(inputs[k], []).append(k)
        if outputs[k] is not None:
            senders.setdefault(outputs[k], []).append(k)
    deps = np.full(total + 1, total, dtype=np.int64)
    by_rank: dict[int, list] = {}
    for k in kinds:
        by_rank.setdefault(k[0], []).append(k)
    for rank in range(pp):
        src_of = np.zeros(3 * chunks, dtype=np.int64)
        delta_of = np.zeros(3 * chunks, dtype=np.int64)
        receives = np.zeros(3 * chunks, dtype=bool)
        for (r, op, chunk) in by_rank.get(rank, ()):
            msg = inputs[(r, op, chunk)]
            if msg is None:
                continue
            found = senders.get(msg, [])
            if len(found) != 1:
                i, action = _first_action(plan, pos, base, r, op, chunk)
                names = ", ".join(str(outputs[(msg.src, o, msg.src_chunk)]) for o in range(3)
                                  if outputs.get((msg.src, o, msg.src_chunk)) is not None) or "nothing"
                why = "no action" if not found else f"{len(found)} action kinds"
                raise PlanError(r, i, action, f"receives {msg} but {why} of rank {msg.src} chunk {msg.src_chunk} "
                                              f"send(s) it (that chunk sends {names}): wrong producer")
            kind = op * chunks + chunk
            receives[kind], src_of[kind] = True, msg.src
            delta_of[kind] = (found[0][1] - op) * stride + (msg.src_chunk - chunk) * mbs
        lo, hi = base[rank], base[rank + 1]
        kind = keys[lo:hi] // mbs
        take = receives[kind]
        deps[lo:hi][take] = pos[src_of[kind[take]], keys[lo:hi][take] + delta_of[kind[take]]]
    for k in kinds:  # every sent message has exactly one receiving action kind
        sent = outputs[k]
        if sent is not None and len(receivers.get(sent, ())) != 1:
            i, action = _first_action(plan, pos, base, *k)
            why = "no action" if sent not in receivers else f"{len(receivers[sent])} action kinds"
            raise PlanError(k[0], i, action, f"sends {sent} but {why} of rank {sent.dst} chunk {sent.dst_chunk} "
                                             f"receive(s) it; every sent message needs exactly one receiver")
    return deps.tolist()


def _first_action(plan: Plan, pos, base, rank: int, op: int, chunk: int) -> tuple[int, Action]:
    """The earliest action of kind ``(op, chunk)`` on ``rank``: ``(index, action)``."""
    mbs = plan.num_microbatches
    start = (op * plan.num_model_chunks + chunk) * mbs
    node = int(pos[rank, start:start + mbs].min())
    return node - base[rank], plan.actions[rank][node - base[rank]]


def _check_fits(plan: Plan, pos, base, kind, msg: Message | None, side: str) -> None:
    """A message of ``kind = (rank, op, chunk)`` (microbatch 0) must name this action's end and existing ranks."""
    if msg is None:
        return
    rank, op, chunk = kind
    here = (msg.dst, msg.dst_chunk) if side == "input" else (msg.src, msg.src_chunk)
    if not _inside(plan, msg) or here != (rank, chunk) or msg.microbatch != 0:
        i, action = _first_action(plan, pos, base, rank, op, chunk)
        raise PlanError(rank, i, action, f"its {side} message {msg} does not fit the plan (pp_size={plan.pp_size},"
                                         f" num_model_chunks={plan.num_model_chunks}) or this action")


def _check_carries_microbatch(plan: Plan, pos, base, kind, first_in, first_out) -> None:
    """Spot check of the per-stage routing the validator relies on: the last microbatch's messages are the first
    microbatch's with the microbatch replaced."""
    last = plan.num_microbatches - 1
    if last == 0:
        return
    rank, op, chunk = kind
    action = Action(_OPS[op], chunk, last)
    for side, first, got in (("input", first_in, plan.input_message(rank, action)),
                             ("output", first_out, plan.output_message(rank, action))):
        expected = None if first is None else replace(first, microbatch=last)
        if got != expected:
            i = int(pos[rank, (op * plan.num_model_chunks + chunk) * plan.num_microbatches + last]) - base[rank]
            raise PlanError(rank, i, plan.actions[rank][i], f"its {side} message {got} is not microbatch {last}'s "
                                                            f"copy of microbatch 0's ({first}); the validator needs "
                                                            f"messages routed per (rank, op, chunk)")


def _inside(plan: Plan, msg: Message) -> bool:
    return (0 <= msg.src < plan.pp_size and 0 <= msg.dst < plan.pp_size and 0 <= msg.src_chunk <
            plan.num_model_chunks and 0 <= msg.dst_chunk < plan.num_model_chunks)


# -- deadlock ----------------------------------------------------------------------------------------------------
def deadlock_free_segments(plan: Plan) -> list[tuple[int, int, int]]:
    """A deadlock-free execution of all ranks as segments ``(rank, lo, hi)``: rank ``rank`` runs its actions with
    global indices ``lo..hi-1`` (see :class:`PlanGraph`) once every earlier segment has run.

    The segments form a topological order of the program-order and message edges, so any cost model can be
    evaluated by one pass over them (the simulator does).  Found by an event-driven execution in linear time: a rank
    runs until it needs a message not produced yet and resumes when the producer passes that action.  Cached on
    the plan.

    Raises:
        PlanError: the plan is invalid or deadlocks (names the first stuck rank's action and the wait cycle).
    """
    cached = plan.__dict__.get("_deadlock_free_segments")
    if cached is None:
        graph = plan_graph(plan)
        cached = _execute(plan, graph)
        plan.__dict__["_deadlock_free_segments"] = cached
    return cached


def _execute(plan: Plan, graph: PlanGraph) -> list[tuple[int, int, int]]:
    deps, base, owner = graph.deps, graph.base, graph.owner
    pp = len(base) - 1
    done = bytearray(graph.num_actions + 1)
    done[graph.num_actions] = 1
    at = list(base[:-1])
    blocked_on = [-1] * pp
    waiters: list[list[int]] = [[] for _ in range(pp)]
    ready = list(range(pp - 1, -1, -1))
    segments = []
    while ready:
        rank = ready.pop()
        lo = i = at[rank]
        end = base[rank + 1]
        while i < end and done[deps[i]]:
            done[i] = 1
            i += 1
        if i > lo:
            segments.append((rank, lo, i))
            at[rank] = i
        if waiters[rank]:
            still = []
            for w in waiters[rank]:
                (ready if done[blocked_on[w]] else still).append(w)
            waiters[rank] = still
        if i < end:
            blocked_on[rank] = deps[i]
            waiters[owner[deps[i]]].append(rank)
    stuck = [r for r in range(pp) if at[r] < base[r + 1]]
    if stuck:
        raise deadlock_error(plan, graph, at, stuck[0])
    return segments


def deadlock_error(plan: Plan, graph: PlanGraph, at: list[int], rank: int) -> PlanError:
    """The error for a stuck execution: ``at[r]`` is the global index rank ``r`` waits at; describes the wait chain
    from ``rank`` until it closes into a cycle, and is raised at the action where the cycle closes (a rank that
    waits for a later action of its own is named itself, not the ranks stuck behind it)."""
    chain, seen = [], []
    r = rank
    while r not in seen:
        seen.append(r)
        node = at[r]
        _, i, action = graph.locate(plan, node)
        producer = graph.deps[node]
        src, j, sent_by = graph.locate(plan, producer)
        msg = plan.input_message(r, action)
        chain.append(f"rank {r} {action} (index {i}) waits for {msg} from {sent_by} (index {j}) on rank {src}")
        r = src
    cycle = " -> ".join(f"rank {x}" for x in seen[seen.index(r):] + [r])
    first = graph.locate(plan, at[r])
    return PlanError(r, first[1], first[2], f"deadlock: {'; '.join(chain)}; cycle {cycle}")


