"""Plans against Megatron's executed schedules (``trace:`` vectors) and invariants over parameter grids.

Every ``trace:*forward_backward_*`` vector of ``tests/data/megatron_schedules.json`` is a real Megatron-Core 0.16.1
schedule run with fake compute and a fake network; each rank's ``action_labels`` must equal ``Plan.action_labels``.
Where Megatron raises, ``build_plan`` raises the same exception type.  pipecast deliberately differs on three
degenerate inputs, listed in ``DELIBERATE`` with Megatron's recorded behaviour (checked here too).
"""
from __future__ import annotations

import dataclasses

import pytest
from tests.helpers.megatron_vectors import FakeCommunicator, vectors

from engine.plan import Action, Message, Op, build_plan, schedule_name
from engine.plan.table import convert_schedule_table_to_order, get_schedule_table
from engine.schedules import get_pp_rank_microbatches
from engine.plan.validate import validate_plan

_SCHEDULE = {"interleaved": "interleaved", "non_interleaved": "1f1b", "no_pipelining": "no_pipelining"}

# (trace schedule, pp_size, vp_size, num_microbatches) -> (Megatron's recorded behaviour, check of it, pipecast error)
DELIBERATE = {
    ("no_pipelining", 1, None, 0): (
        "runs one microbatch with id -1", lambda ranks: [r["compute_order"] for r in ranks] == [["F-1.0", "B-1.0"]],
        "num_microbatches=0"),
    ("non_interleaved", 2, None, 0): (
        "returns without running anything", lambda ranks: all(r["result"]["status"] == "ok"
                                                              and r["compute_order"] == [] for r in ranks),
        "num_microbatches=0"),
    ("interleaved", 1, 2, 2): (
        "raises IndexError (empty FIFO pop) after F0.0", lambda ranks: ranks[0]["result"]["error"] == "IndexError",
        "pp_size=1"),
}


def _traces() -> list[dict]:
    return [t for t in vectors("trace:") if "forward_backward_" in t["function"]]


def _build(args):
    schedule = _SCHEDULE[args["schedule"]]
    chunks = args["vp_size"] if schedule == "interleaved" else 1
    group = args["microbatch_group_size_per_vp_stage"] if schedule == "interleaved" else None
    return build_plan(schedule, args["pp_size"], args["num_microbatches"], chunks, group, args["forward_only"])


def _ranks(trace) -> list[dict]:
    per_rank = trace["result"]["per_rank"]
    return [per_rank[str(r)] for r in range(len(per_rank))]


def test_trace_vectors_compute_order():
    """Per-rank compute order equals Megatron's on every successful trace; errors raise the same type."""
    checked = errors = 0
    for trace in _traces():
        args, ranks = trace["args"], _ranks(trace)
        key = (args["schedule"], args["pp_size"], args["vp_size"], args["num_microbatches"])
        if key in DELIBERATE:
            continue
        statuses = {r["result"]["status"] for r in ranks}
        assert len(statuses) == 1, f"{trace['function']} {args}: ranks disagree {statuses}"
        if statuses == {"error"}:
            exc_name = ranks[0]["result"]["error"]
            assert exc_name in ("ValueError", "RuntimeError"), (args, exc_name)
            with pytest.raises({"ValueError": ValueError, "RuntimeError": RuntimeError}[exc_name]) as info:
                _build(args)
            assert type(info.value).__name__ == exc_name  # RuntimeError is not a ValueError and vice versa
            errors += 1
            continue
        plan = _build(args)
        assert plan.pp_size == len(ranks)
        for rank, recorded in enumerate(ranks):
            assert recorded["dataflow_errors"] == []
            assert plan.action_labels(rank) == recorded["compute_order"], (trace["function"], args, rank)
        assert trace["result"]["unmatched_p2p_ops"] == []
        validate_plan(plan)
        checked += 1
    assert checked >= 20 and errors >= 4, (checked, errors)


@pytest.mark.parametrize("key", sorted(DELIBERATE, key=str))
def test_deliberate_differences_from_megatron(key):
    """Megatron's degenerate behaviour is recorded in the vectors; pipecast raises a clear ValueError instead."""
    behaviour, recorded_as, names = DELIBERATE[key]
    matches = [t for t in _traces() if (t["args"]["schedule"], t["args"]["pp_size"], t["args"]["vp_size"],
                                        t["args"]["num_microbatches"]) == key]
    assert matches, f"no trace vector for {key}"
    for trace in matches:
        assert recorded_as(_ranks(trace)), f"Megatron no longer {behaviour} for {key}"
        with pytest.raises(ValueError, match=names):
            _build(trace["args"])


