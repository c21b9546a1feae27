"""Split backward (engine.runtime.split_backward): F for microbatches 0..M-1, B for each, then W for each in order
gives bitwise the ``.grad`` and input gradients of the unsplit ``backward_step`` per microbatch, in layer and
generic mode, with and without output deallocation, on the loss stage and a middle stage."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.model_parallel_config import ModelParallelConfig
from engine.runtime.split_backward import backward_input_step, enable_layer_deferral, weight_grad_deferral
from engine.runtime.step import ScheduleContractError, backward_step, deallocate_output_tensor
from engine.training.config import ModelConfig
from engine.training.models.chunk import build_model_chunks

S, B, H = 5, 2, 8  # [s, b, h]
M = 3


class MLPChunk(nn.Module):
    """Linear / LayerNorm / GELU layers with a residual: ``[s, b, h] -> [s, b, h]``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(H, 2 * H), nn.LayerNorm(2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x)))) + x


class FlatChunk(MLPChunk):
    """Linear layers on a 2-D ``[s*b, h]`` view (the ``addmm`` form of ``F.linear``)."""

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x.reshape(-1, H))))).view(S, B, H) + x


class CheckpointedChunk(MLPChunk):
    """The MLP chunk under non-reentrant activation checkpointing (recomputed in B)."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


class SharedLinearChunk(nn.Module):
    """One ``nn.Linear`` applied twice (its weight gradient sums two contributions per microbatch)."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(H, H), nn.LayerNorm(H)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(self.ln(x)))) + x


class OddChunk(nn.Module):
    """A user chunk with odd structure: a weight used twice, parameters used directly, a buffer, a branch that
    does not depend on the input, a non-parameter branch of the input."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, H) * 0.3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, H))
        self.register_buffer("shift", torch.randn(H))
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        h = torch.tanh(x @ self.w) @ self.w.t()  # shared weight, used twice
        h = h * self.scale + self.shift  # a parameter used directly, a buffer
        side = (self.scale ** 2).sum() * self.shift  # depends on a parameter only
        return self.lin(h) + side + torch.sin(x)  # sin(x): a branch of the input without parameters


class MixedChunk(nn.Module):
    """A weight-side node fed both from the input path and from another weight-side node: ``x*h + k(h)``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H) * 0.5)

    def forward(self, x):
        h = self.w * 2
        return x * h + torch.exp(h)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, B, H, generator=g) for _ in range(M)], [torch.randn(S, B, H, generator=g) for _ in range(M)]


def _forward(chunk, x, loss_stage, defer):
    with weight_grad_deferral() if defer else torch.enable_grad():
        y = chunk(x)
    return (y.square().mean() / M) if loss_stage else y


def _reference(chunk, xs, gys, config, loss_stage):
    """Unsplit: F then ``backward_step`` per microbatch; returns the input gradients."""
    grads = []
    for x0, gy in zip(xs, gys):
        x = x0.clone().requires_grad_()
        y = _forward(chunk, x, loss_stage, False)
        if not loss_stage:
            deallocate_output_tensor(y, config.deallocate_pipeline_outputs)
        grads.append(backward_step(x, y, None if loss_stage else gy, config))
    return grads


