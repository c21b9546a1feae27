"""One command for the first GPU run: ``PYTHONPATH=. python benchmarks/gpu_check.py`` checks the whole CUDA path.

Needs a CUDA build of torch (2.11 or newer), pytest, pyyaml and numpy -- nothing else (no pip, no network; nvtx,
tokenizers, safetensors, matplotlib, tqdm and Transformer Engine are never imported on this path).  About 3-5
minutes on one H200 (budget: 8); progress goes to stdout, everything to one JSON (``--out``, default
``benchmarks/results/gpu/gpu_check.json``): the git commit, torch / CUDA versions, the device name and every figure.

Checks (``kind`` correctness unless said otherwise), in order:

* ``cuda_tests``: ``pytest -m cuda`` on the test files with ``cuda``-marked tests, as a subprocess (counts);
* ``graphs_<schedule>_<dtype>``: the training GPT block (``engine.training.models.gpt2.layers.Block``, 2 model chunks x 2
  layers, or 1 chunk for ``zb_h1``) on pipeline rank 0 of ``interleaved``, ``zb_h1`` and ``zbv`` (pp = 2, M = 4),
  run in one process through ``graphs.local_rank`` with F and B graphs (plus W graphs for the split-backward
  schedules) against an eager copy over 3 SGD steps: losses, chunk-input gradients and parameter gradients.
  fp32: bitwise, with TF32 off, ``torch.use_deterministic_algorithms(True, warn_only=True)`` (the trainer's
  ``training.deterministic``) and SDPA pinned to its math backend (warn-only determinism keeps the memory-efficient
  kernel, whose backward accumulates with atomics: not even two eager runs would be bitwise).  bf16 autocast, with
  the SDPA kernel torch picks (flash): ``max |a - b| / max |a| <=`` :data:`BF16_TOLERANCE` per tensor (per step
  for the losses) -- 2**-6, four bf16 units in the last place, room for a flash backward's atomic accumulation
  order, far below what a wrong buffer gives (order 1).  ``eager_vs_eager`` (a second eager copy) is recorded next
  to it, so a kernel's nondeterminism can be told from a graph's fault;
* ``backend_ran`` / ``caller_state`` (part of every ``graphs_*`` check): the backend asked for is the one in the
  capture report, no fallback reason, no warning on the ``pipecast.graphs`` logger, the reported graph count;
  after capture the caller's current stream, GC enabled state, CPU and CUDA RNG states and sync-debug mode
  (set to ``warn`` for the capture, to see it restored) are what they were;
* ``split_memory``: zbv with F, B and W graphs at M = 4 and M = 16: ``torch.cuda.memory_allocated`` added by the
  capture, and ``graphs.accounting.held_bytes``.  Pass: the gradients B records for W (``weight_inputs``) do not
  grow with M (zbv on 2 ranks has 2 pending W per chunk at every M), and the allocated bytes grow by at most the
  per-microbatch static buffers' growth (+10 % + 64 MiB): what the capture holds is bounded by what is in flight;
* ``capture_seconds`` (goal): seconds per captured graph and the projection for ``configs/gpu_cuda_graphs.yaml``'s
  rank (128 graphs) against half its ``parallel.timeout_s`` (300 s);
* ``trainer``: ``engine.Trainer`` on one GPU (pipeline 1, virtual 2, ``zbv``, byte-level data from this Python's
  standard library, fp32, SDPA's math backend as above), graphs off and on (``torch`` backend): bitwise the same
  losses, graphs active after the warmup step;
* ``nvtx``: ``engine.profiling.nvtx_ranges.NvtxTracer`` opens a range without the ``nvtx`` package
  (``torch.cuda.nvtx``);
* ``bench_bitwise``: ``benchmarks/cuda_graphs_bench.py``'s own equality checks (launch and compute configs, bf16);
  ``bench_launch_speedup`` (goal >= 1.7x) and ``bench_compute_ratio`` (goal >= 0.99x): its eager / graph step time.

Exit status: 0 exactly when every correctness check passes (skipped ones do not count); goals are figures of the
machine (clocks, other tenants, driver), so a missed goal is printed and recorded (``goal_met: false``) but does not
change the exit status.  2: no CUDA device without ``--dry-run``.

``--dry-run`` runs the same steps on the CPU with the ``emulate`` backend (static-buffer semantics) and tiny sizes;
what needs CUDA (``cuda_tests``' execution, ``memory_allocated``, streams, sync-debug mode, the goals) is recorded
as ``"skipped: needs CUDA"``.  ``tests/project/test_gpu_check.py`` runs it with the optional packages blocked.

    PYTHONPATH=. python benchmarks/gpu_check.py [--out PATH] [--checks NAME,...] [--dry-run]
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from contextlib import nullcontext

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a plain checkout
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; must precede CUDA's start

import torch  # noqa: E402

from engine.plan import build_plan  # noqa: E402
from engine.training.config import ModelConfig  # noqa: E402
from engine.training.models.gpt2.layers import Block  # noqa: E402
from graphs import capture  # noqa: E402
from graphs.accounting import held_bytes  # noqa: E402
from graphs.local_rank import WeightQueue, make_rank_data, run_rank_step, sgd_step  # noqa: E402

BF16_TOLERANCE = 2.0 ** -6
MEMORY_SLACK = (0.10, 64 * 2 ** 20)  # relative, bytes
GOALS = {"bench_launch_speedup": 1.7, "bench_compute_ratio": 0.99}
CHECKS = ("cuda_tests", "graphs", "split_memory", "capture_seconds", "trainer", "nvtx", "bench")
SCHEDULES = (("interleaved", 2), ("zb_h1", 1), ("zbv", 2))  # schedule, model chunks per rank (pp = 2, rank 0)
SIZES = {  # the GPT block: hidden, heads, ffn, seq, micro batch, layers per chunk, microbatches
    "gpu": dict(hidden=1024, heads=16, ffn=4096, seq=1024, mbs=4, layers=2, m=4),
    "dry": dict(hidden=16, heads=2, ffn=32, seq=8, mbs=2, layers=2, m=4),
}
GPU_PRESET_GRAPHS, GPU_PRESET_TIMEOUT_S = 2 * 2 * 16 * 2, 300.0  # configs/gpu_cuda_graphs.yaml: rank 0's F+B graphs
NEEDS_CUDA = "skipped: needs CUDA"
QUIET = {"caller_state", "at", "schedule", "pp", "rank", "chunks", "microbatches", "reason", "note", "tail"}  # JSON only
log = logging.getLogger("pipecast.gpu_check")


class Report:
    """The checks so far; prints one progress line per check."""

    def __init__(self, dry: bool):
        self.dry, self.checks, self.t0 = dry, {}, time.perf_counter()

    def add(self, name: str, kind: str, status: str, **figures) -> dict:
        entry = {"kind": kind, "status": status, **figures}
        if kind == "goal" and status in ("pass", "fail"):
            entry["goal_met"] = status == "pass"
        self.checks[name] = entry
        shown = {k: v for k, v in figures.items() if k not in QUIET and ((k == "failures" and v) or (
            isinstance(v, dict) and len(v) <= 5) or not isinstance(v, (dict, list)))}
        print(f"[gpu_check {time.perf_counter() - self.t0:6.1f}s] {name}: {status.upper()} "
              f"{json.dumps(shown, default=str)}", flush=True)
        return entry

    def check(self, name: str, ok: bool, **figures) -> dict:
        return self.add(name, "correctness", "pass" if ok else "fail", **figures)

    def goal(self, name: str, value, goal: float, **figures) -> dict:
        if self.dry or value is None:
            return self.add(name, "goal", NEEDS_CUDA, value=value, goal=goal, **figures)
        return self.add(name, "goal", "pass" if value >= goal else "fail", value=value, goal=goal, **figures)

    @property
    def correct(self) -> bool:
        return all(c["status"] != "fail" for c in self.checks.values() if c["kind"] == "correctness")


# -- environment ----------------------------------------------------------------------------------------------
def environment(dry: bool) -> dict:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
    cuda = torch.cuda.is_available()
    return {"commit": commit.stdout.strip() or None, "dirty": bool(dirty.stdout.strip()), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "python": platform.python_version(),
            "dry_run": dry, "backend": "emulate" if dry else "torch", "bf16_tolerance": BF16_TOLERANCE}


def exact_attention(on: bool):
    """SDPA pinned to its math backend (deterministic forward and backward) when ``on``."""
    if not on:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.MATH])


def set_determinism() -> None:
    """The trainer's deterministic settings (``training.deterministic``) and no TF32."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# -- a. the cuda-marked tests ---------------------------------------------------------------------------------
