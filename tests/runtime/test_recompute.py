"""Activation recomputation (``engine.runtime.recompute``) and fp32 ``main_grad`` (``engine.runtime.main_grad``) in
one process, against the same model without them.

* full (each layer) and selective (each attention core) recomputation give bitwise the gradients of no
  recomputation -- unsplit backward, split backward with the layer-level deferral and the generic autograd split
  (an elementwise parameter outside the deferred ops), with dropout (the random state is replayed) and under CPU
  bf16 autocast (the autocast state is replayed);
* under split backward the recomputed forward runs once, in B; every weight gradient waits for W, and W holds what
  it holds without recomputation (layer mode);
* saved-activation bytes per microbatch, counted with saved-tensor hooks: full keeps exactly the layer input
  (``s*b*h`` elements) per layer; selective keeps more than full and less than none; a forward flagged False by
  partial recomputation keeps what none keeps;
* ``main_grad``: after a step, the fp32 sum in microbatch order of each microbatch's bf16 gradient, bit for bit,
  unsplit and split (W passes included), with recomputation; ``finalize_model_grads`` reads it.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import finalize_model_grads
from engine.model_parallel_config import ModelParallelConfig
from engine.runtime.main_grad import attach_main_grad, grad_of
from engine.runtime.recompute import apply_recompute, recompute, recomputed_modules, remove_recompute
from engine.runtime.split_backward import backward_input_step, weight_grad_deferral
from engine.runtime.step import recompute_microbatch
from tests.helpers import fit_jobs as fj

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: no intra-op threads spinning on 2 shared cores
S, B, H = fj.S, fj.B, fj.H
CONFIG = ModelParallelConfig()
GRANULARITIES = ("none", "full", "selective")


def _blocks(gate: bool = False, dropout: float = 0.1, dtype=torch.float32) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(fj.Block(dropout, gate) for _ in range(3)).to(dtype)


def _mark(blocks, granularity: str) -> None:
    if granularity == "full":
        apply_recompute(blocks)
    elif granularity == "selective":
        apply_recompute(b.core for b in blocks)


def _inputs(dtype=torch.float32) -> list:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(S, B, H, generator=g).to(dtype) for _ in range(3)]


def _step(blocks, mode: str, xs, autocast: bool = False, start: int = 0) -> tuple[list, list]:
    """One step over the microbatches ``xs`` (numbered from ``start``: the seeds of their dropout and output
    gradient): ``mode`` "unsplit", "layer" or "generic" (split backward: every B, then every W in microbatch
    order).  Returns ``(input gradients, weight-gradient works)``."""
    grads_in, works = [], []
    for m, x in enumerate(xs, start):
        torch.manual_seed(100 + m)
        x = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                (weight_grad_deferral() if mode == "layer" else torch.enable_grad()):
            y = x
            for b in blocks:
                y = b(y)
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(m)).to(y.dtype)
        if mode == "unsplit":
            y.backward(grad)
            grads_in.append(x.grad)
        else:
            gx, work = backward_input_step(x, y, grad, CONFIG, mode="auto" if mode == "layer" else "generic")
            grads_in.append(gx)
            works.append(work)
    for work in works:
        work.run()
    return grads_in, works


def _grads(blocks) -> list:
    return [grad_of(p).clone() for p in blocks.parameters()]


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("mode", ["unsplit", "layer", "generic"])
@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recomputation_changes_no_gradient_bit(granularity, mode, gate):
    base = _blocks(gate)
    want_in, _ = _step(base, mode, _inputs())
    blocks = _blocks(gate)
    _mark(blocks, granularity)
    got_in, _ = _step(blocks, mode, _inputs())
    assert all(torch.equal(a, b) for a, b in zip(_grads(blocks), _grads(base)))
    assert all(torch.equal(a, b) for a, b in zip(got_in, want_in))


@pytest.mark.parametrize("mode", ["unsplit", "layer"])
def test_recomputation_replays_cpu_autocast(mode):
    base, blocks = _blocks(dropout=0.0), _blocks(dropout=0.0)
    _step(base, mode, _inputs(), autocast=True)
    _mark(blocks, "full")
    _step(blocks, mode, _inputs(), autocast=True)
    assert all(torch.equal(a, b) for a, b in zip(_grads(blocks), _grads(base)))


@pytest.mark.parametrize("gate", [False, True])
def test_split_recomputes_once_in_b_and_defers_every_weight_gradient(gate):
    blocks = _blocks(gate)
    calls = []
    for b in apply_recompute(blocks):
        inner = b.forward.forward
        b.forward.forward = lambda *a, inner=inner: (calls.append(torch.is_grad_enabled()), inner(*a))[1]
    x = _inputs()[0].requires_grad_()
    with weight_grad_deferral():
        y = x
        for b in blocks:
            y = b(y)
    assert calls == [False] * 3  # the forward keeps nothing
    _, work = backward_input_step(x, y, torch.ones_like(y), CONFIG)
    assert calls == [False] * 3 + [True] * 3  # recomputed in B, once per layer
    assert all(p.grad is None for p in blocks.parameters()), "a weight gradient was computed in B"
    work.run()
    assert calls == [False] * 3 + [True] * 3  # W recomputes nothing
    assert all(p.grad is not None for p in blocks.parameters())


def test_w_holds_what_it_holds_without_recomputation():
    held = {}
    for granularity in ("none", "full"):
        blocks = _blocks(dropout=0.0)
        _mark(blocks, granularity)
        x = _inputs()[0].requires_grad_()
        with weight_grad_deferral():
            y = x
            for b in blocks:
                y = b(y)
        _, work = backward_input_step(x, y, torch.ones_like(y), CONFIG)
        held[granularity] = work.held_bytes()
        work.run()
    assert held["full"] == held["none"] > 0


def _saved_bytes(blocks, x, flag=None) -> int:
    """Bytes of the distinct storages the forward of ``blocks`` saves for the backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in blocks.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t
    previous, recompute_microbatch[0] = recompute_microbatch[0], flag
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = x
            for b in blocks:
                y = b(y)
    finally:
        recompute_microbatch[0] = previous
    return sum(seen.values())


