"""The ``llama_moe`` family: llama blocks (:mod:`engine.training.models.llama`) whose MLP is a mixture of experts
(``model.moe``, :mod:`engine.moe`) in the MoE layers -- a top-k router, SwiGLU experts split over
``parallel.expert`` ranks, optional shared experts -- and llama's SwiGLU MLP in the others.  Its torch modules are in
:mod:`.layers`.

Why a family of its own and not a ``llama`` option: a family is one Hugging Face architecture
(:attr:`~engine.training.models.registry.FamilySpec.hf`, and ``model.init_from`` picks the family by
``config.json``'s ``model_type``); an MoE run is written as ``MixtralForCausalLM`` and a dense one as
``LlamaForCausalLM``, and the dense family's entry stays as it is.

Hugging Face: ``MixtralForCausalLM`` (``transformers`` ``models/mixtral``: llama's attention, norms and rotary, and
``block_sparse_moe`` = a softmax top-k router ``gate`` whose chosen probabilities are renormalised, and SwiGLU
experts ``w1`` (gate), ``w3`` (up), ``w2`` (down); the per-expert tensor names are those of the published Mixtral
checkpoints, which ``transformers`` 4 loads as they are and 5 fuses on load).  Chosen over Qwen3-MoE (its attention
normalises queries and keys, which llama's does not) and DeepSeek-V3 (multi-head latent attention): Mixtral's
decoder is llama's.  Mixtral has no shared experts, no dense layers, no sigmoid router and no capacity limit, so a
run using one of them is refused at export (naming the field).
"""
from __future__ import annotations

import json

from ..llama import SPEC as LLAMA
from ..registry import FamilySpec, HuggingFace, hf_value, register_family, unsupported

__all__ = ["SPEC"]


def _layers():
    from . import layers  # torch: imported when a model is built
    return layers


def _check(m) -> str | None:
    if m.moe is None:
        return ("model.family=llama_moe needs a model.moe section (e.g. model.moe: {num_experts: 8, top_k: 2}); "
                "set it, or use model.family=llama for a dense model")
    return LLAMA.check(m)


_RULES = LLAMA.hf.rules + (  # (pipecast name pattern, Hugging Face name, transposed)
    (r"layers\.(\d+)\.moe\.router\.linear\.weight", r"model.layers.\1.block_sparse_moe.gate.weight", False),
    (r"layers\.(\d+)\.moe\.experts\.(\d+)\.gate_proj\.weight", r"model.layers.\1.block_sparse_moe.experts.\2.w1.weight",
     False),
    (r"layers\.(\d+)\.moe\.experts\.(\d+)\.down_proj\.weight", r"model.layers.\1.block_sparse_moe.experts.\2.w2.weight",
     False),
    (r"layers\.(\d+)\.moe\.experts\.(\d+)\.up_proj\.weight", r"model.layers.\1.block_sparse_moe.experts.\2.w3.weight",
     False),
)


_MIXTRAL = (("first_dense_layers", 0, "every Mixtral layer is a MoE layer"),
            ("layer_freq", 1, "every Mixtral layer is a MoE layer"),
            ("shared_experts", 0, "Mixtral has no shared experts"),
            ("router", "softmax", "Mixtral's router is a softmax"),
            ("normalize_top_k", True, "Mixtral renormalises the chosen probabilities"),
            ("capacity_factor", None, "Mixtral drops no token"))
"""``(model.moe field, the value Mixtral has, why)``: what an export as ``MixtralForCausalLM`` needs."""


def _mixtral_refusal(cfg) -> str | None:
    """Why ``cfg`` cannot be written as a Mixtral model (None: it can)."""
    for key, want, why in _MIXTRAL:
        value = getattr(cfg.moe, key)
        if value != want:
            return (f"model.moe.{key}={json.dumps(value)} cannot be exported as Hugging Face MixtralForCausalLM "
                    f"({why}); export with --format safetensors (pipecast's names), or train with "
                    f"model.moe.{key}={json.dumps(want)}")
    return None