def cuda_test_files() -> list[str]:
    """Test files that mark tests ``cuda`` (only those are collected: the rest of the suite needs extras)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.cuda" in p.read_text(encoding="utf-8"))


def check_cuda_tests(rep: Report, dry: bool) -> None:
    files = cuda_test_files()
    # no auto-loaded plugins: the run sees what a machine with only pytest has
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *files]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"timed out after {exc.timeout}s: {exc.stdout or ''}", -1
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
              for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors|error|deselected)", out)}
    figures = dict(files=files, returncode=rc, counts=counts, seconds=round(time.perf_counter() - t0, 1),
                   tail=out.strip().splitlines()[-15 if rc else -1:])  # the summary line; more on a failure
    if dry:  # the subprocess ran (so the files collect); every test skips without CUDA
        ok = rc == 0 and counts.get("skipped", 0) > 0 and not counts.get("failed") and not counts.get("error")
        rep.add("cuda_tests", "correctness", NEEDS_CUDA if ok else "fail", **figures)
        return
    rep.check("cuda_tests", rc == 0 and counts.get("passed", 0) > 0 and not counts.get("failed")
              and not counts.get("error"), **figures)


# -- b, c, e: the GPT block with graphs against eager ---------------------------------------------------------
def gpt_chunks(sz: dict, num_chunks: int, device, seed: int = 0):
    cfg = ModelConfig(num_layers=sz["layers"] * num_chunks, hidden_size=sz["hidden"],
                      num_attention_heads=sz["heads"], seq_length=sz["seq"])
    torch.manual_seed(seed)
    return [[Block(cfg, sz["ffn"]).to(device) for _ in range(sz["layers"])] for _ in range(num_chunks)]


def caller_state(device) -> dict:
    cuda = device.type == "cuda"
    return {"gc_enabled": gc.isenabled(), "cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if cuda else NEEDS_CUDA,
            "stream": torch.cuda.current_stream() if cuda else NEEDS_CUDA,
            "sync_debug_mode": torch.cuda.get_sync_debug_mode() if cuda else NEEDS_CUDA}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def checked_capture(chunks, plan, rank: int, sample, backend: str, device, queue) -> tuple:
    """``capture`` with the caller's state compared before and after, and the fallback log read.

    Returns ``(layers, figures, failures)``."""
    cuda = device.type == "cuda"
    previous_mode = torch.cuda.get_sync_debug_mode() if cuda else None
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")  # a non-default mode, to see the capture restore it
    before, records = caller_state(device), _Records()
    logging.getLogger("pipecast.graphs").addHandler(records)
    try:
        layers = capture(chunks, plan, rank, sample, backend=backend,
                         defer_weight_grad=queue.defer if plan.splits_backward else None)
        if cuda:
            torch.cuda.synchronize()
        after = caller_state(device)
    finally:
        logging.getLogger("pipecast.graphs").removeHandler(records)
        if cuda:
            torch.cuda.set_sync_debug_mode(previous_mode)
    report = layers.report
    per_graph = 3 if plan.splits_backward else 2
    figures = {"backend": report.backend, "reason": report.reason, "graph_sets": report.num_graphs,
               "graphs": report.num_graphs * per_graph, "capture_s": round(report.seconds, 3),
               "fallback_log": records.lines,
               "caller_state": {k: NEEDS_CUDA if isinstance(before[k], str) else
                                "unchanged" if _same(before[k], after[k]) else "CHANGED" for k in before}}
    expected_sets = sum(len(c) for c in chunks) * plan.num_microbatches
    failures = [f"backend {report.backend!r}, not {backend!r} ({report.reason})"] if report.backend != backend else []
    failures += [f"graph sets {report.num_graphs} != {expected_sets}"] if report.num_graphs != expected_sets else []
    failures += [f"pipecast.graphs logged: {line}" for line in records.lines]
    failures += [f"caller's {k} changed by the capture" for k, v in figures["caller_state"].items() if v == "CHANGED"]
    states = figures["caller_state"].values()
    figures["caller"] = ("unchanged" if "CHANGED" not in states else "CHANGED") + (
        f" ({sum(v == NEEDS_CUDA for v in states)} of {len(before)} {NEEDS_CUDA})" if not cuda else "")
    return layers, figures, failures


class CountingQueue(WeightQueue):
    """The one-process split backward's ``W`` queue, counting the ``W`` replays the ``B`` replays defer."""

    deferred = 0

    def defer(self, run) -> bool:
        queued = super().defer(run)
        self.deferred += bool(queued)
        return queued


