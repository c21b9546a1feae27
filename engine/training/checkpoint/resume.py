"""What a ``--resume`` may change: the settings saved with a checkpoint against the config that resumes it.

A checkpoint's ``pipecast.json`` (:data:`engine.training.checkpoint.dcp.META_FILE`) holds the model settings
(``model``) and the run settings (``run``: :func:`run_settings`).  :func:`resume_differences` compares them with the
resuming config, field by field, and sorts each change into one of three kinds:

* **refused** -- the run would continue on another trajectory than the one the checkpoint belongs to, which a
  user resuming "the same run" almost certainly did not intend:

  - the model shape (:data:`MODEL_MUST_MATCH`, ``ffn_hidden_size`` resolved, ``model.moe``): the parameters would
    not fit;
  - the data identity (``data.source``, ``data.paths`` as absolute paths, ``data.suffixes``, ``data.tokenizer``,
    ``data.val_fraction``, ``data.split_block_bytes``, ``data.max_bytes``) and the tokenizer kind: other tokens;
  - ``training.seed``: step ``N``'s samples are drawn from ``seed`` and ``N``
    (:meth:`engine.training.data.corpus.Batches.train_offsets`), and dropout from the seed;
  - the global batch ``data x num_microbatches x micro_batch_size``: the samples of step ``N`` are the first
    ``global batch`` draws of that step, so another size gives other samples and another gradient scale.

* **warned** -- the same data and model, optimised differently; plausible on purpose (lowering the learning rate
  of a diverging run, a longer warmup, other evaluation sizes, bf16 from here on): every ``optimizer.*`` field,
  ``model.dropout``, ``model.norm_epsilon``, ``model.rope_theta``, ``model.activation``, ``model.precision`` (the
  checkpoint holds fp32 weights either way), and the sequences per evaluation
  (``data x eval microbatches x micro_batch_size x eval_iters``: validation losses before and after are then
  over other windows, not comparable).

* **allowed silently** -- everything else: the layout (``parallel.pipeline`` / ``virtual`` / ``data`` /
  ``expert`` / ``schedule``, ``model.pipeline_layout``; checkpoints are layout-free), ``model.recompute`` (the same
  gradients), ``micro_batch_size`` and ``num_microbatches`` while their product with ``data`` (the global batch)
  stays, ``training.steps`` (continuing a finished run longer is the common case), intervals, logging,
  checkpointing, CUDA graphs, profiling.

Checkpoints written before ``run`` was saved are compared on the model only.  Pure (JSON and the config; no
torch): :func:`check_resume` runs before any rank starts.
"""
from __future__ import annotations

import dataclasses
import json
import os

from .integrity import check_checkpoint, pick_checkpoint

__all__ = ["MODEL_MUST_MATCH", "REFUSED", "WARNED", "run_settings", "checkpoint_meta", "resume_differences",
           "refusal_message", "check_resume"]

MODEL_MUST_MATCH = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                    "tie_embeddings", "family", "num_query_groups", "max_position_embeddings")
REFUSED = ("data.source", "data.paths", "data.suffixes", "data.tokenizer", "data.val_fraction",
           "data.split_block_bytes", "data.max_bytes", "training.seed", "global_batch_size")
WARNED = ("optimizer.lr", "optimizer.min_lr", "optimizer.warmup_steps", "optimizer.weight_decay", "optimizer.beta1",
          "optimizer.beta2", "optimizer.eps", "optimizer.grad_clip", "model.dropout", "model.norm_epsilon",
          "model.rope_theta", "model.activation", "model.precision", "eval_sequences")


