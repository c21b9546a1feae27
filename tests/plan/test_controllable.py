"""V-Half and V-Min (pure): valid V-placement plans whose memory and bubble, with ``F = B = W``, are what the
controllable-memory paper states (Qi et al., NeurIPS 2024, arXiv:2405.15362, and its authors' summary table):
activation memory ``(p+2)//2`` and ``(p+4)//3`` microbatches (1/2 and 1/3 of 1F1B's ``p``), bubble rate about
``p/2m`` and ``2p/3m`` against 1F1B's ``p/m`` -- here at most 1/2 and 2/3 of 1F1B's ``(p-1)(T_F+T_B+T_W)`` -- and
equal to the construction's closed forms over a grid of ``p`` and ``m``.

Bubble and memory come from a unit-cost execution and a memory walk written here (not the project's simulator):
every pass takes one slot, a pass starts when its rank is free and its input (the neighbour stage's ``F`` or
``B`` of the microbatch; the own ``F`` on the last stage) has ended; the bubble is the longest rank's span from
its first to its last pass minus its ``6M`` busy slots (the paper's bubble rate times that span); memory counts a
chunk activation from its ``F`` to its ``W``, as the paper does.
"""
from __future__ import annotations

import itertools

import pytest

from engine.plan import Op, build_plan
from engine.plan.types import v_placement
from engine.plan.validate import validate_programs

GRID = [(P, M) for P in range(2, 13) for M in (P, P + 1, 2 * P, 3 * P + 2)] + [(16, 16), (16, 37)]
PAPER = {  # schedule -> (activation memory in microbatches, share of 1F1B's bubble): the paper's statements
    "v_half": (lambda P: (P + 2) // 2, 1 / 2),
    "v_min": (lambda P: (P + 4) // 3, 2 / 3),
}


def _spans(plan) -> list[int]:
    """Per rank, first-pass start to last-pass end with every pass one slot (module doc)."""
    S = plan.num_stages
    done, clock, at, first = {}, [0] * plan.pp_size, [0] * plan.pp_size, [None] * plan.pp_size
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(plan.actions):
            while at[r] < len(acts):
                a = acts[at[r]]
                s = plan.stage(r, a.chunk)
                dep = (("F", s - 1) if a.op is Op.FORWARD and s > 0 else ("B", s + 1) if a.op is Op.BACKWARD and
                       s < S - 1 else ("F", s) if a.op is Op.BACKWARD else ("B", s) if a.op is Op.WEIGHT else None)
                key = None if dep is None else (*dep, a.microbatch)
                if key is not None and key not in done:
                    break
                start = max(clock[r], done[key] if key else 0)
                first[r] = start if first[r] is None else first[r]
                done[(a.op.value, s, a.microbatch)] = clock[r] = start + 1
                at[r] += 1
                progress = True
    assert all(at[r] == len(acts) for r, acts in enumerate(plan.actions)), "deadlock"
    return [clock[r] - first[r] for r in range(plan.pp_size)]


def _memory(acts) -> int:
    """Peak chunk activations, each from its F to its W."""
    level = peak = 0
    for a in acts:
        level += (a.op is Op.FORWARD) - (a.op is Op.WEIGHT)
        peak = max(peak, level)
    return peak


def _closed_form(name: str, P: int, M: int) -> int:
    """The construction's bubble in slots (engine.plan.controllable's module doc), for ``M >= P >= 2``."""
    if name == "v_min":
        return 4 * P - 7 if P % 3 == 0 else 4 * P - 5
    if P == 2:
        return 1 if M == 2 else 0
    return 3 * P - 7 if P % 2 == 0 else 3 * P - 4


@pytest.mark.parametrize("name", sorted(PAPER))
def test_memory_and_bubble_are_the_papers(name):
    """Memory exactly the paper's; bubble within the paper's share of 1F1B's ``6(P-1)`` slots (a 1F1B stage holds
    two chunks, so its ``T_F + T_B + T_W`` is 6 slots) and equal to the closed form."""
    memory, share = PAPER[name]
    for P, M in GRID:
        plan = build_plan(name, P, M, 2)
        assert plan.stage_map == v_placement(P)
        # memory: the paper's figure in chunk activations (two per microbatch), on the fullest rank
        assert max(_memory(acts) for acts in plan.actions) == 2 * memory(P), (name, P, M)
        bubble = max(_spans(plan)) - 6 * M
        assert bubble <= share * 6 * (P - 1), (name, P, M, bubble)
        assert bubble == _closed_form(name, P, M), (name, P, M, bubble)


def test_one_rank_has_no_bubble():
    for name in PAPER:
        for M in (1, 3):
            assert max(_spans(build_plan(name, 1, M, 2))) == 6 * M


@pytest.mark.parametrize("name", ["v_half", "v_min"])
def test_plans_are_complete_ordered_lowered_and_within_their_limits(name):
    for P, M in [(1, 1), (1, 3), (2, 1), (2, 3), (3, 2), (4, 4), (4, 9), (6, 7)]:
        plan = build_plan(name, P, M, 2)
        validate_programs(plan)
        for r, acts in enumerate(plan.actions):
            assert sorted(map(str, acts)) == sorted(f"{op}{m}.{c}" for op in "FBW" for c in (0, 1) for m in range(M))
            for op, c in itertools.product(Op, (0, 1)):  # each chunk's passes in microbatch order (bitwise W sums)
                order = [a.microbatch for a in acts if a.op is op and a.chunk == c]
                assert order == sorted(order)
        forward = build_plan(name, P, M, 2, forward_only=True)
        validate_programs(forward)
        assert all(a.op is Op.FORWARD for acts in forward.actions for a in acts)


def test_v_half_holds_half_and_v_min_a_third_of_1f1b():
    P, M = 8, 32
    one_f_one_b = P  # 1F1B's rank 0 holds P microbatches
    assert max(_memory(a) for a in build_plan("v_half", P, M, 2).actions) / 2 == one_f_one_b / 2 + 1
    assert max(_memory(a) for a in build_plan("v_min", P, M, 2).actions) / 2 == (P + 4) // 3


def test_they_take_the_v_placement_only():
    with pytest.raises(ValueError, match="V-Half places exactly two model chunks"):
        build_plan("v_half", 2, 4, 1)
    with pytest.raises(ValueError, match="V-Min places exactly two model chunks"):
        build_plan("v_min", 2, 4, 3)
