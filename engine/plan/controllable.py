"""Controllable-memory V schedules: V-Half and V-Min.

Qi, Wan, Amar and Lin, "Pipeline Parallelism with Controllable Memory", NeurIPS 2024 (arXiv:2405.15362), build a
schedule by repeating one *building block* -- the passes of one microbatch on every rank at fixed offsets -- every
microbatch, and show that the block's lifespan on a rank sets the rank's peak activation memory.  Their V-shape
blocks on the V placement (:func:`engine.plan.types.v_placement`; rank ``r`` holds stages ``r`` and ``2P-1-r``)
trade bubble for memory.  In slots of one chunk pass (``F = B = W = 1`` per chunk) a block repeats every 6 slots (two
chunks, ``F``, ``B`` and ``W`` each); rank ``r`` runs microbatch ``j``'s passes at ``6 j`` plus:

* **V-Min** (about a third of 1F1B's activations): ``F`` of chunk 0 at ``r`` and of chunk 1 at ``2P-1-r`` (the
  forward V, one slot per stage), ``B`` of chunk 1 at ``2P+d+r`` and of chunk 0 at ``4P+d-1-r``; ``d = 2`` when
  ``3 | P`` (else two passes of a rank would share a slot modulo 6), else 0.
* **V-Half** (half of 1F1B's activations): the first leg of each V two slots per stage -- ``F`` of chunk 0 at
  ``2r``, of chunk 1 at ``3P-2-r``, ``B`` of chunk 1 at ``3P+d+2r-1``, of chunk 0 at ``6P+d-r-2`` -- with ``d = 3``
  for even ``P``, else 0.

Each ``W`` takes the first free slot after its ``B`` (first in, first out, so each chunk's weight gradients run in
microbatch order).  Then, as in the paper, the repeated blocks are *squeezed*: in slot order, each pass moves to the
earliest free slot after its input (and its chunk's previous microbatch) where the rank's activation memory -- each
chunk activation from its ``F`` to its ``W``, as the paper counts it -- stays within the repeated blocks' peak.
The paper then reorders the warmup and the cooldown within that peak; here two orders of each rank's ``F`` and ``B``
are tried: the squeezed one, and the same with the ``W`` taken out and each ``B`` of the cooldown (in the blocks,
after the last microbatch's first ``F``) moved to the earliest free slot after its input.  In each, the ``W`` are
placed by the cost-aware builder's timed pass (:func:`engine.plan.cost_aware.place_weights`, one time unit a pass):
first in, first out, where the rank would otherwise wait, where the peak demands one, the rest at the end; the order
with the shorter step (longest rank's span, then makespan) is the plan.  The plan carries its peaks of activations
held and of pending ``W`` as limits.

With ``F = B = W`` (one slot per chunk pass) and ``M >= P`` the plans have, per rank at most, ``(P+2)//2``
(V-Half) and ``(P+4)//3`` (V-Min) microbatches of activation memory -- the paper's figures, 1/2 and 1/3 of 1F1B's
``P`` -- and a bubble (longest rank's span minus its ``6M`` busy slots) of ``3P - 7`` for even ``P >= 4`` and
``3P - 4`` for odd ``P`` (V-Half; at most half of 1F1B's ``6(P-1)``, the paper's "about half") and ``4P - 7`` when
``3 | P``, else ``4P - 5`` (V-Min; at most two thirds of 1F1B's, the paper's "about two thirds").  Pure: no torch.
"""
from __future__ import annotations

from .cost_aware import place_weights
from .pass_costs import PassCosts
from .types import Action, Op, Plan, v_placement

__all__ = ["controllable_plan", "block_offsets", "KINDS"]

KINDS = ("half", "min")
_PERIOD = 6  # slots of one microbatch on a rank: F, B and W of two chunks
_PASSES = (("F", 0), ("F", 1), ("B", 1), ("B", 0))  # the passes of a block; W take the free slots
_UNIT = PassCosts(weight_memory=1.0)  # one slot a pass; a pending W holds its activation (memory from F to W)