def train_steps(chunks, plan, rank, data, steps: int, weights, autocast) -> list:
    out = []
    for _ in range(steps):
        with autocast():
            r = run_rank_step(chunks, plan, rank, data, weights=weights)
        grads = [p.grad.clone() for chunk in chunks for layer in chunk for p in layer.parameters()]
        out.append([torch.stack(list(r.losses.values())), *r.input_grads.values(), *grads])
        sgd_step(chunks)
    return out


def compare(ref: list, got: list) -> dict:
    """Bitwise flag and the largest ``max |a - b| / max |a|`` over the step's losses (one tensor: a surrogate
    loss can be near zero) and every gradient of every step."""
    bitwise, worst = True, 0.0
    for a_step, b_step in zip(ref, got):
        for a, b in zip(a_step, b_step):
            if not torch.equal(a, b):
                bitwise = False
                worst = max(worst, (a.float() - b.float()).abs().max().item() / (a.float().abs().max().item() or 1.0))
    return {"bitwise": bitwise and len(ref) == len(got), "max_rel_diff": worst}


def _autocast(device, dtype):
    if dtype == torch.float32:
        return lambda: torch.autocast(device.type, enabled=False)
    return lambda: torch.autocast(device.type, dtype=dtype)


def graphs_case(rep: Report, schedule: str, num_chunks: int, dtype, sz: dict, device, backend: str,
                steps: int = 3) -> dict:
    """One ``graphs_<schedule>_<dtype>`` check (see the module docstring)."""
    plan, rank, m = build_plan(schedule, 2, sz["m"], num_chunks), 0, sz["m"]
    eager = gpt_chunks(sz, num_chunks, device)
    graphed, again = copy.deepcopy(eager), copy.deepcopy(eager)
    data = make_rank_data(num_chunks, m, (sz["seq"], sz["mbs"], sz["hidden"]), device=device)
    queue = CountingQueue() if plan.splits_backward else None
    sample = [(torch.ones(sz["seq"], sz["mbs"], sz["hidden"], device=device, requires_grad=True),)
              for _ in range(num_chunks * m * sz["layers"])]
    autocast, fp32 = _autocast(device, dtype), dtype == torch.float32
    with exact_attention(fp32):
        with autocast():
            layers, figures, failures = checked_capture(graphed, plan, rank, sample, backend, device, queue)
        ref = train_steps(eager, plan, rank, data, steps, None, autocast)
        got = train_steps(graphed, plan, rank, data, steps, queue, autocast)
        figures["graph_vs_eager"] = diff = compare(ref, got)
        figures["eager_vs_eager"] = compare(ref, train_steps(again, plan, rank, data, steps, None, autocast))
    figures["criterion"] = "bitwise" if fp32 else f"max_rel_diff <= {BF16_TOLERANCE:g}"
    if not (diff["bitwise"] if fp32 else diff["max_rel_diff"] <= BF16_TOLERANCE):
        failures.append(f"graphs vs eager: {diff}")
    if queue is not None:  # every graphed layer's B deferred its W replay, every W action ran it
        figures["w_replays_per_step"] = queue.deferred / steps
        if queue.deferred != steps * figures["graph_sets"] or queue.pending:
            failures.append(f"W replays: {queue.deferred} deferred in {steps} steps (expected "
                            f"{steps * figures['graph_sets']}), left queued: {sorted(queue.pending)}")
    figures["failures"] = failures
    layers.remove()
    name = f"graphs_{schedule}_{'fp32' if fp32 else 'bf16'}"
    return rep.check(name, not failures, schedule=schedule, pp=2, rank=rank, chunks=num_chunks,
                     microbatches=m, **figures)


