"""Spawn a small gloo job inside a test and hand each rank's result back to the parent.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes on 127.0.0.1, initialises the default
process group (gloo), calls ``fn(rank, world_size, *args)`` on each, and returns the list of per-rank return
values (which must pickle).  A rank that raises makes ``run_ranks`` raise ``RankFailed`` naming that rank and its
traceback; a job that has not finished within ``timeout`` seconds is killed (every process) and raises
``TimeoutError``, so a hang fails fast instead of eating CI.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A spawned rank raised; ``errors`` maps rank -> formatted traceback."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        first = min(errors)
        super().__init__(f"rank(s) {sorted(errors)} failed; rank {first}:\n{errors[first]}")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (reads ``/proc``; Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, results, pg_timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 90.0, pg_timeout: float = 30.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results in rank order.

    Raises ``RankFailed`` if any rank raised, ``TimeoutError`` if the job did not finish in ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, pg_timeout), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, object]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(got) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(got))} did not finish "
                                   f"within {timeout:.0f}s")
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
                got[rank] = (ok, out)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise RankFailed({r: f"process exited with code {procs[r].exitcode}" for r in dead})
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = {r: out for r, (ok, out) in got.items() if not ok}
    if errors:
        raise RankFailed(errors)
    return [got[r][1] for r in range(world_size)]
