"""torch.distributed.pipelining's compute-only CSV schedules: export, import, round trip, errors that name the
action, and the ``pipecast schedule --csv / --from-csv`` options.  (Imported plans run on gloo ranks to the
reference's losses and gradients in ``tests/test_zero_bubble_pipeline.py``, schedule ``csv:...``.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.plan import build_plan
from engine.plan.torch_csv import CsvScheduleError, plan_from_csv, plan_to_csv
from engine.plan.validate import PlanError

ROOT = Path(__file__).resolve().parents[1]
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
