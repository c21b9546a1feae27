"""Frozen-replay hazards on the emulate backend (``graphs.hazards``): what a CUDA graph would freeze or reject
must fail on CPU too, naming the layer and the op, instead of passing because emulation re-runs Python.

* host syncs (``.item()``, a data-dependent branch, ``nonzero``) are found in the warmup, before any capture, and
  make the capture fall back with one line naming the layer, op and source line;
* randomness from a generator the graphs do not know fails the capture; registered, it advances per replay
  (bitwise like eager), and :class:`GraphRuntime` registers the generators the recorded step used;
* parameters replaced instead of updated in place, rebound closure tensors and Python state read in forward
  raise at the next replay.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from engine.plan import build_plan
from graphs import GraphRuntime, capture
from graphs.hazards import HazardError
from graphs.local_rank import make_rank_data, run_rank_step
from tests.graphs.test_graphs_emulate import B, Block, H, S, bitwise_equal, run_steps, samples
from tests.graphs.test_graphs_runtime import MegatronChunk


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs with one thread (fixture in conftest.py)."""


class ItemBranch(Block):
    def forward(self, x):
        if x.sum().item() > 1e30:  # a host sync and a data-dependent branch
            return x
        return super().forward(x)


class TensorBranch(Block):
    def forward(self, x):
        return super().forward(x) if x.mean() < 1e30 else x  # bool(tensor): a host sync


class NonzeroIndex(Block):
    def forward(self, x):
        return super().forward(x) + x.nonzero().shape[0] * 0.0


@pytest.mark.parametrize("cls,op", [(ItemBranch, "aten._local_scalar_dense"), (TensorBranch, "aten._local_scalar_dense"),
                                    (NonzeroIndex, "aten.nonzero")])
def test_host_syncs_are_found_before_capture_naming_layer_and_op(cls, op, caplog):
    plan = build_plan("1f1b", 2, 2)
    torch.manual_seed(0)
    chunks = [[Block(), cls()]]
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        layers = capture(chunks, plan, 0, samples(chunks, 2), backend="emulate")
    assert not layers.active
    reason = layers.report.reason
    assert reason.startswith("capture error: HazardError: chunk 0 layer 1 (" + cls.__name__ + ") microbatch 0: ")
    assert op in reason and "host sync" in reason and "test_graphs_hazards.py:" in reason, reason
    assert [r.getMessage() for r in caplog.records if r.name == "pipecast.graphs"] == [layers.report.log_line]


class OwnDropout(Block):
    """Dropout drawn from the layer's own generator (as under a tensor-parallel RNG tracker)."""

    def __init__(self, seed: int = 7):
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x):
        keep = torch.bernoulli(torch.full_like(x, 0.5), generator=self.gen)
        return super().forward(x) * keep


def test_unregistered_generator_fails_capture_and_registered_one_advances_per_replay():
    plan = build_plan("1f1b", 2, 3)
    torch.manual_seed(0)
    eager = [[OwnDropout()]]
    graphed = copy.deepcopy(eager)
    layers = capture(graphed, plan, 0, samples(graphed, 3), backend="emulate")
    assert not layers.active and "aten.bernoulli" in layers.report.reason
    assert "not registered with the graphs" in layers.report.reason
    layers = capture(layers, plan, 0, samples(graphed, 3), backend="emulate", generators=[graphed[0][0].gen])
    assert layers.active, layers.report
    data = make_rank_data(1, 3, (S, B, H))
    ref, got = run_steps(eager, plan, 0, data, 2), run_steps(graphed, plan, 0, data, 2)
    assert bitwise_equal(ref, got)  # capture left the generator's state as it found it; masks advance per replay
    assert not torch.equal(got[0][0].losses[(0, 0)], got[1][0].losses[(0, 0)])


