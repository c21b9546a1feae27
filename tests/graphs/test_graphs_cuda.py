"""The ``torch`` backend on a real GPU (skipped without CUDA): ordered capture of per-(chunk, microbatch, layer)
graphs replays bitwise like eager; a shared graph per layer does not; a capture that fails (host sync inside the
layer) falls back to eager cleanly.  The benchmark ``benchmarks/cuda_graphs_bench.py`` covers larger sizes."""
from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch

from engine.plan import build_plan
from graphs import capture
from graphs.capture import DebugOptions
from graphs.local_rank import make_rank_data
from tests.graphs.test_graphs_emulate import Block, bitwise_equal, run_steps

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

S, B, H = 16, 2, 8


def cuda_chunks(num_chunks, layers, seed=0):
    torch.manual_seed(seed)
    return [[Block().cuda() for _ in range(layers)] for _ in range(num_chunks)]


def cuda_samples(chunks, m):
    return [(torch.ones(S, B, H, device="cuda", requires_grad=True),) for chunk in chunks for _ in range(m)
            for _ in chunk]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("schedule,pp,vp,m,g,rank", [("interleaved", 2, 2, 4, 2, 0), ("interleaved", 2, 2, 5, 3, 1),
                                                     ("1f1b", 4, 1, 4, None, 0)])
def test_torch_backend_bitwise_equal_eager(schedule, pp, vp, m, g, rank):
    plan = build_plan(schedule, pp, m, vp, g)
    eager = cuda_chunks(vp, 2)
    graphed = copy.deepcopy(eager)
    data = make_rank_data(vp, m, (S, B, H), device="cuda")
    layers = capture(graphed, plan, rank, cuda_samples(graphed, m), backend="torch")
    assert layers.active and layers.report.backend == "torch", layers.report
    assert bitwise_equal(run_steps(eager, plan, rank, data, 3), run_steps(graphed, plan, rank, data, 3))
    layers.remove()


def test_torch_backend_shared_graph_negative_control():
    plan = build_plan("interleaved", 2, 4, 2, 2)
    eager = cuda_chunks(2, 1)
    shared = copy.deepcopy(eager)
    data = make_rank_data(2, 4, (S, B, H), device="cuda")
    capture(shared, plan, 0, cuda_samples(shared, 4), backend="torch", share_graphs=True,
            _debug=DebugOptions(allow_unsafe_sharing=True))
    assert not bitwise_equal(run_steps(eager, plan, 0, data, 1), run_steps(shared, plan, 0, data, 1))


class HostSync(Block):
    def forward(self, x):
        if x.sum().item() > 1e30:  # a host sync: illegal during capture
            return x
        return super().forward(x)


def test_failed_capture_falls_back_to_eager(caplog):
    """The warmup finds the host sync (dispatch check and ``set_sync_debug_mode("error")``) before any capture;
    the thread is back on its stream and GC as the caller had it."""
    plan = build_plan("1f1b", 2, 2)
    torch.manual_seed(0)
    eager = [[HostSync().cuda()]]
    graphed = copy.deepcopy(eager)
    stream = torch.cuda.current_stream()
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        layers = capture(graphed, plan, 0, cuda_samples(graphed, 2), backend="torch")
    assert not layers.active and "capture error" in layers.report.reason
    assert "HostSync" in layers.report.reason and "_local_scalar_dense" in layers.report.reason
    assert gc.isenabled() and torch.cuda.current_stream() == stream
    assert len([r for r in caplog.records if r.name == "pipecast.graphs"]) == 1
    data = make_rank_data(1, 2, (S, B, H), device="cuda")
    assert bitwise_equal(run_steps(eager, plan, 0, data, 1), run_steps(graphed, plan, 0, data, 1))


