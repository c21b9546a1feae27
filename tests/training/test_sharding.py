"""``parallel.shard: optimizer`` (ZeRO-1, engine.training.sharding) against plain data parallelism and pp1.

One spawned 4-rank job (pp2 x dp2) runs ``shard: optimizer`` under 1F1B (saving at step 2) and under ZB-H1 (split
backward: W passes deferred), 3 steps each with grad clipping and weight decay on, and a ``shard: optimizer`` run
resumed from a pp1 checkpoint.  (``shard: none`` at pp2 x dp2 is checked against autograd in test_trainer_reference.)  A single-process pp1 run (same
global batch) gives the reference losses and parameters, and resumes from the sharded checkpoint.

Tolerance: the sharded runs reduce-scatter where ``none`` all-reduces and sum the tied embedding before the
data-parallel average (Megatron averages first), and the pp1 run accumulates the whole global batch in one
process: the results differ by float rounding only (fp32: relative 1e-5 on parameters, 1e-5 absolute on losses).
"""
from __future__ import annotations

import pytest
import torch

from engine.training.config import ConfigError, load_config, validate
from tests.helpers.distributed import run_ranks

MODEL = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8)
STEPS, CUT, GLOBAL_MICROBATCHES = 3, 2, 4
TOL = 1e-5


def overrides(run_dir: str, pipeline: int, data: int, **parallel) -> list[str]:
    values = {**{f"model.{k}": v for k, v in MODEL.items()}, "data.max_bytes": 40_000,
              "parallel.pipeline": pipeline, "parallel.data": data, "training.micro_batch_size": 2,
              "training.num_microbatches": GLOBAL_MICROBATCHES // data, "training.steps": STEPS,
              "training.eval_interval": 0, "optimizer.lr": 1e-2, "optimizer.warmup_steps": 0,
              "optimizer.grad_clip": 0.05, "optimizer.weight_decay": 0.1, "checkpoint.interval": 0,
              "checkpoint.save_at_end": False, "logging.progress_bar": False, "logging.level": "WARNING",
              "logging.run_dir": run_dir, **{f"parallel.{k}": v for k, v in parallel.items()}}
    return [f"{k}={v}" for k, v in values.items()]


def _run(config, steps: int, load=None, save_at=None) -> dict:
    from engine import Trainer
    with Trainer(config) as trainer:
        if load is not None:
            trainer.load(load)
        out = {"losses": [], "norms": []}
        while trainer.step < steps:
            m = trainer.train_step()
            out["losses"].append(m["loss"])
            out["norms"].append(m["grad_norm"])
            if save_at == trainer.step:
                out["saved"] = str(trainer.save())
        out["params"] = {n: p.detach().numpy().copy() for n, p in trainer.canonical.named_parameters()}
        out["state_bytes"] = trainer.optimizer.state_bytes() if trainer.sharded else None
    return out


def _job(rank: int, world: int, run_dir: str, pp1_checkpoint: str) -> dict:
    out = {"optimizer": _run(load_config(None, overrides(f"{run_dir}/optimizer", 2, 2, shard="optimizer")), STEPS,
                             save_at=CUT),
           "zb_h1": _run(load_config(None, overrides(f"{run_dir}/zb_h1", 2, 2, shard="optimizer",
                                                     schedule="zb_h1")), STEPS)}
    out["from_pp1"] = _run(load_config(None, overrides(f"{run_dir}/from_pp1", 2, 2, shard="optimizer")), STEPS,
                           load=pp1_checkpoint)
    return out


def _close(a: dict, b: dict) -> float:
    worst = 0.0
    for name, ref in b.items():
        diff = abs(torch.from_numpy(a[name]) - torch.from_numpy(ref)).max().item()
        worst = max(worst, diff / max(abs(torch.from_numpy(ref)).max().item(), 1e-12))
    return worst


def test_zero1_matches_pp1_and_resumes_across_layouts(tmp_path):
    pp1_dir = str(tmp_path / "pp1")
    pp1 = _run(load_config(None, overrides(pp1_dir, 1, 1)), STEPS, save_at=CUT)
    results = run_ranks(_job, 4, str(tmp_path), pp1["saved"], timeout=110)
    params = {}  # canonical name -> values, from every pipeline rank of data-parallel rank 0 (ranks 0 and 2)
    for rank in (0, 2):
        for case in ("optimizer", "zb_h1", "from_pp1"):
            params.setdefault(case, {}).update(results[rank][case]["params"])
    assert set(params["optimizer"]) == set(pp1["params"])
    for case in ("optimizer", "zb_h1", "from_pp1"):
        print(f"{case}: parameters max |diff| / max |ref| vs pp1 = {_close(params[case], pp1['params']):.2e}")
        assert _close(params[case], pp1["params"]) < TOL, case
        loss_rank = results[2][case]  # pp rank 1 holds the loss
        assert max(abs(x - y) for x, y in zip(loss_rank["losses"], pp1["losses"][-len(loss_rank["losses"]):])) \
            < TOL, case
        assert max(abs(x - y) for x, y in zip(loss_rank["norms"], pp1["norms"][-len(loss_rank["norms"]):])) \
            < TOL, case
    for a, b in ((0, 1), (2, 3)):  # data-parallel replicas hold the same full weights after the all-gather
        for name, value in results[a]["optimizer"]["params"].items():
            assert (value == results[b]["optimizer"]["params"][name]).all(), name
    # optimizer state: each data-parallel rank holds the two AdamW moments of its half (plus a step per piece)
    for rank in range(4):
        n_params = sum(v.size for v in results[rank]["optimizer"]["params"].values())
        assert 2 * 4 * n_params / 2 <= results[rank]["optimizer"]["state_bytes"] < 0.55 * 2 * 4 * n_params
    # the sharded checkpoint resumes in one process (pp1, shard none) with the straight run's last loss
    resumed = _run(load_config(None, overrides(str(tmp_path / "resumed"), 1, 1)), STEPS,
                   load=results[0]["optimizer"]["saved"])
    assert abs(resumed["losses"][0] - pp1["losses"][-1]) < TOL
    assert _close(resumed["params"], pp1["params"]) < TOL


def test_shard_full_and_unknown_values_refused_before_any_process_group():
    with pytest.raises(ConfigError, match="parallel.shard=full"):
        validate(load_config(None, ["parallel.shard=full"]))
    with pytest.raises((ConfigError, ValueError, TypeError), match="parallel.shard"):
        validate(load_config(None, ["parallel.shard=zero3"]))
    with pytest.raises(ConfigError, match="parallel.shard=optimizer with parallel.tensor=2"):
        validate(load_config(None, ["parallel.shard=optimizer", "parallel.tensor=2", "parallel.pipeline=1",
                                    "model.num_layers=2"]))
