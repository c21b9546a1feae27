"""The launcher with the data and the ranks: checked before any rank starts, Ctrl-C, teardown (``pipecast train``):

* data problems are found before any rank starts (``engine.training.data.corpus.check_data``, called by the launcher):
  exit 2 with one ``error:`` line naming the field, its value and the fix -- and the ranks' ``load_corpus`` gives
  the same errors (odd-sized / out-of-vocabulary ``.bin`` files included);
* (the failure summary line is tested with the spawner, tests/runtime/test_spawn.py);
* SIGINT to the launcher (or to the whole process group, as Ctrl-C does) stops every rank, prints one line and
  exits 130;
* teardown of a successful run: no rank destroys its groups or exits while a peer is still working (the
  rendezvous store lives in the launcher, which outlives every rank).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.training import launch
from engine.training.config import ConfigError, load_config
from engine.training.data.corpus import check_data, load_corpus
from tests.helpers.distributed import process_alive
from tests.helpers.reliability_jobs import read_records, tiny_overrides, write_corpus

ROOT = Path(__file__).resolve().parents[2]


# ---- data checks ------------------------------------------------------------------------------------------------
def _config(**overrides):
    return load_config(str(ROOT / "configs" / "default.yaml"), overrides)


def _bin(path: Path, tokens) -> Path:
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    return path


def _data_error(cfg) -> str:
    """check_data's message; load_corpus (what each rank runs) must raise the same."""
    with pytest.raises(ConfigError) as before:
        check_data(cfg)
    with pytest.raises(ConfigError) as in_rank:
        load_corpus(cfg.data, cfg.model.seq_length, cfg.model.vocab_size)
    assert str(before.value) == str(in_rank.value)
    return str(before.value)


def test_data_problems_name_the_field_value_and_fix(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    msg = _data_error(_config(**{"data.source": "text", "data.paths": [str(empty)]}))
    assert "data.paths" in msg and str(empty) in msg and "no input files" in msg

    (tmp_path / "blank.txt").write_bytes(b"")
    msg = _data_error(_config(**{"data.source": "text", "data.paths": [str(tmp_path / "blank.txt")]}))
    assert "data.paths" in msg and "empty" in msg

    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 100)  # shorter than one sample of model.seq_length=128
    msg = _data_error(_config(**{"data.source": "text", "data.paths": [str(short)]}))
    assert "model.seq_length=128" in msg and "train split" in msg and "130" in msg
    # long enough for training, but the validation split (1 block in 20) is shorter than one sample
    mid = tmp_path / "mid.txt"
    mid.write_bytes(bytes(range(256)) * 8)
    msg = _data_error(_config(**{"data.source": "text", "data.paths": [str(mid)]}))
    assert "model.seq_length=128" in msg and "validation split" in msg and "data.val_fraction" in msg

    a, b = _bin(tmp_path / "a.bin", range(1000)), _bin(tmp_path / "b.bin", range(1000))
    msg = _data_error(_config(**{"data.source": "bin", "data.paths": [str(a), str(b)], "model.vocab_size": 1000}))
    assert "data.paths=" in msg and "exactly one path" in msg

    nano = tmp_path / "nano"
    nano.mkdir()
    _bin(nano / "val.bin", range(1000))
    msg = _data_error(_config(**{"data.source": "bin", "data.paths": [str(nano)], "model.vocab_size": 1000}))
    assert "data.paths[0]" in msg and "train.bin" in msg and "val.bin" in msg

    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00" * 500 + b"\x07")
    msg = _data_error(_config(**{"data.source": "bin", "data.paths": [str(odd)], "model.vocab_size": 1000}))
    assert str(odd) in msg and "1001 bytes" in msg and "uint16" in msg and "2 bytes" in msg

    big = _bin(tmp_path / "big.bin", [5] * 900 + [4242] + [5] * 3099)  # the largest id sits in the train split
    msg = _data_error(_config(**{"data.source": "bin", "data.paths": [str(big)], "model.vocab_size": 1000}))
    assert "model.vocab_size=1000" in msg and "4242" in msg and "at least 4243" in msg

    cfg = _config(**{"data.source": "bin", "data.paths": [str(big)], "model.vocab_size": 4243})
    assert "uint16 tokens" in check_data(cfg)
    assert load_corpus(cfg.data, 128, 4243).largest_token() == 4242


