"""The Transformer Engine adapter against fake ``transformer_engine`` modules injected through ``sys.modules``.

The fakes have the signatures of real TE releases (main after 2.18; 1.6; one without ``_order``) and enforce TE's
own argument rules (``transformer_engine/pytorch/graph.py``): ``V = max(order)``, ``M = len(order) / V / 2``,
``len(modules) == sum(L)``, ``len(sample_args) == sum(L) * M`` with tensors only, ``_num_layers_per_chunk`` a list
of ``V`` ints.  Their callables replay eagerly and record which flat index was called, so a whole step can run
through pipecast's dispatch on the CPU.
"""
from __future__ import annotations

import copy
import gc
import logging
import sys
import types

import pytest
import torch

from engine.plan import build_plan
from graphs import capture, flat_index, capture_order, layer_events
from graphs.local_rank import make_rank_data
from tests.graphs.test_graphs_emulate import Block, bitwise_equal, make_chunks, run_steps, samples

S, B, H = 3, 2, 8


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs with one thread (fixture in conftest.py)."""


class FakeTE:
    """Records calls; validates like TE; returns eager 'graphs' in TE's flat layout."""

    def __init__(self):
        self.calls: list[dict] = []
        self.replayed: list[int] = []
        self.capturing = False
        self.fail = False

    def validate(self, modules, sample_args, _order, _num_layers_per_chunk, sample_kwargs=None):
        if not all(isinstance(m, torch.nn.Module) for m in modules):
            raise TypeError("modules must be nn.Modules")
        ints = [e for e in _order if isinstance(e, int)]
        V = max(ints)
        M = len(ints) // V // 2
        if V * M * 2 != len(ints):
            raise ValueError("bad order length")
        if _num_layers_per_chunk is None:
            if (len(sample_args) * 2) % len(ints):
                raise ValueError("cannot derive layers per chunk")
            L = [len(sample_args) // V // M] * V
        elif isinstance(_num_layers_per_chunk, int):
            L = [_num_layers_per_chunk] * V
        else:
            if len(_num_layers_per_chunk) != V:
                raise ValueError("_num_layers_per_chunk must have V entries")
            L = list(_num_layers_per_chunk)
        if len(modules) != sum(L) or len(sample_args) != sum(L) * M:
            raise ValueError("sizes do not match")
        if sample_kwargs is not None and len(sample_kwargs) != len(sample_args):
            raise ValueError("sample_kwargs length")
        for a in sample_args:
            if not all(isinstance(t, torch.Tensor) for t in a):
                raise TypeError("non-tensor sample arg")
        # TE's walk: forward k of chunk c is microbatch k; backwards FIFO; an early backward is a KeyError there
        fwd, bwd = [0] * V, [0] * V
        for e in ints:
            c = abs(e) - 1
            if e > 0:
                fwd[c] += 1
            else:
                bwd[c] += 1
                if bwd[c] > fwd[c]:
                    raise KeyError("backward before forward")
        return V, M, L

    def make_callables(self, modules, sample_args, V, M, L):
        prefix = [sum(L[:c]) for c in range(V)]
        out = []
        for c in range(V):
            for m in range(M):
                for l in range(L[c]):
                    idx = prefix[c] * M + m * L[c] + l
                    module = modules[prefix[c] + l]

                    def fn(*args, _idx=idx, _module=module, **kwargs):
                        self.replayed.append(_idx)
                        return type(_module).forward(_module, *args, **kwargs)

                    out.append(fn)
        return tuple(out)

    def sabotage(self, modules):
        """What TE leaves behind when capture raises half-way (TE has no try/finally around it)."""
        for m in modules:
            type(m).__call__ = lambda *a, **k: None
            m.forward = lambda *a, **k: None
            for p in m.parameters():
                p.grad = torch.full_like(p, 7.0)
        self.capturing = True
        gc.disable()
        torch.rand(3)  # advances the RNG
        raise RuntimeError("operation not permitted when stream is capturing")


def install_fake(monkeypatch, flavour: str) -> FakeTE:
    fake = FakeTE()

    if flavour == "head":
        def make_graphed_callables(modules, sample_args, num_warmup_iters=3, allow_unused_input=False,
                                   sample_kwargs=None, fp8_enabled=None, fp8_calibrating=None, fp8_recipe=None,
                                   fp8_group=None, fp8_weight_caching=None, enabled=None, calibrating=None,
                                   recipe=None, amax_reduction_group=None, cache_quantized_params=None, _order=None,
                                   _num_layers_per_chunk=None, pool=None, retain_graph_in_backward=False,
                                   _reuse_graph_input_output_buffers=False, clone_param_grads_on_return=True,
                                   pre_warmup_hook=None, post_warmup_hook=None, capture_time_hooks=None):
            fake.calls.append(dict(modules=modules, sample_args=sample_args, num_warmup_iters=num_warmup_iters,
                                   allow_unused_input=allow_unused_input, sample_kwargs=sample_kwargs,
                                   _order=_order, _num_layers_per_chunk=_num_layers_per_chunk, pool=pool,
                                   clone_param_grads_on_return=clone_param_grads_on_return,
                                   _reuse_graph_input_output_buffers=_reuse_graph_input_output_buffers))
            fake.capturing = True
            V, M, L = fake.validate(modules, sample_args, _order, _num_layers_per_chunk, sample_kwargs)
            if fake.fail:
                fake.sabotage(modules)
            fake.capturing = False
            return fake.make_callables(modules, sample_args, V, M, L)
    elif flavour == "v1.6":
        def make_graphed_callables(modules, sample_args, num_warmup_iters=3, allow_unused_input=False,
                                   fp8_enabled=False, fp8_calibrating=False, fp8_recipe=None, fp8_weight_caching=False,
                                   _order=None):
            fake.calls.append(dict(modules=modules, sample_args=sample_args, _order=_order,
                                   num_warmup_iters=num_warmup_iters, allow_unused_input=allow_unused_input))
            V, M, L = fake.validate(modules, sample_args, _order, None)
            return fake.make_callables(modules, sample_args, V, M, L)
    else:  # before ordered capture
        def make_graphed_callables(modules, sample_args, num_warmup_iters=3, allow_unused_input=False):
            raise AssertionError("must not be called without _order support")

    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_graph = types.ModuleType("transformer_engine.pytorch.graph")
    te_pt.make_graphed_callables = make_graphed_callables
    te_graph.set_capture_end = lambda: setattr(fake, "capturing", False)
    te.pytorch = te_pt
    te_pt.graph = te_graph
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.graph", te_graph)
    # pretend to be on a GPU machine: the adapter needs CUDA, the fake does not
    monkeypatch.setattr("graphs.decision.cuda_ready", lambda: True)
    # (graphs.capture is also the name of the function: reach the module through sys.modules)
    monkeypatch.setattr(sys.modules["graphs.capture"], "_local_problem", lambda layers, sample_args: None)
    return fake


GRID = [("no_pipelining", 1, 1, 3, None, 0, [2]), ("1f1b", 4, 1, 4, None, 1, [2]),
        ("interleaved", 2, 2, 4, 2, 0, [2, 1]), ("interleaved", 2, 2, 5, 3, 1, [1, 2]),
        ("interleaved", 4, 3, 4, 4, 3, [1, 1, 1])]


@pytest.mark.parametrize("schedule,pp,vp,m,g,rank,lpc", GRID)
def test_te_adapter_passes_exactly_what_te_expects(monkeypatch, schedule, pp, vp, m, g, rank, lpc):
    fake = install_fake(monkeypatch, "head")
    plan = build_plan(schedule, pp, m, vp, g)
    eager = make_chunks(vp, lpc)
    graphed = copy.deepcopy(eager)
    sample = samples(graphed, m)
    layers = capture(graphed, plan, rank, sample, backend="te", num_warmup_iters=2)
    assert layers.active and layers.report.backend == "te", layers.report
    (call,) = fake.calls
    assert call["_order"] == capture_order(plan, rank)
    assert call["_num_layers_per_chunk"] == lpc
    assert list(call["modules"]) == [layer for chunk in graphed for layer in chunk]  # chunk-major, each once
    assert len(call["sample_args"]) == sum(lpc) * m
    assert all(a is b for a, b in zip(call["sample_args"], sample))  # the flat TE layout, untouched
    assert call["allow_unused_input"] is True
    assert call["num_warmup_iters"] == max(2, -(-10 // m))  # Megatron's rule: at least 10 warmups per layer
    assert call["clone_param_grads_on_return"] is True  # B17
    # buffer reuse only without pipeline sends (the executor waits a sent gradient lazily)
    assert call["_reuse_graph_input_output_buffers"] is (pp == 1)
    assert call["sample_kwargs"] is None and call["pool"] is None
    # one step through the dispatch: the callable of (c, m, l) is the one TE built for that flat index
    data = make_rank_data(vp, m, (S, B, H))
    assert bitwise_equal(run_steps(eager, plan, rank, data, 1), run_steps(graphed, plan, rank, data, 1))
    events = layer_events(capture_order(plan, rank), lpc)
    assert fake.replayed == [flat_index(e.chunk, e.microbatch, e.layer, lpc, m) for e in events if e.kind == "F"]


def test_te_1_6_signature_uniform_layers_and_b17_hooks(monkeypatch):
    fake = install_fake(monkeypatch, "v1.6")
    plan = build_plan("interleaved", 2, 4, 2, 2)
    eager = make_chunks(2, 2)
    graphed = copy.deepcopy(eager)
    layers = capture(graphed, plan, 0, samples(graphed, 4), backend="te")
    assert layers.active
    (call,) = fake.calls
    assert "_num_layers_per_chunk" not in call and call["_order"] == capture_order(plan, 0)
    assert "clone_param_grads_on_return=no" in layers.report.te_features
    hooked = [p for chunk in graphed for layer in chunk for p in layer.parameters() if p._backward_hooks]
    assert len(hooked) == sum(1 for chunk in graphed for layer in chunk for _ in layer.parameters())
    data = make_rank_data(2, 4, (S, B, H))
    assert bitwise_equal(run_steps(eager, plan, 0, data, 2), run_steps(graphed, plan, 0, data, 2))
    layers.remove()
    assert not any(p._backward_hooks for chunk in graphed for layer in chunk for p in layer.parameters())


def test_te_1_6_non_uniform_layers_falls_back_with_reason(monkeypatch, caplog):
    install_fake(monkeypatch, "v1.6")
    plan = build_plan("interleaved", 2, 4, 2, 2)
    graphed = make_chunks(2, [2, 1])
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        layers = capture(graphed, plan, 0, samples(graphed, 4), backend="te")
    assert not layers.active and "_num_layers_per_chunk" in layers.report.reason
    assert len([r for r in caplog.records if r.name == "pipecast.graphs"]) == 1


def test_te_without_order_is_unavailable(monkeypatch, caplog):
    install_fake(monkeypatch, "none")
    plan = build_plan("1f1b", 2, 2)
    graphed = make_chunks(1, 1)
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        layers = capture(graphed, plan, 0, samples(graphed, 2), backend="te")
    assert not layers.active and "_order" in layers.report.reason
    lines = [r.getMessage() for r in caplog.records if r.name == "pipecast.graphs"]
    assert len(lines) == 1 and "running eagerly" in lines[0]
    # auto picks the torch backend when TE cannot do ordered capture
    from graphs.capture import resolve_backend
    assert resolve_backend("auto") == ("torch", None)


def test_failed_te_capture_restores_every_piece_of_state(monkeypatch, caplog):
    fake = install_fake(monkeypatch, "head")
    fake.fail = True
    plan = build_plan("interleaved", 2, 4, 2, 2)
    eager = make_chunks(2, 1)
    graphed = copy.deepcopy(eager)
    for chunk in graphed:
        for layer in chunk:
            for p in layer.parameters():
                p.grad = torch.zeros_like(p)
    grads_before = [p.grad for chunk in graphed for layer in chunk for p in layer.parameters()]
    call_before = Block.__dict__.get("__call__", "missing")
    rng_before = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        layers = capture(graphed, plan, 0, samples(graphed, 4), backend="te")
    try:
        assert not layers.active and layers.report.backend == "eager"
        assert "capture error" in layers.report.reason and "stream is capturing" in layers.report.reason
        assert Block.__dict__.get("__call__", "missing") == call_before
        assert gc.isenabled() and not fake.capturing
        assert torch.equal(torch.get_rng_state(), rng_before)
        assert all(a is b for a, b in zip(grads_before, [p.grad for c in graphed for l in c for p in l.parameters()]))
        assert len([r for r in caplog.records if r.name == "pipecast.graphs"]) == 1
        for chunk in graphed:
            for layer in chunk:
                layer.zero_grad(set_to_none=True)
        data = make_rank_data(2, 4, (S, B, H))
        assert bitwise_equal(run_steps(eager, plan, 0, data, 1), run_steps(graphed, plan, 0, data, 1))
    finally:
        if "__call__" in Block.__dict__ and call_before == "missing":
            del Block.__call__
        gc.enable()


def test_build_te_arguments_rejects_inconsistent_layouts():
    from graphs.backends.te import TEFeatures, build_te_arguments
    feats = TEFeatures(frozenset({"_order", "_num_layers_per_chunk", "num_warmup_iters"}))
    mods = [torch.nn.Linear(2, 2) for _ in range(3)]
    args = [(torch.ones(2),)] * 6
    (m, sa), kw = build_te_arguments(feats, mods, args, None, [1, 2, -2, -1] * 2, [2, 1], 2, eager_microbatches=8,
                                     reuse_buffers=True)
    assert kw == {"_order": [1, 2, -2, -1] * 2, "_num_layers_per_chunk": [2, 1], "num_warmup_iters": 1}
    feats = TEFeatures(frozenset({"_order", "num_warmup_iters", "_reuse_graph_input_output_buffers"}))
    _, kw = build_te_arguments(feats, mods, args, None, [1, -1] * 2, [3], 2, reuse_buffers=True)
    assert kw["num_warmup_iters"] == 5 and kw["_reuse_graph_input_output_buffers"] is True  # 10 / M = 2
    _, kw = build_te_arguments(feats, mods, args, None, [1, -1] * 2, [3], 2, num_warmup_iters=7)
    assert kw["num_warmup_iters"] == 7 and "_reuse_graph_input_output_buffers" not in kw
    with pytest.raises(ValueError, match="sum\\(L\\)\\*M"):
        build_te_arguments(feats, mods, args[:-1], None, [1, -1], [2, 1], 2)
    with pytest.raises(ValueError, match="modules"):
        build_te_arguments(feats, mods[:2], args, None, [1, -1], [2, 1], 2)
    with pytest.raises(TypeError):
        build_te_arguments(feats, mods, [(1.0,)] * 6, None, [1, -1], [2, 1], 2)
    with pytest.raises(ValueError, match="_order"):
        build_te_arguments(TEFeatures(frozenset()), mods, args, None, [1, -1], [2, 1], 2)


def test_te_falls_back_for_split_backward_plans_and_auto_takes_pipecasts_capture(monkeypatch, caplog):
    """TE's integer backward entries compute weight gradients in B and its -k-0.5 entries serve only its own
    delay_wgrad_compute modules: a split plan through ``te`` runs eagerly with that reason, TE never called;
    ``auto`` captures F / B / W graphs with pipecast's backend instead (here on the CPU emulation)."""
    from graphs.local_rank import WeightQueue
    fake = install_fake(monkeypatch, "head")
    plan = build_plan("zbv", 2, 4, 2)
    graphed = make_chunks(2, 1)
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        layers = capture(graphed, plan, 0, samples(graphed, 4), backend="te", defer_weight_grad=WeightQueue().defer)
    assert not layers.active and not fake.calls
    assert "cannot capture a split-backward plan" in layers.report.reason
    lines = [r.getMessage() for r in caplog.records if r.name == "pipecast.graphs"]
    assert len(lines) == 1 and "running eagerly" in lines[0] and "cuda_graphs.backend='torch'" in lines[0]
    from graphs.backends import get_backend
    monkeypatch.setattr(get_backend("torch"), "capture", get_backend("emulate").capture)  # no GPU here
    layers = capture(layers, plan, 0, samples(graphed, 4), backend="auto", defer_weight_grad=WeightQueue().defer)
    assert layers.active and layers.report.backend == "torch" and not fake.calls
