"""Graphed layers under activation recomputation (``engine.runtime.recompute``): the block's backward recomputes it
and backpropagates the recomputed graph itself, so its weight gradients reach ``.grad`` from inside the backward,
not through the graph's autograd outputs.

A captured backward writes those gradients wherever ``.grad`` pointed at capture time; the first H200 run lost them
(``model.recompute: full`` with graphs trained on other gradients than eager).  The capture now notes such
parameters in the warmup and installs their gradient buffers as ``.grad`` around the capture and every replay.  The
``emulate`` backend models the fault (a replay's ``.grad`` writes go to the tensor the capture saw), so the CPU
runs of these tests fail without the fix; ``torch`` runs them on a GPU.
"""
from __future__ import annotations

import copy

import pytest
import torch

from engine.plan import build_plan
from engine.runtime.recompute import apply_recompute
from graphs import capture
from graphs.backends import common
from graphs.capture import DebugOptions
from graphs.local_rank import WeightQueue, make_rank_data, run_rank_step, sgd_step
from tests.graphs.test_graphs_emulate import Block, bitwise_equal, param_grads

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BACKENDS = ["emulate", pytest.param("torch", marks=[pytest.mark.cuda, CUDA])]
S, B, H = 3, 2, 8


def _recomputed_chunks(num_chunks: int, device: str):
    torch.manual_seed(0)
    eager = [[Block(H).to(device) for _ in range(2)] for _ in range(num_chunks)]
    graphed = copy.deepcopy(eager)
    for chunks in (eager, graphed):
        for chunk in chunks:
            apply_recompute(chunk)
    return eager, graphed


def _samples(chunks, m, device):
    return [(torch.ones(S, B, H, device=device, requires_grad=True),) for chunk in chunks for _ in range(m)
            for _ in chunk]


def _count_hooks(chunks) -> list:
    fired = []
    for p in (p for chunk in chunks for layer in chunk for p in layer.parameters()):
        p.register_post_accumulate_grad_hook(lambda q: fired.append(q.grad.sum().item()))
    return fired


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schedule,chunks", [("interleaved", 2), ("zbv", 2)])
def test_recomputed_blocks_graphed_equal_eager(backend, schedule, chunks):
    """Losses, input and parameter gradients bitwise eager's over three steps (unsplit and split backward); the
    post-accumulate-grad hooks fire as often (unsplit: with the same gradients) and none fires during the
    capture."""
    device = "cuda" if backend == "torch" else "cpu"
    plan = build_plan(schedule, 2, 4, chunks, 2 if schedule == "interleaved" else None)
    eager, graphed = _recomputed_chunks(chunks, device)
    fired = {"eager": _count_hooks(eager), "graphs": _count_hooks(graphed)}
    queue = WeightQueue() if plan.splits_backward else None
    layers = capture(graphed, plan, 0, _samples(graphed, 4, device), backend=backend,
                     defer_weight_grad=queue.defer if queue else None)
    assert layers.active, layers.report
    assert fired["graphs"] == []  # the warmup's and the capture's .grad writes ran no hook
    assert all(len(s.side_params) == 6 for s in layers.graphs.callables)  # fc1, fc2, norm: weight and bias
    data = make_rank_data(chunks, 4, (S, B, H), device=device)
    ref, got = [], []
    for _ in range(3):
        for group, out, weights in ((eager, ref, None), (graphed, got, queue)):
            r = run_rank_step(group, plan, 0, data, weights=weights)
            out.append((r, [g.clone() for g in param_grads(group)]))
            sgd_step(group)
    assert bitwise_equal(ref, got)
    assert len(fired["eager"]) == len(fired["graphs"]) > 0
    if queue is None:  # split: the hooks follow each W replay, when later microbatches' B may have written already
        assert sorted(fired["eager"]) == sorted(fired["graphs"])
    layers.remove()


def test_side_writes_need_accumulated_gradients():
    """Gradients returned per replay (``param_grads='clone'``) cannot carry what the backward writes into
    ``.grad`` itself: the capture falls back to eager, naming the layer and the fix."""
    plan = build_plan("interleaved", 2, 4, 2, 2)
    _, graphed = _recomputed_chunks(2, "cpu")
    layers = capture(graphed, plan, 0, _samples(graphed, 4, "cpu"), backend="emulate",
                     _debug=DebugOptions(param_grads="clone"))
    assert not layers.active
    assert "param_grads='accumulate'" in layers.report.reason and "Block" in layers.report.reason


def test_emulate_models_a_capture_without_the_buffers(monkeypatch):
    """Negative control: with the buffers not installed around the capture, the emulated graphs lose the
    recomputed blocks' weight gradients, as the CUDA graphs did."""
    def no_attach(self):
        return common.redirected_grads([])
    monkeypatch.setattr(common.ReplaySlot, "capturing_side_writes", no_attach)
    plan = build_plan("interleaved", 2, 4, 2, 2)
    eager, graphed = _recomputed_chunks(2, "cpu")
    layers = capture(graphed, plan, 0, _samples(graphed, 4, "cpu"), backend="emulate")
    data = make_rank_data(2, 4, (S, B, H))
    ref = run_rank_step(eager, plan, 0, data), [g.clone() for g in param_grads(eager)]
    got = run_rank_step(graphed, plan, 0, data), [None if g is None else g.clone() for g in param_grads(graphed)]
    assert not bitwise_equal([ref], [got])
    layers.remove()
