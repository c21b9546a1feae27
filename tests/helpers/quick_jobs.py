"""Rank functions of the quick loop's small multi-rank tests (``tests/runtime/test_quick_pipeline.py``,
``tests/training/test_quick_training.py``).

* :func:`pipeline_job`: on 2 gloo ranks, one ZB-V step against the single-process reference
  (:func:`tests.helpers.pipeline_jobs.run_case`), and the summation-order check of :func:`summation_order` under
  1F1B, interleaved 1F1B, ZB-H1 and ZB-V.
* :func:`resume_job`: a tiny training run straight through, and the same run cut in two by a checkpoint; the losses
  after the resume must equal the straight run's.
"""
from __future__ import annotations

import torch

from engine import schedules
from engine.model_parallel_config import ModelParallelConfig
from engine.plan import build_plan
from engine.runtime.process_groups import build_process_groups
from tests.helpers import models as tm
from tests.helpers.pipeline_jobs import case, run_case

# Per-microbatch loss scales: the microbatches' gradients differ by up to nine orders of magnitude, so a sum of them
# in another order than microbatch order differs in fp32 (checked by the job itself, see summation_order).  Scales
# far apart (1e-6 beside 1e6) would not do: the small terms vanish in either order.
SCALES = (1.0, 1e3, 1e-2, 1e5, 1e-4, 1e2)
SUMMATION_SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("zbv", 2), ("v_half", 2), ("v_min", 2),
                       ("zb cost-aware", 1), ("zbv cost-aware", 2))
COSTS = "forward=1.0 backward=1.4 weight=0.6 transfer=0.3 weight_memory=0.5"  # cost-aware: built for these
ZBV_CASE = case(schedule="zbv", chunks=2, M=4, dealloc=True)


def _scaled_forward_step(scales):
    """``forward_step_func`` whose loss for microbatch ``m`` is ``scales[m] * sum((y - target)^2)`` (2-tuple)."""
    def forward_step_func(data_iterator, model, checkpoint_activations_microbatch=None):
        item = next(data_iterator)
        out = model(item, checkpoint_activations_microbatch)

        def loss_func(output):
            raw = ((output.float() - item["target"].float()) ** 2).sum() * scales[item["mb"]]
            return raw, {"mb": item["mb"], "loss": raw.detach().clone()}
        return out, loss_func
    return forward_step_func


def in_order_grads(num_stages: int, data, scales, order) -> dict:
    """Plain autograd of the unsplit stack of ``num_stages`` layers (the same seeded parameters as the pipeline):
    one backward per microbatch, in ``order``, each accumulating ``scales[m] * loss_m / M`` into ``.grad``.
    Returns ``{global layer: (dW, db)}``."""
    cfg = ModelParallelConfig(pipeline_dtype=torch.float32, hidden_size=data[0]["x"].shape[-1])
    stack, _ = tm.build_chunks(cfg, 1, 0, num_stages)
    leaves = [(ch.decoder.layers[0].weight, ch.decoder.layers[0].bias) for ch in stack]
    M = len(data)
    for m in order:
        x = data[m]["x"]
        for w, b in leaves:
            x = torch.tanh(x @ w.t() + b)
        raw = ((x.float() - data[m]["target"].float()) ** 2).sum() * scales[m]
        (raw / M).backward()
    return {i: (w.grad.clone(), b.grad.clone()) for i, (w, b) in enumerate(leaves)}


