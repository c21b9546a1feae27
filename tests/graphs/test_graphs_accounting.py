"""What graphs cost, counted on the emulate backend (``graphs.accounting``).

* Memory: the captured graphs hold one gradient buffer per parameter (not a parameter-gradient copy per
  ``(chunk, microbatch, layer)``), one input gradient and one output per slot, and only layer 0's static input and
  the last layer's static grad-output per ``(chunk, microbatch)`` (consecutive layers share buffers).  The same
  counts on the ``meta`` device size the GPU preset without allocating it.
* Host work: outside the replays themselves, a step runs no parameter-gradient clone or accumulation, and copies
  only into layer 0's input and the last layer's grad-output (a dispatch-mode op counter).
"""
from __future__ import annotations

import copy

import pytest
import torch

from engine.plan import build_plan
from graphs import capture
from graphs.accounting import LiveBytes, OpCounter, held_bytes
from graphs.backends.emulate import EmulatedSlot
from graphs.capture import DebugOptions
from graphs.local_rank import make_rank_data, run_rank_step
from tests.graphs.test_graphs_emulate import B, H, S, bitwise_equal, make_chunks, run_steps, samples

V, L, M = 2, 3, 4
ACT = S * B * H * 4  # bytes of one [s, b, h] fp32 activation


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs with one thread (fixture in conftest.py)."""


def _captured(**kwargs):
    plan = build_plan("interleaved", 2, M, V, 2)
    eager = make_chunks(V, L)
    graphed = copy.deepcopy(eager)
    layers = capture(graphed, plan, 0, samples(graphed, M), backend="emulate", **kwargs)
    assert layers.active, layers.report
    return plan, eager, graphed, layers


def _param_bytes(chunks) -> int:
    return sum(p.numel() * p.element_size() for chunk in chunks for layer in chunk for p in layer.parameters())


def test_graphs_hold_one_gradient_buffer_per_parameter_and_chained_buffers():
    plan, eager, graphed, layers = _captured()
    held = held_bytes(layers.graphs)
    assert held["param_grad_buffers"] == _param_bytes(graphed)  # one per parameter, shared by all microbatches
    # per (chunk, microbatch): L+1 activation buffers forward (layer 0's input, each layer's output, which is the
    # next layer's input) and L+1 backward (the last grad-output, each layer's input gradient, which is the
    # previous layer's grad-output); no parameter-gradient copies
    assert held["static_inputs"] + held["static_outputs"] == V * M * (L + 1) * ACT
    assert held["grad_outputs"] + held["grad_inputs"] == V * M * (L + 1) * ACT
    data = make_rank_data(V, M, (S, B, H))
    assert bitwise_equal(run_steps(eager, plan, 0, data, 3), run_steps(graphed, plan, 0, data, 3))
    with LiveBytes() as live:
        run_rank_step(eager, plan, 0, data)
    assert live.peak > 0
    print(f"held by graphs {held['total']} B vs eager step peak {live.peak} B")


def test_without_accumulation_and_chaining_the_graphs_hold_far_more():
    """The layout before in-graph accumulation and chaining, for the figures: per slot a parameter-gradient copy
    and its own static input and grad-output."""
    _, _, graphed, layers = _captured(chain_layers=False, _debug=DebugOptions(param_grads="clone"))
    held = held_bytes(layers.graphs)
    assert held["param_grad_buffers"] == 0
    assert held["grad_inputs"] == V * M * L * ACT + M * _param_bytes(graphed)
    assert held["static_inputs"] == held["grad_outputs"] == V * M * L * ACT


def test_chained_layer_called_on_another_tensor_raises():
    plan, _, graphed, layers = _captured()
    layer0, layer1 = graphed[0][0], graphed[0][1]
    for layer in graphed[0]:
        layer.current_microbatch = 0
    x = torch.randn(S, B, H, requires_grad=True)
    y = layer0(x)
    with pytest.raises(RuntimeError, match="its input is not layer 0's output"):
        layer1(y * 2)


def _counting(monkeypatch) -> OpCounter:
    counter = OpCounter()
    for name in ("replay_forward", "replay_backward"):
        real = getattr(EmulatedSlot, name)

        def paused(self, _real=real):
            with counter.paused():
                _real(self)
        monkeypatch.setattr(EmulatedSlot, name, paused)
    return counter


def test_host_ops_per_replay(monkeypatch):
    plan, _, graphed, _ = _captured()
    counter = _counting(monkeypatch)
    data = make_rank_data(V, M, (S, B, H))
    run_rank_step(graphed, plan, 0, data)
    for chunk in graphed:
        for layer in chunk:
            for p in layer.parameters():
                p.grad = None
    with counter:
        run_rank_step(graphed, plan, 0, data)
    passes, slots, n_params = V * M, V * M * L, sum(1 for c in graphed for la in c for _ in la.parameters())
    c = counter.counts
    assert c.get("clone", 0) == 2 * passes  # the driver's own input and input-grad copies; no parameter clone
    assert c.get("copy_", 0) == 2 * passes  # into layer 0's input and the last layer's grad-output only
    assert c.get("add_", 0) == 0  # parameter gradients accumulate inside the (backward) replay
    assert c.get("zero_", 0) == n_params  # each gradient buffer is zeroed once per step (grad was None)
    assert c.get("detach", 0) == 2 * slots + 4 * passes  # per slot the output and input-gradient aliases; the
    # driver detaches 4 times per pass


def test_pool_segments_sum_the_segments_of_the_graphs_pool_only():
    from graphs.accounting import pool_segments
    snapshot = [{"segment_pool_id": (0, 0), "total_size": 20 << 20, "allocated_size": 3 << 20},  # default pool
                {"segment_pool_id": (1, 7), "total_size": 2 << 20, "allocated_size": 1 << 20},
                {"segment_pool_id": [1, 7], "total_size": 20 << 20, "allocated_size": 0},
                {"segment_pool_id": (1, 8), "total_size": 4 << 20, "allocated_size": 4 << 20}]  # another graph pool
    assert pool_segments(snapshot, (1, 7)) == {"reserved": 22 << 20, "allocated": 1 << 20, "segments": 2}


def _split_pool(m: int) -> tuple[dict, dict]:
    from graphs.accounting import pool_bytes
    from graphs.local_rank import WeightQueue
    plan = build_plan("zbv", 2, m, 2)
    graphed = make_chunks(2, 2)
    layers = capture(graphed, plan, 0, samples(graphed, m), backend="emulate", defer_weight_grad=WeightQueue().defer)
    assert layers.active, layers.report
    out = pool_bytes(layers.graphs), held_bytes(layers.graphs)
    layers.remove()
    return out


def test_emulated_pool_grows_with_the_microbatch_count_only_by_the_static_buffers(monkeypatch):
    """The emulate backend's model of the graph pool (what its capture walk allocates and keeps, sampled after every
    captured pass): from M = 4 to M = 8 it grows by exactly the per-microbatch static buffers -- the activations and
    B's recorded gradients die at each W's capture, as on CUDA.  A capture that keeps them (planted) grows more."""
    (p4, h4), (p8, h8) = _split_pool(4), _split_pool(8)
    assert p4["reserved"] >= p4["allocated"] > 0 and p4["segments"] is None
    assert p8["reserved"] - p4["reserved"] == h8["total"] - h4["total"]
    kept = []
    real = EmulatedSlot.capture_weight

    def keeps_the_activations(self):
        kept.append(self._live)
        real(self)

    monkeypatch.setattr(EmulatedSlot, "capture_weight", keeps_the_activations)
    (q4, _), (q8, _) = _split_pool(4), _split_pool(8)
    assert q8["reserved"] - q4["reserved"] > 2 * (h8["total"] - h4["total"])
