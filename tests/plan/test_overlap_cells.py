"""Overlapped forward-backward cells in the pure layer: Megatron's combined-1F1B plans, cells as units in the
compiled programs (deadlock freedom, receives posted before a cell, sends reaped after it), and the simulator's
all-to-all costs with and without overlap."""
from __future__ import annotations

import itertools

import pytest

from engine.plan import build_plan
from engine.plan.cli import add_arguments, run
from engine.plan.graph import PlanError
from engine.plan.lowering import compile_rank
from engine.plan.resolve import resolve_schedule
from engine.plan.simulate import simulate
from engine.plan.table import get_schedule_table, pp_rank_microbatches
from engine.plan.types import Action, Op, Plan
from engine.plan.validate import validate_plan, validate_programs

OVERLAP = dict(overlap_moe_expert_parallel_comm=True)


def _label(mb, chunk, op):
    return str(Action(Op(op), chunk, mb))


@pytest.mark.parametrize("pp, m, chunks, group", [(2, 4, 2, None), (2, 6, 3, None), (4, 8, 2, None),
                                                  (4, 12, 2, 4), (3, 6, 2, None), (2, 2, 2, None)])
def test_interleaved_combined_1f1b_is_megatrons_warmup_plus_one_with_steady_pairs_as_cells(pp, m, chunks, group):
    plan = build_plan("interleaved", pp, m, chunks, group, **OVERLAP)
    g = group or pp
    table = get_schedule_table(m, chunks, g)
    total = m * chunks
    for r in range(pp):
        w = pp_rank_microbatches(m, chunks, g, pp, r, chunks, False, True).num_warmup_microbatches
        assert plan.warmup[r] == w == min(total, 2 * (pp - r - 1) + (chunks - 1) * g + 1)
        cells = plan.cell_labels(r)
        steady = [f"{_label(table[w + i][0], table[w + i][1], 'F')}+{_label(table[i][0], chunks - 1 - table[i][1], 'B')}"
                  for i in range(total - w)]
        assert cells[w:w + len(steady)] == steady
        assert plan.overlap_cells(r) == plan.compound_spans(r)  # every steady pair runs overlapped
    validate_plan(plan)
    plain = build_plan("interleaved", pp, m, chunks, group)
    assert plain.compounds is None and plain.warmup != plan.warmup or m * chunks <= plain.warmup[0]


def test_no_pipelining_combined_1f1b():
    plan = build_plan("no_pipelining", 1, 4, 1, **OVERLAP)
    assert plan.cell_labels(0) == ["F0.0", "F1.0+B0.0", "F2.0+B1.0", "F3.0+B2.0", "B3.0"]
    assert build_plan("no_pipelining", 1, 1, 1, **OVERLAP).cell_labels(0) == ["F0.0", "B0.0"]
    assert build_plan("no_pipelining", 1, 3, 1, forward_only=True, **OVERLAP).compounds is None


def test_overlap_is_refused_where_megatron_refuses_it():
    with pytest.raises(ValueError, match="non-interleaved 1F1B.*interleaved"):
        build_plan("1f1b", 2, 4, **OVERLAP)
    for schedule, chunks in (("zbv", 2), ("zb_h1", 1)):
        with pytest.raises(ValueError, match="overlap_moe_expert_parallel_comm"):
            build_plan(schedule, 2, 4, chunks, **OVERLAP)
        with pytest.raises(ValueError, match="does not apply"):
            resolve_schedule(schedule, 2, chunks, overlap_moe_expert_parallel_comm=True)
    resolved = resolve_schedule("interleaved", 2, 2, overlap_moe_expert_parallel_comm=True)
    assert resolved.plan(4).compounds is not None and resolved.plan(4, forward_only=True).compounds is None


def _overlap_plans():
    for pp, m in itertools.product((2, 3, 4, 6), (4, 6, 8, 9, 12)):
        for schedule, chunks, opts in (("dualpipev", 2, {}), ("interleaved", 2, OVERLAP), ("interleaved", 3, OVERLAP)):
            try:
                yield build_plan(schedule, pp, m, chunks, **opts)
            except (ValueError, RuntimeError):
                continue
    for m in (1, 2, 5):
        yield build_plan("no_pipelining", 1, m, 1, **OVERLAP)


@pytest.mark.parametrize("prefetch, batched", [(1, True), (3, False), (3, True)])
def test_cells_as_units_are_deadlock_free_and_post_before_reap_after(prefetch, batched):
    for plan in _overlap_plans():
        programs = validate_programs(plan, prefetch, batched, overlap=True)
        for program in programs:
            posted_at = {r: -1 for r in program.initial_posts}
            for e, st in enumerate(program.steps):
                posted_at.update({r: e for r in st.posts})
            reaped_at = {sid: i for i, st in enumerate(program.steps) for sid in st.reap}
            assert program.cells == plan.overlap_cells(program.rank)
            for start, stop in program.cells:
                for i in range(start, stop):
                    st = program.steps[i]
                    if st.recv >= 0:
                        assert posted_at[st.recv] < start, (plan.schedule, program.rank, st.label)
                    if st.send_id >= 0 and st.send_id in reaped_at:
                        assert reaped_at[st.send_id] >= stop, (plan.schedule, program.rank, st.label)


