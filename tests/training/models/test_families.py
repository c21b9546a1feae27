"""The model-family registry (pure, in-process): a family is named only inside ``engine/training/models/``, the
registry refuses clashes and unknown tensor-parallel styles, and each family's checks name the field, the value and
the fix before any rank starts."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.training.config import ConfigError, load_config
from engine.training.models import FamilySpec, family_names, get_family, register_family

ROOT = Path(__file__).resolve().parents[3]
MODELS = ROOT / "engine" / "training" / "models"


def built_in_names() -> set[str]:
    """Every name of the families the package registers: the ``model.family`` value and the Hugging Face
    ``model_type`` and architectures."""
    names = set()
    for spec in map(get_family, family_names()):
        if spec.block.__module__.startswith("engine.training.models."):
            names.add(spec.name)
            if spec.hf is not None:
                names.update({spec.hf.model_type, *spec.hf.architectures})
    return names


def naming_a_family(sources: dict[str, str], names: set[str]) -> list[str]:
    """``path:line: name`` wherever one of ``names`` stands as a word in ``sources`` (path -> text; any case)."""
    pattern = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, sorted(names))) + r")(?![A-Za-z0-9_])",
                         re.IGNORECASE)
    return [f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for path, text in sources.items()
            for m in pattern.finditer(text)]


def _sources_outside_models() -> dict[str, str]:
    paths = [*(ROOT / "engine").rglob("*.py"), *(ROOT / "graphs").rglob("*.py")]
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(paths) if MODELS not in p.parents}


def test_no_module_outside_models_names_a_built_in_family():
    names = built_in_names()
    assert {"gpt2", "llama", "GPT2LMHeadModel", "LlamaForCausalLM"} <= names
    assert naming_a_family(_sources_outside_models(), names) == []


def test_the_family_name_scan_catches_a_planted_name():
    """Negative control: ``"llama"`` (or an architecture name) planted in metrics.py is found, by line."""
    metrics = (ROOT / "engine" / "training" / "metrics.py").read_text()
    planted = {"engine/training/metrics.py": metrics + 'if cfg.family == "llama":\n    pass\n',
               "engine/training/export.py": "# loads as GPT2LMHeadModel\n"}
    found = naming_a_family(planted, built_in_names())
    assert [f.rsplit(": ", 1)[1] for f in found] == ["llama", "GPT2LMHeadModel"], found
    assert found[0].startswith(f"engine/training/metrics.py:{metrics.count(chr(10)) + 1}:")


def _spec(name: str, **kw) -> FamilySpec:
    gpt2 = get_family("gpt2")
    return FamilySpec(name=name, summary="", embedding=gpt2.embedding, block=kw.pop("block", gpt2.block),
                      final_norm=gpt2.final_norm, **kw)


def test_the_registry_refuses_a_clash_and_unknown_styles():
    with pytest.raises(ValueError, match="already registered"):
        register_family(_spec("llama", block=lambda cfg, ffn: None))  # from this module, not the package's
    with pytest.raises(ValueError, match="tensor_parallel styles"):
        _spec("test_bad_style", tensor_parallel={"qkv": "diagonal"})
    with pytest.raises(ValueError, match="a word"):
        _spec("test bad name")
    with pytest.raises(TypeError):
        register_family("gpt2")
    with pytest.raises(ValueError, match=r"model.family='nope' is unknown; use one of gpt2, llama"):
        get_family("nope")


@pytest.mark.parametrize("overrides,words", [
    ({"model.family": "nope"}, ["model.family='nope' is not allowed", "'gpt2' | 'llama'", "register_family"]),
    ({"model.num_query_groups": 2}, ["model.num_query_groups=2", "model.family=llama"]),
    ({"model.family": "llama", "model.hidden_size": 12, "model.num_attention_heads": 4},
     ["model.family=llama", "head size", "= 3 must be even"]),
    ({"model.family": "llama", "model.activation": "gelu_tanh"}, ["model.activation='gelu_tanh'", "SwiGLU"]),
    ({"model.family": "llama", "model.transformer_engine": True},
     ["model.transformer_engine=true with model.family=llama", "model.family=gpt2"]),
])
def test_family_checks_name_the_field_value_and_fix(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_a_family_without_a_tensor_parallel_plan_is_refused_at_tensor_2():
    register_family(_spec("test_no_tp"))
    try:
        load_config(None, {"model.family": "test_no_tp"})  # fine at tensor 1
        with pytest.raises(ConfigError, match=r"parallel.tensor=2 with model.family=test_no_tp: the family gives no "
                                              r"tensor-parallel plan"):
            load_config(None, {"model.family": "test_no_tp", "parallel.tensor": 2})
    finally:
        from engine.training.models import registry
        registry._REGISTRY.pop("test_no_tp", None)
