"""Split-backward plans (pure): invariants over parameter grids, the closed forms, placement, validation.

The bubble and memory figures are checked with a small unit-cost execution written here (not the project's
simulator), against the closed forms of Qi et al. ("Zero Bubble Pipeline Parallelism", ICLR 2024): ZB-H1's bubble
``(P-1)(F+B-W)`` with 1F1B's in-flight activations ``min(P-r, M)``; ZB-V's bubble of the pipeline fill alone
(``P-1`` chunk forwards) with ``P+1+r`` chunk activations on rank ``r``, at most ``2P`` (1F1B's rank-0 peak, in
half-size chunks).
"""
from __future__ import annotations

import itertools

import pytest

from engine.plan import build_plan
from engine.plan.build import Action, Op, Plan, looped_placement, v_placement
from engine.plan.lowering import compile_rank
from engine.plan.simulate import simulate
from engine.plan.validate import PlanError, memory_levels, validate_plan, validate_programs

GRID = [(P, M) for P in (1, 2, 3, 4, 6) for M in (1, 2, P, P + 1, 2 * P, 3 * P + 1)]


def _unit_makespan(plan: Plan) -> int:
    """Makespan with every action costing 1 and free transfers: an action starts when the rank is free and its
    input (the neighbour stage's F or B of the same microbatch) has finished."""
    S = plan.num_stages
    done, clock, at = {}, [0] * plan.pp_size, [0] * plan.pp_size
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(plan.actions):
            while at[r] < len(acts):
                a = acts[at[r]]
                s = plan.stage(r, a.chunk)
                dep = (("F", s - 1) if a.op is Op.FORWARD and s > 0 else
                       ("B", s + 1) if a.op is Op.BACKWARD and s < S - 1 else None)
                key = None if dep is None else (*dep, a.microbatch)
                if key is not None and key not in done:
                    break
                start = max(clock[r], done[key] if key else 0)
                done[(a.op.value, s, a.microbatch)] = clock[r] = start + 1
                at[r] += 1
                progress = True
    assert all(at[r] == len(acts) for r, acts in enumerate(plan.actions)), "deadlock"
    return max(clock)


def _counts(acts):
    held = pending = peak_held = peak_pending = 0
    for a in acts:
        held += a.op is Op.FORWARD
        held -= a.op is Op.BACKWARD
        pending += (a.op is Op.BACKWARD) - (a.op is Op.WEIGHT)
        peak_held, peak_pending = max(peak_held, held), max(peak_pending, pending)
    return peak_held, peak_pending


@pytest.mark.parametrize("schedule,chunks", [("zb_h1", 1), ("zbv", 2), ("zb", 1), ("zb", 2), ("zb", 3)])
def test_every_split_plan_is_complete_ordered_and_valid(schedule, chunks):
    for P, M in GRID:
        plan = build_plan(schedule, P, M, chunks)
        validate_plan(plan)
        for r, acts in enumerate(plan.actions):
            assert sorted(map(str, acts)) == sorted(f"{op}{m}.{c}" for op in "FBW" for c in range(chunks)
                                                    for m in range(M)), (schedule, P, M, r)
            pos = {(a.op, a.chunk, a.microbatch): i for i, a in enumerate(acts)}
            for c, m in itertools.product(range(chunks), range(M)):
                assert pos[(Op.FORWARD, c, m)] < pos[(Op.BACKWARD, c, m)] < pos[(Op.WEIGHT, c, m)]
            for c in range(chunks):  # each chunk's W (and F, B) in microbatch order: 1F1B's accumulation order
                for op in Op:
                    order = [a.microbatch for a in acts if a.op is op and a.chunk == c]
                    assert order == sorted(order), (schedule, P, M, r, c, op)
            held, pending = _counts(acts)
            assert held <= plan.max_in_flight[r] and pending <= plan.max_pending_w[r]
            assert memory_levels(plan)[r] == (held, pending)


@pytest.mark.parametrize("P,M", [(P, M) for P, M in GRID if P > 1 and M >= P])
def test_zb_h1_meets_its_closed_forms(P, M):
    """The closed forms hold once the pipeline fills (M >= P; with fewer microbatches no W is left to fill the
    cooldown)."""
    plan = build_plan("zb_h1", P, M)
    assert _unit_makespan(plan) - 3 * M == P - 1  # bubble (P-1)(F+B-W) with F = B = W = 1
    assert [_counts(a)[0] for a in plan.actions] == [min(P - r, M) for r in range(P)]  # 1F1B's activations
    sim = simulate(plan, forward_time=1.0, backward_time=1.0, weight_time=1.0)
    assert sim.makespan == 3 * M + P - 1
    assert sim.peak_in_flight == tuple(min(P - r, M) for r in range(P))


@pytest.mark.parametrize("P", [2, 3, 4, 6])
def test_zbv_fills_the_pipeline_and_holds_no_more_than_1f1b(P):
    for M in (P, 2 * P, 3 * P):
        plan = build_plan("zbv", P, M, 2)
        assert plan.stage_map == v_placement(P)
        # two chunks per rank, 3 ops each per microbatch: only the fill of P-1 chunk forwards stays idle
        assert _unit_makespan(plan) - 6 * M == P - 1, (P, M)
        # chunk activations held: P + 1 + r on rank r, at most 2P (1F1B's rank-0 peak: P full-rank activations
        # = 2P half-size chunk activations)
        assert [_counts(a)[0] for a in plan.actions] == [P + 1 + r for r in range(P)]


