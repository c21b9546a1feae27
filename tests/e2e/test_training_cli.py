"""``pipecast train`` end to end (spawned ranks, resolved config, checkpoint, --resume, bad config exit) and the
README's Python example (tests/examples/readme_example.py), each as a subprocess."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.hidden_size=32", "model.num_attention_heads=2", "model.seq_length=32", "data.max_bytes=300000",
        "training.micro_batch_size=2", "training.eval_interval=0", "optimizer.warmup_steps=2",
        "logging.log_interval=1"]


def _pipecast(*args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "engine.cli", "train", *args], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)


def _step_lines(log: str) -> dict[int, str]:
    """``{step: "loss .. | grad norm .. | lr .."}`` from the ``step N/T | loss ...`` lines (timings dropped)."""
    out = {}
    for m in re.finditer(r"step (\d+)/\d+ \| (loss \S+ \| grad norm \S+ \| lr \S+)", log):
        out[int(m.group(1))] = m.group(2)
    return out


@pytest.mark.timeout(150)
def test_pipecast_train_and_resume(tmp_path):
    """A straight 6-step run (checkpoints at 4 and 6, dropout on), then the step-6 checkpoint removed -- a run
    stopped after step 4 -- and ``--resume``: steps 5 and 6 log the straight run's loss, grad norm and LR."""
    run_dir = tmp_path / "run"
    common = ["configs/default.yaml", *(f"--{o}" for o in TINY), f"--logging.run_dir={run_dir}",
              "--training.steps=6", "--checkpoint.interval=4", "--model.dropout=0.1"]
    first = _pipecast(*common)
    assert first.returncode == 0, first.stderr
    log = first.stderr
    assert "interleaved schedule, pipeline=2 virtual=2 data=1" in log
    assert "step 6/6 | loss" in log and "grad norm" in log and "tokens/s" in log and "val loss" in log
    assert (run_dir / "checkpoints" / "step_00000004" / ".metadata").is_file()
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["training"]["steps"] == 6 and resolved["parallel"]["data"] == 1
    assert "step 6/6" in (run_dir / "train.log").read_text()
    straight = _step_lines(log)
    assert sorted(straight) == list(range(1, 7))
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")
    second = _pipecast(*common, "--resume")
    assert second.returncode == 0, second.stderr
    assert "at step 4" in second.stderr
    resumed = _step_lines(second.stderr)
    assert sorted(resumed) == [5, 6], "the resumed run trains steps 5 and 6 only"
    assert resumed == {k: straight[k] for k in (5, 6)}, "resumed steps differ from the straight run"
    assert (run_dir / "checkpoints" / "step_00000006").is_dir()


def test_bad_config_exits_fast_with_the_field():
    out = _pipecast("configs/default.yaml", "--model.num_layers=6", timeout=90)
    assert out.returncode == 2
    assert "model.num_layers=6" in out.stderr and "2 x 2" in out.stderr
    assert _pipecast("configs/default.yaml", "--model.layers=6", timeout=30).returncode == 2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_example_runs_twice_in_a_row(tmp_path):
    """The README's Python example runs, and runs again into the same folder (it continues from its checkpoint);
    a rank's error reaches the user as one ``error:`` line, not a traceback."""
    def example(*extra):
        return subprocess.run([sys.executable, "tests/examples/readme_example.py", *TINY, "training.steps=3",
                               f"logging.run_dir={tmp_path}", *extra], cwd=ROOT, timeout=110, capture_output=True,
                              text=True, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    for _ in range(2):
        out = example()
        assert out.returncode == 0, out.stderr
        assert "step 3: val loss" in out.stdout and (tmp_path / "checkpoints" / "step_00000003").is_dir()
    out = example("model.hidden_size=96", "model.num_attention_heads=2")  # another model: the resume is refused
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: rank "), out.stderr
    assert "CheckpointError: cannot resume" in out.stderr and "model.hidden_size" in out.stderr, out.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pipecast_train_under_torchrun(tmp_path):
    """The README's torchrun form (``torchrun ... -m engine.cli train``) on 2 CPU ranks: the ranks join torchrun's
    job, train, checkpoint and exit 0 (the rank exit skips interpreter finalization: ``engine.cli.entry``)."""
    from engine.runtime.spawn import free_port
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "engine.cli", "train",
           "configs/default.yaml", *(f"--{o}" for o in TINY), f"--logging.run_dir={run_dir}", "--training.steps=2",
           "--checkpoint.interval=2"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, timeout=150, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(_step_lines(out.stdout + out.stderr)) == [1, 2]
    assert (run_dir / "checkpoints" / "step_00000002" / ".metadata").is_file()
