"""The trainer's gradients against an independent reference: plain autograd of the mean token cross-entropy.

For each layout in :data:`LAYOUTS` (pp=1, pp=2 x vp=2, pp=2 x dp=2; a new schedule is one more entry, e.g.
``"pp2_zb_h1": dict(pipeline=2, schedule="zb_h1")``) a tiny GPT trains :data:`STEPS` steps with
``optimizer.grad_clip=0``.  Before every optimizer step each rank records, under the layout-independent
(canonical) parameter names, every parameter and its ``.grad``, and every model chunk records the tokens (first
stage) and labels (last stage) it was given.  The reference -- :func:`reference_loss`, a forward of the GPT written
here from the parameters alone (own attention, no trainer, schedule or model code) -- takes the mean token
cross-entropy over the whole global batch (every microbatch of every data-parallel replica) and backpropagates it
with ``torch.autograd.grad``.  Checked:

* every gradient on every rank (both copies of the tied embedding, every data-parallel replica) equals the
  reference's (fp32: max |diff| / max |ref| <= :data:`TOL`) at every step, so the second step also catches
  gradients kept from the first;
* the reported loss equals the reference loss; the reported ``grad_norm`` equals
  ``torch.nn.utils.get_total_norm`` of the reference gradients and is the same in every layout;
* every layout trains on the same global batch.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.training.config import load_config
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.slow  # three trainer runs, two of them spawned (2 and 4 ranks)

STEPS = 2
TOL = 5e-6  # fp32; the measured worst case (printed by test_grads_equal_plain_autograd) is below 1e-6
MODEL = dict(num_layers=4, hidden_size=16, num_attention_heads=2, seq_length=8)

# name -> parallel.* overrides; one spawned job per world size (pipeline x data) runs all layouts of that size
LAYOUTS = {
    "pp1": dict(pipeline=1),
    "pp2_vp2": dict(pipeline=2, virtual=2),
    "pp2_dp2": dict(pipeline=2, data=2),
}
GLOBAL_MICROBATCHES = 4


def world_of(parallel: dict) -> int:
    return parallel.get("pipeline", 1) * parallel.get("data", 1)


def overrides(parallel: dict, run_dir) -> dict:
    return {**{f"model.{k}": v for k, v in MODEL.items()}, "data.max_bytes": 50_000,
            "training.micro_batch_size": 2, "training.num_microbatches": GLOBAL_MICROBATCHES // parallel.get("data", 1),
            "training.steps": STEPS, "training.eval_interval": 0, "optimizer.grad_clip": 0.0,
            "optimizer.lr": 1e-2, "optimizer.warmup_steps": 0, "logging.progress_bar": False,
            "logging.level": "WARNING", "logging.run_dir": str(run_dir),
            **{f"parallel.{k}": v for k, v in parallel.items()}}


# ---- rank side ----------------------------------------------------------------------------------------------------

def _record_inputs(chunk, seen: dict) -> None:
    """Wrap ``chunk.forward`` to append the tokens / labels it receives to ``seen``."""
    original = chunk.forward

    def forward(tokens=None, labels=None):
        if chunk.is_first and tokens is not None:
            seen["tokens"].append(_array(tokens))
        if chunk.is_last and labels is not None:
            seen["labels"].append(_array(labels))
        return original(tokens, labels)

    chunk.forward = forward


def _array(t):
    """A numpy copy (tensors sent through the result queue would travel as shared memory of an exiting process)."""
    return None if t is None else t.detach().cpu().numpy().copy()


def _record_grads(trainer, steps: list) -> None:
    """Record ``{name: (param, grad)}`` (numpy) before each optimizer update (a step pre-hook)."""

    def hook(optimizer, args, kwargs):
        named = trainer.canonical.named_parameters(remove_duplicate=False)
        steps.append({"params": {n: (_array(p), _array(p.grad)) for n, p in named}})

    trainer.optimizer.register_step_pre_hook(hook)


def recorded_step(trainer, steps: list) -> dict:
    """One training step of ``trainer`` (whose optimizer :func:`_record_grads` into ``steps``), adding to its record
    the inputs the chunks read, the loss, grad norm and ranks; returns the step's metrics."""
    seen = {"tokens": [], "labels": []}
    for chunk in trainer.model:
        _record_inputs(chunk, seen)
    metrics = trainer.train_step()
    for chunk in trainer.model:
        del chunk.forward  # back to the class method before the next wrap
    steps[-1].update(seen, loss=metrics["loss"], grad_norm=metrics["grad_norm"], pp_rank=trainer.pp_rank,
                     dp_rank=trainer.dp_rank)
    return metrics


def train_and_record(rank, world, parallel: dict, run_dir) -> dict:
    """Run :data:`STEPS` steps of ``parallel``'s layout; per step the recorded parameters, grads, inputs, metrics."""
    from engine import Trainer
    config = load_config(None, overrides(parallel, run_dir))
    steps: list = []
    with Trainer(config) as trainer:
        _record_grads(trainer, steps)
        for _ in range(STEPS):
            recorded_step(trainer, steps)
    return {"steps": steps}


def _train_world(rank, world, layouts: dict, run_dir) -> dict:
    return {name: train_and_record(rank, world, p, f"{run_dir}/{name}") for name, p in layouts.items()}


# ---- the independent reference ------------------------------------------------------------------------------------

