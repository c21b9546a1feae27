"""Tuner candidates and predictions (engine.plan.candidates): the candidate set over parameter grids, predictions
against a deterministic fake cost model with hand-derived results, memory per rank against hand counts."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from engine.plan import Op, build_plan
from engine.plan.pass_costs import PassCosts
from engine.plan.candidates import (Candidate, CostModel, LayoutCosts, candidates, peak_memory_bytes, predict,
                                    rank_predictions, virtual_sizes)
from engine.plan.validate import validate_plan

GRID = [(P, L, M) for P, L, M in itertools.product((1, 2, 3, 4), (4, 6, 8, 12), (1, 2, 3, 4, 5, 8)) if L % P == 0]


def _megatron_group_ok(M: int, P: int, G: int) -> bool:
    """Megatron's rule for microbatch_group_size_per_vp_stage, written out here: P <= G <= M, and the remainder of
    M mod G is 0 or at least P."""
    return P <= G <= M and (M % G == 0 or M % G >= P)


@pytest.mark.parametrize("P,L,M", GRID)
def test_every_candidate_is_a_valid_distinct_plan(P, L, M):
    cands = candidates(P, L, M)
    plans = [c.plan(P, M) for c in cands]
    for c, plan in zip(cands, plans):
        validate_plan(plan)  # raises on an invalid plan
        assert plan.num_model_chunks == c.virtual and plan.pp_size == P and plan.num_microbatches == M
        assert L % (P * c.virtual) == 0, f"{c.label}: {L} layers do not split into {P}x{c.virtual} chunks"
        assert plan.splits_backward == c.splits_backward
        if c.max_in_flight is not None:
            assert all(n <= c.max_in_flight for n in _in_flight_peaks(plan))
    keys = [(p.placement, p.actions) for p in plans]
    assert len(set(keys)) == len(keys), "two candidates with the same plan"


def _in_flight_peaks(plan) -> list[int]:
    """Per rank, the most (chunk, microbatch) activations held at once: F done, B not (counted here)."""
    out = []
    for acts in plan.actions:
        level = peak = 0
        for a in acts:
            level += 1 if a.op is Op.FORWARD else -1 if a.op is Op.BACKWARD else 0
            peak = max(peak, level)
        out.append(peak)
    return out


@pytest.mark.parametrize("P,L,M", GRID)
def test_the_candidate_set_covers_every_schedule_that_applies(P, L, M):
    cands = candidates(P, L, M)
    names = {c.schedule for c in cands}
    assert ("1f1b" in names) == (P > 1) and ("no_pipelining" in names) == (P == 1)
    assert "zb_h1" in names or P == 1  # ZB-H1 at P = 1 is no pipelining with W after B: same order as zb
    assert ("zbv" in names) == (L % (2 * P) == 0)
    sizes = [v for v in range(1, L + 1) if L % (P * v) == 0]
    assert virtual_sizes(P, L) == sizes
    for v in sizes:
        if v >= 2 and P >= 2:
            groups = {c.group_size or P for c in cands if c.schedule == "interleaved" and c.virtual == v}
            valid = {G for G in range(P, M + 1) if _megatron_group_ok(M, P, G)}
            assert groups <= valid and (groups or not valid)
        assert any(c.virtual == v and c.splits_backward for c in cands)


def test_candidate_overrides_and_arguments():
    c = Candidate("interleaved", 2, 4)
    assert c.overrides() == {"parallel.schedule": "interleaved", "parallel.virtual": 2,
                             "parallel.microbatch_group_size_per_vp_stage": 4, "parallel.max_in_flight": None,
                             "parallel.schedule_costs": None}
    assert c.arguments() == ["--parallel.schedule=interleaved", "--parallel.virtual=2",
                             "--parallel.microbatch_group_size_per_vp_stage=4"]
    assert Candidate("zb", 1, max_in_flight=3).label == "zb v=1 max_in_flight=3"
    costed = Candidate("zb", 1, max_in_flight=3, costs=PassCosts(1.0, 2.0, 0.5, 0.1))
    assert costed.label == "zb v=1 max_in_flight=3 cost-aware"
    assert costed.overrides()["parallel.schedule_costs"] == str(costed.costs)
    assert PassCosts.parse(costed.overrides()["parallel.schedule_costs"]) == costed.costs


def _uniform(stages: int, F=1.0, B=2.0, W=0.0, A=10, Wb=0, static=100, overhead=0.0, step=0.0) -> LayoutCosts:
    n = stages
    return LayoutCosts((F,) * n, (B,) * n, (W,) * n, (A,) * n, (Wb,) * n, (static,) * n, overhead, step)


@pytest.mark.parametrize("P,M", [(2, 4), (3, 5), (4, 8)])
def test_1f1b_prediction_is_the_closed_form(P, M):
    """Fake costs F, B, per-action overhead o, step overhead s, no transfer: 1F1B's step is
    (M + P - 1) (F + B + 2o) + s (Narayanan et al., SC'21, eq. 1, with the overhead inside each action)."""
    F, B, o, s = 1.0, 2.0, 0.25, 7.0
    model = CostModel({(1, False): _uniform(P, F, B, overhead=o, step=s)})
    p = predict(Candidate("1f1b"), model, P, M)
    assert p.predicted_ms == pytest.approx((M + P - 1) * (F + B + 2 * o) + s)
    assert p.schedule_ms == pytest.approx(p.predicted_ms - s)
    assert p.bubble == pytest.approx((P - 1) / (M + P - 1))
    assert p.simulated_ms == p.predicted_ms
    scaled = CostModel({(1, False): dataclasses.replace(model.layouts[(1, False)], calibration=1.25)})
    q = predict(Candidate("1f1b"), scaled, P, M)
    assert q.simulated_ms == pytest.approx(p.simulated_ms) and q.predicted_ms == pytest.approx(1.25 * p.predicted_ms)


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8)])
def test_zb_h1_prediction_is_the_closed_form(P, M):
    """F = B = W = 1: ZB-H1's step is 3M + (P - 1)(F + B - W) (Qi et al., ICLR 2024)."""
    model = CostModel({(1, True): _uniform(P, 1.0, 1.0, 1.0)})
    assert predict(Candidate("zb_h1"), model, P, M).predicted_ms == pytest.approx(3 * M + (P - 1))


