"""The plan validator: accepts every built plan, rejects broken ones naming the first violating action."""
from __future__ import annotations

import dataclasses

import pytest

from engine.plan import Action, Message, Op, Plan, build_plan
from engine.plan.simulate import simulate
from engine.plan.validate import PlanError, deadlock_free_segments, max_buffered_messages, plan_graph, validate_plan

F, B, W = Op.FORWARD, Op.BACKWARD, Op.WEIGHT


def _with_actions(plan: Plan, per_rank: dict[int, list[Action]], **changes) -> Plan:
    """A copy of ``plan`` with some ranks' action lists replaced (no cached keys or graph carried over)."""
    actions = list(plan.actions)
    for rank, acts in per_rank.items():
        actions[rank] = tuple(acts)
    return dataclasses.replace(plan, actions=tuple(actions), **changes)


def _acts(text: str) -> list[Action]:
    """``"F0.0 B0.0"`` -> actions (trace notation ``<op><microbatch>.<chunk>``)."""
    out = []
    for token in text.split():
        mb, chunk = token[1:].split(".")
        out.append(Action(Op(token[0]), int(chunk), int(mb)))
    return out


def test_built_plans_validate_and_return_their_graph():
    plan = build_plan("interleaved", 4, 8, 2)
    graph = validate_plan(plan)
    assert graph is plan_graph(plan)  # cached
    assert graph.num_actions == plan.total_actions == 4 * 2 * 16
    segments = deadlock_free_segments(plan)
    covered = sorted(i for _, lo, hi in segments for i in range(lo, hi))
    assert covered == list(range(graph.num_actions))  # every action once


def test_execution_order_respects_messages():
    plan = build_plan("interleaved", 3, 6, 2, 3)
    graph = validate_plan(plan)
    position = {}
    for step, (rank, lo, hi) in enumerate(deadlock_free_segments(plan)):
        for i in range(lo, hi):
            position[i] = (step, i)
    for i in range(graph.num_actions):
        producer = graph.deps[i]
        if producer < graph.num_actions:
            assert position[producer] < position[i]
            rank, index, action = graph.locate(plan, i)
            src, src_index, sent_by = graph.locate(plan, producer)
            assert plan.output_message(src, sent_by) == plan.input_message(rank, action)


def test_backward_before_forward_is_rejected():
    plan = build_plan("1f1b", 2, 2)
    assert plan.action_labels(1) == ["F0.0", "B0.0", "F1.0", "B1.0"]
    bad = _with_actions(plan, {1: _acts("B0.0 F0.0 F1.0 B1.0")})
    with pytest.raises(PlanError, match=r"rank 1, action 0 \(B0.0\): runs before F0.0") as info:
        validate_plan(bad)
    assert (info.value.rank, info.value.index, info.value.action) == (1, 0, Action(B, 0, 0))
    assert isinstance(info.value, ValueError)


def test_weight_pass_before_its_backward_is_rejected():
    plan = build_plan("1f1b", 2, 1)
    good = _with_actions(plan, {0: _acts("F0.0 B0.0 W0.0"), 1: _acts("F0.0 B0.0 W0.0")})
    validate_plan(good)
    bad = _with_actions(plan, {0: _acts("F0.0 W0.0 B0.0"), 1: _acts("F0.0 B0.0 W0.0")})
    with pytest.raises(PlanError, match=r"rank 0, action 1 \(W0.0\): runs before B0.0"):
        validate_plan(bad)


def test_deadlock_is_rejected_naming_the_cycle():
    plan = build_plan("1f1b", 2, 2)
    # rank 0 waits for B0's gradient before sending F1; rank 1 wants F1 before it runs B0
    bad = _with_actions(plan, {0: _acts("F0.0 B0.0 F1.0 B1.0"), 1: _acts("F1.0 B1.0 F0.0 B0.0")})
    plan_graph(bad)  # structure and data flow are fine ...
    with pytest.raises(PlanError, match=r"rank 0, action 1 \(B0.0\): deadlock") as info:
        validate_plan(bad)  # ... but it cannot run
    assert "cycle rank 0 -> rank 1 -> rank 0" in str(info.value)
    assert "grad[r1c0m0->r0c0]" in str(info.value)
    with pytest.raises(PlanError, match="deadlock"):
        simulate(bad)


