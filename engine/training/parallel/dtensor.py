"""``DTensor`` helpers every parallelism of the recipe shares (tensor parallel, FSDP2, the gradient sync, the norm
clip, ``model.init_from``): local shards, gradient placements, DTensor's caches, full tensors cut to shards.

A tensor that is not a ``DTensor`` passes through every function here unchanged, so callers need not ask which
layout runs.
"""
from __future__ import annotations

import torch

__all__ = ["local", "align_grads", "clear_caches", "reshard_like", "checkpoint_form", "LocalChunks", "strided_chunks",
           "flat_range_chunks"]


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


def reshard_like(loaded: dict, template: dict) -> dict:
    """The full tensors of ``loaded`` cut to this rank's shards of ``template``'s DTensors (local slicing, no
    communication: every rank read the same full tensors, e.g. a Hugging Face folder)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    out = {}
    for k, v in loaded.items():
        t = template.get(k)
        out[k] = distribute_tensor(v, t.device_mesh, t.placements, src_data_rank=None) \
            if isinstance(t, DTensor) and not isinstance(v, DTensor) else v
    return out


def checkpoint_form(sd: dict) -> dict:
    """``sd`` as DCP saves and loads it without a gather: a ``DTensor`` with a regular placement stays as it is
    (DCP writes its local shard with its offset, and reads a target shard from whatever shards a checkpoint
    holds); one sharded by ``_StridedShard`` (tensor parallelism's fused ``qkv``: ``q | k | v`` row blocks, each
    sharded) becomes :class:`LocalChunks` (:func:`strided_chunks`), which hands DCP its local rows as the
    separate chunks of the full tensor they are.
    Nested dicts are walked; the values keep their storage, so a load into the result fills ``sd``'s tensors."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            v = checkpoint_form(v)
        elif isinstance(v, DTensor) and any(isinstance(p, _StridedShard) for p in v.placements):
            v = strided_chunks(v)
        out[k] = v
    return out


def strided_chunks(dt) -> "LocalChunks":
    """A ``_StridedShard(dim, split_factor=k)`` DTensor on a 1-D mesh as :class:`LocalChunks`: the full ``dim`` is
    cut into ``k`` blocks of ``n / k``, each sharded evenly over the mesh, so mesh rank ``c``'s local tensor is
    ``k`` blocks of ``n / (k T)`` rows, block ``j`` at offset ``j n / k + c n / (k T)`` of the full tensor."""
    local = dt.to_local()
    (placement,) = dt.placements
    dim, k, n = placement.dim, placement.split_factor, dt.shape[placement.dim]
    part = n // k // dt.device_mesh.size()
    rank = dt.device_mesh.get_local_rank()
    blocks = []
    for j in range(k):
        offsets = [0] * local.dim()
        offsets[dim] = j * (n // k) + rank * part
        blocks.append((local.narrow(dim, j * part, part), offsets))
    return LocalChunks(dt.shape, blocks, local)


def flat_range_chunks(shape, start: int, piece: torch.Tensor) -> "LocalChunks":
    """The elements ``[start, start + piece.numel())`` of a row-major tensor of ``shape`` (1-D or 2-D), held as
    the 1-D ``piece`` (ZeRO-1's part of a parameter's moment), as :class:`LocalChunks`: at most three rectangles
    (the rest of a first row, whole rows, the start of a last row), each a view of ``piece``."""
    shape = torch.Size(shape)
    if len(shape) == 1:
        return LocalChunks(shape, [(piece, [start])] if piece.numel() else [], piece)
    cols, end, blocks, at = shape[1], start + piece.numel(), [], start
    while at < end:
        row, col = divmod(at, cols)
        if col or end - at < cols:  # a partial row
            width = min(cols - col, end - at)
            rows = 1
        else:
            width, rows = cols, (end - at) // cols
        view = piece[at - start:at - start + rows * width].view(rows, width)
        blocks.append((view, [row, col]))
        at += rows * width
    return LocalChunks(shape, blocks, piece)


class LocalChunks(torch.Tensor):
    """What DCP saves of, and loads into, a tensor this rank holds in parts: the full ``shape``, and ``blocks``
    (tensor, offsets in the full tensor) -- views of this rank's storage, each one chunk of the saved tensor (DCP's
    ``_Checkpointable`` protocol: ``torch/distributed/checkpoint/planner_helpers.py``).  A rank may hold no block
    (DCP writes and reads nothing of the key there).  A wrapper with no tensor operations: DCP only asks it for
    its chunks and their tensors; :attr:`local` is the storage they view."""

    @staticmethod
    def __new__(cls, shape, blocks, local):
        self = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=local.dtype, device=local.device)
        self._blocks, self.local = blocks, local
        return self

    def _chunks(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        for block, offsets in self._blocks:
            yield block, ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=block.shape)

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(
                              block), size=self.shape)) for block, chunk in self._chunks()]

    def __create_chunk_list__(self) -> list:
        return [chunk for _, chunk in self._chunks()]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for block, chunk in self._chunks():
            if chunk.offsets == index.offset:
                return block
        raise ValueError(f"{index.fqn}: no local block at offset {list(index.offset)}")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func} on LocalChunks: it only hands DCP its blocks")