# -- invariants over grids ---------------------------------------------------------------------------------------
def _valid_group_sizes(pp: int, microbatches: int):
    """Megatron's interleaved rules: P <= G <= M and M mod G in {0} or >= P."""
    return [g for g in range(pp, microbatches + 1) if microbatches % g == 0 or microbatches % g >= pp]


def _grid():
    """(schedule, P, M, C, G) for pp 1..8, vp 1..4, m 1..24 and every valid group size."""
    for pp in range(1, 9):
        for microbatches in range(1, 25):
            if pp == 1:
                yield "no_pipelining", pp, microbatches, 1, None
                continue
            yield "1f1b", pp, microbatches, 1, None
            for chunks in range(1, 5):  # vp=1 interleaved exists in Megatron (vp_size=1 selects it)
                for group in _valid_group_sizes(pp, microbatches):
                    yield "interleaved", pp, microbatches, chunks, group


def _expected_warmup(schedule, pp, rank, microbatches, chunks, group, forward_only):
    total = microbatches * chunks
    if forward_only:
        return total
    if schedule == "interleaved":
        return min(2 * (pp - rank - 1) + (chunks - 1) * group, total)
    return min(pp - rank - 1, microbatches) if schedule == "1f1b" else 0


def _check_invariants(schedule, pp, microbatches, chunks, group, forward_only):
    plan = build_plan(schedule, pp, microbatches, chunks, group, forward_only)
    g = plan.group_size
    table = get_schedule_table(microbatches, chunks, g)
    every = {(c, m) for c in range(chunks) for m in range(microbatches)}
    for rank in range(pp):
        acts = plan.actions[rank]
        forwards = [(i, a) for i, a in enumerate(acts) if a.op is Op.FORWARD]
        backwards = [(i, a) for i, a in enumerate(acts) if a.op is Op.BACKWARD]
        fpos = {(a.chunk, a.microbatch): i for i, a in forwards}
        bpos = {(a.chunk, a.microbatch): i for i, a in backwards}
        assert len(forwards) == len(fpos) and set(fpos) == every  # exactly one F per (chunk, microbatch)
        assert [(a.microbatch, a.chunk) for _, a in forwards] == table  # forwards in schedule-table order
        if forward_only:
            assert len(acts) == len(forwards)
        else:
            assert len(acts) == 2 * len(every) and len(backwards) == len(bpos) and set(bpos) == every
            assert all(bpos[k] > fpos[k] for k in every)  # B after F
            assert [(a.microbatch, chunks - 1 - a.chunk) for _, a in backwards] == table  # mirrored chunk
        warmup = _expected_warmup(schedule, pp, rank, microbatches, chunks, g, forward_only)
        assert plan.warmup[rank] == warmup
        vp = chunks if schedule == "interleaved" else None
        counts = get_pp_rank_microbatches(microbatches, chunks, g, forward_only,
                                          p2p_communicator=FakeCommunicator(pp, rank, vp))
        assert counts[2] == warmup
        assert all(a.op is Op.FORWARD for a in acts[:warmup])
        if not forward_only:
            assert warmup == len(acts) // 2 or acts[warmup].op is Op.FORWARD and acts[warmup + 1].op is Op.BACKWARD
            if schedule == "interleaved":
                assert plan.te_order(rank) == convert_schedule_table_to_order(warmup, chunks, table)
    validate_plan(plan)
    return plan


def test_invariants_training_grid():
    count = sum(1 for case in _grid() if _check_invariants(*case, forward_only=False))
    assert count > 3000


def test_invariants_forward_only_grid():
    cases = [c for c in _grid() if c[4] in (None, c[1])]  # default group size G = P
    assert all(_check_invariants(*case, forward_only=True) for case in cases)


