"""The graphs-or-eager decision, made collectively, and the one-line fallback log.

Captured collectives are collective at replay: if one rank replays graphs while a neighbour runs eagerly, NCCL can
hang.  So every rank contributes its local verdict and all
ranks adopt "graphs" only if every rank can; the reasons of the ranks that cannot are gathered so that the single
log line says why.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

__all__ = ["agree", "log_fallback", "log"]

log = logging.getLogger("pipecast.graphs")


def agree(ok: bool, reason: str | None, group=None) -> tuple[bool, str | None]:
    """All ranks of ``group`` (default: the world, when initialised) agree on graphs or eager.

    Returns ``(all_ok, reason)`` where ``reason`` is ``"rank R: <R's reason>"`` for the first failing rank ``R``
    of the group, identical on every rank (``None`` when all are ok).  Without an initialised process group the local verdict is returned unchanged.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ok, (None if ok else reason)
    verdicts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, (bool(ok), reason), group=group)
    bad = [(r, why) for r, (good, why) in enumerate(verdicts) if not good]
    if not bad:
        return True, None
    rank, why = bad[0]  # the same line on every rank: the first failing rank and its own reason
    more = f" (+{len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
    return False, f"rank {rank}: {why}{more}"


def log_fallback(requested: str, reason: str, group=None) -> str:
    """Log the fallback once (on the first rank of ``group``; DEBUG elsewhere) and return the line."""
    line = f"CUDA graphs off (backend={requested!r}), running eagerly: {reason}"
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0
    log.log(logging.WARNING if first else logging.DEBUG, line)
    return line


def cuda_ready() -> bool:
    """A CUDA device is usable here (patched in tests)."""
    return torch.cuda.is_available()