def test_runtime_registers_the_generators_its_layers_use():
    torch.manual_seed(0)
    eager = [[OwnDropout(), Block()]]
    graphed = copy.deepcopy(eager)
    runtime = GraphRuntime([MegatronChunk(graphed[0])], "1f1b", 2, 1, backend="emulate", warmup_steps=1)
    plan = build_plan("1f1b", 2, 3)
    data = make_rank_data(1, 3, (S, B, H))
    for _ in range(3):
        runtime.before_step(3)
        assert bitwise_equal(run_steps(eager, plan, 1, data, 1), run_steps(graphed, plan, 1, data, 1))
    assert runtime.active, runtime.layers.report
    runtime.close()


def _captured(cls=Block, m: int = 2):
    plan = build_plan("1f1b", 2, m)
    torch.manual_seed(0)
    chunks = [[cls()]]
    layers = capture(chunks, plan, 0, samples(chunks, m), backend="emulate")
    assert layers.active, layers.report
    return plan, chunks, make_rank_data(1, m, (S, B, H))


def test_parameter_replaced_instead_of_updated_in_place_raises_at_replay():
    plan, chunks, data = _captured()
    run_rank_step(chunks, plan, 0, data)
    with torch.no_grad():
        chunks[0][0].fc1.weight.copy_(chunks[0][0].fc1.weight * 0.5)  # in place: fine
    run_rank_step(chunks, plan, 0, data)
    chunks[0][0].fc1.weight.data = chunks[0][0].fc1.weight.data * 0.5  # new storage: a graph keeps the old one
    with pytest.raises(HazardError, match=r"chunk 0 layer 0 \(Block\) parameter fc1.weight was replaced"):
        run_rank_step(chunks, plan, 0, data)  # the per-step storage check (every backend)


def test_load_state_dict_assign_raises_at_replay():
    plan, chunks, data = _captured()
    state = {k: v.clone() for k, v in chunks[0][0].state_dict().items()}
    chunks[0][0].load_state_dict(state, assign=True)
    with pytest.raises(HazardError, match=r"chunk 0 layer 0 \(Block\) parameter fc2.weight was replaced"):
        run_rank_step(chunks, plan, 0, data)


class ClosureScale(Block):
    def __init__(self):
        super().__init__()
        self.scale_tensor = torch.ones(H)  # a plain attribute, not a buffer

    def forward(self, x):
        return super().forward(x) * self.scale_tensor


class PythonScale(Block):
    scale = 1.0

    def forward(self, x):
        return super().forward(x) * self.scale


def test_rebound_closure_tensor_raises_at_replay():
    plan, chunks, data = _captured(ClosureScale)
    chunks[0][0].scale_tensor.mul_(2.0)  # same storage: what a graph reads too
    run_rank_step(chunks, plan, 0, data)
    chunks[0][0].scale_tensor = torch.full((H,), 2.0)
    with pytest.raises(HazardError, match=r"reads a \(8,\) tensor from storage the graph did not capture"):
        run_rank_step(chunks, plan, 0, data)


def test_python_state_read_in_forward_raises_at_replay():
    plan, chunks, data = _captured(PythonScale)
    run_rank_step(chunks, plan, 0, data)
    chunks[0][0].scale = 3.0
    with pytest.raises(HazardError, match=r"op \d+ is aten.mul\[3.0\] but the graph captured aten.mul\[1.0\]"):
        run_rank_step(chunks, plan, 0, data)


def test_replaced_parameter_is_caught_by_the_emulated_replay_trace_too():
    """Without the per-step storage check, the emulated replay's trace check still sees the new storage."""
    plan = build_plan("1f1b", 2, 2)
    torch.manual_seed(0)
    chunks = [[Block()]]
    layers = capture(chunks, plan, 0, samples(chunks, 2), backend="emulate")
    layers.graphs.check_step = lambda: None
    data = make_rank_data(1, 2, (S, B, H))
    run_rank_step(chunks, plan, 0, data)
    chunks[0][0].fc2.bias.data = torch.zeros(H)
    with pytest.raises(HazardError, match="reads parameter fc2.bias from storage the graph did not capture"):
        run_rank_step(chunks, plan, 0, data)
