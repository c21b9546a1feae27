"""The ``llama`` family (Touvron et al. 2023, arXiv:2302.13971): token embedding only, pre-norm blocks with RMSNorm,
rotary position embeddings, grouped-query attention, a SwiGLU MLP, no biases.  Its torch modules are in
:mod:`.layers` (imported when a model is built; this entry is read when a config is loaded, without torch).

Hugging Face: ``LlamaForCausalLM`` (``transformers`` ``models/llama/modeling_llama.py`` and
``configuration_llama.py``: module names, rotate-half rotary on q / k as stored, keys and defaults).
``embedding.word`` -> ``model.embed_tokens``, ``layers.<i>.*`` -> ``model.layers.<i>.*`` (the same module names),
``final_norm`` -> ``model.norm``, an untied head -> ``lm_head``.
"""
from __future__ import annotations

from ..registry import FamilySpec, HuggingFace, hf_value, register_family, unsupported

__all__ = ["SPEC"]


def _layers():
    from . import layers  # torch: imported when a model is built
    return layers


def _check(m) -> str | None:
    head = m.hidden_size // m.num_attention_heads
    if head % 2:
        return (f"model.family=llama: the head size hidden_size / num_attention_heads = {m.hidden_size} / "
                f"{m.num_attention_heads} = {head} must be even for rotary embeddings; change model.hidden_size or "
                "model.num_attention_heads")
    if m.activation != "gelu":
        return (f"model.activation={m.activation!r} applies to model.family=gpt2 only (llama's MLP is SwiGLU); "
                "remove it")
    return None


_RULES = (  # (pipecast name pattern, Hugging Face name, transposed)
    (r"embedding\.word\.weight", "model.embed_tokens.weight", False),
    (r"layers\.(\d+)\.((?:input_layernorm|post_attention_layernorm)\.weight)", r"model.layers.\1.\2", False),
    (r"layers\.(\d+)\.((?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight)", r"model.layers.\1.\2", False),
    (r"final_norm\.weight", "model.norm.weight", False),
    (r"output_head\.word\.weight", "lm_head.weight", False),
)


def _hf_config(cfg, ffn_hidden_size: int) -> dict:
    heads = cfg.num_attention_heads
    return {"num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "intermediate_size": ffn_hidden_size, "num_attention_heads": heads,
            "num_key_value_heads": cfg.num_query_groups or heads, "head_dim": cfg.hidden_size // heads,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings or cfg.seq_length,
            "rms_norm_eps": cfg.norm_epsilon, "rope_theta": cfg.rope_theta, "rope_scaling": None,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.dropout, "pretraining_tp": 1}


def _rope_theta(hf: dict) -> float:
    """``rope_theta`` (transformers 4) or ``rope_parameters.rope_theta`` (5); scaled variants refused."""
    params = hf_value(hf, "rope_parameters", {}, dict)
    scaling = hf_value(hf, "rope_scaling", {}, dict)
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        kind = value.get("rope_type", value.get("type", "default"))
        if value and kind != "default":
            raise unsupported(key, value, "rotary scaling (YaRN, linear, dynamic, llama3) is not implemented")
    return hf_value(hf, "rope_theta", hf_value(params, "rope_theta", 10000.0, float), float)


def _hf_fields(hf: dict) -> dict:
    """The architecture of a ``LlamaConfig``."""
    checks = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1),
              ("sliding_window", None), ("use_sliding_window", False))
    for key, want in checks:
        if hf.get(key, want) not in (want,) + ((None,) if key == "pretraining_tp" else ()):
            raise unsupported(key, hf[key], f"pipecast's llama has {key}={want}")
    hidden, heads = hf_value(hf, "hidden_size", 4096), hf_value(hf, "num_attention_heads", 32)
    if hf_value(hf, "head_dim", None) not in (None, hidden // max(heads, 1)):
        raise unsupported("head_dim", hf["head_dim"], f"pipecast's head size is hidden_size / num_attention_heads "
                          f"= {hidden // max(heads, 1)}")
    groups = hf_value(hf, "num_key_value_heads", 0) or heads
    return {"num_layers": hf_value(hf, "num_hidden_layers", 32), "hidden_size": hidden, "num_attention_heads": heads,
            "num_query_groups": None if groups == heads else groups,
            "ffn_hidden_size": hf_value(hf, "intermediate_size", 11008),
            "vocab_size": hf_value(hf, "vocab_size", 32000),
            "norm_epsilon": hf_value(hf, "rms_norm_eps", 1e-6, float), "rope_theta": _rope_theta(hf),
            "max_position_embeddings": hf_value(hf, "max_position_embeddings", 2048),
            "tie_embeddings": hf_value(hf, "tie_word_embeddings", False, bool), "activation": "gelu"}


def _memory(cfg, ffn_hidden_size: int) -> dict:
    """Per token: what one block saves for its backward and a pending ``W`` holds (:mod:`engine.training.memory`;
    the keys of :func:`engine.training.models.gpt2._memory`).

    Saved (``h`` hidden, ``f`` MLP width, ``a`` heads, ``s`` sequence): the residual stream -- each RMSNorm's
    input, normalized input and ``rsqrt``, ``2 x (2h + 1)`` -- ; the norm outputs the projections read, ``2h``;
    sharded over tensor ranks: the rotated queries and keys, the values (grouped-query heads expanded to ``a``) and
    the attention output ``4h`` plus its log-sum-exp ``a`` (with dropout the math attention's ``3as`` instead), and
    SwiGLU's gate, SiLU, up and product ``4f``.  The rotary tables are buffers (not per microbatch).  The final
    RMSNorm saves ``3h + 1``.  A pending ``W`` holds ``10h + 2kv + 3f`` per block (``kv`` the key / value width;
    ``8h`` of it replicated), ``2h`` for the final norm, ``h`` for the embedding.
    """
    h, f, a, s = cfg.hidden_size, ffn_hidden_size, cfg.num_attention_heads, cfg.seq_length
    kv = h * (cfg.num_query_groups or a) // a
    return {"residual": 4 * h + 2, "gathered": 2 * h, "sharded": 4 * h + (3 * a * s if cfg.dropout else a) + 4 * f,
            "core": 3 * a * s if cfg.dropout else a, "fp32_residual": 4 * h + 2, "fp32_sharded": 0 if cfg.dropout else a,
            "fp32_final_norm": 2 * h + 1, "embedding": 0, "final_norm": 3 * h + 1, "w_replicated": 8 * h,
            "w_sharded": 2 * h + 2 * kv + 3 * f,
            "w_embedding": h, "w_final_norm": 2 * h}


SPEC = register_family(FamilySpec(
    name="llama",
    summary="rotary, RMSNorm, SwiGLU, grouped-query attention, no biases",
    embedding=lambda cfg: _layers().Embedding(cfg),
    block=lambda cfg, ffn_hidden_size: _layers().Block(cfg, ffn_hidden_size),
    final_norm=lambda cfg: _layers().final_norm(cfg),
    tensor_parallel={"input_layernorm": "norm", "post_attention_layernorm": "norm", "self_attn.q_proj": "colwise",
                     "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
                     "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"},
    check=_check,
    hf=HuggingFace(model_type="llama", architectures=("LlamaForCausalLM", "LlamaModel"), prefix="model.",
                   rules=_RULES, config=_hf_config, fields=_hf_fields),
    memory=_memory,
    attention_core="self_attn.core",
))
