"""The ``gpt2`` family (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"; nanoGPT's
``model.py`` has the same structure): token + learned position embedding, pre-norm blocks with LayerNorm, one fused
QKV projection, causal softmax attention and a GELU MLP, biases everywhere.  Its torch modules are in
:mod:`.layers` (imported when a model is built; this entry is read when a config is loaded, without torch).

Hugging Face: ``GPT2LMHeadModel`` (``transformers`` ``models/gpt2/modeling_gpt2.py`` and ``configuration_gpt2.py``:
module names, keys and defaults).  ``embedding.word`` -> ``transformer.wte``, ``embedding.pos`` ->
``transformer.wpe``, ``layers.<i>.ln1 / qkv / proj / ln2 / fc1 / fc2`` -> ``transformer.h.<i>.ln_1 / attn.c_attn /
attn.c_proj / ln_2 / mlp.c_fc / mlp.c_proj``, ``final_norm`` -> ``transformer.ln_f``, an untied head ->
``lm_head``.  Its ``Conv1D`` layers store weights as ``[in, out]`` (transposed here).
"""
from __future__ import annotations

from ..registry import FamilySpec, HuggingFace, hf_value, register_family, unsupported

__all__ = ["SPEC"]


def _layers():
    from . import layers  # torch: imported when a model is built
    return layers


def _check(m) -> str | None:
    groups = m.num_query_groups
    if groups is not None and groups != m.num_attention_heads:
        return (f"model.num_query_groups={groups} needs model.family=llama (gpt2 attention has one key / value head "
                "per query head); remove it or set model.family=llama")
    return None


# (pipecast name pattern, Hugging Face name, transposed)
_RULES = (
    (r"embedding\.word\.weight", "transformer.wte.weight", False),
    (r"embedding\.pos\.weight", "transformer.wpe.weight", False),
    (r"layers\.(\d+)\.ln1\.(weight|bias)", r"transformer.h.\1.ln_1.\2", False),
    (r"layers\.(\d+)\.ln2\.(weight|bias)", r"transformer.h.\1.ln_2.\2", False),
    (r"layers\.(\d+)\.qkv\.weight", r"transformer.h.\1.attn.c_attn.weight", True),
    (r"layers\.(\d+)\.qkv\.bias", r"transformer.h.\1.attn.c_attn.bias", False),
    (r"layers\.(\d+)\.proj\.weight", r"transformer.h.\1.attn.c_proj.weight", True),
    (r"layers\.(\d+)\.proj\.bias", r"transformer.h.\1.attn.c_proj.bias", False),
    (r"layers\.(\d+)\.fc1\.weight", r"transformer.h.\1.mlp.c_fc.weight", True),
    (r"layers\.(\d+)\.fc1\.bias", r"transformer.h.\1.mlp.c_fc.bias", False),
    (r"layers\.(\d+)\.fc2\.weight", r"transformer.h.\1.mlp.c_proj.weight", True),
    (r"layers\.(\d+)\.fc2\.bias", r"transformer.h.\1.mlp.c_proj.bias", False),
    (r"final_norm\.(weight|bias)", r"transformer.ln_f.\1", False),
    (r"output_head\.word\.weight", "lm_head.weight", False),
)
_GELU = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}  # config.json -> activation


def _hf_config(cfg, ffn_hidden_size: int) -> dict:
    positions = cfg.max_position_embeddings or cfg.seq_length
    return {"n_layer": cfg.num_layers, "n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads,
            "n_inner": ffn_hidden_size, "n_positions": positions, "n_ctx": positions,
            "layer_norm_epsilon": cfg.norm_epsilon,
            "activation_function": "gelu_pytorch_tanh" if cfg.activation == "gelu_tanh" else "gelu",
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


def _hf_fields(hf: dict) -> dict:
    """The architecture of a ``GPT2Config`` (``rope_theta`` is left as it is: no rotary embedding here)."""
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU:
        raise unsupported("activation_function", act, f"supported: {', '.join(_GELU)}")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if hf.get(key, want) != want:
            raise unsupported(key, hf[key], f"pipecast's gpt2 attention has {key}={want}")
    hidden = hf_value(hf, "n_embd", 768)
    return {"num_layers": hf_value(hf, "n_layer", 12), "hidden_size": hidden,
            "num_attention_heads": hf_value(hf, "n_head", 12), "num_query_groups": None,
            "ffn_hidden_size": hf_value(hf, "n_inner", 0) or 4 * hidden,
            "vocab_size": hf_value(hf, "vocab_size", 50257),
            "norm_epsilon": hf_value(hf, "layer_norm_epsilon", 1e-5, float),
            "max_position_embeddings": hf_value(hf, "n_positions", 1024),
            "tie_embeddings": hf_value(hf, "tie_word_embeddings", True, bool), "activation": _GELU[act]}


def _memory(cfg, ffn_hidden_size: int) -> dict:
    """Per token: what one block saves for its backward and a pending ``W`` holds (:mod:`engine.training.memory`).

    Saved (``h`` hidden, ``f`` MLP width, ``a`` heads, ``s`` sequence; Korthikanti et al. 2022, arXiv:2205.05198,
    section 4, counted for these modules and torch's kernels): the residual stream -- block input and mid-block sum
    ``2h``, the LayerNorms' mean and rstd ``4``, with dropout its two masks ``2h`` -- ; the LayerNorm outputs the
    column-parallel projections read, ``2h``; sharded over tensor ranks: ``qkv`` ``3h``, the attention output ``h``
    and its log-sum-exp ``a`` (flash attention; with dropout the math attention's scores, probabilities and mask
    ``3as`` instead of the log-sum-exp), ``fc1`` and GELU outputs ``2f``.  The final LayerNorm saves its input,
    statistics and output, ``2h + 2``; the embedding with dropout its mask ``h``.  A pending ``W`` holds each
    projection's and norm's input and output gradient: ``12h + 2f`` per block (the four projections' replicated
    inputs or outputs and the norms' ``8h``), ``2h`` for the final norm, ``h`` for the embedding.
    """
    h, f, a, s = cfg.hidden_size, ffn_hidden_size, cfg.num_attention_heads, cfg.seq_length
    core = 3 * a * s if cfg.dropout else a  # what the attention core alone saves (selective recomputation drops it)
    return {"residual": 2 * h + 4 + (2 * h if cfg.dropout else 0), "gathered": 2 * h,
            "sharded": 4 * h + core + 2 * f, "core": core, "fp32_sharded": 0 if cfg.dropout else a,
            "embedding": h if cfg.dropout else 0,
            "final_norm": 2 * h + 2, "w_replicated": 8 * h, "w_sharded": 4 * h + 2 * f, "w_embedding": h,
            "w_final_norm": 2 * h}


SPEC = register_family(FamilySpec(
    name="gpt2",
    summary="learned positions, LayerNorm, GELU, biases",
    embedding=lambda cfg: _layers().Embedding(cfg),
    block=lambda cfg, ffn_hidden_size: _layers().Block(cfg, ffn_hidden_size),
    final_norm=lambda cfg: _layers().final_norm(cfg),
    tensor_parallel={"ln1": "norm", "qkv": "fused_qkv", "proj": "rowwise", "ln2": "norm", "fc1": "colwise",
                     "fc2": "rowwise"},
    check=_check,
    transformer_engine=True,
    hf=HuggingFace(model_type="gpt2", architectures=("GPT2LMHeadModel", "GPT2Model"), prefix="transformer.",
                   rules=_RULES, config=_hf_config, fields=_hf_fields),
    memory=_memory,
    attention_core="core",
))