def test_max_token_is_scanned_in_chunks():
    from engine.training.data.corpus import max_token_id
    tokens = np.arange(10_000, dtype=np.uint16)[::-1].copy()
    assert max_token_id(tokens, chunk=7) == 9_999 == max_token_id(tokens)
    assert max_token_id(np.zeros(0, np.uint16)) == -1


def test_default_stdlib_check_reads_no_file(monkeypatch):
    """The launcher's check of the default corpus only walks and stats (the ranks read the bytes)."""
    def no_read(self):
        raise AssertionError(f"check_data read {self}")
    monkeypatch.setattr(Path, "read_bytes", no_read)
    assert "files (stdlib)" in check_data(_config())


def _run_cli(overrides: list[str], monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setattr(launch, "run_spawned", lambda *a, **k: pytest.fail("ranks spawned despite bad data"))
    args = argparse.Namespace(config=str(ROOT / "configs" / "default.yaml"), extra=overrides, resume=False,
                              timeline=None, nvtx=False)
    rc = launch.run(args)
    return rc, capsys.readouterr().err


def test_bad_data_exits_2_before_spawning(tmp_path, monkeypatch, capsys):
    odd = tmp_path / "tokens.bin"
    odd.write_bytes(b"\0" * 2001)
    rc, err = _run_cli(["--data.source=bin", f"--data.paths=[{odd}]", "--model.vocab_size=1000"], monkeypatch,
                       capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: data.paths[0]: ") and "uint16" in err, err
    rc, err = _run_cli(["--data.source=bin", f"--data.paths=[{odd},{odd}]"], monkeypatch, capsys)
    assert rc == 2 and err.startswith("error: data.paths=") and "Traceback" not in err, err


def test_fresh_run_into_a_used_run_folder_exits_2_before_spawning(tmp_path, monkeypatch, capsys):
    (tmp_path / "checkpoints" / "step_00000207").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000207" / ".metadata").write_bytes(b"x")
    rc, err = _run_cli([f"--logging.run_dir={tmp_path}"], monkeypatch, capsys)
    assert rc == 2 and err.startswith("error: checkpoint.dir ") and "--resume" in err and "step_00000207" in err, err


# ---- SIGINT -----------------------------------------------------------------------------------------------------
def _sigint_as_in_a_terminal() -> None:
    """In the child before it runs Python: SIGINT's default action, as in a terminal.  A test run started in the
    background of a non-interactive shell (``cmd &``) inherits SIGINT ignored, and Python then keeps ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("to_group", [False, True], ids=["launcher-only", "process-group"])
def test_sigint_stops_every_rank_and_exits_130(tmp_path, to_group):
    """SIGINT to the launcher alone (``kill -INT``), or to its whole process group (Ctrl-C in a terminal), while
    both ranks block inside gloo: every rank is gone within seconds, one line, exit status 130."""
    overrides = tiny_overrides(write_corpus(tmp_path / "corpus.txt"), tmp_path / "run",
                               **{"parallel.pipeline": 2, "parallel.timeout_s": 60})
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.reliability_jobs",
                             json.dumps({"overrides": overrides, "record_dir": str(tmp_path), "sleep": True})],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_sigint_as_in_a_terminal)
    try:
        deadline = time.time() + 120
        while len(read_records(tmp_path)) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        pids = [r["pid"] for r in read_records(tmp_path).values()]
        assert len(pids) == 2, "the ranks did not start"
        time.sleep(0.5)  # both ranks are inside their gloo receive
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=100)
        assert proc.returncode == 130, err
        assert err.strip() == "interrupted; stopped ranks 0, 1", err
        assert not any(process_alive(p) for p in pids), "a rank outlived the interrupt"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# ---- teardown ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_rank0_exits_after_a_late_peer(tmp_path):
    """Rank 1 ends its work 1.5 s after rank 0 (the log rank's final evaluation and 'done' line): rank 0 must
    neither tear down nor exit before it (before the fix it exited ~1.5 s earlier; a peer tearing down under a
    departed store host was the suspected cause of the SIGABRT after 'done')."""
    from engine.training.launch import launch_ranks
    from tests.helpers.reliability_jobs import late_finisher
    cfg = load_config(None, tiny_overrides(write_corpus(tmp_path / "corpus.txt"), tmp_path / "run",
                                           **{"parallel.pipeline": 2}))
    launch_ranks(late_finisher, cfg, str(tmp_path), 1, 1.5)
    records = read_records(tmp_path)
    assert all("exit" in r for r in records.values()), records
    assert records[0]["exit"] >= records[1]["fn_end"], records
