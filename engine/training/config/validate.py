"""Validation of a whole run before any process group exists (:func:`validate`): ranges, the model family, the
``model.init_from`` folder, the parallel layout and its plans (:mod:`.layout`), data paths, logging and device;
and :func:`check_fresh_run`, the refusal to start a fresh run in a folder that holds another run's checkpoints.
Every error is a :class:`~.errors.ConfigError` naming the field, its value and the fix.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..models import family_names, get_family
from .errors import ConfigError
from .fields import check_ranges
from .init_from import check_init_from
from .layout import validate_parallel
from .schema import ModelConfig, TrainConfig
from .validated import mark_validated

__all__ = ["validate", "validate_model_family", "check_fresh_run"]


def validate(config: TrainConfig) -> None:
    """Cross-field checks of a whole run, before any process group exists (no communication).

    Checks: every numeric field against the range in its metadata (:func:`.fields.check_ranges`: finite, within
    what the code represents); ``hidden_size`` divisible by heads; the family's fields
    (:func:`validate_model_family`); recomputation (:func:`_validate_recompute`); ``model.init_from``
    (:func:`.init_from.check_init_from`); ``num_layers`` split into ``pipeline x virtual`` model chunks (evenly,
    or as ``model.pipeline_layout`` places them); the microbatch counts Megatron's schedule accepts (interleaved:
    ``P <= G <= M`` and ``M mod G`` in ``{0} U [P, G)``, Megatron-Core 0.16.1); every plan the run builds, built
    and validated (:func:`.layout.validate_plans`); sequence length and vocabulary; data paths.

    Raises:
        ConfigError (ValueError) / RuntimeError naming field, value and fix.
    """
    m, o = config.model, config.optimizer
    check_ranges(config, ConfigError)  # every numeric field against its range (finite, bounds)
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                          f"{m.num_attention_heads}; choose heads that divide the hidden size")
    if config.data.source in ("stdlib", "text") and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is too small for byte-level data "
                          f"(data.source={config.data.source!r}); set model.vocab_size >= 256")
    validate_model_family(m)
    _validate_recompute(config)
    if m.init_from:
        check_init_from(config)
    validate_parallel(config)
    if not o.min_lr <= o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must be in [0, optimizer.lr={o.lr}]")
    _validate_data(config)
    _validate_logging(config)
    _validate_device(config)  # last: the only check that may import torch
    mark_validated(config)  # the trainer does not check it again (config/validated.py)


def validate_model_family(m: ModelConfig) -> None:
    """The model fields that depend on the family (part of :func:`validate`): grouped-query attention divides the
    heads, positions cover the sequence, the family's own checks
    (:attr:`engine.training.models.registry.FamilySpec.check`), Transformer Engine layers only for a family whose
    block they compute.

    Raises:
        ConfigError: naming the field, its value and the fix.
    """
    groups = m.num_query_groups
    if groups is not None and (isinstance(groups, bool) or groups < 1 or m.num_attention_heads % groups):
        raise ConfigError(f"model.num_query_groups={groups} must be a positive divisor of model.num_attention_heads="
                          f"{m.num_attention_heads} (key / value heads shared by equal groups of query heads); use "
                          f"a divisor or null (one group per head)")
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.seq_length:
        raise ConfigError(f"model.max_position_embeddings={m.max_position_embeddings} is below model.seq_length="
                          f"{m.seq_length}; use >= {m.seq_length} or null (= seq_length)")
    try:
        family = get_family(m.family)
    except ValueError as exc:  # a config built in Python, not loaded (load_config checks the name first)
        raise ConfigError(str(exc)) from None
    _validate_moe(m, family)
    why = family.check(m) if family.check is not None else None
    if why is not None:
        raise ConfigError(why)
    if m.transformer_engine and not family.transformer_engine:
        able = [n for n in family_names() if get_family(n).transformer_engine]
        raise ConfigError(f"model.transformer_engine=true with model.family={m.family}: Transformer Engine's layer "
                          f"(LayerNorm, GELU MLP, biases) does not compute this family's block; set "
                          f"model.transformer_engine=false (or use model.family={' / '.join(able) or '(none)'})")


def _validate_moe(m: ModelConfig, family) -> None:
    """``model.moe`` against the family and itself: a family with a ``moe_block``, ``top_k <= num_experts``, at
    least one MoE layer."""
    moe = m.moe
    if moe is None:
        return
    if family.moe_block is None:
        able = [n for n in family_names() if get_family(n).moe_block is not None]
        raise ConfigError(f"model.moe is set but model.family={m.family} cannot hold a mixture of experts (its "
                          f"FamilySpec has no moe_block); use model.family={' / '.join(able) or '(none)'} or remove "
                          f"model.moe")
    if moe.top_k > moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} is above model.moe.num_experts={moe.num_experts}: a token is "
                          f"routed to at most num_experts experts; lower model.moe.top_k or raise num_experts")
    if not any(moe.is_moe_layer(i) for i in range(m.num_layers)):
        raise ConfigError(f"model.moe.first_dense_layers={moe.first_dense_layers} with model.moe.layer_freq="
                          f"{moe.layer_freq} leaves no MoE layer among model.num_layers={m.num_layers}; lower them "
                          f"or remove model.moe")


def _validate_recompute(config: TrainConfig) -> None:
    """``model.recompute`` and ``model.recompute_kept_microbatches`` (the parallelism's recomputation slot,
    :func:`engine.training.parallel.parallelism.parallelize`).

    Raises:
        ConfigError: kept microbatches without recomputation; ``selective`` for a family whose block names no
            attention core (:attr:`~engine.training.models.registry.FamilySpec.attention_core`); recomputation of
            Transformer Engine layers; recomputation with dropout under ``cuda_graphs`` (a recomputed segment
            inside a captured backward draws its dropout masks at that graph's philox offsets, not at the
            forward graph's: other masks than the forward used).
    """
    m = config.model
    if m.recompute_kept_microbatches is not None and m.recompute == "none":
        raise ConfigError(f"model.recompute_kept_microbatches={m.recompute_kept_microbatches} needs model.recompute="
                          "full or selective (it says which microbatches keep their activations); set one, or remove "
                          "model.recompute_kept_microbatches")
    if m.recompute == "selective" and get_family(m.family).attention_core is None:
        raise ConfigError(f"model.recompute=selective with model.family={m.family}: the family's block names no "
                          "attention core module to recompute (FamilySpec.attention_core); use model.recompute=full "
                          "or none")
    cg = config.cuda_graphs
    if m.recompute != "none" and m.dropout > 0 and cg.enabled and cg.backend != "eager":
        raise ConfigError(f"model.recompute={m.recompute} with model.dropout={m.dropout} and cuda_graphs.enabled=true: "
                          "inside a captured backward the recomputed forward draws its dropout masks at the backward "
                          "graph's random-number offsets, not the forward's, so the gradients would not match the "
                          "forward; set model.dropout=0, model.recompute=none or cuda_graphs.enabled=false")
    if m.recompute != "none" and m.transformer_engine:
        raise ConfigError(f"model.recompute={m.recompute} with model.transformer_engine=true: Transformer Engine "
                          "layers bring their own recomputation, not wired here; set model.transformer_engine=false "
                          "or model.recompute=none")


def _validate_device(config: TrainConfig) -> None:
    """``parallel.device=cuda`` / ``parallel.backend=nccl`` need CUDA on this machine.  torch is imported only for
    configs that ask for CUDA (so the other bad-config paths stay fast)."""
    p = config.parallel
    if p.device != "cuda" and p.backend != "nccl":
        return
    import torch
    if torch.cuda.is_available():
        return
    field_, value = ("parallel.device", p.device) if p.device == "cuda" else ("parallel.backend", p.backend)
    raise ConfigError(f"{field_}={value!r} needs CUDA, but torch.cuda.is_available() is False on this machine "
                      f"(torch {torch.__version__}); set parallel.device=auto or parallel.device=cpu and "
                      f"parallel.backend=auto (or gloo), or run on a machine with CUDA GPUs")


def check_fresh_run(config: TrainConfig, resume: bool) -> None:
    """A fresh run (no ``--resume``) must not start in a folder that already holds checkpoints: the other run's
    newer checkpoints would outrank this run's in the keep-newest rotation and a later ``--resume`` would continue
    the other run.  Pure (reads the folder listing); call it before spawning ranks; the trainer calls it too.

    Raises:
        ConfigError: ``checkpoint.dir`` holds checkpoints (intact or broken: ``checkpoint.keep`` counts both) or
            ``checkpoint.load_step`` is set, and ``resume`` is False.
    """
    if resume:
        return
    if config.checkpoint.load_step is not None:
        raise ConfigError(f"checkpoint.load_step={config.checkpoint.load_step} picks the checkpoint a resume loads, "
                          f"but this run does not resume: add --resume, or remove checkpoint.load_step")
    directory = config.checkpoint_dir
    if not directory.is_dir():
        return
    found = sorted(p.name for p in directory.iterdir() if re.fullmatch(r"step_\d{8}", p.name) and p.is_dir())
    if found:
        shown = ", ".join(found[-3:]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(f"checkpoint.dir {str(directory)!r} already holds checkpoints ({shown}) of another run "
                          f"(logging.run_dir={config.logging.run_dir!r}); pass --resume to continue it, use a new "
                          f"logging.run_dir (or checkpoint.dir) for a fresh run, or delete that folder")


def _validate_data(config: TrainConfig) -> None:
    d = config.data
    if d.source == "bin" and d.tokenizer != "bytes":
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} does not apply to data.source='bin' (its files hold "
                          f"token ids already); remove data.tokenizer, or use data.source=text / stdlib")
    if d.tokenizer == "bpe" and config.model.vocab_size < 257:
        raise ConfigError(f"model.vocab_size={config.model.vocab_size} is too small for data.tokenizer='bpe': a "
                          f"byte-level BPE starts from the 256 byte tokens; set model.vocab_size > 256 (e.g. 4096)")
    if d.source == "stdlib":
        if d.paths:
            raise ConfigError(f"data.paths={d.paths} is set but data.source='stdlib' ignores it; set "
                              f"data.source=text or data.source=bin, or remove data.paths")
        return
    if not d.paths:
        raise ConfigError(f"data.source={d.source!r} needs data.paths (files or folders); none given")
    for i, raw in enumerate(d.paths):
        if not Path(raw).exists():
            raise ConfigError(f"data.paths[{i}]={raw!r} does not exist; fix the path or use data.source=stdlib")


def _validate_logging(config: TrainConfig) -> None:
    lg = config.logging
    if lg.tensorboard:
        import importlib.util
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("logging.tensorboard=true needs the tensorboard package, which is not installed; "
                              "run pip install -e '.[tensorboard]' or set logging.tensorboard=false")