def test_stage_costs_follow_the_placement():
    """Costs are per stage: only the last stage is expensive; under ZB-V it sits on rank 0 (stage 2P-1-r), so
    rank 0 computes M (F + B + W) more than under the looped zb plan of the same layout, where it is rank P-1's."""
    P, M, extra = 2, 4, 5.0
    costs = LayoutCosts((1.0, 1.0, 1.0, 1.0 + extra), (1.0,) * 4, (1.0,) * 4, (1,) * 4, (1,) * 4, (0,) * 4)
    model = CostModel({(2, True): costs})
    from engine.plan.simulate import simulate
    for cand, heavy_rank in ((Candidate("zbv", 2), 0), (Candidate("zb", 2), 1)):
        plan = cand.plan(P, M)
        assert plan.stage_location(3)[0] == heavy_rank
        sim = simulate(plan, [[1.0 + extra * (plan.stage(r, c) == 3) for c in range(2)] for r in range(P)], 1.0,
                       0.0, 1.0)
        pred = predict(cand, model, P, M)
        assert pred.schedule_ms == pytest.approx(sim.makespan)
        busy = [(2 * 3.0 + extra * (r == heavy_rank)) * M for r in range(P)]
        assert list(pred.busy_ms) == pytest.approx(busy)


def test_transfer_time_adds_to_the_critical_path():
    """One microbatch through P stages, F = B = 1, latency t: P forwards, P backwards, 2(P-1) messages."""
    P, t = 3, 0.5
    model = CostModel({(1, False): _uniform(P, 1.0, 1.0)}, transfer_ms=t)
    assert predict(Candidate("1f1b"), model, P, 1).schedule_ms == pytest.approx(2 * P + 2 * (P - 1) * t)


def test_memory_1f1b_is_static_plus_in_flight_activations():
    """1F1B holds min(P - r, M) activations on rank r (its warmup plus one)."""
    P, M, A, S = 4, 8, 10, 100
    plan = build_plan("1f1b", P, M)
    assert peak_memory_bytes(plan, _uniform(P, A=A, static=S)) == tuple(S + min(P - r, M) * A for r in range(P))


