"""``benchmarks/gpu_check.py``, the one command of the first GPU run, kept from rotting on CPU.

* its ``--dry-run`` (emulate backend, tiny sizes) runs in a subprocess with the optional packages blocked (a
  ``sitecustomize`` on ``PYTHONPATH`` installs a meta-path finder raising ``ImportError`` for them, so the GPU
  machine's "torch, pytest, pyyaml, numpy and nothing else" is what it sees): exit 0 and every check in the JSON,
  written into the ``--out`` folder;
* planted faults make it exit 1 with exactly their checks failing: one emulated forward replay writes a perturbed
  output (the first graphs case), replays draw frozen dropout masks (``dropout_rng``), and W captures keep every
  microbatch's activations, so the graph pool grows with M (``split_memory``);
* a run with ``git`` missing from ``PATH`` and killed by SIGKILL inside a check leaves its JSON with the checks
  that finished, the running one in ``in_progress`` and the missing ``git`` under ``commands``.
  The three runs execute the script as ``__main__`` (``runpy``) one after the other in one subprocess (one
  interpreter start and import of torch for all); the faults are planted between them, the kill ends it;
* in process: the time budget skips (and records) checks whose estimate exceeds what is left; the watchdog records
  the running check and ends the run; a capture that silently falls back to eager, and one that leaves the
  caller's GC disabled, are reported as failures by the check's capture wrapper.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("nvtx", "tokenizers", "safetensors", "matplotlib", "tqdm", "transformers", "transformer_engine",
           "hypothesis")

SITECUSTOMIZE = f'''
import importlib.abc, importlib.machinery, sys

BLOCKED = {BLOCKED!r}


class _Block(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Importing a blocked name fails as if it were not installed (a spec is returned, so probes such as
    importlib.util.find_spec see it; only executing the import fails)."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}} ({{spec.name}} is blocked: gpu_check must run "
                                  f"without it)", name=spec.name)

    def exec_module(self, module):
        raise AssertionError("unreachable")


sys.meta_path.insert(0, _Block())

'''


DRIVER = """
import json, os, runpy, signal, sys, tempfile

script, clean_out, planted_out, crash_out, codes_out = sys.argv[1:6]


