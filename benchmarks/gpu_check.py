"""One command for the first GPU run: ``PYTHONPATH=. python benchmarks/gpu_check.py --out DIR`` checks the CUDA path.

Needs a CUDA build of torch (2.11 or newer), pytest, pyyaml and numpy -- nothing else (no pip, no network; nvtx,
tokenizers, safetensors, matplotlib, tqdm and Transformer Engine are never required on this path).  Fits one call of
at most 8 minutes on one H200: a global time budget (``--budget-s``, default :data:`BUDGET_S`) skips a check whose
estimate (:data:`ESTIMATE_S`) exceeds the time left (recorded as ``"skipped: time budget"``), and a watchdog
records the check still running when the budget (plus :data:`WATCHDOG_GRACE_S`) is spent and exits 3.

Never dies without its JSON: ``DIR/gpu_check.json`` (``--out``: a folder, e.g. outside the repository; a path ending
in ``.json`` is the file itself; default ``benchmarks/results/gpu/``) is rewritten (temporary file, then rename)
before and after every check -- ``status`` is ``INCOMPLETE`` and ``in_progress`` names the running check until the
end, so a crash or a kill leaves every finished check and the one that died; SIGTERM records itself too.  External
commands (``git``, ``nvidia-smi``, the pytest subprocess) never raise: a missing binary, a non-zero exit or a
timeout is recorded under ``commands``.  ``cuda_graphs_bench.json`` is written beside it.

Checks (``kind`` correctness unless said otherwise), in order:

* ``graphs_<schedule>_<dtype>``: the training GPT block (``engine.training.models.gpt2.layers.Block``, 2 model chunks x
  2 layers, or 1 chunk for ``zb_h1``) on pipeline rank 0 of ``interleaved``, ``zb_h1`` and ``zbv`` (pp = 2, M = 4),
  run in one process through ``graphs.local_rank`` with F and B graphs (plus W graphs for the split-backward
  schedules) against an eager copy over 3 SGD steps: losses, chunk-input gradients and parameter gradients.
  fp32 and bf16 autocast: bitwise, with TF32 off, ``torch.use_deterministic_algorithms(True, warn_only=True)`` (the
  trainer's ``training.deterministic``) and SDPA pinned to its math backend.  Warn-only determinism keeps the
  fused attention kernels (cuDNN, memory-efficient), whose backward accumulates with atomics, and the key bias's
  gradient is zero in exact arithmetic (softmax is shift-invariant), so in floating point it is rounding noise:
  with those kernels two eager bf16 runs differed by more than that gradient's own size (the first H200 run), and
  no tolerance separates a fault from noise.  ``eager_vs_eager`` (a second eager copy) is recorded next to it, so
  a kernel's nondeterminism can be told from a graph's fault.  Part of each: ``backend_ran`` /
  ``caller_state`` -- the backend asked for is the one in the capture report, no fallback, no warning on the
  ``pipecast.graphs`` logger; after capture the caller's stream, GC state, CPU and CUDA RNG states and sync-debug
  mode (set to ``warn`` for the capture, to see it restored) are what they were;
* ``dropout_rng``: the block with dropout 0.1 (residual and attention), interleaved, fp32, no weight update between
  three steps; each copy reseeded (seeds 11, 12), then continuing from its own RNG state.  Pass: graphs bitwise
  equal to eager at every step (CUDA: graph-safe philox offsets of the default generator, registered with every
  graph; ``emulate``: replays draw from the generator as eager does), the RNG state after each step equal to
  eager's, and the three steps' losses all different (the masks change from step to step, pytorch#84614);
* ``split_memory``: zbv with F, B and W graphs at M = 4 and M = 16: the bytes the graph pool reserves
  (``graphs.accounting.pool_bytes``: CUDA, the caching allocator's segments of the graphs' private pool,
  ``torch.cuda.memory_snapshot`` filtered by the pool id; emulate, its model of the pool: the peak of the bytes its
  capture walk keeps alive) and, on CUDA, ``memory_reserved`` added by the capture, against ``held_bytes`` (the
  static buffers).  Pass: B's recorded gradients for W do not grow with M, and pool and reserved bytes grow by at
  most the per-microbatch static buffers' growth (+:data:`MEMORY_SLACK`): what the capture holds is bounded by what
  is in flight, so activations kept for every microbatch fail it;
* ``capture_seconds`` (goal): seconds per captured graph and the projection for ``configs/gpu_cuda_graphs.yaml``'s
  rank (128 graphs) against half its ``parallel.timeout_s`` (300 s);
* ``trainer_<case>``: ``engine.Trainer`` (byte-level data from this Python's standard library, SDPA's math backend)
  with graphs off and on (``torch`` backend; ``emulate`` in the dry run): the same losses (bitwise in fp32, within
  :data:`BF16_TOLERANCE` in bf16), graphs active after the warmup step -- zbv and 1f1b on one device (1f1b: one
  graph per layer shared by the microbatches), 1f1b in bf16, with ``model.recompute: full`` (also under zbv,
  where the recomputed block's weight gradients are written inside its ``B`` graph; each ``"not available in
  this build"`` while the config refuses the field), and interleaved on two pipeline ranks (spawned,
  one per device: skipped with fewer devices -- NCCL refuses two ranks on one GPU -- and in the dry run);
* ``host_syncs`` (goal 0): synchronising CUDA calls during one non-logging training step with graphs
  (``torch.cuda.set_sync_debug_mode("warn")``; the places they come from are listed);
* ``nvtx``: ``engine.profiling.nvtx_ranges.NvtxTracer`` opens a range without the ``nvtx`` package;
* ``cuda_tests``: ``pytest -m cuda`` on the test files with ``cuda``-marked tests, as a subprocess (counts);
* ``bench_bitwise``: ``benchmarks/cuda_graphs_bench.py``'s own equality checks (launch and compute configs, bf16);
  ``bench_launch_speedup`` (goal >= 1.7x) and ``bench_compute_ratio`` (goal >= 0.99x): its eager / graph step time.

Exit status: 0 exactly when every correctness check passes (skipped ones do not count); goals are figures of the
machine (clocks, other tenants, driver), so a missed goal is printed and recorded (``goal_met: false``) but does not
change the exit status.  2: no CUDA device without ``--dry-run``; 3: the watchdog stopped the run.

``--dry-run`` runs the same steps on the CPU with the ``emulate`` backend (static-buffer semantics) and tiny sizes;
what needs CUDA (``cuda_tests``' execution, reserved bytes, streams, sync-debug mode, the goals) is recorded as
``"skipped: needs CUDA"``.  ``tests/project/test_gpu_check.py`` runs it with the optional packages blocked.

    PYTHONPATH=. python benchmarks/gpu_check.py [--out DIR] [--checks NAME,...] [--budget-s S] [--dry-run]
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import logging
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a plain checkout
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; must precede CUDA's start

import torch  # noqa: E402

from engine.plan import build_plan  # noqa: E402
from engine.training.config import ModelConfig  # noqa: E402
from engine.training.models.gpt2.layers import Block  # noqa: E402
from graphs import capture  # noqa: E402
from graphs.accounting import held_bytes, pool_bytes  # noqa: E402
from graphs.local_rank import WeightQueue, make_rank_data, run_rank_step, sgd_step  # noqa: E402

BF16_TOLERANCE = 2.0 ** -6
MEMORY_SLACK = {"cuda": (0.10, 64 * 2 ** 20), "cpu": (0.10, 0)}  # relative, bytes (CUDA: allocator rounding)
GOALS = {"bench_launch_speedup": 1.7, "bench_compute_ratio": 0.99, "host_syncs": 0}
BUDGET_S = 390.0  # of the 480 s one device call may take: imports, CUDA start and the watchdog's grace come on top
WATCHDOG_GRACE_S = 20.0
CHECKS = ("graphs", "dropout", "split_memory", "capture_seconds", "trainer", "nvtx", "cuda_tests", "bench")
# seconds a check is expected to take on one H200 (a generous guess: nothing here has run on a GPU yet); a check
# starts only while the budget has this much left
ESTIMATE_S = {"graphs": 20, "dropout": 20, "split_memory": 45, "capture_seconds": 0, "trainer": 30, "nvtx": 2,
              "cuda_tests": 90, "bench": 100}
SCHEDULES = (("interleaved", 2), ("zb_h1", 1), ("zbv", 2))  # schedule, model chunks per rank (pp = 2, rank 0)
SIZES = {  # the GPT block: hidden, heads, ffn, seq, micro batch, layers per chunk, microbatches
    "gpu": dict(hidden=1024, heads=16, ffn=4096, seq=1024, mbs=4, layers=2, m=4),
    "dry": dict(hidden=16, heads=2, ffn=32, seq=8, mbs=2, layers=2, m=4),
}
ONE_RANK = {"parallel.pipeline": 1, "parallel.virtual": 1, "parallel.schedule": "1f1b"}
TRAINER_CASES = (  # name, overrides, the overrides' fields this build may lack, counts host syncs
    ("trainer_zbv_fp32", {"parallel.pipeline": 1, "parallel.virtual": 2, "parallel.schedule": "zbv"}, (), False),
    ("trainer_1f1b_fp32", ONE_RANK, (), True),
    ("trainer_1f1b_bf16", {**ONE_RANK, "model.precision": "bf16"}, ("model.precision",), False),
    ("trainer_1f1b_recompute", {**ONE_RANK, "model.recompute": "full"}, ("model.recompute",), False),
    ("trainer_zbv_recompute", {"parallel.pipeline": 1, "parallel.virtual": 2, "parallel.schedule": "zbv",
                               "model.recompute": "full"}, ("model.recompute",), False),
    ("trainer_interleaved_pp2_fp32", {"parallel.pipeline": 2, "parallel.virtual": 2,
                                      "parallel.schedule": "interleaved"}, (), False),
)
GPU_PRESET_GRAPHS, GPU_PRESET_TIMEOUT_S = 2 * 2 * 16 * 2, 300.0  # configs/gpu_cuda_graphs.yaml: rank 0's F+B graphs
NEEDS_CUDA = "skipped: needs CUDA"
OVER_BUDGET = "skipped: time budget"
NOT_AVAILABLE = "not available in this build"
QUIET = {"caller_state", "at", "schedule", "pp", "rank", "chunks", "microbatches", "reason", "note", "tail",
         "traceback", "losses_off", "losses_on", "where"}  # JSON only
log = logging.getLogger("pipecast.gpu_check")


# -- the report, written after every change ------------------------------------------------------------------------
class Report:
    """The checks so far, rewritten to ``path`` (temporary file, then rename) whenever one starts or ends; prints
    one progress line per check.  Thread-safe: the watchdog and the SIGTERM handler write through :meth:`abort`."""

    def __init__(self, path: Path, dry: bool, env: dict, budget_s: float):
        self.path, self.dry, self.env, self.budget_s = Path(path), dry, env, budget_s
        self.checks: dict[str, dict] = {}
        self.in_progress: str | None = None
        self.done = False
        self.t0 = time.perf_counter()
        self._lock = threading.RLock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def start(self, name: str) -> None:
        with self._lock:
            self.in_progress = name
            self.write()

    def add(self, name: str, kind: str, status: str, **figures) -> dict:
        entry = {"kind": kind, "status": status, **figures}
        if kind == "goal" and status in ("pass", "fail"):
            entry["goal_met"] = status == "pass"
        with self._lock:
            self.checks[name] = entry
            self.write()
        shown = {k: v for k, v in figures.items() if k not in QUIET and ((k == "failures" and v) or (
            isinstance(v, dict) and len(v) <= 5) or not isinstance(v, (dict, list)))}
        print(f"[gpu_check {time.perf_counter() - self.t0:6.1f}s] {name}: {status.upper()} "
              f"{json.dumps(shown, default=str)}", flush=True)
        return entry

    def check(self, name: str, ok: bool, **figures) -> dict:
        return self.add(name, "correctness", "pass" if ok else "fail", **figures)

    def goal(self, name: str, value, goal: float, higher_is_better: bool = True, **figures) -> dict:
        if self.dry or value is None or isinstance(value, str):
            return self.add(name, "goal", NEEDS_CUDA, value=value, goal=goal, **figures)
        met = value >= goal if higher_is_better else value <= goal
        return self.add(name, "goal", "pass" if met else "fail", value=value, goal=goal, **figures)

    @property
    def correct(self) -> bool:
        return all(c["status"] != "fail" for c in self.checks.values() if c["kind"] == "correctness")

    def abort(self, why: str) -> None:
        """Record the running check (or the run) as failed with ``why`` and write, from any thread."""
        with self._lock:
            name = self.in_progress or "run"
            self.checks[name] = {"kind": "correctness", "status": "fail", "error": why}
            self.write()

    def finish(self) -> None:
        with self._lock:
            self.done, self.in_progress = True, None
            self.write()

    def write(self) -> None:
        with self._lock:
            status = ("PASS" if self.correct else "FAIL") if self.done else "INCOMPLETE"
            payload = {**self.env, "status": status, "seconds": round(time.perf_counter() - self.t0, 1),
                       "budget_s": self.budget_s, "in_progress": self.in_progress, "goals": GOALS,
                       "checks": self.checks}
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(payload, indent=1, default=str))
            os.replace(tmp, self.path)


class Budget:
    """The run's time budget (seconds from its creation; ``clock`` replaceable in tests)."""

    def __init__(self, seconds: float, clock=time.perf_counter):
        self.seconds, self.clock, self.start = seconds, clock, clock()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)

    def allows(self, estimate_s: float) -> bool:
        return estimate_s <= self.left()


