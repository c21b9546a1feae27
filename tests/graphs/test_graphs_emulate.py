"""The emulate backend (CPU static-buffer semantics) on one pipeline rank, run in plan order in one process.

Positive: graphs per (chunk, microbatch, layer) give bitwise the eager losses, input grads and parameter grads over
several optimizer steps.  Negative controls (kept as tests that assert the failure IS detected): one graph shared by
all microbatches of a layer gives different numbers; a capture order that differs from the runtime is rejected by
check_order and, unchecked, stopped by the replay guard; parameter grads returned as static aliases (B17) corrupt
accumulation across steps.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from engine.plan import build_plan
from graphs import capture, capture_order
from graphs.capture import DebugOptions
from graphs.local_rank import make_rank_data, run_rank_step, sgd_step
from graphs.order import LayerEvent, order_events

H, S, B = 8, 3, 2


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs with one thread (fixture in conftest.py)."""


class Block(nn.Module):
    """Pre-norm residual MLP block, ``[s, b, h] -> [s, b, h]``; parameters registered in a different order from
    their use in forward (B16's trigger)."""

    def __init__(self, h: int = H):
        super().__init__()
        self.fc2 = nn.Linear(2 * h, h)
        self.fc1 = nn.Linear(h, 2 * h)
        self.norm = nn.LayerNorm(h)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def make_chunks(num_chunks: int, layers: int | list[int], seed: int = 0):
    torch.manual_seed(seed)
    counts = layers if isinstance(layers, list) else [layers] * num_chunks
    return [[Block() for _ in range(n)] for n in counts]


def samples(chunks, m):
    return [(torch.ones(S, B, H, requires_grad=True),) for chunk in chunks for _ in range(m) for _ in chunk]


def param_grads(chunks):
    return [p.grad for chunk in chunks for layer in chunk for p in layer.parameters()]


def run_steps(chunks, plan, rank, data, steps, zero_in_place=False):
    out = []
    for _ in range(steps):
        r = run_rank_step(chunks, plan, rank, data)
        out.append((r, [g.clone() for g in param_grads(chunks)]))
        if zero_in_place:  # zero_grad(set_to_none=False) after the update
            with torch.no_grad():
                for chunk in chunks:
                    for layer in chunk:
                        for p in layer.parameters():
                            p.add_(p.grad, alpha=-1e-2)
                            p.grad.zero_()
        else:
            sgd_step(chunks)
    return out


def bitwise_equal(a, b) -> bool:
    for (ra, ga), (rb, gb) in zip(a, b):
        if ra.losses.keys() != rb.losses.keys():
            return False
        if not all(torch.equal(ra.losses[k], rb.losses[k]) for k in ra.losses):
            return False
        if not all(torch.equal(ra.input_grads[k], rb.input_grads[k]) for k in ra.input_grads):
            return False
        if not all(torch.equal(x, y) for x, y in zip(ga, gb)):
            return False
    return True


CASES = [("interleaved", 2, 2, 4, 2, 0), ("interleaved", 2, 2, 4, 2, 1), ("1f1b", 4, 1, 4, None, 0),
         ("1f1b", 4, 1, 4, None, 3), ("interleaved", 4, 2, 4, 4, 2), ("interleaved", 2, 2, 5, 3, 0)]


@pytest.mark.parametrize("schedule,pp,vp,m,g,rank", CASES)
def test_emulated_graphs_bitwise_equal_eager(schedule, pp, vp, m, g, rank):
    plan = build_plan(schedule, pp, m, vp, g)
    eager = make_chunks(vp, [2, 1][:vp] if vp == 2 else 2)
    graphed = copy.deepcopy(eager)
    data = make_rank_data(vp, m, (S, B, H))
    layers = capture(graphed, plan, rank, samples(graphed, m), backend="emulate")
    assert layers.active and layers.report.backend == "emulate"
    assert layers.report.num_graphs == sum(len(c) for c in graphed) * m
    ref = run_steps(eager, plan, rank, data, 3)
    got = run_steps(graphed, plan, rank, data, 3)
    assert bitwise_equal(ref, got)
    assert [(k, c, mb) for k, c, mb in order_events(capture_order(plan, rank))] == got[0][0].executed
    assert layers.guard.at_step_boundary


