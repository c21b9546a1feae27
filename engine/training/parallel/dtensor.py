"""``DTensor`` helpers every parallelism of the recipe shares (tensor parallel, FSDP2, the gradient sync, the norm
clip, checkpoints): local shards, gradient placements, DTensor's caches, and the full-tensor form of a state dict.

A tensor that is not a ``DTensor`` passes through every function here unchanged, so callers need not ask which
layout runs.
"""
from __future__ import annotations

import torch

__all__ = ["local", "align_grads", "clear_caches", "full_state", "full_templates", "reshard_like"]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise); writes to it change the DTensor."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def align_grads(params) -> None:
    """Give every DTensor parameter's gradient the parameter's placements (autograd may produce another one, e.g.
    ``Replicate`` for the vocabulary-parallel embedding: a local slice; ``Partial`` for a sequence-parallel norm's
    weight: an all-reduce over the tensor-parallel group, in parameter order on every rank), called before any
    gradient reduction."""
    from torch.distributed.tensor import DTensor
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


def clear_caches() -> None:
    """Forget DTensor's cached sharding decisions.  ``DeviceMesh`` equality ignores the process groups, so after a
    previous run's groups were destroyed (a second :class:`~engine.training.trainer.Trainer` in one process) a
    cached output spec would still carry the old mesh and its dead groups.  Local."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cache in (getattr(propagator, "propagate_op_sharding", None), getattr(_redistribute, "_gen_transform_infos",
                                                                             None)):
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()


def full_state(sd: dict) -> dict:
    """``sd`` with every DTensor gathered to its full plain tensor (collective over the DTensor's mesh, same key
    order on every rank).  Checkpoints are written in the unsharded layout: the same keys, shapes and bytes
    whatever ``parallel.tensor`` / ``parallel.shard`` (DCP de-duplicates the replicated copies), so they load at
    any layout."""
    from torch.distributed.tensor import DTensor
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}


def full_templates(sd: dict) -> dict:
    """Load targets for :func:`full_state` checkpoints: an empty full-shape plain tensor per DTensor (local)."""
    from torch.distributed.tensor import DTensor
    return {k: torch.empty(v.shape, dtype=v.dtype, device=local(v).device) if isinstance(v, DTensor) else v
            for k, v in sd.items()}


def reshard_like(loaded: dict, template: dict) -> dict:
    """The full tensors of ``loaded`` cut to this rank's shards of ``template``'s DTensors (local slicing, no
    communication: every rank loaded the same full tensors)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    out = {}
    for k, v in loaded.items():
        t = template.get(k)
        out[k] = distribute_tensor(v, t.device_mesh, t.placements, src_data_rank=None) \
            if isinstance(t, DTensor) and not isinstance(v, DTensor) else v
    return out
