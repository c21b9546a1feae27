"""Eager vs ordered CUDA graphs (``torch`` backend) on one GPU: bitwise equality, step time, memory.

One pipeline rank of an interleaved schedule (default PP=2 x VP=2, rank 0, 8 microbatches) runs in a single process:
its model chunks get fixed "received" activations and gradients (``graphs.local_rank``), so the graphs see the same
passes, order and buffer lifetimes as in a real pipeline.  Two configurations:

* ``launch``: small hidden size, many layers per chunk (kernel-launch bound; graphs should win clearly);
* ``compute``: large hidden size (GEMM bound; expect about 1.0x).

For each: eager and graphed copies of the same model train ``--check-steps`` SGD steps on the same data and every
per-microbatch loss, chunk-input gradient and parameter gradient is compared bitwise; then ``--steps`` timed steps
each (median ms per step, speedup), the peak *reserved* memory of one step each (``max_memory_reserved``: what the
caching allocator took from the driver, graph pools included -- allocated bytes would miss a pool's free blocks)
and what the capture holds: ``memory_reserved`` added by it and the graph pool's segments
(``graphs.accounting.pool_bytes``; on CPU the emulate backend's model of the pool).  ``launch`` also
runs a negative control (one graph per layer shared by all microbatches, which must NOT match) and, if Transformer
Engine is importable, the same comparison through ``backend="te"``.

Before that, on any machine: ``[memory NAME]`` lines -- the bytes the captured graphs of one rank hold with the
pre-issue-17 layout (a parameter-gradient copy and separate static buffers per slot) and the current one (one
gradient buffer per parameter, chained buffers), against the eager step's peak, counted on the ``meta`` device
(``graphs.accounting``; ``gpu_cuda_graphs`` is ``configs/gpu_cuda_graphs.yaml``'s rank 0) -- and a ``[replay host
work]`` line: aten ops outside each emulated replay and CPU time per replay against eager.

Without CUDA the graph part is skipped (said so in the output and the JSON); the emulate backend then runs a tiny
version so the script itself is exercised.  Exit status: 0 when every compared run is bitwise equal (within
``--tolerance``) and the negative control is detected, 1 otherwise.

    python benchmarks/cuda_graphs_bench.py --json cuda_graphs_bench.json
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import torch  # noqa: E402
from torch import nn  # noqa: E402

from engine.plan import build_plan  # noqa: E402
from graphs import capture  # noqa: E402
from graphs.capture import DebugOptions  # noqa: E402
from graphs.local_rank import make_rank_data, run_rank_step  # noqa: E402
from graphs.accounting import LiveBytes, OpCounter, held_bytes, pool_bytes  # noqa: E402
from graphs.backends import emulate as emulate_backend  # noqa: E402

CONFIGS = {  # name: hidden, ffn, seq, micro batch, layers per chunk
    "launch": dict(hidden=256, ffn=1024, seq=128, mbs=2, layers=8),
    "compute": dict(hidden=4096, ffn=16384, seq=2048, mbs=2, layers=1),
    "cpu_tiny": dict(hidden=16, ffn=32, seq=4, mbs=2, layers=2),
}


class Block(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear, plus the residual: ``[s, b, h] -> [s, b, h]``."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def build(cfg: dict, chunks: int, device, dtype, seed: int = 0):
    torch.manual_seed(seed)
    return [[Block(cfg["hidden"], cfg["ffn"]).to(device=device, dtype=dtype) for _ in range(cfg["layers"])]
            for _ in range(chunks)]


def params(model):
    return [p for chunk in model for layer in chunk for p in layer.parameters()]


@torch.no_grad()
def sgd(model, lr=1e-3):
    for p in params(model):
        if p.grad is not None:
            p.add_(p.grad, alpha=-lr)
            p.grad = None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(model, plan, rank, data, steps):
    """``steps`` SGD steps; per step the losses, input grads and parameter grads (cloned)."""
    out = []
    for _ in range(steps):
        r = run_rank_step(model, plan, rank, data)
        out.append((r, [p.grad.clone() for p in params(model)]))
        sgd(model)
    return out


def compare(ref, got) -> dict:
    """Bitwise flags and the largest relative difference over losses, input grads and parameter grads."""
    flags = {"losses": True, "input_grads": True, "param_grads": True}
    worst = 0.0
    for (ra, ga), (rb, gb) in zip(ref, got):
        pairs = [("losses", ra.losses[k], rb.losses[k]) for k in ra.losses]
        pairs += [("input_grads", ra.input_grads[k], rb.input_grads[k]) for k in ra.input_grads]
        pairs += [("param_grads", a, b) for a, b in zip(ga, gb)]
        for kind, a, b in pairs:
            if not torch.equal(a, b):
                flags[kind] = False
                scale = a.float().abs().max().item() or 1.0
                worst = max(worst, (a.float() - b.float()).abs().max().item() / scale)
    return {**flags, "bitwise": all(flags.values()), "max_rel_diff": worst}


def time_steps(model, plan, rank, data, steps, device) -> float:
    """Median wall time of one step (forward/backward of every action), grads dropped in between (ms)."""
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        run_rank_step(model, plan, rank, data)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        for p in params(model):
            p.grad = None
    return statistics.median(times)


def peak_step_mib(model, plan, rank, data, device) -> float | None:
    """Peak reserved memory during one step (MiB; ``None`` without CUDA)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_rank_step(model, plan, rank, data)
    sync(device)
    for p in params(model):
        p.grad = None
    return torch.cuda.max_memory_reserved(device) / 2 ** 20