def test_torch_backend_under_bf16_autocast():
    """Captured under bf16 autocast (cast cache off, weights recast on every replay); the eager reference enters
    autocast per step, as ``engine.runtime.step`` does, so it recasts the updated weights every step too."""
    plan = build_plan("interleaved", 2, 4, 2, 2)
    eager = cuda_chunks(2, 2)
    graphed = copy.deepcopy(eager)
    data = make_rank_data(2, 4, (S, B, H), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layers = capture(graphed, plan, 0, cuda_samples(graphed, 4), backend="torch")
    assert layers.active, layers.report
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = run_steps(eager, plan, 0, data, 1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = run_steps(graphed, plan, 0, data, 1)
        assert bitwise_equal(ref, got)


@pytest.mark.parametrize("schedule,C,M,rank", [("zb_h1", 1, 4, 0), ("zbv", 2, 4, 0), ("zbv", 2, 4, 1)])
def test_torch_backend_split_backward_bitwise_equal_eager(schedule, C, M, rank):
    """F, B and W CUDA graphs per (chunk, microbatch, layer), captured in the plan's order with its W actions:
    B replays compute input gradients only, the W replays (queued by B, run at the plan's W) the weight gradients;
    losses, input and parameter gradients bitwise eager's over three steps."""
    from graphs.local_rank import WeightQueue, run_rank_step, sgd_step
    from tests.graphs.test_graphs_emulate import param_grads
    plan = build_plan(schedule, 2, M, C)
    eager = cuda_chunks(C, 2)
    graphed = copy.deepcopy(eager)
    queue = WeightQueue()
    data = make_rank_data(C, M, (S, B, H), device="cuda")
    layers = capture(graphed, plan, rank, cuda_samples(graphed, M), backend="torch", defer_weight_grad=queue.defer)
    assert layers.active and layers.report.backend == "torch", layers.report
    assert all(s.wgt_graph is not None for s in layers.graphs.callables)
    ref, got = [], []
    for _ in range(3):
        for chunks, out, weights in ((eager, ref, None), (graphed, got, queue)):
            r = run_rank_step(chunks, plan, rank, data, weights=weights)
            out.append((r, [g.clone() for g in param_grads(chunks)]))
            sgd_step(chunks)
    assert bitwise_equal(ref, got) and layers.guard.at_step_boundary and not queue.pending
    layers.remove()


def test_torch_backend_hooks_other_shapes_and_pool_bytes():
    """On a GPU: the backward replays run the post-accumulate-grad hooks with eager's accumulated gradients; a
    microbatch of another sequence length runs its pass eagerly (bitwise eager's step, guard at the boundary); the
    graph pool's segments (``graphs.accounting.pool_bytes``) are found and reserve at least what they hold."""
    from graphs.accounting import pool_bytes
    plan = build_plan("interleaved", 2, 4, 2, 2)
    eager = cuda_chunks(2, 2)
    graphed = copy.deepcopy(eager)
    layers = capture(graphed, plan, 0, cuda_samples(graphed, 4), backend="torch")
    assert layers.active, layers.report
    pool = pool_bytes(layers.graphs)
    assert pool["segments"] > 0 and pool["reserved"] >= pool["allocated"] > 0, pool
    fired = {"eager": [], "graphs": []}
    for name, chunks in (("eager", eager), ("graphs", graphed)):
        for p in (p for chunk in chunks for layer in chunk for p in layer.parameters()):
            p.register_post_accumulate_grad_hook(lambda q, f=fired[name]: f.append(q.grad.clone()))
    data = make_rank_data(2, 4, (S, B, H), device="cuda")
    data.inputs[1][2], data.grads[1][2] = torch.randn(S + 2, B, H, device="cuda"), torch.randn(S + 2, B, H,
                                                                                                device="cuda")
    assert bitwise_equal(run_steps(eager, plan, 0, data, 2), run_steps(graphed, plan, 0, data, 2))
    assert layers.eager_calls == 2 * 2 and layers.guard.at_step_boundary
    assert len(fired["eager"]) == len(fired["graphs"]) > 0
    assert sorted(t.sum().item() for t in fired["eager"]) == sorted(t.sum().item() for t in fired["graphs"])
    layers.remove()