def start_watchdog(rep: Report, budget: Budget, grace_s: float = WATCHDOG_GRACE_S, exit_fn=os._exit):
    """A daemon timer that, when the budget plus ``grace_s`` is spent, records the running check as killed, writes
    the JSON and ends the process with status 3 (``exit_fn``; tests pass their own).  Returns the timer."""
    def fire():
        rep.abort(f"killed: the time budget (--budget-s {budget.seconds:g} + {grace_s:g} s grace) ran out while "
                  f"this check was running")
        print(f"[gpu_check] time budget exhausted during {rep.in_progress or 'the run'}; wrote {rep.path}",
              file=sys.stderr, flush=True)
        exit_fn(3)

    timer = threading.Timer(max(0.0, budget.left()) + grace_s, fire)
    timer.daemon = True
    timer.start()
    return timer


# -- external commands: recorded, never raised ---------------------------------------------------------------------
def run_command(cmd: list[str], timeout_s: float = 30.0, env: dict | None = None) -> dict:
    """Run ``cmd`` in the repository; never raises.  ``{"cmd", "returncode", "stdout", "stderr"}``, or
    ``{"cmd", "error"}`` for a missing binary, a timeout (with the output so far) or another OS error."""
    shown = " ".join(cmd)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, timeout_s))
    except FileNotFoundError:
        return {"cmd": shown, "error": f"{cmd[0]}: not found (PATH={os.environ.get('PATH', '')!r})"}
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"cmd": shown, "error": f"timed out after {timeout_s:.0f}s", "stdout": out}
    except OSError as exc:
        return {"cmd": shown, "error": f"{type(exc).__name__}: {exc}"}
    return {"cmd": shown, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr[-2000:]}