def reserved_mib(device) -> float:
    """``memory_reserved`` now, after a sync and ``empty_cache`` (MiB; 0 without CUDA)."""
    if device.type != "cuda":
        return 0.0
    sync(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device) / 2 ** 20


def run_config(name: str, cfg: dict, args, device, dtype, backend: str) -> dict:
    plan = build_plan("interleaved", args.pp, args.microbatches, args.vp, args.group)
    rank = args.rank
    data = make_rank_data(args.vp, args.microbatches, (cfg["seq"], cfg["mbs"], cfg["hidden"]), dtype, device)
    eager = build(cfg, args.vp, device, dtype)
    graphed = copy.deepcopy(eager)
    res: dict = {"config": cfg, "backend": backend, "pp": args.pp, "vp": args.vp, "rank": rank,
                 "microbatches": args.microbatches, "order": plan.te_order(rank)}

    # warm up cuBLAS/allocator on a throwaway copy, so the eager reference is not the first run
    scratch = copy.deepcopy(eager)
    run_rank_step(scratch, plan, rank, data)
    del scratch

    sample = [(torch.ones(cfg["seq"], cfg["mbs"], cfg["hidden"], device=device, dtype=dtype, requires_grad=True),)
              for _ in range(args.vp * args.microbatches * cfg["layers"])]
    mem0 = reserved_mib(device)
    t0 = time.perf_counter()
    layers = capture(graphed, plan, rank, sample, backend=backend, num_warmup_iters=args.warmup_iters,
                     tracer=args.tracer)
    sync(device)
    res["capture_s"] = time.perf_counter() - t0
    res["capture_reserved_mib"] = reserved_mib(device) - mem0 if device.type == "cuda" else None
    pool = pool_bytes(layers.graphs)
    res["pool_mib"] = {k: v / 2 ** 20 for k, v in pool.items() if k != "segments"} if pool else None
    res["pool_segments"] = pool.get("segments") if pool else None
    res["graphs_active"] = layers.active
    res["num_graph_pairs"] = layers.report.num_graphs
    res["fallback_reason"] = layers.report.reason
    if not layers.active:
        print(f"[{name}] capture fell back to eager: {layers.report.reason}")
        if layers.report.traceback:
            print(layers.report.traceback)
            res["traceback"] = layers.report.traceback
        res["ok"] = False
        return res

    ref = train(eager, plan, rank, data, args.check_steps)
    got = train(graphed, plan, rank, data, args.check_steps)
    res["graph_vs_eager"] = compare(ref, got)
    if name != "compute":  # eager twice: is eager itself deterministic here?
        again = build(cfg, args.vp, device, dtype)
        res["eager_vs_eager"] = compare(ref, train(again, plan, rank, data, args.check_steps))

    res["eager_ms"] = time_steps(eager, plan, rank, data, args.steps, device)
    res["graph_ms"] = time_steps(graphed, plan, rank, data, args.steps, device)
    res["speedup"] = res["eager_ms"] / res["graph_ms"] if res["graph_ms"] else None
    res["eager_peak_mib"] = peak_step_mib(eager, plan, rank, data, device)
    res["graph_peak_mib"] = peak_step_mib(graphed, plan, rank, data, device)
    diff = res["graph_vs_eager"]
    res["ok"] = diff["bitwise"] or diff["max_rel_diff"] <= args.tolerance

    if name in ("launch", "cpu_tiny"):
        res["negative_control"] = negative_control(cfg, args, device, dtype, backend, plan, rank, data)
        res["ok"] = res["ok"] and res["negative_control"]["detected"]
        if device.type == "cuda" and not args.no_te:
            res["te"] = te_comparison(cfg, args, device, dtype, plan, rank, data)
    layers.remove()
    return res


