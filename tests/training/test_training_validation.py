"""Training config and run validation (``pipecast train`` and the ``Trainer``):

* exponent floats (``1e-3``) in files and overrides; non-finite / non-numeric floats rejected; duplicate YAML keys
  rejected; a string passed as ``overrides`` is a TypeError; one field per optimizer error; the group-size field named
  first; CUDA settings rejected in validation on a machine without CUDA (pure checks first, torch imported only then);
* a fresh run refuses a folder that holds checkpoints (before touching its ``train.log`` / ``config.yaml``); the
  keep-newest rotation never deletes the checkpoint just written;
* a config is validated once: the trainer does not check again what ``load_config`` validated, but checks a config
  built or changed by hand after its validation, refusing a bad one before any process group exists;
* NaN / inf loss or grad norm stops the run on every rank with the step, the value and the fix, saving nothing;
* resuming with other model settings names each differing field; a resumed run evaluates at its start (honest
  ``val loss A -> B``); resuming at or past ``training.steps`` logs ``nothing to do``.
"""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from engine.training.checkpoint.dcp import CheckpointError, list_checkpoints, save_checkpoint
from engine.training.config import (ConfigError, check_fresh_run, load_config, parse_override_args)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP single-process warnings


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


# ---- config parsing ---------------------------------------------------------------------------------------------

def test_exponent_floats_in_files_and_overrides(tmp_path):
    path = _write(tmp_path, "optimizer:\n  lr: 1e-3\n  min_lr: 1E-4\n  eps: 1e-8\nmodel: {norm_epsilon: 1e-6}\n")
    config = load_config(path)
    assert (config.optimizer.lr, config.optimizer.min_lr, config.optimizer.eps, config.model.norm_epsilon) == \
        (1e-3, 1e-4, 1e-8, 1e-6)
    assert all(isinstance(v, float) for v in (config.optimizer.lr, config.optimizer.eps))
    config = load_config(path, parse_override_args(["--optimizer.lr=3E-4", "--optimizer.eps", "1e-7"]))
    assert (config.optimizer.lr, config.optimizer.eps) == (3e-4, 1e-7)
    # a quoted number is accepted for a float field; ints too
    assert load_config(None, ["optimizer.lr='2e-3'", "optimizer.grad_clip=2"]).optimizer.lr == 2e-3
    # other strings keep their meaning (not floats)
    assert load_config(None, ["logging.run_dir=1e3x"]).logging.run_dir == "1e3x"


@pytest.mark.parametrize("value,error,words", [
    ("abc", TypeError, ["optimizer.lr='abc'", "1e-3"]),
    (".nan", ConfigError, ["optimizer.lr=nan", "finite"]),
    (".inf", ConfigError, ["optimizer.lr=inf", "finite"]),
    ("'nan'", ConfigError, ["optimizer.lr='nan'", "finite"]),
    ("true", TypeError, ["optimizer.lr=True", "float"]),
])
def test_bad_floats_are_rejected(value, error, words):
    with pytest.raises(error) as info:
        load_config(None, [f"optimizer.lr={value}"])
    assert all(w in str(info.value) for w in words), str(info.value)


def test_duplicate_yaml_keys_are_rejected(tmp_path):
    path = _write(tmp_path, "model:\n  num_layers: 4\n  hidden_size: 64\n  num_layers: 8\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'num_layers' on line 4 \(first given on line 2\)"):
        load_config(path)
    with pytest.raises(ConfigError, match="duplicate key 'model' on line 2"):
        load_config(_write(tmp_path, "model: {num_layers: 4}\nmodel: {hidden_size: 64}\n"))


def test_string_overrides_are_a_type_error():
    with pytest.raises(TypeError, match=r"overrides.*\['training.steps=3'\]"):
        load_config(None, "training.steps=3")


def test_one_field_per_optimizer_error():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["optimizer.grad_clip=-1"])
    message = str(info.value)
    assert message.startswith("optimizer.grad_clip=-1.0") and "weight_decay" not in message and "eps" not in message
    with pytest.raises(ConfigError, match=r"^optimizer.eps=0.0 must be > 0"):
        load_config(None, ["optimizer.eps=0"])


def test_group_size_error_names_the_group_field_first():
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "configs" / "default.yaml", ["parallel.microbatch_group_size_per_vp_stage=1"])
    assert str(info.value).startswith("parallel.microbatch_group_size_per_vp_stage=1 is invalid"), str(info.value)
    assert "[2, 4]" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("override,field", [("parallel.device=cuda", "parallel.device='cuda'"),
                                            ("parallel.backend=nccl", "parallel.backend='nccl'")])
