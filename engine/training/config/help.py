"""The config reference, generated from the dataclasses of :mod:`engine.training.config`: every field with its type
and default read from the dataclass and its meaning from :data:`FIELD_HELP` (a test checks that every field has
one and no entry is stale; an entry that names schedules is a function that reads the schedule registry,
:mod:`engine.plan.registry`, when the help is shown).  ``pipecast train --help`` prints :func:`help_text`;
:func:`markdown_table` gives the same rows for documentation.
"""
from __future__ import annotations

import dataclasses
import textwrap
import typing

from ...plan.registry import get_schedule, schedule_names
from . import TrainConfig, _type_name

__all__ = ["FIELD_HELP", "field_rows", "help_text", "markdown_table"]

FIELD_HELP = {
    "model.family": "gpt2 (learned positions, LayerNorm, GELU, biases) or llama (rotary, RMSNorm, SwiGLU, "
                    "grouped-query attention, no biases)",
    "model.num_query_groups": "llama: key / value heads, dividing the attention heads (null: one per head)",
    "model.rope_theta": "llama: base of the rotary position embedding",
    "model.max_position_embeddings": "gpt2: rows of the learned position table; llama: context length recorded "
                                     "in exports (null: seq_length; >= seq_length)",
    "model.activation": "gpt2 MLP: gelu (exact) or gelu_tanh (GPT-2's tanh approximation)",
    "model.init_from": "a Hugging Face folder (config.json + model.safetensors, GPT-2 or Llama) to start from: its "
                       "config sets the architecture fields, its weights the first step",
    "model.num_layers": "transformer blocks; must divide into parallel.pipeline x parallel.virtual chunks",
    "model.hidden_size": "width h; pipeline messages are [seq_length, micro_batch_size, hidden_size]",
    "model.num_attention_heads": "attention heads; must divide hidden_size",
    "model.ffn_hidden_size": "MLP width (null: 4 x hidden_size)",
    "model.seq_length": "tokens per sample (context length)",
    "model.vocab_size": "embedding rows: >= 256 for bytes, the BPE size for data.tokenizer=bpe, above the largest "
                        "token id for .bin files",
    "model.dropout": "dropout probability (attention, residual, embedding)",
    "model.norm_epsilon": "LayerNorm (gpt2) / RMSNorm (llama) epsilon",
    "model.init_std": "standard deviation of the normal weight init (residual projections / sqrt(2 L))",
    "model.tie_embeddings": "output head = input embedding (the copies on first and last stage kept in sync)",
    "model.transformer_engine": "Transformer Engine layers when importable and on CUDA (not with a split-backward "
                                "schedule such as zb_h1 / zbv: refused)",
    "model.precision": "bf16: autocast on CUDA (parameters and pipeline messages stay fp32)",
    "parallel.pipeline": "pipeline ranks P",
    "parallel.virtual": "model chunks per pipeline rank; > 1 selects interleaved 1F1B (schedule: auto)",
    "parallel.schedule": lambda: _schedule_help(),
    "parallel.max_in_flight": lambda: f"{_takers('max_in_flight')} only: per-rank limit on in-flight activations "
                                      "(null: 1F1B's, virtual x (P - r))",
    "parallel.schedule_costs": lambda: f"{_takers('costs')} only: build the plan for these per-pass costs, e.g. "
                                       "'forward=1.2 backward=1.3 weight=0.7 transfer=0.05 weight_memory=0.4' (ms "
                                       "per chunk; values per rank a,b/c,d); null: the hand-made shape",
    "parallel.data": "data-parallel replicas (null: world size / (pipeline x tensor); 1 when spawning locally)",
    "parallel.sequence_parallel": "with parallel.tensor > 1: norms, dropout, residual stream and the activations "
                                  "sent between stages are each rank's [s/T, b, h] sequence shard (1/T of the bytes)",
    "parallel.tensor": "tensor-parallel ranks per stage (column / row / vocabulary-parallel layers; divides heads, "
                       "query groups, ffn_hidden_size and vocab_size); world = pipeline x data x tensor",
    "parallel.microbatch_group_size_per_vp_stage": lambda: f"{_takers('group_size')} only (null: P); Megatron's "
                                                           "rules P <= G <= M, M mod G in {0} U [P, G)",
    "parallel.device": "auto: CUDA when available, else CPU",
    "parallel.backend": "auto: NCCL on CUDA, gloo on CPU",
    "parallel.timeout_s": "communication timeout in seconds; a lost peer fails the job after this long",
    "parallel.batch_p2p_comm": "batch each step's sends and receives (Megatron's option)",
    "parallel.overlap_p2p_comm": "overlap P2P with compute (interleaved only; needs batch_p2p_comm=false)",
    "parallel.deallocate_pipeline_outputs": "free a sent activation's data once sent (Megatron's option)",
    "parallel.overlap_grad_reduce": "start a chunk's data-parallel all-reduce when its last backward ends",
    "parallel.shard": "none; optimizer: ZeRO-1, AdamW state 1/data per rank; full: FSDP2 per chunk, parameters, "
                      "gradients and AdamW state 1/data per rank between steps (both a no-op at data=1)",
    "data.source": "stdlib (this Python's standard library .py files), text (data.paths) or bin (token files)",
    "data.paths": "files / folders for text; one folder with train.bin + val.bin or one .bin file for bin",
    "data.suffixes": "file suffixes read from folders of data.paths",
    "data.val_fraction": "share of validation: every k-th block (k = 1 / val_fraction)",
    "data.split_block_bytes": "train / validation split granularity in bytes",
    "data.max_bytes": "read at most this many bytes of text (null: all)",
    "data.tokenizer": "text sources: bytes (one token per byte) or bpe (byte-level BPE of model.vocab_size tokens "
                      "trained on the training split, cached)",
    "data.cache_dir": "where BPE tokenizers and tokenized splits are cached (null: $XDG_CACHE_HOME or ~/.cache, "
                      "then /pipecast)",
    "optimizer.lr": "peak learning rate (after linear warmup)",
    "optimizer.min_lr": "learning rate at the end of the cosine decay (at training.steps)",
    "optimizer.warmup_steps": "linear warmup steps",
    "optimizer.weight_decay": "AdamW weight decay (not on biases and norms)",
    "optimizer.beta1": "AdamW beta1",
    "optimizer.beta2": "AdamW beta2",
    "optimizer.eps": "AdamW epsilon",
    "optimizer.grad_clip": "global L2 grad-norm clip (0: off)",
    "optimizer.check_for_nan_in_loss_and_grad": "stop on every rank when the loss or grad norm is NaN / inf; the "
                                                "step is not applied and nothing is saved",
    "training.steps": "optimizer steps of the run",
    "training.micro_batch_size": "sequences per microbatch b",
    "training.num_microbatches": "microbatches M per data-parallel rank and step; global batch = data x M x b",
    "training.eval_interval": "evaluate every N steps (0: at the start and the end only)",
    "training.eval_iters": "forward-only schedule calls per evaluation",
    "training.eval_microbatches": "microbatches per evaluation call (null: num_microbatches)",
    "training.seed": "seed of sample order, init and dropout",
    "training.deterministic": "deterministic kernels",
    "checkpoint.dir": "checkpoint folder (null: logging.run_dir/checkpoints)",
    "checkpoint.interval": "save every N steps (0: at the end only)",
    "checkpoint.keep": "complete checkpoints kept (the oldest removed)",
    "checkpoint.save_at_end": "save after the last step",
    "logging.run_dir": "run folder: config.yaml, train.log, metrics.jsonl, loss.png, checkpoints",
    "logging.log_interval": "log (and write metrics.jsonl) every N steps",
    "logging.progress_bar": "tqdm bar: true / false / auto (when stderr is a terminal)",
    "logging.level": "log level of the logging rank",
    "logging.tensorboard": "also write TensorBoard events to run_dir/tensorboard (pip install -e '.[tensorboard]')",
    "logging.peak_tflops": "one GPU's peak TFLOP/s for MFU (null: the GPU's known dense bf16 peak)",
    "logging.sample_every_eval": "print a sample of N tokens at each evaluation (0: off)",
    "cuda_graphs.enabled": "capture CUDA graphs per model chunk and microbatch",
    "cuda_graphs.backend": "auto (TE when importable, else pipecast's), te, torch / pipecast, emulate (CPU test "
                           "backend), eager",
    "cuda_graphs.warmup_steps": "eager steps before capture",
    "profile.enabled": "torch.profiler around the steps",
    "profile.wait": "profiler: steps skipped first",
    "profile.warmup": "profiler: warmup steps",
    "profile.active": "profiler: recorded steps",
}


