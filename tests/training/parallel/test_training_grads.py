"""GradSync on 2 data-parallel gloo ranks: the overlapped all-reduce gives the average, also when a schedule
enabled sync too early (gradients changed after the launch), and no_sync defers it."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks


def _job(rank, world):
    from engine.runtime.process_groups import build_process_groups
    from engine.training.parallel.data_parallel import GradSync
    pg = build_process_groups(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    sync = GradSync([model], pg, overlap=True)
    x = torch.full((2, 4), float(rank + 1))
    out = {}
    # 1) accumulate under no_sync, last backward with sync: one launch, the average of the sums
    with sync.no_sync():
        model(x).sum().backward()
    model(x).sum().backward()
    out["launched"] = sync.buckets[0].handle is not None
    sync.finalize_model_grads([model])
    out["normal"] = model.weight.grad.clone()
    # 2) sync enabled for two backwards: the first launch is stale and finalize must redo it
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    model(x).sum().backward()
    sync.finalize_model_grads([model])
    out["early"] = model.weight.grad.clone()
    sync.close()
    pg.destroy()
    return out


@pytest.mark.timeout(60)
def test_overlapped_data_parallel_average():
    results = run_ranks(_job, 2, timeout=50)
    # d/dW sum(W x + b) = x summed over the batch: 2 * (rank + 1) per entry and backward; two backwards each
    expected = torch.full((3, 4), (2 * 1 * 2 + 2 * 2 * 2) / 2)
    for out in results:
        assert out["launched"]
        assert torch.equal(out["normal"], expected)
        assert torch.equal(out["early"], expected)
