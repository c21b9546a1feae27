"""``pipecast train`` (the launcher) as a user meets it: bad output paths and missing packages refused before any rank
starts, the run-folder lock, SIGTERM (preemption) with a checkpoint and an exact resume, SIGTERM during that save,
a stopped rank, a full disk.  Launcher processes are ``python -m engine.cli train`` or ``python -m
tests.helpers.reliability_jobs`` (the same launcher around a patched rank function), each with a timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.training import launch
from engine.training.outputs import run_lock
from tests.helpers.distributed import process_alive
from tests.helpers.reliability_jobs import read_records, tiny_overrides, write_corpus

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")} | {
    "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _flags(overrides: dict) -> list[str]:
    return [f"--{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in overrides.items()]


def _train(*args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", "train", *args], cwd=ROOT, env=ENV, timeout=timeout,
                          capture_output=True, text=True)


def _job(spec: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.reliability_jobs", json.dumps(spec)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def _wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline or (proc is not None and proc.poll() is not None):
            raise AssertionError("the awaited state was not reached" +
                                 ("" if proc is None or proc.poll() is None else f":\n{proc.communicate()[1]}"))
        time.sleep(0.1)


# ---- refused before any rank starts -----------------------------------------------------------------------------
def _bad_paths(tmp: Path) -> dict:
    a_file = tmp / "a_file"
    a_file.write_text("x")
    return {  # case -> (override flags, extra CLI args, text the error line must hold)
        "checkpoint-dir-is-a-file": ([f"--checkpoint.dir={a_file}"], [], "checkpoint.dir="),
        "run-dir-under-a-file": ([f"--logging.run_dir={a_file}/run"], [], "logging.run_dir="),
        "run-dir-in-proc": (["--logging.run_dir=/proc/pipecast-run"], [], "logging.run_dir='/proc/pipecast-run'"),
        "name-over-255-bytes": ([f"--logging.run_dir={tmp / ('n' * 300)}"], [], "over the file system's limit"),
        "timeline-is-a-file": ([], [f"--timeline={a_file}"], "--timeline="),
        "config-is-a-folder": (None, [str(tmp)], "is a folder, not a file"),
        "config-is-binary": (None, [str(tmp / "bin.yaml")], "bin.yaml' is not UTF-8 text"),
        "absurd-steps": (["--training.steps=100000000000000000000000"], [], "is over the upper bound"),
    }


def _run_inline(argv: list[str], monkeypatch) -> int:
    """``launch.run`` in this process; spawning ranks fails the test (the refusal must come before any rank)."""
    monkeypatch.setattr(launch, "run_spawned", lambda *a, **k: pytest.fail("ranks spawned despite a bad path"))
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    args.extra = extra
    return launch.run(args)


@pytest.mark.parametrize("name", list(_bad_paths(Path("/tmp"))))
def test_bad_output_path_refused_before_any_rank(tmp_path, monkeypatch, capsys, name):
    (tmp_path / "bin.yaml").write_bytes(b"\x00\x9f\xff binary")
    flags, extra, expect = _bad_paths(tmp_path)[name]
    argv = ([str(ROOT / "configs" / "default.yaml"), f"--logging.run_dir={tmp_path / 'run'}", *flags]
            if flags is not None else [])
    rc = _run_inline([*argv, *extra] if flags is not None else extra, monkeypatch)
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert expect in lines[0], lines[0]


def test_missing_plotting_package_refused_before_any_rank(tmp_path, monkeypatch, capsys):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    rc = _run_inline([str(ROOT / "configs" / "default.yaml"), f"--logging.run_dir={tmp_path}",
                         f"--timeline={tmp_path / 'tl'}"], monkeypatch)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: --timeline") and "'matplotlib' is not installed" in err, err
    assert "pip install matplotlib" in err


@pytest.mark.timeout(30)
def test_bad_path_from_the_command_line_exits_2():
    out = _train("configs/default.yaml", "--checkpoint.dir=README.md", timeout=25)
    assert out.returncode == 2 and _error_lines(out.stderr) == [out.stderr.strip()], out.stderr
    assert "checkpoint.dir='README.md' is a file, not a folder" in out.stderr


# ---- the run-folder lock ----------------------------------------------------------------------------------------
_HOLD = ("import sys, time\nfrom engine.training.config import load_config\nfrom engine.training.outputs import "
         "run_lock\nwith run_lock(load_config(None, {'logging.run_dir': sys.argv[1]})):\n    print('held', "
         "flush=True)\n    time.sleep(60)\n")


@pytest.mark.timeout(60)
def test_lock_names_the_holder_and_dies_with_it(tmp_path):
    """A second run into a locked run folder is refused naming the holder's pid; once the holder is SIGKILLed (a
    crashed run) the folder is free again."""
    from engine.training.config import ConfigError, load_config
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        config = load_config(None, {"logging.run_dir": str(tmp_path)})
        with pytest.raises(ConfigError, match=rf"in use by another pipecast run \(pid {holder.pid} "):
            with run_lock(config):
                pass
        holder.kill()
        holder.wait(timeout=10)
        with run_lock(config):  # the kernel released the crashed holder's lock
            pass
    finally:
        holder.kill()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_second_run_into_a_running_folder_is_refused_and_the_first_finishes(tmp_path):
    overrides = tiny_overrides(write_corpus(tmp_path / "corpus.txt"), tmp_path / "run",
                               **{"parallel.pipeline": 2, "training.steps": 30, "checkpoint.interval": 0})
    first = _job({"overrides": overrides, "record_dir": str(tmp_path), "patch": None})
    try:
        _wait_for(lambda: len(read_records(tmp_path)) == 2, 120, first)
        second = _train("configs/default.yaml", *_flags(overrides), timeout=90)
        assert second.returncode == 2, second.stderr
        line = _error_lines(second.stderr)[0]
        assert f"in use by another pipecast run (pid {first.pid} " in line, line
        _, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
        assert (tmp_path / "run" / "checkpoints" / "step_00000030" / ".metadata").is_file()
    finally:
        first.kill()


# ---- SIGTERM ----------------------------------------------------------------------------------------------------
def _losses(log_text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+)/\d+ \| loss (\S+)", log_text)}


def _run_args(tmp: Path, name: str, **extra) -> list[str]:
    overrides = tiny_overrides(write_corpus(tmp / "corpus.txt"), tmp / name,
                               **{"parallel.pipeline": 2, "training.steps": 60, "logging.level": "INFO",
                                  "checkpoint.interval": 0, **extra})
    return ["configs/default.yaml", *_flags(overrides)]


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard: three trainer runs on a possibly busy machine
def test_sigterm_saves_on_every_rank_and_resume_continues_exactly(tmp_path):
    """SIGTERM to the launcher mid-run: the ranks finish the step, save it, and ``pipecast train`` exits 143 naming
    the saved step; ``--resume`` then gives the same loss at every step as a run never stopped."""
    args = _run_args(tmp_path, "stopped")
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "train", *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "stopped" / "train.log"
    try:
        _wait_for(lambda: log.is_file() and len(_losses(log.read_text())) >= 3, 120, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=100)
    finally:
        proc.kill()
    assert proc.returncode == launch.EXIT_PREEMPTED == 143, err[-3000:]
    saved = re.search(r"^preempted: SIGTERM; saved checkpoint of step (\d+) in (\S+) on every rank", err, re.M)
    assert saved, err[-3000:]
    step = int(saved.group(1))
    assert 3 <= step < 60 and Path(saved.group(2)).name == f"step_{step:08d}"
    assert max(_losses(log.read_text())) == step, "the step in flight was not finished, or more ran after"
    resumed = _train(*args, "--resume", timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = _train(*_run_args(tmp_path, "straight"), timeout=150)
    assert straight.returncode == 0, straight.stderr[-3000:]
    want = _losses((tmp_path / "straight" / "train.log").read_text())
    assert sorted(want) == list(range(1, 61))
    assert _losses(log.read_text()) == want, "the stopped + resumed run differs from the straight run"


def _rank_pids(launcher_pid: int) -> list[int]:
    """The launcher's rank processes (its children started by the spawn method, not the resource tracker)."""
    kids = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    return [int(k) for k in kids if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text()]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint(tmp_path):
    args = _run_args(tmp_path, "run")
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "train", *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "run" / "train.log"
    try:
        _wait_for(lambda: log.is_file() and len(_losses(log.read_text())) >= 2, 120, proc)
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2
        os.kill(ranks[0], signal.SIGTERM)  # pipeline rank 0, not the logging rank
        _, err = proc.communicate(timeout=100)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    step = int(re.search(r"saved checkpoint of step (\d+)", err).group(1))
    assert (tmp_path / "run" / "checkpoints" / f"step_{step:08d}" / ".metadata").is_file()
    assert not any(process_alive(p) for p in ranks)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_second_sigterm_during_the_save_leaves_the_previous_checkpoint(tmp_path):
    """The save after SIGTERM is slow; a second SIGTERM kills the ranks mid-save: exit 143 with one error line
    naming the previous checkpoint, which stays complete -- ``--resume`` continues from it."""
    overrides = tiny_overrides(write_corpus(tmp_path / "corpus.txt"), tmp_path / "run",
                               **{"parallel.pipeline": 2, "training.steps": 60, "checkpoint.interval": 2})
    proc = _job({"overrides": overrides, "record_dir": str(tmp_path), "patch": "slow_preempt_save"})
    ckpts = tmp_path / "run" / "checkpoints"
    try:
        _wait_for(lambda: any(ckpts.glob("step_*/.metadata")), 120, proc)
        proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: (tmp_path / "in_save").is_file(), 120, proc)
        before = sorted(p.name for p in ckpts.glob("step_*") if (p / ".metadata").is_file())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=100)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and "a second SIGTERM arrived" in lines[0] and before[-1] in lines[0], lines
    assert sorted(p.name for p in ckpts.glob("step_*") if (p / ".metadata").is_file()) == before
    assert not any(process_alive(r["pid"]) for r in read_records(tmp_path).values())
    resumed = _train("configs/default.yaml", *_flags(overrides), "--training.steps=" + str(int(before[-1][5:]) + 1),
                     "--resume", "--logging.level=INFO", timeout=120)
    assert resumed.returncode == 0 and f"at step {int(before[-1][5:])}" in resumed.stderr, resumed.stderr[-3000:]


