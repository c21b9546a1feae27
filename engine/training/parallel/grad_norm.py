"""The one global-norm gradient clip of the recipe, for every layout's gradients.

Each rank holds a part of the model's gradients, in one of three forms, all handled by :func:`clip_grad_norm_`:

* a plain tensor, whole: the same on its data-parallel and tensor-parallel peers (``shard: none``; norms and
  biases that tensor parallelism leaves replicated) -- its square counts once;
* a ``DTensor`` (tensor parallelism, FSDP2): the squares of its local shard are summed over the process group of
  every mesh dimension it is sharded on (``Shard`` / ``_StridedShard``; a ``Replicate`` dimension adds nothing);
* a plain tensor that is this rank's piece of a flat buffer split over ``shard_group`` (ZeRO-1's reduced gradient
  shards; a routed expert's piece: split over ``expert_shard_group``, the expert-data-parallel group): its squares
  are summed over that group;
* a routed expert's gradient under tensor parallelism alone is a plain tensor, whole: reduced over the
  expert-data-parallel group (which holds the tensor-parallel peers, :mod:`engine.moe.layer`), it is the same on
  them and counts once;
* a routed expert's gradient under expert parallelism: the other ranks of ``expert_group`` hold the other experts
  of the layer, so its squares are summed over that group too (Megatron-Core sums the expert gradients' squares
  over the expert-tensor x expert x pipeline group; under its distributed optimizer each rank first holds a shard
  over the expert-data-parallel group).

The sums are then summed over the pipeline group (each stage holds other parameters).  The clip is
``torch.nn.utils.clip_grads_with_norm_``'s rule, ``g *= min(1, max_norm / (norm + 1e-6))``, applied to the local
shards (a DTensor gradient cannot be multiplied by a plain scalar tensor).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ...runtime.process_groups import group_size
from .dtensor import local

__all__ = ["clip_grad_norm_"]


def _sharded_over(grad: torch.Tensor, shard_group) -> tuple:
    """The process groups over which ``grad``'s local squares are summed (see the module docstring)."""
    from torch.distributed.tensor import DTensor
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        return tuple(mesh.get_group(dim) for dim, placement in enumerate(grad.placements)
                     if not placement.is_replicate())
    return () if shard_group is None else (shard_group,)


@torch.no_grad()
def clip_grad_norm_(grads: Sequence[torch.Tensor], max_norm: float, *, pipeline_group=None,
                    counted: Sequence[bool] | None = None, shard_group=None, device=None,
                    experts: Sequence[bool] | None = None, expert_group=None,
                    expert_shard_group=None) -> torch.Tensor:
    """Global L2 norm of the whole model's gradients, then scale ``grads`` in place so it is at most ``max_norm``.

    Args:
        grads: this rank's gradients (plain tensors or DTensors; see the module docstring for what each form
            means); all of them are clipped.
        max_norm: the clip threshold (``optimizer.grad_clip``); ``<= 0`` only computes the norm.
        pipeline_group: the pipeline group (None: one stage).
        counted: per gradient, False to leave it out of the norm while still clipping it: a copy whose value
            another counted gradient holds (the last stage's tied word-embedding copy).  Default: all counted.
        shard_group: the group over which plain ``grads`` are pieces of one flat buffer (ZeRO-1), or None.
        device: where the norm is computed and reduced (NCCL needs the GPU); default the first gradient's device
            (CPU when this rank holds none).
        experts: per gradient, True for a routed expert's (default: none is); their squares are also summed over
            ``expert_group`` (the expert-parallel group), whose ranks hold the layer's other experts.
        expert_shard_group: the group over which plain expert ``grads`` are pieces of one flat buffer (ZeRO-1 under
            expert parallelism: the expert-data-parallel group), or None (they are split like the others, over
            ``shard_group``).

    Returns:
        The norm before clipping: an fp32 scalar tensor on the gradients' device, the same on every rank (no host
        synchronisation here; read it with ``float()`` where it is logged).

    Collective over ``pipeline_group`` and every group a gradient is sharded over (each all-reduce issued in
    gradient order, the same on the members of a group: they hold the same stage).
    """
    grads = list(grads)
    counted = [True] * len(grads) if counted is None else list(counted)
    if device is None:
        device = local(grads[0]).device if grads else torch.device("cpu")
    experts = [False] * len(grads) if experts is None else list(experts)
    expert_shard_group = shard_group if expert_shard_group is None else expert_shard_group
    expert_over = (expert_group,) if expert_group is not None else ()
    # ZeRO-1's members hold different pieces, so one may hold no counted piece (only the tied-embedding copy, or
    # nothing): each shard group's all-reduces are issued whatever this rank holds, dense pieces' first
    parts: dict[tuple, list[torch.Tensor]] = {} if shard_group is None else {(shard_group,): []}
    if expert_shard_group is not shard_group:
        parts[(expert_shard_group,) + expert_over] = []
    for g, c, e in zip(grads, counted, experts):
        over = _sharded_over(g, expert_shard_group) + expert_over if e else _sharded_over(g, shard_group)
        tensors = parts.setdefault(over, [])
        if c:
            tensors.append(local(g))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, tensors in parts.items():
        sq = (torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).pow(2).sum() if tensors else
              torch.zeros((), dtype=torch.float32, device=device))
        for group in groups:
            if group_size(group) > 1:
                dist.all_reduce(sq, group=group)
        total = total + sq
    if group_size(pipeline_group) > 1:
        dist.all_reduce(total, group=pipeline_group)
    norm = total.sqrt()
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        shards = [local(g) for g in grads]
        for dev in {s.device for s in shards}:  # one fused multiply per device
            torch._foreach_mul_([s for s in shards if s.device == dev], coef.to(dev))
    return norm
