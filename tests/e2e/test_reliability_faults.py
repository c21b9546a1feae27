"""Reliability of whole training jobs under the launcher (``engine.training.launch.run_spawned``, what ``pipecast
train`` runs), each job a separate launcher process with a timeout:

* SIGKILL one rank of 4 (pipeline 2 x data 2) mid-training: the launcher exits 1 within 60 s of the kill with an
  ``error:`` line naming the killed rank; every rank process is gone.
* Exact resume past a corrupt checkpoint: checkpoints at steps 5 and 10, SIGKILL in step 13, then bytes flipped
  inside one ``.distcp`` file of step 10 (its size unchanged).  ``--resume`` names step 10 and the file in one
  warning and falls back to step 5 on every rank: 20 steps straight == 5 steps (+ checkpoint) + ``--resume`` + the
  rest, bitwise on CPU (every step loss and every rank's weights); the straight reference is trained from scratch
  by the resuming job after it finishes.  The first 12 steps of the killed job equal the reference too: two runs
  (separate processes) with the same seed and config give bitwise-identical losses.  The manifest of a 4-rank
  save lists every file of the folder.
* A rank raises in its forward step: the launcher exits 1 naming that rank and the exception; no process is left.
* A rank is stuck (alive, never sends): the peer fails after ``parallel.timeout_s`` naming it (and saying that it
  may be slow rather than dead: raise ``parallel.timeout_s``); the job ends.
* The launcher itself is SIGKILLed: its ranks (blocked inside gloo) die with it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.distributed import process_alive
from tests.helpers.reliability_jobs import read_records, tiny_overrides, write_corpus

ROOT = Path(__file__).resolve().parents[2]


def _launch(spec: dict, timeout: float = 90) -> tuple[int, str, float]:
    """Run one launcher process; returns (exit status, stderr, seconds)."""
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.reliability_jobs", json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr, time.time() - t0


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert lines, f"no error line in:\n{stderr[-3000:]}"
    return lines[0]


@pytest.mark.timeout(480)
def test_sigkill_one_of_four_ranks_then_exact_resume(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    layout = {"parallel.pipeline": 2, "parallel.data": 2, "checkpoint.interval": 5, "checkpoint.keep": 3}
    overrides = tiny_overrides(corpus, tmp_path / "run", **layout)
    killed_dir, resumed_dir = tmp_path / "killed", tmp_path / "resumed"
    killed_dir.mkdir()
    resumed_dir.mkdir()

    # run 1: SIGKILL rank 2 at the start of step 13 (after the checkpoint of step 10)
    rc, err, _ = _launch({"overrides": overrides, "record_dir": str(killed_dir), "fault": ["sigkill", 2, 13]})
    killed = read_records(killed_dir)
    assert rc == 1, err[-3000:]
    line = _error_line(err)
    assert "rank 2" in line and "SIGKILL" in line, line
    assert not any(process_alive(r["pid"]) for r in killed.values()), "a rank process was left behind"
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000005", "step_00000010"], ckpts

    # bytes flipped inside the largest payload file of step 10, which every rank's manifest entry covers
    corrupt = tmp_path / "run" / "checkpoints" / "step_00000010"
    listed = json.loads((corrupt / "manifest.json").read_text())["files"]
    assert set(listed) == {f.name for f in corrupt.iterdir()} - {"manifest.json"}
    payload = max(corrupt.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(payload.read_bytes())
    data[len(data) // 2:len(data) // 2 + 8] = bytes(255 - x for x in data[len(data) // 2:len(data) // 2 + 8])
    payload.write_bytes(bytes(data))

    # run 2: --resume to the end, then 20 steps straight from scratch in the same processes (the reference)
    rc, err, _ = _launch({"overrides": overrides, "record_dir": str(resumed_dir), "resume": True,
                          "then_straight": True})
    assert rc == 0, err[-3000:]
    warned = [ln for ln in err.splitlines() if "is broken" in ln]
    assert len(warned) == 1 and warned[0].endswith(
        f"checkpoint {corrupt} is broken: {payload.name} fails its sha256 checksum (its bytes changed after the "
        f"save); skipped it, resuming from {corrupt.with_name('step_00000005')}"), err[-3000:]
    resumed = read_records(resumed_dir)
    assert sorted(resumed) == [0, 1, 2, 3]
    for rank, rec in resumed.items():
        straight = rec["straight"]
        assert list(straight["losses"]) == [str(s) for s in range(1, 21)]
        # determinism: two runs (separate processes) with the same seed and config, bitwise equal until the kill
        assert list(killed[rank]["losses"]) == [str(s) for s in range(1, 13)]
        assert all(killed[rank]["losses"][s] == straight["losses"][s] for s in killed[rank]["losses"]), \
            f"rank {rank}: two runs of the same config differ"
        # exact resume: 5 steps + resume past the corrupt step 10 + 15 steps == 20 steps straight (bitwise)
        assert rec["resumed_at"] == 5
        assert list(rec["losses"]) == [str(s) for s in range(6, 21)]
        assert [rec["losses"][s] for s in rec["losses"]] == [straight["losses"][s] for s in rec["losses"]], \
            f"rank {rank}: resumed losses differ from the straight run"
        assert rec["digest"] == straight["digest"], f"rank {rank}: resumed weights differ bitwise"
    # data-parallel replicas of a pipeline stage hold bitwise-equal weights; the two stages differ
    by_stage = {}
    for rec in resumed.values():
        by_stage.setdefault(rec["pp_rank"], set()).add(rec["digest"])
    assert sorted(by_stage) == [0, 1] and all(len(d) == 1 for d in by_stage.values())
    assert by_stage[0] != by_stage[1]


@pytest.mark.timeout(120)
def test_raise_in_one_ranks_forward(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    overrides = tiny_overrides(corpus, tmp_path / "run", **{"parallel.pipeline": 2, "training.steps": 5})
    rc, err, _ = _launch({"overrides": overrides, "record_dir": str(tmp_path), "fault": ["raise", 1, 3]})
    records = read_records(tmp_path)
    assert rc == 1, err[-3000:]
    line = _error_line(err)
    assert "rank 1 failed" in line and "injected fault: rank 1 raises in its forward step" in line, line
    assert not any(process_alive(r["pid"]) for r in records.values()), "a rank process was left behind"
    assert all(list(r["losses"]) == ["1", "2"] for r in records.values())


@pytest.mark.timeout(60)
def test_ranks_die_with_the_launcher(tmp_path):
    """SIGKILL the launcher itself (what a CI cancel or an OOM killer does): its ranks must not live on."""
    import signal
    overrides = tiny_overrides(write_corpus(tmp_path / "corpus.txt"), tmp_path / "run", **{"parallel.pipeline": 2})
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.reliability_jobs",
                             json.dumps({"overrides": overrides, "record_dir": str(tmp_path), "sleep": True})],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while len(read_records(tmp_path)) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        pids = [r["pid"] for r in read_records(tmp_path).values()]
        assert len(pids) == 2, "the ranks did not start"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.time() + 60
        while any(process_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(process_alive(p) for p in pids), "ranks outlived their launcher"
    finally:
        proc.kill()


@pytest.mark.timeout(120)
def test_stuck_rank_ends_the_job_after_the_communication_timeout(tmp_path):
    """A rank that is alive but stuck (never sends): its peer's receive fails after ``parallel.timeout_s``, naming
    the stuck rank, and the launcher stops everything."""
    timeout_s = 3
    overrides = tiny_overrides(write_corpus(tmp_path / "corpus.txt"), tmp_path / "run",
                               **{"parallel.pipeline": 2, "training.steps": 5, "parallel.timeout_s": timeout_s})
    rc, err, _ = _launch({"overrides": overrides, "record_dir": str(tmp_path), "fault": ["hang", 1, 2]})
    ended = time.time()
    records = read_records(tmp_path)
    assert rc == 1, err[-3000:]
    line = _error_line(err)
    assert "rank 0 failed" in line and "from pipeline rank 1 (global rank 1) failed" in line, line
    # a timeout may also be a slow but healthy stage: the line says so and names the setting to raise
    assert "may be slow rather than dead" in line and "parallel.timeout_s" in line, line
    waited = ended - records[1]["fault_at"]
    assert waited >= timeout_s, f"job ended {waited:.1f}s after the rank got stuck, before parallel.timeout_s"
    assert not any(process_alive(r["pid"]) for r in records.values()), "a rank process was left behind"