def negative_control(cfg, args, device, dtype, backend, plan, rank, data) -> dict:
    """One graph per layer shared by all microbatches (wrong with >1 microbatch in flight) must differ."""
    eager = build(cfg, args.vp, device, dtype, seed=1)
    shared = copy.deepcopy(eager)
    sample = [(torch.ones(cfg["seq"], cfg["mbs"], cfg["hidden"], device=device, dtype=dtype, requires_grad=True),)
              for _ in range(args.vp * args.microbatches * cfg["layers"])]
    layers = capture(shared, plan, rank, sample, backend=backend, share_graphs=True,
            _debug=DebugOptions(allow_unsafe_sharing=True))
    diff = compare(train(eager, plan, rank, data, 1), train(shared, plan, rank, data, 1))
    layers.remove()
    return {"detected": not diff["bitwise"], "max_rel_diff": diff["max_rel_diff"]}


def te_comparison(cfg, args, device, dtype, plan, rank, data) -> dict:
    from graphs.backends.te import te_unavailable_reason
    reason = te_unavailable_reason()
    if reason is not None:
        return {"skipped": reason}
    try:
        eager = build(cfg, args.vp, device, dtype, seed=2)
        graphed = copy.deepcopy(eager)
        sample = [(torch.ones(cfg["seq"], cfg["mbs"], cfg["hidden"], device=device, dtype=dtype,
                              requires_grad=True),) for _ in range(args.vp * args.microbatches * cfg["layers"])]
        layers = capture(graphed, plan, rank, sample, backend="te")
        if not layers.active:
            return {"skipped": layers.report.reason}
        diff = compare(train(eager, plan, rank, data, args.check_steps),
                       train(graphed, plan, rank, data, args.check_steps))
        out = {"graph_vs_eager": diff, "features": layers.report.te_features,
               "eager_ms": time_steps(eager, plan, rank, data, args.steps, device),
               "graph_ms": time_steps(graphed, plan, rank, data, args.steps, device)}
        layers.remove()
        return out
    except Exception as exc:  # noqa: BLE001 - report, never abort the benchmark for the optional TE part
        return {"error": f"{type(exc).__name__}: {exc}"}


MEMORY_CONFIGS = {  # name: layer kind, hidden, ffn, heads, seq, micro batch, layers per chunk, pp, vp, microbatches
    "launch": ("mlp", 256, 1024, 0, 128, 2, 8, 2, 2, 8),
    "compute": ("mlp", 4096, 16384, 0, 2048, 2, 1, 2, 2, 8),
    "gpu_cuda_graphs": ("gpt", 1024, 4096, 16, 1024, 8, 2, 4, 2, 16),  # configs/gpu_cuda_graphs.yaml, one rank
}