def _split(chunk, xs, gys, config, loss_stage, mode, defer):
    """F for every microbatch, then B for each, then W for each in microbatch order."""
    saved, reached = [], []
    for x0, gy in zip(xs, gys):
        x = x0.clone().requires_grad_()
        x.register_hook(lambda g: reached.append(1))  # W must never compute an input gradient again
        y = _forward(chunk, x, loss_stage, defer)
        if not loss_stage:
            deallocate_output_tensor(y, config.deallocate_pipeline_outputs)
        saved.append((x, y, None if loss_stage else gy))
    grads, works = [], []
    for x, y, gy in saved:
        gx, work = backward_input_step(x, y, gy, config, mode=mode)
        grads.append(gx)
        works.append(work)
    after_b = {n: p.grad is not None for n, p in chunk.named_parameters()}
    assert len(reached) == len(xs)
    for work in works:
        work.run()
    assert len(reached) == len(xs)
    return grads, works, after_b


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _check(ctor, mode, defer, dealloc, loss_stage, expect_mode):
    torch.manual_seed(0)
    ref = ctor()
    tst = copy.deepcopy(ref)
    config = ModelParallelConfig(deallocate_pipeline_outputs=dealloc)
    xs, gys = _data()
    g_ref = _reference(ref, xs, gys, config, loss_stage)
    g_tst, works, after_b = _split(tst, xs, gys, config, loss_stage, mode, defer)
    assert {w.mode for w in works} == {expect_mode}
    assert not any(after_b.values()), f"weight gradients computed in B: {after_b}"
    assert _max_diff(g_ref, g_tst) == 0.0
    for (name, p), q in zip(ref.named_parameters(), tst.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("dealloc", [False, True])
@pytest.mark.parametrize("loss_stage", [False, True])
@pytest.mark.parametrize("mode,defer,expect", [("layer", True, "layer"), ("auto", True, "layer"),
                                                ("generic", False, "generic"), ("auto", False, "generic"),
                                                ("generic", True, "generic")])
@pytest.mark.parametrize("ctor", [MLPChunk, FlatChunk, SharedLinearChunk])
def test_layer_chunk_split_equals_unsplit_bitwise(ctor, mode, defer, expect, dealloc, loss_stage):
    _check(ctor, mode, defer, dealloc, loss_stage, expect)


@pytest.mark.parametrize("dealloc", [False, True])
@pytest.mark.parametrize("loss_stage", [False, True])
@pytest.mark.parametrize("ctor", [OddChunk, MixedChunk])
@pytest.mark.parametrize("defer", [False, True])
def test_user_chunk_generic_split_equals_unsplit_bitwise(ctor, defer, dealloc, loss_stage):
    # parameters used outside deferrable ops: auto chooses the generic split even under the deferral
    _check(ctor, "auto", defer, dealloc, loss_stage, "generic")


@pytest.mark.parametrize("loss_stage", [False, True])
def test_checkpointed_chunk_generic_split_equals_unsplit_bitwise(loss_stage):
    _check(CheckpointedChunk, "generic", False, True, loss_stage, "generic")


# ---- the project's GPT chunks (layer deferral) --------------------------------------------------------------------

GPT = ModelConfig(num_layers=3, hidden_size=16, num_attention_heads=2, seq_length=6, vocab_size=32)


def _gpt_stage(chunk, tokens, labels, x, defer):
    chunk.set_input_tensor(x)
    with weight_grad_deferral() if defer else torch.enable_grad():
        y = chunk(tokens, labels if chunk.is_last else None)
    return y.mean() if chunk.is_last else y


@pytest.mark.parametrize("pp,rank", [(3, 0), (3, 1), (3, 2), (1, 0)])
def test_gpt_chunks_layer_split_equals_unsplit_bitwise(pp, rank):
    """First stage (embedding, no input), middle, last (tied head copy used by a bare F.linear, the loss), and one
    chunk holding both ends (the embedding and the head share one weight)."""
    ref = build_model_chunks(GPT, 4 * GPT.hidden_size, pp, rank, 1, seed=3)[0]
    tst = copy.deepcopy(ref)
    config = ModelParallelConfig(deallocate_pipeline_outputs=True)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 32, (B, 6), generator=g), torch.randint(0, 32, (B, 6), generator=g),
             None if ref.is_first else torch.randn(6, B, 16, generator=g), torch.randn(6, B, 16, generator=g))
            for _ in range(M)]
    saved, g_ref = [], []
    for tokens, labels, x0, gy in data:
        x = None if x0 is None else x0.clone().requires_grad_()
        y = _gpt_stage(ref, tokens, labels, x, False)
        if not ref.is_last:
            deallocate_output_tensor(y, True)
        g_ref.append(backward_step(x, y, None if ref.is_last else gy, config))
        x = None if x0 is None else x0.clone().requires_grad_()
        y = _gpt_stage(tst, tokens, labels, x, True)
        if not tst.is_last:
            deallocate_output_tensor(y, True)
        saved.append((x, y, None if tst.is_last else gy))
    works = []
    for x, y, gy in saved:
        gx, work = backward_input_step(x, y, gy, config)
        assert work.mode == "layer" and work.held_bytes() > 0
        works.append(work)
        if x is None:
            assert gx is None
        else:
            assert torch.equal(gx, g_ref[len(works) - 1])
    assert all(p.grad is None for p in tst.parameters())
    for work in works:
        work.run()
    for (name, p), q in zip(ref.named_parameters(), tst.parameters()):
        assert torch.equal(p.grad, q.grad), name