def test_negative_control_shared_graph_per_layer_is_detected():
    plan = build_plan("interleaved", 2, 4, 2, 2)
    eager = make_chunks(2, 2)
    graphed = copy.deepcopy(eager)
    data = make_rank_data(2, 4, (S, B, H))
    with pytest.raises(ValueError, match="in flight"):
        capture(copy.deepcopy(eager), plan, 0, samples(eager, 4), backend="emulate", share_graphs=True)
    capture(graphed, plan, 0, samples(graphed, 4), backend="emulate", share_graphs=True,
            _debug=DebugOptions(allow_unsafe_sharing=True))
    ref = run_steps(eager, plan, 0, data, 1)
    got = run_steps(graphed, plan, 0, data, 1)
    assert not bitwise_equal(ref, got)
    # the first microbatch's backward already used the second microbatch's activations
    k = (1, 0)
    assert not torch.equal(ref[0][0].input_grads[k], got[0][0].input_grads[k])


def test_shared_graphs_are_fine_without_pipelining():
    """Megatron's PP=1 capture: one graph per layer, legal because forward and backward strictly alternate."""
    plan = build_plan("no_pipelining", 1, 3)
    eager = make_chunks(1, 2)
    graphed = copy.deepcopy(eager)
    data = make_rank_data(1, 3, (S, B, H))
    layers = capture(graphed, plan, 0, samples(graphed, 3), backend="emulate", share_graphs=True)
    assert layers.report.num_graphs == 2
    assert bitwise_equal(run_steps(eager, plan, 0, data, 2), run_steps(graphed, plan, 0, data, 2))


def test_negative_control_capture_order_differs_from_runtime_is_detected():
    plan = build_plan("interleaved", 2, 4, 2, 2)
    order = capture_order(plan, 0)
    torch_style = [e for e in order if e > 0] + [e for e in reversed(order) if e < 0]  # torch's fixed order
    graphed = make_chunks(2, 2)
    with pytest.raises(ValueError, match="differs from the runtime plan"):
        capture(graphed, plan, 0, samples(graphed, 4), backend="emulate", order=torch_style)
    wrong_rank = capture_order(plan, 1)
    layers = capture(graphed, plan, 0, samples(graphed, 4), backend="emulate", order=wrong_rank,
                     _debug=DebugOptions(check_order=False))
    data = make_rank_data(2, 4, (S, B, H))
    with pytest.raises(RuntimeError, match="diverged from the capture order at pass"):
        run_rank_step(graphed, plan, 0, data)
    layers.guard.reset()
    # the same graphs replayed in the order they were captured run through
    run_rank_step(graphed, plan, 0, data, order_override=list(order_events(wrong_rank)))
    assert layers.guard.at_step_boundary


def test_negative_control_param_grads_aliasing_static_buffers_b17():
    """zero_grad(set_to_none=False) across steps: aliased static grads double-count; clones are exact."""
    plan = build_plan("interleaved", 2, 4, 2, 2)
    eager = make_chunks(2, 1)
    cloned, aliased = copy.deepcopy(eager), copy.deepcopy(eager)
    data = make_rank_data(2, 4, (S, B, H))
    capture(cloned, plan, 0, samples(cloned, 4), backend="emulate")
    layers = capture(aliased, plan, 0, samples(aliased, 4), backend="emulate",
                     _debug=DebugOptions(param_grads="alias"))
    ref = run_steps(eager, plan, 0, data, 3, zero_in_place=True)
    assert bitwise_equal(ref, run_steps(cloned, plan, 0, data, 3, zero_in_place=True))
    assert not bitwise_equal(ref, run_steps(aliased, plan, 0, data, 3, zero_in_place=True))
    # the CPU analogue of B17: with aliasing, a .grad shares storage with a static buffer
    statics = {t.data_ptr() for s in layers.graphs.callables for t in s.static_grad_inputs if t is not None}
    assert any(g.data_ptr() in statics for g in param_grads(aliased))


def test_cloned_param_grads_never_alias_static_buffers():
    plan = build_plan("interleaved", 2, 4, 2, 2)
    graphed = make_chunks(2, 2)
    layers = capture(graphed, plan, 1, samples(graphed, 4), backend="emulate")
    r = run_rank_step(graphed, plan, 1, make_rank_data(2, 4, (S, B, H)))
    statics = {t.untyped_storage().data_ptr() for s in layers.graphs.callables
               for t in [*s.static_grad_inputs, *s.static_outputs, *s.static_inputs] if t is not None}
    assert not any(g.untyped_storage().data_ptr() in statics for g in param_grads(graphed))
    assert r.input_grads


