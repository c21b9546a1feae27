"""Hugging Face folders through real pipelined runs: a folder written by ``transformers``' own ``save_pretrained``
(GPT-2 and Llama built from configs, no download) starts a run with ``model.init_from`` on 2 gloo ranks under
1F1B, interleaved 1F1B and ZB-V; the step-0 loss equals the loss ``transformers`` computes on the same batch; the
checkpoint of the pp2 / pp2 x vp2 run exported with ``--format hf`` loads in ``transformers`` with the trained
weights (bitwise) and the logits of pipecast's model of that checkpoint; and a run whose update is below fp32
resolution exports bitwise the tensors it started from (HF -> pipecast -> HF).

The reference is ``transformers`` itself: its forward on the tokens the first stage saw and the labels the last
stage saw (``labels`` are pipecast's already shifted targets, so the loss is a plain mean cross entropy).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.training.config import load_config
from tests.helpers.distributed import run_ranks
from tests.training.test_trainer_reference import _array, _record_inputs, global_batch

transformers = pytest.importorskip("transformers", reason="optional dependency transformers (dev extra)")


LAYOUTS = {"1f1b": {"parallel.schedule": "1f1b"},
           "interleaved": {"parallel.schedule": "interleaved", "parallel.virtual": 2},
           "zbv": {"parallel.schedule": "zbv", "parallel.virtual": 2}}
LOSS_TOL = 1e-6  # relative, fp32: pipecast and transformers order the attention and norm arithmetic differently
LOGITS_TOL = 1e-5


def _hf_model(family: str):
    """A 4-layer model built from a config with every tensor perturbed (no zero biases, norms not all ones)."""
    torch.manual_seed(3)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=4, n_embd=16, n_head=4, vocab_size=256, n_positions=16,
                                      activation_function="gelu_new", tie_word_embeddings=True,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=16, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=24, vocab_size=256,
                                       max_position_embeddings=16, rope_theta=500.0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _overrides(folder, run_dir, layout: dict, lr: float) -> dict:
    return {"model.init_from": str(folder), "model.seq_length": 8, "data.max_bytes": 50_000,
            "training.micro_batch_size": 2, "training.num_microbatches": 4, "training.steps": 1,
            "training.eval_interval": 0, "optimizer.lr": lr, "optimizer.min_lr": 0.0, "optimizer.warmup_steps": 0,
            "optimizer.grad_clip": 0.0, "parallel.pipeline": 2, "logging.progress_bar": False,
            "logging.level": "WARNING", "logging.run_dir": str(run_dir), **layout}


def _run(folder, run_dir, layout: dict, lr: float) -> dict:
    """One step from ``folder``; the step-0 loss and batch, the checkpoint, the trained canonical parameters."""
    from engine import Trainer
    with Trainer(load_config(None, _overrides(folder, run_dir, layout, lr))) as trainer:
        seen = {"tokens": [], "labels": []}
        for chunk in trainer.model:
            _record_inputs(chunk, seen)
        loss = trainer.train_step()["loss"]
        for chunk in trainer.model:
            del chunk.forward
        path = trainer.save()
        params = {n: _array(p) for n, p in trainer.canonical.named_parameters()}
    return {"steps": [seen | {"loss": loss, "dp_rank": trainer.dp_rank}], "checkpoint": str(path), "params": params}


def _job(rank, world, folders: dict, run_dir) -> dict:
    out = {f"{family}/{name}": _run(folder, f"{run_dir}/{family}_{name}", layout, 1e-2)
           for family, folder in folders.items() for name, layout in LAYOUTS.items()}
    out["llama/roundtrip"] = _run(folders["llama"], f"{run_dir}/roundtrip", LAYOUTS["zbv"], 1e-30)
    out["llama/resume"] = _resume(folders["llama"], f"{run_dir}/resume")
    return out


def _resume(folder, run_dir, steps: int = 4, cut: int = 2) -> dict:
    """The llama family under ZB-V: ``steps`` straight, and ``cut`` steps saved then resumed by a fresh trainer."""
    from engine import Trainer
    config = load_config(None, _overrides(folder, f"{run_dir}/straight", LAYOUTS["zbv"], 1e-2)
                         | {"training.steps": steps})
    with Trainer(config) as trainer:
        straight = [trainer.train_step()["loss"] for _ in range(steps)]
    config = load_config(None, _overrides(folder, f"{run_dir}/cut", LAYOUTS["zbv"], 1e-2) | {"training.steps": steps})
    with Trainer(config) as trainer:
        first = [trainer.train_step()["loss"] for _ in range(cut)]
        path = trainer.save()
    with Trainer(config) as trainer:
        trainer.load(path)
        rest = [trainer.train_step()["loss"] for _ in range(steps - cut)]
        final = trainer.save()
    return {"straight": straight, "resumed": first + rest, "checkpoint": str(final)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_roundtrip")
    folders = {}
    for family in ("gpt2", "llama"):
        folders[family] = root / f"hf_{family}"
        _hf_model(family).save_pretrained(folders[family])  # safetensors, as a downloaded folder
    per_rank = run_ranks(_job, 2, folders, root / "runs", timeout=170)
    return folders, {case: [r[case] for r in per_rank] for case in per_rank[0]}


def _hf_loss(model, tokens, labels) -> float:
    with torch.no_grad():
        logits = model(tokens).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_init_from_gives_transformers_step0_loss(runs, family, layout):
    folders, results = runs
    per_rank = results[f"{family}/{layout}"]
    tokens, labels = global_batch([r["steps"] for r in per_rank], 0)
    want = _hf_loss(transformers.AutoModelForCausalLM.from_pretrained(folders[family]).eval(), tokens, labels)
    got = per_rank[-1]["steps"][0]["loss"]
    print(f"{family} {layout}: step-0 loss {got:.6f} vs transformers {want:.6f} (|diff| {abs(got - want):.2g})")
    assert abs(got - want) <= LOSS_TOL * abs(want)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", ["1f1b", "interleaved"])
def test_export_of_a_pipelined_checkpoint_loads_in_transformers(runs, tmp_path, family, layout):
    from engine.training.export import export_hf
    from engine.training.generate import load_model
    _, results = runs
    per_rank = results[f"{family}/{layout}"]
    export_hf(per_rank[0]["checkpoint"], tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    trained = {n: v for r in per_rank for n, v in r["params"].items()}  # each rank's chunks, canonical names
    loaded = load_model(per_rank[0]["checkpoint"])
    for name, value in loaded.model.state_dict().items():
        if name in trained:
            assert np.array_equal(value.numpy(), trained[name]), name
    tokens = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (loaded.model(tokens).transpose(0, 1) - hf(tokens).logits).abs().max().item()
    print(f"{family} {layout} (pp2{' x vp2' if layout == 'interleaved' else ''}): logits max |diff| {diff:.3g}")
    assert diff <= LOGITS_TOL


@pytest.mark.timeout(200)
def test_llama_resumes_exactly_and_samples(runs):
    from engine.training.generate import generate, load_model
    _, results = runs
    for r in results["llama/resume"]:
        assert r["resumed"] == r["straight"], (r["resumed"], r["straight"])
    loaded = load_model(results["llama/resume"][0]["checkpoint"])
    assert loaded.step == 4 and loaded.config.family == "llama"
    prompt = list(b"the ")
    tokens = generate(loaded.model, prompt, 12, temperature=0.8, seed=5)
    assert len(tokens) == 12 and all(0 <= t < loaded.config.vocab_size for t in tokens)
    assert tokens == generate(loaded.model, prompt, 12, temperature=0.8, seed=5)  # seeded: reproducible
    greedy = generate(loaded.model, prompt, 2, temperature=0.0)
    with torch.no_grad():  # greedy picks the argmax of the model's own next-token logits ([s, b, V])
        logits = loaded.model(torch.tensor([prompt + greedy[:1]]))[:, 0]
    assert greedy == [int(logits[-2].argmax()), int(logits[-1].argmax())]


@pytest.mark.timeout(200)
def test_hf_to_pipecast_to_hf_is_bitwise(runs, tmp_path):
    from safetensors.torch import load_file
    from engine.training.export import export_hf
    folders, results = runs
    export_hf(results["llama/roundtrip"][0]["checkpoint"], tmp_path / "out")
    before, after = load_file(folders["llama"] / "model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert sorted(before) == sorted(after)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, changed