def summation_order(rank: int, world: int, pgc, schedule: str, chunks: int, scales=SCALES) -> dict:
    """One training call of ``schedule`` on this rank with per-microbatch loss scales ``scales``; compares each
    model chunk's ``.grad`` bitwise with :func:`in_order_grads` in microbatch order.  Returns the layers whose
    gradients differ (``mismatch``: layer -> max |diff|) and those where the reversed order differs from microbatch
    order (``order_sensitive``), which must be non-empty for the comparison to mean anything."""
    M = len(scales)
    name, _, aware = schedule.partition(" ")
    plan = build_plan(name, world, M, chunks, costs=COSTS if aware else None)
    cfg = ModelParallelConfig(pipeline_model_parallel_size=world,
                              virtual_pipeline_model_parallel_size=chunks if name == "interleaved" else None,
                              pipeline_dtype=torch.float32, hidden_size=8)
    model, _ = tm.build_chunks(cfg, world, rank, chunks, stages=plan.stages_of(rank))
    data = tm.make_data(M, 4, 2, 8, seed=7)
    schedules.forward_backward_pipelining_with_schedule(
        schedule=plan, forward_step_func=_scaled_forward_step(scales), data_iterator=tm.iterators(data, chunks),
        model=model, num_microbatches=M, seq_length=4, micro_batch_size=2, forward_only=False, pg_collection=pgc,
        p2p_communicator=schedules.P2PCommunicator(pgc.pp, cfg))
    got = tm.chunk_grads(model)
    want = in_order_grads(world * chunks, data, scales, range(M))
    backwards = in_order_grads(world * chunks, data, scales, reversed(range(M)))
    mismatch, sensitive = {}, []
    for layer, tensors in got.items():
        diff = max((g - r).abs().max().item() for g, r in zip(tensors, want[layer]))
        if not all(torch.equal(g, r) for g, r in zip(tensors, want[layer])):
            mismatch[layer] = diff
        if not all(torch.equal(a, b) for a, b in zip(want[layer], backwards[layer])):
            sensitive.append(layer)
    return {"schedule": schedule, "rank": rank, "mismatch": mismatch, "order_sensitive": sensitive}


def pipeline_job(rank: int, world: int) -> dict:
    """The quick runtime checks on this rank: the ZB-V case's result and one summation-order result per
    schedule of :data:`SUMMATION_SCHEDULES`."""
    pgc = build_process_groups(world)
    zbv = run_case(rank, pgc, ZBV_CASE)
    return {"zbv": zbv, "sums": [summation_order(rank, world, pgc, s, c) for s, c in SUMMATION_SCHEDULES]}


# ---- training: a resume continues exactly -----------------------------------------------------------------------

RESUME_MODEL = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8)


def resume_overrides(run_dir: str, steps: int) -> list[str]:
    """A tiny run: 2 pipeline ranks, Adam with a constant LR (no warmup), ``steps`` steps, no evaluation."""
    values = {**{f"model.{k}": v for k, v in RESUME_MODEL.items()}, "data.max_bytes": 40_000,
              "parallel.pipeline": 2, "parallel.virtual": 1, "training.micro_batch_size": 2,
              "training.num_microbatches": 2, "training.steps": steps, "training.eval_interval": 0,
              "optimizer.lr": 1e-2, "optimizer.warmup_steps": 0, "checkpoint.interval": 0,
              "checkpoint.save_at_end": False, "logging.progress_bar": False, "logging.level": "WARNING",
              "logging.run_dir": run_dir}
    return [f"{k}={v}" for k, v in values.items()]


def _losses(trainer, steps: int) -> list:
    return [trainer.train_step()["loss"] for _ in range(steps)]


def resume_job(rank: int, world: int, run_dir: str, steps: int = 4, cut: int = 2) -> dict:
    """``steps`` steps straight; then a fresh run of ``cut`` steps that saves, and a third trainer that loads that
    checkpoint and runs the remaining steps.  Returns both loss lists (the loss rank's; ``None`` elsewhere)."""
    from engine import Trainer, load_config
    with Trainer(load_config(None, resume_overrides(f"{run_dir}/straight", steps))) as trainer:
        straight = _losses(trainer, steps)
    cut_config = load_config(None, resume_overrides(f"{run_dir}/cut", steps))
    with Trainer(cut_config) as trainer:
        first = _losses(trainer, cut)
        path = trainer.save()
    with Trainer(cut_config) as trainer:
        trainer.load(path)
        resumed_at = trainer.step
        rest = _losses(trainer, steps - cut)
    return {"rank": rank, "straight": straight, "resumed": first + rest, "resumed_at": resumed_at}
