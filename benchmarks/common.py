"""Shared pieces of the benchmarks: the MLP-stack model, its data, the engines under test, timing and JSON output.

The model is a stack of residual MLP layers ``h <- h + gelu(h W^T + b)`` on activations ``[s, b, h]`` (a
per-token map, so any batch layout gives the same numbers), split into ``P*C`` equal chunks of consecutive layers;
virtual pipeline stage ``k = c*P + r`` (rank ``r``, chunk ``c``) holds layers ``[k*L/(P*C), (k+1)*L/(P*C))``, the
placement of Megatron's interleaved schedule and of torch.distributed.pipelining's looped schedules.  The loss of a
microbatch is the mean squared error to a fixed random target; every engine's gradient is that of the mean of the
microbatch losses (Megatron divides each loss by M; torch's schedules scale gradients by 1/M).

Every engine runs in fresh processes spawned by :func:`launch` (gloo on 127.0.0.1, ``torch.set_num_threads``
threads per rank, the same process priority), so their timings share the conditions of one run.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
_LOAD_AT_START = os.getloadavg() if hasattr(os, "getloadavg") else None
RESULTS = ROOT / "benchmarks" / "results"


# ---------------------------------------------------------------------------------------------------------------
# model and data
@dataclass(frozen=True)
class Workload:
    """Model and batch sizes of one benchmark (defaults: the issue's vs-torch setting)."""

    hidden: int = 512
    layers: int = 8
    sequences: int = 16      # global batch, sequences
    seq_length: int = 64     # tokens per sequence
    microbatches: int = 8
    seed: int = 1234

    @property
    def micro_batch_size(self) -> int:
        return self.sequences // self.microbatches

    def validate(self, pp: int, chunks: int) -> None:
        if self.sequences % self.microbatches:
            raise ValueError(f"sequences={self.sequences} is not divisible by microbatches={self.microbatches}")
        if self.layers % (pp * chunks):
            raise ValueError(f"layers={self.layers} is not divisible by pp*chunks={pp * chunks}; choose layers, pp "
                             f"and model chunks so every virtual stage gets the same number of layers")


class MLPLayer(nn.Module):
    """``h + gelu(Linear(h))`` on ``[..., hidden]``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, h):
        return h + nn.functional.gelu(self.fc(h))


def build_layers(w: Workload) -> list[MLPLayer]:
    """All ``w.layers`` layers with seeded weights (identical in every process)."""
    g = torch.Generator().manual_seed(w.seed)
    layers = []
    for _ in range(w.layers):
        layer = MLPLayer(w.hidden)
        with torch.no_grad():
            layer.fc.weight.copy_(torch.randn(w.hidden, w.hidden, generator=g) * (0.5 / w.hidden ** 0.5))
            layer.fc.bias.copy_(torch.randn(w.hidden, generator=g) * 0.01)
        layers.append(layer)
    return layers


def stage_layers(w: Workload, pp: int, chunks: int, stage: int) -> nn.Sequential:
    """The layers of virtual pipeline stage ``stage`` (of ``pp*chunks``)."""
    per = w.layers // (pp * chunks)
    return nn.Sequential(*build_layers(w)[stage * per:(stage + 1) * per])


def batch(w: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and target of the global batch, ``[sequences, seq_length, hidden]`` each (batch-first)."""
    g = torch.Generator().manual_seed(w.seed + 1)
    x = torch.randn(w.sequences, w.seq_length, w.hidden, generator=g)
    y = torch.randn(w.sequences, w.seq_length, w.hidden, generator=g)
    return x, y


def microbatches_sbh(w: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batch as ``M`` microbatches in Megatron's ``[s, b, h]`` layout (contiguous)."""
    x, y = batch(w)
    b = w.micro_batch_size
    return [(x[i * b:(i + 1) * b].transpose(0, 1).contiguous(), y[i * b:(i + 1) * b].transpose(0, 1).contiguous())
            for i in range(w.microbatches)]


def mse(out, target):
    return nn.functional.mse_loss(out, target)


# ---------------------------------------------------------------------------------------------------------------
# launching fresh processes
def launch(fn, world: int, *args, threads: int = 1, pin: bool = False, timeout: float = 600.0) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh gloo processes; return per-rank results in rank order
    (:func:`engine.runtime.spawn.spawn`, the project's one spawner).

    ``threads``: torch threads per rank.  ``pin``: pin rank ``r`` (every thread of the process) to CPU
    ``r mod cpu_count`` with ``os.sched_setaffinity``; the same for every engine of a benchmark.

    Raises:
        RankError (a RuntimeError) when a rank raised or died; JobTimeout when the job ran past ``timeout``.
    """
    from engine.runtime.spawn import spawn
    return spawn(fn, world, args=args, threads=threads, pin_cpus=pin, timeout_s=timeout, group_timeout_s=120)


# ---------------------------------------------------------------------------------------------------------------
# timing
def timed_steps(step, warmup: int, steps: int, group=None) -> list[float]:
    """Run ``step()`` ``warmup + steps`` times, a barrier before each; return the timed steps' durations (s) as the
    maximum over ranks (a step ends when its last rank is done)."""
    times = []
    for i in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier(group)
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times = t.tolist()
    return times


def round_robin(steps_by_label: dict, warmup: int, steps: int, seed: int, after_round=()) -> dict[str, dict]:
    """Run each engine's ``step()`` once per round, ``warmup + steps`` rounds, in a shuffled order per round (a
    barrier before each step), so that load from elsewhere on the machine falls on all engines alike; then call each
    of ``after_round`` (untimed).  Returns ``{label: {"wall": [s], "cpu": [s]}}`` per timed step: the wall time
    and the process's CPU time (``time.process_time``: every thread of the process, so a runtime's helper threads
    count too), each the maximum over ranks (a step ends when its last rank is done).  Collective when
    ``torch.distributed`` is initialised."""
    import random
    order = list(steps_by_label)
    times = {label: {"wall": [], "cpu": []} for label in order}
    rng = random.Random(seed)
    for i in range(warmup + steps):
        rng.shuffle(order)
        for label in order:
            if dist.is_initialized():
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            steps_by_label[label]()
            if i >= warmup:
                times[label]["wall"].append(time.perf_counter() - t0)
                times[label]["cpu"].append(time.process_time() - c0)
        for fn in after_round:
            fn()
    if dist.is_initialized() and dist.get_world_size() > 1:
        flat = torch.tensor([times[label][k] for label in steps_by_label for k in ("wall", "cpu")],
                            dtype=torch.float64)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        for label, (wall, cpu) in zip(steps_by_label, flat.view(len(steps_by_label), 2, steps).tolist()):
            times[label] = {"wall": wall, "cpu": cpu}
    return times


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def machine() -> dict:
    """Where the figures were taken."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "loadavg": load, "loadavg_at_start": _LOAD_AT_START, "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "git": _git_rev()}


def _git_rev() -> str | None:
    """The short commit, with ``-dirty`` when tracked files outside ``benchmarks/results`` differ from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!benchmarks/results"], cwd=ROOT, capture_output=True, text=True,
                               timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("-dirty" if dirty else "")) or None


def write_json(name: str, payload: dict, out: str | None = None) -> Path:
    """Write ``payload`` (plus ``machine`` and ``command``) to ``out`` or ``benchmarks/results/<name>.json``."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
               "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path