def test_link_order_matches_receivers():
    """Each directed link's messages, in the sender's order, are exactly what the receiver consumes from it."""
    for schedule, pp, microbatches, chunks, group in [("1f1b", 4, 6, 1, None), ("interleaved", 2, 5, 2, 3),
                                                      ("interleaved", 4, 8, 3, 4), ("interleaved", 3, 8, 2, 4)]:
        plan = build_plan(schedule, pp, microbatches, chunks, group)
        for src in range(pp):
            for dst in range(pp):
                sent = plan.link_order(src, dst)
                received = [m for a in plan.actions[dst] if (m := plan.input_message(dst, a)) and m.src == src]
                assert sorted(sent, key=str) == sorted(received, key=str)
                assert len(set(sent)) == len(sent)


def test_messages_follow_virtual_stages():
    plan = build_plan("interleaved", 2, 2, 2)
    # stage 1 (rank 1, chunk 0) -> stage 2 (rank 0, chunk 1): the wrap-around link
    assert plan.output_message(1, Action(Op.FORWARD, 0, 1)) == Message("act", 1, 0, 0, 1, 1)
    assert plan.input_message(0, Action(Op.FORWARD, 1, 1)) == Message("act", 1, 0, 0, 1, 1)
    assert plan.input_message(0, Action(Op.FORWARD, 0, 0)) is None  # first stage reads data
    assert plan.output_message(1, Action(Op.FORWARD, 1, 0)) is None  # last stage computes the loss
    assert plan.input_message(1, Action(Op.BACKWARD, 1, 0)) is None
    assert plan.input_message(1, Action(Op.BACKWARD, 0, 0)) == Message("grad", 0, 1, 1, 0, 0)
    assert plan.output_message(0, Action(Op.BACKWARD, 0, 0)) is None


def test_build_plan_rejects_bad_input_with_named_fields():
    with pytest.raises(ValueError, match="schedule='gpipe'"):
        build_plan("gpipe", 2, 4)
    with pytest.raises(ValueError, match="pp_size=0"):
        build_plan("1f1b", 0, 4)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        build_plan("1f1b", 2, 0)
    with pytest.raises(ValueError, match="num_model_chunks=2"):
        build_plan("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="pp_size=2"):
        build_plan("no_pipelining", 2, 4)
    with pytest.raises(ValueError, match=r"microbatch_group_size_per_vp_stage=9 .*\[4, 8\]"):
        build_plan("interleaved", 4, 8, 2, 9)
    with pytest.raises(RuntimeError, match="last group of 3 microbatches"):
        build_plan("interleaved", 4, 8, 2, 5)
    with pytest.raises(RuntimeError, match="num_microbatches=7"):
        build_plan("interleaved", 4, 7, 2)
    with pytest.raises(ValueError, match="pp_size=1"):
        build_plan("interleaved", 1, 4, 2)


def test_schedule_name_follows_megatron_choice():
    assert schedule_name(1, None) == "no_pipelining" and schedule_name(1, 2) == "no_pipelining"
    assert schedule_name(4, None) == "1f1b"
    assert schedule_name(4, 1) == "interleaved" and schedule_name(2, 4) == "interleaved"


def test_action_keys_cache_equals_generic_computation():
    """build_plan pre-fills Plan.action_keys; a copy without the cache recomputes the same keys."""
    plan = build_plan("interleaved", 3, 6, 2, 3)
    copy = dataclasses.replace(plan)
    assert "action_keys" not in copy.__dict__
    assert copy.action_keys == plan.action_keys
    stride = 2 * 6
    a = plan.actions[1][0]
    assert plan.action_keys[1][0] == {Op.FORWARD: 0, Op.BACKWARD: 1}[a.op] * stride + a.chunk * 6 + a.microbatch


def test_one_action_notation_round_trips():
    """``str(action)`` is the one notation (grids, JSON, spans, errors) and ``Action.parse`` reads it back."""
    for op in Op:
        for chunk, mb in ((0, 0), (1, 3), (12, 103)):
            a = Action(op, chunk, mb)
            assert Action.parse(str(a)) == a and a.label == str(a)
    assert str(Action(Op.FORWARD, 1, 3)) == "F3.1"
    for bad in ("F c1 mb3", "X3.1", "F3", "F-1.0", "", None):
        with pytest.raises(ValueError, match="is not an action"):
            Action.parse(bad)
    plan = build_plan("zbv", 2, 2, 2)
    assert [Action.parse(s) for s in plan.action_labels(0)] == list(plan.actions[0])
