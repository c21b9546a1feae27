"""F, B and W graphs for split-backward plans on one pipeline rank, in one process (emulate backend).

* the capture order holds the plan's ``W`` actions and equals the plan, over a grid of schedules, sizes and ranks;
  orders that differ are rejected;
* graphs per ``(chunk, microbatch, layer)`` replayed through the plan -- ``B`` queueing each layer's ``W`` replay,
  the plan's ``W`` action running it (:class:`graphs.local_rank.WeightQueue`) -- give bitwise the eager losses, input
  gradients and parameter gradients over several optimizer steps;
* ``B`` replays accumulate nothing; the ``W`` replay of ``(chunk, microbatch, layer)`` reads that slot's static
  buffers, which a later microbatch's ``B`` does not touch (negative control: buffers shared between microbatches
  give wrong gradients);
* what cannot work is refused or falls back with the reason.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from engine.plan import build_plan
from graphs import capture, check_order, capture_order, layer_events, order_events
from graphs.local_rank import WeightQueue, make_rank_data, run_rank_step, sgd_step
from tests.graphs.test_graphs_emulate import B, H, S, bitwise_equal, make_chunks, param_grads, samples
from tests.graphs.test_graphs_fallback import fake_cuda  # noqa: F401 - the fixture


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs with one thread (fixture in conftest.py)."""


def _plans():
    for pp in (2, 3, 4):
        for M in sorted({pp, 3, 2 * pp + 1}):
            yield build_plan("zb_h1", pp, M)
            yield build_plan("zb", pp, M, 2, max_in_flight=2 * pp)
    for pp in (2, 4):
        for M in (pp, 3, 2 * pp):
            yield build_plan("zbv", pp, M, 2)


def test_capture_order_includes_w_and_equals_the_plan():
    for plan in _plans():
        for rank in range(plan.pp_size):
            order = capture_order(plan, rank)
            where = (plan.schedule, plan.pp_size, plan.num_microbatches, rank)
            assert [f"{k}{m}.{c}" for k, c, m in order_events(order)] == plan.action_labels(rank), where
            assert sum(isinstance(e, float) for e in order) == plan.num_model_chunks * plan.num_microbatches, where
            check_order(order, plan, rank)
            events = layer_events(order, [2] * plan.num_model_chunks)
            assert [e.layer for e in events if e.kind == "W"][:2] == [1, 0], where  # W walks the layers like B


def test_check_order_rejects_split_orders_that_are_not_the_plans():
    plan = build_plan("zbv", 2, 4, 2)
    order = capture_order(plan, 0)
    with pytest.raises(ValueError, match=r"rank 0 of the zbv plan runs 24 \(W included\)"):
        check_order(plan.te_order(0), plan, 0)  # the F/B order of unsplit capture
    first_w = next(i for i, e in enumerate(order) if isinstance(e, float))
    early = [order[first_w]] + order[:first_w] + order[first_w + 1:]
    with pytest.raises(ValueError, match="not causal: weight-gradient pass #1 of model chunk 1"):
        check_order(early, plan, 0)
    w = [i for i, e in enumerate(order) if isinstance(e, float)]
    i, j = next((a, b) for a, b in zip(w, w[1:]) if order[a] != order[b])
    swapped = list(order)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError, match=f"differs from the runtime plan of rank 0 at position {i}"):
        check_order(swapped, plan, 0)
    with pytest.raises(TypeError, match="weight-gradient pass"):
        check_order(order[:-1] + [-1.25], plan, 0)


def _pair(schedule, C, M, rank, layers=2):
    plan = build_plan(schedule, 2, M, C)
    eager = make_chunks(C, layers)
    graphed = copy.deepcopy(eager)
    queue = WeightQueue()
    graphs = capture(graphed, plan, rank, samples(graphed, M), backend="emulate", defer_weight_grad=queue.defer)
    assert graphs.active and graphs.report.backend == "emulate", graphs.report
    return plan, eager, graphed, queue, graphs


def _steps(chunks, plan, rank, data, steps, queue=None):
    out = []
    for _ in range(steps):
        r = run_rank_step(chunks, plan, rank, data, weights=queue)
        out.append((r, [g.clone() for g in param_grads(chunks)]))
        sgd_step(chunks)
    return out


@pytest.mark.parametrize("schedule,C,M,rank", [("zb_h1", 1, 4, 0), ("zb_h1", 1, 3, 1), ("zbv", 2, 4, 0),
                                               ("zbv", 2, 4, 1)])