# -- d: split-graph memory at M = 4 and M = 16 -----------------------------------------------------------------
def split_memory_at(sz: dict, m: int, device, backend: str) -> dict:
    plan = build_plan("zbv", 2, m, 2)
    chunks = gpt_chunks(sz, 2, device)
    cuda = device.type == "cuda"
    sample = [(torch.ones(sz["seq"], sz["mbs"], sz["hidden"], device=device, requires_grad=True),)
              for _ in range(2 * m * sz["layers"])]
    if cuda:  # after the sample arguments: what the capture adds (they may become static inputs: a looser bound)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    layers = capture(chunks, plan, 0, sample, backend=backend, defer_weight_grad=WeightQueue().defer)
    out = {"active": layers.active, "backend": layers.report.backend, "reason": layers.report.reason,
           "capture_s": round(layers.report.seconds, 3), "graphs": 3 * layers.report.num_graphs,
           "held_bytes": held_bytes(layers.graphs) if layers.active else None}
    if cuda:
        torch.cuda.synchronize()
        out["allocated_by_capture"] = torch.cuda.memory_allocated() - base
    layers.remove()
    del layers, chunks, sample
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def check_split_memory(rep: Report, sz: dict, device, backend: str) -> list[dict]:
    at = {m: split_memory_at(sz, m, device, backend) for m in (4, 16)}
    failures = [f"M={m}: capture fell back ({r['reason']})" for m, r in at.items() if not r["active"]]
    figures: dict = {"schedule": "zbv", "pp": 2, "chunks": 2, "layers_per_chunk": sz["layers"], "at": at}
    if not failures:
        h4, h16 = at[4]["held_bytes"], at[16]["held_bytes"]
        figures["weight_inputs_bytes"] = {4: h4["weight_inputs"], 16: h16["weight_inputs"]}
        if h16["weight_inputs"] != h4["weight_inputs"]:
            failures.append(f"B's recorded gradients for W grow with M: {h4['weight_inputs']} -> "
                            f"{h16['weight_inputs']} bytes")
        static_growth = (h16["total"] - h16["weight_inputs"]) - (h4["total"] - h4["weight_inputs"])
        if device.type == "cuda":
            growth = at[16]["allocated_by_capture"] - at[4]["allocated_by_capture"]
            bound = static_growth * (1 + MEMORY_SLACK[0]) + MEMORY_SLACK[1]
            figures.update(allocated_mib={m: round(r["allocated_by_capture"] / 2 ** 20, 1) for m, r in at.items()},
                           allocated_growth_mib=round(growth / 2 ** 20, 1), bound_mib=round(bound / 2 ** 20, 1))
            if growth > bound:
                failures.append(f"memory_allocated grows by {growth / 2 ** 20:.1f} MiB from M=4 to M=16, more than "
                                f"the per-microbatch static buffers' {static_growth / 2 ** 20:.1f} MiB (+slack)")
        else:
            figures["allocated_mib"] = NEEDS_CUDA
    figures["failures"] = failures
    rep.check("split_memory", not failures, **figures)
    return list(at.values())


