"""Scale of the pure layer: build + validate + simulate one plan (default P=64, C=8, M=1024: about 1M actions).

Prints the time of each phase (wall clock and this process's CPU time; the machine may be shared, so the CPU
time is the steadier figure) and the total; ``--json`` writes them.  Target: total under 1 s.

    python benchmarks/plan_scale.py [--pp 64 --vp 8 --microbatches 1024] [--repeat 3] [--json out.json]

Phases:
    build     ``build_plan`` (per-rank action lists and their integer keys)
    graph     ``plan_graph``: structure, data-flow checks and the dependency graph (numpy)
    deadlock  ``deadlock_free_segments``: event-driven execution of all ranks (the deadlock check)
    simulate  ``simulate`` with forward 1, backward 2, transfer 0 (one pass over the execution order)
``validate`` = graph + deadlock.  Each repeat builds a fresh plan (no caches carried over); the best repeat is
reported, with every repeat in the JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.plan import build_plan  # noqa: E402
from engine.plan.simulate import simulate  # noqa: E402
from engine.plan.validate import deadlock_free_segments, plan_graph  # noqa: E402

PHASES = ("build", "graph", "deadlock", "simulate")


def run_once(pp: int, vp: int, microbatches: int) -> dict:
    """Times of one build + validate + simulate, per phase: ``{phase: (wall_s, cpu_s)}`` plus figures."""
    clocks = []
    gc.collect()
    gc.disable()  # collection pauses would be charged to whichever phase happens to trigger them
    try:
        clocks.append((time.perf_counter(), time.process_time()))
        schedule = "interleaved" if vp > 1 else ("1f1b" if pp > 1 else "no_pipelining")
        plan = build_plan(schedule, pp, microbatches, vp)
        clocks.append((time.perf_counter(), time.process_time()))
        plan_graph(plan)
        clocks.append((time.perf_counter(), time.process_time()))
        deadlock_free_segments(plan)
        clocks.append((time.perf_counter(), time.process_time()))
        sim = simulate(plan, 1.0, 2.0, 0.0)
        clocks.append((time.perf_counter(), time.process_time()))
    finally:
        gc.enable()
    result = {phase: {"wall_s": clocks[i + 1][0] - clocks[i][0], "cpu_s": clocks[i + 1][1] - clocks[i][1]}
              for i, phase in enumerate(PHASES)}
    result["total"] = {"wall_s": clocks[-1][0] - clocks[0][0], "cpu_s": clocks[-1][1] - clocks[0][1]}
    result["actions"] = plan.total_actions
    result["makespan"] = sim.makespan
    result["bubble_overall"] = sim.bubble_overall
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=64)
    parser.add_argument("--vp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3, help="fresh plans to time; the best total is reported")
    parser.add_argument("--json", type=Path, default=None, help="write all figures here")
    args = parser.parse_args(argv)
    runs = [run_once(args.pp, args.vp, args.microbatches) for _ in range(max(1, args.repeat))]
    best = min(runs, key=lambda r: r["total"]["wall_s"])
    print(f"plan scale: pp={args.pp} vp={args.vp} microbatches={args.microbatches}: {best['actions']:,} actions, "
          f"makespan {best['makespan']:g}, bubble {100 * best['bubble_overall']:.2f}%")
    for phase in PHASES + ("total",):
        print(f"  {phase:<9} {best[phase]['wall_s'] * 1e3:8.1f} ms wall  {best[phase]['cpu_s'] * 1e3:8.1f} ms cpu")
    validate = {k: best["graph"][k] + best["deadlock"][k] for k in ("wall_s", "cpu_s")}
    print(f"  (validate = graph + deadlock: {validate['wall_s'] * 1e3:.1f} ms wall)")
    totals = ", ".join(f"{r['total']['wall_s']:.3f} s" for r in runs)
    print(f"  all totals (wall): {totals}; target < 1 s: "
          f"{'met' if best['total']['wall_s'] < 1.0 else 'MISSED'}")
    if args.json is not None:
        args.json.write_text(json.dumps({"pp": args.pp, "vp": args.vp, "microbatches": args.microbatches,
                                         "python": platform.python_version(), "machine": platform.machine(),
                                         "best": best, "runs": runs}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
