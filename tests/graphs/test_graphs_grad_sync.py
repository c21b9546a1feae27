"""Data-parallel grad sync with split-backward graphs (issue 24, item 3), dp = 2 on gloo, emulate backend.

A ``W`` replay accumulates the parameter gradients into the graphs' buffers without autograd, so it must itself run
the parameters' post-accumulate-grad hooks (what ``engine.training.parallel.data_parallel.GradSync`` launches its overlapped
all-reduce from) and bump the buffers' version counters (what its late-change check compares):

* sync enabled only for each chunk's last ``W`` (what the schedules do): the hooks fire for every graphed parameter
  and microbatch, each chunk's all-reduce is launched from a hook (overlapped), none is redone, and the averaged
  gradients equal eager's averaged gradients bitwise;
* sync enabled for every ``W`` (a schedule enabling it too early): the all-reduce is launched after the first
  microbatch's ``W``, later replays change the gradients, and ``finalize_model_grads`` must notice (version
  counters) and reduce again -- the result still equals eager's.

Unsplit graphs (in process): a backward replay accumulates in the graph too, and runs the hooks itself -- not
through autograd calling a parameter's ``AccumulateGrad`` with an undefined gradient (the parameters are no inputs of
the replaying function); checked against eager's hook firings, and with the explicit call silenced.

Small on purpose (two gloo ranks, a few seconds): part of the quick loop.
"""
from __future__ import annotations

import copy

import pytest

from tests.helpers.distributed import run_ranks

PP, M, V, L = 2, 4, 1, 2


def _job(rank, world, enable_early: bool):
    import contextlib

    import torch
    import torch.distributed as dist
    from torch import nn

    from engine.plan import build_plan
    from engine.runtime.process_groups import ProcessGroupCollection
    from engine.training.parallel import data_parallel as grads_mod
    from engine.training.parallel.data_parallel import GradSync
    from graphs import capture
    from graphs.local_rank import WeightQueue, make_rank_data, run_rank_step
    from tests.graphs.test_graphs_emulate import B, H, S, make_chunks, samples

    plan = build_plan("zb_h1", PP, M, V)
    eager = make_chunks(V, L)
    graphed = copy.deepcopy(eager)
    queue = WeightQueue()
    layers = capture(graphed, plan, 0, samples(graphed, M), backend="emulate", defer_weight_grad=queue.defer)
    assert layers.active, layers.report
    pg = ProcessGroupCollection(dp=dist.group.WORLD, dp_ranks=tuple(range(world)), rank=rank, world_size=world)
    sync = GradSync([nn.ModuleList(c) for c in graphed], pg, overlap=True)
    calls = {"hook": 0, "async": 0, "sync": 0}
    real_all_reduce = dist.all_reduce

    def all_reduce(t, *a, async_op=False, **k):
        calls["async" if async_op else "sync"] += 1
        return real_all_reduce(t, *a, async_op=async_op, **k)

    grads_mod.dist.all_reduce = all_reduce
    for chunk in graphed:
        for layer in chunk:
            for p in layer.parameters():
                p.register_post_accumulate_grad_hook(lambda _p: calls.__setitem__("hook", calls["hook"] + 1))
    last_w = {c: max(a.microbatch for a in plan.actions[0] if a.chunk == c) for c in range(V)}
    real_run = queue.run

    @contextlib.contextmanager
    def sync_on():
        sync.sync_enabled = True
        try:
            yield
        finally:
            sync.sync_enabled = False

    def run(chunk, microbatch):  # the executor's rule: sync only around each chunk's last W (or every W: too early)
        with sync_on() if enable_early or microbatch == last_w[chunk] else contextlib.nullcontext():
            real_run(chunk, microbatch)

    queue.run = run
    data = make_rank_data(V, M, (S, B, H), seed=rank)  # each replica its own data
    sync.sync_enabled = False  # F and B passes: no_sync (nothing of the graphed layers accumulates in B)
    run_rank_step(graphed, plan, 0, data, weights=queue)
    sync.sync_enabled = True
    sync.finalize_model_grads()
    grads_mod.dist.all_reduce = real_all_reduce
    run_rank_step(eager, plan, 0, data)
    ref = [p.grad.clone() for c in eager for la in c for p in la.parameters()]
    for g in ref:
        dist.all_reduce(g)
        g.div_(world)
    got = [p.grad for c in graphed for la in c for p in la.parameters()]
    layers.remove()
    return calls, all(torch.equal(a, b) for a, b in zip(ref, got)), sum(1 for _ in ref)


