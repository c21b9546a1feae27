"""The simulator against closed forms (Narayanan et al., SC'21) and hand-computed timelines.

All costs are small integers (or integer multiples of a power of two), so every simulated time is an exact float and
the closed forms are checked with ``==`` up to the final division.
"""
from __future__ import annotations

import pytest

from engine.plan import build_plan
from engine.plan.simulate import simulate


@pytest.mark.parametrize("forward,backward", [(1, 1), (1, 2), (2, 3)])
def test_1f1b_bubble_fraction_closed_form(forward, backward):
    """1F1B bubble fraction = (p-1)/(m+p-1) of the makespan on every rank.

    The makespan is ``(m+p-1)(t_f+t_b)`` for any ``t_f``, ``t_b`` with zero transfer time: the first forward reaches
    the last rank after ``(p-1)t_f``, the last backward leaves it ``(p-1)t_b`` before the end, and each rank computes
    ``m(t_f+t_b)``.  ``t_f == t_b`` is the textbook case; the others show the form does not need it.  Integer
    costs keep all times exact.
    """
    for pp in range(2, 9):
        for microbatches in (1, 2, pp - 1, pp, 2 * pp + 1, 24):
            if microbatches < 1:
                continue
            sim = simulate(build_plan("1f1b", pp, microbatches), forward, backward)
            assert sim.makespan == (microbatches + pp - 1) * (forward + backward)
            expected = (pp - 1) / (microbatches + pp - 1)
            assert all(b == pytest.approx(expected, abs=1e-15) for b in sim.bubble), (pp, microbatches, sim.bubble)
            assert sim.busy == (microbatches * (forward + backward),) * pp


def test_interleaved_bubble_closed_form():
    """Interleaved 1F1B bubble = (p-1)/(v*m) of the ideal time, per-chunk cost 1/v of a full stage, m = k*p.

    Instead of costs 1/v (inexact for v=3) each chunk costs 1 (forward) and 2 (backward), so a full stage costs v
    and 2v: the fraction is scale-free and all times stay integers.
    """
    for pp in range(2, 9):
        for chunks in (2, 3, 4):
            for k in (1, 2, 3):
                microbatches = k * pp
                sim = simulate(build_plan("interleaved", pp, microbatches, chunks), 1, 2)
                ideal = microbatches * 3 * chunks
                assert sim.busy == (ideal,) * pp
                assert sim.makespan - ideal == 3 * (pp - 1)  # bubble time (p-1)(t_f+t_b)/v in full-stage units
                expected = (pp - 1) / (chunks * microbatches)
                assert all(b == pytest.approx(expected, abs=1e-15) for b in sim.bubble_of_ideal)


def test_interleaved_beats_1f1b_bubble():
    one = simulate(build_plan("1f1b", 4, 8), 2, 4)
    two = simulate(build_plan("interleaved", 4, 8, 2), 1, 2)  # same model split in two chunks per rank
    assert two.busy == one.busy
    assert two.makespan < one.makespan
    assert two.bubble_overall < one.bubble_overall


def test_peak_in_flight_1f1b_is_p_minus_r():
    for pp in range(1, 9):
        for microbatches in range(pp, pp + 5):
            sim = simulate(build_plan("1f1b" if pp > 1 else "no_pipelining", pp, microbatches))
            assert sim.peak_in_flight == tuple(pp - r for r in range(pp))
    # fewer microbatches than ranks: capped by m
    assert simulate(build_plan("1f1b", 4, 2)).peak_in_flight == (2, 2, 2, 1)


def test_peak_in_flight_interleaved_is_warmup_plus_one():
    for pp, microbatches, chunks, group in [(4, 8, 2, 4), (4, 4, 2, 4), (2, 5, 2, 3), (8, 16, 4, 8), (3, 7, 3, 4)]:
        plan = build_plan("interleaved", pp, microbatches, chunks, group)
        total = microbatches * chunks
        expected = tuple(w + 1 if w < total else total for w in plan.warmup)
        assert simulate(plan).peak_in_flight == expected


def test_no_pipelining_has_no_bubble():
    sim = simulate(build_plan("no_pipelining", 1, 5), 1.5, 2.5)
    assert sim.makespan == 5 * 4.0 and sim.bubble == (0.0,) and sim.bubble_overall == 0.0
    assert sim.peak_in_flight == (1,)
    assert sim.start[0] == [0.0, 1.5, 4.0, 5.5, 8.0, 9.5, 12.0, 13.5, 16.0, 17.5]


def test_forward_only_holds_no_activations():
    sim = simulate(build_plan("interleaved", 2, 4, 2, forward_only=True))
    assert sim.peak_in_flight == (0, 0)
    assert sim.makespan == 4 * 2 + 1  # rank 1 starts one forward late


def test_per_rank_chunk_costs_and_transfer_hand_computed():
    """P=2, M=1: rank 0 forward 1, rank 1 forward 3, backward 2 everywhere, transfer t."""
    plan = build_plan("1f1b", 2, 1)
    for t in (0.0, 0.5):
        sim = simulate(plan, forward_time=[[1.0], [3.0]], backward_time=2.0, transfer_time=t)
        assert sim.start == ([0.0, 6.0 + 2 * t], [1.0 + t, 4.0 + t])
        assert sim.end == ([1.0, 8.0 + 2 * t], [4.0 + t, 6.0 + t])
        assert sim.makespan == 8.0 + 2 * t
        assert sim.busy == (3.0, 5.0)
        assert sim.bubble == pytest.approx(((5.0 + 2 * t) / (8 + 2 * t), (3.0 + 2 * t) / (8 + 2 * t)))
    same = simulate(plan, forward_time={(0, 0): 1.0, (1, 0): 3.0}, backward_time=2.0)
    assert same.start == simulate(plan, forward_time=[[1.0], [3.0]], backward_time=2.0).start