def check_capture_seconds(rep: Report, captures: list[dict]) -> None:
    graphs = sum(c["graphs"] for c in captures)
    seconds = sum(c["capture_s"] for c in captures)
    per_graph = seconds / graphs if graphs else None
    projected = per_graph * GPU_PRESET_GRAPHS if per_graph is not None else None
    ratio = GPU_PRESET_TIMEOUT_S / 2 / projected if projected else None
    rep.goal("capture_seconds", round(ratio, 2) if ratio else None, 1.0, captures=len(captures), graphs=graphs, seconds=round(seconds, 2),
             seconds_per_graph=round(per_graph, 4) if per_graph else None,
             projected_gpu_preset_s=round(projected, 1) if projected else None,
             note="value: half of configs/gpu_cuda_graphs.yaml's parallel.timeout_s over its projected capture")


# -- f: the trainer on one device ------------------------------------------------------------------------------
def trainer_run(run_dir: str, graphs: bool, device, backend: str, steps: int, sz: dict) -> dict:
    from engine import Trainer
    from engine.training.config import load_config
    overrides = {"model.num_layers": 2 * sz["layers"], "model.hidden_size": sz["hidden"],
                 "model.num_attention_heads": sz["heads"], "model.seq_length": sz["seq"],
                 "data.max_bytes": 200_000, "training.micro_batch_size": sz["mbs"],
                 "training.num_microbatches": sz["m"], "training.steps": steps, "training.eval_interval": 0,
                 "logging.progress_bar": False, "logging.level": "WARNING", "logging.run_dir": run_dir,
                 "parallel.pipeline": 1, "parallel.virtual": 2, "parallel.schedule": "zbv",
                 "parallel.device": device.type, "cuda_graphs.enabled": graphs, "cuda_graphs.warmup_steps": 1}
    config = load_config(None, overrides)
    losses, active = [], []
    with Trainer(config) as trainer:
        trainer.config.cuda_graphs.backend = backend  # emulate is test-only: set after validation
        for _ in range(steps):
            losses.append(trainer.train_step()["loss"])
            runtime = getattr(trainer, "_graphs", None)
            active.append(bool(runtime is not None and runtime.active))
        report = runtime.layers.report if runtime is not None else None
        return {"losses": losses, "active": active, "backend": report.backend if report else None,
                "reason": report.reason if report else None}  # Trainer.close releases the graphs


