"""Every combination of ``parallel.*`` that the config accepts runs, and its first step equals the single-process
trainer's (issue 36: sequence parallelism under split schedules, FSDP with a V placement at pipeline 1 and the
overlapped data-parallel reduction at pipeline 1 with tensor parallelism were accepted, then failed or trained
wrong).

:func:`accepted` walks :data:`AXES` (pipeline, tensor and data sizes of at most 4 ranks, sequence parallelism,
shard, the built-in schedules (spawned ranks lack a schedule a test registered in this process), virtual) through the config validator (``load_config`` + ``validate_world_size``); each
combination is either refused there with a ``ConfigError`` or kept, once per distinct effective run (``auto``
resolved to its schedule; a shard at ``parallel.data=1`` runs as ``none``).  The kept ones run one training step
each, on a tiny GPT with tied embeddings, in one spawned job per world size (each rank builds the trainers in
sequence).  Their loss and grad norm must equal the pp1 trainer's in this process on the same global batch
(:data:`GLOBAL_MICROBATCHES` microbatches), within :data:`TOL` (tensor parallelism sums in another order).
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from engine.plan.registry import schedule_names
from engine.training.config import ConfigError, load_config, validate_world_size
from tests.helpers.distributed import run_ranks

TOL = 5e-5  # fp32, the tensor-parallel reduction order (tests/training/parallel/test_tensor_parallel.py)
GLOBAL_MICROBATCHES = (4, 8)  # per step, the first the config accepts (DualPipeV at pipeline 2 x data 2 needs 8)
MODEL = {"model.num_layers": 4, "model.hidden_size": 16, "model.num_attention_heads": 4, "model.seq_length": 8}
AXES = {
    "pipeline": (1, 2), "tensor": (1, 2), "data": (1, 2), "sequence_parallel": (False, True),
    "shard": ("none", "optimizer", "full"), "schedule": ("auto", *schedule_names(builtin=True)), "virtual": (1, 2),
}
MAX_WORLD = 4
TEXT = str(Path(__file__).resolve().parents[3] / "README.md")  # a small corpus: no walk of the standard library


def overrides(combo: dict, run_dir: str, microbatches: int) -> dict:
    return {**MODEL, **{f"parallel.{k}": v for k, v in combo.items()}, "data.source": "text", "data.paths": [TEXT],
            "training.micro_batch_size": 1, "training.num_microbatches": microbatches // combo["data"],
            "training.steps": 1, "training.eval_interval": 0, "optimizer.grad_clip": 1.0,
            "optimizer.warmup_steps": 0, "logging.progress_bar": False, "logging.level": "WARNING",
            "logging.run_dir": run_dir}


def accepted() -> tuple[dict, int]:
    """``({world size: [(combination, global microbatches), ...]}, number refused)``: the distinct combinations the
    validator accepts."""
    runs: dict = {}
    seen, refused = set(), 0
    for values in itertools.product(*AXES.values()):
        combo = dict(zip(AXES, values))
        world = combo["pipeline"] * combo["tensor"] * combo["data"]
        if world > MAX_WORLD:
            continue
        found = next(((c, m) for m in GLOBAL_MICROBATCHES for c in [_accepted(combo, world, m)] if c), None)
        if found is None:
            refused += 1
            continue
        config, microbatches = found
        p = config.parallel
        key = (world, p.pipeline, p.tensor, p.sequence_parallel, p.shard if p.data > 1 else "none",
               config.schedule_name, p.virtual)
        if key not in seen:
            seen.add(key)
            runs.setdefault(world, []).append((combo, microbatches))
    return runs, refused


def _accepted(combo: dict, world: int, microbatches: int):
    try:
        return validate_world_size(load_config(None, overrides(combo, "unused", microbatches)), world)
    except ConfigError:
        return None


def first_step(combo: dict, microbatches: int, run_dir: str) -> dict:
    from engine import Trainer
    with Trainer(load_config(None, overrides(combo, run_dir, microbatches))) as trainer:
        metrics = trainer.train_step()
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}


def _job(rank, world, combos: list, run_dir: str) -> list:
    out = []
    for i, (combo, microbatches) in enumerate(combos):
        try:
            out.append(first_step(combo, microbatches, f"{run_dir}/{i}"))
        except Exception as exc:  # the job stops; name the combination
            raise RuntimeError(f"parallel combination {combo} failed: {type(exc).__name__}: {exc}") from exc
    return out


@pytest.mark.timeout(600)
def test_every_accepted_parallel_combination_runs(tmp_path):
    runs, refused = accepted()
    ref = {m: first_step({"pipeline": 1, "data": 1}, m, str(tmp_path / f"ref{m}")) for m in GLOBAL_MICROBATCHES}
    for world, combos in sorted(runs.items()):
        per_rank = (run_ranks(_job, world, combos, str(tmp_path / f"w{world}"), timeout=400) if world > 1 else
                    [_job(0, 1, combos, str(tmp_path / "w1"))])
        for rank, got in enumerate(per_rank):
            for (combo, m), r in zip(combos, got):
                for field in ("loss", "grad_norm"):
                    assert r[field] == pytest.approx(ref[m][field], rel=TOL), (field, combo, m, rank, r, ref[m])
    print(f"{sum(len(c) for c in runs.values())} distinct accepted combinations ran ({ {w: len(c) for w, c in runs.items()} }"
          f" by world size), {refused} refused by the config check")
    assert refused and all(len(c) for c in runs.values())
