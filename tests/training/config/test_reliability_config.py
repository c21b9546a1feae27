"""Reliability: a bad configuration fails fast and clearly, before any process group or P2P exists.

* A table of bad YAML configs (each written to a file and loaded the way ``pipecast train`` loads it): every row must
  raise ``ValueError`` / ``TypeError`` / ``RuntimeError`` whose message names the field, the bad value and a fix, and
  no process group may have been created.  Validation is a pure function of the file, so every rank of a job raises
  the same message (checked here by loading each row twice and comparing).
* ``pipecast train`` end to end (subprocesses): exit status 2, one ``error:`` line naming the field, within 10 s --
  also under torchrun-style environment variables with a world size that is not ``pipeline x data``.
* Untrusted YAML: Python tags are rejected by ``yaml.safe_load`` and never executed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.training.config import load_config, validate_world_size

ROOT = Path(__file__).resolve().parents[3]
FIX_WORDS = ("use ", "set ", "choose", "pass ", "start ", "remove", "fix ", "change", "write ", "must ", "needs", "call ",
             "accepts", "expected", "allowed", "are: ", "one of")


def _teaches(message: str) -> bool:
    """A message that says what to do (a fix or the allowed values)."""
    return any(w in message for w in FIX_WORDS)


# (id, YAML text, world size for validate_world_size or None, exception types, substrings the message must contain)
BAD_CONFIGS = [
    ("layers_not_divisible_into_chunks", "model: {num_layers: 6}\nparallel: {pipeline: 2, virtual: 2}\n", None,
     ValueError, ["model.num_layers=6", "2 x 2", "divisible by 4", "model.pipeline_layout"]),
    ("layers_fewer_than_stages", "model: {num_layers: 2}\nparallel: {pipeline: 4}\n", None,
     ValueError, ["model.num_layers=2", "divisible by 4"]),
    ("layout_stage_count", "model: {num_layers: 4, pipeline_layout: 'Et*2|t*2L'}\nparallel: {pipeline: 2, virtual: 2}\n",
     None, ValueError, ["model.pipeline_layout='Et*2|t*2L'", "2 stages", "parallel.virtual=2", "write 4 stages"]),
    ("layout_lacks_E", "model: {num_layers: 4, pipeline_layout: 't*2|t*2L'}\nparallel: {pipeline: 2}\n", None,
     ValueError, ["model.pipeline_layout='t*2|t*2L'", "lacks E", "open the first stage"]),
    ("layout_lacks_L", "model: {num_layers: 4, pipeline_layout: 'Et*2|t*2'}\nparallel: {pipeline: 2}\n", None,
     ValueError, ["model.pipeline_layout='Et*2|t*2'", "lacks L", "close the last stage"]),
    ("layout_empty_stage", "model: {num_layers: 4, pipeline_layout: 'Et*4||L'}\nparallel: {pipeline: 3}\n", None,
     ValueError, ["model.pipeline_layout='Et*4||L'", "stage 1 holds no layer", "move a layer onto it"]),
    ("layout_layer_count", "model: {num_layers: 4, pipeline_layout: 'Et*2|t*3L'}\nparallel: {pipeline: 2}\n", None,
     ValueError, ["model.pipeline_layout='Et*2|t*3L'", "5 decoder layers", "model.num_layers=4"]),
    ("layout_syntax", "model: {num_layers: 4, pipeline_layout: 'Et*2|x*2L'}\nparallel: {pipeline: 2}\n", None,
     ValueError, ["model.pipeline_layout='Et*2|x*2L'", "'x' at position", "e.g."]),
    ("precision_unknown", "model: {precision: fp16}\n", None, ValueError, ["model.precision='fp16'", "'bf16'"]),
    ("recompute_unknown", "model: {recompute: all}\n", None, ValueError, ["model.recompute='all'", "'selective'"]),
    ("kept_microbatches_without_recompute", "model: {recompute_kept_microbatches: 2}\n", None, ValueError,
     ["model.recompute_kept_microbatches=2", "model.recompute=", "remove"]),
    ("recompute_dropout_with_graphs", "model: {recompute: full, dropout: 0.1}\ncuda_graphs: {enabled: true}\n", None,
     ValueError, ["model.recompute=full", "model.dropout=0.1", "cuda_graphs.enabled=true", "set model.dropout=0"]),
    ("kept_microbatches_negative", "model: {recompute: full, recompute_kept_microbatches: -1}\n", None, ValueError,
     ["model.recompute_kept_microbatches=-1"]),
    ("world_not_pp_x_dp", "parallel: {pipeline: 2, data: 2}\n", 6,
     ValueError, ["world size 6", "2 x 2", "parallel.data"]),
    ("world_not_multiple_of_pp", "parallel: {pipeline: 4}\nmodel: {num_layers: 4}\n", 6,
     ValueError, ["world size 6", "parallel.pipeline=4"]),
    ("group_size_above_M", "parallel: {pipeline: 2, virtual: 2, microbatch_group_size_per_vp_stage: 8}\n"
     "training: {num_microbatches: 4}\n", None, ValueError,
     ["microbatch_group_size_per_vp_stage=8", "num_microbatches=4", "[2, 4]"]),
    ("group_size_below_pp", "parallel: {pipeline: 4, virtual: 2, microbatch_group_size_per_vp_stage: 2}\n"
     "model: {num_layers: 8}\ntraining: {num_microbatches: 8}\n", None, ValueError,
     ["microbatch_group_size_per_vp_stage=2", "[4, 8]"]),
    ("M_below_pp_interleaved", "parallel: {pipeline: 4, virtual: 2}\nmodel: {num_layers: 8}\n"
     "training: {num_microbatches: 3}\n", None, ValueError, ["training.num_microbatches=3", "num_microbatches >= 4"]),
    ("M_leftover_group_too_small", "parallel: {pipeline: 3, virtual: 2, microbatch_group_size_per_vp_stage: 3}\n"
     "model: {num_layers: 6}\ntraining: {num_microbatches: 7}\n", None, RuntimeError,
     ["training.num_microbatches=7", "last group of 1"]),
    ("eval_M_invalid_for_schedule", "parallel: {pipeline: 2, virtual: 2}\n"
     "training: {num_microbatches: 4, eval_microbatches: 3}\n", None, RuntimeError, ["training.eval_microbatches=3"]),
    ("unknown_key", "model: {num_layer: 4}\n", None, ValueError, ["model.num_layer", "num_layers"]),
    ("unknown_section", "optimiser: {lr: 0.1}\n", None, ValueError, ["'optimiser'", "optimizer"]),
    ("wrong_type_string_for_int", "training: {steps: ten}\n", None, TypeError, ["training.steps", "'ten'", "int"]),
    ("wrong_type_bool_for_int", "parallel: {pipeline: true}\n", None, TypeError, ["parallel.pipeline", "True"]),
    ("wrong_type_scalar_for_list", "data: {source: text, paths: corpus.txt}\n", None, TypeError,
     ["data.paths", "list"]),
    ("section_not_mapping", "model: 4\n", None, TypeError, ["'model'", "mapping"]),
    ("negative_micro_batch_size", "training: {micro_batch_size: -2}\n", None, ValueError,
     ["training.micro_batch_size=-2", ">= 1"]),
    ("zero_microbatches", "training: {num_microbatches: 0}\n", None, ValueError, ["training.num_microbatches=0"]),
    ("negative_hidden_size", "model: {hidden_size: -128}\n", None, ValueError, ["model.hidden_size=-128"]),
    ("negative_pipeline", "parallel: {pipeline: -1}\n", None, ValueError, ["parallel.pipeline=-1"]),
    ("negative_interval", "checkpoint: {interval: -5}\n", None, ValueError, ["checkpoint.interval=-5"]),
    ("missing_data_path", "data: {source: text, paths: [/nonexistent/pipecast/corpus.txt]}\n", None, ValueError,
     ["data.paths[0]", "/nonexistent/pipecast/corpus.txt", "does not exist"]),
    ("data_source_without_paths", "data: {source: bin}\n", None, ValueError, ["data.paths", "'bin'"]),
    ("heads_do_not_divide_hidden", "model: {hidden_size: 100, num_attention_heads: 3}\n", None, ValueError,
     ["model.hidden_size=100", "num_attention_heads=3"]),
    ("literal_not_allowed", "parallel: {backend: mpi}\n", None, ValueError, ["parallel.backend='mpi'", "'gloo'"]),
    ("timeout_not_positive", "parallel: {timeout_s: -1}\n", None, ValueError, ["parallel.timeout_s=-1"]),
    ("overlap_with_batched_p2p", "parallel: {pipeline: 2, virtual: 2, overlap_p2p_comm: true}\n", None, ValueError,
     ["overlap_p2p_comm", "batch_p2p_comm"]),
    ("lr_not_positive", "optimizer: {lr: 0.0}\n", None, ValueError, ["optimizer.lr=0.0"]),
    ("not_a_mapping", "- 1\n- 2\n", None, TypeError, ["mapping of sections", "list"]),
    ("invalid_yaml", "model: {num_layers: 4\n", None, ValueError, ["not valid YAML"]),
]


def _load_row(tmp_path: Path, text: str, world: int | None):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    config = load_config(path)
    if world is not None:
        validate_world_size(config, world)
    return config


@pytest.mark.parametrize("name,text,world,exc,parts", BAD_CONFIGS, ids=[r[0] for r in BAD_CONFIGS])
def test_bad_config_fails_before_any_process_group(name, text, world, exc, parts, tmp_path):
    import torch.distributed as dist
    messages = []
    for _ in range(2):  # what two ranks reading the same file would do
        with pytest.raises(exc) as info:
            _load_row(tmp_path, text, world)
        messages.append(str(info.value))
    assert messages[0] == messages[1], "validation must be deterministic: every rank raises the same error"
    message = messages[0]
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    assert _teaches(message) or name == "invalid_yaml", f"message gives no fix: {message!r}"
    assert not dist.is_initialized(), "validation must not create a process group"


def test_table_is_large_enough():
    assert len(BAD_CONFIGS) >= 15


def test_untrusted_yaml_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(path)
    path.write_text(f"model:\n  num_layers: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ValueError):  # an override is parsed with safe_load too
        load_config(None, [f"model.num_layers=!!python/object/apply:os.system ['touch {marker}']"])
    assert not marker.exists()


# ---- end to end: `pipecast train` exits non-zero, fast, with one clear line ------------------------------------

CLI_CASES = [
    # (id, YAML text, extra CLI args, extra env, substrings of the error line)
    ("layers", "model: {num_layers: 5}\nparallel: {pipeline: 2}\n", [], {}, ["model.num_layers=5"]),
    ("unknown_override", "parallel: {pipeline: 2}\n", ["--training.stepz=3"], {}, ["training.stepz"]),
    ("missing_data", "data: {source: text, paths: [/nonexistent/x.txt]}\n", [], {}, ["data.paths[0]"]),
    ("torchrun_world", "parallel: {pipeline: 2, data: 2}\n", [],
     {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     ["world size 3", "parallel.pipeline"]),
]


@pytest.mark.timeout(150)
def test_cli_refuses_bad_configs_before_any_rank_starts(tmp_path):
    """All cases run concurrently (independent processes); each ends on its own with one error line and no run
    folder (it is created only once validation passed, so its absence shows nothing started); a case that hung
    in a collective would meet the communicate timeout, which is far above what a refusal needs even on a busy
    machine (no assertion on the time itself)."""
    procs = []
    for name, text, args, env, parts in CLI_CASES:
        path = tmp_path / f"{name}.yaml"
        path.write_text(text + f"logging: {{run_dir: {tmp_path / name}}}\n")
        full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
        full_env.update(env)
        cmd = [sys.executable, "-m", "engine.cli", "train", str(path), *args]
        procs.append((name, parts,
                      subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)))
    for name, parts, proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 2, f"{name}: exit status {proc.returncode}; stderr:\n{err}"
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1, f"{name}: expected one error line, got:\n{err}"
        assert "Traceback" not in err, f"{name}: a traceback instead of a clear error:\n{err}"
        for part in parts:
            assert part in lines[0], f"{name}: {part!r} not in {lines[0]!r}"
        assert not (tmp_path / name).exists(), f"{name}: the run folder was created before validation failed"


# ---- the Megatron-style API: the same contract for Python callers ------------------------------------------------

def _api_rows():
    import torch

    from engine.model_parallel_config import ModelParallelConfig as MPC
    from engine.runtime.process_groups import build_process_groups
    from engine.plan.table import validate_interleaved_microbatches
    from engine.schedules import get_forward_backward_func
    f32 = torch.float32
    return [
        ("pp_zero", lambda: MPC(pipeline_model_parallel_size=0), ValueError,
         ["pipeline_model_parallel_size", "got 0", ">= 1"]),
        ("pp_wrong_type", lambda: MPC(pipeline_model_parallel_size="2"), TypeError,
         ["pipeline_model_parallel_size", "'2'", "int"]),
        ("pp_without_dtype", lambda: MPC(pipeline_model_parallel_size=2), ValueError, ["pipeline_dtype", "set "]),
        ("vp_zero", lambda: MPC(pipeline_model_parallel_size=2, pipeline_dtype=f32,
                                virtual_pipeline_model_parallel_size=0), ValueError,
         ["virtual_pipeline_model_parallel_size", "got 0"]),
        ("group_size_zero", lambda: MPC(pipeline_model_parallel_size=2, pipeline_dtype=f32,
                                        microbatch_group_size_per_vp_stage=0), ValueError,
         ["microbatch_group_size_per_vp_stage", "got 0"]),
        ("negative_checkpoint_count", lambda: MPC(num_microbatches_with_partial_activation_checkpoints=-1),
         ValueError, ["num_microbatches_with_partial_activation_checkpoints", "-1"]),
        ("group_size_out_of_range", lambda: validate_interleaved_microbatches(3, 4, 4), ValueError,
         ["microbatch_group_size_per_vp_stage=4", "num_microbatches=3", "pipeline_model_parallel_size=4"]),
        ("leftover_group", lambda: validate_interleaved_microbatches(7, 3, 3), RuntimeError,
         ["num_microbatches=7", "last group of 1"]),
        ("pipelining_without_process_group", lambda: build_process_groups(2), RuntimeError,
         ["pipeline_model_parallel_size=2", "init_process_group"]),
        ("vp_without_pp", lambda: get_forward_backward_func(None, 2), TypeError, ["vp_size=2", "pp_size"]),
    ]


def test_bad_api_arguments_raise_clear_errors():
    import torch.distributed as dist
    for name, call, exc, parts in _api_rows():
        with pytest.raises(exc) as info:
            call()
        message = str(info.value)
        assert all(p in message for p in parts), f"{name}: {parts} not all in {message!r}"
        assert _teaches(message) or "got" in message, f"{name}: message gives no fix: {message!r}"
    assert not dist.is_initialized()


def test_default_communication_timeout_is_short():
    """A lost peer must fail a job (and a CI run) in about a minute, not after torch's 30-minute default."""
    from engine.training.config import ParallelConfig, load_config
    assert 0 < ParallelConfig().timeout_s <= 60
    for preset in sorted((ROOT / "configs").glob("*.yaml")):
        assert load_config(preset, check=False).parallel.timeout_s <= 300, preset.name
