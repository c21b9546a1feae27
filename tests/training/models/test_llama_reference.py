"""The llama family under every schedule against an independent reference: plain autograd of a Llama forward
written here (RMSNorm, rotary on pairs ``(j, j + d/2)``, grouped-query attention by repeating key / value heads,
SwiGLU), from the recorded parameters alone -- as tests/training/test_trainer_reference.py does for gpt2.

Layouts: pp=1 (in this process), and on 2 gloo ranks 1F1B, interleaved (pp=2 x vp=2), zb_h1, zbv, zb, dualpipev, a
tied head under 1F1B, and emulated CUDA graphs under interleaved, zbv and dualpipev.  Checked at every step: each
gradient on every rank equals the reference (fp32, relative :data:`TOL`), the reported loss equals the reference
loss; zb_h1, zbv and dualpipev give *bitwise* the gradients of the schedule with the same model chunks and the same
per-parameter accumulation order (zb_h1 = 1F1B, zbv = interleaved, dualpipev = zbv: each chunk's weight gradients
summed in microbatch order; ``zb`` runs its W passes in another order, so it is checked against the reference
only), and emulated graphs give bitwise the eager losses and gradients.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.training.config import load_config
from tests.helpers.distributed import run_ranks
from tests.training.test_trainer_reference import (
    _record_grads, global_batch, max_rel_error, recorded_leaves, recorded_step)

pytestmark = pytest.mark.slow  # one 2-rank job of eight short trainer runs

STEPS = 2
TOL = 5e-6
THETA = 500.0  # not the default: a rotary base that is not applied shows
MODEL = dict(family="llama", num_layers=4, hidden_size=16, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=24, seq_length=8, tie_embeddings=False, rope_theta=THETA)
GRAPHS = {"cuda_graphs.enabled": True, "cuda_graphs.backend": "emulate", "cuda_graphs.warmup_steps": 1}
LAYOUTS = {  # name -> overrides
    "pp1": {"parallel.pipeline": 1},
    "1f1b": {"parallel.pipeline": 2, "parallel.schedule": "1f1b"},
    "interleaved": {"parallel.pipeline": 2, "parallel.virtual": 2},
    "zb_h1": {"parallel.pipeline": 2, "parallel.schedule": "zb_h1"},
    "zbv": {"parallel.pipeline": 2, "parallel.virtual": 2, "parallel.schedule": "zbv"},
    "zb": {"parallel.pipeline": 2, "parallel.schedule": "zb"},
    "1f1b_tied": {"parallel.pipeline": 2, "parallel.schedule": "1f1b", "model.tie_embeddings": True},
    "interleaved_graphs": {"parallel.pipeline": 2, "parallel.virtual": 2, **GRAPHS},
    "zbv_graphs": {"parallel.pipeline": 2, "parallel.virtual": 2, "parallel.schedule": "zbv", **GRAPHS},
    "dualpipev": {"parallel.pipeline": 2, "parallel.virtual": 2, "parallel.schedule": "dualpipev"},
    "dualpipev_graphs": {"parallel.pipeline": 2, "parallel.virtual": 2, "parallel.schedule": "dualpipev", **GRAPHS},
}
BITWISE = {"zb_h1": "1f1b", "zb": "1f1b", "zbv": "interleaved", "interleaved_graphs": "interleaved",
           "zbv_graphs": "zbv", "dualpipev": "zbv", "dualpipev_graphs": "dualpipev"}


def overrides(layout: dict, run_dir) -> dict:
    return {**{f"model.{k}": v for k, v in MODEL.items()}, "data.max_bytes": 50_000,
            "training.micro_batch_size": 2, "training.num_microbatches": 4, "training.steps": STEPS,
            "training.eval_interval": 0, "optimizer.grad_clip": 0.0, "optimizer.lr": 1e-2,
            "optimizer.warmup_steps": 0, "logging.progress_bar": False, "logging.level": "WARNING",
            "logging.run_dir": str(run_dir), **layout}


def _train(name: str, run_dir) -> dict:
    from engine import Trainer
    config = load_config(None, overrides(LAYOUTS[name], f"{run_dir}/{name}"))
    steps: list = []
    with Trainer(config) as trainer:
        _record_grads(trainer, steps)
        graphed = []
        for _ in range(STEPS):
            recorded_step(trainer, steps)
            runtime = getattr(trainer, "_graphs", None)
            graphed.append(bool(runtime is not None and runtime.active))
        if getattr(trainer, "_graphs", None) is not None:
            trainer._graphs.close()
            trainer._graphs = None
    return {"steps": steps, "graphed": graphed}


def _job(rank, world, names, run_dir) -> dict:
    return {name: _train(name, run_dir) for name in names}


# ---- the independent reference ------------------------------------------------------------------------------------

def _rms(x, w, eps=1e-5):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, theta: float):
    """``[b, n, s, d]``: pair ``(j, j + d/2)`` at position ``p`` turned by ``p * theta^(-2j/d)``."""
    d = x.shape[-1]
    half = d // 2
    freq = torch.tensor([theta ** (-2.0 * j / d) for j in range(half)], dtype=torch.float64)
    angle = (torch.arange(x.shape[2], dtype=torch.float64)[:, None] * freq[None]).float()  # [s, d/2]
    c, s = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


def attention_residual(x, p: dict, i: int, model: dict, theta: float):
    """``x + attention(rms(x))`` of layer ``i`` (grouped-query, rotary, causal) from the parameters ``p``;
    ``x`` ``[b, s, h]``."""
    def w(name):
        return p[f"layers.{i}.{name}"]
    b, s, h = x.shape
    heads, groups = model["num_attention_heads"], model["num_query_groups"]
    d = h // heads
    y = _rms(x, w("input_layernorm.weight"))
    q = (y @ w("self_attn.q_proj.weight").t()).view(b, s, heads, d).transpose(1, 2)
    k = (y @ w("self_attn.k_proj.weight").t()).view(b, s, groups, d).transpose(1, 2)
    v = (y @ w("self_attn.v_proj.weight").t()).view(b, s, groups, d).transpose(1, 2)
    q, k = _rotate(q, theta), _rotate(k, theta)
    k, v = k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    return x + attn.transpose(1, 2).reshape(b, s, h) @ w("self_attn.o_proj.weight").t()


def _block(x, p: dict, i: int):
    def w(name):
        return p[f"layers.{i}.{name}"]
    x = attention_residual(x, p, i, MODEL, THETA)
    y = _rms(x, w("post_attention_layernorm.weight"))
    gate, up = y @ w("mlp.gate_proj.weight").t(), y @ w("mlp.up_proj.weight").t()
    return x + (gate * torch.sigmoid(gate) * up) @ w("mlp.down_proj.weight").t()


def reference_loss(p: dict, tokens, labels):
    x = p["embedding.word.weight"][tokens]
    for i in range(MODEL["num_layers"]):
        x = _block(x, p, i)
    head = p.get("output_head.word.weight", p["embedding.word.weight"])
    logits = _rms(x, p["final_norm.weight"]) @ head.t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _reference(per_rank: list, step: int):
    leaves = recorded_leaves(per_rank, step)
    tokens, labels = global_batch(per_rank, step)
    loss = reference_loss(leaves, tokens, labels)
    return loss.item(), dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("llama")
    out = {"pp1": [_train("pp1", run_dir)]}
    names = [n for n in LAYOUTS if n != "pp1"]
    per_rank = run_ranks(_job, 2, names, run_dir, timeout=170)
    out.update({n: [r[n] for r in per_rank] for n in names})
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_grads_equal_plain_autograd(runs, layout):
    per_rank = [r["steps"] for r in runs[layout]]
    worst = 0.0
    for step in range(STEPS):
        loss, grads = _reference(per_rank, step)
        for steps in per_rank:
            r = steps[step]
            where = f"{layout} step {step} pp_rank {r['pp_rank']}"
            assert r["loss"] == pytest.approx(loss, rel=1e-6, abs=0), where
            for name, (_, grad) in r["params"].items():
                assert grad is not None, f"{where}: {name} has no gradient"
                err = max_rel_error(torch.from_numpy(grad), grads[name])
                assert err <= TOL, f"{where}: {name} gradient differs from plain autograd by {err:.3g} (relative)"
                worst = max(worst, err)
    print(f"{layout}: loss {per_rank[0][0]['loss']:.6f}, largest relative gradient error {worst:.3g}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", sorted(BITWISE))
def test_llama_split_backward_and_graphs_are_bitwise(runs, layout):
    """Split backward (B now, W later; RMSNorm's weight deferred like LayerNorm's) and emulated CUDA graphs give
    bitwise the gradients and losses of the run they mirror."""
    base = BITWISE[layout]
    if layout.endswith("_graphs"):
        assert all(r["graphed"] == [False] + [True] * (STEPS - 1) for r in runs[layout]), runs[layout][0]["graphed"]
    for step in range(STEPS):
        got, want = _by_name(runs[layout], step), _by_name(runs[base], step)
        assert got.keys() == want.keys()
        for name, (loss, grad) in got.items():
            assert loss == want[name][0], (layout, step)
            assert np.array_equal(grad, want[name][1]), f"{layout} step {step}: {name} is not bitwise {base}'s"


def _by_name(per_rank: list, step: int) -> dict:
    """``{canonical name (+ the rank holding it when it is a tied copy): (loss, grad)}`` over all ranks of a run
    (the placements differ: zbv holds stages 0 and 3 on rank 0, interleaved stages 0 and 2)."""
    out = {}
    for r in per_rank:
        s = r["steps"][step]
        for name, (_, grad) in s["params"].items():
            key = name if name not in out else f"{name}@{s['pp_rank']}"
            out[key] = (s["loss"], grad)
    return out
