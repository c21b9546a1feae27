"""Memory counts of tensors that own no storage (wrapper subclasses, sparse tensors): engine.runtime.storage, and
the split backward's held bytes, which count through it (issue 36: sequence parallelism under a split schedule
crashed in B on a gradient that was a wrapper subclass)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from engine.model_parallel_config import ModelParallelConfig
from engine.runtime.split_backward import backward_input_step, weight_grad_deferral
from engine.runtime.storage import local_bytes, plain_tensors, storage_sizes


def test_a_wrapper_subclass_counts_the_storages_it_wraps():
    x = torch.randn(4, 3)
    wrapped = AsyncCollectiveTensor(AsyncCollectiveTensor(x))  # what a DTensor redistribution leaves, nested
    with pytest.raises(RuntimeError, match="invalid python storage"):
        wrapped.untyped_storage().data_ptr()  # why a plain storage count cannot be used on it
    (plain,) = plain_tensors(wrapped)
    assert plain is x
    assert storage_sizes(wrapped) == {x.untyped_storage().data_ptr(): 48} == storage_sizes(x[1:])
    assert local_bytes(wrapped) == 48


def test_a_sparse_tensor_counts_its_indices_and_values():
    coo = torch.eye(4).to_sparse()
    assert storage_sizes(coo) == {t.untyped_storage().data_ptr(): t.nbytes for t in (coo._indices(), coo._values())}
    assert local_bytes(coo) == 2 * 4 * 8 + 4 * 4


@pytest.mark.parametrize("mode", ["layer", "generic"])
def test_split_backward_with_a_wrapper_subclass_gradient(mode):
    """The gradient received from the next stage is a wrapper subclass (as under sequence parallelism): B runs,
    W holds what it holds with a plain gradient, and the weight gradients are bitwise the plain ones."""
    results = []
    for wrap in (lambda g: g, AsyncCollectiveTensor):
        torch.manual_seed(0)
        chunk = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        x = torch.randn(4, 2, 8, requires_grad=True)
        with weight_grad_deferral():
            y = chunk(x)
        grad_in, work = backward_input_step(x, y, wrap(torch.randn(4, 2, 8)), ModelParallelConfig(), mode=mode)
        held = work.held_bytes()
        work.run()
        results.append((held, grad_in, [p.grad for p in chunk.parameters()]))
    (held, grad_in, grads), (held_w, grad_in_w, grads_w) = results
    assert held_w == held > 0
    assert torch.equal(grad_in_w, grad_in)
    assert all(torch.equal(a, b) for a, b in zip(grads_w, grads))