def _hf_config(cfg, ffn_hidden_size: int) -> dict:
    """Mixtral's ``config.json`` keys (``MixtralConfig``).

    Raises:
        ValueError: a ``model.moe`` setting Mixtral cannot express (:func:`_mixtral_refusal`)."""
    why = _mixtral_refusal(cfg)
    if why is not None:
        raise ValueError(why)
    out = LLAMA.hf.config(cfg, ffn_hidden_size)
    for key in ("attention_bias", "mlp_bias", "pretraining_tp"):  # LlamaConfig's, not MixtralConfig's
        out.pop(key)
    moe = cfg.moe
    return out | {"intermediate_size": moe.ffn_hidden_size or ffn_hidden_size, "num_local_experts": moe.num_experts,
                  "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coeff,
                  "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None}


def _hf_fields(hf: dict) -> dict:
    """The architecture of a ``MixtralConfig``: llama's fields and the ``moe`` section."""
    if hf_value(hf, "router_jitter_noise", 0.0, float):
        raise unsupported("router_jitter_noise", hf["router_jitter_noise"], "pipecast's router has no jitter")
    defaults = {"intermediate_size": 14336, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
                "num_key_value_heads": 8}  # MixtralConfig's, where LlamaConfig's differ
    plain = {k: v for k, v in hf.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    plain = {k: v for k, v in defaults.items() if hf.get(k) is None} | plain
    if hf.get("rope_theta") is None and hf.get("rope_parameters") is None:
        plain["rope_theta"] = 1e6  # MixtralConfig's default base
    fields = LLAMA.hf.fields(plain)
    moe = {"num_experts": hf_value(hf, "num_local_experts", 8), "top_k": hf_value(hf, "num_experts_per_tok", 2),
           "ffn_hidden_size": fields["ffn_hidden_size"], "router": "softmax", "normalize_top_k": True,
           "aux_loss_coeff": hf_value(hf, "router_aux_loss_coef", 0.001, float)}
    return fields | {"moe": moe}


def _memory(cfg, ffn_hidden_size: int) -> dict:
    """Per token (:mod:`engine.training.memory`'s keys): llama's counts with the MLP's part replaced, in a MoE
    layer, by what :class:`engine.moe.MoELayer` saves: the router's scores ``E``, its chosen probabilities ``k``
    (renormalised: also the unnormalised ones and their sum, ``2k + 1``; the sigmoid router with the load-balancing
    loss: ``+1``, the sum its balance divides by), three ``int64`` indices per routed slot (the chosen experts, the
    slot order, the token of each row; 8 bytes at either precision), and per routed slot (``k`` per token) the
    dispatched row, the expert output the combine scatters and the scattered copy it weights, ``3h``, and the
    expert's SwiGLU ``4f'`` (``f'`` the expert width); ``4 f_s`` for the shared experts.  A pending ``W`` holds per
    routed slot its row, the gate and up outputs' gradients and the down projection's input and output gradient,
    ``3f' + 2h``, in place of the dense MLP's ``3f + h``, the router's output gradient ``E``, and ``3 f_s + h`` for
    the shared experts.  ``cfg`` without ``moe``: llama's counts (the dense layers of a MoE model); a capacity
    factor's masks are not counted."""
    dense = LLAMA.memory(cfg, ffn_hidden_size)
    if cfg.moe is None:
        return dense
    moe, h = cfg.moe, cfg.hidden_size
    f, k, fs = moe.ffn_hidden_size or ffn_hidden_size, moe.top_k, moe.shared_experts * (moe.ffn_hidden_size or
                                                                                          ffn_hidden_size)
    renormalised = k > 1 and (moe.normalize_top_k or moe.router == "sigmoid")
    router = moe.num_experts + (2 * k + 1 if renormalised else k) + (
        1 if moe.router == "sigmoid" and moe.aux_loss_coeff > 0 else 0)
    indices = 2 * 3 * k  # int64: two 4-byte elements each, in sharded and in fp32_sharded (8 bytes either way)
    routed = k * (3 * h + 4 * f) + router + indices + 4 * fs
    counts = dict(dense, sharded=dense["sharded"] - 4 * ffn_hidden_size + routed,
                  fp32_sharded=dense.get("fp32_sharded", 0) + indices,
                  w_sharded=dense["w_sharded"] - 3 * ffn_hidden_size - h + k * (3 * f + 2 * h) + moe.num_experts
                  + (3 * fs + h if fs else 0))
    return counts


SPEC = register_family(FamilySpec(
    name="llama_moe",
    summary="llama blocks with mixture-of-experts MLPs (model.moe; parallel.expert), Hugging Face: Mixtral",
    embedding=LLAMA.embedding,
    block=lambda cfg, ffn_hidden_size: _layers().Block(cfg, ffn_hidden_size),
    final_norm=LLAMA.final_norm,
    tensor_parallel=LLAMA.tensor_parallel,  # attention and the dense layers' mlp; a MoE layer: shard_tokens
    check=_check,
    hf=HuggingFace(model_type="mixtral", architectures=("MixtralForCausalLM", "MixtralModel"), prefix="model.",
                   rules=_RULES, config=_hf_config, fields=_hf_fields),
    memory=_memory,
    moe_block=lambda cfg, layer: _layers().MoEBlock(cfg, layer),
    attention_core=LLAMA.attention_core,  # llama's attention in every block, MoE or dense
))