def _block(x, p: dict, i: int, heads: int, eps: float):
    """Pre-norm block on ``[b, s, h]``: causal softmax attention written out, GELU MLP."""
    def w(name):
        return p[f"layers.{i}.{name}"]
    b, s, h = x.shape
    d = h // heads
    y = F.layer_norm(x, (h,), w("ln1.weight"), w("ln1.bias"), eps)
    qkv = (y @ w("qkv.weight").t() + w("qkv.bias")).view(b, s, 3, heads, d)
    q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))  # [b, nh, s, d]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v  # [b, nh, s, d]
    x = x + attn.transpose(1, 2).reshape(b, s, h) @ w("proj.weight").t() + w("proj.bias")
    y = F.layer_norm(x, (h,), w("ln2.weight"), w("ln2.bias"), eps)
    hidden = F.gelu(y @ w("fc1.weight").t() + w("fc1.bias"))
    return x + hidden @ w("fc2.weight").t() + w("fc2.bias")


def reference_loss(p: dict, tokens: torch.Tensor, labels: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Mean token cross-entropy (nats) of the GPT with parameters ``p`` (canonical names) on ``tokens`` /
    ``labels`` ``[N, s]``; tied input / output embedding ``embedding.word.weight`` ``[V, h]``."""
    wte = p["embedding.word.weight"]
    x = wte[tokens] + p["embedding.pos.weight"][: tokens.shape[1]]  # [N, s, h]
    for i in range(MODEL["num_layers"]):
        x = _block(x, p, i, MODEL["num_attention_heads"], eps)
    x = F.layer_norm(x, (x.shape[-1],), p["final_norm.weight"], p["final_norm.bias"], eps)
    logits = x @ wte.t()  # [N, s, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def global_batch(per_rank_steps: list, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[N, s]`` tokens and labels of one step over all data-parallel replicas, replica by replica."""
    rows = [s[step] for s in per_rank_steps]
    tokens = {r["dp_rank"]: torch.cat([torch.from_numpy(t) for t in r["tokens"]]) for r in rows if r["tokens"]}
    labels = {r["dp_rank"]: torch.cat([torch.from_numpy(t) for t in r["labels"]]) for r in rows if r["labels"]}
    assert sorted(tokens) == sorted(labels), "every data-parallel replica reads tokens and labels"
    return torch.cat([tokens[d] for d in sorted(tokens)]), torch.cat([labels[d] for d in sorted(labels)])


def recorded_leaves(per_rank_steps: list, step: int) -> dict:
    """``{name: leaf tensor}``: the full parameters the ranks recorded at ``step`` (each name from its first
    holder), as fresh autograd leaves for a reference."""
    params = {}
    for s in per_rank_steps:
        for name, (value, _) in s[step]["params"].items():
            params.setdefault(name, value)
    return {n: torch.from_numpy(v).clone().requires_grad_() for n, v in params.items()}


def reference_grads(per_rank_steps: list, step: int):
    """``(loss, {name: grad}, tokens)`` of the reference at ``step``, from the parameters the ranks recorded."""
    leaves = recorded_leaves(per_rank_steps, step)
    tokens, labels = global_batch(per_rank_steps, step)
    loss = reference_loss(leaves, tokens, labels)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.item(), dict(zip(leaves, grads)), tokens


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# ---- fixtures and tests -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """name -> per-rank results; pp=1 in this process, one spawned job per larger world size."""
    out = {}
    by_world: dict = {}
    for name, parallel in LAYOUTS.items():
        by_world.setdefault(world_of(parallel), {})[name] = parallel
    for world, layouts in sorted(by_world.items()):
        run_dir = tmp_path_factory.mktemp(f"world{world}")
        if world == 1:
            per_rank = [_train_world(0, 1, layouts, run_dir)]
        else:
            per_rank = run_ranks(_train_world, world, layouts, run_dir, timeout=110)
        for name in layouts:
            out[name] = [r[name]["steps"] for r in per_rank]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_grads_equal_plain_autograd(runs, layout):
    per_rank = runs[layout]
    worst = 0.0
    for step in range(STEPS):
        loss, grads, _ = reference_grads(per_rank, step)
        for steps in per_rank:
            r = steps[step]
            where = f"{layout} step {step} pp_rank {r['pp_rank']} dp_rank {r['dp_rank']}"
            assert r["loss"] == pytest.approx(loss, rel=1e-6, abs=0), where
            for name, (_, grad) in r["params"].items():
                assert grad is not None, f"{where}: {name} has no gradient"
                err = max_rel_error(torch.from_numpy(grad), grads[name])
                assert err <= TOL, f"{where}: {name} gradient differs from plain autograd by {err:.3g} (relative)"
                worst = max(worst, err)
            assert r["grad_norm"] == pytest.approx(torch.nn.utils.get_total_norm(list(grads.values())).item(),
                                                   rel=1e-5), where
    print(f"{layout}: largest relative gradient error against plain autograd {worst:.3g}")


@pytest.mark.timeout(120)
def test_grad_norms_agree_across_layouts(runs):
    """The same global batch and the same ``grad_norm`` in every layout (and on every rank of a layout)."""
    first = next(iter(LAYOUTS))
    for step in range(STEPS):
        want_tokens = global_batch(runs[first], step)[0]
        norms = {}
        for name, per_rank in runs.items():
            assert torch.equal(global_batch(per_rank, step)[0], want_tokens), f"{name}: another global batch"
            values = {s[step]["grad_norm"] for s in per_rank}
            assert len(values) == 1, f"{name} step {step}: ranks report different grad norms {values}"
            norms[name] = values.pop()
        spread = max(norms.values()) - min(norms.values())
        assert spread <= 1e-5 * max(norms.values()), f"step {step}: grad norms {norms}"
        print(f"step {step}: grad norms {norms}")