def block_offsets(kind: str, pp_size: int, rank: int) -> dict[tuple[str, int], int]:
    """Slot of each ``(op, chunk)`` of microbatch 0 on ``rank`` in the building block of ``kind`` (module doc).

    Raises:
        ValueError: ``kind`` not ``"half"`` or ``"min"``.
    """
    P, r = pp_size, rank
    if kind == "min":
        d = 2 if P % 3 == 0 else 0
        return {("F", 0): r, ("F", 1): 2 * P - 1 - r, ("B", 1): 2 * P + d + r, ("B", 0): 4 * P + d - 1 - r}
    if kind == "half":
        d = 3 if P % 2 == 0 else 0
        return {("F", 0): 2 * r, ("F", 1): 3 * P - 2 - r, ("B", 1): 3 * P + d + 2 * r - 1,
                ("B", 0): 6 * P + d - r - 2}
    raise ValueError(f"kind={kind!r} is unknown; use one of {', '.join(KINDS)}")


def controllable_plan(kind: str, name: str, pp_size: int, num_microbatches: int, num_model_chunks: int,
                      forward_only: bool = False) -> Plan:
    """The plan of V-Half (``kind="half"``) or V-Min (``"min"``), named ``name`` (module doc); forward-only plans
    run the forwards in the squeezed order.

    Raises:
        ValueError: ``num_model_chunks`` is not 2 (the V placement).
    """
    if num_model_chunks != 2:
        raise ValueError(f"{name} runs on the V placement: two model chunks per rank, got {num_model_chunks}")
    P, M = pp_size, num_microbatches
    blocks = _block(kind, P, M)
    horizon = max(blocks.values()) + 1
    cap = [max(_held(blocks, r, M, horizon)) for r in range(P)]
    squeezed = _squeezed(blocks, P, M, cap)
    if forward_only:
        orders = [tuple(Action(Op.FORWARD, c, j) for op, c, j in seq if op == "F") for seq in _orders(squeezed, P)]
    else:
        tried = [place_weights(v_placement(P), P, M, _UNIT, cap, _orders(slots, P))
                 for slots in (squeezed, _backwards_first(squeezed, blocks, P, M))]
        orders = min(tried, key=lambda found: (found.span, found.makespan)).actions
    warmup = tuple(next((i for i, a in enumerate(acts) if a.op is not Op.FORWARD), len(acts)) for acts in orders)
    peaks = [_peak(acts) for acts in orders]
    limits = (None, None) if forward_only else (tuple(x for x, _ in peaks), tuple(w for _, w in peaks))
    return Plan(name, P, 2, M, M, forward_only, warmup, tuple(orders), v_placement(P), *limits)