def test_emulated_split_graphs_bitwise_equal_eager(schedule, C, M, rank):
    plan, eager, graphed, queue, graphs = _pair(schedule, C, M, rank)
    data = make_rank_data(C, M, (S, B, H))
    ref = _steps(eager, plan, rank, data, 3)
    got = _steps(graphed, plan, rank, data, 3, queue)
    assert bitwise_equal(ref, got)
    assert got[0][0].executed == [(a.op.value, a.chunk, a.microbatch) for a in plan.actions[rank]]
    assert graphs.report.order == capture_order(plan, rank) and graphs.guard.at_step_boundary
    assert not queue.pending  # every queued W ran in its W action


def test_b_replays_accumulate_nothing_and_w_replays_the_weight_gradients():
    plan, eager, graphed, queue, graphs = _pair("zb_h1", 1, 4, 0)
    data = make_rank_data(1, 4, (S, B, H))
    params = [p for layer in graphed[0] for p in layer.parameters()]
    # rank 0 of zb_h1: F0 F1 B0 F2 B1 W0 ...; run up to B1 by hand
    prefix = [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1)]
    run_rank_step(graphed, plan, 0, data, order_override=prefix, weights=queue)
    assert all(p.grad is None for p in params)  # no B accumulated anything
    assert [len(queue.pending[(0, m)]) for m in (0, 1)] == [2, 2]  # one W per layer and microbatch
    run_rank_step(eager, plan, 0, data, order_override=[("F", 0, 0), ("B", 0, 0)])
    queue.run(0, 0)  # W0: exactly microbatch 0's weight gradients
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(params, (q for l in eager[0] for q in l.parameters())))


def test_w_replay_reads_the_buffers_of_its_own_microbatch():
    """zb_h1 rank 0 runs B1 before W0: W0 must read what B0 recorded, which B1 leaves alone.  Two identical
    captures: one stops after B0 (what B0 recorded), the other runs on through F2 and B1."""
    data = make_rank_data(1, 4, (S, B, H))
    recorded = []
    for prefix in ([("F", 0, 0), ("F", 0, 1), ("B", 0, 0)],
                   [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1)]):
        plan, _, graphed, queue, graphs = _pair("zb_h1", 1, 4, 0)
        run_rank_step(graphed, plan, 0, data, order_override=prefix, weights=queue)
        slots = {(s.event.microbatch, s.event.layer): s for s in graphs.graphs.callables}
        recorded.append({m: [g.clone() for r in slots[(m, 0)].static_weight_inputs for g in (r or ()) if g is not None]
                         for m in (0, 1)})
    after_b0, after_b1 = recorded
    assert after_b0[0] and len(after_b0[0]) == len(after_b1[0])
    assert all(torch.equal(a, b) for a, b in zip(after_b0[0], after_b1[0]))  # B1 left microbatch 0's alone
    assert not all(torch.equal(a, b) for a, b in zip(after_b1[0], after_b1[1]))  # and wrote its own


def test_negative_control_w_buffers_shared_between_microbatches_give_wrong_gradients():
    plan, eager, graphed, queue, graphs = _pair("zb_h1", 1, 4, 0)
    first = {s.event.layer: s for s in graphs.graphs.callables if s.event.microbatch == 0}
    for s in graphs.graphs.callables:  # every microbatch's B writes, and its W reads, microbatch 0's buffers
        s.static_weight_inputs = first[s.event.layer].static_weight_inputs
    data = make_rank_data(1, 4, (S, B, H))
    ref, got = _steps(eager, plan, 0, data, 1), _steps(graphed, plan, 0, data, 1, queue)
    assert [torch.equal(a.losses[k], b.losses[k]) for (a, _), (b, _) in zip(ref, got) for k in a.losses] == [True] * 4
    assert not bitwise_equal(ref, got)  # W0 read B1's recording


def test_what_cannot_work_is_refused_or_falls_back_with_the_reason(caplog):
    plan = build_plan("zb_h1", 2, 3)
    chunks = make_chunks(1, 2)
    with pytest.raises(ValueError, match="defer_weight_grad=<callable>"):
        capture(chunks, plan, 0, samples(chunks, 3), backend="emulate")
    with pytest.raises(ValueError, match="share_graphs=True with a split-backward plan"):
        capture(chunks, plan, 1, samples(chunks, 3), backend="emulate", share_graphs=True,
                defer_weight_grad=WeightQueue().defer)
    no_grad = [(torch.ones(S, B, H),) for _ in range(6)]  # the first layer's input needs no gradient
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        layers = capture(chunks, plan, 0, no_grad, backend="emulate", defer_weight_grad=WeightQueue().defer)
    assert not layers.active and "chunk 0 layer 0 is called on inputs that need no gradient" in layers.report.reason
    assert len([r for r in caplog.records if r.name == "pipecast.graphs"]) == 1
    layers.remove()