def _memory_layers(kind, hidden, ffn, heads, seq, chunks, layers):
    if kind == "mlp":
        return [[Block(hidden, ffn).to("meta") for _ in range(layers)] for _ in range(chunks)]
    from engine.training.config import ModelConfig
    from engine.training.models.gpt2.layers import Block as GPTBlock
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq)
    return [[GPTBlock(cfg, ffn).to("meta") for _ in range(layers)] for _ in range(chunks)]


def memory_figures(name: str, rank: int = 0) -> dict:
    """Bytes the captured graphs of pipeline rank ``rank`` hold (``graphs.accounting.held_bytes``, emulate backend
    on the ``meta`` device: shapes only, nothing allocated) with the pre-issue-17 layout (a parameter-gradient copy
    and separate static buffers per slot) and the current one, against the eager step's peak (``LiveBytes``).
    fp32 throughout (the GPU preset's bf16 autocast keeps parameters, gradients and the residual stream fp32; its
    saved activations would be bf16, so the eager peak here is an upper bound)."""
    kind, hidden, ffn, heads, seq, mbs, n_layers, pp, vp, m = MEMORY_CONFIGS[name]
    plan = build_plan("interleaved" if vp > 1 else "1f1b", pp, m, vp, pp if vp > 1 else None)
    data = make_rank_data(vp, m, (seq, mbs, hidden), device="meta")
    eager = _memory_layers(kind, hidden, ffn, heads, seq, vp, n_layers)
    with LiveBytes() as live:
        run_rank_step(eager, plan, rank, data)
    out = {"eager_step_peak": live.peak, "layers_per_rank": vp * n_layers, "microbatches": m}
    for layout, kwargs in (("before", dict(chain_layers=False, _debug=DebugOptions(param_grads="clone"))),
                           ("after", {})):
        graphed = _memory_layers(kind, hidden, ffn, heads, seq, vp, n_layers)
        sample = [(torch.ones(seq, mbs, hidden, device="meta", requires_grad=True),)
                  for _ in range(vp * m * n_layers)]
        layers = capture(graphed, plan, rank, sample, backend="emulate", **kwargs)
        if not layers.active:
            raise RuntimeError(f"memory figures for {name}: capture fell back: {layers.report.reason}")
        out[layout] = held_bytes(layers.graphs)
        layers.remove()
    return out


def print_memory(names) -> dict:
    figures = {}
    for name in names:
        f = figures[name] = memory_figures(name)
        gib = 2 ** 30
        print(f"[memory {name}] {f['layers_per_rank']} layers/rank x M={f['microbatches']}: graphs hold "
              f"{f['before']['total'] / gib:.2f} GiB before -> {f['after']['total'] / gib:.2f} GiB now "
              f"(of which {f['after']['param_grad_buffers'] / gib:.2f} GiB gradient buffers = eager's .grad); "
              f"eager step peak {f['eager_step_peak'] / gib:.2f} GiB")
    return figures


def _none_grads(model) -> None:
    for p in params(model):
        p.grad = None


def _replays_paused(counter: OpCounter | None):
    """Patch the emulated replays: uncounted by ``counter``, or (``None``) no-ops, leaving the host work around."""
    saved = emulate_backend.EmulatedSlot.replay_forward, emulate_backend.EmulatedSlot.replay_backward

    def wrap(fn):
        def run(slot):
            if counter is not None:
                with counter.paused():
                    fn(slot)
        return run
    emulate_backend.EmulatedSlot.replay_forward, emulate_backend.EmulatedSlot.replay_backward = map(wrap, saved)
    return saved