def test_one_f_one_b_bubble_is_three_times_zb_h1s_with_equal_costs():
    for P in (2, 4, 8):
        M = 2 * P
        unsplit = simulate(build_plan("1f1b", P, M), forward_time=1.0, backward_time=2.0)
        split = simulate(build_plan("zb_h1", P, M), forward_time=1.0, backward_time=1.0, weight_time=1.0)
        assert unsplit.makespan - 3 * M == 3 * (P - 1) and split.makespan - 3 * M == P - 1


def test_v_placement_hands_over_locally_and_puts_both_ends_on_rank_0():
    plan = build_plan("zbv", 3, 3, 2)
    assert plan.stages_of(0) == (0, 5) and plan.stages_of(2) == (2, 3)
    assert plan.is_first_stage(0, 0) and plan.is_last_stage(0, 1)
    m = plan.output_message(2, Action(Op.FORWARD, 0, 1))
    assert (m.src, m.dst, m.dst_chunk) == (2, 2, 1)  # stage 2 -> 3 stays on rank 2
    program = compile_rank(plan, 2, prefetch=3)
    local_out = [st for st in program.steps if st.local_out >= 0]
    local_in = [st for st in program.steps if st.local_in >= 0]
    assert len(local_out) == len(local_in) == 2 * 3  # activations forward and gradients back, per microbatch
    assert all(st.send_peer == -1 for st in local_out) and all(st.recv == -1 for st in local_in)
    assert program.num_local == 6
    assert plan.stage_map == v_placement(3) and build_plan("zb_h1", 3, 3).stage_map == looped_placement(3, 1)


@pytest.mark.parametrize("schedule,chunks", [("zb_h1", 1), ("zbv", 2), ("zb", 2), ("1f1b", 1), ("interleaved", 2)])
def test_compiled_programs_are_deadlock_free_in_every_p2p_mode(schedule, chunks):
    for P, M in [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8)]:
        if schedule == "interleaved" and M % P:
            continue
        for forward_only, prefetch, batched in itertools.product((False, True), (1, 3), (False, True)):
            validate_programs(build_plan(schedule, P, M, chunks, forward_only=forward_only), prefetch, batched)


def test_program_check_catches_a_send_waited_before_its_receive_is_posted(monkeypatch):
    """Negative control: waiting every send right after it was posted (before the receiver provably posted its
    receive) deadlocks on gloo; the program check must say so."""
    from engine.plan import lowering
    monkeypatch.setattr(lowering, "reap_points", lambda plan, rank, prefetch, batched, recvs, overlap=False: {
        m: i + 1 for i, a in enumerate(plan.actions[rank]) if (m := plan.output_message(rank, a)) is not None})
    with pytest.raises(PlanError, match="deadlock in the compiled program"):
        validate_programs(build_plan("zbv", 2, 4, 2), prefetch=1)


def test_validator_refuses_wrong_split_plans():
    good = build_plan("zb_h1", 2, 2)
    acts = list(good.actions[0])
    w, b = acts.index(Action(Op.WEIGHT, 0, 0)), acts.index(Action(Op.BACKWARD, 0, 0))
    acts[w], acts[b] = acts[b], acts[w]
    with pytest.raises(PlanError, match="runs before"):
        validate_plan(Plan(good.schedule, 2, 1, 2, 2, False, good.warmup, (tuple(acts), good.actions[1])))
    missing = tuple(a for a in good.actions[1] if a != Action(Op.WEIGHT, 0, 1))
    with pytest.raises(PlanError, match="never runs W1.0"):
        validate_plan(Plan(good.schedule, 2, 1, 2, 2, False, good.warmup, (good.actions[0], missing)))
    tight = Plan(good.schedule, 2, 1, 2, 2, False, good.warmup, good.actions, None, (1, 1), None)
    with pytest.raises(PlanError, match="activations held reach 2, over the plan's limit 1"):
        validate_plan(tight)


def test_budgeted_plans_respect_the_budget_and_trade_memory_for_bubble():
    P, M = 4, 12
    bubbles = []
    for limit in (1, 2, P, 2 * P):
        plan = build_plan("zb", P, M, max_in_flight=limit)
        assert all(_counts(a)[0] <= limit for a in plan.actions)
        bubbles.append(_unit_makespan(plan) - 3 * M)
    assert bubbles == sorted(bubbles, reverse=True) and bubbles[0] > bubbles[-1]
    with pytest.raises(ValueError, match="max_in_flight=0 is invalid"):
        build_plan("zb", P, M, max_in_flight=0)
    with pytest.raises(ValueError, match="for schedule=.*'zb' only"):
        build_plan("zb_h1", P, M, max_in_flight=2)


def test_split_schedules_take_the_chunk_counts_they_need():
    with pytest.raises(ValueError, match="ZB-V places exactly two model chunks"):
        build_plan("zbv", 2, 4, 1)
    with pytest.raises(ValueError, match="takes 1 model chunk"):
        build_plan("zb_h1", 2, 4, 2)
    with pytest.raises(ValueError, match="schedule='nope' is unknown"):
        build_plan("nope", 2, 4)


def test_forward_only_plans_keep_the_placement():
    plan = build_plan("zbv", 3, 4, 2, forward_only=True)
    assert plan.stage_map == v_placement(3) and not any(a.op is not Op.FORWARD for acts in plan.actions for a in acts)
    validate_programs(plan, prefetch=3)
