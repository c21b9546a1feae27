"""The README stays true: its quickstart test command is what CI runs, and its code examples run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.runtime.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    """The README text under heading ``title``, up to the next heading of the same or a higher level."""
    lines, out, level, fenced = README.splitlines(), None, 0, False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"(#+) (.*)", line) if not fenced else None
        if out is None:
            if heading and heading.group(2) == title:
                out, level = [], len(heading.group(1))
            continue
        if heading and len(heading.group(1)) <= level:
            break
        out.append(line)
    assert out is not None, f"README has no section {title!r}"
    return "\n".join(out) + "\n"


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_quickstart_has_two_commands_and_ci_runs_the_test_command():
    blocks = code_blocks(section("Quickstart"), "bash")
    assert len(blocks) == 2, "the quickstart has exactly two commands: the main job and the tests"
    train, tests = (b.strip() for b in blocks)
    assert "pipecast train configs/default.yaml" in train and "torch==2.13.0" in train
    assert "pytest" in tests and "torch==2.13.0" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci, ".ci/run must run the README's test command unchanged"


def test_python_training_example_is_the_tested_file():
    block = code_blocks(section("The same run from Python"), "python")[0]
    code = block.split("\n", 1)[1]  # drop the comment line naming the file
    example = (ROOT / "tests" / "examples" / "readme_example.py").read_text()
    assert code.strip() in example, "README's Python example differs from tests/examples/readme_example.py (run by a test)"


def test_plan_example_runs():
    block = code_blocks(section("Schedules as data: plans, validation, simulation"), "python")[0]
    namespace: dict = {}
    exec(compile(block, "README:plans", "exec"), namespace)  # noqa: S102 - our own README
    sim = namespace["sim"]
    assert sim.makespan > 0 and len(sim.bubble) == 4


@pytest.mark.timeout(180)
def test_api_example_runs_under_torchrun(tmp_path):
    block = code_blocks(section("Example: a model split into chunks, on two pipeline ranks"), "python")[0]
    script = tmp_path / "example.py"
    script.write_text(block)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0: []" in out.stdout
    # the two ranks print concurrently, so their lines may interleave: count over the whole output
    assert out.stdout.count("rank 1: [") == 1 and out.stdout.count("lm loss") == 4, out.stdout


def _tp_example_reference() -> list[float]:
    """The example's 4 losses from one process: two unsharded stages with the example's initialisation (seed 0
    before each stage's layers, so both stages start equal) and its data (drawn after the layers)."""
    import torch
    from torch import nn

    def stage():
        torch.manual_seed(0)
        return nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16)

    stages = [stage(), stage()]
    data = [(torch.randn(8, 4, 16), torch.randn(8, 4, 16)) for _ in range(4)]
    losses = []
    with torch.no_grad():
        for x, target in data:
            for norm, up, down in stages:
                x = x + down(torch.relu(up(norm(x))))
            losses.append(((x - target) ** 2).mean().item())
    return losses


@pytest.mark.timeout(240)
def test_tensor_parallel_api_example_runs_under_torchrun():
    """tests/examples/megatron_tp_example.py (README: pipeline 2 x tensor 2 with sequence_parallel) on 4 ranks:
    stage 0 sends [s/2, b, h], both tensor-parallel ranks of the last stage report the single-process losses
    (printed to 4 decimals, compared to 1e-4)."""
    script = ROOT / "tests" / "examples" / "megatron_tp_example.py"
    assert script.name in README, "README does not show the tensor-parallel example"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {int(m.group(1)): m for m in re.finditer(
        r"rank (\d) \(stage (\d), tp (\d)\): activation messages \[(.*?)\], losses \[(.*?)\]", out.stdout)}
    assert sorted(lines) == [0, 1, 2, 3], out.stdout
    want = _tp_example_reference()
    for rank, m in lines.items():
        if rank < 2:
            assert m.group(4) == "(4, 4, 16)" and m.group(5) == "", m.group(0)
        else:
            got = [float(v) for v in m.group(5).split(", ")]
            assert got == pytest.approx(want, abs=1e-4), (m.group(0), want)