def replay_overhead(steps: int = 10) -> dict:
    """Host work per replay on the emulate backend (CPU): aten ops outside the replays (a dispatch-mode counter)
    and CPU time per replay with the replay itself a no-op (driver included), next to eager per layer pass."""
    cfg, vp, m = CONFIGS["cpu_tiny"], 2, 4
    cfg = dict(cfg, layers=4)
    plan = build_plan("interleaved", 2, m, vp, 2)
    data = make_rank_data(vp, m, (cfg["seq"], cfg["mbs"], cfg["hidden"]))
    eager = build(cfg, vp, torch.device("cpu"), torch.float32)
    graphed = copy.deepcopy(eager)
    sample = [(torch.ones(cfg["seq"], cfg["mbs"], cfg["hidden"], requires_grad=True),) for _ in range(vp * m * 4)]
    layers = capture(graphed, plan, 0, sample, backend="emulate")
    replays, counter, eager_ops = 2 * vp * m * cfg["layers"], OpCounter(), OpCounter()
    saved = _replays_paused(counter)
    try:
        run_rank_step(graphed, plan, 0, data)
        _none_grads(graphed)
        with counter:
            run_rank_step(graphed, plan, 0, data)
        _none_grads(graphed)
        with eager_ops:
            run_rank_step(eager, plan, 0, data)
        _none_grads(eager)
        _replays_paused(None)
        graph_s, eager_s = _cpu_seconds(graphed, plan, data, steps), _cpu_seconds(eager, plan, data, steps)
    finally:
        emulate_backend.EmulatedSlot.replay_forward, emulate_backend.EmulatedSlot.replay_backward = saved
    layers.remove()
    return {"ops_per_replay": counter.total / replays, "ops": dict(sorted(counter.counts.items())),
            "eager_ops_per_layer_pass": eager_ops.total / replays, "host_us_per_replay": graph_s * 1e6 / replays,
            "eager_us_per_layer_pass": eager_s * 1e6 / replays}


def _cpu_seconds(model, plan, data, steps: int) -> float:
    """Median CPU time of this process per step (s): robust to other processes sharing the cores."""
    times = []
    for _ in range(steps):
        t0 = time.process_time()
        run_rank_step(model, plan, 0, data)
        times.append(time.process_time() - t0)
        _none_grads(model)
    return statistics.median(times)


def fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results to this path")
    ap.add_argument("--configs", default="launch,compute", help="comma-separated: launch, compute")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--vp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--group", type=int, default=None, help="microbatch_group_size_per_vp_stage (default pp)")
    ap.add_argument("--rank", type=int, default=0, help="which pipeline rank's order to run")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--check-steps", type=int, default=3, help="SGD steps compared bitwise")
    ap.add_argument("--warmup-iters", type=int, default=1, help="warmup rounds inside the capture")
    ap.add_argument("--tolerance", type=float, default=0.0, help="max relative difference accepted (0: bitwise)")
    ap.add_argument("--no-te", action="store_true", help="skip the optional Transformer Engine comparison")
    ap.add_argument("--memory", default="launch,compute,gpu_cuda_graphs",
                    help="configs of the memory accounting (meta device, runs without a GPU); empty: skip")
    ap.add_argument("--memory-only", action="store_true", help="print the memory accounting and exit")
    ap.add_argument("--nvtx", action="store_true",
                    help="NVTX range per graph replay (engine.profiling.nvtx_ranges), for nsys --cuda-graph-trace=node")
    args = ap.parse_args(argv)

    memory = print_memory([n for n in args.memory.split(",") if n]) if args.memory else {}
    if args.memory_only:
        return 0
    overhead = replay_overhead()
    print(f"[replay host work] {overhead['ops_per_replay']:.2f} aten ops outside each replay {overhead['ops']}, "
          f"{overhead['host_us_per_replay']:.1f} us CPU per replay (replay a no-op, driver included) vs eager "
          f"{overhead['eager_ops_per_layer_pass']:.1f} ops / {overhead['eager_us_per_layer_pass']:.1f} us per layer "
          f"pass")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    args.tracer = None
    if args.nvtx:
        from engine.profiling.nvtx_ranges import NvtxTracer
        args.tracer = NvtxTracer()
    dtype = getattr(torch, args.dtype)
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "dtype": args.dtype, "argv": sys.argv[1:], "configs": {}, "memory_bytes": memory,
                    "replay_overhead": overhead,
                    "notes": "eager_peak_mib / graph_peak_mib: max_memory_reserved during one step of each copy (what "
                             "the caching allocator holds from the driver, everything in the process: both model "
                             "copies, the graph pool); capture_reserved_mib: memory_reserved added by capturing "
                             "(after empty_cache on both sides); pool_mib: the graph pool's segments "
                             "(reserved, allocated; graphs.accounting.pool_bytes; CPU: the emulate pool model)"}
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        names, backend = [c.strip() for c in args.configs.split(",") if c.strip()], "torch"
        report["skipped_graphs"] = False
    else:
        print("no CUDA device: skipping the CUDA-graph part; running a tiny emulate-backend check of the script")
        names, backend, dtype = ["cpu_tiny"], "emulate", torch.float32
        args.steps, args.microbatches = min(args.steps, 3), min(args.microbatches, 4)
        report["skipped_graphs"] = True
        torch.set_num_threads(1)
    for name in names:
        if name not in CONFIGS:
            ap.error(f"unknown config {name!r}; use launch, compute")
        t0 = time.perf_counter()
        try:
            res = run_config(name, CONFIGS[name], args, device, dtype, backend)
        except Exception as exc:  # noqa: BLE001 - keep going: report the error, the other config and the JSON
            import traceback
            traceback.print_exc()
            res = {"config": CONFIGS[name], "ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "num_graph_pairs": 0, "capture_s": 0.0, "capture_reserved_mib": None, "pool_mib": None}
        res["wall_s"] = time.perf_counter() - t0
        report["configs"][name] = res
        if device.type == "cuda":
            torch.cuda.empty_cache()
        d = res.get("graph_vs_eager", {})
        pool = res.get("pool_mib") or {}
        print(f"[{name}] {res['config']} backend={backend} graphs={res['num_graph_pairs']} "
              f"capture={res['capture_s']:.2f}s reserved by capture={fmt(res['capture_reserved_mib'], '.1f')}MiB "
              f"pool reserved={fmt(pool.get('reserved'), '.3f')}MiB allocated={fmt(pool.get('allocated'), '.3f')}MiB")
        print(f"[{name}] graph_vs_eager bitwise={d.get('bitwise')} losses={d.get('losses')} "
              f"input_grads={d.get('input_grads')} param_grads={d.get('param_grads')} "
              f"max_rel_diff={fmt(d.get('max_rel_diff'), '.3g')}")
        if "eager_vs_eager" in res:
            print(f"[{name}] eager_vs_eager bitwise={res['eager_vs_eager']['bitwise']}")
        print(f"[{name}] step eager={fmt(res.get('eager_ms'))}ms graph={fmt(res.get('graph_ms'))}ms "
              f"speedup={fmt(res.get('speedup'), '.2f')}x peak reserved eager={fmt(res.get('eager_peak_mib'), '.1f')}MiB"
              f" graph={fmt(res.get('graph_peak_mib'), '.1f')}MiB")
        if "negative_control" in res:
            print(f"[{name}] negative_control (shared graph per layer) detected={res['negative_control']['detected']}")
        if "te" in res:
            print(f"[{name}] te: {json.dumps(res['te'], default=str)}")
        print(f"[{name}] {'PASS' if res['ok'] else 'FAIL'} in {res['wall_s']:.1f}s")
    ok = all(r["ok"] for r in report["configs"].values())
    report["status"] = "PASS" if ok else "FAIL"
    print(f"STATUS overall {report['status']}" + (" (graph part skipped: no CUDA)" if not cuda else ""))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
