"""torch.distributed.pipelining's compute-only CSV schedules: export, import, round trip, errors that name the
action and its cell, and the ``pipecast schedule --csv / --from-csv`` options; against torch itself: the CSVs its
schedule classes write (built on stage stubs, no process group: ``tests/helpers/torch_schedules.py``) import, validate,
simulate and run on 2 gloo ranks to the reference's and pipecast's losses, and torch's runtime loads and dry-runs
every plan pipecast exports.  (More imported plans run on gloo ranks at P = 2 and 4 in
``tests/runtime/test_zero_bubble_pipeline.py``, schedules ``csv:...`` and ``torch:...``.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.plan import build_plan
from engine.plan.torch_csv import CsvScheduleError, plan_from_csv, plan_to_csv
from engine.plan.simulate import simulate
from engine.plan.validate import PlanError
from tests.helpers.torch_schedules import TORCH_CLASSES, torch_load_csv, torch_schedule_csv

ROOT = Path(__file__).resolve().parents[2]
BUILT = [("no_pipelining", 1, 1), ("1f1b", 1, 2), ("1f1b", 1, 4), ("interleaved", 2, 2), ("interleaved", 2, 4),
         ("zb_h1", 1, 3), ("zbv", 2, 2), ("zbv", 2, 4), ("zb", 2, 3)]


@pytest.mark.parametrize("schedule,chunks,pp", BUILT)
def test_export_then_import_gives_the_same_plan(schedule, chunks, pp):
    for M in (pp, 2 * pp, 2 * pp + (schedule != "interleaved")):
        for forward_only in (False, True):
            plan = build_plan(schedule, pp, M, chunks, forward_only=forward_only)
            text = plan_to_csv(plan)
            back = plan_from_csv(text)
            assert back.actions == plan.actions and back.stage_map == plan.stage_map
            assert (back.pp_size, back.num_model_chunks, back.num_microbatches) == (pp, chunks, M)
            assert back.forward_only == forward_only
            assert forward_only or back.splits_backward == plan.splits_backward
            assert plan_to_csv(back) == text


@pytest.mark.parametrize("schedule,chunks,pp", [b for b in BUILT if b[2] > 1])
def test_torch_loads_and_dry_runs_every_exported_plan(schedule, chunks, pp):
    """torch's runtime reads pipecast's export: its validation, its lowering to sends and receives and its dry run
    accept it, and it infers pipecast's placement."""
    for M in (pp, 2 * pp + (schedule != "interleaved")):
        plan = build_plan(schedule, pp, M, chunks)
        mapping = torch_load_csv(plan_to_csv(plan), pp, M, chunks, "v" if schedule == "zbv" else "looped")
        assert mapping == {s: rank for s, (rank, _) in enumerate(plan.stage_map)}


def test_torch_refuses_the_csv_pipecast_calls_a_deadlock():
    text = "0F0,0B0,0F1,0B1\n1F0,1F1,1B1,1B0\n"
    with pytest.raises(PlanError, match="deadlock"):
        plan_from_csv(text)
    with pytest.raises(AssertionError, match="can't schedule sends/recvs"):
        torch_load_csv(text, 2, 2, 1)


def test_torch_notation_is_stage_based():
    """Cells are <stage><type><microbatch>; under the V placement rank 0 writes stages 0 and 2P-1."""
    rows = plan_to_csv(build_plan("zbv", 2, 2, 2)).splitlines()
    assert rows[0].split(",")[:3] == ["0F0", "0F1", "3F0"] and {c[0] for c in rows[0].split(",")} == {"0", "3"}
    assert {c[1] for c in rows[0].split(",")} == {"F", "I", "W"}
    assert "B" in plan_to_csv(build_plan("1f1b", 2, 2)) and "I" not in plan_to_csv(build_plan("1f1b", 2, 2))


def test_a_full_backward_in_a_split_schedule_becomes_b_then_w():
    text = "0F0,0F1,0I0,0W0,0B1\n1F0,1B0,1F1,1I1,1W1\n"
    plan = plan_from_csv(text)
    assert [str(a) for a in plan.actions[0]] == ["F0.0", "F1.0", "B0.0", "W0.0", "B1.0", "W1.0"]