def _brief(result: dict) -> dict:
    """A command's result for the JSON: its error, or its exit status and first lines."""
    if "error" in result:
        return {"cmd": result["cmd"], "error": result["error"]}
    text = (result["stdout"] or result["stderr"]).strip().splitlines()
    return {"cmd": result["cmd"], "returncode": result["returncode"], "output": text[:4]}


def environment(dry: bool) -> dict:
    """The git commit, versions, the device and what ``nvidia-smi`` says (each command guarded)."""
    commands = {"git_commit": run_command(["git", "rev-parse", "HEAD"]),
                "git_status": run_command(["git", "status", "--porcelain"]),
                "nvidia_smi": run_command(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                                           "clocks.max.sm,power.limit", "--format=csv,noheader"])}
    ok = {k: r.get("returncode") == 0 for k, r in commands.items()}
    cuda = torch.cuda.is_available()
    return {"commit": commands["git_commit"]["stdout"].strip() or None if ok["git_commit"] else None,
            "dirty": bool(commands["git_status"]["stdout"].strip()) if ok["git_status"] else None,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "devices": torch.cuda.device_count(),
            "python": platform.python_version(), "dry_run": dry, "backend": "emulate" if dry else "torch",
            "bf16_tolerance": BF16_TOLERANCE, "commands": {k: _brief(r) for k, r in commands.items()}}


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


