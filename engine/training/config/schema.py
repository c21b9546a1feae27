"""The config dataclasses, one per section: the source of truth for every field's type, default, meaning and range
(each written once, in the field's :func:`~.fields.setting`).  Shapes: activations between pipeline stages are
``[seq_length, micro_batch_size, hidden_size]`` (Megatron's ``[s, b, h]``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ...plan.layout import PipelineLayout, resolve_layout
from ...plan.registry import auto_schedule, config_choices, get_schedule, schedule_names, virtual_or_none
from ...plan.resolve import ResolvedSchedule, resolve_schedule
from ..models import DEFAULT_FAMILY, family_names, get_family
from .errors import ConfigError
from .fields import MAX_STEPS, Range, RegisteredName, setting

__all__ = ["ScheduleName", "FamilyName", "MoEConfig", "ModelConfig", "ParallelConfig", "DataConfig", "OptimizerConfig",
           "TrainingConfig", "CheckpointConfig", "LoggingConfig", "CudaGraphsConfig", "ProfileConfig", "TrainConfig",
           "schedules_taking"]


class ScheduleName(RegisteredName):
    """The type of ``parallel.schedule``: ``auto``, a schedule of the registry (:mod:`engine.plan.registry`,
    including schedules registered before the config is loaded) or ``tuned``."""

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        return config_choices()


class FamilyName(RegisteredName):
    """The type of ``model.family``: a family of the registry (:mod:`engine.training.models.registry`, including
    families registered before the config is loaded)."""

    hint = ("; or register the family (engine.training.models.register_family) at import of a module that the "
            "ranks import too (the module of the function they run)")

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        return family_names()


def schedules_taking(option: str) -> str:
    """The registered schedules that take build option ``option``, joined with " / " ("no schedule": none)."""
    return " / ".join(n for n in schedule_names() if option in get_schedule(n).options) or "no schedule"


def _schedule_help() -> str:
    named = "; ".join(f"{n}: {get_schedule(n).summary}" if get_schedule(n).summary else n for n in schedule_names())
    return (f"auto: Megatron's choice from pipeline / virtual; a registered schedule -- {named}; tuned: the best "
            "of RUN_DIR/tune.json (`pipecast tune`)")


def _family_help() -> str:
    named = "; ".join(f"{n}: {get_family(n).summary}" for n in family_names())
    return f"{named} (a family is added with engine.training.models.register_family)"


_LAYOUT_FIELDS = {"layout": "model.pipeline_layout", "num_layers": "model.num_layers", "pipeline": "parallel.pipeline",
                  "virtual": "parallel.virtual"}
_STEPS = f"use a step count in [1, {MAX_STEPS:_}]"
_COUNT = "use 0 (off) or a number of steps"


@dataclass
class MoEConfig:
    """A mixture-of-experts MLP (``model.moe``; the layers are :mod:`engine.moe`'s): a top-k router over
    ``num_experts`` SwiGLU experts, optional shared experts, a load-balancing loss.  Layer ``i`` is a MoE layer when
    ``i >= first_dense_layers`` and ``i % layer_freq == 0`` (DeepSeek-V3's ``first_k_dense_replace`` /
    ``moe_layer_freq``); the others keep the family's dense MLP."""

    num_experts: int = setting(8, "routed experts E of each MoE layer (a multiple of parallel.expert)",
                               Range(1, 1 << 16, "use a positive number of experts, e.g. 8"))
    top_k: int = setting(2, "experts each token is routed to (<= num_experts)",
                         Range(1, 1 << 16, "use a positive number of experts per token, e.g. 2"))
    ffn_hidden_size: int | None = setting(None, "each routed expert's SwiGLU width (null: model.ffn_hidden_size)",
                                          Range(1, 1 << 22, "use a positive expert width or null"))
    shared_experts: int = setting(0, "shared experts every token also goes through (DeepSeek-MoE, arXiv:2401.06066): "
                                  "one SwiGLU of shared_experts x the expert width; 0: none",
                                  Range(0, 1 << 10, "use 0 (none) or a number of shared experts"))
    router: Literal["softmax", "sigmoid"] = setting("softmax", "softmax: the top-k of softmax scores (Jiang et al., "
                                                    "arXiv:2401.04088); sigmoid: DeepSeek-V3's sigmoid affinities, the "
                                                    "chosen ones normalised to sum to 1")
    normalize_top_k: bool = setting(True, "softmax router: renormalise the k chosen probabilities to sum to 1 "
                                    "(sigmoid ones always are)")
    aux_loss_coeff: float = setting(0.01, "weight of the load-balancing loss (Switch Transformer, arXiv:2101.03961; "
                                    "its gradient follows the pipeline's loss scale); 0: none",
                                    Range(0.0, 1e3, "use 0 (none) or a small weight such as 0.01"))
    capacity_factor: float | None = setting(None, "null: dropless; else each expert takes at most ceil(capacity_factor"
                                            " x tokens x top_k / num_experts) token slots per forward, the later "
                                            "ones dropped", Range(0.0, 1e6, "use e.g. 1.25, or null (dropless)",
                                                                  low_open=True))
    layer_freq: int = setting(1, "every layer_freq-th layer (index % layer_freq == 0) is a MoE layer (Megatron's "
                              "--moe-layer-freq)", Range(1, 1 << 16, "use 1 (every layer) or e.g. 2"))
    first_dense_layers: int = setting(0, "the first N layers keep the dense MLP (DeepSeek-V3's first_k_dense_replace)",
                                      Range(0, 1 << 16, "use 0 or a number of leading dense layers"))

    def is_moe_layer(self, index: int) -> bool:
        """Whether global layer ``index`` holds a MoE MLP."""
        return index >= self.first_dense_layers and index % self.layer_freq == 0


@dataclass
class ModelConfig:
    """A decoder-only transformer of one registered ``family`` (:mod:`engine.training.models`).  ``init_from``: a
    Hugging Face model folder whose ``config.json`` sets the architecture fields and whose weights start the run
    (:mod:`.init_from`)."""

    family: FamilyName = setting(DEFAULT_FAMILY, _family_help)
    num_layers: int = setting(4, "transformer blocks; split evenly into parallel.pipeline x parallel.virtual chunks, "
                              "or as model.pipeline_layout places them",
                              Range(1, 1 << 16, "use a positive number of transformer blocks"))
    hidden_size: int = setting(128, "width h; pipeline messages are [seq_length, micro_batch_size, hidden_size]",
                               Range(1, 1 << 20, "use a positive width such as 128 or 768"))
    num_attention_heads: int = setting(4, "attention heads; must divide hidden_size",
                                       Range(1, 1 << 16, "use a positive number of heads that divides hidden_size"))
    ffn_hidden_size: int | None = setting(None, "MLP width (null: 4 x hidden_size)",
                                          Range(1, 1 << 22, "use a positive MLP width or null (4 x hidden_size)"))
    seq_length: int = setting(128, "tokens per sample (context length)",
                              Range(2, 1 << 20, "next-token training needs >= 2 tokens per sample"))
    vocab_size: int = setting(256, "embedding rows: >= 256 for bytes, the BPE size for data.tokenizer=bpe, above the "
                              "largest token id for .bin files",
                              Range(2, 1 << 24, "use the tokenizer's vocabulary size (256 for bytes)"))
    dropout: float = setting(0.0, "dropout probability (attention, residual, embedding)",
                             Range(0.0, 1.0, "use a probability such as 0.0 or 0.1", high_open=True))
    norm_epsilon: float = setting(1e-5, "epsilon of the family's norms (LayerNorm / RMSNorm)",
                                  Range(0.0, 1.0, "use e.g. 1e-5", low_open=True))
    init_std: float = setting(0.02, "standard deviation of the normal weight init (residual projections / "
                              "sqrt(2 L))", Range(0.0, 10.0, "use e.g. 0.02", low_open=True))
    tie_embeddings: bool = setting(True, "output head = input embedding (the copies on first and last stage kept in "
                                   "sync)")
    transformer_engine: bool = setting(False, "Transformer Engine layers when importable and on CUDA, for families "
                                       "whose block they compute (not with a split-backward schedule such as zb_h1 "
                                       "/ zbv: refused)")
    precision: Literal["fp32", "bf16"] = setting(
        "fp32", "bf16: mixed precision as Megatron-LM and torchtitan train -- bf16 parameters, activations and "
                "pipeline messages, gradients summed over the step's microbatches in fp32, AdamW on fp32 master "
                "weights (what checkpoints keep), the loss in fp32 (engine.training.parallel.precision)")
    recompute: Literal["none", "full", "selective"] = setting(
        "none", "activation recomputation (Korthikanti et al., arXiv:2205.05198): full keeps each block's input and "
                "recomputes the block in its backward; selective recomputes the attention core only")
    recompute_kept_microbatches: int | None = setting(
        None, "with model.recompute: of each window of a rank's in-flight microbatches (its warmup + 1 forwards) "
              "the first N keep their activations and the rest recompute (Megatron's "
              "num_microbatches_with_partial_activation_checkpoints); null: every microbatch recomputes",
        Range(0, 1 << 24, "use the microbatches per window that keep their activations, or null (all recompute)"))
    pipeline_layout: str | None = setting(
        None, "the layers of each virtual pipeline stage in Megatron's notation (--pipeline-model-parallel-layout): "
              "stages separated by '|', E embedding, t decoder layer, L output head and loss, x*N repeats, e.g. "
              "'Et*3|t*4|t*4|t*3L' (parallel.pipeline x parallel.virtual stages, stage order); null: an even split")
    num_query_groups: int | None = setting(None, "key / value heads of grouped-query attention, dividing the "
                                           "attention heads (null: one per head)",
                                           Range(1, 1 << 16, "use a divisor of num_attention_heads or null"))
    rope_theta: float = setting(10000.0, "base of the rotary position embedding (families with rotary positions)",
                                Range(0.0, 1e12, "use the rotary base, e.g. 10000 or 500000", low_open=True))
    max_position_embeddings: int | None = setting(None, "rows of a learned position table, or the context length "
                                                  "recorded in exports (null: seq_length; >= seq_length)",
                                                  Range(2, 1 << 24, "use >= model.seq_length or null (= seq_length)"))
    activation: Literal["gelu", "gelu_tanh"] = setting("gelu", "the MLP's GELU (families with one): gelu (exact) or "
                                                       "gelu_tanh (the tanh approximation, Hendrycks & Gimpel "
                                                       "arXiv:1606.08415)")
    moe: MoEConfig | None = setting(None, "a mixture-of-experts MLP in the family's MoE layers (model.moe.*; "
                                    "families whose FamilySpec has a moe_block); null: dense")
    init_from: str | None = setting(None, "a Hugging Face folder (config.json + model.safetensors) of a registered "
                                    "family to start from: its config sets the architecture fields, its weights the "
                                    "first step")


@dataclass
class ParallelConfig:
    """Pipeline (``pipeline``) x data (``data``) x tensor (``tensor``) parallelism; ``virtual`` model chunks per
    pipeline rank."""

    pipeline: int = setting(1, "pipeline ranks P", Range(1, 1 << 16, "use a positive number of pipeline ranks"))
    virtual: int = setting(1, "model chunks per pipeline rank; > 1 selects interleaved 1F1B (schedule: auto)",
                           Range(1, 1 << 10, "use a positive number of model chunks per rank"))
    schedule: ScheduleName = setting("auto", _schedule_help)
    max_in_flight: int | None = setting(
        None, lambda: f"{schedules_taking('max_in_flight')} only: per-rank limit on in-flight activations (null: "
                      "1F1B's, virtual x (P - r))",
        Range(1, 1 << 24, "use the activations held per rank, or null for 1F1B's limit"))
    schedule_costs: str | None = setting(
        None, lambda: f"{schedules_taking('costs')} only: build the plan for these per-pass costs, e.g. 'forward=1.2 "
                      "backward=1.3 weight=0.7 transfer=0.05 weight_memory=0.4' (ms per chunk; per rank a,b/c,d; "
                      "engine.plan.pass_costs); null: the hand-made shape")
    data: int | None = setting(None, "data-parallel replicas (null: world size / (pipeline x tensor); 1 when "
                               "spawning locally)",
                               Range(1, 1 << 20, "use a positive number of data-parallel replicas or null"))
    tensor: int = setting(1, "tensor-parallel ranks per stage (column / row / vocabulary-parallel layers; divides "
                          "heads, query groups, ffn_hidden_size and vocab_size); world = pipeline x data x tensor",
                          Range(1, 1 << 10, "use a positive number of tensor-parallel ranks per stage (1: none)"))
    sequence_parallel: bool = setting(False, "with parallel.tensor > 1: norms, dropout, residual stream and the "
                                      "activations sent between stages are each rank's [s/T, b, h] sequence shard "
                                      "(1/T of the bytes)")
    microbatch_group_size_per_vp_stage: int | None = setting(
        None, lambda: f"{schedules_taking('group_size')} only (null: P); Megatron's rules P <= G <= M, M mod G in "
                      "{0} U [P, G)",
        Range(1, 1 << 24, "use a value in [pipeline, num_microbatches] or null"))
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "auto: CUDA when available, else CPU")
    backend: Literal["auto", "gloo", "nccl"] = setting("auto", "auto: NCCL on CUDA, gloo on CPU")
    timeout_s: float = setting(60.0, "communication timeout in seconds; a lost peer fails the job after this long",
                               Range(0.0, 1e8, "use a communication timeout in seconds, e.g. 60", low_open=True))
    batch_p2p_comm: bool = setting(True, "batch each step's sends and receives (Megatron's option)")
    overlap_p2p_comm: bool = setting(False, "overlap P2P with compute (interleaved only; needs batch_p2p_comm=false)")
    deallocate_pipeline_outputs: bool = setting(True, "free a sent activation's data once sent (Megatron's option)")
    overlap_grad_reduce: bool = setting(True, "start a chunk's data-parallel all-reduce when its last backward ends")
    expert: int = setting(1, "expert-parallel ranks E (model.moe): each MoE layer's experts are split over E ranks "
                          "taken from the data-parallel ones (E divides parallel.data and model.moe.num_experts); "
                          "expert gradients are reduced over the data / E expert-data-parallel ranks",
                          Range(1, 1 << 16, "use 1 (every rank holds every expert) or a divisor of parallel.data"))
    overlap_moe_expert_parallel_comm: bool = setting(
        False, lambda: f"{schedules_taking('overlap_moe_expert_parallel_comm')} only (1f1b: one pipeline rank): run "
                       "each forward-backward cell's two microbatches taking turns at their expert all-to-alls, so "
                       "one's all-to-all is in flight while the other computes (engine.runtime.overlap; gradients "
                       "unchanged)")
    shard: Literal["none", "optimizer", "full"] = setting(
        "none", "none; optimizer: ZeRO-1, AdamW state 1/data per rank; full: FSDP2 per chunk, parameters, gradients "
                "and AdamW state 1/data per rank between steps (both a no-op at data=1; routed experts' 1/(data / "
                "expert), over their expert-data-parallel ranks)")


