"""pipecast's 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV against torch.distributed.pipelining's schedules.

Same model (``benchmarks.common``: MLP stack, hidden 512, 8 layers), same data (16 sequences of 64 tokens in 8
microbatches, fp32), 2 ranks on gloo, 1 thread per rank, same process priority.  Each repeat is one fresh 2-rank
job that builds every engine and then runs their steps round-robin (shuffled order per round; the single-process
reference on rank 0 while rank 1 waits), so that load from elsewhere on a shared machine falls on all engines
alike; each job reports the median of each engine's timed steps and the figures are medians over repeats.  Prints
and writes ``benchmarks/results/vs_torch_pipelining.json``.

Figures: step time (ms); speedup over the single-process loop; ratio of that speedup to the bound of the schedule
with equal stage costs and free communication, ``P*M/(M+P-1)`` for 1F1B (``2m/(m+1)`` at P=2) and
``P*M/(M+(P-1)/V)`` for interleaved 1F1B with V chunks per rank (``2m/(m+1/2)`` at P=2, V=2) (Narayanan et al.,
SC'21, section 2.2); DualPipeV (pipecast's and torch's rows alike): the bound of its plan simulated with
``F = B = W`` (:func:`engine.plan.simulate.simulate`); and the mean microbatch loss, which must agree across engines.

    python benchmarks/vs_torch_pipelining.py                 # full run (about 5 minutes on 2 cores)
    python benchmarks/vs_torch_pipelining.py --repeats 1 --steps 2 --warmup 1   # smoke test
    python benchmarks/vs_torch_pipelining.py --only DualPipeV ZB-V --torch-schedules ScheduleDualPipeV \
        ScheduleZBVZeroBubble --out benchmarks/results/vs_torch_pipelining_dualpipev.json   # DualPipeV beside torch
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Workload, launch, median, write_json  # noqa: E402
from benchmarks.engines import BUILDERS  # noqa: E402

TORCH_SCHEDULES = {  # name -> model chunks per rank
    "Schedule1F1B": 1, "ScheduleGPipe": 1, "ScheduleInterleaved1F1B": 2, "ScheduleLoopedBFS": 2,
    "ScheduleInterleavedZeroBubble": 2, "ScheduleZBVZeroBubble": 2, "ScheduleDualPipeV": 2,
}


NOT_RENICED = "gloo I/O thread not reniced"


def engines(torch_schedules) -> list[tuple[str, str, dict]]:
    """``(label, builder, options)`` of every engine in the comparison."""
    out = [("single process", "single", {}),
           ("pipecast 1F1B", "pipecast", {"chunks": 1}),
           ("pipecast interleaved 1F1B", "pipecast", {"chunks": 2}),
           ("pipecast ZB-H1", "pipecast", {"chunks": 1, "schedule": "zb_h1"}),
           ("pipecast ZB-V", "pipecast", {"chunks": 2, "schedule": "zbv"}),
           ("pipecast DualPipeV", "pipecast", {"chunks": 2, "schedule": "dualpipev"}),
           (f"pipecast 1F1B, {NOT_RENICED}", "pipecast", {"chunks": 1, "gloo_io_nice": None}),
           (f"pipecast interleaved 1F1B, {NOT_RENICED}", "pipecast", {"chunks": 2, "gloo_io_nice": None})]
    out += [(f"torch {s}", "torch", {"schedule": s, "chunks": TORCH_SCHEDULES[s]}) for s in torch_schedules]
    return out


def job(rank: int, world: int, todo: list, workload: Workload, warmup: int, steps: int, seed: int):
    """Build every engine in this job's processes, then run their steps round-robin (a shuffled order per round),
    so that whatever else the machine does falls on all engines alike.  ``single`` runs on rank 0 only while the
    other rank waits at the next barrier."""
    import random
    import time
    import torch
    import torch.distributed as dist
    built, losses = {}, {}
    for label, builder, options in todo:
        if builder == "single":
            engine = BUILDERS[builder](rank, 1, workload, **options) if rank == 0 else None
        else:
            engine = BUILDERS[builder](rank, world, workload, **options)
        built[label] = engine
        out = engine.step() if engine is not None else []
        losses[label] = float(sum(float(l) for l in out) / len(out)) if out else None
    times = {label: [] for label in built}
    order = list(built)
    rng = random.Random(seed)
    for i in range(warmup + steps):
        rng.shuffle(order)
        for label in order:
            dist.barrier()
            t0 = time.perf_counter()
            if built[label] is not None:
                built[label].step()
            if i >= warmup:
                times[label].append(time.perf_counter() - t0)
    flat = torch.tensor([t for label in built for t in times[label]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)  # a step ends when its last rank is done
    per = flat.view(len(built), steps).tolist()
    return {"times": dict(zip(built, per)), "loss": losses}


def bound(schedule: str, pp: int, m: int, chunks: int) -> float:
    """Speedup bound with equal stage costs and free communication (see module docstring); zero-bubble rows with
    F = B = W: ZB-H1's bubble ``(P-1)(F+B-W)`` (Qi et al., ICLR 2024), ZB-V's the fill of ``P-1`` chunk forwards."""
    if "DualPipeV" in schedule:
        from engine.plan import build_plan
        from engine.plan.simulate import simulate
        sim = simulate(build_plan("dualpipev", pp, m, 2), forward_time=1.0, backward_time=1.0, weight_time=1.0)
        return sum(sim.busy) / sim.makespan
    if "ZB-H1" in schedule:
        return pp * 3 * m / (3 * m + pp - 1)
    if "ZB-V" in schedule:
        return pp * 6 * m / (6 * m + pp - 1)
    if "interleaved" in schedule.lower() or chunks > 1:
        return pp * m / (m + (pp - 1) / chunks)
    return pp * m / (m + pp - 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="fresh-process jobs (default 5)")
    ap.add_argument("--steps", type=int, default=10, help="timed rounds per job, one step of each engine (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds per job after the first step (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--pin", action="store_true", help="pin each rank to its own core (same for every engine)")
    ap.add_argument("--torch-schedules", nargs="*", default=list(TORCH_SCHEDULES), choices=list(TORCH_SCHEDULES))
    ap.add_argument("--only", nargs="*", default=None, help="run only engines whose label contains one of these")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/vs_torch_pipelining.json)")
    args = ap.parse_args(argv)

    w = Workload()
    todo = engines(args.torch_schedules)
    if args.only:
        todo = [e for e in todo if e[0] == "single process" or any(o in e[0] for o in args.only)]
    runs: dict[str, list[dict]] = {label: [] for label, *_ in todo}
    for rep in range(args.repeats):
        res = launch(job, 2, todo, w, args.warmup, args.steps, rep, threads=args.threads, pin=args.pin)
        for label, *_ in todo:
            times = res[0]["times"][label]
            loss = res[0]["loss"][label] if res[0]["loss"][label] is not None else res[1]["loss"][label]
            runs[label].append({"median_s": median(times), "times": times, "loss": loss})
        print(f"  repeat {rep + 1}/{args.repeats}: " + ", ".join(
            f"{label} {runs[label][-1]['median_s'] * 1e3:.1f}" for label, *_ in todo) + " ms", flush=True)

    single = median([r["median_s"] for r in runs["single process"]])
    ref_loss = runs["single process"][0]["loss"]
    rows = []
    for label, builder, options in todo:
        t = median([r["median_s"] for r in runs[label]])
        chunks = options.get("chunks", 1)
        world = 1 if builder == "single" else 2
        all_times = [x for r in runs[label] for x in r["times"]]
        row = {"engine": label, "world": world, "chunks": chunks, "step_ms": t * 1e3,
               "min_ms": min(r["median_s"] for r in runs[label]) * 1e3,
               "max_ms": max(r["median_s"] for r in runs[label]) * 1e3,
               "p10_ms": sorted(all_times)[len(all_times) // 10] * 1e3,
               "speedup": single / t, "loss": runs[label][0]["loss"],
               "loss_matches": all(abs(r["loss"] - ref_loss) <= 1e-5 * abs(ref_loss) for r in runs[label])}
        if world > 1:
            b = bound(label, world, w.microbatches, chunks)
            row.update(bound=b, of_bound=row["speedup"] / b)
        rows.append(row)
    by = {r["engine"]: r for r in rows}
    goals = _goals(by)

    print(f"\n{'engine':<56} {'step ms':>8} {'p10 ms':>7} {'repeats':>13} {'speedup':>8} {'bound':>6} {'of bound':>8}"
          f"  loss")
    for r in rows:
        rng = f"{r['min_ms']:.1f}-{r['max_ms']:.1f}"
        print(f"{r['engine']:<56} {r['step_ms']:8.1f} {r['p10_ms']:7.1f} {rng:>13} {r['speedup']:8.3f} "
              f"{r.get('bound', 0):6.3f} {r.get('of_bound', 0):8.3f}  {r['loss']:.6f}"
              f"{'' if r['loss_matches'] else '  MISMATCH'}")
    for g in goals:
        print(f"goal {g['goal']:<58} {g['value']:.3f} {'met' if g['met'] else 'MISSED'}")
    path = write_json("vs_torch_pipelining_pinned" if args.pin else "vs_torch_pipelining", {
        "workload": w.__dict__, "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
        "threads": args.threads, "pin": args.pin,
        "design": "round-robin steps of all engines in each fresh 2-rank job",
        "rows": rows, "goals": goals,
        "runs": {k: [{"median_s": r["median_s"], "loss": r["loss"]} for r in v] for k, v in runs.items()}},
        args.out)
    print(f"wrote {path}")
    return 0 if all(r["loss_matches"] for r in rows) else 1


def _goals(by: dict) -> list[dict]:
    goals = []

    def add(goal, value, met):
        goals.append({"goal": goal, "value": value, "met": bool(met)})
    p1, pi = by.get("pipecast 1F1B"), by.get("pipecast interleaved 1F1B")
    t1, ti = by.get("torch Schedule1F1B"), by.get("torch ScheduleInterleaved1F1B")
    torch_rows = [r for k, r in by.items() if k.startswith("torch ")]
    if p1 and t1:
        v = p1["step_ms"] / t1["step_ms"]
        add("pipecast 1F1B / torch Schedule1F1B <= 0.95", v, v <= 0.95)
    if pi and ti:
        v = pi["step_ms"] / ti["step_ms"]
        add("pipecast interleaved / torch ScheduleInterleaved1F1B <= 0.80", v, v <= 0.80)
    if pi and torch_rows:
        fastest = min(torch_rows, key=lambda r: r["step_ms"])
        v = pi["step_ms"] / fastest["step_ms"]
        add(f"pipecast interleaved / fastest torch ({fastest['engine'][6:]}) < 1", v, v < 1)
    for r in (p1, pi):
        if r:
            add(f"{r['engine']} speedup / bound >= 0.93", r["of_bound"], r["of_bound"] >= 0.93)
    zb = [by[k] for k in ("pipecast ZB-H1", "pipecast ZB-V") if k in by]
    if zb:
        best = max(zb, key=lambda r: r["speedup"])
        add(f"best pipecast zero-bubble ({best['engine'][9:]}) speedup >= 1.85", best["speedup"],
            best["speedup"] >= 1.85)
        if torch_rows:
            fastest = min(torch_rows, key=lambda r: r["step_ms"])
            v = best["step_ms"] / fastest["step_ms"]
            add(f"best pipecast zero-bubble / fastest torch ({fastest['engine'][6:]}) <= 0.80", v, v <= 0.80)
    return goals


if __name__ == "__main__":
    sys.exit(main())
