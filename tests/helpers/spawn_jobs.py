"""Rank functions for the spawner tests (importable: the ``spawn`` start method imports them by name)."""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist


def sum_ranks(rank: int, world: int, scale: float) -> dict:
    import warnings
    warnings.warn("spawn test: a warning every rank emits", UserWarning, stacklevel=1)  # shown once per job
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item() * scale, "pid": os.getpid(), "env_rank": os.environ["RANK"]}


def raise_on(rank: int, world: int, bad: int, pid_dir: str) -> None:
    _pid(pid_dir, rank)
    if rank == bad:
        time.sleep(0.2)
        raise ValueError(f"injected on rank {rank}")
    dist.barrier()  # the peer fails on the closed connection, or is stopped


def kill_self(rank: int, world: int, bad: int, pid_dir: str) -> None:
    _pid(pid_dir, rank)
    if rank == bad:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def stop_self(rank: int, world: int, bad: int, pid_dir: str) -> None:
    """Rank ``bad`` SIGSTOPs itself; the others wait for it in a collective until the group timeout."""
    _pid(pid_dir, rank)
    if rank == bad:
        os.kill(os.getpid(), signal.SIGSTOP)
    t = torch.zeros(1)
    dist.all_reduce(t)


def die_later(delay: float) -> None:
    """Killed by SIGKILL after ``delay`` seconds (a rank whose exit a peer's raise overtakes)."""
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


def hang(rank: int, world: int, pid_dir: str) -> None:
    _pid(pid_dir, rank)
    time.sleep(600)


def slow_on_sigterm(rank: int, world: int, pid_dir: str, delay: float) -> str:
    """Handles SIGTERM by finishing ``delay`` seconds later (a save that takes a while)."""
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append(time.monotonic()))
    _pid(pid_dir, rank)
    while not got:
        time.sleep(0.05)
    time.sleep(delay)
    return "finished"


def ends_with_exit(rank: int, world: int) -> None:
    dist.barrier()
    os._exit(0)


def busy_thread_at_exit(rank: int, world: int, out_dir: str) -> int:
    """Return while a daemon thread is inside torch ops (it releases the GIL in each and re-takes it after) -- a
    prefetcher or a gloo worker at exit -- with an ``atexit`` handler and a non-daemon thread that must still run."""
    import atexit
    import threading
    a = torch.randn(128, 128)

    def spin() -> None:
        while True:
            torch.mm(a, a)

    def late_write() -> None:
        time.sleep(0.2)
        _touch(out_dir, f"thread_{rank}")

    threading.Thread(target=spin, daemon=True).start()
    threading.Thread(target=late_write).start()
    atexit.register(_touch, out_dir, f"atexit_{rank}")
    return rank


def _touch(out_dir: str, name: str) -> None:
    with open(os.path.join(out_dir, name), "w") as fh:
        fh.write("done")


def _pid(pid_dir: str, rank: int) -> None:
    path = os.path.join(pid_dir, f"{rank}.pid")
    with open(path + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    """``python -m tests.helpers.spawn_jobs SCENARIO PID_DIR [GRACE]``: a caller process for the SIGTERM tests; prints the
    results or ``ExceptionType: message`` and exits 0 / 3."""
    import sys
    from engine.runtime.spawn import spawn
    scenario, pid_dir, *rest = argv if argv is not None else sys.argv[1:]
    grace = float(rest[0]) if rest else 30.0
    fn, args = {"slow_on_sigterm": (slow_on_sigterm, (pid_dir, 2.0)), "hang": (hang, (pid_dir,))}[scenario]
    try:
        print(spawn(fn, 2, args=args, term_grace_s=grace), flush=True)
        return 0
    except BaseException as exc:  # noqa: BLE001 - the test reads the line
        print(f"{type(exc).__name__}: {exc}", flush=True)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