# -- the GPT block with graphs against eager ------------------------------------------------------------------
def gpt_chunks(sz: dict, num_chunks: int, device, seed: int = 0, dropout: float = 0.0):
    cfg = ModelConfig(num_layers=sz["layers"] * num_chunks, hidden_size=sz["hidden"],
                      num_attention_heads=sz["heads"], seq_length=sz["seq"], dropout=dropout)
    torch.manual_seed(seed)
    return [[Block(cfg, sz["ffn"]).to(device) for _ in range(sz["layers"])] for _ in range(num_chunks)]


def block_samples(sz: dict, count: int, device) -> list[tuple]:
    return [(torch.ones(sz["seq"], sz["mbs"], sz["hidden"], device=device, requires_grad=True),)
            for _ in range(count)]


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


def _step_tensors(chunks, result) -> list:
    """One step's losses (stacked), chunk-input gradients and parameter gradients."""
    grads = [p.grad.clone() for chunk in chunks for layer in chunk for p in layer.parameters()]
    return [torch.stack(list(result.losses.values())), *result.input_grads.values(), *grads]


def train_steps(chunks, plan, rank, data, steps: int, weights, autocast) -> list:
    out = []
    for _ in range(steps):
        with autocast():
            r = run_rank_step(chunks, plan, rank, data, weights=weights)
        out.append(_step_tensors(chunks, r))
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
    sample = block_samples(sz, num_chunks * m * sz["layers"], device)
    autocast, fp32 = _autocast(device, dtype), dtype == torch.float32
    with exact_attention(True):
        with autocast():
            layers, figures, failures = checked_capture(graphed, plan, rank, sample, backend, device, queue)
        ref = train_steps(eager, plan, rank, data, steps, None, autocast)
        got = train_steps(graphed, plan, rank, data, steps, queue, autocast)
        figures["graph_vs_eager"] = diff = compare(ref, got)
        figures["eager_vs_eager"] = compare(ref, train_steps(again, plan, rank, data, steps, None, autocast))
    figures["criterion"] = "bitwise"
    if not diff["bitwise"]:
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


# -- dropout under replay ------------------------------------------------------------------------------------------
def _rng_state(device):
    return torch.cuda.get_rng_state() if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device, state) -> None:
    (torch.cuda.set_rng_state if device.type == "cuda" else torch.set_rng_state)(state)


def _dropout_steps(models: dict, plan, data, device, seeds) -> tuple[dict, dict]:
    """Per model, one step per seed (``None``: continue from the model's own RNG state), no weight update; returns
    the per-step tensors and the RNG state after each step."""
    out = {name: [] for name in models}
    states = {name: [] for name in models}
    for seed in seeds:
        for name, chunks in models.items():
            if seed is None:
                _set_rng_state(device, states[name][-1])
            else:
                torch.manual_seed(seed)
            out[name].append(_step_tensors(chunks, run_rank_step(chunks, plan, 0, data)))
            states[name].append(_rng_state(device))
            for p in (p for chunk in chunks for layer in chunk for p in layer.parameters()):
                p.grad = None
    return out, states