def _orders(slots: dict, P: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, its passes (``(rank, op, chunk, microbatch)`` -> slot) as ``(op, chunk, microbatch)`` in slot
    order."""
    out = [[] for _ in range(P)]
    for (r, op, c, j), _ in sorted(slots.items(), key=lambda item: item[1]):
        out[r].append((op, c, j))
    return out


def _block(kind: str, P: int, M: int) -> dict:
    """``(rank, op, chunk, microbatch)`` -> slot of the repeated blocks, each ``W`` in the first free slot after
    its ``B`` (first in, first out)."""
    out = {}
    for r in range(P):
        offsets = block_offsets(kind, P, r)
        fb = {offsets[(op, c)] + _PERIOD * j: (op, c, j) for op, c in _PASSES for j in range(M)}
        pending, t, last = [], 0, max(fb)
        while t <= last or pending:
            if t in fb:
                op, c, j = fb[t]
                out[(r, op, c, j)] = t
                if op == "B":
                    pending.append((c, j))
            elif pending:
                c, j = pending.pop(0)
                out[(r, "W", c, j)] = t
            t += 1
    return out


def _squeezed(original: dict, P: int, M: int, cap: list[int]) -> dict:
    """``original`` (``(rank, op, chunk, microbatch)`` -> slot) squeezed (module doc): in slot order, each pass moves
    to the earliest free slot after its input and its chunk's previous microbatch where the rank's activations
    (``F`` to ``W``, as the paper counts them) stay within ``cap[rank]``."""
    horizon = max(original.values()) + 1
    held = [_held(original, r, M, horizon) for r in range(P)]
    taken = [set() for _ in range(P)]
    new: dict = {}
    for key in sorted(original, key=original.get):
        r, op, c, j = key
        lo = max(_after(new, _input(key, P)), _after(new, (r, op, c, j - 1)))
        s_old = original[key]
        s = next((s for s in range(lo, s_old) if s not in taken[r] and _fits(held[r], s, s_old, op, cap[r])),
                 s_old)
        step = {"F": 1, "B": 0, "W": -1}[op]
        for t in range(s, s_old):
            held[r][t] += step
        new[key] = s
        taken[r].add(s)
    return new


def _backwards_first(squeezed: dict, blocks: dict, P: int, M: int) -> dict:
    """The ``F`` and ``B`` of ``squeezed`` with each ``B`` of the cooldown (in ``blocks``, after the last microbatch's
    first ``F``) moved, in slot order, to the earliest free slot after its input (a ``B`` adds no activation)."""
    start = blocks[(0, "F", 0, M - 1)]
    fb = {key: s for key, s in squeezed.items() if key[1] != "W"}
    taken = [set() for _ in range(P)]
    new: dict = {}
    for key in sorted(fb, key=fb.get):
        r, op, c, j = key
        s = fb[key]
        if op == "B" and blocks[key] > start:
            lo = max(_after(new, _input(key, P)), _after(new, (r, op, c, j - 1)))
            s = next((t for t in range(lo, s) if t not in taken[r]), s)
        new[key] = s
        taken[r].add(s)
    return new


def _held(slots: dict, r: int, M: int, horizon: int) -> list[int]:
    """Rank ``r``'s activations after each slot, each from its ``F`` to its ``W``."""
    delta = [0] * (horizon + 1)
    for c in (0, 1):
        for j in range(M):
            delta[slots[(r, "F", c, j)]] += 1
            delta[slots[(r, "W", c, j)]] -= 1
    level, out = 0, []
    for t in range(horizon):
        level += delta[t]
        out.append(level)
    return out


def _fits(held: list[int], s: int, s_old: int, op: str, cap: int) -> bool:
    """Moving an ``F`` from ``s_old`` to ``s`` adds an activation over ``[s, s_old)``; ``B`` and ``W`` add none."""
    return op != "F" or max(held[s:s_old]) + 1 <= cap


def _input(key, P: int):
    """The pass that must precede ``key``: the previous stage's ``F`` / the next stage's ``B`` (the own ``F`` on the
    last stage) / the own ``B`` of a ``W``; ``None`` for the first stage's ``F``."""
    r, op, c, j = key
    stage = r if c == 0 else 2 * P - 1 - r
    if op == "W":
        return r, "B", c, j
    if op == "F":
        return None if stage == 0 else _at(stage - 1, P, "F", j)
    return (r, "F", c, j) if stage == 2 * P - 1 else _at(stage + 1, P, "B", j)


def _at(stage: int, P: int, op: str, j: int):
    r, c = (stage, 0) if stage < P else (2 * P - 1 - stage, 1)
    return r, op, c, j


def _after(new: dict, key) -> int:
    """The first slot after ``key``'s (0 for none)."""
    return 0 if key is None or key[3] < 0 else new[key] + 1


def _peak(actions) -> tuple[int, int]:
    held = pending = peak_held = peak_pending = 0
    for a in actions:
        held += (a.op is Op.FORWARD) - (a.op is Op.BACKWARD)
        pending += (a.op is Op.BACKWARD) - (a.op is Op.WEIGHT)
        peak_held, peak_pending = max(peak_held, held), max(peak_pending, pending)
    return peak_held, max(peak_pending, 1)
