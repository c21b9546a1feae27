"""A plain reference for mixture-of-experts layers, written apart from ``engine.moe``: one token at a time.

Each token is routed by itself (a dot product per expert, softmax or sigmoid by hand, the top-k by sorting with
ties to the lower index, the capacity rule by counting in token order); each chosen expert's SwiGLU is three
matrix-vector products; the outputs are summed in slot order.  The load-balancing loss is the Switch Transformer
formula written out (``engine.moe.router`` cites it).  Only the weights are read from the layer.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["reference", "expert"]


def _route_token(logits, k, score, normalize, bias):
    """(slots [(expert, prob)], full distribution) of one token, by hand."""
    if score == "softmax":
        m = max(logits.tolist())
        ex = [torch.exp(v - m) for v in logits]
        total = sum(ex)
        scores = [e / total for e in ex]
        chooser = [s.item() for s in scores]
        balance = scores
    else:
        scores = [1 / (1 + torch.exp(-v)) for v in logits]
        chooser = [s.item() + (0.0 if bias is None else bias[i].item()) for i, s in enumerate(scores)]
        total = sum(scores)
        balance = [s / total for s in scores]
    chosen = sorted(range(len(scores)), key=lambda e: (-chooser[e], e))[:k]
    probs = [scores[e] for e in chosen]
    if (score == "sigmoid" or normalize) and k > 1:
        z = sum(probs)
        probs = [p / z for p in probs]
    return list(zip(chosen, probs)), balance


def expert(x, e):
    """``down @ (silu(gate @ x) * (up @ x))`` for one token ``x`` ``[h]`` and a SwiGLU module ``e``."""
    return e.down_proj.weight @ (F.silu(e.gate_proj.weight @ x) * (e.up_proj.weight @ x))


def reference(layer, x: torch.Tensor, *, k, score="softmax", normalize=True, coeff=0.0, capacity=None,
              experts=None):
    """Naive forward of an ``engine.moe.MoELayer``'s weights on ``x`` ``[n, h]``: ``(out [n, h], aux loss, tokens
    per expert)``.  ``experts``: the SwiGLU modules of all experts in global order (default: the layer's own)."""
    E = layer.num_experts
    W = layer.router.linear.weight
    bias = layer.router.expert_bias
    experts = list(layer.experts.local) if experts is None else experts
    routed, balances = [], []
    for t in range(x.shape[0]):
        logits = torch.stack([torch.dot(W[e], x[t]) for e in range(E)])
        slots, balance = _route_token(logits, k, score, normalize, bias)
        routed.append(slots)
        balances.append(balance)
    counts = [sum(1 for slots in routed for e, _ in slots if e == i) for i in range(E)]
    limit = math.ceil(capacity * x.shape[0] * k / E) if capacity is not None else None
    seen, kept = [0] * E, [0] * E
    outs = []
    for t, slots in enumerate(routed):
        y = torch.zeros_like(x[t])
        for e, p in slots:
            seen[e] += 1
            if limit is None or seen[e] <= limit:
                kept[e] += 1
                y = y + p * expert(x[t], experts[e])
        if layer.shared_experts is not None:
            y = y + expert(x[t], layer.shared_experts)
        outs.append(y)
    T = x.shape[0]
    aux = coeff * E / (k * T * T) * sum(sum(b[e] for b in balances) * counts[e] for e in range(E))
    return torch.stack(outs), aux, kept
