"""Memory of pipecast's schedules: peak in-flight microbatch activations per rank, and bytes held by sent outputs.

Measured inside the ranks, without touching the engine:

* **In-flight activations.**  The forward step runs each model chunk under ``torch.autograd.graph.saved_tensors_hooks``
  and tags every tensor autograd saves (parameters excluded) with its ``(model chunk, microbatch)``; a tag is
  in flight while any of its saved tensors is alive (autograd frees them when that microbatch's backward has run).
  The peak number of live tags per rank is compared with the theory: ``min(P - r, M)`` for 1F1B and
  ``min(W_r + 1, M*C)`` for interleaved 1F1B (``W_r`` the rank's warmup count), i.e. the simulator's
  ``peak_in_flight`` for the plan (Narayanan et al., SC'21; Megatron-Core's warmup counts).
* **Bytes held by sent outputs.**  Each chunk's output is produced by an identity autograd function that allocates
  it from a numpy array, so the lifetime of its *storage* (not of one tensor object) is observable through a weak
  reference; a probe tracer (``engine.runtime.tracing.use_tracer``) samples the live output bytes at every span the executor
  reports.  Peak per rank with ``deallocate_pipeline_outputs`` off and on: with it on, a sent output should hold only
  its ``[1]`` placeholder once the send no longer needs the data.

* **Split backward** (ZB-H1, ZB-V).  With layer-level deferral autograd frees a microbatch's saved tensors in
  ``B``; what ``W`` needs (each deferred layer's input and output gradient) is held by the pending ``W`` itself,
  outside autograd, and reported as the simulator's ``peak_pending_w``.  On the first stage the first op's input
  (the microbatch itself) needs no gradient, so that op runs as its own small graph whose one saved tensor, the
  input, lives until W (B frees the rest: for one chunk here 2 MiB saved after F, 256 KiB after B); a tag counts as
  live while any of its tensors is, so the first stage's chunk counts until W.  The theory compared is that
  model: per rank, the peak over its order of forwards done minus, per chunk, ``B`` done (``W`` done for the
  first stage's chunk).

* **Sharded data parallelism** (``--sharding``).  A pp2 x dp2 trainer on 4 CPU ranks per
  ``parallel.shard`` value: per rank the bytes of parameters, gradients (the full ``.grad`` tensors, plus the
  reduce-scattered shard ``optimizer`` holds until the step) and AdamW state, against the theory (state of
  ``optimizer`` = state of ``none`` / dp, within one shard's padding; ``full`` (FSDP2): parameters, gradients and
  state each = ``none`` / dp, within one dim-0 row per parameter -- measured between steps, the parameters of a
  chunk are gathered whole during a step), and the median step time.  The tensor-parallel sizes T are the hook
  :data:`TENSOR`.
* **Tensor parallelism** (``--tensor``).  A pp2 trainer (data 1) at ``parallel.tensor`` T = 1 (2 ranks), T = 2
  (4 ranks) and T = 2 with ``parallel.sequence_parallel``: per rank the local bytes of parameters, gradients and
  AdamW state (DTensors counted by their local shard), against the theory ``1/T`` of T = 1 and against the exact
  count, ``sharded / T + replicated``: norms, row-parallel biases and the position embedding stay replicated
  (every rank holds them whole), so the measured ratio is slightly above ``1/T``.

* **Recomputation and precision** (``--recompute``).  One GPT chunk (the recipe's blocks) in one process, fp32 and
  bf16 parameters, recomputation none / selective / full (``engine.runtime.recompute``): the bytes a microbatch's
  forward saves for the backward (distinct storages, parameters excluded, counted with saved-tensor hooks) per
  layer, against the layer input ``s*b*h`` elements that full recomputation keeps, and the median time of a
  forward and of a forward + backward (the extra forward recomputation costs).  Selective needs blocks whose
  attention core is a module (``core``); it is skipped for blocks without one.

* **The estimate** (``--estimate``).  Presets (and variants) trained two steps with every chunk's forward under
  saved-tensor hooks that count the live distinct storages autograd holds (:class:`LiveSaved`): per rank the
  peak, and the parameter, gradient and optimizer-state bytes, against :func:`engine.training.memory.estimate`.

    python benchmarks/memory.py            # pp=2 and pp=4, 1F1B, interleaved, ZB-H1, ZB-V (about two minutes)
    python benchmarks/memory.py --sharding # pp2 x dp2, shard none / optimizer / full (about two minutes)
    python benchmarks/memory.py --tensor   # pp2 x tp1 / tp2 / tp2 + sequence_parallel, bytes per rank
    python benchmarks/memory.py --estimate # engine.training.memory's estimate against measured bytes per rank
    python benchmarks/memory.py --recompute  # saved bytes per layer: fp32 / bf16 x none / selective / full
    python benchmarks/memory.py --fit      # --estimate for model.precision x model.recompute, uneven layout

"""
from __future__ import annotations

