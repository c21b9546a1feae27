"""SIGTERM as a request to stop cleanly: finish the current step, save a checkpoint on every rank, return.

Cluster schedulers send SIGTERM before they kill a job (Slurm: to every process of the step; torchrun forwards it
to its workers; ``pipecast train`` forwards it to its ranks).  While :func:`sigterm_requests` is active (the
trainer's loop), SIGTERM only records the request -- more SIGTERMs change nothing -- and :func:`stop_agreed`,
called by every rank after each step at which the host reads the step's figures (a logged, evaluated or saved
step: ``logging.log_interval``; the other steps do not wait on the device, and a flag read would make them),
tells all ranks at once (a max all-reduce of one flag over the default group), so they all stop after the same
step even when the signal reached them at different moments.
"""
from __future__ import annotations

import contextlib
import signal

__all__ = ["sigterm_requests", "requested", "stop_agreed"]

_state = {"requested": False, "depth": 0}


def requested() -> bool:
    """Whether this process has received SIGTERM while :func:`sigterm_requests` was active."""
    return _state["requested"]


@contextlib.contextmanager
def sigterm_requests():
    """While active (main thread only; elsewhere, or nested, it changes nothing), SIGTERM sets :func:`requested`
    instead of ending the process.  The previous handler is restored on exit."""
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm) if _state["depth"] == 0 else None
    except ValueError:  # not the main thread
        previous = None
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _on_sigterm(signum, frame) -> None:
    _state["requested"] = True


def stop_agreed() -> bool:
    """Collective over the default group (every rank calls it at the same point): True on every rank when any rank
    has :func:`requested` a stop.  Without ``torch.distributed`` (or with one rank) it is the local flag."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return requested()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    flag = torch.tensor([1 if requested() else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