def test_dispatch_errors_and_eval_runs_eagerly():
    plan = build_plan("interleaved", 2, 4, 2, 2)
    graphed = make_chunks(2, 1)
    layers = capture(graphed, plan, 0, samples(graphed, 4), backend="emulate")
    layer = graphed[0][0]
    x = torch.randn(S, B, H, requires_grad=True)
    layer.current_microbatch = 4
    with pytest.raises(RuntimeError, match="num_microbatches=4; recapture"):
        layer(x)
    layer.current_microbatch = None
    with pytest.raises(RuntimeError, match="set_current_microbatch"):
        layer(x)
    layer.eval()  # evaluation: eager, no guard step
    ref = Block.forward(layer, x)
    assert torch.equal(layer(x), ref) and layers.guard.at_step_boundary
    layer.train()
    with layers.suspend():  # training-mode evaluation passes
        assert torch.equal(layer(x), ref)
    layers.remove()
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("schedule,vp", [("interleaved", 2), ("zb_h1", 1)])
def test_a_pass_with_other_shapes_runs_eagerly_and_the_others_replay(schedule, vp, caplog):
    """A microbatch with another sequence length (a ragged batch) runs its chunk pass eagerly -- both layers, the
    second called on the first's eager output -- while every other pass replays; the step's numbers are eager's,
    the replay guard ends each step at its boundary, one warning says why, and a step with the captured shapes
    replays everything again."""
    from graphs.local_rank import WeightQueue
    plan = build_plan(schedule, 2, 4, vp, 2 if vp > 1 else None)
    eager = make_chunks(vp, 2)
    graphed = copy.deepcopy(eager)
    queue = WeightQueue() if plan.splits_backward else None
    layers = capture(graphed, plan, 0, samples(graphed, 4), backend="emulate",
                     defer_weight_grad=queue.defer if queue is not None else None)
    assert layers.active
    ragged = make_rank_data(vp, 4, (S, B, H))
    c = vp - 1
    ragged.inputs[c][2], ragged.grads[c][2] = torch.randn(S + 2, B, H), torch.randn(S + 2, B, H)
    normal = make_rank_data(vp, 4, (S, B, H), seed=1)
    ref, got = [], []
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        for data in (ragged, ragged, normal):
            ref.append((run_rank_step(eager, plan, 0, data), [g.clone() for g in param_grads(eager)]))
            got.append((run_rank_step(graphed, plan, 0, data, weights=queue),
                        [g.clone() for g in param_grads(graphed)]))
            assert layers.guard.at_step_boundary
            sgd_step(eager)
            sgd_step(graphed)
    if queue is None:  # the same accumulation order: bitwise
        assert bitwise_equal(ref, got)
    else:  # the eager pass accumulates its weight gradients in B, the graphs in W: another summation order
        for (ra, ga), (rb, gb) in zip(ref, got):
            pairs = [(ra.losses[k], rb.losses[k]) for k in ra.losses] + list(zip(ga, gb))
            assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in pairs)
    assert layers.eager_calls == 2 * 2  # two ragged steps x both layers of the pass
    warnings = [r.getMessage() for r in caplog.records if "running this pass eagerly" in r.getMessage()]
    assert len(warnings) == 1 and f"chunk {c} layer 0 microbatch 2" in warnings[0], warnings
    layers.remove()


class FirstPositions(Block):
    """Keeps the first ``S`` positions: its output has the captured shape whatever the input's length."""

    def forward(self, x):
        return super().forward(x)[:S]


def test_a_pass_that_left_its_graph_stays_eager_for_its_later_layers():
    """Layer 1 of a pass whose layer 0 ran eagerly is called on an eager tensor of the captured shape: it runs
    eagerly too (its graph reads layer 0's static output in place, chained buffers)."""
    plan = build_plan("1f1b", 2, 2)
    torch.manual_seed(0)
    eager = [[FirstPositions(), Block()]]
    graphed = copy.deepcopy(eager)
    layers = capture(graphed, plan, 0, samples(graphed, 2), backend="emulate")
    assert layers.active and layers.graphs.callables[1].chained_input
    data = make_rank_data(1, 2, (S, B, H))
    data.inputs[0][1] = torch.randn(S + 2, B, H)
    assert bitwise_equal(run_steps(eager, plan, 0, data, 2), run_steps(graphed, plan, 0, data, 2))
    assert layers.eager_calls == 2 * 2 and layers.guard.at_step_boundary
    layers.remove()


def test_record_mode_sees_the_executed_order():
    plan = build_plan("1f1b", 4, 5)
    chunks = make_chunks(1, 3)
    from graphs import GraphedLayers
    layers = GraphedLayers(chunks)
    layers.start_recording()
    run_rank_step(chunks, plan, 1, make_rank_data(1, 5, (S, B, H)))
    rec = layers.stop_recording()
    assert rec.chunk_order() == capture_order(plan, 1)
    assert rec.microbatch_passes() == [(a.op.value, a.chunk, a.microbatch) for a in plan.actions[1]]
    assert rec.events[:4] == [LayerEvent("F", 0, 0, 0), LayerEvent("F", 0, 0, 1), LayerEvent("F", 0, 0, 2),
                              LayerEvent("F", 0, 1, 0)]
    specs, reason = rec.layer_specs()
    assert reason is None and specs[(0, 2)].tensor_specs[0].shape == (S, B, H)


