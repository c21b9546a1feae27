"""``engine.spawn`` / ``engine.runtime.spawn.spawn``: the one spawner of local ranks (launcher, tests, benchmarks).

Results come back to the caller in rank order; every failure is one exception with a one-line message naming the
rank to blame and its real cause, and no rank process outlives the call.  Rank functions: tests/helpers/spawn_jobs.py.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import engine
from engine.runtime import spawn as sp
from tests.helpers import spawn_jobs as jobs
from tests.helpers.distributed import process_alive

ROOT = Path(__file__).resolve().parents[2]


def _pids(pid_dir: Path) -> list[int]:
    return [int(f.read_text()) for f in sorted(pid_dir.glob("*.pid"))]


def _no_rank_left(pid_dir: Path) -> None:
    pids = _pids(pid_dir)
    assert pids and not any(process_alive(p) for p in pids), "a rank process outlived spawn()"


@pytest.mark.timeout(60)
def test_results_come_back_in_rank_order(capfd):
    assert engine.spawn is sp.spawn
    out = sp.spawn(jobs.sum_ranks, 2, args=(10.0,), timeout_s=50)
    assert [r["rank"] for r in out] == [0, 1] and [r["env_rank"] for r in out] == ["0", "1"]
    # issue 36: a warning every rank emits (torch's DTensor warning under tensor parallelism) is shown once
    assert capfd.readouterr().err.count("UserWarning: spawn test: a warning every rank emits") == 1
    assert all(r["sum"] == 10.0 for r in out)  # all_reduce of 0 + 1, scaled: the ranks formed one group
    assert sp.spawn(jobs.ends_with_exit, 2, timeout_s=50) == [None, None]  # os._exit(0): no value, no error


@pytest.mark.timeout(60)
def test_a_finished_rank_with_a_thread_inside_torch_exits_cleanly(tmp_path):
    """A daemon thread mid-op at interpreter finalization aborts the process (SIGABRT, ``terminate called without
    an active exception``; seen in CI from a gloo worker): ranks end without finalization, yet still join their
    non-daemon threads and run their ``atexit`` handlers."""
    assert sp.spawn(jobs.busy_thread_at_exit, 2, args=(str(tmp_path),), timeout_s=50) == [0, 1]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["atexit_0", "atexit_1", "thread_0", "thread_1"]


@pytest.mark.timeout(60)
def test_a_raise_is_one_line_naming_the_rank_and_cause(tmp_path):
    with pytest.raises(sp.RankError) as info:
        sp.spawn(jobs.raise_on, 2, args=(1, str(tmp_path)), timeout_s=50)
    err = info.value
    assert str(err) == "rank 1 failed: ValueError: injected on rank 1; stopped the other ranks (0)"
    assert err.rank == 1 and "Traceback" in err.traceback and "raise_on" in err.traceback
    assert not err.one_line  # a failure of the code: its traceback is part of the report
    _no_rank_left(tmp_path)


@pytest.mark.timeout(60)
def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    with pytest.raises(sp.RankError) as info:
        sp.spawn(jobs.kill_self, 2, args=(1, str(tmp_path)), timeout_s=50)
    assert str(info.value).startswith("rank 1 (pid ") and "was killed by SIGKILL; stopped the other ranks (0)" \
        in str(info.value)
    _no_rank_left(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_stopped_rank_ends_as_the_peers_timeout(tmp_path):
    """Rank 1 SIGSTOPs itself: rank 0's collective times out after ``group_timeout_s`` and is the error reported
    (not the spawner's SIGKILL of the stopped rank, nor the job timeout), blaming the stopped rank 1 with rank 0's
    timeout as the cause (issue 36: it blamed the waiting rank)."""
    with pytest.raises(sp.RankError) as info:  # not the JobTimeout of timeout_s: the peer's timeout is reported
        sp.spawn(jobs.stop_self, 2, args=(1, str(tmp_path)), group_timeout_s=3, timeout_s=50)
    line = str(info.value)
    assert info.value.rank == 1 and line.startswith("rank 1 (pid ") and "was stopped" in line, line
    assert "rank 0 timed out waiting for it: " in line and "Timed out" in line and info.value.one_line, line
    _no_rank_left(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_job_timeout_stops_every_rank(tmp_path):
    with pytest.raises(sp.JobTimeout) as info:
        sp.spawn(jobs.hang, 2, args=(str(tmp_path),), timeout_s=10)
    assert info.value.ranks == [0, 1] and "timeout_s=10" in str(info.value)
    # a loaded machine may not have started a rank's function within the 10 s: count the processes, not pid files
    assert not multiprocessing.active_children(), "a rank process outlived spawn()"
    assert not any(process_alive(p) for p in _pids(tmp_path))


def _caller(tmp_path: Path, scenario: str, grace: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.spawn_jobs", scenario, str(tmp_path), str(grace)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120  # a hang guard: rank start-up is slow on a busy machine
    while len(_pids(tmp_path)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    if len(_pids(tmp_path)) < 2:
        proc.kill()
        raise AssertionError(f"the ranks did not start:\n{proc.communicate()[1][-2000:]}")
    time.sleep(0.3)
    return proc


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("grace,expect", [(30.0, "['finished', 'finished']"),
                                          (0.5, "Terminated: terminated: the ranks did not finish within "
                                                "term_grace_s=0.5 s")], ids=["in-grace", "past-grace"])
def test_sigterm_is_forwarded_and_the_ranks_get_the_grace(tmp_path, grace, expect):
    """SIGTERM to the caller reaches every rank; ranks that finish within ``term_grace_s`` return their values,
    ranks that take longer are killed and Terminated is raised."""
    proc = _caller(tmp_path, "slow_on_sigterm", grace)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=100)
    assert out.strip().startswith(expect), out + err[-2000:]
    _no_rank_left(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_killed_by_the_forwarded_sigterm_is_terminated_not_blamed(tmp_path):
    proc = _caller(tmp_path, "hang", 30.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=100)
    assert out.startswith("Terminated: terminated: rank ") and "forwarded SIGTERM" in out, out
    _no_rank_left(tmp_path)


# ---- pure parts -------------------------------------------------------------------------------------------------
def test_blame_prefers_a_killed_rank_then_the_earliest_raise():
    kill, stop = -int(signal.SIGKILL), -int(signal.SIGINT)  # SIGINT: the spawner's own stop signal
    records = {0: (2_000, "RuntimeError: Connection closed by peer", "tb0"), 3: (1_000, "ValueError: x", "tb3")}
    assert sp._blame([1, stop, kill, 1], records) == 2  # killed by a signal the spawner did not send
    assert sp._blame([1, stop, None, 1], records) == 3  # the earliest recorded raise, not the first reported
    assert sp._blame([None, 7, stop, None], {}) == 1  # no record: the first non-zero exit
    err = sp.RankError(2, 102, "was killed by SIGKILL", "", kill, "SIGKILL", [0, 1, 3])
    assert str(err) == "rank 2 (pid 102) was killed by SIGKILL; stopped the other ranks (0, 1, 3)"


def test_a_peer_that_exits_first_waits_for_the_killed_rank():
    """A killed rank closes its sockets before it is reaped: the failure waits for its exit code, not blaming the
    peer that saw the closed connection and exited first."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=jobs.die_later, args=(2.0,)), ctx.Process(target=sys.exit, args=(1,))]
    for p in procs:
        p.start()
    procs[1].join()  # the peer has exited; the killed rank is (normally) still sleeping
    codes = sp._settled_codes(procs, settle_s=60)
    assert codes == [-signal.SIGKILL, 1] and sp._blame(codes, {1: (1, "RuntimeError: Connection reset", "")}) == 0
    for p in procs:
        p.join()


def _raise(factory):
    try:
        factory()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("no exception")


def test_describe_exception_is_one_line_with_the_os_error_under_it():
    def multiline():
        raise RuntimeError("checkpoint is truncated\n  File 'x.distcp' is missing\ndelete it")

    def chained():
        try:
            multiline()
        except RuntimeError as exc:
            raise KeyError("cannot resume") from exc
    assert sp.describe_exception(_raise(multiline)) == "RuntimeError: checkpoint is truncated"
    assert sp.describe_exception(_raise(chained)) == "KeyError: 'cannot resume'"

    from torch.distributed.checkpoint.api import CheckpointException
    full = OSError(28, os.strerror(28), "/ckpt/__0_0.distcp")
    dcp = CheckpointException("save failed", {0: (full, None)})
    line = sp.describe_exception(dcp)
    assert "\n" not in line and line.endswith("(OSError: [Errno 28] No space left on device: '/ckpt/__0_0.distcp')")
    assert sp.describe_exception(full) == "OSError: [Errno 28] No space left on device: '/ckpt/__0_0.distcp'"


def test_only_failures_of_the_code_need_their_traceback():
    """Issue 36: a full disk printed 88 lines and 4 tracebacks before the one line that said it all.  A failure
    whose line is the whole report -- an operating-system error about the machine under it, or an error class that
    says so (``one_line``) -- is reported without the traceback; a failure of the code keeps it."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    class Named(RuntimeError):
        one_line = True

    def wrapped(code):
        def fail():
            try:
                raise OSError(code, os.strerror(code))
            except OSError as exc:
                raise RuntimeError("cannot save") from exc
        return _raise(fail)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/__0_0.distcp")
    for machine in (full, wrapped(errno.ENOSPC), wrapped(errno.EROFS), wrapped(errno.EACCES),
                    CheckpointException("save failed", {0: (full, None)}), Named("bad checkpoint")):
        assert not sp.needs_traceback(machine), machine
    for code in (ValueError("bug"), KeyError("x"), FileNotFoundError(errno.ENOENT, "missing"),
                 wrapped(errno.EBADF)):
        assert sp.needs_traceback(code), code


def test_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="world_size=0"):
        sp.spawn(jobs.sum_ranks, 0)