# ---- hooks, first stage, lists, loss scaling ----------------------------------------------------------------------

@pytest.mark.parametrize("mode,defer", [("layer", True), ("generic", False)])
def test_parameter_hooks_fire_at_w_once_per_microbatch(mode, defer):
    chunk = MLPChunk()
    calls = []
    for name, p in chunk.named_parameters():
        p.register_hook(lambda g, name=name: calls.append(("hook", name)))
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.append(("post", name)))
    xs, gys = _data()
    config = ModelParallelConfig()
    _, works, _ = _split_no_run(chunk, xs, gys, config, mode, defer)
    assert calls == []
    works[0].run()
    n = len(list(chunk.parameters()))
    assert sorted(calls) == sorted([(k, name) for name, _ in chunk.named_parameters() for k in ("hook", "post")])
    assert len(calls) == 2 * n
    with pytest.raises(RuntimeError, match="already ran"):
        works[0].run()


def _split_no_run(chunk, xs, gys, config, mode, defer):
    works, grads = [], []
    for x0, gy in zip(xs, gys):
        x = x0.clone().requires_grad_()
        gx, w = backward_input_step(x, _forward(chunk, x, False, defer), gy, config, mode=mode)
        works.append(w)
        grads.append(gx)
    return grads, works, None


def test_tensor_hook_on_intermediate_applies_once():
    class Hooked(MLPChunk):
        def forward(self, x):
            h = self.fc1(x)
            h.register_hook(lambda g: g * 3)  # the gradient arriving at an intermediate's output tensor
            return self.fc2(F.gelu(h)) + x
    _check(Hooked, "generic", False, False, False, "generic")


@pytest.mark.parametrize("mode,defer,expect", [("generic", False, "full"), ("auto", True, "layer")])
def test_first_stage_without_input_defers_everything(mode, defer, expect):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(10, H), nn.Linear(H, H))
    tst = copy.deepcopy(ref)
    config = ModelParallelConfig()
    tokens = torch.randint(0, 10, (S, B))
    gy = torch.randn(S, B, H)
    assert backward_step(None, ref(tokens), gy, config) is None
    with weight_grad_deferral() if defer else torch.enable_grad():
        y = tst(tokens)
    gx, work = backward_input_step([None], [y], [gy], config, mode=mode)
    assert gx == [None] and work.mode == expect
    assert all(p.grad is None for p in tst.parameters())
    work.run()
    for p, q in zip(ref.parameters(), tst.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("mode,defer", [("layer", True), ("generic", False)])
def test_grad_scale_func_applied_once_on_loss_stage(mode, defer):
    torch.manual_seed(0)
    ref = MLPChunk()
    tst = copy.deepcopy(ref)
    config = ModelParallelConfig(grad_scale_func=lambda loss: loss * 8.0)
    x0 = torch.randn(S, B, H)
    x = x0.clone().requires_grad_()
    g_ref = backward_step([x], [ref(x).sum()], [None], config)
    x = x0.clone().requires_grad_()
    with weight_grad_deferral() if defer else torch.enable_grad():
        loss = tst(x).sum()
    g_tst, work = backward_input_step([x], [loss], [None], config, mode=mode)
    work.run()
    assert isinstance(g_tst, list) and torch.equal(g_ref[0], g_tst[0])
    for p, q in zip(ref.parameters(), tst.parameters()):
        assert torch.equal(p.grad, q.grad)


# ---- errors, memory, the deferral outside split backward ----------------------------------------------------------

def test_errors_name_the_value_and_fix():
    x = torch.randn(S, B, H, requires_grad=True)
    with pytest.raises(ValueError, match="mode='fast'.*'generic'"):
        backward_input_step(x, MLPChunk()(x), torch.ones(S, B, H), ModelParallelConfig(), mode="fast")
    with pytest.raises(ScheduleContractError, match=r"shape \[5, 2, 8\].*loss.sum\(\)"):
        backward_input_step(x, MLPChunk()(x), None, ModelParallelConfig(), mode="generic")
    with pytest.raises(TypeError, match="nn.Module"):
        enable_layer_deferral(lambda x: x)


class _SavedTensors:
    """Saved-tensor hooks recording what autograd saves; ``held()`` is the bytes of the distinct non-parameter
    storages still saved (alive in some graph)."""

    def __init__(self, params):
        self.boxes, self.params = [], {p.untyped_storage().data_ptr() for p in params}

    def hooks(self):
        def pack(t):
            box = _Box(t)
            self.boxes.append(weakref.ref(box))
            return box
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t)

    def held(self) -> int:
        sizes = {}
        for ref in self.boxes:
            box = ref()
            if box is not None and box.t.untyped_storage().data_ptr() not in self.params:
                sizes[box.t.untyped_storage().data_ptr()] = box.t.untyped_storage().nbytes()
        return sum(sizes.values())


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def _held_between_b_and_w(mode, defer):
    chunk = MLPChunk()
    saved = _SavedTensors(chunk.parameters())
    x = torch.randn(S, B, H, requires_grad=True)
    with saved.hooks(), weight_grad_deferral() if defer else torch.enable_grad():
        y = chunk(x)
    _, work = backward_input_step(x, y, torch.randn(S, B, H), ModelParallelConfig(), mode=mode)
    del y
    gc.collect()
    between = saved.held(), work.held_bytes()
    work.run()
    gc.collect()
    return between, (saved.held(), work.held_bytes())


