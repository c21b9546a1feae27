"""The pipeline groups' gloo I/O threads get a lower priority (engine.runtime.gloo_io): which threads, which value, the
switch, and that nothing fails where threads cannot be reniced."""
from __future__ import annotations

import os

import pytest

from engine.runtime import gloo_io
from tests.helpers.distributed import run_ranks


@pytest.mark.parametrize("raw, expected", [(None, 19), ("off", None), ("None", None), ("", None), ("7", 7),
                                           (" 0 ", 0), ("19", 19)])
def test_default_nice_reads_the_environment(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("PIPECAST_GLOO_IO_NICE", raising=False)
    else:
        monkeypatch.setenv("PIPECAST_GLOO_IO_NICE", raw)
    assert gloo_io.default_nice() == expected


@pytest.mark.parametrize("option", ["off", 25, -3, True, 1.5])
def test_a_bad_gloo_io_nice_argument_is_refused_before_any_group(option):
    from engine.runtime.process_groups import build_process_groups
    with pytest.raises(ValueError, match=r"gloo_io_nice=.*integer 0\.\.19"):
        gloo_io.resolve_nice(option)
    with pytest.raises(ValueError, match="gloo_io_nice"):  # torch.distributed is not initialised: nothing created
        build_process_groups(1, gloo_io_nice=option)


@pytest.mark.parametrize("raw", ["x", "20", "-1", "1.5", "no"])
def test_a_bad_value_warns_naming_the_variable_and_keeps_the_default(monkeypatch, raw):
    monkeypatch.setenv("PIPECAST_GLOO_IO_NICE", raw)
    with pytest.warns(RuntimeWarning, match="PIPECAST_GLOO_IO_NICE"):
        assert gloo_io.default_nice() == gloo_io.DEFAULT_NICE
    with pytest.raises(ValueError, match=r"PIPECAST_GLOO_IO_NICE=.*integer 0\.\.19.*'off'"):
        gloo_io.check_environment()


def test_pipecast_train_refuses_a_bad_value_before_any_rank_starts(tmp_path):
    import subprocess
    import sys
    env = dict(os.environ, PIPECAST_GLOO_IO_NICE="fast")
    out = subprocess.run([sys.executable, "-m", "engine.cli", "train", "configs/default.yaml",
                          f"--logging.run_dir={tmp_path}", f"--checkpoint.dir={tmp_path}/ckpt"],
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith("error: PIPECAST_GLOO_IO_NICE='fast' is not a nice value"), out.stderr


def _fake_threads(monkeypatch, before, after, fail=False):
    calls = iter([set(before), set(after)])
    monkeypatch.setattr(gloo_io, "io_threads", lambda: next(calls))
    monkeypatch.setattr(os, "getpriority", lambda which, tid: 0)
    set_calls = []

    def setpriority(which, tid, nice):
        if fail:
            raise PermissionError("sandbox")
        set_calls.append((tid, nice))
    monkeypatch.setattr(os, "setpriority", setpriority)
    return set_calls


def test_only_threads_created_inside_the_block_are_reniced(monkeypatch):
    set_calls = _fake_threads(monkeypatch, {10, 11}, {10, 11, 12, 13})
    with gloo_io.lowered_io_priority(19) as changed:
        pass
    assert sorted(set_calls) == [(12, 19), (13, 19)] and changed == {12, 13}


def test_an_io_thread_that_names_itself_late_is_still_reniced(monkeypatch):
    # the group's thread exists when the block ends but takes its name only later (a busy machine): the first
    # listings after the block do not show it yet
    set_calls = _fake_threads(monkeypatch, {10}, {10})
    listings = iter([{10}, {10}, {10}, {10, 12}])
    monkeypatch.setattr(gloo_io, "io_threads", lambda: next(listings))
    with gloo_io.lowered_io_priority(19, expected=1) as changed:
        pass
    assert set_calls == [(12, 19)] and changed == {12}


def test_none_leaves_threads_alone_and_refusals_are_ignored(monkeypatch):
    set_calls = _fake_threads(monkeypatch, {1}, {1, 2})
    with gloo_io.lowered_io_priority(None) as changed:
        pass
    assert set_calls == [] and changed == set()
    _fake_threads(monkeypatch, {1}, {1, 2}, fail=True)
    with gloo_io.lowered_io_priority(19) as changed:
        pass
    assert changed == set()


def _nice_of_new_io_threads(rank: int, world: int, options: tuple) -> list:
    from engine.runtime.process_groups import build_process_groups
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the test may itself run under nice
    out = []
    for option in options:  # each build makes new groups, with new I/O threads
        before = gloo_io.io_threads()
        kwargs = {} if option == "default" else {"gloo_io_nice": option}
        pgc = build_process_groups(2, **kwargs)
        pgc.pp.barrier()  # the pipeline group still works
        # one I/O thread per distinct group this rank joins (a kind whose rank lists equal an earlier kind's reuses
        # its groups), counted once all have named themselves (a new thread carries its creator's name at first)
        joined = len(pgc._owned)
        new = gloo_io.new_io_threads(before, joined, wait_s=60)
        out.append((base, joined, sorted(os.getpriority(os.PRIO_PROCESS, tid) for tid in new)))
    return out


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads are listed through /proc")
def test_build_process_groups_renices_only_the_pipeline_groups_io_thread():
    cases = (("default", 19), (None, 0), (5, 5))
    for per_option in run_ranks(_nice_of_new_io_threads, 2, tuple(o for o, _ in cases), timeout=50):
        for (option, expected), (base, joined, niceness) in zip(cases, per_option):
            assert joined >= 2 and niceness == sorted([max(base, expected)] + [base] * (joined - 1)), \
                (option, base, niceness)