def test_self_deadlock_on_one_rank():
    """P=1 with two chunks: chunk 1 consumes chunk 0's activation on the same rank; consuming first deadlocks."""
    plan = Plan("interleaved", 1, 2, 1, 1, False, (0,), (tuple(_acts("F0.1 F0.0 B0.1 B0.0")),))
    with pytest.raises(PlanError, match=r"rank 0, action 0 \(F0.1\): deadlock.*cycle rank 0 -> rank 0"):
        validate_plan(plan)
    fine = Plan("interleaved", 1, 2, 1, 1, False, (0,), (tuple(_acts("F0.0 F0.1 B0.1 B0.0")),))
    validate_plan(fine)


class _MisroutedPlan(Plan):
    """Claims that rank 0's chunk-1 forwards receive from rank 1's chunk 1 (the loss stage) instead of chunk 0."""

    def input_message(self, rank, action):
        msg = super().input_message(rank, action)
        if msg is not None and rank == 0 and action.op is Op.FORWARD and action.chunk == 1:
            return dataclasses.replace(msg, src_chunk=1)
        return msg


def test_receive_from_the_wrong_producer_is_rejected():
    built = build_plan("interleaved", 2, 2, 2)
    plan = _MisroutedPlan(*(getattr(built, f.name) for f in dataclasses.fields(Plan)))
    with pytest.raises(PlanError, match=r"rank 0, action \d+ \(F0.1\): .*receives act\[r1c1m0->r0c1\].*wrong "
                                        r"producer") as info:
        validate_plan(plan)
    assert info.value.action == Action(F, 1, 0)


class _DroppedGradientPlan(Plan):
    """Rank 0's chunk-0 backward claims to need nothing, so rank 1's gradient has no receiver."""

    def input_message(self, rank, action):
        if rank == 0 and action.op is Op.BACKWARD:
            return None
        return super().input_message(rank, action)


def test_message_without_receiver_is_rejected():
    built = build_plan("1f1b", 2, 2)
    plan = _DroppedGradientPlan(*(getattr(built, f.name) for f in dataclasses.fields(Plan)))
    with pytest.raises(PlanError, match=r"rank 1, action 1 \(B0.0\): sends grad\[r1c0m0->r0c0\] but no action"):
        validate_plan(plan)


def test_missing_and_duplicate_actions_are_rejected():
    plan = build_plan("1f1b", 2, 2)
    with pytest.raises(PlanError, match=r"rank 1, action F1.0: never runs F1.0"):
        validate_plan(_with_actions(plan, {1: _acts("F0.0 B0.0 B1.0")}))
    with pytest.raises(PlanError, match=r"rank 1, action 2 \(F0.0\): runs F0.0 again \(also at index 0\)"):
        validate_plan(_with_actions(plan, {1: _acts("F0.0 B0.0 F0.0 F1.0 B1.0")}))
    with pytest.raises(PlanError, match=r"rank 0, action 1 \(F0.2\): is not an action of this plan"):
        validate_plan(_with_actions(plan, {0: _acts("F0.0 F0.2 F1.0 B0.0 B1.0")}))
    with pytest.raises(PlanError, match=r"rank 1, action 0 \('F0.0'\): is not an action of this plan"):
        validate_plan(_with_actions(plan, {1: ["F0.0", *plan.actions[1][1:]]}))
    with pytest.raises(PlanError, match=r"plan: has action lists for 1 ranks but pp_size=2"):
        validate_plan(dataclasses.replace(plan, actions=plan.actions[:1]))


def test_forward_only_plan_must_not_run_backwards():
    plan = build_plan("1f1b", 2, 2, forward_only=True)
    validate_plan(plan)
    with pytest.raises(PlanError, match=r"rank 0, action 2 \(B0.0\): a forward-only plan runs no backward"):
        validate_plan(_with_actions(plan, {0: _acts("F0.0 F1.0 B0.0")}))


def test_message_naming_unknown_rank_is_rejected():
    class Escaping(Plan):
        def output_message(self, rank, action):
            msg = super().output_message(rank, action)
            return dataclasses.replace(msg, dst=5) if msg is not None and msg.kind == "act" else msg

    built = build_plan("1f1b", 2, 1)
    plan = Escaping(*(getattr(built, f.name) for f in dataclasses.fields(Plan)))
    with pytest.raises(PlanError, match=r"rank 0, action 0 \(F0.0\): its output message act\[r0c0m0->r5c0\] does "
                                        r"not fit the plan"):
        validate_plan(plan)


