"""Gradient synchronisation of one rank's model chunks: data-parallel all-reduce and tied-embedding sum.

:class:`GradSync` provides the two hooks the schedules call (Megatron's ``no_sync_func`` / ``grad_sync_func``):

* ``no_sync()`` -- a context manager; inside it, backward passes only accumulate gradients.  The schedules run
  every backward inside it except the last backward of each model chunk.
* ``finalize_model_grads(model_chunks, num_tokens=None, pg_collection=None, force_all_reduce=False)`` -- called
  once at the end of a training step.  Order as in Megatron-Core's ``finalize_model_grads``: first the
  data-parallel all-reduce (average) of every gradient, then the sum of the tied word-embedding gradients over
  the embedding group (first and last pipeline stage), so that both copies receive the same update
  (:func:`engine.finalize.sum_tied_grads` on the weights marked ``shared_embedding``).

With ``overlap=True`` the data-parallel all-reduce of a chunk starts (``async_op``) as soon as the last
gradient of the chunk has been accumulated by a backward that ran with sync enabled (a post-accumulate-grad hook),
overlapping communication with the remaining backward passes; ``finalize_model_grads`` waits for it.  If a
gradient changed after its all-reduce was launched (a schedule that enabled sync too early) the chunk is reduced
again synchronously, so the result never depends on the timing.  CUDA-graph replays (``graphs``) write
gradients without autograd; they run these hooks and bump the gradient buffers' version counters themselves
(``graphs.backends.common.fire_post_accumulate_hooks``), so overlap and the late-change check hold with graphs,
split-backward ``W`` graphs included.

Mixture-of-experts layers (:mod:`engine.moe`): a routed expert's parameters (``param.expert_parallel``) are reduced
over the expert-data-parallel group ``pg.expt_dp`` (the ranks holding the same experts) in a bucket of their own,
and scaled by ``1 / data`` like the dense ones -- Megatron-Core's ``DistributedDataParallel`` (expert gradient
scaling factor ``1 / data``): an expert's gradient already sums the tokens its expert-parallel peers sent it.
Under tensor parallelism (expert-tensor size 1) ``pg.expt_dp`` also holds the tensor-parallel peers, each of which
routed its share of the sequence (:meth:`engine.moe.MoELayer.shard_tokens`), so the sum covers the whole sequence.

The global-norm clip of the gradients is :func:`engine.training.parallel.grad_norm.clip_grad_norm_` (every
layout's); :class:`engine.training.parallel.Parallelism` picks this class or its ZeRO-1 / FSDP2 forms.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...finalize import sum_tied_grads, tied_weights
from ...moe import is_expert_parameter
from ...runtime.process_groups import ProcessGroupCollection, group_size
from .dtensor import align_grads, local

__all__ = ["GradSync"]


def _versions(g: torch.Tensor) -> tuple:
    """What an in-place write to ``g`` changes: its version counter and that of its local tensor.  A DTensor's
    in-place op (autograd accumulating a second contribution into a DTensor ``.grad``) bumps the wrapper's
    counter only (the local op runs below autograd's version tracking); a write to ``to_local()`` bumps the local
    one only."""
    return g._version, local(g)._version


class _Bucket:
    """Parameters of one model chunk reduced as one flat tensor over ``group`` (the data-parallel group; the
    expert-data-parallel one for routed experts)."""

    def __init__(self, params: list[nn.Parameter], group=None):
        self.params, self.group = params, group
        self.ready: set[int] = set()
        self.handle = None
        self.flat: torch.Tensor | None = None
        self.snapshot: list[tuple[torch.Tensor, int]] = []

    def flatten(self) -> torch.Tensor:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        align_grads(self.params)
        self.snapshot = [(p.grad, _versions(p.grad)) for p in self.params]
        return torch.cat([local(p.grad).reshape(-1) for p in self.params])  # local shards of DTensor grads

    def changed_since_flatten(self) -> bool:
        return any(p.grad is not g or _versions(g) != v for p, (g, v) in zip(self.params, self.snapshot))

    def unflatten(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            g = local(p.grad)
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    def reset(self) -> None:
        self.ready.clear()
        self.handle = self.flat = None
        self.snapshot = []


class GradSync:
    """Data-parallel gradient reduction and tied-embedding synchronisation for one rank's model chunks.

    Args:
        chunks: this rank's model chunks.
        pg: the process groups (``dp`` for the data-parallel average, ``embd`` for the tied embedding).
        overlap: launch each chunk's data-parallel all-reduce when its gradients are complete.
        tracer: optional ``engine.runtime.tracing.Tracer``; finalize reports a ``"sync"`` span.
        tied_on_one_rank: the first and the last stage are on one rank (V placement): they share one tied
            ``Parameter`` there, and no rank communicates over the embedding group.
    """

    def __init__(self, chunks: Sequence[nn.Module], pg: ProcessGroupCollection, overlap: bool = True,
                 tracer=None, tied_on_one_rank: bool = False):
        self.chunks = list(chunks)
        self.pg = pg
        self.dp_size = group_size(pg.dp)
        self.tracer = tracer
        self.sync_enabled = True
        seen: set = set()  # a Parameter two chunks share (V placement's tied ends) belongs to the first's bucket
        self.buckets = [b for c in self.chunks for b in self._chunk_buckets(
            [p for p in c.parameters() if p.requires_grad and not (id(p) in seen or seen.add(id(p)))])]
        self.tied = tied_weights(self.chunks)  # marked shared_embedding (ModelChunk, engine.split_model)
        self._tied_on_one_rank = tied_on_one_rank
        self._hooks = []
        if overlap:
            for bucket in self.buckets:
                if group_size(bucket.group) > 1:
                    for i, p in enumerate(bucket.params):
                        self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(bucket, i)))

    def _chunk_buckets(self, params: list) -> list[_Bucket]:
        """One chunk's bucket over the data-parallel group, or two when its routed experts are reduced over another
        group (``pg.expt_dp`` under expert parallelism; Megatron-Core's
        expert gradient reduction, scaled like the dense gradients by ``1 / data``)."""
        expt_dp = self.pg.expt_dp if self.pg.expt_dp is not None else self.pg.dp
        if expt_dp is self.pg.dp:
            return [_Bucket(params, self.pg.dp)]
        dense = [p for p in params if not is_expert_parameter(p)]
        experts = [p for p in params if is_expert_parameter(p)]
        return [_Bucket(dense, self.pg.dp)] + ([_Bucket(experts, expt_dp)] if experts else [])

    def _hook(self, bucket: _Bucket, index: int):
        def on_grad(_param: torch.Tensor) -> None:
            if not self.sync_enabled or bucket.handle is not None:
                return
            bucket.ready.add(index)
            if len(bucket.ready) == len(bucket.params):
                bucket.flat = bucket.flatten()
                bucket.handle = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        return on_grad

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Suppress the data-parallel reduction for the backward passes inside (gradients accumulate)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def finalize_model_grads(self, model_chunks=None, num_tokens=None, pg_collection=None,
                             force_all_reduce: bool = False) -> None:
        """Finish the data-parallel average and sum the tied-embedding gradients (Megatron's order).

        ``num_tokens`` is accepted for the schedule contract; the trainer's loss uses the 3-tuple pattern without
        ``calculate_per_token_loss``, so it is always None here.
        """
        span = self.tracer.span("sync", "finalize grads") if self.tracer else contextlib.nullcontext()
        with span:
            align_grads(p for b in self.buckets for p in b.params)  # parallel.tensor > 1: grads laid out as params
            for bucket in self.buckets:
                if self.dp_size > 1 or group_size(bucket.group) > 1:
                    self._reduce(bucket)
            if not self._tied_on_one_rank:  # V placement: one shared Parameter, no embedding-group communication
                sum_tied_grads(self.tied, self.pg)

    def _reduce(self, bucket: _Bucket) -> None:
        """Sum ``bucket`` over its group (waiting for an overlapped launch, redone if a gradient changed after it)
        and divide by the data-parallel size."""
        if group_size(bucket.group) > 1:
            if bucket.handle is not None:
                bucket.handle.wait()
                if bucket.changed_since_flatten():  # gradients moved on after the launch: redo
                    bucket.handle = None
            if bucket.handle is None:
                bucket.flat = bucket.flatten()
                dist.all_reduce(bucket.flat, group=bucket.group)
        else:
            bucket.flat = bucket.flatten()
        bucket.unflatten(bucket.flat.div_(self.dp_size))
        bucket.reset()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