def check_trainer(rep: Report, device, backend: str, sz: dict, steps: int = 4) -> None:
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp, exact_attention(True):
        off = trainer_run(f"{tmp}/off", False, device, backend, steps, sz)
        on = trainer_run(f"{tmp}/on", True, device, backend, steps, sz)
    failures = [] if on["losses"] == off["losses"] else ["losses differ with graphs on"]
    if on["active"] != [False] + [True] * (steps - 1) or on["backend"] != backend:
        failures.append(f"graphs not active after the warmup step: {on['active']} backend={on['backend']} "
                        f"({on['reason']})")
    rep.check("trainer", not failures, pipeline=1, virtual=2, schedule="zbv", precision="fp32",
              losses_off=off["losses"], losses_on=on["losses"], active=on["active"], backend=on["backend"],
              failures=failures)


# -- NVTX ranges without the nvtx package --------------------------------------------------------------------------
def check_nvtx(rep: Report, device) -> None:
    """``engine.profiling.nvtx_ranges.NvtxTracer("auto")`` uses the ``nvtx`` package when installed, else
    ``torch.cuda.nvtx``: one range pushed and popped (without CUDA and without the package it must say so)."""
    from engine.profiling.nvtx_ranges import NvtxTracer
    if device.type != "cuda":
        try:
            NvtxTracer()
        except RuntimeError as exc:  # no package, no CUDA: the documented error
            rep.add("nvtx", "correctness", NEEDS_CUDA, error=str(exc))
            return
        rep.add("nvtx", "correctness", NEEDS_CUDA, backend="nvtx package")
        return
    tracer = NvtxTracer()
    with tracer.span("compute", "F0.0"):
        torch.cuda.synchronize()
    rep.check("nvtx", tracer.backend in ("nvtx", "torch"), backend=tracer.backend)