def test_memory_split_counts_pending_w_and_the_tied_embedding_once():
    """ZB-V at P = 2, M = 1.  Rank 0 runs F0.0(s0) F0.1(s3) B0.1(s3) W0.1(s3) B0.0(s0) W0.0(s0): held bytes
    10, 50, 50-40+4, 14-4, 10-10+1, 0 -> peak 50, static 100 + 400 less the tied embedding counted twice (7).
    Rank 1 runs F0.0(s1) F0.1(s2) B0.1(s2) B0.0(s1) W0.1(s2) W0.0(s1): 20, 50, 23, 5, 2, 0 -> 50 + 200 + 300."""
    lc = LayoutCosts((1.0,) * 4, (1.0,) * 4, (1.0,) * 4, (10, 20, 30, 40), (1, 2, 3, 4), (100, 200, 300, 400))
    plan = build_plan("zbv", 2, 1, 2)
    assert [str(a) for a in plan.actions[0]] == ["F0.0", "F0.1", "B0.1", "W0.1", "B0.0", "W0.0"]
    assert [str(a) for a in plan.actions[1]] == ["F0.0", "F0.1", "B0.1", "B0.0", "W0.1", "W0.0"]
    assert peak_memory_bytes(plan, lc, tied_bytes=7) == (100 + 400 - 7 + 50, 200 + 300 + 50)
    # the same stages looped (zb, v=2): stages 0 and 2 on rank 0, no tied sharing on one rank
    looped = build_plan("zb", 2, 1, 2)
    assert peak_memory_bytes(looped, lc, tied_bytes=7)[0] >= 100 + 300 + 10


@pytest.mark.parametrize("schedule,P,M,v", [("zb_h1", 2, 4, 1), ("zb_h1", 4, 8, 1), ("zbv", 2, 5, 2),
                                             ("zbv", 4, 8, 2), ("zb", 3, 6, 2)])
def test_memory_walk_counts_what_the_validator_counts(schedule, P, M, v):
    """Unit bytes: activation 1 and pending W 0 give the peak in-flight count, activation 0 and pending W 1 the
    peak pending-W count, as :func:`engine.plan.validate.memory_levels` counts them."""
    from engine.plan.validate import memory_levels
    plan = build_plan(schedule, P, M, v)
    n = plan.num_stages
    levels = memory_levels(plan)
    acts = LayoutCosts((1.0,) * n, (1.0,) * n, (1.0,) * n, (1,) * n, (0,) * n, (0,) * n)
    pend = LayoutCosts((1.0,) * n, (1.0,) * n, (1.0,) * n, (0,) * n, (1,) * n, (0,) * n)
    assert peak_memory_bytes(plan, acts) == tuple(x for x, _ in levels)
    assert peak_memory_bytes(plan, pend) == tuple(w for _, w in levels)


def test_ranking_puts_fitting_candidates_first():
    P, M = 2, 4
    model = CostModel({(1, False): _uniform(P, A=1000), (1, True): _uniform(P, 1.0, 1.0, 1.0, A=1000, Wb=1000)})
    preds = [predict(c, model, P, M) for c in (Candidate("1f1b"), Candidate("zb_h1"))]
    fast, slow = sorted(preds, key=lambda p: p.predicted_ms)
    assert rank_predictions(preds)[0] is fast
    budget = max(slow.peak_memory_bytes)
    if max(fast.peak_memory_bytes) > budget:
        assert rank_predictions(preds, budget)[0] is slow
    assert all(p.fits(None) for p in preds)


def test_a_layout_that_was_not_measured_is_named():
    with pytest.raises(KeyError, match="virtual=2 with split backward"):
        predict(Candidate("zbv", 2), CostModel({(1, False): _uniform(2)}), 2, 4)
    with pytest.raises(ValueError, match="forward_ms has 2 entries for 4 stages"):
        predict(Candidate("interleaved", 2), CostModel({(2, False): _uniform(2)}), 2, 4)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_layers=6 is not divisible by pp_size=4"):
        candidates(4, 6, 4)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        candidates(2, 4, 0)