@pytest.mark.timeout(60)
def test_w_replays_fire_grad_sync_hooks_and_the_overlapped_all_reduce_matches_eager(tmp_path):
    for (calls, equal, n_params) in run_ranks(_job, 2, False, timeout=50):
        assert calls["hook"] == n_params * M  # once per graphed parameter and microbatch, as in eager
        assert calls["async"] == V and calls["sync"] == 0  # launched from the last W's hooks, not redone
        assert equal


@pytest.mark.timeout(60)
def test_a_w_replay_after_the_launch_is_noticed_and_reduced_again(tmp_path):
    for (calls, equal, _) in run_ranks(_job, 2, True, timeout=50):
        assert calls["async"] == V and calls["sync"] == V  # launched early, then redone synchronously
        assert equal


def _hooked(chunks, fired: dict):
    """Post-accumulate-grad hooks on every parameter recording the gradient each firing sees."""
    for c, chunk in enumerate(chunks):
        for l, layer in enumerate(chunk):
            for n, p in layer.named_parameters():
                key = (c, l, n)
                p.register_post_accumulate_grad_hook(lambda q, k=key: fired.setdefault(k, []).append(q.grad.clone()))


def _unsplit_run(silence_explicit_hooks: bool, monkeypatch):
    from engine.plan import build_plan
    from graphs import capture
    from graphs.backends import common
    from graphs.local_rank import make_rank_data, run_rank_step
    from tests.graphs.test_graphs_emulate import B, H, S, make_chunks, samples

    plan = build_plan("interleaved", 2, 4, 2, 2)
    eager = make_chunks(2, 2)
    graphed = copy.deepcopy(eager)
    layers = capture(graphed, plan, 0, samples(graphed, 4), backend="emulate")
    assert layers.active, layers.report
    if silence_explicit_hooks:
        monkeypatch.setattr(common, "fire_post_accumulate_hooks", lambda params: None)
    ref, got = {}, {}
    _hooked(eager, ref)
    _hooked(graphed, got)
    data = make_rank_data(2, 4, (S, B, H))
    run_rank_step(eager, plan, 0, data)
    run_rank_step(graphed, plan, 0, data)
    layers.remove()
    return ref, got


def test_unsplit_backward_replays_fire_the_grad_sync_hooks_explicitly(monkeypatch):
    """Unsplit graphs: each backward replay runs every parameter's post-accumulate-grad hook once, seeing the
    accumulated gradient eager's ``AccumulateGrad`` hook sees (bitwise, per parameter, in order) -- and only because
    the replay calls them: with that call silenced no hook fires (no ``AccumulateGrad`` node of a graphed parameter
    is reached through an undefined gradient)."""
    import torch

    ref, got = _unsplit_run(False, monkeypatch)
    assert ref.keys() == got.keys() and all(len(v) == 4 for v in ref.values())  # once per microbatch
    for key in ref:
        assert all(torch.equal(a, b) for a, b in zip(ref[key], got[key])), key
    _, silenced = _unsplit_run(True, monkeypatch)
    assert silenced == {}


def test_a_graphed_layer_whose_inputs_need_no_gradient_still_accumulates(monkeypatch):
    """The parameters are no inputs of the replaying function: a layer called on a tensor that needs no gradient
    still gets a backward (through a zero-size anchor leaf) and the eager parameter gradients."""
    import torch

    from engine.plan import build_plan
    from graphs import capture
    from tests.graphs.test_graphs_emulate import B, H, S, make_chunks

    plan = build_plan("1f1b", 1, 1)
    eager = make_chunks(1, 1)
    graphed = copy.deepcopy(eager)
    layers = capture(graphed, plan, 0, [(torch.ones(S, B, H),)], backend="emulate")
    assert layers.active, layers.report
    x = torch.randn(S, B, H)
    for model in (eager, graphed):
        model[0][0].current_microbatch = 0
        model[0][0](x).square().sum().backward()
    for a, b in zip(eager[0][0].parameters(), graphed[0][0].parameters()):
        assert torch.equal(a.grad, b.grad)
    layers.remove()