def test_torch_backend_captures_f_b_and_w_graphs_in_plan_order(fake_cuda):  # noqa: F811 - the fixture
    """pipecast's CUDA capture on the CPU through the fake ``torch.cuda`` of tests/graphs/test_graphs_fallback.py: every
    slot gets its three graphs, created (and captured) in exactly the plan's order, ``W`` included."""
    fake, _ = fake_cuda
    plan = build_plan("zbv", 2, 4, 2)
    chunks = make_chunks(2, 2)
    layers = capture(chunks, plan, 1, samples(chunks, 4), backend="torch", defer_weight_grad=WeightQueue().defer)
    assert layers.active and layers.report.backend == "torch", layers.report
    owner = {}
    for s in layers.graphs.callables:
        for kind, g in (("F", s.fwd_graph), ("B", s.bwd_graph), ("W", s.wgt_graph)):
            owner[id(g)] = (kind, s.event.chunk, s.event.microbatch, s.event.layer)
    created = [owner[id(g)] for g in fake.graphs]
    events = layer_events(capture_order(plan, 1), [2, 2])
    assert created == [(e.kind, e.chunk, e.microbatch, e.layer) for e in events]
    # after its W capture a slot keeps neither the saved activations nor B's recorded gradients: their blocks go
    # back to the pool (tests/graphs/test_graphs_split_memory.py checks the bound)
    assert all(s._capture_outputs is None and not s.static_weight_inputs for s in layers.graphs.callables)
    layers.remove()


def test_w_buffers_hold_one_gradient_per_weight_op():
    """What B records for W: per set the gradient at each intermediate -- for the block, the outputs of fc2
    ([s*b, h]), fc1 ([s*b, 2h]) and the layer norm ([s, b, h]) -- counted by graphs.accounting; one set per pending
    W of each (chunk, layer), not per microbatch."""
    from graphs.accounting import held_bytes
    from graphs.backends.common import pending_weight_sets
    plan, _, graphed, _, graphs = _pair("zbv", 2, 4, 0)
    per_set = (H + 2 * H + H) * S * B * 4  # fp32
    peak = pending_weight_sets(layer_events(capture_order(plan, 0), [2, 2]))[1]
    assert sum(peak.values()) < 2 * 4 * 2  # fewer sets than chunks x microbatches x layers
    assert held_bytes(graphs.graphs)["weight_inputs"] == sum(peak.values()) * per_set


def test_graphs_under_the_executors_weight_gradient_deferral_see_the_layers_own_ops():
    """The executor runs split-backward forwards under ``weight_grad_deferral`` (a torch-function mode): the capture
    and every emulated replay run without it, as a real replay runs no Python -- same numbers as eager."""
    from engine.runtime.split_backward import weight_grad_deferral
    plan = build_plan("zb_h1", 2, 4)
    eager = make_chunks(1, 2)
    graphed = copy.deepcopy(eager)
    queue = WeightQueue()
    with weight_grad_deferral():
        graphs = capture(graphed, plan, 0, samples(graphed, 4), backend="emulate", defer_weight_grad=queue.defer)
    assert graphs.active, graphs.report
    data = make_rank_data(1, 4, (S, B, H))
    ref = _steps(eager, plan, 0, data, 2)
    with weight_grad_deferral():
        got = _steps(graphed, plan, 0, data, 2, queue)
    assert bitwise_equal(ref, got)
    # the last replays' graphs were cut at the blocks' own addmm / layer-norm nodes (not at deferral bridges)
    assert all(len(s.split.intermediates) == 3 for s in graphs.graphs.callables)


class _SharedTranspose(torch.nn.Module):
    """One transposed weight used by three matmuls whose gradients differ by orders of magnitude, summed as
    ``(c + b) + a``: the graph walk meets ``a`` first, ``B`` runs ``c`` first (the last op created), so a ``W`` that
    summed the three contributions in walk order would round differently from eager's ``AccumulateGrad``."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(H, H, bias=False)

    def forward(self, x):
        wt = self.w.weight.t()
        a, b, c = x @ wt, (x * 1e-4) @ wt, (x * 1e4) @ wt
        return (c + b) + a


def test_w_sums_the_recorded_gradients_in_bs_execution_order():
    plan = build_plan("zb_h1", 2, 4)
    torch.manual_seed(0)
    eager = [[_SharedTranspose(), _SharedTranspose()]]
    graphed = copy.deepcopy(eager)
    queue = WeightQueue()
    layers = capture(graphed, plan, 0, samples(graphed, 4), backend="emulate", defer_weight_grad=queue.defer)
    assert layers.active, layers.report
    data = make_rank_data(1, 4, (S, B, H))
    assert bitwise_equal(_steps(eager, plan, 0, data, 2), _steps(graphed, plan, 0, data, 2, queue))
    layers.remove()
