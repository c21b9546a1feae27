"""Where do 1F1B step times go on a 2-core machine?  pipecast's posting / waiting variants, side by side.

On 2 cores, two ranks with one busy compute thread each leave no idle core when a gloo I/O thread (which moves
the bytes of every send / receive in the background) wakes up; it may then queue behind a compute thread for a
scheduler tick (3-6 ms), and the rank that waits for that message stalls.  This script runs the vs-torch workload
(``benchmarks.common.Workload``) under several variants of when pipecast posts receives and waits for sends,
all variants built in the same fresh 2-rank job and stepped round-robin (shuffled per round, so load from
elsewhere falls on all alike), with the timeline recorder on, and reports the median and 90th-percentile step time and
the receive waits longer than ``--stall-ms``:

* ``baseline``: the executor as is;
* ``prefetch=K``: receives posted ``K`` actions ahead (baseline 1);
* ``send_wait=now``: every send waited right after it is posted (the sender's core is idle while the bytes move);
* ``pin``: each rank pinned to its own core (``os.sched_setaffinity``), so a rank's I/O thread shares the core of
  its own compute thread and runs as soon as that thread waits;
* ``torch``, ``torch pin``: torch.distributed.pipelining's Schedule1F1B / ScheduleInterleaved1F1B for reference.

    python benchmarks/investigations/p2p_stalls.py --chunks 1 --repeats 3 --steps 20
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import Workload, launch, median, write_json  # noqa: E402

VARIANTS = {
    "baseline": {},
    "prefetch=1": {"prefetch": 1},
    "prefetch=2": {"prefetch": 2},
    "prefetch=3": {"prefetch": 3},
    "prefetch=4": {"prefetch": 4},
    "prefetch=all": {"prefetch": 10_000},
    "send_wait=now": {"send_wait": "now"},
    "prefetch=all send_wait=now": {"prefetch": 10_000, "send_wait": "now"},
    "pin": {"pin": True},
    "torch": {"torch": True},
    "torch pin": {"torch": True, "pin": True},
}


_CURRENT: dict = {}


class _Done:
    """A finished handle: a gloo ``Work`` must not be waited twice (the second wait blocks forever)."""

    def wait(self, *args):
        return True

    def is_completed(self):
        return True


def install_hooks(rank: int) -> None:
    """Patch this rank's pipecast runtime once so that each step follows the variant in ``_CURRENT``."""
    import engine.runtime.p2p as P
    import engine.schedules as S
    orig_program, orig_post = S.cached_program, P.P2PCommunicator.post

    def cached_program(schedule, pp, m, c, g, fo, r, prefetch, batched):
        return orig_program(schedule, pp, m, c, g, fo, r, _CURRENT.get("prefetch", prefetch), batched)

    def post(self, ops, batched):
        works = orig_post(self, ops, batched)
        if _CURRENT.get("send_wait") != "now":
            return works
        works = list(works)
        for i, ((is_send, *_), w) in enumerate(zip(ops, works)):
            if is_send:
                w.wait()
                works[i] = _Done()
        return works
    S.cached_program, P.P2PCommunicator.post = cached_program, post


PIN_ALL = False


def set_variant(rank: int, variant: dict) -> None:
    _CURRENT.clear()
    _CURRENT.update(variant)
    pin = variant.get("pin") or PIN_ALL
    os.sched_setaffinity(0, {rank % os.cpu_count()} if pin else set(range(os.cpu_count())))


def apply_variant(rank: int, variant: dict) -> None:
    """Patch this rank's runtime and select ``variant`` for every following step (used by other scripts)."""
    install_hooks(rank)
    set_variant(rank, variant)


def job(rank: int, world: int, chunks: int, names: list, warmup: int, steps: int, stall_ms: float, seed: int,
        pin_all: bool = False):
    """Build one engine per variant, then run their steps round-robin (shuffled per round) so that load from
    elsewhere falls on all variants alike."""
    import random
    import time
    import torch.distributed as dist
    from benchmarks.engines import build_pipecast, build_torch
    from engine.profiling import TimelineRecorder
    global PIN_ALL
    PIN_ALL = pin_all
    install_hooks(rank)
    w = Workload()
    engines, recs = {}, {}
    for name in names:
        recs[name] = TimelineRecorder(rank)
        if VARIANTS[name].get("torch"):
            engines[name] = build_torch(rank, world, w, "ScheduleInterleaved1F1B" if chunks > 1 else "Schedule1F1B",
                                        chunks)
        else:
            engines[name] = build_pipecast(rank, world, w, chunks=chunks, tracer=recs[name])
    times = {name: [] for name in names}
    order, rng = list(names), random.Random(seed)
    for i in range(warmup + steps):
        rng.shuffle(order)
        for name in order:
            set_variant(rank, VARIANTS[name])
            dist.barrier()
            t0 = time.perf_counter()
            with recs[name].step(i):
                engines[name].step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    set_variant(rank, {})
    stalls = {name: [(s.label, s.duration_ns / 1e6) for s in recs[name].spans()
                     if s.category == "p2p" and s.step >= warmup and s.duration_ns > stall_ms * 1e6]
              for name in names}
    return {"times": times, "stalls": stalls}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=1, help="1: 1F1B, 2: interleaved 1F1B")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stall-ms", type=float, default=2.0)
    ap.add_argument("--pin-all", action="store_true", help="pin each rank to its own core in every variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = {v: {"times": [], "stalls": 0, "waits": []} for v in args.variants}
    for rep in range(args.repeats):
        out = launch(job, 2, args.chunks, args.variants, args.warmup, args.steps, args.stall_ms, rep, args.pin_all,
                     timeout=600)
        for v in args.variants:
            times = [max(a, b) for a, b in zip(out[0]["times"][v], out[1]["times"][v])]
            res[v]["times"] += times
            res[v]["stalls"] += len(out[0]["stalls"][v]) + len(out[1]["stalls"][v])
            res[v]["waits"] += [x for o in out for x in o["stalls"][v]]
        print(f"  repeat {rep + 1}: " + ", ".join(f"{v} {median(res[v]['times']) * 1e3:.1f}" for v in args.variants)
              + " ms (medians so far)", flush=True)
    rows = []
    print(f"\n{'variant':<28} {'median ms':>9} {'p10':>7} {'p90':>7} {'stalls/step':>11}")
    for v in args.variants:
        t = res[v]["times"]
        row = {"variant": v, "median_ms": median(t) * 1e3, "p10_ms": pct(t, 0.1) * 1e3, "p90_ms": pct(t, 0.9) * 1e3,
               "stalls_per_step": res[v]["stalls"] / len(t)}
        rows.append(row)
        print(f"{v:<28} {row['median_ms']:9.1f} {row['p10_ms']:7.1f} {row['p90_ms']:7.1f} "
              f"{row['stalls_per_step']:11.2f}")
    path = write_json(f"p2p_stalls_{'interleaved' if args.chunks > 1 else '1f1b'}",
                      {"chunks": args.chunks, "stall_ms": args.stall_ms, "pin_all": args.pin_all,
                       "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