def test_saved_activation_bytes_per_layer():
    x = _inputs()[0].requires_grad_()
    sizes = {}
    for granularity in GRANULARITIES:
        blocks = _blocks()
        _mark(blocks, granularity)
        sizes[granularity] = _saved_bytes(blocks, x)
    assert sizes["full"] == 3 * S * B * H * 4  # each layer keeps its input [s, b, h] (fp32), nothing else
    assert sizes["full"] < sizes["selective"] < sizes["none"]
    blocks = _blocks()
    _mark(blocks, "full")
    assert _saved_bytes(blocks, x, flag=False) == sizes["none"]  # partial recomputation: this microbatch keeps all
    assert _saved_bytes(blocks, x, flag=True) == sizes["full"]


def test_main_grad_is_the_fp32_sum_of_each_microbatchs_bf16_gradient():
    xs = _inputs(torch.bfloat16)
    ref = _blocks(dropout=0.0, dtype=torch.bfloat16)
    total = [torch.zeros(p.shape) for p in ref.parameters()]
    for m, x in enumerate(xs):  # the reference: each microbatch's bf16 gradient on its own, summed in fp32
        ref.zero_grad(set_to_none=True)
        _step(ref, "unsplit", [x], start=m)
        for t, p in zip(total, ref.parameters()):
            t += p.grad.float()
    for mode in ("unsplit", "layer", "generic"):
        for granularity in ("none", "full"):
            blocks = _blocks(dropout=0.0, dtype=torch.bfloat16)
            _mark(blocks, granularity)
            handle = attach_main_grad([blocks])
            _step(blocks, mode, xs)
            assert all(p.grad is None for p in blocks.parameters())
            assert all(torch.equal(p.main_grad, t) for p, t in zip(blocks.parameters(), total)), (mode, granularity)
            handle.zero()
            assert all(not p.main_grad.any() for p in blocks.parameters())


def test_finalize_reads_main_grad():
    blocks = _blocks(dropout=0.0, dtype=torch.bfloat16)
    attach_main_grad([blocks])
    _step(blocks, "unsplit", _inputs(torch.bfloat16))
    before = [p.main_grad.clone() for p in blocks.parameters()]
    finalize_model_grads([blocks], torch.tensor(4, dtype=torch.int))
    assert all(p.grad is None for p in blocks.parameters())
    for p, b in zip(blocks.parameters(), before):
        torch.testing.assert_close(p.main_grad, b / 4, rtol=0, atol=0)


def test_recompute_api():
    blocks = _blocks()
    names = [n for n, _ in blocks.named_parameters()]
    marked = apply_recompute(blocks)
    assert apply_recompute(blocks) == marked and recomputed_modules(blocks) == list(blocks)
    assert [n for n, _ in blocks.named_parameters()] == names and set(blocks.state_dict()) >= set(names)
    remove_recompute(blocks)
    assert recomputed_modules(blocks) == []
    with pytest.raises(TypeError, match="expected torch.nn.Module objects, got int"):
        apply_recompute([3])
    x = torch.randn(2, 3, requires_grad=True)
    with torch.no_grad():  # without grad the function just runs
        assert recompute(torch.tanh, x).grad_fn is None
    pair = recompute(lambda t: (t * 2, "tag", [t]), x)
    assert pair[1] == "tag" and pair[0].grad_fn is not None
    with pytest.raises(TypeError, match="returned dict"):
        recompute(lambda t: {"y": t}, x)
    handle = attach_main_grad([blocks, nn.ModuleList([blocks[0]])])  # a shared parameter gets one main_grad
    assert len(handle.params) == len(names)
    with pytest.raises(ValueError, match="parameter '0.ln1.weight' already has a main_grad; attach once"):
        attach_main_grad([blocks])
    handle.remove()
    assert not any(hasattr(p, "main_grad") for p in blocks.parameters())


def test_parameters_of_a_segment_without_grad_inputs_still_get_gradients():
    """The first layer fed data directly (no input requires grad): the anchor keeps its parameters in the graph."""
    base, blocks = _blocks(dropout=0.0), _blocks(dropout=0.0)
    apply_recompute(blocks)
    x = _inputs()[0]
    for model in (base, blocks):
        y = x
        for b in model:
            y = b(y)
        y.sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(blocks), _grads(base)))
