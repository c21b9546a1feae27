"""The trainer resolves its schedule once and agrees on a call across the pipeline only when the call's sizes
are new (sizes agreed before -- training again after an evaluation -- are not agreed again): on 2 gloo ranks (pipeline 2, interleaved 1F1B) the ``all_gather`` calls (the agreement's collective; the
layout has no other) are counted per phase -- many equal training steps, an evaluation with another microbatch
count (several equal batches), sampling (one-sequence microbatches, many tokens), training again.  The same run
with the public function called per step (what the trainer did before) counts one per call, and gives the same
losses."""
from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks

STEPS, EVAL_ITERS, TOKENS = 5, 3, 4


def _overrides(run_dir: str) -> dict:
    return {"model.num_layers": 4, "model.hidden_size": 16, "model.num_attention_heads": 2, "model.seq_length": 8,
            "data.max_bytes": 40_000, "parallel.pipeline": 2, "parallel.virtual": 2,
            "training.micro_batch_size": 2, "training.num_microbatches": 4, "training.eval_microbatches": 2,
            "training.eval_iters": EVAL_ITERS, "training.steps": 2 * STEPS, "training.eval_interval": 0,
            "checkpoint.interval": 0, "checkpoint.save_at_end": False, "logging.progress_bar": False,
            "logging.level": "WARNING", "logging.run_dir": run_dir}


def _phases(trainer, counter: list) -> tuple[dict, list]:
    gathers, losses = {}, []

    def phase(name, fn, times=1):
        counter[0] = 0
        for _ in range(times):
            result = fn()
        gathers[name] = counter[0]
        return result
    losses += [phase("first train step", trainer.train_step)["loss"]]
    phase(f"{STEPS - 1} more train steps", lambda: losses.append(trainer.train_step()["loss"]), STEPS - 1)
    losses.append(phase(f"evaluate ({EVAL_ITERS} batches of 2 microbatches)", trainer.evaluate))
    phase(f"sample {TOKENS} tokens", lambda: trainer.sample(TOKENS))
    phase("train step after evaluate and sample", lambda: losses.append(trainer.train_step()["loss"]))
    phase("2 more train steps", lambda: losses.append(trainer.train_step()["loss"]), 2)
    return gathers, losses


def _job(rank: int, world: int, run_dir: str) -> dict:
    import torch.distributed as dist

    from engine import Trainer, schedules
    from engine.training.config import load_config
    counter = [0]
    inner = dist.all_gather

    def all_gather(*args, **kwargs):
        counter[0] += 1
        return inner(*args, **kwargs)
    dist.all_gather = all_gather
    try:
        with Trainer(load_config(None, _overrides(f"{run_dir}/bound"))) as trainer:
            bound = _phases(trainer, counter)
        with Trainer(load_config(None, _overrides(f"{run_dir}/per_call"))) as trainer:
            def per_call(**kwargs):  # the public function on every call, handed the same plans
                plan = trainer.schedule.plan(kwargs["num_microbatches"], kwargs["forward_only"])
                return schedules.forward_backward_pipelining_with_schedule(
                    schedule=plan, model=trainer.model, pg_collection=trainer.pg,
                    p2p_communicator=trainer._pipeline.p2p_communicator, **kwargs)
            trainer._pipeline.forward_backward = per_call
            per_call_run = _phases(trainer, counter)
    finally:
        dist.all_gather = inner
    return {"bound": bound, "per_call": per_call_run}


@pytest.mark.timeout(240)
def test_the_schedule_call_agrees_once_per_new_sizes(tmp_path):
    for rank, r in enumerate(run_ranks(_job, 2, str(tmp_path), timeout=200)):
        gathers, losses = r["bound"]
        assert gathers == {"first train step": 1, f"{STEPS - 1} more train steps": 0,
                           f"evaluate ({EVAL_ITERS} batches of 2 microbatches)": 1, f"sample {TOKENS} tokens": 1,
                           "train step after evaluate and sample": 0, "2 more train steps": 0}, (rank, gathers)
        per_call_gathers, per_call_losses = r["per_call"]
        assert list(per_call_gathers.values()) == [1, STEPS - 1, EVAL_ITERS, TOKENS, 1, 2], (rank, per_call_gathers)
        assert losses == per_call_losses, rank
