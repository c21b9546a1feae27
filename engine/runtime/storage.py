"""The memory a tensor keeps alive: its plain tensors and their storages (``{data_ptr: bytes}``), for any tensor.

A strided tensor owns (a view of) one storage.  A **wrapper tensor subclass** owns none: a DTensor (tensor and
sequence parallelism, FSDP2's sharded parameters), functional collectives' ``AsyncCollectiveTensor`` (what a
DTensor redistribution such as sequence parallelism's all-gather / reduce-scatter leaves as its local tensor)
report the global shape, and ``untyped_storage()`` of the wrapper raises "Attempted to access the data pointer on
an invalid python storage"; its memory is that of the tensors it wraps, which it names through
``__tensor_flatten__`` (torch's traceable-wrapper-subclass protocol, ``torch/utils/_python_dispatch.py``), possibly
wrappers again.  A sparse tensor's memory is that of its index and value tensors.  Every memory count of pipecast
(split backward's held bytes, the tuner's activation probe) goes through :func:`storage_sizes` / :func:`local_bytes`.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["plain_tensors", "storage_sizes", "local_bytes"]

_SPARSE_PARTS = {  # layout -> the methods returning its plain component tensors
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def plain_tensors(t: torch.Tensor) -> list:
    """The strided tensors holding ``t``'s data: ``[t]`` for a strided tensor, the inner tensors (recursively) of a
    wrapper subclass, the components of a sparse tensor."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # may also name non-tensor attributes (a DTensor's device mesh)
        inner = (getattr(t, n) for n in names)
        return [x for i in inner if isinstance(i, torch.Tensor) for x in plain_tensors(i)]
    parts = _SPARSE_PARTS.get(t.layout)
    if parts is not None:
        return [x for p in parts for x in plain_tensors(getattr(t, p)())]
    return [t]


def storage_sizes(t: torch.Tensor) -> dict:
    """``{storage data_ptr: storage bytes}`` of the storages ``t`` keeps alive (merge dicts to count shared
    storages once)."""
    return {s.data_ptr(): s.nbytes() for s in (x.untyped_storage() for x in plain_tensors(t))}


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this process's part of ``t`` (a DTensor's local shard, not its global shape)."""
    return sum(x.nbytes for x in plain_tensors(t))
