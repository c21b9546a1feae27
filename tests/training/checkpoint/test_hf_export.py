"""Hugging Face folders out and in (in-process): pipecast's model written by :func:`engine.training.checkpoint.hf.write_hf_folder`
loads in ``transformers`` with the same logits; ``config.json`` options pipecast cannot reproduce are refused."""
from __future__ import annotations

import json

import pytest
import torch

from engine.training.config import ConfigError, ModelConfig, load_config
from engine.training.checkpoint.hf import write_hf_folder
from engine.training.config.init_from import model_fields
from engine.training.models.chunk import build_model_chunks, canonical_module

CASES = [("gpt2", dict(tie_embeddings=True)), ("gpt2", dict(tie_embeddings=False, activation="gelu_tanh")),
         ("llama", dict(num_query_groups=2, tie_embeddings=False, rope_theta=500.0)), ("llama", dict())]


def _model(family, kw):
    cfg = ModelConfig(family=family, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                      vocab_size=300, **kw)
    (chunk,) = build_model_chunks(cfg, 64, 1, 0, 1, 7)
    with torch.no_grad():
        for p in chunk.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    return cfg, chunk.eval()


@pytest.mark.parametrize("family,kw", CASES)
def test_export_loads_in_transformers_with_equal_logits(tmp_path, family, kw):
    transformers = pytest.importorskip("transformers", reason="optional dependency transformers")
    cfg, chunk = _model(family, kw)
    write_hf_folder(tmp_path, cfg, 64, dict(canonical_module([chunk]).state_dict()))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (chunk(tokens).transpose(0, 1) - hf.eval()(tokens).logits).abs().max().item()
    print(f"{family} {kw}: logits max |diff| {diff:.3g}")
    assert diff <= 1e-5


def _folder(tmp_path, **changes):
    cfg, chunk = _model("llama", {})
    write_hf_folder(tmp_path, cfg, 64, dict(canonical_module([chunk]).state_dict()))
    data = json.loads((tmp_path / "config.json").read_text()) | changes
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("key,value", [("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
                                       ("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu"),
                                       ("head_dim", 16), ("model_type", "mistral"), ("sliding_window", 64)])
def test_unmappable_options_are_refused(key, value):
    data = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, key: value}
    with pytest.raises(ConfigError, match=key):
        model_fields(data)


def test_init_from_sets_fields_and_refuses_disagreement(tmp_path):
    folder = _folder(tmp_path / "hf")
    base = {"model.init_from": str(folder), "model.seq_length": 16, "logging.run_dir": str(tmp_path / "run")}
    config = load_config(None, base)
    assert (config.model.family, config.model.num_layers, config.model.hidden_size) == ("llama", 2, 32)
    with pytest.raises(ConfigError, match=r"model.num_layers=4 disagrees.*num_layers = 2"):
        load_config(None, base | {"model.num_layers": 4})
