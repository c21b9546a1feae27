"""Runtime overhead per action: what an engine adds to each forward / backward beyond the compute itself.

A tiny model (hidden 8, 2 layers, 1 sequence of 4 tokens per microbatch) makes compute cheap, so the step time
grows with the number of microbatches M almost only through per-action costs.  For each engine the script fits the
slope of the median step time over M (least squares over ``--microbatches``), subtracts the slope of a plain
single-process loop over the same layers (the compute: forward, loss, backward), and divides by the actions per
microbatch on a rank (one forward and one backward)::

    overhead per action = (slope_engine - slope_compute) / 2

at pp=1 (pure runtime cost: pipecast's no-pipelining schedule vs a one-stage torch pipelining schedule, no
communication) and pp=2 (1F1B on both engines, 1 layer per rank; includes the send/receive of each action; pipecast
also with its pipeline group's gloo I/O thread left at the process's priority, see ``engine.runtime.gloo_io``).  The
pp=2 jobs also measure the gloo one-way latency of a message of the activation's size (half a ping-pong round trip,
median of ``--pings``), so the pp=2 figure can be read against it.

    python benchmarks/runtime_overhead.py                    # full run (about 2 minutes on 2 cores)
    python benchmarks/runtime_overhead.py --repeats 1 --steps 5 --microbatches 8 16   # smoke test
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Workload, launch, median, write_json  # noqa: E402

HIDDEN, LAYERS, SEQ = 8, 2, 4
BIG_MESSAGE = 2 * 64 * 512 * 4  # bytes of one activation of the vs-torch workload ([64, 2, 512] fp32)


def workload(m: int) -> Workload:
    return Workload(hidden=HIDDEN, layers=LAYERS, sequences=m, seq_length=SEQ, microbatches=m)


def gloo_one_way_us(rank: int, numel: int, pings: int) -> float:
    """Median half round trip of a ``numel``-float message between ranks 0 and 1 (us)."""
    import torch
    import torch.distributed as dist
    buf = torch.zeros(numel)
    other = 1 - rank
    rtts = []
    for i in range(pings + 20):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, other)
            dist.recv(buf, other)
        else:
            dist.recv(buf, other)
            dist.send(buf, other)
        if i >= 20:
            rtts.append(time.perf_counter() - t0)
    return median(rtts) / 2 * 1e6


def job(rank: int, world: int, cases: list, ms: list[int], warmup: int, steps: int, pings: int, seed: int):
    """Build every ``(case, M)`` engine of this world size, then step them round-robin (shuffled per round) so that
    load from elsewhere falls on all alike; ``single`` cases run on rank 0 while the other rank waits."""
    import random
    import torch
    import torch.distributed as dist
    from benchmarks.engines import BUILDERS
    built = {}
    for label, builder, options in cases:
        for m in ms:
            if builder == "single":
                engine = BUILDERS[builder](rank, 1, workload(m), **options) if rank == 0 else None
            else:
                engine = BUILDERS[builder](rank, world, workload(m), **options)
            if engine is not None:
                engine.step()
            built[(label, m)] = engine
    keys = list(built)
    times = {k: [] for k in keys}
    rng = random.Random(seed)
    for i in range(warmup + steps):
        rng.shuffle(keys)
        for k in keys:
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            if built[k] is not None:
                built[k].step()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    order = list(built)
    flat = torch.tensor([t for k in order for t in times[k]], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    per = flat.view(len(order), steps).tolist()
    step_s = {}
    for (label, m), ts in zip(order, per):
        step_s.setdefault(label, {})[m] = median(ts)
    latency = big = None
    if world == 2:
        latency = gloo_one_way_us(rank, SEQ * HIDDEN, pings)
        big = gloo_one_way_us(rank, BIG_MESSAGE // 4, max(20, pings // 5))
    return {"step_s": step_s, "one_way_us": latency, "one_way_big_us": big}


def slope(xs, ys) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


CASES = [  # label, builder, job world size, options, compute reference
    ("compute pp=1", "single", 1, {}, None),
    ("pipecast pp=1", "pipecast", 1, {}, "compute pp=1"),
    ("torch pp=1", "torch", 1, {"schedule": "Schedule1F1B"}, "compute pp=1"),
    ("compute pp=2 (one stage)", "single", 2, {"layers": LAYERS // 2}, None),  # rank 0 of the 2-rank job
    ("pipecast pp=2", "pipecast", 2, {}, "compute pp=2 (one stage)"),
    ("pipecast pp=2, gloo I/O thread not reniced", "pipecast", 2, {"gloo_io_nice": None}, "compute pp=2 (one stage)"),
    ("torch pp=2", "torch", 2, {"schedule": "Schedule1F1B"}, "compute pp=2 (one stage)"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=3, help="fresh-process jobs per engine (default 3)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per M (default 30)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pings", type=int, default=500, help="ping-pongs for the gloo latency (default 500)")
    ap.add_argument("--pin", action="store_true", help="pin each rank to its own core (same for every engine)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ms = sorted(args.microbatches)
    if len(ms) < 2:
        ap.error("--microbatches needs at least two values to fit a slope")

    runs = {c[0]: [] for c in CASES}
    latency, latency_big = [], []
    for rep in range(args.repeats):
        for world in (1, 2):
            cases = [(label, builder, options) for label, builder, w, options, _ in CASES if w == world]
            res = launch(job, world, cases, ms, args.warmup, args.steps, args.pings, rep, pin=args.pin)
            for label, *_ in cases:
                runs[label].append(res[0]["step_s"][label])
            if res[0]["one_way_us"] is not None:
                latency.append(res[0]["one_way_us"])
                latency_big.append(res[0]["one_way_big_us"])
        print(f"  repeat {rep + 1}/{args.repeats}: " + "; ".join(
            f"{label} " + " ".join(f"{runs[label][-1][m] * 1e3:.2f}" for m in ms) for label in runs) + " ms",
              flush=True)

    rows, slopes = [], {}
    for label, builder, world, options, ref in CASES:
        per_m = {m: median([r[m] for r in runs[label]]) for m in ms}
        slopes[label] = slope(ms, [per_m[m] for m in ms])
        row = {"case": label, "world": world, "step_ms": {m: per_m[m] * 1e3 for m in ms},
               "slope_us_per_microbatch": slopes[label] * 1e6}
        if ref is not None:
            row["overhead_us_per_action"] = (slopes[label] - slopes[ref]) * 1e6 / 2
        rows.append(row)
    by = {r["case"]: r for r in rows}
    one_way = median(latency) if latency else None
    goals = [
        {"goal": "pipecast overhead per action at pp=1 <= 10 us", "value": by["pipecast pp=1"]["overhead_us_per_action"],
         "met": by["pipecast pp=1"]["overhead_us_per_action"] <= 10},
        {"goal": "pipecast / torch overhead per action at pp=2 <= 0.7",
         "value": by["pipecast pp=2"]["overhead_us_per_action"] / by["torch pp=2"]["overhead_us_per_action"],
         "met": by["pipecast pp=2"]["overhead_us_per_action"] <= 0.7 * by["torch pp=2"]["overhead_us_per_action"]},
    ]
    print(f"\n{'case':<44} {'slope us/mb':>12} {'overhead us/action':>19}")
    for r in rows:
        ov = r.get("overhead_us_per_action")
        print(f"{r['case']:<44} {r['slope_us_per_microbatch']:12.1f} {'' if ov is None else f'{ov:19.1f}'}")
    one_way_big = median(latency_big) if latency_big else None
    if one_way:
        print(f"gloo one-way latency: {one_way:.1f} us ({SEQ * HIDDEN * 4} B), {one_way_big:.1f} us "
              f"({BIG_MESSAGE // 1024} KiB, the vs-torch activation)")
    for g in goals:
        print(f"goal {g['goal']:<52} {g['value']:.3f} {'met' if g['met'] else 'MISSED'}")
    path = write_json("runtime_overhead", {"hidden": HIDDEN, "layers": LAYERS, "seq_length": SEQ,
                                           "microbatches": ms, "repeats": args.repeats, "steps": args.steps, "pin": args.pin,
                                           "rows": rows, "gloo_one_way_us": one_way,
                                           "gloo_one_way_big_us": one_way_big, "big_message_bytes": BIG_MESSAGE,
                                           "goals": goals}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