@pytest.mark.parametrize("mode,defer", [("layer", True), ("generic", False)])
def test_w_frees_what_b_held(mode, defer):
    (graph, handle), after = _held_between_b_and_w(mode, defer)
    assert graph > 0 and handle > 0
    assert after == (0, 0)


def test_layer_mode_holds_less_than_generic_between_b_and_w():
    (layer, _), _ = _held_between_b_and_w("layer", True)
    (generic, _), _ = _held_between_b_and_w("generic", False)
    # layer: the inputs of fc1, ln, fc2 (+ ln's mean / rstd); generic: every saved tensor (+ gelu's input)
    assert layer < generic


def test_deferral_without_split_backward_is_the_plain_backward():
    torch.manual_seed(0)
    ref = MLPChunk()
    tst = copy.deepcopy(ref)
    hooks = enable_layer_deferral(tst)
    x0 = torch.randn(S, B, H)
    ref(x0.clone().requires_grad_()).sum().backward()
    x = x0.clone().requires_grad_()
    y = tst(x)
    assert "_BridgeBackward" in _node_names(y)
    y.sum().backward()
    for p, q in zip(ref.parameters(), tst.parameters()):
        assert torch.equal(p.grad, q.grad)
    hooks.remove()
    with torch.no_grad(), weight_grad_deferral():
        assert tst(x0).grad_fn is None
    assert "_BridgeBackward" not in _node_names(tst(x))