import argparse
import contextlib
import sys
import weakref
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import Workload, launch, write_json  # noqa: E402
from engine.runtime.storage import local_bytes, storage_sizes  # noqa: E402

CASES = [  # pp, model chunks, schedule (None: Megatron's)
    (2, 1, None), (2, 2, None), (4, 1, None), (4, 2, None), (2, 1, "zb_h1"), (2, 2, "zbv"), (4, 1, "zb_h1"),
    (4, 2, "zbv"),
]


class _NumpyBacked(torch.autograd.Function):
    """Identity whose output storage is a numpy array (weak-referenceable: its death is the storage's)."""

    @staticmethod
    def forward(ctx, x):
        arr = np.empty(tuple(x.shape), dtype=np.float32)
        out = torch.from_numpy(arr)
        out.copy_(x)
        _NumpyBacked.last = arr
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class Meter:
    """Live saved activations by (chunk, microbatch) and live output storages of one rank."""

    def __init__(self, params):
        self.param_ptrs = {ptr for p in params for ptr in storage_sizes(p)}
        self.live: dict[tuple[int, int], int] = {}     # tag -> live saved tensors
        self.peak_tags = 0
        self.outputs: list[tuple[weakref.ref, int]] = []
        self.peak_output_bytes = 0
        self.output_bytes_one = 0

    def hooks(self, tag):
        meter = self

        class Handle:
            __slots__ = ("t",)

            def __init__(self, t):
                self.t = t
                meter.live[tag] = meter.live.get(tag, 0) + 1
                meter.peak_tags = max(meter.peak_tags, sum(1 for v in meter.live.values() if v > 0))

            def __del__(self):
                meter.live[tag] -= 1

        def pack(t):
            if not storage_sizes(t).keys() - self.param_ptrs:
                return t
            return Handle(t)

        def unpack(h):
            return h.t if isinstance(h, Handle) else h

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def track_output(self, out):
        arr = _NumpyBacked.last
        self.outputs.append((weakref.ref(arr), arr.nbytes))
        self.output_bytes_one = arr.nbytes
        self.sample()

    def sample(self):
        alive = [(r, n) for r, n in self.outputs if r() is not None]
        self.outputs = alive
        self.peak_output_bytes = max(self.peak_output_bytes, sum(n for _, n in alive))

    # tracer protocol: sample whenever the executor reports a span
    def span(self, category, label):
        self.sample()
        return _NULL


_NULL = contextlib.nullcontext()


def job(rank: int, world: int, chunks: int, deallocate: bool, w: Workload, schedule=None):
    from benchmarks.engines import build_pipecast
    from engine.runtime.tracing import use_tracer
    engine = build_pipecast(rank, world, w, chunks=chunks, deallocate=deallocate, schedule=schedule)
    mods = engine.modules
    meter = Meter([p for m in mods for p in m.parameters()])
    n_stages = world * chunks
    # wrap each chunk: saved tensors tagged by (chunk, microbatch), output made numpy-backed on sending chunks
    counters = [0] * chunks
    for c, mod in enumerate(mods):
        inner = mod.forward
        sends = mod.stage < n_stages - 1

        def forward(x, _inner=inner, _c=c, _sends=sends):
            mb = counters[_c]
            counters[_c] += 1
            with meter.hooks((_c, mb)):
                out = _inner(x)
            if _sends:
                out = _NumpyBacked.apply(out)
                meter.track_output(out)
            return out
        mod.forward = forward
    with use_tracer(meter):
        for _ in range(2):
            counters[:] = [0] * chunks
            engine.step()
    meter.sample()
    return {"peak_in_flight": meter.peak_tags, "peak_output_bytes": meter.peak_output_bytes,
            "output_bytes": meter.output_bytes_one, "live_after_step": sum(1 for v in meter.live.values() if v > 0)}


