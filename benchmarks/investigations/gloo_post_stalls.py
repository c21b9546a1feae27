"""How long does *posting* a gloo send take while both ranks compute?  The stall behind pipecast's slow steps.

Two ranks (gloo on 127.0.0.1) each loop: about 2 ms of matmuls (the compute of an action), then post one send of a
256 KiB activation (``[64, 2, 512]`` fp32, the vs-torch workload's message) to the other rank and one receive
(receives are kept posted three iterations ahead, as the executor does), then wait for the receive of this
iteration.  The script times the two posting calls (``ProcessGroup.send`` / ``recv``, which return handles) and
reports per rank the median post time, the 99th percentile, the maximum and the number of posts over 1 ms.

A post normally costs 0.1-0.2 ms (the sender's thread writes the bytes into the loopback socket).  On this 2-core
VM a few percent of posts take 2-8 ms, and the compute thread that posted them stands still meanwhile; in the
pipeline such a stall on the last stage delays the whole step.  A reading of gloo's TCP transport suggests a cause
(the posting thread holds the pair's lock while it writes; gloo's I/O thread, woken on the same core by the peer's
data, only try-locks it and returns to its event loop); during the stalls that I/O thread uses the CPU (its CPU
time matched the stalled time in a separate measurement).  No variant below, each in a fresh 2-rank job, removes
the stalls (measured 2026-11-30: 5-20 % of sends over 1 ms in every variant); ``nice19`` shortens them in some runs.

* ``plain``: one process group for both directions (what pipecast and torch.distributed.pipelining do);
* ``yield``: ``os.sched_yield()`` before each post (let a woken I/O thread run first);
* ``split``: sends and receives on two process groups (lower rank -> higher rank on one, the reverse on the other),
  so a pair's data flows one way;
* ``nice19``: the gloo I/O threads (``gloo_tcp_loop``) reniced to 19 (what ``engine.runtime.gloo_io`` does for the
  pipeline groups pipecast creates).

    python benchmarks/investigations/gloo_post_stalls.py                      # all variants, 400 iterations each
    python benchmarks/investigations/gloo_post_stalls.py --variants plain split --iterations 200 --pin
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import launch, write_json  # noqa: E402

VARIANTS = ("plain", "yield", "split", "nice19")
AHEAD = 3
NUMEL = 64 * 2 * 512


def _renice_gloo_threads(nice: int) -> None:
    """Every gloo I/O thread of this process (``engine.runtime.gloo_io.io_threads``) to ``nice``."""
    from engine.runtime.gloo_io import io_threads
    for tid in io_threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass


def job(rank: int, world: int, variant: str, iterations: int) -> dict:
    import torch
    import torch.distributed as dist
    peer = 1 - rank
    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    send_pg = recv_pg = dist.group.WORLD
    if variant == "split":
        send_pg, recv_pg = (groups[0], groups[1]) if rank == 0 else (groups[1], groups[0])
    if variant == "nice19":
        _renice_gloo_threads(19)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    x = torch.randn(NUMEL)
    bufs = [torch.empty(NUMEL) for _ in range(AHEAD + 1)]  # receive i lands in bufs[i % (AHEAD + 1)]
    recvs = [recv_pg.recv([bufs[k]], peer, 1) for k in range(AHEAD)]
    sends, send_us, recv_us = [], [], []
    dist.barrier()
    for i in range(iterations):
        for _ in range(3):
            a @ b
        if variant == "yield":
            os.sched_yield()
        t0 = time.perf_counter()
        sends.append(send_pg.send([x], peer, 1))
        t1 = time.perf_counter()
        recvs.append(recv_pg.recv([bufs[(i + AHEAD) % (AHEAD + 1)]], peer, 1))
        t2 = time.perf_counter()
        send_us.append((t1 - t0) * 1e6)
        recv_us.append((t2 - t1) * 1e6)
        recvs[i].wait()
    for w in sends:
        w.wait()
    tail = [send_pg.send([x], peer, 1) for _ in range(AHEAD)]  # matches the receives posted ahead
    for w in recvs[iterations:] + tail:
        w.wait()

    def stats(us):
        s = sorted(us)
        return {"median_us": s[len(s) // 2], "p99_us": s[int(len(s) * 0.99)], "max_us": s[-1],
                "over_1ms": sum(v > 1000 for v in s)}
    return {"send": stats(send_us), "recv": stats(recv_us)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--pin", action="store_true", help="pin each rank to its own core")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    print(f"{'variant':<8} {'rank':>4} {'op':>4} {'median us':>10} {'p99 us':>8} {'max us':>8} {'posts > 1 ms':>13}")
    for variant in args.variants:
        for rank, res in enumerate(launch(job, 2, variant, args.iterations, pin=args.pin)):
            for op in ("send", "recv"):
                s = res[op]
                rows.append({"variant": variant, "rank": rank, "op": op, **s})
                print(f"{variant:<8} {rank:>4} {op:>4} {s['median_us']:10.0f} {s['p99_us']:8.0f} {s['max_us']:8.0f} "
                      f"{s['over_1ms']:>6} / {args.iterations}")
    path = write_json("gloo_post_stalls", {"iterations": args.iterations, "pin": args.pin, "message_bytes": NUMEL * 4,
                                           "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
