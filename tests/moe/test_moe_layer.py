"""The MoE layer on one rank against a plain reference written here: a per-token loop over the chosen experts.

The reference routes each token by itself (softmax or sigmoid scores from a dot product per expert, the top-k by
sorting, the capacity rule by counting), runs each chosen expert's SwiGLU as three matrix-vector products and
sums the outputs in slot order; its load-balancing loss is written from the Switch Transformer formula.  Outputs
and the gradients of the input and of every parameter must agree (fp32).  Also: routing everything to one expert
stays dropless; the auxiliary loss's gradient at the router under a pipeline loss scale equals the analytic one;
bad settings are refused.
"""
from __future__ import annotations

import pytest
import torch

from engine.model_parallel_config import ModelParallelConfig
from engine.moe import MoELayer
from engine.schedules import forward_backward_no_pipelining
from tests.helpers.moe_reference import reference

TOL = 2e-6


def _grads(module, x):
    out = {"x": x.grad.clone()}
    for name, p in module.named_parameters():
        out[name] = torch.zeros_like(p) if p.grad is None else p.grad.clone()
    return out


CASES = [
    dict(k=2, score="softmax", normalize=True, coeff=0.0, shared_ffn=0),
    dict(k=1, score="softmax", normalize=False, coeff=0.05, shared_ffn=6),
    dict(k=3, score="softmax", normalize=False, coeff=0.1, shared_ffn=0),
    dict(k=2, score="sigmoid", normalize=True, coeff=0.02, shared_ffn=4, bias=True),
    dict(k=2, score="softmax", normalize=True, coeff=0.0, shared_ffn=0, capacity=0.5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_moe_layer_equals_per_token_reference(case, one_thread):
    torch.manual_seed(3)
    h, E = 8, 6
    opts = dict(score_function=case["score"], normalize_top_k=case["normalize"], aux_loss_coeff=case["coeff"],
                capacity_factor=case.get("capacity"), expert_bias=case.get("bias", False))
    layer = MoELayer(h, 12, E, case["k"], shared_ffn_hidden_size=case["shared_ffn"], **opts)
    if case.get("bias"):
        layer.router.expert_bias.copy_(torch.randn(E) * 0.3)
    x = torch.randn(5, 3, h)
    w = torch.randn(5, 3, h)
    x1 = x.clone().requires_grad_()
    (layer(x1) * w).sum().backward()
    got = _grads(layer, x1)
    out = layer(x.clone()).detach()
    stats = layer.router.stats()
    layer.zero_grad(set_to_none=True)
    x2 = x.reshape(-1, h).clone().requires_grad_()
    want, aux, kept = reference(layer, x2, k=case["k"], score=case["score"], normalize=case["normalize"],
                                coeff=case["coeff"], capacity=case.get("capacity"))
    ((want * w.reshape(-1, h)).sum() + aux).backward()
    ref = _grads(layer, x2)
    ref["x"] = ref["x"].view_as(x)
    torch.testing.assert_close(out, want.detach().view_as(x), rtol=TOL, atol=TOL)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=TOL, atol=TOL, msg=name)
    assert stats.tokens_per_expert.tolist() == [2 * c for c in kept] and stats.forwards == 2  # two forwards
    if case["coeff"]:
        assert stats.aux_loss.item() == pytest.approx(2 * float(aux.detach()), rel=1e-5)


def test_all_tokens_to_one_expert_stay_dropless(one_thread):
    """Routing every token to expert 2 (a router that scores it far above the rest): every token is processed."""
    torch.manual_seed(0)
    h, E, n = 6, 4, 10
    layer = MoELayer(h, 8, E, 1)
    with torch.no_grad():
        layer.router.linear.weight.fill_(-1.0)
        layer.router.linear.weight[2].fill_(1.0)
    x = torch.rand(n, h) + 0.5  # positive: expert 2 always wins
    out = layer(x)
    assert layer.router.stats().tokens_per_expert.tolist() == [0, 0, n, 0]
    want, _, kept = reference(layer, x, k=1)
    torch.testing.assert_close(out, want, rtol=TOL, atol=TOL)
    assert kept == [0, 0, n, 0] and bool((out.abs().sum(1) > 0).all())


def test_capacity_drops_late_tokens_of_a_full_expert(one_thread):
    torch.manual_seed(0)
    layer = MoELayer(6, 8, 4, 1, capacity_factor=1.0)
    with torch.no_grad():
        layer.router.linear.weight.fill_(-1.0)
        layer.router.linear.weight[1].fill_(1.0)
    x = torch.rand(8, 6) + 0.5
    out = layer(x)
    assert layer.router.stats().tokens_per_expert.tolist() == [0, 2, 0, 0]  # capacity ceil(1.0 * 8 / 4) = 2
    assert bool((out[:2].abs().sum(1) > 0).all()) and bool((out[2:] == 0).all())


class _Chunk(torch.nn.Module):
    def __init__(self, layer, config):
        super().__init__()
        self.layer, self.config = layer, config

    def set_input_tensor(self, tensors):
        pass

    def forward(self, x):
        return self.layer(x)


def test_aux_loss_gradient_at_the_router_follows_the_pipeline_loss_scale(one_thread):
    """Through the schedule (grad_scale_func S, M microbatches, the main loss contributing nothing): the router's
    weight gradient is sum over microbatches of (S / M) * d aux / d W, written out from the softmax Jacobian."""
    torch.manual_seed(1)
    h, E, k, M, S, coeff = 5, 4, 2, 3, 8.0, 0.3
    layer = MoELayer(h, 6, E, k, aux_loss_coeff=coeff)
    config = ModelParallelConfig(num_moe_experts=E, grad_scale_func=lambda loss: loss * S)
    chunk = _Chunk(layer, config)
    data = [torch.randn(7, h) for _ in range(M)]

    def step(it, model):
        out = model(next(it))
        return out, lambda y: ((y * 0).sum(), {"loss": (y * 0).sum().detach()})

    forward_backward_no_pipelining(forward_step_func=step, data_iterator=iter(data), model=chunk,
                                   num_microbatches=M, seq_length=7, micro_batch_size=1)
    want = torch.zeros(E, h)
    W = layer.router.linear.weight.detach()
    for x in data:
        p = torch.softmax(x @ W.t(), -1)  # [T, E]
        counts = torch.bincount(torch.topk(p, k, -1).indices.reshape(-1), minlength=E).float()
        g = coeff * E / (k * x.shape[0] ** 2) * counts  # d aux / d p_te (the same for every token)
        dz = p * (g - (p * g).sum(-1, keepdim=True))  # softmax Jacobian
        want += (S / M) * dz.t() @ x
    torch.testing.assert_close(layer.router.linear.weight.grad, want, rtol=1e-5, atol=1e-7)
    assert layer.experts.local[0].gate_proj.weight.grad.abs().max() == 0  # the main loss gave nothing


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=5), "top_k=5"), (dict(top_k=0), "top_k=0"), (dict(expert_bias=True), "sigmoid"),
    (dict(score_function="relu"), "score_function"), (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(aux_loss_coeff=-1.0), "aux_loss_coeff")])
def test_bad_router_settings_are_refused(kwargs, match):
    args = dict(top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MoELayer(4, 4, 4, args.pop("top_k"), **args)


def test_update_expert_bias_moves_towards_balance():
    layer = MoELayer(4, 4, 4, 1, score_function="sigmoid", expert_bias=True)
    layer.router.update_expert_bias(0.5, torch.tensor([10, 0, 2, 4]))
    assert layer.router.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.0]  # mean load 4: expert 3 is balanced
    with pytest.raises(ValueError, match="expert bias"):
        MoELayer(4, 4, 4, 1).router.update_expert_bias(0.1)