def theory(pp: int, chunks: int, m: int) -> list[int]:
    """Closed-form peak in-flight (chunk, microbatch) activations per rank (see module docstring)."""
    from engine.plan.table import pp_rank_microbatches
    out = []
    for r in range(pp):
        if chunks == 1:
            out.append(min(pp - r, m))
        else:
            w = pp_rank_microbatches(m, chunks, pp, pp, r, chunks).num_warmup_microbatches
            out.append(min(w + 1, m * chunks))
    return out


def live_saved(plan) -> list[int]:
    """Per rank, the peak number of microbatches whose autograd-saved tensors are alive under split backward (see
    the module doc): from F until B, or until W for the first stage's chunk."""
    out = []
    for rank, acts in enumerate(plan.actions):
        level = peak = 0
        for a in acts:
            frees = "W" if plan.is_first_stage(rank, a.chunk) else "B"
            level += (a.op.value == "F") - (a.op.value == frees)
            peak = max(peak, level)
        out.append(peak)
    return out


SHARDS = ("none", "optimizer", "full")  # parallel.shard values measured
TENSOR = (1,)  # T of --sharding: shard optimizer / full with parallel.tensor > 1 is refused (T = 2: --tensor)
SHARD_STEPS = 6


def _shard_overrides(shard: str, run_dir: str) -> list[str]:
    values = {"model.num_layers": 4, "model.hidden_size": 128, "model.num_attention_heads": 4,
              "model.seq_length": 64, "data.max_bytes": 200_000, "parallel.pipeline": 2, "parallel.data": 2,
              "parallel.shard": shard, "training.micro_batch_size": 4, "training.num_microbatches": 4,
              "training.steps": SHARD_STEPS, "training.eval_interval": 0, "checkpoint.interval": 0,
              "checkpoint.save_at_end": False, "logging.progress_bar": False, "logging.level": "WARNING",
              "logging.run_dir": run_dir}
    return [f"{k}={v}" for k, v in values.items()]


def _nbytes(tensors) -> int:
    """Bytes this rank holds (a DTensor -- ``shard: full`` -- counts its local shard)."""
    return sum(local_bytes(t) for t in tensors if torch.is_tensor(t))