@dataclass
class DataConfig:
    """Training text.  ``bin`` token files: nanoGPT's raw uint16 or llm.c's headered uint16 / uint32."""

    source: Literal["stdlib", "text", "bin"] = setting("stdlib", "stdlib (this Python's standard library .py files), "
                                                       "text (data.paths) or bin (token files)")
    paths: list[str] = setting(text="files / folders for text; one folder with train.bin + val.bin or one .bin file "
                               "(split) for bin", factory=list)
    suffixes: list[str] = setting(text="file suffixes read from folders of data.paths",
                                  factory=lambda: [".txt", ".md", ".py", ".rst"])
    val_fraction: float = setting(0.05, "share of validation: every k-th block (k = 1 / val_fraction)",
                                  Range(0.0, 0.5, "use e.g. 0.05", low_open=True, high_open=True))
    split_block_bytes: int = setting(4096, "train / validation split granularity in bytes",
                                     Range(1, 1 << 30, "use a positive block size in bytes, e.g. 4096"))
    max_bytes: int | None = setting(None, "read at most this many bytes of text (null: all)",
                                    Range(1, 1 << 62, "use a positive byte count or null (all)"))
    tokenizer: Literal["bytes", "bpe"] = setting("bytes", "text sources: bytes (one token per byte) or bpe "
                                                 "(byte-level BPE of model.vocab_size tokens trained on the training "
                                                 "split, cached)")
    cache_dir: str | None = setting(None, "where BPE tokenizers and tokenized splits are cached (null: "
                                    "$XDG_CACHE_HOME or ~/.cache, then /pipecast)")


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr``; global grad-norm clipping."""

    lr: float = setting(1e-3, "peak learning rate (after linear warmup)",
                        Range(0.0, 10.0, "use a learning rate such as 3e-4 or 3e-3", low_open=True))
    min_lr: float = setting(1e-4, "learning rate at the end of the cosine decay (at training.steps)",
                            Range(0.0, 10.0, "use 0 or a value <= optimizer.lr"))
    warmup_steps: int = setting(10, "linear warmup steps", Range(0, MAX_STEPS, "use 0 (no warmup) or a number of "
                                                                               "steps"))
    weight_decay: float = setting(0.1, "AdamW weight decay (not on biases and norms)",
                                  Range(0.0, 10.0, "use e.g. 0.1 (0 disables it)"))
    beta1: float = setting(0.9, "AdamW beta1", Range(0.0, 1.0, "use e.g. 0.9", high_open=True))
    beta2: float = setting(0.95, "AdamW beta2", Range(0.0, 1.0, "use e.g. 0.95", high_open=True))
    eps: float = setting(1e-8, "AdamW epsilon", Range(0.0, 1.0, "use e.g. 1e-8", low_open=True))
    grad_clip: float = setting(1.0, "global L2 grad-norm clip (0: off)",
                               Range(0.0, 1e12, "use a positive max grad norm (e.g. 1.0) or 0 to disable clipping"))
    check_for_nan_in_loss_and_grad: bool = setting(True, "stop on every rank when the loss or grad norm is NaN / inf "
                                                   "(Megatron's option); the step is not applied and nothing is saved")


@dataclass
class TrainingConfig:
    """The step: ``num_microbatches`` microbatches of ``micro_batch_size`` sequences per data-parallel rank."""

    steps: int = setting(100, "optimizer steps of the run", Range(1, MAX_STEPS, _STEPS))
    micro_batch_size: int = setting(4, "sequences per microbatch b",
                                    Range(1, 1 << 20, "use a positive number of sequences"))
    num_microbatches: int = setting(4, "microbatches M per data-parallel rank and step; global batch = data x M x b",
                                    Range(1, 1 << 24, "use a positive number of microbatches"))
    eval_interval: int = setting(50, "evaluate every N steps (0: at the start and the end only)",
                                 Range(0, MAX_STEPS, "use 0 (at the start and end only) or a number of steps"))
    eval_iters: int = setting(1, "forward-only schedule calls per evaluation",
                              Range(1, 1 << 20, "use a positive number of evaluation calls"))
    eval_microbatches: int | None = setting(None, "microbatches per evaluation call (null: num_microbatches)",
                                            Range(1, 1 << 24, "use a positive number of microbatches or null"))
    seed: int = setting(1234, "seed of sample order, init and dropout",
                        Range(0, (1 << 32) - 1, "use a seed in [0, 2**32 - 1]"))
    deterministic: bool = setting(True, "deterministic kernels, warn-only (torch.use_deterministic_algorithms): "
                                  "bitwise repeatable on CPU; on CUDA the fused attention kernels' backward (cuDNN, "
                                  "memory-efficient SDPA) may still vary in the last bits")
    check_memory: bool = setting(True, "estimate each rank's memory (parameters, gradients, optimizer state, "
                                 "activations in flight) before any rank starts and refuse a run that cannot fit the "
                                 "host or GPU (engine.training.memory; false: skip the check)")


@dataclass
class CheckpointConfig:
    dir: str | None = setting(None, "checkpoint folder (null: logging.run_dir/checkpoints)")
    interval: int = setting(0, "save every N steps (0: at the end only)",
                            Range(0, MAX_STEPS, "use 0 (at the end only) or a number of steps"))
    keep: int = setting(2, "checkpoints kept (the oldest removed; a broken one counts like any other)",
                        Range(1, 1 << 20, "keep at least one checkpoint"))
    save_at_end: bool = setting(True, "save after the last step")
    load_step: int | None = setting(None, "with --resume: resume from the checkpoint of this step (Megatron's "
                                    "--ckpt-step, torchtitan's checkpoint.load_step), refused if it is broken (null: "
                                    "the newest intact checkpoint, warning about each newer broken one)",
                                    Range(1, MAX_STEPS, "use the step of a checkpoint in checkpoint.dir, or null"))


@dataclass
class LoggingConfig:
    run_dir: str = setting("runs/default", "run folder: config.yaml, train.log, metrics.jsonl, loss.png, "
                           "checkpoints")
    log_interval: int = setting(1, "log (and write metrics.jsonl) every N steps; only then does the host read the "
                                "steps' figures (a NaN / inf step or SIGTERM stops the run there)",
                                Range(1, MAX_STEPS, "use a positive number of steps"))
    progress_bar: bool | Literal["auto"] = setting("auto", "tqdm bar: true / false / auto (when stderr is a "
                                                   "terminal)")
    level: Literal["DEBUG", "INFO", "WARNING"] = setting("INFO", "log level of the logging rank")
    tensorboard: bool = setting(False, "also write TensorBoard events to run_dir/tensorboard (pip install -e "
                                "'.[tensorboard]')")
    peak_tflops: float | None = setting(None, "one GPU's peak TFLOP/s for MFU (null: the GPU's known dense bf16 "
                                        "peak)", Range(0.0, 1e9, "use one GPU's TFLOP/s or null", low_open=True))
    sample_every_eval: int = setting(0, "print a sample of N tokens at each evaluation (0: off)",
                                     Range(0, 1 << 20, "use 0 (off) or a number of tokens"))


@dataclass
class CudaGraphsConfig:
    enabled: bool = setting(False, "capture CUDA graphs per model chunk and microbatch")
    backend: Literal["auto", "te", "torch", "pipecast", "emulate", "eager"] = setting(
        "auto", "auto (TE when importable, else pipecast's), te, torch / pipecast, emulate (CPU test backend with "
                "static-buffer semantics), eager (no graphs)")
    warmup_steps: int = setting(2, "eager steps before capture",
                                Range(1, MAX_STEPS, "capture needs at least one eager step to record the passes it "
                                                    "captures"))


@dataclass
class ProfileConfig:
    enabled: bool = setting(False, "torch.profiler around the steps")
    wait: int = setting(1, "profiler: steps skipped first", Range(0, MAX_STEPS, _COUNT))
    warmup: int = setting(1, "profiler: warmup steps", Range(0, MAX_STEPS, _COUNT))
    active: int = setting(2, "profiler: recorded steps", Range(1, MAX_STEPS, "profile at least one step"))


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cuda_graphs: CudaGraphsConfig = field(default_factory=CudaGraphsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    # ---- derived values -------------------------------------------------------------------------------------
    @property
    def ffn_hidden_size(self) -> int:
        return self.model.ffn_hidden_size or 4 * self.model.hidden_size

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data or 1

    @property
    def world_size(self) -> int:
        return self.parallel.pipeline * self.data_parallel_size * self.parallel.tensor

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.training.micro_batch_size * self.training.num_microbatches * self.data_parallel_size

    @property
    def eval_microbatches(self) -> int:
        return self.training.eval_microbatches or self.training.num_microbatches

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.logging.run_dir) / "checkpoints"

    @property
    def schedule_name(self) -> str:
        """The schedule that runs: ``parallel.schedule``, or for ``auto`` Megatron's choice from
        ``parallel.pipeline`` / ``parallel.virtual`` (:func:`engine.plan.registry.auto_schedule`)."""
        p = self.parallel
        if p.schedule != "auto":
            return p.schedule
        return auto_schedule(p.pipeline, virtual_or_none(p.virtual))

    @property
    def layout(self) -> PipelineLayout:
        """The layers of each virtual pipeline stage: ``model.pipeline_layout``, or the even split of
        ``model.num_layers`` over ``parallel.pipeline x parallel.virtual`` stages (:mod:`engine.plan.layout`).

        Raises:
            ConfigError: a layout that does not fit the run, naming the field, its value and the fix.
        """
        p = self.parallel
        try:
            return resolve_layout(self.model.pipeline_layout, num_layers=self.model.num_layers, pp_size=p.pipeline,
                                  virtual=p.virtual, names=_LAYOUT_FIELDS)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None

    def resolve_schedule(self) -> ResolvedSchedule:
        """The run's one :class:`~engine.plan.resolve.ResolvedSchedule` (schedule, sizes and options; it gives
        every plan of the run).

        Raises:
            ConfigError: ``parallel.schedule: tuned`` not resolved yet
                (:func:`engine.training.tune.result.resolve_tuned`), or settings the schedule does not take.
        """
        p = self.parallel
        if p.schedule == "tuned":
            raise ConfigError("parallel.schedule=tuned was not resolved: resolve it with "
                              "engine.training.tune.result.resolve_tuned(config), which reads the best schedule from "
                              "RUN_DIR/tune.json (run `pipecast tune CONFIG` first); pipecast train does this")
        try:
            return resolve_schedule(p.schedule, p.pipeline, p.virtual, p.microbatch_group_size_per_vp_stage,
                                    p.max_in_flight, costs=p.schedule_costs,
                                    overlap_moe_expert_parallel_comm=p.overlap_moe_expert_parallel_comm)
        except ValueError as exc:
            raise ConfigError(f"parallel.schedule={p.schedule}: {exc}") from None