def check_dropout(rep: Report, sz: dict, device, backend: str, seeds=(11, 12, None)) -> dict:
    """``dropout_rng`` (module docstring): graphs reproduce eager's dropout masks and advance them per replay."""
    plan = build_plan("interleaved", 2, sz["m"], 2)
    eager = gpt_chunks(sz, 2, device, dropout=0.1)
    graphed = copy.deepcopy(eager)
    data = make_rank_data(2, sz["m"], (sz["seq"], sz["mbs"], sz["hidden"]), device=device)
    with exact_attention(True):
        layers, figures, failures = checked_capture(graphed, plan, 0, block_samples(sz, 2 * sz["m"] * sz["layers"],
                                                                                    device), backend, device, None)
        out, states = _dropout_steps({"eager": eager, "graphs": graphed}, plan, data, device, seeds)
    layers.remove()
    figures["graph_vs_eager"] = diff = compare(out["eager"], out["graphs"])
    figures["rng_state_as_eager"] = [torch.equal(a, b) for a, b in zip(states["eager"], states["graphs"])]
    losses = [step[0] for step in out["graphs"]]
    figures["masks_change"] = changes = [not torch.equal(losses[i], losses[j])
                                         for i in range(len(losses)) for j in range(i + 1, len(losses))]
    failures += [] if diff["bitwise"] else [f"graphs vs eager with dropout: {diff}"]
    failures += [] if all(figures["rng_state_as_eager"]) else ["RNG state after a replayed step differs from eager's"]
    failures += [] if all(changes) else ["two steps drew the same dropout masks (losses equal)"]
    figures["failures"] = failures
    return rep.check("dropout_rng", not failures, seeds=list(seeds), **figures)


# -- split-graph memory at M = 4 and M = 16 -------------------------------------------------------------------------
def split_memory_at(sz: dict, m: int, device, backend: str) -> dict:
    """One zbv capture at ``m`` microbatches: pool bytes (``graphs.accounting.pool_bytes``), the static buffers
    (``held_bytes``) and, on CUDA, ``memory_reserved`` added by the capture."""
    plan = build_plan("zbv", 2, m, 2)
    chunks = gpt_chunks(sz, 2, device)
    cuda = device.type == "cuda"
    sample = block_samples(sz, 2 * m * sz["layers"], device)
    if cuda:  # after the sample arguments (they become static inputs, outside the pool); earlier checks' garbage
        gc.collect()  # is freed first, or the capture's own collection would lower the figure below its base
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
    layers = capture(chunks, plan, 0, sample, backend=backend, defer_weight_grad=WeightQueue().defer)
    out = {"active": layers.active, "backend": layers.report.backend, "reason": layers.report.reason,
           "capture_s": round(layers.report.seconds, 3), "graphs": 3 * layers.report.num_graphs,
           "held_bytes": held_bytes(layers.graphs) if layers.active else None}
    if cuda:  # the warmup's freed blocks are cached in the default pool: released first, the graph pool stays
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out["reserved_by_capture"] = torch.cuda.memory_reserved() - base
    out["pool"] = pool_bytes(layers.graphs) if layers.active else None
    layers.remove()
    del layers, chunks, sample
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def _memory_failures(at: dict, figures: dict, device) -> list[str]:
    h4, h16 = at[4]["held_bytes"], at[16]["held_bytes"]
    failures = []
    figures["weight_inputs_bytes"] = {4: h4["weight_inputs"], 16: h16["weight_inputs"]}
    if h16["weight_inputs"] != h4["weight_inputs"]:
        failures.append(f"B's recorded gradients for W grow with M: {h4['weight_inputs']} -> "
                        f"{h16['weight_inputs']} bytes")
    static_growth = (h16["total"] - h16["weight_inputs"]) - (h4["total"] - h4["weight_inputs"])
    rel, slack = MEMORY_SLACK[device.type]
    bound = static_growth * (1 + rel) + slack
    measured = {"pool_reserved": {m: r["pool"]["reserved"] if r["pool"] else None for m, r in at.items()}}
    if device.type == "cuda":
        measured["reserved_by_capture"] = {m: r["reserved_by_capture"] for m, r in at.items()}
    figures.update(static_growth_bytes=static_growth, bound_bytes=int(bound), **measured)
    for what, values in measured.items():
        if None in values.values():
            failures.append(f"{what}: not measured ({values})")
            continue
        growth = values[16] - values[4]
        figures[f"{what}_growth_bytes"] = growth
        if growth > bound:
            failures.append(f"{what} grows by {growth / 2 ** 20:.3f} MiB from M=4 to M=16, more than the "
                            f"per-microbatch static buffers' {static_growth / 2 ** 20:.3f} MiB (+slack): the "
                            f"graphs keep what should be dead after each microbatch")
    return failures


def check_split_memory(rep: Report, sz: dict, device, backend: str) -> list[dict]:
    at = {m: split_memory_at(sz, m, device, backend) for m in (4, 16)}
    failures = [f"M={m}: capture fell back ({r['reason']})" for m, r in at.items() if not r["active"]]
    figures: dict = {"schedule": "zbv", "pp": 2, "chunks": 2, "layers_per_chunk": sz["layers"], "at": at,
                     "measures": "graph pool segments (CUDA) / the emulate backend's pool model (dry run)"}
    if not failures:
        failures = _memory_failures(at, figures, device)
    figures["failures"] = failures
    rep.check("split_memory", not failures, **figures)
    return list(at.values())