def test_max_buffered_messages_counts_early_arrivals():
    """Rank 0 (forward cost 1) runs ahead of rank 1 (cost 3): activations arrive at 1, 2, 3, 4 and are consumed
    at 1, 4, 7, 10, so up to two wait in rank 1's buffers (during [3, 7)); rank 0 receives nothing."""
    plan = build_plan("1f1b", 2, 4, forward_only=True)
    cost = {(0, 0): 1.0, (1, 0): 3.0}
    sim = simulate(plan, forward_time=cost)
    assert sim.start[1] == [1.0, 4.0, 7.0, 10.0]
    assert max_buffered_messages(plan, sim) == (0, 2)
    assert max_buffered_messages(plan, forward_time=cost) == (0, 2)
    # equal speeds: every activation is consumed the moment it arrives
    assert max_buffered_messages(plan, forward_time=1.0) == (0, 0)


def test_max_buffered_messages_with_transfer_time():
    plan = build_plan("1f1b", 2, 4, forward_only=True)
    sim = simulate(plan, forward_time={(0, 0): 1.0, (1, 0): 3.0}, transfer_time=0.5)
    assert sim.start[1] == [1.5, 4.5, 7.5, 10.5]
    assert max_buffered_messages(plan, sim) == (0, 2)


def test_message_dataclass_round_trip():
    """The validator compares messages by value; Message is a value type."""
    assert Message("act", 0, 0, 1, 0, 3) == Message("act", 0, 0, 1, 0, 3)
    assert str(Message("grad", 1, 0, 0, 0, 2)) == "grad[r1c0m2->r0c0]"


def _reference_runs(plan) -> bool:
    """Naive deadlock check straight from the plan's messages: sweep ranks until nobody can move."""
    produced = set()
    at = [0] * plan.pp_size
    moved = True
    while moved:
        moved = False
        for rank, acts in enumerate(plan.actions):
            while at[rank] < len(acts):
                msg = plan.input_message(rank, acts[at[rank]])
                if msg is not None and msg not in produced:
                    break
                out = plan.output_message(rank, acts[at[rank]])
                if out is not None:
                    produced.add(out)
                at[rank] += 1
                moved = True
    return all(at[r] == len(acts) for r, acts in enumerate(plan.actions))


def test_deadlock_check_matches_reference_on_perturbed_plans():
    """Random reorderings that keep each F before its B: the validator accepts exactly the runnable ones."""
    import random
    rng = random.Random(11)
    verdicts = set()
    for schedule, pp, microbatches, chunks in [("1f1b", 3, 4, 1), ("interleaved", 2, 4, 2), ("interleaved", 3, 3, 2)]:
        plan = build_plan(schedule, pp, microbatches, chunks)
        for _ in range(60):
            rank = rng.randrange(pp)
            acts = list(plan.actions[rank])
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(len(acts) - 1)
                a, b = acts[i], acts[i + 1]
                if not (a.op is F and b.op is B and (a.chunk, a.microbatch) == (b.chunk, b.microbatch)):
                    acts[i], acts[i + 1] = b, a
            candidate = _with_actions(plan, {rank: acts})
            expected = _reference_runs(candidate)
            try:
                validate_plan(candidate)
                accepted = True
            except PlanError as exc:
                assert "deadlock" in str(exc), exc
                accepted = False
            assert accepted == expected, (rank, [str(a) for a in acts])
            verdicts.add(accepted)
    assert verdicts == {True, False}  # both outcomes were exercised


def test_caches_stay_out_of_pickles_and_simulation_must_match_plan():
    import pickle
    plan = build_plan("interleaved", 2, 4, 2)
    validate_plan(plan)
    assert {"_plan_graph", "_deadlock_free_segments", "action_keys"} <= set(plan.__dict__)
    copy = pickle.loads(pickle.dumps(plan))
    assert copy == plan and not {"_plan_graph", "_deadlock_free_segments", "action_keys"} & set(copy.__dict__)
    validate_plan(copy)
    with pytest.raises(ValueError, match="simulation is of another plan"):
        max_buffered_messages(copy, simulate(plan))


def test_microbatch_dependent_routing_is_rejected():
    """The validator derives messages per (rank, op, chunk); a plan routing by microbatch is refused, not misjudged."""
    class ByMicrobatch(Plan):
        def input_message(self, rank, action):
            msg = super().input_message(rank, action)
            return None if msg is not None and action.microbatch == self.num_microbatches - 1 else msg

    built = build_plan("1f1b", 2, 3)
    plan = ByMicrobatch(*(getattr(built, f.name) for f in dataclasses.fields(Plan)))
    with pytest.raises(PlanError, match=r"rank 0, action \d+ \(B2.0\): its input message None is not microbatch 2's"):
        validate_plan(plan)