def _node_names(y) -> set:
    names, stack, seen = set(), [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            names.add(type(node).__name__)
            stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("ctor", [MLPChunk, OddChunk])
def test_gradient_changing_parameter_hooks_apply_once(ctor):
    torch.manual_seed(0)
    ref = ctor()
    tst = copy.deepcopy(ref)
    for p, q in zip(ref.parameters(), tst.parameters()):
        p.register_hook(lambda g: g * 2)
        q.register_hook(lambda g: g * 2)
    config = ModelParallelConfig()
    xs, gys = _data()
    g_ref = _reference(ref, xs, gys, config, False)
    g_tst, works, _ = _split(tst, xs, gys, config, False, "generic", False)
    assert _max_diff(g_ref, g_tst) == 0.0
    for p, q in zip(ref.parameters(), tst.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_nested_deferral_defers_each_op_once():
    torch.manual_seed(0)
    ref = MLPChunk()
    tst = copy.deepcopy(ref)
    enable_layer_deferral(tst)  # and the executor's weight_grad_deferral around the forward
    x = torch.randn(S, B, H, requires_grad=True)
    with weight_grad_deferral():
        y = tst(x)
    _, work = backward_input_step(x, y, torch.ones(S, B, H), ModelParallelConfig())
    assert work.mode == "layer" and len(work.records) == 3
    assert "_LinearBridgeBackward" in _node_names(y)  # nn.Linear on [s, b, h] takes the written-out formulas
    work.run()
    ref(x).backward(torch.ones(S, B, H))
    for p, q in zip(ref.parameters(), tst.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("ctor,mode,defer", [(MLPChunk, "auto", True), (OddChunk, "auto", True),
                                             (MLPChunk, "generic", False)])
def test_split_under_cpu_autocast_equals_unsplit_bitwise(ctor, mode, defer):
    """bf16 autocast (``config.enable_autocast``): linear takes the op's own graph, not the fp32 formulas."""
    torch.manual_seed(0)
    ref = ctor()
    tst = copy.deepcopy(ref)
    config = ModelParallelConfig()
    xs, gys = _data()
    works = []
    for x0, gy in zip(xs, gys):
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ref(x)
        g_ref = backward_step(x, y, gy.to(y.dtype), config)
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), weight_grad_deferral() if defer else torch.enable_grad():
            y = tst(x)
        g_tst, work = backward_input_step(x, y, gy.to(y.dtype), config, mode=mode)
        assert torch.equal(g_ref, g_tst)
        works.append(work)
    for work in works:
        work.run()
    for p, q in zip(ref.parameters(), tst.parameters()):
        assert torch.equal(p.grad, q.grad)


def _two_stage_step(chunks, data, split, order):
    """One training step of a 2-stage GPT in one process (the hand-off detached as P2P does).  ``split``: B then W
    where ``order[m]`` lists the Ws ``(stage, microbatch)`` run after the Bs of microbatch ``m``, as a zero-bubble
    plan interleaves them; else the unsplit backward.  Returns the losses."""
    config = ModelParallelConfig(deallocate_pipeline_outputs=True)
    acts, losses = [], []
    for tokens, labels in data:  # F of every microbatch on both stages
        with weight_grad_deferral() if split else torch.enable_grad():
            chunks[0].set_input_tensor(None)
            y0 = chunks[0](tokens)
            x1 = y0.detach().requires_grad_()
            chunks[1].set_input_tensor(x1)
            loss = chunks[1](tokens, labels).mean() / len(data)
        deallocate_output_tensor(y0, True)
        acts.append((y0, x1, loss))
        losses.append(loss.item())
    works = {}
    for m, (y0, x1, loss) in enumerate(acts):
        if split:
            gx, works[1, m] = backward_input_step(x1, loss, None, config)
            _, works[0, m] = backward_input_step(None, y0, gx, config)
            for stage, mb in order[m]:
                works.pop((stage, mb)).run()
        else:
            backward_step(None, y0, backward_step(x1, loss, None, config), config)
    assert not works
    return losses


@pytest.mark.slow  # a few seconds on a loaded 2-core machine (the first GPT forwards of a process warm up)
def test_two_stage_gpt_zero_bubble_order_equals_unsplit_bitwise():
    """Ws interleaved with later microbatches' Bs (each stage's W in microbatch order) give the unsplit step."""
    ref = [build_model_chunks(GPT, 4 * GPT.hidden_size, 2, r, 1, seed=3)[0] for r in (0, 1)]
    tst = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(9)
    data = [(torch.randint(0, 32, (B, 6), generator=g), torch.randint(0, 32, (B, 6), generator=g)) for _ in range(3)]
    order = [[(1, 0)], [(0, 0), (1, 1)], [(0, 1), (1, 2), (0, 2)]]
    assert _two_stage_step(ref, data, False, None) == _two_stage_step(tst, data, True, order)
    for a, b in zip(ref, tst):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad), name


class _OwnW(torch.autograd.Function):
    """A node doing its own W (like a CUDA-graphed layer) on ``holder.own`` (a plain tensor, not a parameter):
    B returns the input gradient and queues the weight gradient through ``defer_weight_grad``; without a split B in
    progress it accumulates at once.  ``ORDER`` logs ``(kind, microbatch)``."""

    @staticmethod
    def forward(ctx, x, holder):
        ctx.save_for_backward(x)
        ctx.holder, ctx.mb = holder, holder.forwards
        holder.forwards += 1
        return x * holder.own

    @staticmethod
    def backward(ctx, grad):
        from engine.runtime.split_backward import defer_weight_grad
        (x,), holder, mb = ctx.saved_tensors, ctx.holder, ctx.mb

        def w():
            ORDER.append(("W", mb))
            g = (grad * x).sum((0, 1))
            holder.own_grad = g if holder.own_grad is None else holder.own_grad + g
        ORDER.append(("B", mb))
        if not defer_weight_grad(w):
            w()
        return grad * holder.own, None


ORDER: list = []


class OwnWChunk(MLPChunk):
    """``fc1`` (deferred in layer mode), a node doing its own W, ``fc2``."""

    def __init__(self):
        super().__init__()
        self.own, self.own_grad, self.forwards = torch.randn(2 * H), None, 0

    def forward(self, x):
        return self.fc2(_OwnW.apply(self.fc1(x), self)) + x


@pytest.mark.parametrize("mode", ["layer", "generic"])
def test_nodes_doing_their_own_w_are_queued_into_it_in_order(mode):
    """``defer_weight_grad``: outside a split B it declines (the node runs its W now); inside, the queued W runs in
    ``work.run()`` -- after every B, in microbatch order -- and every gradient equals the unsplit one."""
    from engine.runtime.split_backward import defer_weight_grad
    assert defer_weight_grad(lambda: None) is False
    torch.manual_seed(0)
    chunk = OwnWChunk()
    twin = copy.deepcopy(chunk)
    config = ModelParallelConfig()
    xs, gys = _data()
    ORDER.clear()
    _reference(twin, xs, gys, config, loss_stage=False)
    assert ORDER == [(k, m) for m in range(M) for k in "BW"]  # unsplit: each W right after its B
    ORDER.clear()
    _split(chunk, xs, gys, config, False, mode, True)
    assert ORDER == [("B", m) for m in range(M)] + [("W", m) for m in range(M)]
    assert torch.equal(chunk.own_grad, twin.own_grad)
    grads = [(p.grad, q.grad) for p, q in zip(chunk.parameters(), twin.parameters()) if q.grad is not None]
    assert len(grads) == 4 and all(torch.equal(a, b) for a, b in grads)  # fc1 and fc2 (ln is unused)


class BatchFirstChunk(MLPChunk):
    """A batch-first chunk: ``[s, b, h]`` in, transposed to ``[b, s, h]`` for its layers, transposed back out."""

    def forward(self, x):
        h = x.transpose(0, 1)  # [b, s, h]: its gradient flows back to x as a transposed (strided) view
        return self.fc2(F.gelu(self.ln(self.fc1(h)))).transpose(0, 1).contiguous()


@pytest.mark.parametrize("mode", ["generic", "layer"])
def test_input_gradient_of_a_transposing_chunk_is_made_sendable(mode):
    """Issue 26: B's input gradient of a batch-first chunk is autograd's strided view in generic mode; what the
    executor hands to P2P (``sendable_grad``) is contiguous and equal to the unsplit ``backward_step``'s, and the
    P2P message API refuses a strided tensor, naming its kind and the fix, before posting anything."""
    from engine.runtime.p2p import TAG_GRAD, P2PCommunicator, check_sendable
    from engine.runtime.step import sendable_grad
    torch.manual_seed(0)
    chunk, gy = BatchFirstChunk(), torch.randn(S, B, H)
    x = torch.randn(S, B, H, requires_grad=True)
    with weight_grad_deferral() if mode == "layer" else torch.enable_grad():
        y = chunk(x)
    gx, _ = backward_input_step(x, y, gy, ModelParallelConfig(), mode=mode)
    ref_x = x.detach().clone().requires_grad_(True)
    want = backward_step(ref_x, copy.deepcopy(chunk)(ref_x), gy, ModelParallelConfig())
    assert gx.is_contiguous() == (mode == "layer")  # generic B: autograd's raw gradient, a strided view
    sent = sendable_grad(gx)
    assert sent.is_contiguous() and torch.equal(sent, want)
    strided = want.transpose(0, 1).contiguous().transpose(0, 1)
    assert sendable_grad(strided).is_contiguous() and sendable_grad(None) is None
    with pytest.raises(ValueError, match=r"non-contiguous input gradient: shape \(5, 2, 8\).*tensor.contiguous\(\)"):
        check_sendable(strided, TAG_GRAD)
    comm = P2PCommunicator(None, ModelParallelConfig())
    with pytest.raises(ValueError, match="non-contiguous input gradient"):
        comm.post([(False, torch.empty(3), 1, TAG_GRAD), (True, strided, 1, TAG_GRAD)], batched=True)
