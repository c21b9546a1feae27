"""The range of every numeric config field, in one table (:data:`RANGES`), checked by :func:`check_ranges`.

Each number a config holds is bounded by what the code can represent and use: finite floats (``.inf`` and ``.nan``
are refused earlier), learning rates and epsilons that do not overflow an fp32 update (``optimizer.lr=1e300``
makes the first AdamW step ``inf``), AdamW's betas in ``[0, 1)`` (Loshchilov & Hutter, "Decoupled Weight Decay
Regularization", arXiv:1711.05101), sizes well inside int64 once multiplied (tokens per step, plan actions),
seeds that ``torch.Generator.manual_seed`` takes after the per-step offset (:class:`engine.training.data.corpus.Batches`)
and timeouts that ``datetime.timedelta`` holds.  Cross-field rules (``min_lr <= lr``, ``max_position_embeddings
>= seq_length``, divisibility, the plans a config implies) live in :func:`engine.training.config.validate`.

A test checks that every ``int`` / ``float`` field of the config dataclasses has exactly one entry here.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["Range", "RANGES", "MAX_STEPS", "MAX_TOKENS_PER_STEP", "check_ranges"]

MAX_STEPS = 10**9  # the upper bound of training.steps (at one step per millisecond: 11 days)
MAX_TOKENS_PER_STEP = 1 << 40  # data x num_microbatches x micro_batch_size x seq_length


@dataclass(frozen=True)
class Range:
    """``low`` / ``high`` bounds (``None``: unbounded); ``*_open``: the bound itself is excluded; ``fix``: what to
    write instead, appended to the error."""

    low: float | None
    high: float | None
    fix: str
    low_open: bool = False
    high_open: bool = False

    def violation(self, value) -> str | None:
        """Why ``value`` is outside the range (``None`` when inside)."""
        kind = "an integer " if isinstance(value, int) else ""
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return f"must be {kind}{'>' if self.low_open else '>='} {self.low}"
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return (f"must be below {self.high}" if self.high_open else
                    f"is over the upper bound {self.high:_}" if isinstance(self.high, int) else
                    f"is over the upper bound {self.high}")
        return None


_STEPS = f"use a step count in [1, {MAX_STEPS:_}]"
_COUNT = "use 0 (off) or a number of steps"
RANGES: dict[str, Range] = {
    "model.num_layers": Range(1, 1 << 16, "use a positive number of transformer blocks"),
    "model.hidden_size": Range(1, 1 << 20, "use a positive width such as 128 or 768"),
    "model.num_attention_heads": Range(1, 1 << 16, "use a positive number of heads that divides hidden_size"),
    "model.ffn_hidden_size": Range(1, 1 << 22, "use a positive MLP width or null (4 x hidden_size)"),
    "model.seq_length": Range(2, 1 << 20, "next-token training needs >= 2 tokens per sample"),
    "model.vocab_size": Range(2, 1 << 24, "use the tokenizer's vocabulary size (256 for bytes)"),
    "model.dropout": Range(0.0, 1.0, "use a probability such as 0.0 or 0.1", high_open=True),
    "model.norm_epsilon": Range(0.0, 1.0, "use e.g. 1e-5", low_open=True),
    "model.init_std": Range(0.0, 10.0, "use e.g. 0.02", low_open=True),
    "model.num_query_groups": Range(1, 1 << 16, "use a divisor of num_attention_heads or null"),
    "model.rope_theta": Range(0.0, 1e12, "use the rotary base, e.g. 10000 or 500000", low_open=True),
    "model.max_position_embeddings": Range(2, 1 << 24, "use >= model.seq_length or null (= seq_length)"),
    "parallel.pipeline": Range(1, 1 << 16, "use a positive number of pipeline ranks"),
    "parallel.virtual": Range(1, 1 << 10, "use a positive number of model chunks per rank"),
    "parallel.max_in_flight": Range(1, 1 << 24, "use the activations held per rank, or null for 1F1B's limit"),
    "parallel.data": Range(1, 1 << 20, "use a positive number of data-parallel replicas or null"),
    "parallel.tensor": Range(1, 1 << 10, "use a positive number of tensor-parallel ranks per stage (1: none)"),
    "parallel.microbatch_group_size_per_vp_stage": Range(1, 1 << 24, "use a value in [pipeline, num_microbatches] "
                                                                        "or null"),
    "parallel.timeout_s": Range(0.0, 1e8, "use a communication timeout in seconds, e.g. 60", low_open=True),
    "data.val_fraction": Range(0.0, 0.5, "use e.g. 0.05", low_open=True, high_open=True),
    "data.split_block_bytes": Range(1, 1 << 30, "use a positive block size in bytes, e.g. 4096"),
    "data.max_bytes": Range(1, 1 << 62, "use a positive byte count or null (all)"),
    "optimizer.lr": Range(0.0, 10.0, "use a learning rate such as 3e-4 or 3e-3", low_open=True),
    "optimizer.min_lr": Range(0.0, 10.0, "use 0 or a value <= optimizer.lr"),
    "optimizer.warmup_steps": Range(0, MAX_STEPS, "use 0 (no warmup) or a number of steps"),
    "optimizer.weight_decay": Range(0.0, 10.0, "use e.g. 0.1 (0 disables it)"),
    "optimizer.beta1": Range(0.0, 1.0, "use e.g. 0.9", high_open=True),
    "optimizer.beta2": Range(0.0, 1.0, "use e.g. 0.95", high_open=True),
    "optimizer.eps": Range(0.0, 1.0, "use e.g. 1e-8", low_open=True),
    "optimizer.grad_clip": Range(0.0, 1e12, "use a positive max grad norm (e.g. 1.0) or 0 to disable clipping"),
    "training.steps": Range(1, MAX_STEPS, _STEPS),
    "training.micro_batch_size": Range(1, 1 << 20, "use a positive number of sequences"),
    "training.num_microbatches": Range(1, 1 << 24, "use a positive number of microbatches"),
    "training.eval_interval": Range(0, MAX_STEPS, "use 0 (at the start and end only) or a number of steps"),
    "training.eval_iters": Range(1, 1 << 20, "use a positive number of evaluation calls"),
    "training.eval_microbatches": Range(1, 1 << 24, "use a positive number of microbatches or null"),
    "training.seed": Range(0, (1 << 32) - 1, "use a seed in [0, 2**32 - 1]"),
    "checkpoint.interval": Range(0, MAX_STEPS, "use 0 (at the end only) or a number of steps"),
    "checkpoint.keep": Range(1, 1 << 20, "keep at least one checkpoint"),
    "checkpoint.load_step": Range(1, MAX_STEPS, "use the step of a checkpoint in checkpoint.dir, or null"),
    "logging.log_interval": Range(1, MAX_STEPS, "use a positive number of steps"),
    "logging.peak_tflops": Range(0.0, 1e9, "use one GPU's TFLOP/s or null", low_open=True),
    "logging.sample_every_eval": Range(0, 1 << 20, "use 0 (off) or a number of tokens"),
    "cuda_graphs.warmup_steps": Range(1, MAX_STEPS, "capture needs at least one eager step to record the passes "
                                                    "it captures"),
    "profile.wait": Range(0, MAX_STEPS, _COUNT),
    "profile.warmup": Range(0, MAX_STEPS, _COUNT),
    "profile.active": Range(1, MAX_STEPS, "profile at least one step"),
}


def _show(value) -> str:
    return repr(value) if not isinstance(value, int) or abs(value) < 10**6 else f"{value:_}"


def check_ranges(config, error: type[Exception] = ValueError) -> None:
    """Check every numeric field of ``config`` (a :class:`~engine.training.config.TrainConfig`) against
    :data:`RANGES`, in dataclass order; ``None`` (null) values are left to the field's meaning.

    Raises:
        error: (a ``ValueError``; :func:`engine.training.config.validate` passes its ``ConfigError``) naming the
            field, its value, the bound and the fix.
    """
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for f in dataclasses.fields(values):
            value, where = getattr(values, f.name), f"{section.name}.{f.name}"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise error(f"{where}={value!r} is not a finite number; use a finite value")
            rule = RANGES[where]
            why = rule.violation(value)
            if why is not None:
                raise error(f"{where}={_show(value)} {why}; {rule.fix}")
    s, m = config.training, config.model
    tokens = (config.parallel.data or 1) * s.num_microbatches * s.micro_batch_size * m.seq_length
    if tokens > MAX_TOKENS_PER_STEP:
        raise error(f"training.num_microbatches={s.num_microbatches} x training.micro_batch_size="
                          f"{s.micro_batch_size} x model.seq_length={m.seq_length} x data replicas = {tokens:_} "
                          f"tokens per step is over the upper bound {MAX_TOKENS_PER_STEP:_}; use fewer microbatches "
                          f"or smaller microbatches")