def test_per_chunk_costs_interleaved():
    plan = build_plan("interleaved", 2, 2, 2)
    uniform = simulate(plan, 1.0, 2.0)
    table = simulate(plan, [[1.0, 1.0], [1.0, 1.0]], {(r, c): 2.0 for r in range(2) for c in range(2)})
    assert table.start == uniform.start
    heavy_last = simulate(plan, [[1.0, 1.0], [1.0, 5.0]], 2.0)
    assert heavy_last.busy == (12.0, 20.0)
    assert heavy_last.makespan > uniform.makespan


def test_timeline_is_consistent():
    plan = build_plan("interleaved", 4, 8, 2)
    sim = simulate(plan, 1.0, 2.0, 0.25)
    for rank in range(4):
        starts, ends = sim.start[rank], sim.end[rank]
        assert all(e >= s for s, e in zip(starts, ends))
        assert all(ends[i] <= starts[i + 1] for i in range(len(starts) - 1))  # one action at a time
        for i, action in enumerate(plan.actions[rank]):
            msg = plan.input_message(rank, action)
            if msg is not None:
                j = plan.actions[msg.src].index(next(a for a in plan.actions[msg.src]
                                                     if plan.output_message(msg.src, a) == msg))
                assert starts[i] >= sim.end[msg.src][j] + 0.25
    spans = sim.bars()
    assert len(spans) == plan.total_actions
    assert {s.kind for s in spans} == {"F", "B"}
    assert max(s.end for s in spans) == sim.makespan


@pytest.mark.parametrize("kwargs,match", [
    ({"forward_time": -1.0}, "forward_time=-1.0"),
    ({"backward_time": float("nan")}, "backward_time=nan"),
    ({"transfer_time": float("inf")}, "transfer_time=inf"),
    ({"forward_time": [[1.0]]}, r"\[2\]\[1\] nested list"),
    ({"forward_time": {(0, 0): 1.0}}, r"\(rank, chunk\)=\(1, 0\)"),
    ({"backward_time": [[1.0], [-2.0]]}, r"backward_time\[1\]\[0\]=-2.0"),
])
def test_bad_costs_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(build_plan("1f1b", 2, 2), **kwargs)


def _reference_times(plan, forward, backward, transfer):
    """Independent fixed-point evaluation straight from the plan's messages (quadratic; small plans only)."""
    producer = {}
    for rank, acts in enumerate(plan.actions):
        for i, a in enumerate(acts):
            msg = plan.output_message(rank, a)
            if msg is not None:
                producer[msg] = (rank, i)
    cost = {"F": forward, "B": backward}
    end = [[None] * len(acts) for acts in plan.actions]
    start = [[None] * len(acts) for acts in plan.actions]
    changed = True
    while changed:
        changed = False
        for rank, acts in enumerate(plan.actions):
            for i, a in enumerate(acts):
                if end[rank][i] is not None:
                    continue
                ready = end[rank][i - 1] if i else 0.0
                msg = plan.input_message(rank, a)
                if ready is None:
                    break
                if msg is not None:
                    src = end[producer[msg][0]][producer[msg][1]]
                    if src is None:
                        break
                    ready = max(ready, src + transfer)
                start[rank][i] = ready
                end[rank][i] = ready + cost[a.op.value][rank][a.chunk]
                changed = True
    return start, end


def test_simulate_matches_reference_on_random_costs():
    import random
    rng = random.Random(7)
    cases = [("1f1b", 3, 5, 1, None), ("interleaved", 2, 5, 2, 3), ("interleaved", 3, 6, 3, 3),
             ("interleaved", 4, 8, 2, 4), ("no_pipelining", 1, 3, 1, None)]
    for schedule, pp, microbatches, chunks, group in cases:
        plan = build_plan(schedule, pp, microbatches, chunks, group)
        for _ in range(3):
            forward = [[rng.choice((0.5, 1.0, 1.5, 3.0)) for _ in range(chunks)] for _ in range(pp)]
            backward = [[rng.choice((1.0, 2.0, 2.5)) for _ in range(chunks)] for _ in range(pp)]
            transfer = rng.choice((0.0, 0.25, 1.0))
            sim = simulate(plan, forward, backward, transfer)
            start, end = _reference_times(plan, forward, backward, transfer)
            assert list(sim.start) == start and list(sim.end) == end
            assert sim.makespan == max(e[-1] for e in end)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 5)])
def test_nominal_bubble_is_the_1f1b_closed_form(p, m):
    """The simulated bubble ``pipecast train`` prints at start-up and the timeline repeats (one definition,
    :func:`simulate_nominal`): for 1F1B at nominal costs, ``(p-1)/(m+p-1)`` on every rank; a split plan's nominal
    costs are B = W = 1 (the same total backward of 2)."""
    from engine.plan.simulate import simulate_nominal
    assert simulate_nominal(build_plan("1f1b", p, m)).bubble_overall == pytest.approx((p - 1) / (m + p - 1))
    split = simulate_nominal(build_plan("zb_h1", p, m))
    assert split.busy == simulate(build_plan("zb_h1", p, m), 1.0, 1.0, 0.0, 1.0).busy
    assert all(b == 3.0 * m for b in split.busy)  # F 1 + B 1 + W 1 per microbatch: the unsplit 1 + 2