def _cell_deadlock_plan() -> Plan:
    """Rank 1 runs both forwards before its backwards; rank 0 overlaps F1 with B0, whose gradient rank 1 sends only
    after its F1, which needs rank 0's F1: fine part after part, a deadlock as one unit."""
    f = [Action(Op.FORWARD, 0, m) for m in range(2)]
    b = [Action(Op.BACKWARD, 0, m) for m in range(2)]
    acts = ((f[0], f[1], b[0], b[1]), (f[0], f[1], b[0], b[1]))
    return Plan("custom", 2, 1, 2, 2, False, (2, 2), acts, compounds=(((1, 3),), ()))


def test_a_cell_whose_input_needs_its_own_output_is_caught():
    plan = _cell_deadlock_plan()
    assert plan.overlap_cells(0) == ((1, 3),)
    validate_programs(plan, 1, True)  # part after part: fine
    with pytest.raises(PlanError, match="deadlock"):
        validate_programs(plan, 1, True, overlap=True)
    with pytest.raises(PlanError, match="deadlock"):
        simulate(plan, 1.0, 2.0, a2a_time=0.5, overlap=True)


def test_only_forward_backward_cells_overlap():
    f0, f1 = Action(Op.FORWARD, 0, 0), Action(Op.FORWARD, 0, 1)
    b0, w0, b1 = Action(Op.BACKWARD, 0, 0), Action(Op.WEIGHT, 0, 0), Action(Op.BACKWARD, 0, 1)
    acts = ((f0, f1, b0, w0, b1, Action(Op.WEIGHT, 0, 1)),)
    spans = {((0, 2),): (), ((1, 4),): ((1, 4),), ((1, 3),): ((1, 3),), ((3, 5),): ()}
    for given, want in spans.items():
        plan = Plan("custom", 1, 1, 2, 2, False, (2,), acts, compounds=(given,))
        assert plan.overlap_cells(0) == want, given
    dual = build_plan("dualpipev", 4, 10, 2)
    assert all(dual.overlap_cells(r) == dual.compound_spans(r) and dual.compound_spans(r) for r in range(4))
    program = compile_rank(build_plan("dualpipev", 2, 4, 2), 0, overlap=False)
    assert program.cells == ()


@pytest.mark.parametrize("f, b, a", [(1.0, 2.0, 0.5), (1.0, 2.0, 1.5), (1.0, 1.0, 3.0), (2.0, 1.0, 0.0)])
def test_simulated_cell_hides_each_sides_all_to_all_behind_the_others_compute(f, b, a):
    plan = build_plan("no_pipelining", 1, 3, 1, **OVERLAP)  # F0, F1+B0, F2+B1, B2
    cell = f + b + max(0.0, a - b) + max(0.0, a - f)
    assert simulate(plan, f, b, a2a_time=a, overlap=True).makespan == pytest.approx((f + a) + 2 * cell + (b + a))
    assert simulate(plan, f, b, a2a_time=a).makespan == pytest.approx(3 * (f + a) + 3 * (b + a))
    assert simulate(plan, f, b).makespan == pytest.approx(3 * (f + b))


def test_dualpipev_ranks_above_zbv_for_an_moe_model_only_with_overlap():
    """GPU-like costs (per chunk: F 1, B 1, W 1, all-to-all 0.8 each way): the cells hide the all-to-all."""
    costs = dict(forward_time=1.0, backward_time=1.0, weight_time=1.0, a2a_time=0.8)
    dual, zbv = build_plan("dualpipev", 4, 16, 2), build_plan("zbv", 4, 16, 2)
    on = simulate(dual, **costs, overlap=True).makespan
    assert on < simulate(zbv, **costs, overlap=True).makespan < simulate(dual, **costs).makespan + 1e-9
    assert simulate(zbv, **costs, overlap=True).makespan == simulate(zbv, **costs).makespan  # no cells to overlap


def test_schedule_cli_takes_all_to_all_costs(capsys):
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spans = []
    for extra in ([], ["--overlap-moe"]):
        assert run(parser.parse_args(["--pp", "2", "--vp", "2", "-m", "4", "--schedule", "interleaved",
                                      "--a2a-time", "0.5"] + extra)) == 0
        out = capsys.readouterr().out
        spans.append(float(out.rsplit("makespan ", 1)[1].split(",")[0]))
        assert "all-to-all 0.5" in out
    assert "F" in out and "+B" in out  # the grid shows the combined-1F1B cells
    assert spans[1] < spans[0]


def test_schedule_cli_refuses_overlap_without_cells(capsys):
    """``--overlap-moe`` on a plan with no forward-backward cells (ZB-V) is refused, as a run's config refuses it,
    instead of printing '(cells overlapped)' beside an unchanged makespan."""
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        run(parser.parse_args(["--pp", "2", "-m", "4", "--schedule", "zbv", "--a2a-time", "1", "--overlap-moe"]))
    assert "has no forward-backward cells to overlap" in capsys.readouterr().err
