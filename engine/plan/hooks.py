"""When the grad / param sync hooks fire: the rules a schedule entry names (:class:`ScheduleSpec.hooks`).

A rule maps ``(plan, rank, has_grad_sync, has_param_sync)`` to ``(start, before, after, end)``: the
:class:`HookEvent` s run at the start of the step, before / after each of the rank's actions, and at the end.
Megatron-Core 0.16.1's points (``megatron/core/pipeline_parallel/schedules.py``): ``no_sync`` entered at the start;
left before the last forward (:func:`last_forward_hooks`, no pipelining), before the last backward
(:func:`last_backward_hooks`, 1F1B; with ``grad_sync_func`` only on pipeline rank 0, the others call it at the end),
around the last backward of each chunk or each ``grad_sync_func`` call timed by ``k - r``
(:func:`interleaved_hooks`).  Split-backward plans (:func:`last_weight_hooks`): around each chunk's last ``W``,
where its gradients are complete (``grad_sync_func`` right after it); ``param_sync_func`` for every chunk at the
start.  Forward-only plans leave ``no_sync`` at the end (every rule but :func:`last_forward_hooks`).  Pure.
"""
from __future__ import annotations

from typing import NamedTuple

from .types import Op, Plan

__all__ = ["HookEvent", "ENABLE", "DISABLE", "last_forward_hooks", "last_backward_hooks", "interleaved_hooks",
           "last_weight_hooks"]


class HookEvent(NamedTuple):
    """A grad / param sync hook event: ``enable`` leaves ``no_sync``, ``disable`` enters it, ``grad`` calls
    ``grad_sync_func`` for ``chunk`` (None: the whole model of a one-chunk rank), ``param`` calls
    ``param_sync_func`` for ``chunk``."""

    kind: str
    chunk: int | None = None


ENABLE, DISABLE = HookEvent("enable"), HookEvent("disable")


def _empty(plan: Plan, rank: int):
    n = len(plan.actions[rank])
    return [DISABLE], [[] for _ in range(n)], [[] for _ in range(n)], []


def _no_backward(plan: Plan, rank: int, events) -> bool:
    """Forward-only plans (and ranks without a backward) leave ``no_sync`` at the end."""
    if plan.forward_only or not any(a.op is Op.BACKWARD for a in plan.actions[rank]):
        events[3].append(ENABLE)
        return True
    return False


def last_forward_hooks(plan: Plan, rank: int, has_grad_sync: bool, has_param_sync: bool):
    """No pipelining: ``no_sync`` left before the last forward (training and evaluation alike)."""
    start, before, after, end = events = _empty(plan, rank)
    fwd = [i for i, a in enumerate(plan.actions[rank]) if a.op is Op.FORWARD]
    if fwd:
        before[fwd[-1]].append(ENABLE)
    return events


def last_backward_hooks(plan: Plan, rank: int, has_grad_sync: bool, has_param_sync: bool):
    """1F1B: ``no_sync`` left before the last backward; with ``grad_sync_func`` only on rank 0, the others leave it
    and call ``grad_sync_func`` at the end."""
    start, before, after, end = events = _empty(plan, rank)
    if _no_backward(plan, rank, events):
        return events
    last_b = max(i for i, a in enumerate(plan.actions[rank]) if a.op is Op.BACKWARD)
    if not has_grad_sync or rank == 0:
        before[last_b].append(ENABLE)
    else:
        end += [ENABLE, HookEvent("grad", None)]
    return events


def last_weight_hooks(plan: Plan, rank: int, has_grad_sync: bool, has_param_sync: bool):
    """Split backward: around each chunk's last ``W``; ``param_sync_func`` for every chunk at the start."""
    start, before, after, end = events = _empty(plan, rank)
    if _no_backward(plan, rank, events):
        return events
    acts = plan.actions[rank]
    last_w = {a.chunk: i for i, a in enumerate(acts) if a.op is Op.WEIGHT}
    if has_param_sync:
        start += [HookEvent("param", c) for c in range(plan.num_model_chunks)]
    for c, i in sorted(last_w.items()):
        if has_grad_sync:
            after[i] += [ENABLE, HookEvent("grad", c), DISABLE]
        else:
            before[i].append(ENABLE)
            after[i].append(DISABLE)
    end.append(ENABLE)
    return events


def interleaved_hooks(plan: Plan, rank: int, has_grad_sync: bool, has_param_sync: bool):
    """Interleaved 1F1B's hook points (Megatron-Core's ``forward_backward_pipelining_with_interleaving``)."""
    start, before, after, end = events = _empty(plan, rank)
    if _no_backward(plan, rank, events):
        return events
    acts = plan.actions[rank]
    last_m = plan.num_microbatches - 1
    fwd_idx = [i for i, a in enumerate(acts) if a.op is Op.FORWARD]
    bwd_idx = [i for i, a in enumerate(acts) if a.op is Op.BACKWARD]
    chunks, total = plan.num_model_chunks, len(fwd_idx)
    if has_param_sync:
        start += [HookEvent("param", c) for c in range(min(2, chunks))]
        for k, i in enumerate(fwd_idx):
            j = k + rank
            if j < total and acts[fwd_idx[j]].microbatch == 0:
                c2 = acts[fwd_idx[j]].chunk + 1
                if 1 < c2 < chunks:
                    before[i].append(HookEvent("param", c2))
    synced = set()
    for k, i in enumerate(bwd_idx):
        if not has_grad_sync and acts[i].microbatch == last_m:
            before[i].append(ENABLE)
            after[i].append(DISABLE)
        if has_grad_sync:
            j = k - rank
            if j >= 0 and acts[bwd_idx[j]].microbatch == last_m:
                c2 = acts[bwd_idx[j]].chunk
                after[i] += [ENABLE, HookEvent("grad", c2), DISABLE]
                synced.add(c2)
    end.append(ENABLE)
    if has_grad_sync:
        end += [HookEvent("grad", c) for c in range(chunks) if c not in synced]
    return events