def check_capture_seconds(rep: Report, captures: list[dict]) -> None:
    graphs = sum(c["graphs"] for c in captures)
    seconds = sum(c["capture_s"] for c in captures)
    per_graph = seconds / graphs if graphs else None
    projected = per_graph * GPU_PRESET_GRAPHS if per_graph is not None else None
    ratio = GPU_PRESET_TIMEOUT_S / 2 / projected if projected else None
    rep.goal("capture_seconds", round(ratio, 2) if ratio else None, 1.0, captures=len(captures), graphs=graphs,
             seconds=round(seconds, 2), seconds_per_graph=round(per_graph, 4) if per_graph else None,
             projected_gpu_preset_s=round(projected, 1) if projected else None,
             note="value: half of configs/gpu_cuda_graphs.yaml's parallel.timeout_s over its projected capture")


# -- the trainer ---------------------------------------------------------------------------------------------------
def trainer_overrides(sz: dict, run_dir: str, device_type: str, graphs: bool, extra: dict, steps: int) -> dict:
    return {"model.num_layers": 2 * sz["layers"], "model.hidden_size": sz["hidden"],
            "model.num_attention_heads": sz["heads"], "model.seq_length": sz["seq"], "data.max_bytes": 200_000,
            "training.micro_batch_size": sz["mbs"], "training.num_microbatches": sz["m"], "training.steps": steps + 1,
            "training.eval_interval": 0, "logging.progress_bar": False, "logging.level": "WARNING",
            "logging.log_interval": 1000, "logging.run_dir": run_dir, "parallel.device": device_type,
            "cuda_graphs.enabled": graphs, "cuda_graphs.warmup_steps": 1, **extra}


def count_host_syncs(step) -> dict:
    """Synchronising CUDA calls during ``step()`` (``torch.cuda.set_sync_debug_mode("warn")``): the count and the
    places they come from (file:line of the warning, most frequent first)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return {"count": len(syncs), "where": dict(where.most_common(10))}


def trainer_run(rank: int, world: int, device_type: str, backend: str, overrides: dict, steps: int,
                count_syncs: bool = False) -> dict:
    """Train ``steps`` steps with ``overrides`` (graphs per ``cuda_graphs.enabled``) on this rank: the losses,
    whether graphs were active after each step, the capture report, and the host syncs of one more
    (non-logging) step when ``count_syncs`` on CUDA.  Module-level: spawned ranks import it."""
    from engine import Trainer
    from engine.training.config import load_config
    config = load_config(None, overrides)
    losses, active, syncs = [], [], None
    with exact_attention(True), Trainer(config) as trainer:
        if config.cuda_graphs.enabled:
            trainer.config.cuda_graphs.backend = backend  # emulate is test-only: set after validation
        for _ in range(steps):
            losses.append(trainer.train_step()["loss"])
            runtime = getattr(trainer, "_graphs", None)
            active.append(bool(runtime is not None and runtime.active))
        if count_syncs and device_type == "cuda":
            syncs = count_host_syncs(trainer.step_on_device)  # a step that logs nothing
        report = runtime.layers.report if runtime is not None else None
        return {"losses": losses, "active": active, "backend": report.backend if report else None,
                "reason": report.reason if report else None, "host_syncs": syncs}  # close releases the graphs


def _trainer_job(rank: int, world: int, *args) -> dict:
    return importlib.import_module("benchmarks.gpu_check").trainer_run(rank, world, *args)


def _availability(overrides: dict, fields: tuple) -> str | None:
    """``None`` if the config takes ``overrides``, else why not (``NOT_AVAILABLE`` when it refuses one of
    ``fields``, which this build may not have yet)."""
    from engine.training.config import ConfigError, load_config
    try:
        load_config(None, overrides)
    except ConfigError as exc:
        if any(f in str(exc) for f in fields):
            return f"{NOT_AVAILABLE}: {exc}"
        raise
    return None


def _run_both(tmp: str, device, backend: str, sz: dict, extra: dict, steps: int, count_syncs: bool) -> tuple:
    ranks = extra.get("parallel.pipeline", 1)
    runs = {}
    for graphs in (False, True):
        overrides = trainer_overrides(sz, f"{tmp}/{'on' if graphs else 'off'}", device.type, graphs, extra, steps)
        args = (device.type, backend, overrides, steps, graphs and count_syncs)
        if ranks == 1:
            runs[graphs] = trainer_run(0, 1, *args)
        else:
            from engine.runtime.spawn import spawn
            runs[graphs] = spawn(_trainer_job, ranks, backend="nccl" if device.type == "cuda" else "gloo",
                                 args=args, timeout_s=240, threads=1)[-1]  # the last rank reports the loss
    return runs[False], runs[True]


def check_trainer_case(rep: Report, name: str, extra: dict, fields: tuple, count_syncs: bool, device,
                       backend: str, sz: dict, steps: int = 4) -> None:
    """One ``trainer_<case>`` (module docstring), plus ``host_syncs`` for the case that counts them."""
    ranks = extra.get("parallel.pipeline", 1)
    devices = torch.cuda.device_count() if device.type == "cuda" else 1  # the dry run stands for one GPU
    if devices < ranks:
        rep.add(name, "correctness", f"skipped: needs {ranks} devices", devices=devices,
                reason="one device per pipeline rank: NCCL refuses two ranks on one GPU (the dry run mirrors a "
                       "one-GPU machine)")
        return
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        missing = _availability(trainer_overrides(sz, tmp, device.type, True, extra, steps), fields)
        if missing is not None:
            rep.add(name, "correctness", NOT_AVAILABLE, reason=missing)
            return
        off, on = _run_both(tmp, device, backend, sz, extra, steps, count_syncs)
    bf16 = extra.get("model.precision") == "bf16"
    worst = max(abs(a - b) / (abs(a) or 1.0) for a, b in zip(off["losses"], on["losses"]))
    failures = [] if (worst <= BF16_TOLERANCE if bf16 else on["losses"] == off["losses"]) else [
        f"losses differ with graphs on (max rel diff {worst:.3g})"]
    if on["active"] != [False] + [True] * (steps - 1) or on["backend"] != backend:
        failures.append(f"graphs not active after the warmup step: {on['active']} backend={on['backend']} "
                        f"({on['reason']})")
    rep.check(name, not failures, overrides=extra, pipeline_ranks=ranks, losses_off=off["losses"],
              losses_on=on["losses"], max_rel_diff=worst, active=on["active"], backend=on["backend"],
              precision_note="bf16 is autocast on CUDA only (fp32 here)" if bf16 and device.type != "cuda" else None,
              failures=failures)
    if count_syncs:
        syncs = on["host_syncs"] or {"count": NEEDS_CUDA, "where": {}}
        rep.goal("host_syncs", syncs["count"], GOALS["host_syncs"], higher_is_better=False, case=name,
                 where=syncs["where"], note="synchronising CUDA calls in one non-logging step with graphs")


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


# -- the cuda-marked tests ---------------------------------------------------------------------------------------
def cuda_test_files() -> list[str]:
    """Test files that mark tests ``cuda`` (only those are collected: the rest of the suite needs extras)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.cuda" in p.read_text(encoding="utf-8"))


