"""A training step that logs nothing makes no host sync on pipecast's side, and a NaN / inf step is skipped on the
device on every rank and stops the run at the next step the host reads.

* :class:`engine.profiling.host_syncs.HostSyncCounter` counts every kind it names (and not the non-blocking copy);
* one rank (pipeline 1, torch's fused AdamW) and four gloo ranks (pipeline 2 x data 2, ``shard: optimizer``: the
  loss's data-parallel all-reduce and pipeline broadcast, ZeRO-1's inner AdamW): every step after the first (the
  first agrees on the schedule call) counts 0 host syncs, in the step and in the loop's bookkeeping after it; the
  same step with a planted ``.item()`` counts 1, named at the planted line;
* on the four ranks a NaN loss injected at step ``K`` (the last stage's per-token losses of that step only, so no
  parameter is touched) with ``logging.log_interval`` ``LOG``: every rank raises today's ``NonFiniteLossError``
  naming step ``K`` at step ``LOG``, its parameters and optimizer state are bitwise those after step ``K - 1``
  (steps ``K`` .. ``LOG`` applied nothing), and its trainer is back at step ``K - 1``.
"""
from __future__ import annotations

import pytest
import torch

from engine.profiling.host_syncs import count_host_syncs
from engine.training.config import load_config
from tests.helpers.distributed import run_ranks

K, LOG = 3, 4  # the poisoned step and the next logged step (log_interval)


def _overrides(run_dir, log_interval=LOG, **parallel) -> dict:
    return {"model.num_layers": 4, "model.hidden_size": 16, "model.num_attention_heads": 2, "model.seq_length": 8,
            "data.max_bytes": 40_000, "training.micro_batch_size": 2, "training.num_microbatches": 2,
            "training.steps": 8, "training.eval_interval": 0, "checkpoint.interval": 0,
            "checkpoint.save_at_end": False, "logging.log_interval": log_interval, "logging.progress_bar": False,
            "logging.level": "WARNING", "logging.run_dir": str(run_dir),
            **{f"parallel.{k}": v for k, v in parallel.items()}}


def test_the_counter_counts_every_kind_of_host_read():
    t = torch.ones(3)
    with count_host_syncs() as counter:
        t.sum().item()
        float(t[0]), int(t[0]), bool(t[0] > 0), f"{t[0]:.1f}"
        t.tolist()
        t.cpu(), t.to("cpu")
        torch.tensor([1.0], device="cpu")
        torch.cuda.synchronize() if torch.cuda.is_available() else counter.record("synchronize")
        t.to("cpu", non_blocking=True), t.to(torch.float64), t * 2  # not host reads
    assert dict(counter.counts) == {"item": 1, "float": 1, "int": 1, "bool": 1, "format": 1, "tolist": 1,
                                    "to_host": 2, "to_device": 1, "synchronize": 1}, counter.counts


def _step_syncs(trainer, steps: int, plant: bool = False) -> list[dict]:
    """The host syncs of each of ``steps`` loop iterations (the step, then the loop's bookkeeping after it, which
    reads nothing before the log interval), as ``{kind: count}``; ``plant``: a ``.item()`` in the step."""
    if plant:
        clip = trainer.parallelism.clip_grad_norm_
        trainer.parallelism.clip_grad_norm_ = lambda max_norm: (lambda n: (n.item(), n)[1])(clip(max_norm))
    counts = []
    for _ in range(steps):
        with count_host_syncs() as counter:
            trainer.step_on_device()
            assert trainer._after_step(trainer.config.training.steps, None) is False
        counts.append({k: v for k, v in counter.counts.items() if v})
    if plant:
        counts.append(dict(counter.where))
        del trainer.parallelism.clip_grad_norm_
    return counts


def test_a_step_that_logs_nothing_makes_no_host_sync(tmp_path):
    from engine import Trainer
    with Trainer(load_config(None, _overrides(tmp_path, log_interval=10))) as trainer:
        trainer.step_on_device()  # the first step: the schedule call's agreement (a group of one: none)
        assert _step_syncs(trainer, 2) == [{}, {}]
        *planted, where = _step_syncs(trainer, 1, plant=True)
        assert planted == [{"item": 1}] and where["item"][0].split("/")[-1].startswith("trainer.py:"), where
        trainer.read_pending()
        assert [m["step"] for m in trainer.history] == [1, 2, 3, 4]


def _state(trainer) -> dict:
    """Every parameter and optimizer state tensor of this rank (clones), by position."""
    params = {f"p{i}": p.detach().clone() for i, p in enumerate(trainer.parallelism.parameters())}
    opt = trainer.optimizer.inner if hasattr(trainer.optimizer, "inner") else trainer.optimizer
    moments = {f"o{i}.{k}": v.detach().clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    return {**params, **moments}


def _poison_step(trainer, step: int) -> None:
    """The last stage's per-token losses become NaN during step ``step`` only (parameters untouched)."""
    for chunk in trainer.model:
        if chunk.is_last:
            chunk.forward = lambda *a, _f=chunk.forward, **kw: _f(*a, **kw) * (
                float("nan") if trainer.step == step - 1 else 1.0)


def _nan_job(rank: int, world: int, run_dir: str) -> dict:
    from engine import Trainer
    from engine.training.trainer import NonFiniteLossError
    with Trainer(load_config(None, _overrides(run_dir, pipeline=2, data=2, shard="optimizer"))) as trainer:
        trainer.step_on_device()  # step 1: the schedule call's agreement reads the gathered fingerprints
        syncs = _step_syncs(trainer, 1)
        before_k = _state(trainer)  # after step K - 1 = 2
        _poison_step(trainer, K)
        try:
            trainer.train()
            error = None
        except NonFiniteLossError as exc:
            error = str(exc)
        after = _state(trainer)
        return {"syncs": syncs, "error": error, "step": trainer.step,
                "unchanged": sorted(k for k in before_k if torch.equal(before_k[k], after[k])),
                "keys": sorted(before_k), "steps_read": [m["step"] for m in trainer.history]}


@pytest.mark.timeout(120)
def test_a_nan_step_is_skipped_on_every_rank_and_stops_at_the_next_logged_step(tmp_path):
    for rank, r in enumerate(run_ranks(_nan_job, 4, str(tmp_path), timeout=100)):
        assert r["syncs"] == [{}], (rank, r["syncs"])
        assert r["error"] is not None and r["error"].startswith(f"step {K}: loss is nan and grad norm is nan"), r
        assert f"nor were steps {K + 1}-{LOG}" in r["error"], r["error"]
        assert r["unchanged"] == r["keys"] and len(r["keys"]) > 2, (rank, r)  # parameters and AdamW moments
        assert r["step"] == K - 1 and r["steps_read"] == [1, 2], (rank, r)
