"""GraphRuntime on one rank in one process (local plan driver): warmup steps, recording, capture, recapture when the
microbatch count changes, eager fallback for variable shapes, and the per-chunk microbatch counter for chunks
without Megatron's ``decoder``."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from engine.plan import build_plan
from graphs import GraphRuntime, capture_order
from graphs.local_rank import make_rank_data, run_rank_step
from tests.graphs.test_graphs_emulate import S, B, H, bitwise_equal, make_chunks, run_steps


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs with one thread (fixture in conftest.py)."""


class Decoder(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class MegatronChunk(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.decoder = Decoder(layers)


class PlainChunk(nn.Module):
    """Like pipecast's ModelChunk: blocks in ``.layers``; forward runs them (the runtime counts microbatches)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_warmup_record_capture_and_recapture_on_microbatch_change():
    eager = make_chunks(2, 2)
    graphed = copy.deepcopy(eager)
    runtime = GraphRuntime([MegatronChunk(c) for c in graphed], "interleaved", 2, 0, 2, 2, backend="emulate",
                           warmup_steps=2)
    active = []
    for step, m in enumerate([4, 4, 4, 4, 6, 6, 6]):
        plan = build_plan("interleaved", 2, m, 2, 2)
        data = make_rank_data(2, m, (S, B, H), seed=step)
        runtime.before_step(m)
        active.append(runtime.active)
        assert bitwise_equal(run_steps(eager, plan, 0, data, 1), run_steps(graphed, plan, 0, data, 1)), step
    assert active == [False, False, True, True, False, True, True]
    assert runtime.layers.graphs.num_microbatches == 6
    assert runtime.last_recording.chunk_order() == capture_order(build_plan("interleaved", 2, 6, 2, 2), 0)
    runtime.close()
    assert all("forward" not in layer.__dict__ for chunk in graphed for layer in chunk)


def test_counting_hook_names_microbatches_for_plain_chunks():
    plan = build_plan("1f1b", 2, 3)
    layers = make_chunks(1, 2)[0]
    chunk = PlainChunk(layers)
    runtime = GraphRuntime([chunk], "1f1b", 2, 0, backend="emulate", warmup_steps=1)
    data = make_rank_data(1, 3, (S, B, H))
    for step in range(3):
        runtime.before_step(3)
        live = {}
        for a in plan.actions[0]:  # an executor that never calls set_current_microbatch
            if a.op.value == "F":
                x = data.inputs[0][a.microbatch].clone().requires_grad_()
                live[a.microbatch] = chunk(x)
                assert layers[0].current_microbatch == a.microbatch
            else:
                live.pop(a.microbatch).backward(data.grads[0][a.microbatch])
    assert runtime.active and runtime.layers.report.num_graphs == 6


def test_variable_shapes_fall_back_to_eager_with_one_line(caplog):
    chunks = make_chunks(1, 1)
    runtime = GraphRuntime([MegatronChunk(c) for c in chunks], "1f1b", 2, 0, backend="emulate", warmup_steps=1)
    plan = build_plan("1f1b", 2, 2)
    data = make_rank_data(1, 2, (S, B, H))
    data.inputs[0][1] = torch.randn(S + 2, B, H)  # microbatch 1 is longer
    data.grads[0][1] = torch.randn(S + 2, B, H)
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        for _ in range(3):
            runtime.before_step(2)
            run_rank_step(chunks, plan, 0, data)
    assert not runtime.active and "variable input shapes" in runtime.disabled_reason
    assert len([r for r in caplog.records if r.name == "pipecast.graphs"]) == 1


def test_variable_seq_lengths_flag_and_bad_arguments():
    chunks = make_chunks(1, 1)
    runtime = GraphRuntime([MegatronChunk(c) for c in chunks], "1f1b", 2, 1, backend="emulate", warmup_steps=1,
                           variable_seq_lengths=True)
    plan = build_plan("1f1b", 2, 2)
    for _ in range(2):
        runtime.before_step(2)
        run_rank_step(chunks, plan, 1, make_rank_data(1, 2, (S, B, H)))
    assert not runtime.active and "variable sequence lengths" in runtime.disabled_reason
    runtime.close()
    with pytest.raises(ValueError, match="warmup_steps"):
        GraphRuntime([MegatronChunk(c) for c in chunks], "1f1b", 2, 0, warmup_steps=-1)
    assert GraphRuntime([MegatronChunk(c) for c in make_chunks(1, 1)], "1f1b", 2, 0, warmup_steps=0).warmup_steps == 1
    with pytest.raises(ValueError, match="backend"):
        GraphRuntime([MegatronChunk(c) for c in chunks], "1f1b", 2, 0, backend="cuda")


def test_executor_order_differing_from_plan_vetoes_capture():
    chunks = make_chunks(2, 1)
    runtime = GraphRuntime([MegatronChunk(c) for c in chunks], "interleaved", 2, 0, 2, 2, backend="emulate",
                           warmup_steps=1)
    plan = build_plan("interleaved", 2, 4, 2, 2)
    other = [(a.op.value, a.chunk, a.microbatch) for a in plan.actions[1]]  # rank 1's order run on rank 0
    data = make_rank_data(2, 4, (S, B, H))
    for _ in range(2):
        runtime.before_step(4)
        run_rank_step(chunks, plan, 0, data, order_override=other)
    assert not runtime.active and "differ from the interleaved plan at pass" in runtime.disabled_reason


def test_graphs_capture_under_the_recorded_autocast_state(caplog):
    """The executor runs forward steps under autocast (bf16 runs): capture must use the same state (cache off); a
    call outside it runs eagerly (fp32, as asked, with a warning), never a silent fp32/bf16 mix."""
    eager = make_chunks(2, 1)
    graphed = copy.deepcopy(eager)
    runtime = GraphRuntime([MegatronChunk(c) for c in graphed], "interleaved", 2, 1, 2, 2, backend="emulate",
                           warmup_steps=1)
    plan = build_plan("interleaved", 2, 4, 2, 2)
    data = make_rank_data(2, 4, (S, B, H))
    for _ in range(3):
        runtime.before_step(4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref, got = run_steps(eager, plan, 1, data, 1), run_steps(graphed, plan, 1, data, 1)
        assert bitwise_equal(ref, got)
    assert runtime.active and str(runtime.layers.graphs.autocast) == "cpu:bfloat16"
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        assert bitwise_equal(run_steps(eager, plan, 1, data, 1), run_steps(graphed, plan, 1, data, 1))
    assert runtime.layers.eager_calls == 8 and runtime.layers.guard.at_step_boundary
    assert any("autocast is 'off'" in r.getMessage() for r in caplog.records)


def test_no_pipelining_shares_one_graph_per_layer():
    eager = make_chunks(1, 2)
    graphed = copy.deepcopy(eager)
    runtime = GraphRuntime([MegatronChunk(c) for c in graphed], "no_pipelining", 1, 0, backend="emulate",
                           warmup_steps=1)
    plan = build_plan("no_pipelining", 1, 4)
    data = make_rank_data(1, 4, (S, B, H))
    for _ in range(3):
        runtime.before_step(4)
        assert bitwise_equal(run_steps(eager, plan, 0, data, 1), run_steps(graphed, plan, 0, data, 1))
    assert runtime.active and runtime.layers.graphs.shared and runtime.layers.report.num_graphs == 2


class ScaledBetweenLayers(PlainChunk):
    """Something runs between two graphed layers, so layer 1's input is not layer 0's output."""

    def forward(self, x):
        x = self.layers[0](x)
        return self.layers[1](x * 0.5)


def test_layers_not_called_on_each_others_outputs_are_captured_unchained():
    torch.manual_seed(0)
    layers = make_chunks(1, 2)[0]
    eager_chunk, graphed_chunk = ScaledBetweenLayers(copy.deepcopy(layers)), ScaledBetweenLayers(layers)
    runtime = GraphRuntime([graphed_chunk], "1f1b", 2, 0, backend="emulate", warmup_steps=1)
    plan = build_plan("1f1b", 2, 2)
    data = make_rank_data(1, 2, (S, B, H))
    for _ in range(3):
        runtime.before_step(2)
        outs = []
        for chunk in (eager_chunk, graphed_chunk):
            live = {}
            for a in plan.actions[0]:
                if a.op.value == "F":
                    live[a.microbatch] = chunk(data.inputs[0][a.microbatch].clone().requires_grad_())
                else:
                    live.pop(a.microbatch).backward(data.grads[0][a.microbatch])
            outs.append([p.grad.clone() for p in chunk.parameters()])
            for p in chunk.parameters():
                p.grad = None
        assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert runtime.active and runtime.last_recording.unchained == {(0, 1)}
    assert not any(s.chained_input for s in runtime.layers.graphs.callables)
    runtime.close()
