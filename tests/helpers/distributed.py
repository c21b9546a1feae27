"""Spawn a small gloo job inside a test and hand each rank's result back to the parent.

``run_ranks(fn, world_size, *args)`` is :func:`engine.runtime.spawn.spawn` (the project's one spawner) with the
tests' defaults: gloo, one torch thread per rank, a job ``timeout`` so a hang fails fast instead of eating CI.  It
returns the per-rank return values of ``fn(rank, world_size, *args)`` (which must pickle); a failing rank raises
``engine.runtime.spawn.RankError`` naming it (``.traceback`` holds its traceback), a job past ``timeout`` raises
``JobTimeout`` (a ``TimeoutError``).
"""
from __future__ import annotations

from engine.runtime.spawn import free_port, spawn

__all__ = ["run_ranks", "process_alive", "free_port", "tensor_gathers"]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (reads ``/proc``; Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


MIN_JOB_TIMEOUT_S = 200.0
"""Floor of a job's timeout (seconds), below the tests' own floor (``tests/conftest.py``: ``MIN_TIMEOUT_S``), so
that a hung job ends as a ``JobTimeout`` naming its ranks rather than as pytest's timeout."""


def run_ranks(fn, world_size: int, *args, timeout: float = 90.0, pg_timeout: float = 30.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results in rank order.

    Raises ``RankError`` if a rank raised or died, ``JobTimeout`` if the job did not finish in ``timeout`` seconds.
    """
    timeout = max(timeout, MIN_JOB_TIMEOUT_S)  # a hang guard: a busy CI machine makes a 15 s job take 75 s
    return spawn(fn, world_size, args=args, timeout_s=timeout, group_timeout_s=max(pg_timeout, 60.0), threads=1)


def tensor_gathers(comm) -> int:
    """The tensor collectives a ``torch.distributed.tensor.debug.CommDebugMode`` counted: functional ones (what a
    ``DTensor`` redistribution or ``full_tensor`` issues) and ``all_gather_into_tensor`` (``_allgather_base_``),
    leaving out the object collectives of DCP's plan exchange (``allgather_``, ``gather_``, ``broadcast_``,
    ``scatter_``)."""
    return sum(n for op, n in comm.get_comm_counts().items()
               if "c10d_functional" in str(op) or "_allgather_base_" in str(op))