def _get(config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def run_settings(config) -> dict:
    """The ``run`` entry of a checkpoint's meta: every :data:`REFUSED` and :data:`WARNED` field (``data.paths``
    made absolute, so that a resume from another working folder compares the same files), the global batch, and
    its three factors (named in the message when it differs)."""
    out = {}
    for name in REFUSED + WARNED:
        if name == "global_batch_size":
            out[name] = config.global_batch_size
        elif name == "eval_sequences":
            out[name] = (config.data_parallel_size * config.eval_microbatches * config.training.micro_batch_size *
                         config.training.eval_iters)
        elif name == "data.paths":
            out[name] = [os.path.abspath(p) for p in config.data.paths]
        else:
            out[name] = _get(config, name)
    s = config.training
    out["batch"] = f"data {config.data_parallel_size} x {s.num_microbatches} microbatches x {s.micro_batch_size}"
    return out


def _model_settings(config) -> dict:
    """The settings that fix parameter names and shapes: :data:`MODEL_MUST_MATCH`, ``ffn_hidden_size`` resolved
    and ``moe`` (the ``model.moe`` section as a mapping, or None; ``parallel.expert`` is layout and may change)."""
    moe = config.model.moe
    return {k: getattr(config.model, k) for k in MODEL_MUST_MATCH} | {
        "ffn_hidden_size": config.ffn_hidden_size, "moe": None if moe is None else dataclasses.asdict(moe)}


def checkpoint_meta(config, step: int) -> dict:
    """The meta saved beside a checkpoint's tensors (``pipecast.json``): what a resume must match (``model``: the
    settings that fix parameter names and shapes, ``ffn_hidden_size`` resolved; ``run``: :func:`run_settings`),
    and what ``pipecast sample`` / ``export`` need to rebuild the model in one process (``model_config``: every
    model field; ``tokenizer``: ``bytes``, ``bpe`` with its ``tokenizer.json`` in the checkpoint folder, or
    ``none`` for ``.bin`` token files)."""
    kind = "none" if config.data.source == "bin" else config.data.tokenizer
    model = {"ffn_hidden_size": config.ffn_hidden_size}
    return {"step": step, "model": _model_settings(config),
            "model_config": dataclasses.asdict(config.model) | model,
            "tokenizer": {"kind": kind} | ({"file": "tokenizer.json"} if kind == "bpe" else {}),
            "seed": config.training.seed, "run": run_settings(config)}


def resume_differences(meta: dict | None, config) -> tuple[list[str], list[str]]:
    """``(refused, warned)``: one line per changed field of the checkpoint ``meta`` against ``config``, each
    naming the field with the old and the new value (``field: old -> new``).  Fields missing from ``meta``
    (older checkpoints) are not compared."""
    meta = meta or {}
    refused, warned = [], []
    saved_model = meta.get("model")
    if isinstance(saved_model, dict):
        ours = _model_settings(config)
        refused += [f"checkpoint has model.{k}={saved_model[k]!r}, the config has {ours[k]!r}"
                    for k in ours if k in saved_model and saved_model[k] != ours[k]]
    saved_tok = (meta.get("tokenizer") or {}).get("kind")
    our_tok = "none" if config.data.source == "bin" else config.data.tokenizer
    if saved_tok is not None and saved_tok != our_tok:
        refused.append(f"checkpoint was trained on {saved_tok!r} tokens, the config's data gives {our_tok!r}")
    saved_run, ours_run = meta.get("run"), run_settings(config)
    if isinstance(saved_run, dict):
        for name in REFUSED + WARNED:
            if name not in saved_run or saved_run[name] == ours_run[name]:
                continue
            line = f"{name}: {saved_run[name]!r} -> {ours_run[name]!r}"
            if name == "global_batch_size":
                line += f" ({saved_run.get('batch', '?')} -> {ours_run['batch']})"
            elif name == "eval_sequences":
                line += " (sequences per evaluation: data x eval microbatches x micro_batch_size x eval_iters)"
            (refused if name in REFUSED else warned).append(line)
    return refused, warned


def refusal_message(path, refused: list[str]) -> str:
    """The one-line error for :func:`resume_differences`' refused changes."""
    return (f"cannot resume from {str(path)!r}: it was written for another model or run: {'; '.join(refused)}; "
            f"resume with the same model settings, data, training.seed and global batch (data x num_microbatches x "
            f"micro_batch_size; the parallel layout may change), or start a fresh run in a new logging.run_dir")


def check_resume(config, error: type[Exception] = ValueError) -> list[str]:
    """Before any rank starts: find the checkpoint a resume will load -- ``checkpoint.load_step``'s, or the newest
    one in ``config.checkpoint_dir`` whose files are all there at their written sizes (the ranks then verify the
    checksums, :func:`engine.training.checkpoint.dcp.checkpoint_to_load`) -- and compare it with ``config``.
    Returns the warned lines (empty when nothing to resume or nothing changed); an unreadable ``pipecast.json`` is
    left to the trainer's load, which names it.

    Raises:
        error: (the caller's ``ValueError`` class) :func:`refusal_message` when a refused field changed.
        CheckpointError: the checkpoint of ``checkpoint.load_step`` is missing or broken, or every checkpoint is.
    """
    path, _ = pick_checkpoint(config.checkpoint_dir, config.checkpoint.load_step,
                              lambda p: check_checkpoint(p, hashes=False))
    if path is None:
        return []
    try:
        meta = json.loads((path / "pipecast.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(meta, dict):
        return []
    refused, warned = resume_differences(meta, config)
    if refused:
        raise error(refusal_message(path, refused))
    return warned
