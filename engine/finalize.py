"""Gradient finalization at the end of a training step: data-parallel all-reduce, then the tied-weight sum.

:func:`finalize_model_grads` has the signature the schedules call ``config.finalize_model_grads_func`` with
(Megatron-Core's ``finalize_model_grads``): set ``config.finalize_model_grads_func = engine.finalize_model_grads``.
It works for any model chunks -- split by :func:`engine.model_split.split_model` or marking their shared weights
themselves:

* **tied weights**: a parameter with ``shared_embedding = True`` (Megatron's attribute) on a chunk of the first and
  of the last pipeline stage is one weight held twice (a word embedding tied to the output head); its two gradients
  are summed over the embedding group (``pg_collection.embd``: first and last pipeline rank), so both copies take
  the same optimizer step.  Both ends must mark the same number of weights with the same shapes, in the same order.
  A weight whose both uses live on one rank (one ``Parameter`` in two chunks) needs no marking.
* gradients are read through :func:`engine.runtime.main_grad.grad_of`: a parameter's fp32 ``main_grad`` when it has
  one (bf16 parameters), else ``.grad``.
* :func:`warn_unsynced_tied_weights` (called by the schedules on a training call without a
  ``finalize_model_grads_func``) warns once per model chunk when such weights would otherwise diverge silently.
"""
from __future__ import annotations

import warnings
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .runtime.main_grad import grad_of
from .runtime.process_groups import ProcessGroupCollection, group_size

__all__ = ["finalize_model_grads", "tied_weights", "all_reduce_grads", "sum_tied_grads",
           "warn_unsynced_tied_weights"]


def tied_weights(model_chunks: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The parameters marked ``shared_embedding = True`` in ``model_chunks``, each once, in chunk order."""
    seen, out = set(), []
    for chunk in model_chunks:
        for p in chunk.parameters():
            if getattr(p, "shared_embedding", False) and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _grad_params(model_chunks: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Every parameter that requires grad, each once (a Parameter shared by two chunks of one rank counts once);
    a missing gradient becomes zeros, so every rank of a group reduces the same tensors.  A parameter with a
    ``main_grad`` (:mod:`engine.runtime.main_grad`) is reduced through it."""
    seen, out = set(), []
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                if grad_of(p) is None:
                    p.grad = torch.zeros_like(p)
                out.append(p)
    return out


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient of ``p`` (:func:`~engine.runtime.main_grad.grad_of`), or for a DTensor parameter the local shard
    of it laid out like ``p`` (autograd may hand back another placement, e.g. a replicated embedding gradient; it
    is redistributed first)."""
    from torch.distributed.tensor import DTensor
    g = grad_of(p)
    if not isinstance(g, DTensor):
        return g
    if isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g.to_local()


def all_reduce_grads(params: Sequence[nn.Parameter], group, *, average: bool) -> None:
    """All-reduce the gradients of ``params`` over ``group`` (sum, or mean with ``average``), one flat tensor per
    (dtype, device).  No-op for a group of one rank (or ``None``)."""
    size = group_size(group)
    if size == 1 or not params:
        return
    buckets: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        g = grad_of(p)
        buckets.setdefault((g.dtype, g.device), []).append(p)
    for bucket in buckets.values():
        flat = torch.cat([_local_grad(p).reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=group)
        if average:
            flat.div_(size)
        offset = 0
        for p in bucket:
            g = _local_grad(p)
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n


def sum_tied_grads(weights: Sequence[nn.Parameter], pg_collection: ProcessGroupCollection) -> None:
    """Sum the gradients of the tied ``weights`` over the embedding group (no-op when it has one rank)."""
    if weights and len(pg_collection.embd_ranks) > 1 and pg_collection.embd is not None:
        for w in weights:
            if grad_of(w) is None:
                w.grad = torch.zeros_like(w)
        all_reduce_grads(weights, pg_collection.embd, average=False)


def _scale_by_tokens(params: Sequence[nn.Parameter], num_tokens: torch.Tensor,
                     pg: ProcessGroupCollection) -> None:
    """Per-token loss: the loss stage's token count, summed over data-parallel replicas, divides every gradient.
    The count is summed over the pipeline group (every other stage counts 0), so it reaches every rank wherever the
    loss stage is placed (the last rank, or rank 0 under the V placement)."""
    total = num_tokens.clone()
    if group_size(pg.pp) > 1:
        dist.all_reduce(total, group=pg.pp)
    if group_size(pg.dp_cp) > 1:
        dist.all_reduce(total, group=pg.dp_cp)
    scale = 1.0 / total.clamp(min=1).to(torch.float64)  # on the device: no host read of the count
    for p in params:
        grad_of(p).mul_(scale)


def finalize_model_grads(model_chunks: Sequence[nn.Module], num_tokens=None, *, pg_collection=None,
                         force_all_reduce: bool = False) -> None:
    """Finish this rank's gradients after the last backward of a step (Megatron-Core's order).

    1. Data-parallel all-reduce over ``pg_collection.dp`` of every gradient (mean; a sum when ``num_tokens`` is
       given, as Megatron's DDP does with ``calculate_per_token_loss``).  A chunk with ``finish_grad_sync()`` (a
       Megatron-style DDP wrapper) finishes its own reduction instead.
    2. Sum of the tied weights (``shared_embedding = True``) over the embedding group.
    3. ``num_tokens`` (``calculate_per_token_loss``; an int tensor: the loss stage's count there, 0 on the other
       pipeline ranks, as the schedules pass it): summed over the pipeline group and over ``dp_cp``, and every
       gradient is divided by ``max(total, 1)``.

    ``pg_collection`` defaults to ``engine.parallel_state.get_pg_collection()``; ``force_all_reduce`` is accepted
    for the schedule contract (pipecast always all-reduces).  Every rank of a group must call it.
    """
    del force_all_reduce  # only selects all-reduce over reduce-scatter in Megatron's distributed optimizer
    if pg_collection is None:
        from . import parallel_state
        pg_collection = parallel_state.get_pg_collection()
    chunks = list(model_chunks)
    own_sync = [c for c in chunks if callable(getattr(c, "finish_grad_sync", None))]
    for chunk in own_sync:
        chunk.finish_grad_sync()
    params = _grad_params(c for c in chunks if c not in own_sync)
    all_reduce_grads(params, pg_collection.dp, average=num_tokens is None)
    sum_tied_grads(tied_weights(chunks), pg_collection)
    if num_tokens is not None:
        _scale_by_tokens(_grad_params(chunks), num_tokens, pg_collection)


def warn_unsynced_tied_weights(model_chunks: Sequence[nn.Module]) -> None:
    """Warn (once per model chunk) that the chunks hold tied weights but no ``finalize_model_grads_func`` will sum
    their gradients -- the first and last stage's copies would silently diverge.  Call on training steps whose
    config has no ``finalize_model_grads_func``."""
    names = []
    for c, chunk in enumerate(model_chunks):
        if getattr(chunk, "_pipecast_tied_checked", False):
            continue
        object.__setattr__(chunk, "_pipecast_tied_checked", True)
        names += [f"chunk {c}: {n}" for n, p in chunk.named_parameters() if getattr(p, "shared_embedding", False)]
    if names:
        warnings.warn(f"model chunks hold tied weights ({', '.join(names)}) whose gradients must be summed over the "
                      "embedding group, but config.finalize_model_grads_func is None: the copies on the first and "
                      "last pipeline stage will diverge; set config.finalize_model_grads_func = "
                      "engine.finalize_model_grads (or call it after each schedule call)", UserWarning, stacklevel=4)
