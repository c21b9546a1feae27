"""Record the timeline of pipecast steps on the vs-torch workload: where does a step's time go?

Runs pipecast 1F1B or interleaved 1F1B (2 ranks on gloo, as ``vs_torch_pipelining.py``) with the timeline recorder
on, then writes to ``--out`` (default ``benchmarks/results/timeline_<schedule>``) the merged Chrome/Perfetto trace,
the Gantt chart of the slowest (or ``--step``) step with measured vs simulated bubble, and a summary JSON: per step
its time, per rank its compute / receive-wait / idle time, the receive waits longer than ``--stall-ms``, and the
floor: the plan simulated with the measured mean action costs and free communication (no engine on this machine can
step faster than that with the same schedule and the same per-action compute).

    python benchmarks/profile_step.py --chunks 2 --steps 20
    python benchmarks/profile_step.py --schedule zbv --chunks 2 --steps 20
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, Workload, launch, median  # noqa: E402


def job(rank: int, world: int, chunks: int, steps: int, warmup: int, options: dict, schedule=None):
    import torch.distributed as dist
    from benchmarks.engines import build_pipecast
    from engine.profiling import TimelineRecorder
    rec = TimelineRecorder(rank)
    engine = build_pipecast(rank, world, Workload(), chunks=chunks, tracer=rec, schedule=schedule, **options)
    for _ in range(warmup):
        engine.step()
    rec.anchor(dist.group.WORLD)
    for i in range(steps):
        dist.barrier()
        with rec.step(i):
            engine.step()
    return [(s.category, s.label, s.start_ns, s.end_ns, s.step, s.depth) for s in rec.spans()]


def analyse(rank_spans, stall_ms: float) -> dict:
    from engine.profiling.bubble import busy_ns, step_window, steps_of
    steps = steps_of(rank_spans)
    out = {"steps": [], "stalls": []}
    for s in steps:
        lo, hi = step_window(rank_spans, s)
        entry = {"step": s, "ms": (hi - lo) / 1e6, "ranks": []}
        for r, spans in enumerate(rank_spans):
            mine = [x for x in spans if x.step == s]
            wait = sum(x.duration_ns for x in mine if x.category == "p2p")
            busy = busy_ns(mine)
            entry["ranks"].append({"compute_ms": busy / 1e6, "p2p_wait_ms": wait / 1e6,
                                   "other_ms": (hi - lo - busy - wait) / 1e6})
            for x in mine:
                if x.category == "p2p" and x.duration_ns > stall_ms * 1e6:
                    out["stalls"].append({"step": s, "rank": r, "label": x.label, "ms": x.duration_ns / 1e6,
                                          "at_ms": (x.start_ns - lo) / 1e6})
        out["steps"].append(entry)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=1, help="1: 1F1B, 2: interleaved 1F1B")
    ap.add_argument("--schedule", default=None, choices=("zb_h1", "zbv"),
                    help="a split-backward schedule instead (zbv: --chunks 2)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--step", type=int, default=None, help="step to draw (default: the slowest)")
    ap.add_argument("--stall-ms", type=float, default=1.0, help="report receive waits longer than this")
    ap.add_argument("--config", nargs="*", default=[], help="ModelParallelConfig overrides, key=value (bool/int)")
    ap.add_argument("--pin", action="store_true", help="pin each rank to its own core")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from engine.plan import build_plan
    from engine.profiling import Span, write_chrome_trace
    from engine.profiling.gantt import plot_measured_timeline, simulated_bubble
    options = {}
    for kv in args.config:
        k, v = kv.split("=", 1)
        options[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
    schedule = args.schedule or ("interleaved" if args.chunks > 1 else "1f1b")
    out = Path(args.out or RESULTS / f"timeline_{schedule}")
    res = launch(job, 2, args.chunks, args.steps, args.warmup, options, args.schedule, pin=args.pin)
    rank_spans = [[Span(*t) for t in r] for r in res]
    plan = build_plan(schedule, 2, Workload().microbatches, args.chunks)
    summary = analyse(rank_spans, args.stall_ms)
    times = [s["ms"] for s in summary["steps"]]
    step = args.step if args.step is not None else max(summary["steps"], key=lambda s: s["ms"])["step"]
    out.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(out / "timeline.json", rank_spans, {"schedule": schedule, "config": options})
    chart = plot_measured_timeline(rank_spans, out / "timeline.png", plan, step)
    fast = min(summary["steps"], key=lambda s: s["ms"])["step"]
    chart_fast = plot_measured_timeline(rank_spans, out / "timeline_fastest.png", plan, fast)
    summary.update(median_ms=median(times), chart=chart, chart_fastest=chart_fast, config=options)
    print(f"{schedule}: step median {median(times):.1f} ms, min {min(times):.1f}, max {max(times):.1f}")
    for r in range(2):
        comp = median([s["ranks"][r]["compute_ms"] for s in summary["steps"]])
        wait = median([s["ranks"][r]["p2p_wait_ms"] for s in summary["steps"]])
        print(f"  rank {r}: compute {comp:.1f} ms, receive waits {wait:.1f} ms (medians)")
    print(f"  measured bubble (step {step}) {chart['measured_bubble']}, simulated {chart['simulated_bubble']}")
    _, sim = simulated_bubble(plan, rank_spans)  # mean action costs over all recorded steps
    summary["floor_ms"] = sim.makespan
    print(f"  floor: {sim.makespan:.1f} ms = this plan with the measured mean action costs and free communication "
          f"(rank compute {', '.join(f'{b:.1f}' for b in sim.busy)} ms); median step / floor "
          f"{median(times) / sim.makespan:.3f} (prediction error {100 * (sim.makespan / median(times) - 1):+.1f}%)")
    from engine.profiling.costs import simulate_measured
    pred = simulate_measured(plan, rank_spans)
    summary["predicted_ms"] = pred.makespan
    print(f"  prediction: {pred.makespan:.1f} ms = this plan with the median measured action costs plus the measured "
          f"per-action overhead (prediction error {100 * (pred.makespan / median(times) - 1):+.1f}%)")
    print(f"  {len(summary['stalls'])} receive waits > {args.stall_ms} ms in {len(times)} steps:",
          ", ".join(f"s{x['step']} r{x['rank']} {x['label']} {x['ms']:.1f}ms" for x in summary["stalls"][:12]))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}/timeline.json, timeline.png, timeline_fastest.png, summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