def test_cuda_settings_without_cuda_fail_in_validation(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert field in str(info.value) and "parallel.device=auto" in str(info.value)
    # the pure checks run first: another error in the same config is reported instead
    with pytest.raises(ConfigError, match="model.num_layers=6"):
        load_config(None, [override, "model.num_layers=6", "parallel.pipeline=4"])


def test_bad_config_does_not_import_torch():
    """The launcher validates before importing torch; the device check must not import it for other configs."""
    code = ("import sys\nfrom engine.training.config import load_config\n"
            "try:\n    load_config('configs/default.yaml', ['model.num_layers=6'])\nexcept ValueError:\n    pass\n"
            "load_config('configs/default.yaml')\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---- checkpoint folders -----------------------------------------------------------------------------------------

def _state(seed: int) -> dict:
    return {"model": {"w": torch.full((2,), float(seed))}}


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (205, 207):
        save_checkpoint(_state(step), tmp_path, step=step, keep=2)
    written = save_checkpoint(_state(3), tmp_path, step=3, keep=2, meta={"step": 3})
    assert written.is_dir() and written in list_checkpoints(tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000207"]
    assert yaml.safe_load((written / "pipecast.json").read_text()) == {"step": 3, "manifest": "manifest.json"}


def test_check_fresh_run(tmp_path):
    config = load_config(None, [f"logging.run_dir={tmp_path}"])
    check_fresh_run(config, resume=False)  # no folder yet
    (tmp_path / "checkpoints" / ".step_00000001.tmp").mkdir(parents=True)  # a crashed save is no checkpoint
    check_fresh_run(config, resume=False)
    save_checkpoint(_state(1), tmp_path / "checkpoints", step=205)
    with pytest.raises(ConfigError) as info:
        check_fresh_run(config, resume=False)
    message = str(info.value)
    for word in ("checkpoint.dir", "step_00000205", f"logging.run_dir={str(tmp_path)!r}", "--resume",
                 "delete"):
        assert word in message, message
    check_fresh_run(config, resume=True)


# ---- trainer runs (one rank, in this process) -------------------------------------------------------------------

TINY = {"model.num_layers": 2, "model.hidden_size": 32, "model.num_attention_heads": 2, "model.seq_length": 16,
        "data.max_bytes": 100_000, "training.micro_batch_size": 2, "training.num_microbatches": 2,
        "training.eval_interval": 0, "optimizer.warmup_steps": 1, "logging.progress_bar": False,
        "logging.level": "INFO"}


def _config(run_dir, **overrides):
    return load_config(None, {**TINY, "logging.run_dir": str(run_dir), **overrides})


def _poison(trainer) -> None:
    with torch.no_grad():
        next(trainer.model[0].parameters()).fill_(float("nan"))


def test_the_trainer_validates_only_what_was_not_validated(tmp_path, monkeypatch):
    import torch.distributed as dist

    from engine.training import trainer as trainer_module
    from engine.training.config import OptimizerConfig, TrainConfig
    calls = []
    real = trainer_module.validate
    monkeypatch.setattr(trainer_module, "validate", lambda c: (calls.append(c), real(c))[1])
    config = _config(tmp_path, **{"training.steps": 1})
    with trainer_module.Trainer(config) as trainer:  # load_config validated it
        assert trainer.config.parallel.data == 1
    assert calls == []
    config.model.num_attention_heads = 3  # changed by hand after its validation: checked again, refused
    with pytest.raises(ConfigError, match="model.num_attention_heads=3"):
        trainer_module.Trainer(config)
    hand = TrainConfig(optimizer=OptimizerConfig(lr=-1.0))  # built by hand, never validated
    with pytest.raises(ConfigError, match="optimizer.lr"):
        trainer_module.Trainer(hand)
    assert calls == [config, hand] and not dist.is_initialized()  # refused before any process group


def test_nan_loss_stops_the_run_and_saves_nothing(tmp_path):
    from engine.training.trainer import NonFiniteLossError, Trainer
    with Trainer(_config(tmp_path, **{"training.steps": 3, "checkpoint.interval": 1,
                                      "optimizer.grad_clip": 0})) as trainer:
        trainer.train(steps=1)
        _poison(trainer)
        with pytest.raises(NonFiniteLossError) as info:
            trainer.train()
        assert trainer.step == 1  # the bad step was not applied
    message = str(info.value)
    for word in ("step 2", "loss is nan", "optimizer.lr", "enable optimizer.grad_clip",
                 "optimizer.check_for_nan_in_loss_and_grad=false"):
        assert word in message, message
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000001"]
    # switched off, the step runs (Megatron's flag semantics)
    with Trainer(_config(tmp_path / "off", **{"training.steps": 3,
                                              "optimizer.check_for_nan_in_loss_and_grad": False})) as trainer:
        _poison(trainer)
        assert math.isnan(trainer.train_step()["loss"])


def test_fresh_run_in_a_used_folder_and_resume(tmp_path):
    from engine.training.trainer import Trainer
    with Trainer(_config(tmp_path, **{"training.steps": 2})) as first:
        first.train()
    log_before, config_before = (tmp_path / "train.log").read_text(), (tmp_path / "config.yaml").read_text()
    assert "step 2/2" in log_before
    # a fresh run with other settings is refused before it writes anything into the other run's files
    with Trainer(_config(tmp_path, **{"training.steps": 4, "optimizer.lr": 5e-3})) as fresh:
        with pytest.raises(ConfigError, match="already holds checkpoints.*--resume"):
            fresh.train()
    assert (tmp_path / "train.log").read_text() == log_before
    assert (tmp_path / "config.yaml").read_text() == config_before
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000002"]
    # --resume continues it, evaluating at its start (the summary's "val loss A -> B" is this run's)
    with Trainer(_config(tmp_path, **{"training.steps": 4})) as resumed:
        assert resumed.load() is not None and resumed.step == 2
        resumed.train()
        assert [s for s, _ in resumed.val_history] == [2, 4]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["training"]["steps"] == 4
    # resuming at or past training.steps: one line, nothing else
    with Trainer(_config(tmp_path, **{"training.steps": 3})) as done:
        done.load()
        assert done.train() == [] and done.val_history == [] and done.step == 4
    assert "nothing to do: checkpoint step 4 >= training.steps=3" in (tmp_path / "train.log").read_text()


def test_resume_with_other_model_settings_names_each_field(tmp_path):
    from engine.training.trainer import Trainer
    with Trainer(_config(tmp_path, **{"training.steps": 1})) as first:
        first.train()
    changed = {"model.hidden_size": 64, "model.num_layers": 4, "model.tie_embeddings": False}
    with Trainer(_config(tmp_path, **{"training.steps": 2, **changed})) as other:
        with pytest.raises(CheckpointError) as info:
            other.load()
    message = str(info.value)
    for word in ("checkpoint has model.hidden_size=32, the config has 64", "model.num_layers=2, the config has 4",
                 "model.tie_embeddings=True, the config has False", "model.ffn_hidden_size=128, the config has 256",
                 "resume with the same model settings"):
        assert word in message, message
    # the run settings saved with it (issue 26.6): another trajectory is refused before any rank, naming each
    # field old -> new, by the launcher's pure check and by the trainer; an optimisation change is logged
    from engine.training.checkpoint.resume import check_resume
    with pytest.raises(ConfigError, match=r"training.seed: 1234 -> 5; global_batch_size: 4 -> 8"):
        check_resume(_config(tmp_path, **{"training.seed": 5, "training.micro_batch_size": 4}), ConfigError)
    with Trainer(_config(tmp_path, **{"training.steps": 2, "data.max_bytes": 50_000})) as other:
        with pytest.raises(CheckpointError, match=r"data.max_bytes: 100000 -> 50000"):
            other.load()
    with Trainer(_config(tmp_path, **{"training.steps": 2, "optimizer.lr": 5e-4})) as resumed:
        assert resumed.load() is not None
    assert "optimizer.lr: 0.001 -> 0.0005" in (tmp_path / "train.log").read_text()


def test_summary_after_a_sigterm_stop_makes_no_fake_comparison(tmp_path, monkeypatch):
    """Issue 26: SIGTERM stopped the run after step 1, before any evaluation but the first; the summary said
    ``val loss 5.3170 -> 5.3170 (0.0% lower)``.  It must give the one loss, its step and why there is no other."""
    from engine.training import launch, preempt
    monkeypatch.setattr(preempt, "stop_agreed", lambda: True)  # as if every rank got SIGTERM during step 1
    config = _config(tmp_path, **{"training.steps": 6, "training.eval_interval": 3})
    result = launch.train_worker(config)
    assert result is not None and result["preempted"] and result["step"] == 1, result
    lines = (tmp_path / "train.log").read_text().splitlines()
    line = next(ln for ln in lines if "| val loss" in ln and ("done:" in ln or "stopped" in ln))
    assert " -> " not in line and "% lower" not in line, line
    assert "stopped (SIGTERM): step 1 in " in line and "at step 0 (stopped by SIGTERM before the next " \
        "evaluation" in line, line
    two = launch.summary_line(6, 1.0, [(0, 5.0), (3, 4.0), (6, 5.5)])
    assert two == "done: step 6 in 1.0 s | val loss 5.0000 -> 5.5000 (10.0% higher)", two
    assert launch.summary_line(4, 2.0, [(0, 4.0), (4, 3.0)]).endswith("val loss 4.0000 -> 3.0000 (25.0% lower)")