@pytest.mark.parametrize("text,match", [
    ("0F0,0X1\n", r"column 1: '0X1' is not a compute action"),
    ("0F0,0SEND_F0\n", r"'0SEND_F0' is not a compute action"),
    ("0F0,1B0\n1F0,1B0\n", r"stage 1 appears on pipeline ranks 0 and 1"),
    ("0F0,0I0\n", r"0I0 has no 0W0"),
    ("0F0,0B0\n2F0,2B0\n", r"stages are \[0, 2\]"),
    ("\n\n", r"no action"),
])
def test_malformed_csv_is_refused_naming_the_cell(text, match):
    with pytest.raises(CsvScheduleError, match=match):
        plan_from_csv(text)


@pytest.mark.parametrize("text,match", [
    ("0F0,0B0,0F1,0B1\n1F0,1F1,1B1,1B0\n", r"rank 0, action 1 \(B0\.0\): deadlock"),
    ("0B0,0F0\n1F0,1B0\n", r"rank 0, action 0 \(B0\.0\): runs before F0\.0"),
    ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", r"never runs B1\.0"),
])
def test_invalid_schedules_name_the_first_bad_action(text, match):
    with pytest.raises(PlanError, match=match):
        plan_from_csv(text)


@pytest.mark.timeout(60)
def test_cli_writes_and_reads_csv(tmp_path):
    out = tmp_path / "zbv.csv"
    run = [sys.executable, "-m", "engine.cli", "schedule"]
    first = subprocess.run(run + ["--schedule", "zbv", "--pp", "2", "-m", "4", "--csv", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert out.read_text() == plan_to_csv(build_plan("zbv", 2, 4, 2))
    again = subprocess.run(run + ["--from-csv", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.split("\n")[2:4] == first.stdout.split("\n")[2:4]
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B1,1B0\n")
    refused = subprocess.run(run + ["--from-csv", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "deadlock" in refused.stderr and "B0.0" in refused.stderr


# ---- CSVs written by torch's own schedule classes (tests/helpers/torch_schedules.py: stage stubs, no process group) --------
# Per class: the microbatch counts tried at P ranks (M = P, odd M, 2P, 3P) and the pipecast schedule of the same
# family, if any.  torch refuses some sizes itself (DualPipeV: M >= 2P); those are checked to raise ValueError.
TORCH_GRID = [(name, pp) for name in TORCH_CLASSES for pp in (2, 4)]
TWIN = {"ScheduleGPipe": "1f1b", "ScheduleInterleaved1F1B": "interleaved", "ScheduleLoopedBFS": "interleaved",
        "ScheduleInterleavedZeroBubble": "zb", "ScheduleZBVZeroBubble": "zbv", "ScheduleDualPipeV": "zbv"}


def _torch_or_none(name, pp, M):
    try:
        return torch_schedule_csv(name, pp, M)
    except ValueError:
        assert name == "ScheduleDualPipeV" and M < 2 * pp, f"torch refused {name} at pp={pp}, M={M}"
        return None


def _torch_cells(text: str, split: bool) -> list[list[str]]:
    """Per row, torch's compute cells as pipecast runs them: idle cells and REDUCE_GRAD dropped, an overlapped cell
    as its sub-actions, a full B of a split schedule as I then W (an independent reading of the grid)."""
    rows = []
    for line in text.splitlines():
        cells = []
        for cell in filter(None, line.split(",")):
            subs = cell[1:cell.index(")")].split(";") if cell.endswith(")OVERLAP_F_B") else [cell]
            for s in subs:
                if "REDUCE_GRAD" in s:
                    continue
                cells += [s.replace("B", "I"), s.replace("B", "W")] if split and "B" in s else [s]
        rows.append(cells)
    return rows


@pytest.mark.parametrize("name,pp", [g for g in TORCH_GRID if g[0] != "Schedule1F1B"])
def test_torch_schedules_import_validate_and_simulate(name, pp):
    """Each class's CSV imports (validated), keeps torch's per-rank order and placement, and simulates."""
    per_rank, placement = TORCH_CLASSES[name]
    for M in (pp, pp + 1, 2 * pp, 3 * pp):
        text = _torch_or_none(name, pp, M)
        if text is None:
            continue
        plan = plan_from_csv(text)
        assert (plan.pp_size, plan.num_model_chunks, plan.num_microbatches) == (pp, per_rank, M)
        want = [(s % pp, s // pp) if placement == "looped" else (min(s, 2 * pp - 1 - s), s // pp)
                for s in range(pp * per_rank)]
        assert list(plan.stage_map) == want, (name, pp, M)
        exported = plan_to_csv(plan)
        assert _torch_cells(exported, plan.splits_backward) == _torch_cells(text, plan.splits_backward)
        assert exported.count("OVERLAP_F_B") == text.count("OVERLAP_F_B"), (name, pp, M)  # compounds kept
        assert plan.splits_backward == (name in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
                                                 "ScheduleDualPipeV"))
        sim = simulate(plan, 1.0, 1.0, 0.0, 1.0) if plan.splits_backward else simulate(plan)
        assert sim.makespan >= max(sim.busy) > 0


@pytest.mark.parametrize("name,pp", [g for g in TORCH_GRID if g[0] != "Schedule1F1B"])
def test_torch_schedules_against_pipecasts_twin(name, pp):
    """The same actions per rank and the same placement as pipecast's schedule of the family; the order differs
    where the schedules differ by design (asserted, so a change shows):
      - Interleaved1F1B: the very plan pipecast builds (Megatron's interleaved order) wherever pipecast takes M;
      - GPipe vs 1F1B, LoopedBFS vs interleaved: the same step time at F = 1, B = 2, more activations held;
      - ZBV vs zbv: at M >= 2P the same step time at F = B = W = 1; torch runs each W right after its I (rank 0
        holds one pending W), pipecast defers W passes into the bubbles;
      - InterleavedZeroBubble (ZB1P) vs zb: torch holds more activations than zb's default budget C*(P - r), so is
        faster; DualPipeV vs zbv: the same step time at M >= 2P with more activations held (its overlapped F;B)."""
    for M in (pp, pp + 1, 2 * pp, 3 * pp):
        text = _torch_or_none(name, pp, M)
        if text is None:
            continue
        ours = plan_from_csv(text)
        try:
            twin = build_plan(TWIN[name], pp, M, ours.num_model_chunks)
        except RuntimeError:  # interleaved at 0 < M mod P < P: Megatron's refusal
            continue
        assert ours.stage_map == twin.stage_map
        assert [sorted(map(str, a)) for a in ours.actions] == [sorted(map(str, a)) for a in twin.actions]
        costs = (1.0, 1.0, 0.0, 1.0) if ours.splits_backward else (1.0, 2.0)
        mine, theirs = simulate(ours, *costs), simulate(twin, *costs)
        if name == "ScheduleInterleaved1F1B":
            assert ours.actions == twin.actions, (pp, M)
        elif name in ("ScheduleGPipe", "ScheduleLoopedBFS") or (M >= 2 * pp and TORCH_CLASSES[name][1] == "v"):
            assert mine.makespan == theirs.makespan, (pp, M, mine.makespan, theirs.makespan)
            assert sum(mine.peak_in_flight) >= sum(theirs.peak_in_flight)
        if name == "ScheduleInterleavedZeroBubble":
            assert mine.makespan < theirs.makespan and sum(mine.peak_in_flight) > sum(theirs.peak_in_flight)


@pytest.mark.parametrize("pp", [2, 4])
def test_three_stages_per_rank(pp):
    """Looped classes with three stages a rank import; Interleaved1F1B's is pipecast's interleaved plan, C = 3."""
    for M in (pp, 2 * pp, 3 * pp):
        for name in ("ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble"):
            assert plan_from_csv(torch_schedule_csv(name, pp, M, 3)).num_model_chunks == 3
        plan = plan_from_csv(torch_schedule_csv("ScheduleInterleaved1F1B", pp, M, 3))
        assert plan.actions == build_plan("interleaved", pp, M, 3).actions, (pp, M)


@pytest.mark.parametrize("pp", [2, 4])
def test_torch_1f1b_pipeline_order_is_refused_naming_the_last_ranks_forward(pp):
    """torch 2.13's Schedule1F1B.pipeline_order (its visualizer / export view; its step() does not use it) forwards
    microbatches 1..M on the last rank, where the warm-up has no forward: the import names that cell."""
    M = 2 * pp
    text = torch_schedule_csv("Schedule1F1B", pp, M)
    last = text.splitlines()[pp - 1].split(",")
    assert f"{pp - 1}F0" not in last and f"{pp - 1}F{M}" in last
    col = last.index(f"{pp - 1}F{M}")
    with pytest.raises(CsvScheduleError, match=rf"row {pp - 1} \(pipeline rank {pp - 1}\), column {col}: "
                                               rf"{pp - 1}F{M} is microbatch {M}, but stage 0 forwards "
                                               rf"microbatches 0\.\.{M - 1}"):
        plan_from_csv(text)


def test_dualpipev_overlapped_cells_run_as_their_sub_actions_in_order():
    text = torch_schedule_csv("ScheduleDualPipeV", 2, 4)
    row0 = text.splitlines()[0].split(",")
    assert "(0F3;3B1)OVERLAP_F_B" in row0 and "0REDUCE_GRAD" not in row0
    plan = plan_from_csv(text)
    acts = [str(a) for a in plan.actions[0]]
    at = acts.index("F3.0")
    assert acts[at:at + 3] == ["F3.0", "B1.1", "W1.1"]     # 3B1 is a full backward: B then its W
    with pytest.raises(CsvScheduleError, match=r"column 7, in '\(0F3;3SEND_B1\)OVERLAP_F_B': '3SEND_B1' is not"):
        plan_from_csv(text.replace("(0F3;3B1)", "(0F3;3SEND_B1)"))


def test_reduce_grad_is_dropped_after_the_stages_last_backward_and_refused_before_it():
    plan = plan_from_csv("0F0,0B0,0REDUCE_GRAD\n1F0,1B0,1REDUCE_GRAD\n")
    assert [str(a) for a in plan.actions[0]] == ["F0.0", "B0.0"]
    with pytest.raises(CsvScheduleError, match=r"row 0 \(pipeline rank 0\), column 2: 0REDUCE_GRAD comes before 0B1 "
                                               r"\(column 3\)"):
        plan_from_csv("0F0,0F1,0REDUCE_GRAD,0B1,0B0\n1F0,1B0,1F1,1B1\n")


def test_torch_compute_comms_csv_is_refused_naming_its_first_cell():
    text = torch_schedule_csv("ScheduleZBVZeroBubble", 2, 2, comms=True)
    assert text.startswith("0UNSHARD,")
    with pytest.raises(CsvScheduleError, match=r"row 0 \(pipeline rank 0\), column 0: '0UNSHARD' is not a compute "
                                               r"action.*only the compute-only form is read"):
        plan_from_csv(text)


@pytest.mark.parametrize("edit,match", [
    # ZBV, P = 2, M = 4: rank 0 runs its chunk-1 forward of microbatch 1 (stage 3) before the forward feeding it
    (lambda rows: rows[0].insert(1, rows[0].pop(6)),
     r"rank 0, action 1 \(F1\.1\): deadlock: .*cycle rank 0 -> rank 1 -> rank 0 \[CSV row 0, column 1: '3F1'\]"),
    # rank 1 runs 2I0 before 2F0: the column counts rank 1's leading idle cell, the action index does not
    (lambda rows: rows[1].insert(2, rows[1].pop(5)),
     r"rank 1, action 1 \(B0\.1\): runs before F0\.1 .*\[CSV row 1, column 2: '2I0'\]"),
])
def test_a_bad_torch_csv_names_the_first_bad_action_and_its_cell(edit, match):
    rows = [line.split(",") for line in torch_schedule_csv("ScheduleZBVZeroBubble", 2, 4).splitlines()]
    edit(rows)
    with pytest.raises(PlanError, match=match):
        plan_from_csv("\n".join(",".join(r) for r in rows))


# torch-written CSVs on 2 gloo ranks through the executor (tests/helpers/pipeline_jobs.py, schedule "torch:<class>"), with
# pipecast's own plan of the family in the same job: losses and gradients against the single-process reference
RUNS = [("ScheduleZBVZeroBubble", dict(chunks=2, M=4, dealloc=True), "zbv"),
        ("ScheduleInterleaved1F1B", dict(chunks=2, M=4), "interleaved"),
        ("ScheduleDualPipeV", dict(chunks=2, M=4, batch=False), "zbv"),
        ("ScheduleInterleavedZeroBubble", dict(chunks=2, M=3), None),
        ("ScheduleLoopedBFS", dict(chunks=2, M=3, overlap=True, batch=False), None),
        ("ScheduleGPipe", dict(M=3), "1f1b")]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_torch_csvs_run_on_gloo_ranks_to_the_reference_and_pipecasts_losses():
    from tests.helpers.distributed import run_ranks
    from tests.helpers.pipeline_jobs import case, job, with_torch_csvs
    cases = []
    for name, kw, twin in RUNS:
        cases.append(case(schedule=f"torch:{name}", **kw))
        cases.append(case(schedule=twin, **kw) if twin else None)
    results = run_ranks(job, 2, with_torch_csvs([c for c in cases if c is not None], 2), timeout=100)
    per_case = iter(zip(*results))
    for (name, kw, twin) in RUNS:
        torch_run = next(per_case)
        twin_run = next(per_case) if twin else None
        loss_rank = 0 if TORCH_CLASSES[name][1] == "v" else 1
        for r in torch_run:
            assert r["error"] is None, f"{name}: rank {r['rank']} raised {r['error']}"
            assert r["grad_err"] <= 1e-5 and r["loss_err"] <= 1e-5, (name, r["rank"], r["grad_err"], r["loss_err"])
            call = r["calls"][0]
            assert call["order"] == call["plan_order"], f"{name}: rank {r['rank']} did not run the CSV's order"
            assert call["store_len"] == (kw["M"] if r["pp_rank"] == loss_rank else 0), (name, r["rank"])
        if twin_run is not None:
            mine = dict(zip(torch_run[loss_rank]["calls"][0]["store_mbs"], torch_run[loss_rank]["calls"][0]["losses"]))
            call = twin_run[loss_rank]["calls"][0]
            assert twin_run[loss_rank]["error"] is None
            assert mine == pytest.approx(dict(zip(call["store_mbs"], call["losses"])), rel=1e-6), name


def test_a_rank_waiting_on_itself_is_named_not_the_rank_stuck_behind_it():
    """Rank 1 swaps its first two forwards: 2F0 (stage 2) waits for 1F0 later on its own rank, and rank 0 waits
    for rank 1.  The error names rank 1's 2F0, where the cycle closes."""
    rows = [line.split(",") for line in plan_to_csv(build_plan("zbv", 2, 4, 2)).splitlines()]
    rows[1][0], rows[1][1] = rows[1][1], rows[1][0]
    with pytest.raises(PlanError, match=r"rank 1, action 0 \(F0\.1\): deadlock: .*cycle rank 1 -> rank 1 "
                                        r"\[CSV row 1, column 0: '2F0'\]"):
        plan_from_csv("\n".join(",".join(r) for r in rows))


def test_schedule_cli_refuses_sizes_that_disagree_with_the_csv(tmp_path, capsys):
    from engine.cli import main
    path = tmp_path / "zbv.csv"
    path.write_text(plan_to_csv(build_plan("zbv", 2, 4, 2)))
    with pytest.raises(SystemExit) as exit_:
        main(["schedule", "--from-csv", str(path), "--pp", "4"])
    assert exit_.value.code == 2
    assert "--pp 4 disagrees with --from-csv" in capsys.readouterr().err
    assert main(["schedule", "--from-csv", str(path), "--pp", "2", "-m", "4"]) == 0
    assert "pp=2 vp=2 microbatches=4" in capsys.readouterr().out