def _takers(option: str) -> str:
    """The registered schedules that take build option ``option``, joined with " / "."""
    return " / ".join(n for n in schedule_names() if option in get_schedule(n).options) or "no schedule"


def _schedule_help() -> str:
    """``parallel.schedule``'s meaning, read from the schedule registry when help is shown (so schedules
    registered before that are listed too)."""
    named = "; ".join(f"{n}: {get_schedule(n).summary}" if get_schedule(n).summary else n for n in schedule_names())
    return (f"auto: Megatron's choice from pipeline / virtual; a registered schedule -- {named}; tuned: the best "
            "of RUN_DIR/tune.json (`pipecast tune`)")


def _shown(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def field_rows(config: TrainConfig | None = None) -> list[tuple[str, str, str, str]]:
    """``(section.field, type, value, meaning)`` for every config field, in dataclass order; ``value`` is the
    built-in default, or the field's value in ``config`` when one is given."""
    rows = []
    sections = typing.get_type_hints(TrainConfig)
    for section in dataclasses.fields(TrainConfig):
        cls = sections[section.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if config is not None:
                value = getattr(getattr(config, section.name), f.name)
            name = f"{section.name}.{f.name}"
            meaning = FIELD_HELP.get(name, "")
            rows.append((name, _type_name(hints[f.name]), _shown(value), meaning() if callable(meaning) else meaning))
    return rows


def help_text(width: int = 118, config: TrainConfig | None = None, source: str | None = None) -> str:
    """Every field as ``--section.key TYPE`` with its value and meaning (for ``pipecast train --help``).

    Without ``config``: the built-in defaults, marked as such (a config file replaces them).  With ``config`` (the
    file ``source`` after the command line's overrides, as :func:`engine.training.config.load_config` resolves it):
    the values a run would use, and the built-in default beside each value that differs from it.
    """
    builtin = {name: value for name, _, value, _ in field_rows()}
    if config is None:
        lines = ["config fields (set in the YAML file or override with --section.key=value). The values shown are "
                 "the built-in defaults, which a config file replaces: `pipecast train CONFIG --help` shows the "
                 "values a run of CONFIG would use."]
    else:
        lines = [f"config fields with the values a run of {source} would use (that file, then the overrides given; "
                 f"override with --section.key=value):"]
    lines = textwrap.wrap(lines[0], width)
    for name, kind, value, meaning in field_rows(config):
        if config is None:
            lines.append(f"  --{name} {kind} (built-in default {value})")
        else:
            differs = f"; built-in default {builtin[name]}" if builtin[name] != value else ""
            lines.append(f"  --{name} {kind} = {value} ({differs[2:] if differs else 'built-in default'})")
        lines.extend(textwrap.wrap(meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def markdown_table() -> str:
    """The same rows as a Markdown table."""
    out = ["| field | type | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{n}` | {k.replace('|', '/')} | {d} | {m} |" for n, k, d, m in field_rows()]
    return "\n".join(out)