# ---- a stopped rank, a full disk ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stopped_rank_is_reported_as_the_peers_timeout(tmp_path):
    """Rank 1 is SIGSTOPped: the launcher reports rank 0's timeout naming pipeline rank 1 within
    ``parallel.timeout_s`` + REPORT_GRACE_S + the stop, not its own SIGKILL of the stopped rank; the line blames
    the stopped rank 1, with rank 0's timeout as the cause (issue 36: it blamed the waiting rank 0)."""
    from engine.runtime.spawn import REPORT_GRACE_S, STOP_GRACE_S
    timeout_s = 4
    overrides = tiny_overrides(write_corpus(tmp_path / "corpus.txt"), tmp_path / "run",
                               **{"parallel.pipeline": 2, "training.steps": 5, "parallel.timeout_s": timeout_s})
    proc = _job({"overrides": overrides, "record_dir": str(tmp_path), "fault": ["sigstop", 1, 2]})
    _, err = proc.communicate(timeout=100)
    ended = time.time()
    records = read_records(tmp_path)
    assert proc.returncode == 1, err[-3000:]
    line = _error_lines(err)[0]
    assert line.startswith("error: rank 1 (pid ") and "was stopped (process state T" in line, line
    assert "rank 0 timed out waiting for it" in line and "pipeline rank 1 (global rank 1)" in line, line
    waited = ended - records[1]["fault_at"]
    assert timeout_s <= waited < timeout_s + REPORT_GRACE_S + STOP_GRACE_S + 3, f"ended {waited:.1f}s after"
    assert not any(process_alive(r["pid"]) for r in records.values())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_disk_full_during_a_save_is_one_line_with_the_cause(tmp_path):
    """Issue 26: the disk fills up after the first checkpoint; the second save named only ``CheckpointException
    ranks:dict_keys([0, 1])``.  One line with the cause and the file, the first checkpoint intact, no partial
    folder left.  Issue 36: that line came after 88 lines and 4 tracebacks; now it is all of stderr."""
    from engine.training.checkpoint.dcp import checkpoint_keys, list_checkpoints
    overrides = tiny_overrides(write_corpus(tmp_path / "corpus.txt"), tmp_path / "run",
                               **{"parallel.pipeline": 2, "training.steps": 4, "checkpoint.interval": 2})
    proc = _job({"overrides": overrides, "record_dir": str(tmp_path), "patch": "enospc"})
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 1, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and "No space left on device: '" in lines[0] and ".distcp'" in lines[0], err[-3000:]
    assert err.strip().splitlines() == lines, err[-3000:]  # no traceback above it (logging.level=WARNING)
    first = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert "cannot save the checkpoint of step 4" in lines[0], lines[0]
    assert f"the previous checkpoint {str(first)!r} is intact" in lines[0], lines[0]
    assert list_checkpoints(first.parent) == [first] and checkpoint_keys(first)
    assert not list(first.parent.glob(".step_*.tmp"))