def run(*args):
    sys.argv = [script, "--dry-run", *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # the script ends with sys.exit(main())
        return exc.code
    return None


codes = {"clean": run("--out", clean_out)}
import torch
from graphs.backends import emulate

replay_forward, capture_weight = emulate.EmulatedSlot.replay_forward, emulate.EmulatedSlot.capture_weight
calls, frozen, kept = [0], {}, []


def perturbed_frozen_replay(self):  # (1) one replay writes a perturbed output; (2) every replay of a slot draws its
    calls[0] += 1                   # first replay's random numbers and leaves the generator alone (pytorch#84614)
    caller = torch.get_rng_state()
    torch.set_rng_state(frozen.setdefault(id(self), caller))
    replay_forward(self)
    torch.set_rng_state(caller)
    if calls[0] == 3:
        self.static_outputs[0].add_(1e-3)


def leaking_capture_weight(self):  # (3) the W capture keeps the activations of every microbatch alive
    kept.append(self._live)
    capture_weight(self)


emulate.EmulatedSlot.replay_forward, emulate.EmulatedSlot.capture_weight = perturbed_frozen_replay, leaking_capture_weight
codes["planted"] = run("--checks", "graphs_interleaved_fp32,dropout,split_memory", "--out", planted_out)
emulate.EmulatedSlot.replay_forward, emulate.EmulatedSlot.capture_weight = replay_forward, capture_weight
with open(codes_out, "w") as f:
    json.dump(codes, f)
# the crash: git is not on PATH, and the process is killed (SIGKILL, no cleanup) inside the nvtx check
os.environ["PATH"] = tempfile.mkdtemp()
from engine.profiling import nvtx_ranges
nvtx_ranges.NvtxTracer = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
run("--checks", "dropout,nvtx", "--out", crash_out)
"""

RUNS = ("clean", "planted", "crash")


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict:
    """``{name: (exit code, report)}`` for :data:`RUNS` and the output of the one subprocess."""
    tmp_path = tmp_path_factory.mktemp("gpu_check")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), CUDA_VISIBLE_DEVICES="")
    outs = {name: tmp_path / name for name in RUNS}  # --out takes folders (outside the repository)
    codes_file = tmp_path / "codes.json"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT / "benchmarks" / "gpu_check.py"),
                           *(str(outs[n]) for n in RUNS), str(codes_file)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=420)
    codes = json.loads(codes_file.read_text()) if codes_file.exists() else {}
    report = {n: outs[n] / "gpu_check_dry_run.json" for n in RUNS}
    runs = {n: (codes.get(n), json.loads(report[n].read_text()) if report[n].exists() else {}) for n in RUNS}
    return {**runs, "output": proc.stdout[-3000:] + proc.stderr[-3000:], "returncode": proc.returncode,
            "files": {n: sorted(p.name for p in outs[n].iterdir()) if outs[n].exists() else [] for n in RUNS}}


def _check_names() -> set[str]:
    from benchmarks.gpu_check import SCHEDULES, TRAINER_CASES
    graphs = {f"graphs_{s}_{d}" for s, _ in SCHEDULES for d in ("fp32", "bf16")}
    return graphs | {name for name, *_ in TRAINER_CASES} | {
        "dropout_rng", "split_memory", "capture_seconds", "host_syncs", "nvtx", "cuda_tests", "bench_bitwise",
        "bench_launch_speedup", "bench_compute_ratio"}


@pytest.mark.slow
@pytest.mark.timeout(440)
def test_dry_run_passes_with_optional_packages_blocked(dry_runs):
    from benchmarks.gpu_check import NEEDS_CUDA, NOT_AVAILABLE
    code, report = dry_runs["clean"]
    assert code == 0, dry_runs["output"]
    assert "is blocked" not in dry_runs["output"]
    checks = report["checks"]
    assert set(checks) == _check_names(), sorted(checks)
    assert report["status"] == "PASS" and report["dry_run"] and report["backend"] == "emulate"
    assert report["commit"] and report["torch"] == torch.__version__ and report["in_progress"] is None
    assert dry_runs["files"]["clean"] == ["cuda_graphs_bench_dry_run.json", "gpu_check_dry_run.json"]
    for name, c in checks.items():
        assert c["status"] in ("pass", NEEDS_CUDA, NOT_AVAILABLE, "skipped: needs 2 devices"), (name, c)
    for name in ("graphs_zbv_fp32", "graphs_zb_h1_bf16", "dropout_rng", "split_memory", "trainer_zbv_fp32",
                 "trainer_1f1b_fp32", "trainer_1f1b_bf16", "trainer_1f1b_recompute", "bench_bitwise"):
        assert checks[name]["status"] == "pass", name
    assert checks["graphs_zbv_fp32"]["graph_vs_eager"]["bitwise"]
    assert checks["graphs_zbv_fp32"]["caller_state"]["gc_enabled"] == "unchanged"
    assert all(checks["dropout_rng"]["masks_change"]) and all(checks["dropout_rng"]["rng_state_as_eager"])
    memory = checks["split_memory"]
    assert memory["pool_reserved_growth_bytes"] <= memory["bound_bytes"]
    assert checks["cuda_tests"]["counts"]["skipped"] > 0  # the subprocess collected the cuda-marked tests


@pytest.mark.slow
@pytest.mark.timeout(440)
def test_planted_faults_fail_exactly_their_checks(dry_runs):
    """A perturbed replay output fails the first graphs case; replays that draw frozen dropout masks fail
    dropout_rng; activations kept past each W capture (memory growing with M) fail split_memory."""
    code, report = dry_runs["planted"]
    assert code == 1, dry_runs["output"]
    checks = report["checks"]
    assert set(checks) == {"graphs_interleaved_fp32", "dropout_rng", "split_memory"}  # --checks takes a case
    failed = {n for n, c in checks.items() if c["status"] == "fail"}
    assert failed == {"graphs_interleaved_fp32", "dropout_rng", "split_memory"}, failed
    assert not checks["graphs_interleaved_fp32"]["graph_vs_eager"]["bitwise"]
    assert not all(checks["dropout_rng"]["masks_change"])
    memory = checks["split_memory"]
    assert memory["weight_inputs_bytes"]["4"] == memory["weight_inputs_bytes"]["16"]  # only the pool grows
    assert memory["pool_reserved_growth_bytes"] > memory["bound_bytes"]
    assert any("pool_reserved grows by" in f for f in memory["failures"])


@pytest.mark.slow
@pytest.mark.timeout(440)
def test_a_killed_run_leaves_the_checks_so_far_and_a_missing_git_is_recorded(dry_runs):
    code, report = dry_runs["crash"]
    assert code is None and dry_runs["returncode"] == -signal.SIGKILL, dry_runs["output"]
    assert report["status"] == "INCOMPLETE" and report["in_progress"] == "nvtx"
    assert report["checks"]["dropout_rng"]["status"] == "pass" and "nvtx" not in report["checks"]
    assert report["commit"] is None and report["dirty"] is None
    assert "git: not found" in report["commands"]["git_commit"]["error"]


def _report(tmp_path):
    from benchmarks import gpu_check
    return gpu_check.Report(tmp_path / "gpu_check.json", True, {"dry_run": True}, 10.0)


def test_the_budget_skips_checks_whose_estimate_exceeds_what_is_left(tmp_path):
    from benchmarks import gpu_check
    rep = _report(tmp_path)
    budget = gpu_check.Budget(10.0, clock=lambda: 0.0)  # 10 s left, whatever the machine's speed
    gpu_check.run_checks(rep, {"nvtx", "trainer"}, torch.device("cpu"), "emulate", gpu_check.SIZES["dry"], budget,
                         tmp_path)
    written = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert written["nvtx"]["status"] == gpu_check.NEEDS_CUDA  # estimate 2 s: ran
    trainer = {n for n in written if n.startswith("trainer_")}
    assert trainer == {name for name, *_ in gpu_check.TRAINER_CASES}  # estimate 30 s each: skipped, recorded
    assert all(written[n]["status"] == gpu_check.OVER_BUDGET for n in trainer | {"host_syncs"})
    assert written["host_syncs"]["kind"] == "goal"


def test_the_watchdog_records_the_running_check_and_ends_the_run(tmp_path):
    from benchmarks import gpu_check
    rep = _report(tmp_path)
    rep.add("nvtx", "correctness", "pass")
    rep.start("trainer_zbv_fp32")
    exits = []
    timer = gpu_check.start_watchdog(rep, gpu_check.Budget(0.0, clock=lambda: 0.0), grace_s=0.0,
                                     exit_fn=exits.append)
    timer.join(30)
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert exits == [3] and written["status"] == "INCOMPLETE" and written["in_progress"] == "trainer_zbv_fp32"
    assert written["checks"]["nvtx"]["status"] == "pass"
    assert written["checks"]["trainer_zbv_fp32"]["status"] == "fail"
    assert "time budget" in written["checks"]["trainer_zbv_fp32"]["error"]


def _tiny_case():
    from benchmarks import gpu_check
    from engine.plan import build_plan
    sz = gpu_check.SIZES["dry"]
    plan = build_plan("interleaved", 2, sz["m"], 2)
    chunks = gpu_check.gpt_chunks(sz, 2, torch.device("cpu"))
    sample = [(torch.ones(sz["seq"], sz["mbs"], sz["hidden"], requires_grad=True),)
              for _ in range(2 * sz["m"] * sz["layers"])]
    return gpu_check, plan, chunks, sample


class HostSync(torch.nn.Module):
    """A layer with a host sync in its forward (illegal in a graph): the capture falls back to eager."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if x.sum().item() > 1e30:
            return x
        return self.inner(x)


def test_capture_wrapper_reports_a_silent_fallback():
    gpu_check, plan, chunks, sample = _tiny_case()
    chunks[1][0] = HostSync(chunks[1][0])
    layers, figures, failures = gpu_check.checked_capture(chunks, plan, 0, sample, "emulate", torch.device("cpu"),
                                                          None)
    layers.remove()
    assert figures["backend"] == "eager" and "HostSync" in figures["reason"], figures
    assert any("backend 'eager'" in f for f in failures) and any("pipecast.graphs logged" in f for f in failures)


def test_capture_wrapper_reports_a_changed_caller_state(monkeypatch):
    gpu_check, plan, chunks, sample = _tiny_case()
    real = gpu_check.capture

    def leaves_gc_off(*args, **kwargs):
        layers = real(*args, **kwargs)
        gc.disable()
        return layers

    monkeypatch.setattr(gpu_check, "capture", leaves_gc_off)
    try:
        layers, figures, failures = gpu_check.checked_capture(chunks, plan, 0, sample, "emulate",
                                                              torch.device("cpu"), None)
    finally:
        gc.enable()
    layers.remove()
    assert figures["backend"] == "emulate" and figures["caller_state"]["gc_enabled"] == "CHANGED"
    assert failures == ["caller's gc_enabled changed by the capture"]