# -- g: benchmarks/cuda_graphs_bench.py -------------------------------------------------------------------------
def check_bench(rep: Report, dry: bool) -> None:
    from benchmarks import cuda_graphs_bench
    with tempfile.TemporaryDirectory(prefix="gpu_check_bench_") as tmp:
        path = Path(tmp) / "bench.json"
        threads = torch.get_num_threads()
        torch.use_deterministic_algorithms(False)  # as the bench runs on its own (no NaN fill of every empty)
        try:
            rc = cuda_graphs_bench.main(["--json", str(path), "--memory", "", "--no-te"])
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(True, warn_only=True)
        result = json.loads(path.read_text())
    configs = result["configs"]
    rep.check("bench_bitwise", rc == 0, returncode=rc, configs=sorted(configs),
              graph_vs_eager={k: v.get("graph_vs_eager") for k, v in configs.items()})
    launch, compute = configs.get("launch", {}).get("speedup"), configs.get("compute", {}).get("speedup")
    rep.goal("bench_launch_speedup", launch, GOALS["bench_launch_speedup"],
             eager_ms=configs.get("launch", {}).get("eager_ms"), graph_ms=configs.get("launch", {}).get("graph_ms"),
             dry_run_speedup=configs.get("cpu_tiny", {}).get("speedup"))
    rep.goal("bench_compute_ratio", compute, GOALS["bench_compute_ratio"],
             eager_ms=configs.get("compute", {}).get("eager_ms"),
             graph_ms=configs.get("compute", {}).get("graph_ms"))


# -- driver ------------------------------------------------------------------------------------------------------
def run_checks(rep: Report, selected: set[str], device, backend: str, sz: dict) -> None:
    captures: list[dict] = []
    steps = [("cuda_tests", lambda: check_cuda_tests(rep, rep.dry))]
    for schedule, chunks in SCHEDULES:
        for dtype in (torch.float32, torch.bfloat16):
            steps.append(("graphs", lambda s=schedule, c=chunks, d=dtype:
                          captures.append(graphs_case(rep, s, c, d, sz, device, backend))))
    steps += [("split_memory", lambda: captures.extend(check_split_memory(rep, sz, device, backend))),
              ("capture_seconds", lambda: check_capture_seconds(rep, captures)),
              ("trainer", lambda: check_trainer(rep, device, backend, sz)),
              ("nvtx", lambda: check_nvtx(rep, device)),
              ("bench", lambda: check_bench(rep, rep.dry))]
    for name, step in steps:
        if name not in selected:
            continue
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - record the error, keep going, always write the JSON
            import traceback
            rep.add(f"{name}_error_{len(rep.checks)}", "correctness", "fail", error=f"{type(exc).__name__}: {exc}",
                    traceback=traceback.format_exc().splitlines()[-12:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="the JSON report (default benchmarks/results/gpu/gpu_check.json; "
                    "with --dry-run gpu_check_dry_run.json beside it, so a CPU run never replaces a GPU report)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, emulate backend, tiny sizes; what needs CUDA is recorded as skipped")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(ROOT / "benchmarks" / "results" / "gpu" /
                       ("gpu_check_dry_run.json" if args.dry_run else "gpu_check.json"))
    selected = {c.strip() for c in args.checks.split(",") if c.strip()}
    if selected - set(CHECKS):
        ap.error(f"--checks: unknown {sorted(selected - set(CHECKS))}; use {', '.join(CHECKS)}")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch %s, CUDA build %s); run on a GPU, or use --dry-run"
              % (torch.__version__, torch.version.cuda), file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        torch.set_num_threads(1)
    set_determinism()
    rep = Report(args.dry_run)
    env = environment(args.dry_run)
    if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 11):
        print(f"[gpu_check] warning: torch {torch.__version__} is older than the 2.11 this check is written for")
    print(f"[gpu_check] {json.dumps(env)}", flush=True)
    run_checks(rep, selected, device, env["backend"], SIZES["dry" if args.dry_run else "gpu"])
    ok = rep.correct
    report = {**env, "status": "PASS" if ok else "FAIL", "seconds": round(time.perf_counter() - rep.t0, 1),
              "goals": GOALS, "checks": rep.checks}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    failed = [n for n, c in rep.checks.items() if c["status"] == "fail" and c["kind"] == "correctness"]
    missed = [n for n, c in rep.checks.items() if c["kind"] == "goal" and c["status"] == "fail"]
    print(f"[gpu_check] {report['status']} in {report['seconds']}s: {len(rep.checks)} checks; failed: "
          f"{', '.join(failed) or 'none'}; goals missed (not in the exit status): {', '.join(missed) or 'none'}; "
          f"wrote {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
