"""``benchmarks/gpu_check.py``, the one command of the first GPU run, kept from rotting on CPU.

* its ``--dry-run`` (emulate backend, tiny sizes) runs in a subprocess with the optional packages blocked (a
  ``sitecustomize`` on ``PYTHONPATH`` installs a meta-path finder raising ``ImportError`` for them, so the GPU
  machine's "torch, pytest, pyyaml, numpy and nothing else" is what it sees): exit 0 and every check in the JSON;
* a planted fault -- one emulated forward replay writes a perturbed output -- makes it exit 1, with exactly the
  perturbed check failing.  Both runs execute the script as ``__main__`` (``runpy``) one after the other in that
  one subprocess (one interpreter start and import of torch for both); the fault is planted between them;
* in process: a capture that silently falls back to eager, and one that leaves the caller's GC disabled, are
  reported as failures by the check's capture wrapper.
"""
from __future__ import annotations

import gc
import json
import os
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
import json, runpy, sys

script, clean_out, planted_out, codes_out = sys.argv[1:5]


def run(*args):
    sys.argv = [script, "--dry-run", *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # the script ends with sys.exit(main())
        return exc.code
    return None


codes = {"clean": run("--out", clean_out)}
from graphs.backends import emulate  # the planted fault: perturb the output of one emulated forward replay

original, calls = emulate.EmulatedSlot.replay_forward, [0]


def replay_forward(self):
    original(self)
    calls[0] += 1
    if calls[0] == 3:
        self.static_outputs[0].add_(1e-3)


emulate.EmulatedSlot.replay_forward = replay_forward
codes["planted"] = run("--checks", "graphs", "--out", planted_out)
with open(codes_out, "w") as f:
    json.dump(codes, f)
"""


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict:
    """``{"clean": (exit code, report), "planted": (exit code, report)}`` and the output of the one subprocess."""
    tmp_path = tmp_path_factory.mktemp("gpu_check")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), CUDA_VISIBLE_DEVICES="")
    outs = {name: tmp_path / f"gpu_check_{name}.json" for name in ("clean", "planted", "codes")}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT / "benchmarks" / "gpu_check.py"),
                           *(str(outs[n]) for n in ("clean", "planted", "codes"))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=420)
    codes = json.loads(outs["codes"].read_text()) if outs["codes"].exists() else {}
    runs = {name: (codes.get(name), json.loads(outs[name].read_text()) if outs[name].exists() else {})
            for name in ("clean", "planted")}
    return {**runs, "output": proc.stdout[-3000:] + proc.stderr[-3000:], "returncode": proc.returncode}


def _check_names() -> set[str]:
    from benchmarks.gpu_check import SCHEDULES
    graphs = {f"graphs_{s}_{d}" for s, _ in SCHEDULES for d in ("fp32", "bf16")}
    return graphs | {"cuda_tests", "split_memory", "capture_seconds", "trainer", "nvtx", "bench_bitwise",
                     "bench_launch_speedup", "bench_compute_ratio"}


@pytest.mark.slow
@pytest.mark.timeout(440)
def test_dry_run_passes_with_optional_packages_blocked(dry_runs):
    code, report = dry_runs["clean"]
    assert dry_runs["returncode"] == 0 and code == 0, dry_runs["output"]
    assert "is blocked" not in dry_runs["output"]
    checks = report["checks"]
    assert set(checks) == _check_names(), sorted(checks)
    assert report["status"] == "PASS" and report["dry_run"] and report["backend"] == "emulate"
    assert report["commit"] and report["torch"] == torch.__version__
    for name, c in checks.items():
        assert c["status"] in ("pass", "skipped: needs CUDA"), (name, c)
    for name in ("graphs_zbv_fp32", "graphs_zb_h1_bf16", "split_memory", "trainer", "bench_bitwise"):
        assert checks[name]["status"] == "pass", name
    assert checks["graphs_zbv_fp32"]["graph_vs_eager"]["bitwise"]
    assert checks["graphs_zbv_fp32"]["caller_state"]["gc_enabled"] == "unchanged"
    assert checks["cuda_tests"]["counts"]["skipped"] > 0  # the subprocess collected the cuda-marked tests


@pytest.mark.slow
@pytest.mark.timeout(440)
def test_a_perturbed_replay_fails_the_check(dry_runs):
    code, report = dry_runs["planted"]
    assert code == 1, dry_runs["output"]
    failed = {n for n, c in report["checks"].items() if c["status"] == "fail"}
    assert failed == {"graphs_interleaved_fp32"}, failed  # the first case holds the third replay
    assert not report["checks"]["graphs_interleaved_fp32"]["graph_vs_eager"]["bitwise"]


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
