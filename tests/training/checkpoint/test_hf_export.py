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


def _rewrite_header(path, change):
    """Rewrite the JSON header of the safetensors file ``path`` with ``change(header)`` (the data kept)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    change(header)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


def _retensor(path, change):
    """Rewrite the safetensors file ``path`` with ``change(tensors)`` (a whole, valid file)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


DAMAGE = {  # name -> (damage the folder, words of the one error line)
    "truncated": (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
                  ["model.safetensors' is truncated: 5,000 bytes", "again"]),
    "no header": (lambda f: (f / "model.safetensors").write_bytes(b"abc"), ["not a whole safetensors file"]),
    "bad header": (lambda f: (f / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{oops!!}"),
                   ["model.safetensors' has a damaged header"]),
    "longer": (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes() + b"x"),
               ["longer than its header describes"]),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), ["has no model.safetensors"]),
    "config not JSON": (lambda f: (f / "config.json").write_text("{oops"), ["config.json' is not readable JSON"]),
    "config value type": (lambda f: (f / "config.json").write_text(json.dumps(
        json.loads((f / "config.json").read_text()) | {"num_hidden_layers": "two"})),
        ["config.json has num_hidden_layers='two', not an integer"]),
    "rope not an object": (lambda f: (f / "config.json").write_text(json.dumps(
        json.loads((f / "config.json").read_text()) | {"rope_parameters": [1]})), ["rope_parameters=[1]"]),
    "wider config": (lambda f: (f / "config.json").write_text(json.dumps(
        json.loads((f / "config.json").read_text()) | {"intermediate_size": 128})),
        ["model.safetensors': tensor 'model.layers.0.mlp.gate_proj.weight' has shape [64, 32], but config.json's "
         "model needs [128, 32]"]),
    "integer dtype": (lambda f: _rewrite_header(f / "model.safetensors", lambda h: h["model.norm.weight"].update(
        dtype="I32")), ["tensor 'model.norm.weight' is I32, not floating point"]),
    "missing tensor": (lambda f: _retensor(f / "model.safetensors", lambda t: t.pop("model.norm.weight")),
                       ["tensors ['model.norm.weight'] (of 1) are missing"]),
    "extra tensor": (lambda f: _retensor(f / "model.safetensors", lambda t: t.update(
        {"model.extra.bias": torch.zeros(3)})), ["tensors ['model.extra.bias'] (of 1) have no place"]),
    "missing shard": (lambda f: ((f / "model.safetensors").rename(f / "a.safetensors"), (
        f / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "b.safetensors"}}))),
        ["b.safetensors' is missing"]),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_init_from_folder_is_refused_naming_the_file(tmp_path, capsys, case):
    """Issue 36: a truncated model.safetensors reached the ranks as a raw ``SafetensorError`` traceback (exit 1).
    Every damage to the folder (weights cut short or longer, a damaged header, a missing file or shard, config.json
    not JSON or with a value of another type, weights of another shape, an integer dtype, a missing or extra tensor)
    is a ConfigError from the config check, naming the file (or tensor) and the fix: ``pipecast train`` exits 2
    with that one line, before any rank starts."""
    from engine.cli import main
    from engine.training.checkpoint.init_from import check_init_weights
    damage, words = DAMAGE[case]
    folder = _folder(tmp_path / "hf")
    base = {"model.init_from": str(folder), "model.seq_length": 16, "logging.run_dir": str(tmp_path / "run")}
    check_init_weights(load_config(None, base))  # intact: accepted
    damage(folder)
    with pytest.raises(ConfigError) as info:  # the config check, then (the tensors against the model) the launcher's
        check_init_weights(load_config(None, base))
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    (tmp_path / "run.yaml").write_text("parallel: {pipeline: 1}\n")
    assert main(["train", str(tmp_path / "run.yaml"), f"--model.init_from={folder}", "--model.seq_length=16",
                 f"--logging.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words[0] in err, err


def test_init_from_accepts_both_families_and_a_sharded_folder(tmp_path):
    """The header checks pass on intact folders: gpt2 (its Conv1D weights stored transposed), llama, and a llama
    folder split into two shards with an index."""
    from engine.training.checkpoint.init_from import check_init_weights
    for family, kw in CASES[:3]:
        cfg, chunk = _model(family, kw)
        folder = tmp_path / f"{family}{len(kw)}"
        write_hf_folder(folder, cfg, 64, dict(canonical_module([chunk]).state_dict()))
        check_init_weights(load_config(None, {"model.init_from": str(folder), "model.seq_length": 16}))
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({k: tensors[k] for k in part}, folder / file)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, part in halves.items() for k in part}}))
    check_init_weights(load_config(None, {"model.init_from": str(folder), "model.seq_length": 16}))
