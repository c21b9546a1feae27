"""Mixture of experts: all-to-all bytes, DualPipeV's overlapped cells on CPU, and the simulator's gain at GPU costs.

Three parts (``--part``, default all):

* ``bytes`` -- one MoE layer (``engine.moe.MoELayer``) forward + backward on ``P`` gloo ranks of one expert-parallel
  group: the bytes its all-to-alls send to other ranks, measured by ``engine.moe.A2A_TRAFFIC``, against the theory
  for top-``k`` routing, ``T x k x h x d x (P-1)/P`` per exchange (four exchanges per step: dispatch and combine,
  forward and backward), with balanced routing (every expert gets ``T k / E`` slots: the theory exactly) and random
  routing (the theory in expectation).
* ``overlap`` -- pipeline 2 x expert 2 on 4 gloo ranks (a block ``x + tanh(mix(x))``, ``+ MoE(norm(x))`` per
  virtual stage, DualPipeV), steps alternating overlap off / on (``overlap_moe_expert_parallel_comm``): median step
  time of each, and one step with overlap on recorded (``engine.profiling``): a Chrome trace and a two-lane picture
  per rank (compute turns; expert all-to-alls in flight), with the count of all-to-alls in flight across the other
  microbatch's compute.  On this machine (few cores, shared; gloo moves the rows with the same cores that compute)
  the overlap cannot buy much: the figures say what it costs or saves here, not on GPUs.
* ``simulate`` -- the simulator (``engine.plan.simulate``) at GPU-like costs per chunk (F = B = W = 1, all-to-all
  0.5 / 1.0 / 1.5 each way): 1F1B, interleaved (combined 1F1B with overlap), ZB-V and DualPipeV without and with
  overlap, P = 4 / 8.

    python benchmarks/moe_overlap.py                   # all parts
    python benchmarks/moe_overlap.py --part overlap --steps 6
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, launch, median, write_json  # noqa: E402


# ---- bytes ------------------------------------------------------------------------------------------------------
def bytes_job(rank: int, world: int, hidden: int, tokens: int, experts: int, top_k: int, routing: str, dtype: str):
    import torch

    from engine.moe import A2A_TRAFFIC, MoELayer
    from engine.runtime.process_groups import build_process_groups
    pgc = build_process_groups(1, expert_model_parallel_size=world)
    torch.manual_seed(0)
    layer = MoELayer(hidden, hidden, experts, top_k, ep_group=pgc.ep).to(getattr(torch, dtype))
    g = torch.Generator().manual_seed(rank)
    if routing == "balanced":  # identity router on one-hot-like tokens: token t -> experts t, t+1, ... (mod E)
        with torch.no_grad():
            layer.router.linear.weight.copy_(torch.eye(experts, hidden))
        x = torch.zeros(tokens, hidden)
        for t in range(tokens):
            for j in range(top_k):
                x[t, (t + j) % experts] = float(top_k - j)
    else:
        x = torch.randn(tokens, hidden, generator=g)
    x = x.to(getattr(torch, dtype)).requires_grad_()
    A2A_TRAFFIC.reset()
    layer(x).float().square().mean().backward()
    return A2A_TRAFFIC.bytes_sent, A2A_TRAFFIC.exchanges


def run_bytes(args) -> list:
    rows = []
    for ep, top_k, dtype, routing in ((2, 2, "float32", "balanced"), (4, 2, "float32", "balanced"),
                                      (4, 1, "float32", "balanced"), (4, 2, "bfloat16", "balanced"),
                                      (4, 2, "float32", "random")):
        experts, hidden, tokens = 8, args.hidden, args.tokens
        per_rank = launch(bytes_job, ep, hidden, tokens, experts, top_k, routing, dtype)
        size = 2 if dtype == "bfloat16" else 4
        theory = tokens * top_k * hidden * size * (ep - 1) / ep
        measured = sum(b for b, _ in per_rank) / len(per_rank) / per_rank[0][1]
        rows.append({"ep": ep, "top_k": top_k, "dtype": dtype, "routing": routing, "tokens": tokens,
                     "hidden": hidden, "experts": experts, "exchanges_per_step": per_rank[0][1],
                     "measured_bytes_per_exchange": measured, "theory_bytes_per_exchange": theory,
                     "ratio": measured / theory, "per_rank_bytes_per_step": [b for b, _ in per_rank]})
        print(f"ep={ep} k={top_k} {dtype:8s} {routing:8s}: {measured:10.0f} B per exchange (theory {theory:10.0f},"
              f" ratio {measured / theory:.4f}); per step per rank {[b for b, _ in per_rank]}")
    return rows


# ---- overlap on the CPU -----------------------------------------------------------------------------------------
def _model(pgc, hidden: int, experts: int, microbatches: int, tokens: int):
    import torch
    from torch import nn

    from engine.model_parallel_config import ModelParallelConfig
    from engine.moe import MoELayer
    from engine.plan import build_plan

    class Block(nn.Module):
        def __init__(self, index):
            super().__init__()
            self.mix, self.norm = nn.Linear(hidden, hidden), nn.RMSNorm(hidden, eps=1e-6)
            self.moe = MoELayer(hidden, 2 * hidden, experts, 2, ep_group=pgc.ep, name=f"L{index}",
                                aux_loss_coeff=0.01)

        def forward(self, x):
            x = x + torch.tanh(self.mix(x))
            return x + self.moe(self.norm(x))

    class Chunk(nn.Module):
        def __init__(self, index, config, first):
            super().__init__()
            self.block, self.config, self.first, self.x = Block(index), config, first, None

        def set_input_tensor(self, tensors):
            self.x = tensors[0]

        def forward(self, x):
            return self.block(x if self.first else self.x)

    pp = pgc.pipeline_model_parallel_size
    config = ModelParallelConfig(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, hidden_size=hidden,
                                 num_moe_experts=experts)
    torch.manual_seed(1)
    plan = build_plan("dualpipev", pp, microbatches, 2)
    chunks = [Chunk(s, config, s == 0) for s in plan.stages_of(pgc.pipeline_model_parallel_rank)]
    return config, chunks


def overlap_job(rank: int, world: int, hidden: int, experts: int, microbatches: int, tokens: int, steps: int):
    import time

    import torch
    import torch.distributed as dist

    from engine import schedules
    from engine.profiling import TimelineRecorder
    from engine.runtime.process_groups import build_process_groups
    from engine.runtime.tracing import use_tracer
    pgc = build_process_groups(2, expert_model_parallel_size=2)
    config, chunks = _model(pgc, hidden, experts, microbatches, tokens)
    g = torch.Generator().manual_seed(pgc.data_parallel_rank)
    data = [(torch.randn(tokens, 1, hidden, generator=g), torch.randn(tokens, 1, hidden, generator=g))
            for _ in range(microbatches)]

    def step_fn(it, model):
        x, t = next(it)
        return model(x), lambda y: (((y - t) ** 2).mean(), {})

    def step():
        schedules.forward_backward_pipelining_with_schedule(
            schedule="dualpipev", forward_step_func=step_fn, data_iterator=[iter(data), iter(data)], model=chunks,
            num_microbatches=microbatches, seq_length=tokens, micro_batch_size=1,
            p2p_communicator=schedules.P2PCommunicator(pgc.pp, config), pg_collection=pgc)

    times = {False: [], True: []}
    for i in range(2 + 2 * steps):  # two warmup steps, then overlap off / on alternating
        config.overlap_moe_expert_parallel_comm = bool(i % 2)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times[bool(i % 2)].append(time.perf_counter() - t0)
    rec = TimelineRecorder(rank)
    config.overlap_moe_expert_parallel_comm = True
    rec.anchor(dist.group.WORLD)
    with use_tracer(rec), rec.step(0):
        step()
    spans = [(s.category, s.label, s.start_ns, s.end_ns, s.step, s.depth) for s in rec.spans()]
    return {"off": times[False], "on": times[True], "spans": spans}


def _hidden(spans) -> tuple[int, int]:
    """``(all-to-alls in flight across a compute turn of another action, all-to-alls)``."""
    comm = [s for s in spans if s[0] == "comm"]
    compute = [s for s in spans if s[0] == "compute"]
    hidden = sum(1 for c in comm if any(s[1] != c[1].split()[0] and c[2] <= s[2] and s[3] <= c[3] for s in compute))
    return hidden, len(comm)


def draw(rank_spans, path: Path, title: str) -> None:
    """Two lanes per rank: compute turns (F / B / W colours, cells' turns alternating) and the all-to-alls in
    flight (coloured by the microbatch's op that issued them)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    colours = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
    t0 = min(s[2] for spans in rank_spans for s in spans)
    fig = Figure(figsize=(16, 1.4 * len(rank_spans) + 1))
    ax = fig.add_subplot()
    for rank, spans in enumerate(rank_spans):
        base = (len(rank_spans) - 1 - rank) * 3
        for cat, label, start, end, _, depth in spans:
            if cat == "compute" and depth == 0:
                ax.broken_barh([((start - t0) / 1e6, (end - start) / 1e6)], (base + 1.5, 0.9),
                               color=colours.get(label[0], "grey"), edgecolor="black", linewidth=0.3)
            elif cat == "comm":
                ax.broken_barh([((start - t0) / 1e6, (end - start) / 1e6)], (base + 0.3, 0.9),
                               color=colours.get(label[0], "grey"), alpha=0.55, edgecolor="black", linewidth=0.3)
        ax.text(-0.01, base + 1.4, f"rank {rank}", transform=ax.get_yaxis_transform(), ha="right", va="center")
    ax.set_yticks([])
    ax.set_xlabel("ms (upper lane: compute turns; lower lane: expert all-to-alls in flight, by the issuing action: blue F, "
                  "orange B, grey outside a cell)")
    ax.set_title(title, fontsize=9)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def run_overlap(args) -> dict:
    from engine.profiling.chrome_trace import write_chrome_trace
    from engine.profiling.timeline import Span
    res = launch(overlap_job, 4, args.hidden, args.experts, args.microbatches, args.tokens, args.steps,
                 threads=1, timeout=1800)
    off = [max(r["off"][i] for r in res) for i in range(args.steps)]
    on = [max(r["on"][i] for r in res) for i in range(args.steps)]
    rank_spans = [r["spans"] for r in res]
    out = Path(args.out or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    trace = write_chrome_trace(out / "moe_overlap_timeline.json", [[Span(*s) for s in spans] for spans in rank_spans],
                               {"schedule": "dualpipev", "pp": 2, "ep": 2, "overlap_moe_expert_parallel_comm": True})
    counts = [_hidden(spans) for spans in rank_spans]
    title = (f"DualPipeV pp2 x ep2, {args.microbatches} microbatches, overlap on: all-to-alls in flight across the "
             f"other microbatch's compute per rank {[h for h, _ in counts]} of {[n for _, n in counts]}")
    draw(rank_spans, out / "moe_overlap_timeline.png", title)
    summary = {"step_ms_off": 1e3 * median(off), "step_ms_on": 1e3 * median(on), "steps_ms_off": [1e3 * t for t in off],
               "steps_ms_on": [1e3 * t for t in on], "hidden_all_to_alls": counts, "trace": trace.name,
               "picture": "moe_overlap_timeline.png"}  # beside the JSON (no machine's path in a result)
    print(f"DualPipeV pp2 x ep2 on CPU: median step {summary['step_ms_off']:.1f} ms overlap off, "
          f"{summary['step_ms_on']:.1f} ms on ({args.steps} steps each); hidden all-to-alls {counts}")
    return summary


# ---- simulator --------------------------------------------------------------------------------------------------
def run_simulate(args) -> list:
    from engine.plan import build_plan
    from engine.plan.simulate import simulate
    rows = []
    for pp, m in ((4, 16), (8, 32)):
        for a2a in (0.5, 1.0, 1.5):
            full = dict(forward_time=1.0, backward_time=2.0, a2a_time=a2a)
            split = dict(forward_time=1.0, backward_time=1.0, weight_time=1.0, a2a_time=a2a)
            cases = [("1f1b", 1, {}, full, False), ("interleaved", 2, {}, {**full, "forward_time": 0.5,
                                                                          "backward_time": 1.0, "a2a_time": a2a / 2},
                                                      False),
                     ("interleaved", 2, {"overlap_moe_expert_parallel_comm": True},
                      {**full, "forward_time": 0.5, "backward_time": 1.0, "a2a_time": a2a / 2}, True),
                     ("zbv", 2, {}, {k: v / 2 for k, v in split.items()}, False),
                     ("dualpipev", 2, {}, {k: v / 2 for k, v in split.items()}, False),
                     ("dualpipev", 2, {}, {k: v / 2 for k, v in split.items()}, True)]
            for name, chunks, opts, costs, overlap in cases:
                sim = simulate(build_plan(name, pp, m, chunks, **opts), **costs, overlap=overlap)
                rows.append({"pp": pp, "microbatches": m, "a2a_per_rank_stage_forward": a2a, "schedule": name,
                             "overlap": overlap, "makespan": sim.makespan, "bubble": sim.bubble_overall})
            best = {r["schedule"] + ("+overlap" if r["overlap"] else ""): r["makespan"] for r in rows[-len(cases):]}
            gain = 1 - best["dualpipev+overlap"] / best["dualpipev"]
            print(f"P={pp} M={m} a2a={a2a}: " + ", ".join(f"{k} {v:g}" for k, v in best.items())
                  + f"; DualPipeV overlap gain {100 * gain:.1f}%, vs ZB-V {100 * (1 - best['dualpipev+overlap'] / best['zbv']):.1f}%")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "bytes", "overlap", "simulate"), default="all")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank and microbatch")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="timed steps of each mode (overlap part)")
    p.add_argument("--out", default=None, help="folder for the trace and picture (default benchmarks/results)")
    args = p.parse_args()
    payload = {"settings": vars(args)}
    if args.part in ("all", "bytes"):
        payload["bytes"] = run_bytes(args)
    if args.part in ("all", "simulate"):
        payload["simulate"] = run_simulate(args)
    if args.part in ("all", "overlap"):
        payload["overlap"] = run_overlap(args)
    print(f"wrote {write_json('moe_overlap' if args.part == 'all' else f'moe_overlap_{args.part}', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