def test_replays_report_graph_spans():
    class Recorder:
        def __init__(self):
            self.spans = []

        def span(self, category, label):
            self.spans.append((category, label))
            import contextlib
            return contextlib.nullcontext()

    tracer = Recorder()
    plan = build_plan("1f1b", 2, 2)
    chunks = make_chunks(1, 1)
    capture(chunks, plan, 0, samples(chunks, 2), backend="emulate", tracer=tracer)
    run_rank_step(chunks, plan, 0, make_rank_data(1, 2, (S, B, H)))
    assert tracer.spans == [("graph", "replay F0.0 l0"), ("graph", "replay F1.0 l0"),
                            ("graph", "replay B0.0 l0"), ("graph", "replay B1.0 l0")]


def test_bad_arguments_raise_before_capture():
    plan = build_plan("interleaved", 2, 4, 2, 2)
    chunks = make_chunks(2, 1)
    with pytest.raises(ValueError, match="sum\\(L\\)\\*M"):
        capture(chunks, plan, 0, samples(chunks, 4)[:-1], backend="emulate")
    with pytest.raises(ValueError, match="num_model_chunks"):
        capture(chunks[:1], plan, 0, samples(chunks[:1], 4), backend="emulate")
    with pytest.raises(ValueError, match="unknown"):
        capture(chunks, plan, 0, samples(chunks, 4), backend="cudagraph")
    bad = samples(chunks, 4)
    bad[5] = (torch.ones(S + 1, B, H, requires_grad=True),)
    with pytest.raises(ValueError, match="differ between microbatches"):
        capture(chunks, plan, 0, bad, backend="emulate")


class MaskedBlock(Block):
    """Takes a tensor keyword argument and a constant one (frozen at capture, like in a real graph)."""

    def forward(self, x, *, mask=None, scale=1.0):
        return super().forward(x) * mask * scale


def test_keyword_tensors_and_frozen_constants():
    from graphs.specs import CallSpec
    plan = build_plan("1f1b", 2, 2)
    torch.manual_seed(0)
    eager = [[MaskedBlock()]]
    graphed = copy.deepcopy(eager)
    mask = torch.ones(S, B, 1)
    spec = CallSpec.of((torch.ones(S, B, H, requires_grad=True),), {"mask": mask, "scale": 2.0})
    layers = capture(graphed, plan, 0, specs={(0, 0): spec}, backend="emulate")
    layer = graphed[0][0]
    for m in (0, 1):
        layer.current_microbatch = m
        x = torch.randn(S, B, H, requires_grad=True)
        m_in = torch.rand(S, B, 1)
        assert torch.equal(layer(x, mask=m_in, scale=2.0), eager[0][0](x, mask=m_in, scale=2.0))
    assert "differs from the captured constant 2.0" in spec.mismatch((x,), {"mask": m_in, "scale": 3.0})
    assert "keyword arguments" in spec.mismatch((x,), {})  # such calls run eagerly (the test above)
    assert spec.mismatch((x,), {"mask": m_in.double(), "scale": 2.0}).startswith("kwargs['mask'] is float64")
    layers.remove()


def test_emulate_replays_under_the_captured_autocast_with_the_cast_cache_off():
    """A graph recasts the weights on every replay (capture requires the cast cache off).  A caller that keeps one
    autocast region (cache on) over two optimizer steps would reuse step 1's bf16 weight casts in step 2; the
    emulation must compute what the graph computes, i.e. eager with autocast entered per step."""
    plan = build_plan("interleaved", 2, 4, 2, 2)
    eager = make_chunks(2, 1)
    graphed, stale = copy.deepcopy(eager), copy.deepcopy(eager)
    data = make_rank_data(2, 4, (S, B, H))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layers = capture(graphed, plan, 0, samples(graphed, 4), backend="emulate")
    assert layers.active and str(layers.graphs.autocast) == "cpu:bfloat16"
    ref = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref += run_steps(eager, plan, 0, data, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # one cached region over both steps
        got = run_steps(graphed, plan, 0, data, 2)
        cached = run_steps(stale, plan, 0, data, 2)
    assert bitwise_equal(ref, got)
    assert not bitwise_equal(ref, cached)  # the cache really is stale in step 2: the check has teeth
