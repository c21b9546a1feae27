"""A model family registered from outside the package (:mod:`tests.training.models.tiny_family`, one file) works
everywhere a built-in one does: a YAML config names it, the ranks started by the spawner see it (they import this
module, which imports the family's), it trains under 1F1B and ZB-V at ``pipeline 2 x tensor 2`` (its own
tensor-parallel plan), and its checkpoint exports to a Hugging Face folder that ``model.init_from`` reads back.

One 4-rank gloo job trains both layouts for :data:`STEPS` steps; the reference is the same family's pp1 x tp1 run in
this process on the same global batch.  Tolerance :data:`TOL` as in tests/training/parallel/test_tensor_parallel.py
(the row-parallel all-reduce sums in another order than one matmul).
"""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from engine.training.config import load_config
from tests.helpers.distributed import run_ranks
from tests.training.models import tiny_family

STEPS = 2
TOL = 5e-5
CONFIG = {  # the YAML file every run reads (the layouts override parallel.*)
    "model": {"family": tiny_family.NAME, "num_layers": 4, "hidden_size": 16, "num_attention_heads": 4,
              "ffn_hidden_size": 24, "seq_length": 8, "vocab_size": 256},
    "data": {"max_bytes": 50_000},
    "training": {"micro_batch_size": 2, "num_microbatches": 4, "steps": STEPS, "eval_interval": 0},
    "optimizer": {"lr": 1e-2, "warmup_steps": 0, "grad_clip": 0.05},
    "logging": {"progress_bar": False, "level": "WARNING"},
}
LAYOUTS = {"1f1b": {"parallel.pipeline": 2, "parallel.tensor": 2, "parallel.schedule": "1f1b"},
           "zbv": {"parallel.pipeline": 2, "parallel.virtual": 2, "parallel.tensor": 2, "parallel.schedule": "zbv"}}


def _train(path, run_dir, layout: dict, save: bool = False) -> dict:
    """Losses and grad norms of :data:`STEPS` steps of the YAML config ``path`` under ``layout``; with ``save``
    the checkpoint written at the end."""
    from engine import Trainer
    config = load_config(path, {**layout, "logging.run_dir": str(run_dir)})
    with Trainer(config) as trainer:
        metrics = [trainer.train_step() for _ in range(STEPS)]
        checkpoint = trainer.save() if save else None
    return {"loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics],
            "checkpoint": str(checkpoint) if checkpoint else None}


def _job(rank, world, path, run_dir) -> dict:
    return {name: _train(path, f"{run_dir}/{name}", layout, save=name == "1f1b") for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("family")
    path = run_dir / "tiny.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    ref = _train(path, run_dir / "ref", {"parallel.pipeline": 1})
    return {"ref": ref, "ranks": run_ranks(_job, 4, path, run_dir, timeout=150), "dir": run_dir}


@pytest.mark.timeout(170)
def test_a_registered_family_trains_under_1f1b_and_zbv_with_tensor_parallel(runs):
    ref = runs["ref"]
    for rank, result in enumerate(runs["ranks"]):
        for name in LAYOUTS:
            assert result[name]["loss"] == pytest.approx(ref["loss"], rel=TOL), (name, rank)
            assert result[name]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL), (name, rank)
    print(f"{tiny_family.NAME}: pp1 losses {ref['loss']}, 1f1b / zbv at pp2 x tp2 within {TOL}")


@pytest.mark.timeout(170)
def test_a_registered_family_exports_to_hugging_face_and_inits_from_it(runs):
    from safetensors.torch import load_file

    from engine.training.checkpoint.hf import load_hf_weights
    from engine.training.export import export_hf
    from engine.training.generate import load_model, model_state_dict
    checkpoint, out = runs["ranks"][0]["1f1b"]["checkpoint"], runs["dir"] / "hf"
    export_hf(checkpoint, out)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "pipecast_tiny_relu2" and written["architectures"] == ["TinyRelu2ForCausalLM"]
    assert (written["num_hidden_layers"], written["intermediate_size"]) == (4, 24)
    ours = model_state_dict(load_model(checkpoint).model)
    tensors = load_file(str(out / "model.safetensors"))
    assert len(tensors) == len(ours) and "lm_head.weight" not in tensors  # tied: the head is the embedding
    assert torch.equal(tensors["model.layers.3.mlp_down.weight"], ours["layers.3.down.weight"].t())
    assert torch.equal(tensors["model.layers.0.q.weight"], ours["layers.0.q.weight"])

    config = load_config(None, {"model.init_from": str(out), "model.seq_length": 8, "data.max_bytes": 50_000,
                                "logging.run_dir": str(runs["dir"] / "init")})
    assert config.model.family == tiny_family.NAME
    assert (config.model.num_layers, config.model.hidden_size, config.model.ffn_hidden_size) == (4, 16, 24)
    back = load_hf_weights(out, config.model, list(ours))
    assert all(torch.equal(back[n], t) for n, t in ours.items())