def check_cuda_tests(rep: Report, dry: bool, timeout_s: float) -> None:
    files = cuda_test_files()
    # no auto-loaded plugins: the run sees what a machine with only pytest has
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONPATH=path)
    t0 = time.perf_counter()
    result = run_command([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *files],
                         timeout_s=timeout_s, env=env)
    out, rc = (result.get("stdout") or "") + (result.get("stderr") or ""), result.get("returncode", -1)
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
              for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors|error|deselected)", out)}
    figures = dict(files=files, returncode=rc, error=result.get("error"), counts=counts,
                   seconds=round(time.perf_counter() - t0, 1),
                   tail=out.strip().splitlines()[-15 if rc else -1:])  # the summary line; more on a failure
    if dry:  # the subprocess ran (so the files collect); every test skips without CUDA
        ok = rc == 0 and counts.get("skipped", 0) > 0 and not counts.get("failed") and not counts.get("error")
        rep.add("cuda_tests", "correctness", NEEDS_CUDA if ok else "fail", **figures)
        return
    rep.check("cuda_tests", rc == 0 and counts.get("passed", 0) > 0 and not counts.get("failed")
              and not counts.get("error"), **figures)


# -- benchmarks/cuda_graphs_bench.py -------------------------------------------------------------------------------
def check_bench(rep: Report, out_dir: Path) -> None:
    from benchmarks import cuda_graphs_bench
    path = out_dir / ("cuda_graphs_bench_dry_run.json" if rep.dry else "cuda_graphs_bench.json")
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(False)  # as the bench runs on its own (no NaN fill of every empty)
    try:
        rc = cuda_graphs_bench.main(["--json", str(path), "--memory", ""])
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
    configs = json.loads(path.read_text())["configs"]
    shown = path.relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
    rep.check("bench_bitwise", rc == 0, returncode=rc, configs=sorted(configs), json=str(shown),
              graph_vs_eager={k: v.get("graph_vs_eager") for k, v in configs.items()},
              te={k: v["te"] for k, v in configs.items() if "te" in v})
    launch, compute = configs.get("launch", {}), configs.get("compute", {})
    rep.goal("bench_launch_speedup", launch.get("speedup"), GOALS["bench_launch_speedup"],
             eager_ms=launch.get("eager_ms"), graph_ms=launch.get("graph_ms"),
             dry_run_speedup=configs.get("cpu_tiny", {}).get("speedup"))
    rep.goal("bench_compute_ratio", compute.get("speedup"), GOALS["bench_compute_ratio"],
             eager_ms=compute.get("eager_ms"), graph_ms=compute.get("graph_ms"))


# -- driver ------------------------------------------------------------------------------------------------------
BENCH_NAMES = ("bench_bitwise", "bench_launch_speedup", "bench_compute_ratio")


