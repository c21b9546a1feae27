"""Resuming with changed settings: changes that continue another trajectory (model shape, data
identity, seed, global batch) are refused before any rank starts, naming every changed field old -> new;
optimisation changes are warned; layout changes and a longer run pass silently."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from engine.training import launch
from engine.training.config import load_config
from engine.training.checkpoint.resume import MODEL_MUST_MATCH, resume_differences, run_settings

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = ROOT / "configs" / "default.yaml"


def _meta(config) -> dict:
    """What the trainer saves (the model / tokenizer / run entries of
    ``engine.training.checkpoint.resume.checkpoint_meta``)."""
    return {"model": {k: getattr(config.model, k) for k in MODEL_MUST_MATCH} |
            {"ffn_hidden_size": config.ffn_hidden_size}, "tokenizer": {"kind": config.data.tokenizer},
            "run": json.loads(json.dumps(run_settings(config)))}


SAVED = load_config(DEFAULT)


@pytest.mark.parametrize("overrides,refused,warned", [
    ([], [], []),
    (["parallel.pipeline=1", "parallel.virtual=1", "training.steps=400"], [], []),  # layout, a longer run
    (["training.micro_batch_size=4", "training.num_microbatches=8"], [], []),  # the same global batch (32)
    (["training.micro_batch_size=4"], ["global_batch_size: 32 -> 16 (data 1 x 4 microbatches x 8 -> data 1 x 4 "
                                       "microbatches x 4)"],
     ["eval_sequences: 64 -> 32 (sequences per evaluation: data x eval microbatches x micro_batch_size x "
      "eval_iters)"]),
    (["training.seed=7"], ["training.seed: 1234 -> 7"], []),
    (["data.max_bytes=100000", "optimizer.lr=1e-3"], ["data.max_bytes: None -> 100000"],
     ["optimizer.lr: 0.003 -> 0.001"]),
    (["optimizer.warmup_steps=5", "training.eval_iters=3"], [],
     ["optimizer.warmup_steps: 20 -> 5", "eval_sequences: 64 -> 96 (sequences per evaluation: data x eval "
                                         "microbatches x micro_batch_size x eval_iters)"]),
    (["model.hidden_size=64"], ["checkpoint has model.hidden_size=128, the config has 64",
                                "checkpoint has model.ffn_hidden_size=512, the config has 256"], []),
])
def test_each_change_is_refused_warned_or_allowed(overrides, refused, warned):
    assert resume_differences(_meta(SAVED), load_config(DEFAULT, overrides)) == (refused, warned)


def test_changed_data_paths_are_refused(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 5000)
    (tmp_path / "b.txt").write_text("b" * 5000)
    saved = load_config(DEFAULT, ["data.source=text", f"data.paths=[{tmp_path / 'a.txt'}]"])
    ours = load_config(DEFAULT, ["data.source=text", f"data.paths=[{tmp_path / 'b.txt'}]"])
    refused, _ = resume_differences(_meta(saved), ours)
    assert refused == [f"data.paths: [{str(tmp_path / 'a.txt')!r}] -> [{str(tmp_path / 'b.txt')!r}]"]


def test_old_checkpoints_are_compared_on_the_model_only():
    meta = _meta(SAVED)
    del meta["run"]
    assert resume_differences(meta, load_config(DEFAULT, ["training.seed=7"])) == ([], [])


def test_the_cli_refuses_a_changed_trajectory_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    step = tmp_path / "checkpoints" / "step_00000050"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "pipecast.json").write_text(json.dumps(_meta(load_config(DEFAULT, [f"logging.run_dir={tmp_path}"]))))
    monkeypatch.setattr(launch, "run_spawned", lambda *a, **k: "spawned")
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)

    def run(*flags):
        args, extra = parser.parse_known_args([str(DEFAULT), f"--logging.run_dir={tmp_path}", "--resume", *flags])
        args.extra = extra
        return launch.run(args)

    assert run("--training.seed=7", "--training.micro_batch_size=2") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot resume from '{step}'"), lines
    assert "training.seed: 1234 -> 7" in lines[0] and "global_batch_size: 32 -> 8" in lines[0], lines
    assert run("--optimizer.lr=1e-3", "--parallel.pipeline=1", "--parallel.virtual=1") == "spawned"


def test_the_cli_picks_the_checkpoint_a_resume_loads_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    """``checkpoint.load_step`` needs ``--resume`` and an existing step; a structurally broken newest checkpoint
    (a file missing or truncated) is passed over for the comparison, as the ranks will; all broken: refused."""
    import warnings

    import torch

    from engine.training.checkpoint.dcp import save_checkpoint
    meta = _meta(load_config(DEFAULT, [f"logging.run_dir={tmp_path}"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: saving in a single process
        for step, seed in ((50, 1234), (100, 7)):  # step 100 was written by a run of another seed
            save_checkpoint({"w": torch.zeros(3)}, tmp_path / "checkpoints", step,
                            meta={**meta, "run": {**meta["run"], "training.seed": seed}})
    monkeypatch.setattr(launch, "run_spawned", lambda *a, **k: "spawned")
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)

    def run(*flags):
        args, extra = parser.parse_known_args([str(DEFAULT), f"--logging.run_dir={tmp_path}", *flags])
        args.extra = extra
        capsys.readouterr()
        return launch.run(args), capsys.readouterr().err

    code, err = run("--resume")
    assert code == 2 and "training.seed: 7 -> 1234" in err and "step_00000100" in err, err
    assert run("--resume", "--checkpoint.load_step=50") == ("spawned", "")
    code, err = run("--checkpoint.load_step=50")
    assert code == 2 and err.count("\n") == 1 and "add --resume" in err, err
    code, err = run("--resume", "--checkpoint.load_step=70")
    assert code == 2 and err.count("\n") == 1 and "no checkpoint of step 70 (its steps: 50, 100)" in err, err
    newest = tmp_path / "checkpoints" / "step_00000100"
    payload = next(newest.glob("*.distcp"))
    payload.write_bytes(payload.read_bytes()[:10])
    assert run("--resume") == ("spawned", "")  # step 100 is truncated: the ranks will resume from step 50
    code, err = run("--resume", "--checkpoint.load_step=100")
    assert code == 2 and err.startswith(f"error: checkpoint {str(newest)!r} is broken: {payload.name} is "
                                        f"truncated (10 of"), err
    (tmp_path / "checkpoints" / "step_00000050" / ".metadata").unlink()
    code, err = run("--resume")
    assert code == 2 and err.count("\n") == 1 and "no intact checkpoint in" in err, err


def _warmup_cosine(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """The LR of optimizer step ``step`` (0-based), written out here as the README states it: linear warmup to
    ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``total``."""
    import math
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_resumed_run_follows_its_own_lr_schedule_from_the_first_step(tmp_path):
    """Issue 36: resuming with more training.steps ran the first resumed step at the saved LR (the old schedule's)
    and jumped after; the saved base LR also outlived a changed optimizer.lr.  Every resumed step's LR is the new
    config's schedule at that step (a longer run, and a longer run with another peak LR, warned)."""
    from engine import Trainer
    base = {"model.num_layers": 2, "model.hidden_size": 16, "model.num_attention_heads": 2, "model.seq_length": 8,
            "data.max_bytes": 50_000, "training.micro_batch_size": 1, "training.num_microbatches": 1,
            "training.eval_interval": 0, "optimizer.warmup_steps": 2, "optimizer.lr": 1e-2, "optimizer.min_lr": 1e-3,
            "logging.progress_bar": False, "logging.run_dir": str(tmp_path / "run"), "training.steps": 5}
    with Trainer(load_config(None, base)) as first:
        first.train(steps=4)
        first.save()
    for longer in ({"training.steps": 12}, {"training.steps": 12, "optimizer.lr": 5e-3}):
        config = load_config(None, {**base, **longer})
        o = config.optimizer
        with Trainer(config) as second:
            assert second.load() is not None and second.step == 4
            lrs = [second.train_step()["lr"] for _ in range(8)]
        want = [_warmup_cosine(k, o.lr, o.min_lr, o.warmup_steps, 12) for k in range(4, 12)]
        assert lrs == pytest.approx(want, rel=1e-12, abs=0), (longer, lrs, want)