def static_bytes(tr) -> dict:
    """A trainer's parameter, gradient (and ZeRO-1 gradient shard) and optimizer-state bytes on this rank."""
    params = list({id(p): p for c in tr.model for p in c.parameters() if p.requires_grad}.values())
    masters = [] if tr.parallelism.masters is None else tr.parallelism.parameters()  # bf16: the fp32 masters
    if tr.parallelism.shard == "optimizer":
        state = tr.optimizer.state_bytes()
        shards = tr.parallelism.grad_sync.shards
        grad_shard = sum(s.shard_size * 4 for s in shards)
        padding = sum((s.padded - sum(p.numel() for p in s.params)) * 4 for s in shards)
    else:
        state = _nbytes(t for st in tr.optimizer.state.values() for t in st.values())
        grad_shard = padding = 0
        if tr.parallelism.shard == "full":  # slack of torch.chunk's dim-0 split: one row per parameter
            padding = sum(p.numel() // max(p.shape[0], 1) * 4 for p in params)
    return {"param_bytes": _nbytes(params) + _nbytes(masters), "grad_bytes": _nbytes(p.grad for p in params + masters),
            "grad_shard_bytes": grad_shard, "state_bytes": state, "padding_bytes": padding}


def shard_job(rank: int, world: int, shard: str, run_dir: str) -> dict:
    """One rank of a pp2 x dp2 run: parameter, gradient and optimizer-state bytes after the last step."""
    from engine import Trainer
    from engine.training.config import load_config
    with Trainer(load_config(None, _shard_overrides(shard, f"{run_dir}/{shard}"))) as tr:
        times = [tr.train_step()["step_time_s"] for _ in range(SHARD_STEPS)]
        return {"rank": rank, "pp_rank": tr.pp_rank, "dp_rank": tr.dp_rank, **static_bytes(tr),
                "step_time_s": times[1:]}


def _shard_row(t: int, shard: str, r: dict, base: dict, step_time: float) -> dict:
    """One table row: ``r`` (a rank's bytes) against the theory from ``base`` (the same rank under ``none``)."""
    dp = 2
    expect = base["state_bytes"] / dp if shard != "none" else base["state_bytes"]
    slack = 2 * r["padding_bytes"] + 4 * 64  # padding of one shard / row per parameter (two moments) + steps
    within = abs(r["state_bytes"] - expect) <= slack
    if shard == "full":  # parameters and gradients sharded too
        within = within and all(abs(r[k] - base[k] / dp) <= r["padding_bytes"] for k in ("param_bytes", "grad_bytes"))
    return {"T": t, "shard": shard, **{k: v for k, v in r.items() if k != "step_time_s"},
            "state_theory_bytes": expect, "state_ratio_to_none": r["state_bytes"] / base["state_bytes"],
            "param_ratio_to_none": r["param_bytes"] / base["param_bytes"],
            "grad_ratio_to_none": r["grad_bytes"] / base["grad_bytes"], "within_theory": within,
            "step_time_s": step_time}


def sharding_main(out: str | None) -> int:
    """The ``--sharding`` table: bytes per rank and step time per ``parallel.shard`` value, against the theory."""
    import statistics
    import tempfile
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        measured = {s: launch(shard_job, 4, s, tmp) for s in SHARDS}
    for t in TENSOR:
        for shard in SHARDS:
            for r, base in zip(measured[shard], measured["none"]):
                rows.append(_shard_row(t, shard, r, base, statistics.median(r["step_time_s"])))
    print(f"{'T':>2} {'shard':>9} {'rank':>4} {'params B':>9} {'grads B':>9} {'grad shard B':>12} {'state B':>9} "
          f"{'theory B':>9} {'ratio':>6} {'p ratio':>7} {'step s':>7}")
    for r in rows:
        print(f"{r['T']:>2} {r['shard']:>9} {r['rank']:>4} {r['param_bytes']:>9} {r['grad_bytes']:>9} "
              f"{r['grad_shard_bytes']:>12} {r['state_bytes']:>9} {int(r['state_theory_bytes']):>9} "
              f"{r['state_ratio_to_none']:>6.3f} {r['param_ratio_to_none']:>7.3f} {r['step_time_s']:>7.3f}")
    def goal(text, shard, key):
        mine = [r for r in rows if r["shard"] == shard]
        return {"goal": text, "value": max(r[key] for r in mine), "met": all(r["within_theory"] for r in mine)}
    goals = [goal("optimizer-state bytes with shard=optimizer = 1/dp of none (within one shard's padding)",
                  "optimizer", "state_ratio_to_none"),
             goal("parameter, gradient and optimizer-state bytes with shard=full = 1/dp of none (within one dim-0 "
                  "row per parameter), between steps", "full", "param_ratio_to_none")]
    met = all(g["met"] for g in goals) and all(r["within_theory"] for r in rows)
    path = write_json("memory_sharding", {"rows": rows, "goals": goals, "tensor_sizes": list(TENSOR),
                                          "note": "shard=full: bytes between steps; during a step each chunk's "
                                                  "parameters and gradients are gathered whole (reshard after it)"},
                      out)
    print(f"wrote {path}")
    return 0 if met else 1


TENSOR_LAYOUTS = ((1, False), (2, False), (2, True))  # (parallel.tensor, parallel.sequence_parallel) of --tensor


def _local_bytes(t) -> int:
    return _nbytes([t])


def tensor_job(rank: int, world: int, tp: int, sp: bool, run_dir: str) -> dict:
    """One rank of a pp2 x tp ``tp`` run (data 1): local parameter, gradient and AdamW-state bytes after the last
    step, and the full / local element counts of its sharded and replicated parameters."""
    from torch.distributed.tensor import DTensor, Replicate

    from engine import Trainer
    from engine.training.config import load_config
    over = [o for o in _shard_overrides("none", f"{run_dir}/tp{tp}{'_sp' if sp else ''}") if "parallel.data" not in o]
    over += ["parallel.data=1", f"parallel.tensor={tp}", f"parallel.sequence_parallel={str(sp).lower()}"]
    with Trainer(load_config(None, over)) as tr:
        for _ in range(SHARD_STEPS):
            tr.train_step()
        params = list({id(p): p for c in tr.model for p in c.parameters() if p.requires_grad}.values())
        sharded = [p for p in params if isinstance(p, DTensor) and not all(isinstance(x, Replicate)
                                                                           for x in p.placements)]
        state = [t for st in tr.optimizer.state.values() for t in st.values()]
        return {"rank": rank, "pp_rank": tr.pp_rank, "tp_rank": tr.pg.tensor_model_parallel_rank,
                "param_bytes": sum(_local_bytes(p) for p in params),
                "grad_bytes": sum(_local_bytes(p.grad) for p in params),
                "state_bytes": sum(_local_bytes(t) for t in state),
                "step_bytes": sum(_local_bytes(t) for t in state if t.dim() == 0),
                "sharded_full_elems": sum(p.numel() for p in sharded),
                "replicated_elems": sum(p.numel() for p in params) - sum(p.numel() for p in sharded)}


def tensor_rows(measured: dict) -> list[dict]:
    """One row per (layout, rank): bytes, their ratio to the T = 1 rank of the same pipeline stage, the ``1/T``
    theory and the exact ``(sharded / T + replicated) x 4`` bytes (fp32; AdamW: two moments + one step scalar per
    parameter tensor)."""
    rows = []
    base = {r["pp_rank"]: r for r in measured[(1, False)]}
    for (tp, sp), ranks in measured.items():
        for r in ranks:
            b = base[r["pp_rank"]]
            exact = 4 * (r["sharded_full_elems"] // tp + r["replicated_elems"])
            row = {"T": tp, "sequence_parallel": sp, **r, "theory_ratio": 1 / tp, "exact_param_bytes": exact,
                   "exact_state_bytes": 2 * exact + r["step_bytes"]}
            for kind in ("param", "grad", "state"):
                row[f"{kind}_ratio_to_T1"] = r[f"{kind}_bytes"] / b[f"{kind}_bytes"]
            row["exact"] = (r["param_bytes"] == exact == r["grad_bytes"]
                            and r["state_bytes"] == row["exact_state_bytes"])
            rows.append(row)
    return rows


def tensor_main(out: str | None) -> int:
    """The ``--tensor`` table: per-rank bytes at T = 1 and T = 2 against ``1/T`` and the exact count."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        measured = {(tp, sp): launch(tensor_job, 2 * tp, tp, sp, tmp) for tp, sp in TENSOR_LAYOUTS}
    rows = tensor_rows(measured)
    print(f"{'T':>2} {'sp':>3} {'rank':>4} {'stage':>5} {'params B':>9} {'grads B':>9} {'state B':>9} "
          f"{'exact params B':>14} {'ratio':>6} {'1/T':>5} {'exact':>5}")
    for r in rows:
        print(f"{r['T']:>2} {'y' if r['sequence_parallel'] else 'n':>3} {r['rank']:>4} {r['pp_rank']:>5} "
              f"{r['param_bytes']:>9} {r['grad_bytes']:>9} {r['state_bytes']:>9} {r['exact_param_bytes']:>14} "
              f"{r['param_ratio_to_T1']:>6.3f} {r['theory_ratio']:>5.2f} {'yes' if r['exact'] else 'NO':>5}")
    t2 = [r for r in rows if r["T"] == 2]
    met = all(r["exact"] for r in rows) and all(r["param_ratio_to_T1"] >= 0.5 for r in t2)
    goals = [{"goal": "per-rank parameter / gradient / AdamW-state bytes at T = 2: sharded / 2 + replicated, "
                      "exactly (theory 1/T = 0.5; replicated norms and biases put it slightly above)",
              "value": max(r["param_ratio_to_T1"] for r in t2), "met": met}]
    path = write_json("memory_tensor", {"rows": rows, "goals": goals,
                                        "layouts": [list(x) for x in TENSOR_LAYOUTS]}, out)
    print(f"wrote {path}")
    return 0 if met else 1


ESTIMATE_CASES = (  # (config file, overrides) of --estimate: unsplit schedules (a pending W is outside autograd)
    ("configs/default.yaml", []), ("configs/llama_tiny.yaml", []), ("configs/pp4_1f1b.yaml", []),
    ("configs/pp2_dp2_zero1.yaml", []),
    ("configs/default.yaml", ["parallel.pipeline=1", "parallel.virtual=1", "model.dropout=0.1"]),
    ("configs/llama_tiny.yaml", ["training.micro_batch_size=2", "training.num_microbatches=8"]),
)


class LiveSaved:
    """Bytes of the distinct storages autograd holds for backward passes, live now and at the peak (parameters
    and buffers left out): every saved tensor is packed into a handle counted per storage."""

    def __init__(self, skip: set[int]):
        self.skip, self.count, self.live, self.peak = skip, {}, 0, 0

    def hooks(self):
        meter = self

        class Held:
            __slots__ = ("t", "sizes")

            def __init__(self, t):
                self.t, self.sizes = t, storage_sizes(t)  # a wrapper tensor (DTensor): what it wraps
                for ptr, size in self.sizes.items():
                    if meter.count.get(ptr, 0) == 0:
                        meter.live += size
                    meter.count[ptr] = meter.count.get(ptr, 0) + 1
                meter.peak = max(meter.peak, meter.live)

            def __del__(self):
                for ptr, size in self.sizes.items():
                    meter.count[ptr] -= 1
                    if meter.count[ptr] == 0:
                        meter.live -= size

        def pack(t):
            return t if not storage_sizes(t).keys() - meter.skip else Held(t)
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t if isinstance(h, Held) else h)


def estimate_job(rank: int, world: int, path: str, overrides: list[str], run_dir: str) -> dict:
    """One rank of ``path`` + ``overrides``: two training steps with every chunk's forward under
    :class:`LiveSaved`; its static bytes (:func:`static_bytes`) and the peak saved-activation bytes."""
    from engine import Trainer
    from engine.training.config import load_config
    config = load_config(path, overrides + [f"logging.run_dir={run_dir}", "logging.level=WARNING",
                                            "logging.progress_bar=false", "data.max_bytes=300000"])
    with Trainer(config) as tr:
        meter = LiveSaved({ptr for c in tr.model for t in [*c.parameters(), *c.buffers()]
                           for ptr in storage_sizes(t)})
        for chunk in tr.model:
            def forward(*args, _inner=chunk.forward, **kwargs):
                with meter.hooks():
                    return _inner(*args, **kwargs)
            chunk.forward = forward
        for _ in range(2):
            tr.train_step()
        return {"rank": rank, "pp_rank": tr.pp_rank, **static_bytes(tr), "activation_peak_bytes": meter.peak}


FIT_CASES = tuple(("configs/default.yaml", [f"model.precision={p}", f"model.recompute={r}"])
                  for p in ("fp32", "bf16") for r in ("none", "selective", "full")) + (
    ("configs/default.yaml", ["model.precision=bf16", "model.recompute=full", "model.num_layers=6",
                              "model.pipeline_layout=Et|t*2|t*2|tL"]),
    ("configs/default.yaml", ["model.recompute=full", "model.recompute_kept_microbatches=2"]),)
"""``--fit``: the default config at precision x recompute, an uneven layout, and partial recomputation (issue 33's
memory table)."""


def estimate_main(out: str | None, cases=ESTIMATE_CASES, name: str = "memory_estimate") -> int:
    """The ``--estimate`` table (``--fit``: :data:`FIT_CASES`): :func:`engine.training.memory.estimate` against
    measured bytes per rank."""
    import tempfile

    from engine.training.config import load_config
    from engine.training.memory import estimate
    rows = []
    for path, overrides in cases:
        config = load_config(path, overrides)
        est = estimate(config, "cpu")
        with tempfile.TemporaryDirectory() as tmp:
            measured = launch(estimate_job, config.world_size, path, overrides, tmp)
        for r in measured:
            mine = est.ranks[r["pp_rank"]]
            row = {"config": " ".join([Path(path).stem, *overrides]), "rank": r["rank"], "pp_rank": r["pp_rank"],
                   "in_flight": mine.in_flight,
                   **{f"{k}_predicted": getattr(mine, k) for k in ("parameters", "gradients", "optimizer",
                                                                     "activations")},
                   "parameters_measured": r["param_bytes"], "gradients_measured": r["grad_bytes"] +
                   r["grad_shard_bytes"], "optimizer_measured": r["state_bytes"],
                   "activations_measured": r["activation_peak_bytes"]}
            row["activations_error"] = row["activations_predicted"] / row["activations_measured"] - 1
            row["static_exact"] = all(row[f"{k}_predicted"] == row[f"{k}_measured"]
                                      for k in ("parameters", "gradients", "optimizer"))
            rows.append(row)
            print(f"{row['config']:<58} rank {r['rank']}: params {r['param_bytes']:>9} / {mine.parameters:>9}  "
                  f"grads {row['gradients_measured']:>9} / {mine.gradients:>9}  optimizer {r['state_bytes']:>9} / "
                  f"{mine.optimizer:>9}  activations {r['activation_peak_bytes']:>10} / {mine.activations:>10} "
                  f"({100 * row['activations_error']:+.1f}%, {mine.in_flight} in flight)", flush=True)
    worst = max(abs(r["activations_error"]) for r in rows)
    goals = [{"goal": "activations predicted within 10% of the measured peak of saved tensors", "value": worst,
              "met": worst <= 0.10},
             {"goal": "parameter / gradient / optimizer bytes exact with parallel.shard none",
              "value": float(all(r["static_exact"] for r in rows if "zero1" not in r["config"])),
              "met": all(r["static_exact"] for r in rows if "zero1" not in r["config"])}]
    path = write_json(name, {"rows": rows, "goals": goals}, out)
    print(f"wrote {path} (measured / predicted bytes)")
    return 0 if all(g["met"] for g in goals) else 1


RECOMPUTE_SIZES = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=256)
RECOMPUTE_BATCH = 4


def _saved_bytes(chunk, tokens) -> dict:
    """Bytes of the distinct storages one forward of ``chunk`` saves for its backward (parameters excluded), per
    dtype of the saving tensor: ``{"float32": ..., "bfloat16": ...}``."""
    params = {ptr for p in chunk.parameters() for ptr in storage_sizes(p)}
    seen = {}

    def pack(t):
        for ptr, size in storage_sizes(t).items():
            if ptr not in params:
                seen[ptr] = (str(t.dtype).replace("torch.", ""), size)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk(tokens)
    out: dict = {}
    for dtype, n in seen.values():
        out[dtype] = out.get(dtype, 0) + n
    return out


def _median_ms(fn, repeats: int = 15) -> float:
    import statistics
    import time
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def recompute_row(dtype, granularity: str):
    """One row of ``--recompute``: a middle-stage GPT chunk (blocks only) at ``dtype`` with ``granularity``."""
    from engine.runtime.recompute import apply_recompute
    from engine.training.config import ModelConfig
    from engine.training.models.chunk import build_model_chunks
    cfg = ModelConfig(**RECOMPUTE_SIZES)
    chunk = build_model_chunks(cfg, 4 * cfg.hidden_size, 3, 1, 1, seed=0)[0].to(dtype)  # stage 1 of 3: blocks only
    cores = [getattr(b, "core", None) for b in chunk.layers]
    if granularity == "selective" and None in cores:
        return None
    apply_recompute(chunk.layers if granularity == "full" else cores if granularity == "selective" else [])
    s, b, h = cfg.seq_length, RECOMPUTE_BATCH, cfg.hidden_size
    x = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
    chunk.set_input_tensor(x)
    saved = _saved_bytes(chunk, None)
    n = len(chunk.layers)
    grad = torch.randn(s, b, h, dtype=dtype)
    forward = _median_ms(lambda: chunk(None))
    step = _median_ms(lambda: chunk(None).backward(grad))
    element = torch.tensor([], dtype=dtype).element_size()
    return {"precision": str(dtype).replace("torch.", ""), "recompute": granularity, "layers": n,
            "saved_bytes_per_layer": sum(saved.values()) / n, "fp32_saved_bytes_per_layer": saved.get("float32", 0) / n,
            "layer_input_bytes": s * b * h * element, "forward_ms": forward, "forward_backward_ms": step}


def recompute_main(out: str | None) -> int:
    """The ``--recompute`` table (module doc)."""
    torch.set_num_threads(1)
    rows = [r for dtype in (torch.float32, torch.bfloat16) for g in ("none", "selective", "full")
            if (r := recompute_row(dtype, g)) is not None]
    print(f"{'precision':>9} {'recompute':>9} {'saved B/layer':>13} {'input B':>8} {'F ms':>7} {'F+B ms':>7}")
    for r in rows:
        print(f"{r['precision']:>9} {r['recompute']:>9} {r['saved_bytes_per_layer']:>13.0f} "
              f"{r['layer_input_bytes']:>8} {r['forward_ms']:>7.2f} {r['forward_backward_ms']:>7.2f}")
    full = [r for r in rows if r["recompute"] == "full"]
    by = {(r["precision"], r["recompute"]): r["saved_bytes_per_layer"] for r in rows}
    stats = next(r["fp32_saved_bytes_per_layer"] for r in rows if r["precision"] == "bfloat16" and
                 r["recompute"] == "none")  # fp32 tensors a bf16 forward saves: the attention's log-sum-exp
    goals = [{"goal": "full recomputation saves exactly the layer input (s*b*h elements) per layer and microbatch",
              "value": max(r["saved_bytes_per_layer"] / r["layer_input_bytes"] for r in full),
              "met": all(r["saved_bytes_per_layer"] == r["layer_input_bytes"] for r in full)},
             {"goal": "bf16 activations saved per layer are half of fp32's (the attention's fp32 log-sum-exp kept whole)",
              "value": by[("bfloat16", "none")] / by[("float32", "none")],
              "met": (by[("bfloat16", "none")] - stats) * 2 + stats == by[("float32", "none")]}]
    for g in goals:
        print(f"{'met' if g['met'] else 'MISSED'}: {g['goal']} ({g['value']:.3f})")
    path = write_json("memory_recompute", {"rows": rows, "goals": goals, "sizes": {**RECOMPUTE_SIZES,
                                                                                    "micro_batch_size": RECOMPUTE_BATCH}},
                      out)
    print(f"wrote {path}")
    return 0 if all(g["met"] for g in goals) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--sharding", action="store_true", help="only the parallel.shard table (pp2 x dp2, 4 ranks)")
    ap.add_argument("--tensor", action="store_true", help="only the parallel.tensor table (pp2 x tp1 / tp2)")
    ap.add_argument("--estimate", action="store_true",
                    help="only engine.training.memory's estimate against measured bytes per rank (presets)")
    ap.add_argument("--recompute", action="store_true", help="only the recomputation x precision table (1 process)")
    ap.add_argument("--fit", action="store_true", help="only the estimate against measured bytes per rank for "
                    "model.precision x model.recompute and an uneven model.pipeline_layout")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.estimate or args.fit:
        return estimate_main(args.out, FIT_CASES if args.fit else ESTIMATE_CASES,
                             "memory_fit" if args.fit else "memory_estimate")
    if args.recompute:
        return recompute_main(args.out)
    if args.sharding:
        return sharding_main(args.out)
    if args.tensor:
        return tensor_main(args.out)
    from engine.plan import build_plan
    from engine.plan.simulate import simulate
    rows = []
    for pp, chunks, schedule in CASES:
        w = Workload(hidden=512, layers=8, sequences=2 * args.microbatches, seq_length=64,
                     microbatches=args.microbatches)
        name = schedule or ("interleaved" if chunks > 1 else "1f1b")
        plan = build_plan(name, pp, w.microbatches, chunks)
        sim = simulate(plan, 1.0, 1.0, 0.0, 1.0) if schedule else simulate(plan)
        th = live_saved(plan) if schedule else theory(pp, chunks, w.microbatches)
        res = {d: launch(job, pp, chunks, d, w, schedule) for d in (False, True)}
        measured = [r["peak_in_flight"] for r in res[False]]
        expected_sim = th if schedule else list(sim.peak_in_flight)
        row = {"pp": pp, "chunks": chunks, "schedule": name, "microbatches": w.microbatches, "theory": th,
               "simulator": list(sim.peak_in_flight), "simulator_pending_w": list(sim.peak_pending_w),
               "measured": measured, "measured_dealloc": [r["peak_in_flight"] for r in res[True]],
               "exact": measured == th == expected_sim and [r["peak_in_flight"] for r in res[True]] == th,
               "output_bytes": res[False][0]["output_bytes"],
               "sent_output_bytes_peak": [r["peak_output_bytes"] for r in res[False]],
               "sent_output_bytes_peak_dealloc": [r["peak_output_bytes"] for r in res[True]],
               "leaked_after_step": [r["live_after_step"] for r in res[False] + res[True]]}
        rows.append(row)
        print(f"{name} pp={pp} vp={chunks} m={w.microbatches}: live measured {measured} theory {th} simulator "
              f"in-flight {row['simulator']} pending W {row['simulator_pending_w']} "
              f"{'exact' if row['exact'] else 'MISMATCH'}; sent-output bytes peak "
              f"{row['sent_output_bytes_peak']} -> {row['sent_output_bytes_peak_dealloc']} with deallocation "
              f"(one output {row['output_bytes']} B)", flush=True)
    goals = [{"goal": "peak in-flight activations exactly the theory", "value": float(all(r["exact"] for r in rows)),
              "met": all(r["exact"] for r in rows)}]
    path = write_json("memory", {"rows": rows, "goals": goals}, args.out)
    print(f"wrote {path}")
    return 0 if goals[0]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