def plan_steps(rep: Report, device, backend: str, sz: dict, out_dir: Path, budget: Budget) -> list[tuple]:
    """``(group, names it records, fn)`` for every step, in order."""
    captures: list[dict] = []
    steps = []
    for schedule, chunks in SCHEDULES:
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            steps.append(("graphs", (f"graphs_{schedule}_{tag}",), lambda s=schedule, c=chunks, d=dtype:
                          captures.append(graphs_case(rep, s, c, d, sz, device, backend))))
    steps += [("dropout", ("dropout_rng",), lambda: check_dropout(rep, sz, device, backend)),
              ("split_memory", ("split_memory",),
               lambda: captures.extend(check_split_memory(rep, sz, device, backend))),
              ("capture_seconds", ("capture_seconds",), lambda: check_capture_seconds(rep, captures))]
    for name, extra, fields, syncs in TRAINER_CASES:
        names = (name, "host_syncs") if syncs else (name,)
        steps.append(("trainer", names, lambda n=name, e=extra, f=fields, s=syncs:
                      check_trainer_case(rep, n, e, f, s, device, backend, sz)))
    steps += [("nvtx", ("nvtx",), lambda: check_nvtx(rep, device)),
              ("cuda_tests", ("cuda_tests",),
               lambda: check_cuda_tests(rep, rep.dry, min(300.0, budget.left() - 5.0))),
              ("bench", BENCH_NAMES, lambda: check_bench(rep, out_dir))]
    return steps


def run_checks(rep: Report, selected: set[str], device, backend: str, sz: dict, budget: Budget,
               out_dir: Path) -> None:
    """Run the selected steps in order: each skipped when the budget has less left than its estimate, each error
    recorded (with its traceback) without stopping the run."""
    for group, names, step in plan_steps(rep, device, backend, sz, out_dir, budget):
        if group not in selected and names[0] not in selected:
            continue
        if not budget.allows(ESTIMATE_S[group]):
            for name in names:
                rep.add(name, "goal" if name in GOALS else "correctness", OVER_BUDGET,
                        estimate_s=ESTIMATE_S[group], left_s=round(budget.left(), 1))
            continue
        rep.start(names[0])
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - record the error, keep going, always write the JSON
            import traceback
            rep.add(names[0] if names[0] not in rep.checks else f"{names[0]}_error", "correctness", "fail",
                    error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc().splitlines()[-12:])
        rep.in_progress = None


def output_path(out: str | None, dry: bool) -> Path:
    """``--out``: a folder (the report is ``gpu_check.json`` in it, ``gpu_check_dry_run.json`` with ``--dry-run``,
    so a CPU run never replaces a GPU report), or a path ending in ``.json``."""
    name = "gpu_check_dry_run.json" if dry else "gpu_check.json"
    if out is None:
        return ROOT / "benchmarks" / "results" / "gpu" / name
    return Path(out) if out.endswith(".json") else Path(out) / name


def _arguments(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for gpu_check.json and cuda_graphs_bench.json (default "
                    "benchmarks/results/gpu/), or the report's path ending in .json")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, emulate backend, tiny sizes; what needs CUDA is recorded as skipped")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}, "
                    f"or single cases by name (graphs_zbv_fp32, trainer_1f1b_bf16, ...)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"seconds for all checks (default {BUDGET_S:g}); a check whose estimate exceeds what is "
                         f"left is skipped, one still running {WATCHDOG_GRACE_S:g} s after it is spent ends the run")
    args = ap.parse_args(argv)
    selected = {c.strip() for c in args.checks.split(",") if c.strip()}
    cases = {f"graphs_{s}_{d}" for s, _ in SCHEDULES for d in ("fp32", "bf16")} | {c[0] for c in TRAINER_CASES}
    if selected - set(CHECKS) - cases:
        ap.error(f"--checks: unknown {sorted(selected - set(CHECKS) - cases)}; use {', '.join(CHECKS)} or a case")
    return args, selected


def main(argv=None) -> int:
    args, selected = _arguments(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch %s, CUDA build %s); run on a GPU, or use --dry-run"
              % (torch.__version__, torch.version.cuda), file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        torch.set_num_threads(1)
    set_determinism()
    budget = Budget(args.budget_s)
    env = environment(args.dry_run)
    rep = Report(output_path(args.out, args.dry_run), args.dry_run, env, args.budget_s)
    watchdog = start_watchdog(rep, budget)
    on_term = signal.signal(signal.SIGTERM, lambda *_: (rep.abort("killed: SIGTERM"), os._exit(143)))
    if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 11):
        print(f"[gpu_check] warning: torch {torch.__version__} is older than the 2.11 this check is written for")
    print(f"[gpu_check] {json.dumps(env)}", flush=True)
    run_checks(rep, selected, device, env["backend"], SIZES["dry" if args.dry_run else "gpu"], budget,
               rep.path.parent)
    watchdog.cancel()
    signal.signal(signal.SIGTERM, on_term)
    rep.finish()
    failed = [n for n, c in rep.checks.items() if c["status"] == "fail" and c["kind"] == "correctness"]
    missed = [n for n, c in rep.checks.items() if c["kind"] == "goal" and c["status"] == "fail"]
    print(f"[gpu_check] {'PASS' if rep.correct else 'FAIL'} in {time.perf_counter() - rep.t0:.1f}s: "
          f"{len(rep.checks)} checks; failed: {', '.join(failed) or 'none'}; goals missed (not in the exit status): "
          f"{', '.join(missed) or 'none'}; wrote {rep.path}", flush=True)
    return 0 if rep.correct else 1


if __name__ == "__main__":
    sys.exit(main())
