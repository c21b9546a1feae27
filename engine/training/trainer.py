"""The training loop: a :class:`Trainer` that owns init, ``train_step``, ``train``, ``evaluate``, checkpoints and
``close`` (torchtitan's shape).  It drives the pipeline only through the public Megatron-style API:
``engine.schedules.forward_backward_pipelining_with_schedule`` handed the plan of the run's one resolution
(:class:`engine.plan.resolve.ResolvedSchedule`), with a ``forward_step_func`` / ``loss_func`` pair, model chunks
that implement ``set_input_tensor`` and carry ``.config``, and the ``finalize_model_grads_func`` / ``no_sync_func``
hooks on that config.

One training step (every rank)::

    zero grads -> schedule(forward_step_func, data iterators, chunks, M microbatches)   # the run's plan
               -> finalize_model_grads (data-parallel average, tied-embedding sum)      # called by the schedule
               -> global grad-norm clip -> AdamW step -> LR schedule step

The loss is owned by the last pipeline stage (on the last rank, or rank 0 under the V placement); it is averaged
over data-parallel replicas and broadcast over the pipeline so every rank returns the same metrics.  The log line
is written by the last stage of data-parallel replica 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from ..model_parallel_config import ModelParallelConfig
from ..plan.registry import virtual_or_none
from ..runtime.process_groups import ProcessGroupCollection, build_process_groups
from .checkpoint.dcp import (CheckpointError, checkpoint_keys, checkpoint_to_load, latest_checkpoint, list_checkpoints,
                             load_checkpoint, read_checkpoint_meta, save_checkpoint)
from .checkpoint.resume import MODEL_MUST_MATCH, refusal_message, resume_differences, run_settings
from .config import TrainConfig, check_fresh_run, dump_config, validate, validate_world_size
from .data.corpus import Batches, load_corpus
from .parallel.data_parallel import GradSync, clip_grad_norm
from .parallel.zero1 import ShardedAdamW, ShardedGradSync
from . import preempt
from .files import LogFile
from .metrics import MetricsLog, known_peak_tflops, model_flops_per_token
from .models.chunk import build_model_chunks, canonical_module
from .seed import set_seed_and_determinism

__all__ = ["Trainer", "lr_lambda", "NonFiniteLossError"]

log = logging.getLogger("pipecast.train")


class NonFiniteLossError(RuntimeError):
    """The loss or the global grad norm of a step is NaN or infinite (the run diverged); raised on every rank."""


def lr_lambda(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): linear warmup over ``warmup_steps`` to ``lr``, then
    cosine decay to ``min_lr`` at ``total_steps`` (and ``min_lr`` after)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    floor = min_lr / lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """A pipeline-parallel GPT training run on this rank.

    Args:
        config: a validated :class:`~engine.training.config.TrainConfig` (``load_config``).

    ``torch.distributed`` must be initialised with ``parallel.pipeline x parallel.data`` ranks (``pipecast train``
    and ``engine.training.launch.spawn`` do it; torchrun plus ``init_process_group`` works too); a one-rank config
    initialises a one-process gloo group itself.  Use as a context manager or call :meth:`close`.

    Raises:
        ConfigError / RuntimeError: invalid config or world size (before any process group is created).
    """

    def __init__(self, config: TrainConfig):
        validate(config)
        self._owns_default_group = self._init_distributed(config)
        self.config = config = validate_world_size(config, dist.get_world_size())
        self.rank = dist.get_rank()
        self.device = self._pick_device(config)
        p = config.parallel
        backend = None if p.backend == "auto" else p.backend
        self.pg: ProcessGroupCollection = build_process_groups(
            p.pipeline, virtual_or_none(p.virtual), backend=backend,
            timeout=datetime.timedelta(seconds=p.timeout_s), tensor_model_parallel_size=p.tensor)
        self.pp_rank, self.pp_size = self.pg.pipeline_model_parallel_rank, p.pipeline
        self.dp_rank, self.dp_size = self.pg.data_parallel_rank, self.pg.data_parallel_size
        self.schedule = config.resolve_schedule()  # the run's one resolution: it gives every plan of the run
        self.plan = self.schedule.plan(config.training.num_microbatches)  # its placement: the stages held here
        self.loss_rank = self.plan.stage_location(self.plan.num_stages - 1)[0]  # pipeline rank of the loss stage
        self.is_log_rank = self.pp_rank == self.loss_rank and self.dp_rank == 0 == self.pg.tensor_model_parallel_rank
        self.run_dir = Path(config.logging.run_dir)
        # a folder with checkpoints belongs to another run until load() resumes it: its train.log and config.yaml
        # are left alone (train() refuses a fresh start there, see check_fresh_run)
        self._run_files_open = not list_checkpoints(config.checkpoint_dir)
        self._log_file = _setup_logging(config, self.is_log_rank, self.run_dir, to_file=self._run_files_open)
        set_seed_and_determinism(config.training.seed, self.pp_rank, config.training.deterministic)

        self.tracer = None  # an engine.runtime.tracing.Tracer; the profiling tools set it
        self.mp_config = self._model_parallel_config()
        self.model = build_model_chunks(config.model, config.ffn_hidden_size, p.pipeline, self.pp_rank, p.virtual,
                                        config.training.seed, self.mp_config, self.device,
                                        stages=self.plan.stages_of(self.pp_rank))
        self._apply_tensor_parallel()
        self._apply_full_shard()
        first, last = self.plan.stage_location(0)[0], self.plan.stage_location(self.plan.num_stages - 1)[0]
        self.grad_sync = self._build_grad_sync(tied_on_one_rank=first == last)
        self.mp_config.finalize_model_grads_func = self.grad_sync.finalize_model_grads
        self.mp_config.no_sync_func = self.grad_sync.no_sync
        self.canonical = canonical_module(self.model)
        if config.model.init_from:
            self._init_from_hf()
        self.optimizer = self._build_optimizer()
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_multiplier)
        self.batches = self._build_batches()
        self.step = 0
        self.history: list[dict] = []
        self.val_history: list[tuple[int, float]] = []
        self._graphs = None  # graphs.runtime.GraphRuntime, created by _maybe_capture_graphs when enabled
        self._resumed = False
        self.preempted: Path | None = None  # the checkpoint saved when SIGTERM stopped train()
        self._metrics: MetricsLog | None = None  # opened by train() on the logging rank
        self.flops_per_token = model_flops_per_token(config.model, config.ffn_hidden_size)
        self.peak_tflops = self._peak_tflops()
        self._forward_backward, self._p2p = self._schedule()
        if self.rank == 0 and self._run_files_open:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(config, self.run_dir / "config.yaml")
        n_params = sum(p.numel() for c in self.model for p in c.parameters())
        log.info("pipecast: %s schedule, pipeline=%d virtual=%d data=%d, %d layers, %.2fM parameters on this "
                 "rank, device %s, simulated bubble %.1f%%, data: %s", config.schedule_name + (
                     f" (max_in_flight {p.max_in_flight})" if p.max_in_flight else ""), p.pipeline, p.virtual,
                 self.dp_size, config.model.num_layers, n_params / 1e6, self.device, 100 * self.simulated_bubble(),
                 self.batches.corpus.description if self.batches else "(not read on this stage)")

    # ---- setup ------------------------------------------------------------------------------------------------
    @staticmethod
    def _init_distributed(config: TrainConfig) -> bool:
        if dist.is_initialized():
            return False
        if config.world_size != 1:
            raise RuntimeError(
                f"the config needs {config.world_size} ranks (parallel.pipeline x parallel.data = "
                f"{config.parallel.pipeline} x {config.data_parallel_size}) but torch.distributed is not initialised;"
                f" launch with `pipecast train CONFIG`, torchrun, or engine.training.launch.spawn")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return True

    @torch.no_grad()
    def _init_from_hf(self) -> None:
        """``model.init_from``: copy the Hugging Face folder's tensors into this rank's parameters (each rank reads
        only what its model chunks hold; a tied copy on the last stage reads the word embedding).  A later
        ``load()`` (resume) overwrites them.

        Raises:
            ConfigError: missing or unexpected tensors, or a shape that differs (naming the tensor)."""
        from .config import ConfigError
        from .checkpoint.hf import load_hf_weights
        params = dict(self.canonical.named_parameters())
        tensors = load_hf_weights(self.config.model.init_from, self.config.model, params)
        for name, param in params.items():
            value = tensors[name]
            if isinstance(param, DTensor):  # parallel.tensor > 1: this rank's shard of the full tensor
                value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements,
                                          src_data_rank=None)
            if tuple(value.shape) != tuple(param.shape):
                raise ConfigError(f"model.init_from={self.config.model.init_from!r}: tensor for {name} has shape "
                                  f"{list(value.shape)}, the model expects {list(param.shape)}")
            param.copy_(value)
        if self.is_log_rank:
            log.info("model.init_from: %d tensors from %s", len(params), self.config.model.init_from)

    def _apply_tensor_parallel(self) -> None:
        """``parallel.tensor > 1``: column / row / vocabulary-parallel layers on the mesh's ``tp`` dimension
        (:mod:`engine.training.parallel.tensor_parallel`); local, every rank slices the same full initial weights."""
        if self.config.parallel.tensor > 1:
            from ..runtime.process_groups import device_mesh
            from .parallel.tensor_parallel import parallelize_chunks
            parallelize_chunks(self.model, device_mesh(self.pg, self.device.type)["tp"],
                               sequence_parallel=self.config.parallel.sequence_parallel)

    def _apply_full_shard(self) -> None:
        """``parallel.shard=full`` with data > 1: ``fully_shard`` each chunk over the mesh's ``dp`` dimension
        (:mod:`engine.training.parallel.fsdp`; local, every replica slices the same full initial weights).  At data = 1 one
        shard is the whole model: it runs as ``shard=none``."""
        p = self.config.parallel
        self.fully_sharded = p.shard == "full" and self.dp_size > 1
        if p.shard == "full":
            log.info("parallel.shard=full: %s", "FSDP2 fully_shard per model chunk over the data-parallel group" if
                     self.fully_sharded else "parallel.data=1, one shard is the whole model (runs as shard=none)")
        if self.fully_sharded:
            from ..runtime.process_groups import device_mesh
            from .parallel.fsdp import shard_chunks
            shard_chunks(self.model, device_mesh(self.pg, self.device.type)["dp"])

    @staticmethod
    def _pick_device(config: TrainConfig) -> torch.device:
        want = config.parallel.device
        if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                raise RuntimeError("parallel.device=cuda but CUDA is not available; set parallel.device=cpu or auto")
            local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
        return torch.device("cpu")

    def _peak_tflops(self) -> float | None:
        """Per-GPU peak for MFU: ``logging.peak_tflops``, else the GPU's known dense bf16 peak; None on CPU."""
        if self.device.type != "cuda":
            return None
        return self.config.logging.peak_tflops or known_peak_tflops(torch.cuda.get_device_name(self.device))

    def _model_parallel_config(self) -> ModelParallelConfig:
        c, p = self.config, self.config.parallel
        bf16 = c.model.precision == "bf16" and self.device.type == "cuda"
        return ModelParallelConfig(
            pipeline_model_parallel_size=p.pipeline, tensor_model_parallel_size=p.tensor,
            sequence_parallel=p.sequence_parallel,  # the schedules then send [s / tensor, b, h]
            virtual_pipeline_model_parallel_size=virtual_or_none(p.virtual),
            microbatch_group_size_per_vp_stage=p.microbatch_group_size_per_vp_stage,
            pipeline_dtype=torch.float32, hidden_size=c.model.hidden_size,
            batch_p2p_comm=p.batch_p2p_comm, overlap_p2p_comm=p.overlap_p2p_comm,
            deallocate_pipeline_outputs=p.deallocate_pipeline_outputs,
            enable_autocast=bf16, autocast_dtype=torch.bfloat16 if bf16 else None,
            deterministic_mode=c.training.deterministic)

    def _build_grad_sync(self, tied_on_one_rank: bool) -> GradSync:
        """GradSync, or with data > 1 its ZeRO-1 form (``parallel.shard=optimizer``, engine.training.parallel.zero1) or
        its FSDP2 form (``parallel.shard=full``, engine.training.parallel.fsdp)."""
        p = self.config.parallel
        self.sharded = p.shard == "optimizer" and self.dp_size > 1
        if p.shard == "optimizer":
            log.info("parallel.shard=optimizer: %s", "AdamW state sharded over the data-parallel group" if
                     self.sharded else "parallel.data=1, one shard is the whole state (runs as shard=none)")
        if self.sharded:
            return ShardedGradSync(self.model, self.pg, tied_on_one_rank=tied_on_one_rank)
        if self.fully_sharded:
            from .parallel.fsdp import FSDPGradSync
            return FSDPGradSync(self.model, self.pg)
        return GradSync(self.model, self.pg, overlap=p.overlap_grad_reduce, tied_on_one_rank=tied_on_one_rank)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.config.optimizer
        params = [p for c in self.model for p in c.parameters() if p.requires_grad]
        unique = list({id(p): p for p in params}.values())
        decay = [p for p in unique if p.dim() >= 2]
        no_decay = [p for p in unique if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if self.sharded:
            return ShardedAdamW(groups, self.grad_sync, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)

    def _lr_multiplier(self, step: int) -> float:
        o = self.config.optimizer
        return lr_lambda(step, o.lr, o.min_lr, o.warmup_steps, self.config.training.steps)

    def simulated_bubble(self) -> float:
        """Bubble fraction of one training step from the plan simulator at nominal costs
        (:func:`engine.plan.simulate.simulate_nominal`): idle / makespan over all pipeline ranks."""
        from ..plan.simulate import simulate_nominal
        return simulate_nominal(self.plan).bubble_overall

    @property
    def _reads_tokens(self) -> bool:
        return any(c.is_first for c in self.model)

    @property
    def _reads_labels(self) -> bool:
        return any(c.is_last for c in self.model)

    def _build_batches(self) -> Batches | None:
        if not (self._reads_tokens or self._reads_labels):
            return None  # middle stages read no data
        c = self.config
        corpus = load_corpus(c.data, c.model.seq_length, c.model.vocab_size)
        return Batches(corpus, c.model.seq_length, c.training.micro_batch_size, c.training.num_microbatches,
                       self.dp_rank, self.dp_size, c.training.seed, c.model.vocab_size, self.device)

    def _schedule(self):
        """The schedule call (the public API, which runs the plan it is handed) and the pipeline communicator."""
        from .. import schedules  # the public API; imported late so that `engine` never imports the trainer eagerly
        from ..runtime.p2p import P2PCommunicator
        # no pipelining ignores it (Megatron's contract); pipelined schedules need it next to pg_collection
        return schedules.forward_backward_pipelining_with_schedule, P2PCommunicator(self.pg.pp, self.mp_config)

    # ---- one step ---------------------------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        """``forward_step_func(data_iterator, model) -> (output, loss_func)``: only the first stage reads tokens,
        only the last reads labels (their chunks get an iterator; the others get None)."""
        batch = next(data_iterator) if data_iterator is not None else {}
        return model(batch.get("tokens"), batch.get("labels")), _loss_func

    def _iterators(self, microbatches: Iterator[dict] | None) -> list:
        """One data iterator per chunk that reads data (first and last stage), None for the others; when one
        rank holds both (V placement) each gets its own iterator over the same microbatches."""
        readers = [c.is_first or c.is_last for c in self.model]
        if sum(readers) > 1 and microbatches is not None:
            items = list(microbatches)
            return [iter(items) if r else None for r in readers]
        return [microbatches if r else None for r in readers]

    def _run_schedule(self, microbatches, num_microbatches: int, forward_only: bool, forward_step_func=None,
                      micro_batch_size: int | None = None, collect_non_loss_data: bool = False) -> list:
        c = self.config
        kwargs: dict[str, Any] = dict(
            schedule=self.schedule.plan(num_microbatches, forward_only),  # the run's plan for this call
            forward_step_func=forward_step_func or self._forward_step, data_iterator=self._iterators(microbatches),
            model=self.model, num_microbatches=num_microbatches, seq_length=c.model.seq_length,
            micro_batch_size=micro_batch_size or c.training.micro_batch_size, forward_only=forward_only,
            pg_collection=self.pg, p2p_communicator=self._p2p)
        if collect_non_loss_data:
            kwargs["collect_non_loss_data"] = True
        out = self._forward_backward(**kwargs)
        if forward_only and self.fully_sharded:  # a training step reshards in finalize_model_grads
            from .parallel.fsdp import reshard
            reshard(self.model)
        return out

    def _data(self, step: int):
        if self.batches is None:
            return None
        return self.batches.train(step, self._reads_tokens, self._reads_labels)

    def _maybe_capture_graphs(self) -> None:
        """Call site for CUDA graphs (``cuda_graphs:`` section), run at the start of every train step.

        Does nothing unless ``cuda_graphs.enabled``; then ``graphs.runtime.GraphRuntime`` runs ``warmup_steps`` eager
        steps, captures per (chunk, microbatch, layer) in this rank's order (collectively; one log line if it falls
        back to eager) and recaptures if the microbatch count or shapes change.  Split-backward schedules get F, B
        and W graphs; their W replays run inside the split backward's W passes (``defer_weight_grad``).
        """
        cg = self.config.cuda_graphs
        if not cg.enabled:
            return
        if getattr(self, "_graphs", None) is None:
            from engine.runtime.split_backward import defer_weight_grad  # W graphs join the split backward's W
            from graphs.runtime import GraphRuntime  # the one engine -> graphs call site
            p = self.config.parallel
            self._graphs = GraphRuntime(self.model, self.schedule, self.pp_size, self.pp_rank, p.virtual,
                                        backend=cg.backend,
                                        warmup_steps=cg.warmup_steps, tracer=self.tracer,
                                        variable_seq_lengths=self.mp_config.variable_seq_lengths,
                                        defer_weight_grad=defer_weight_grad, plan=self.plan, timeout_s=p.timeout_s)
        self._graphs.before_step(self.config.training.num_microbatches,
                                 (self.config.model.seq_length, self.config.training.micro_batch_size))

    def train_step(self) -> dict:
        """Run one optimizer step; returns ``{step, loss, grad_norm, lr, tokens_per_s, tokens_seen, step_time_s,
        tflops}`` plus on CUDA ``max_memory_gib``, ``reserved_memory_gib`` and ``mfu`` (same on every rank; ``loss``
        in nats per token, averaged over the global batch; ``tflops``: model TFLOP/s of the whole job from
        :func:`~engine.training.metrics.model_flops_per_token`).

        Raises:
            NonFiniteLossError: NaN / inf loss or grad norm (when ``optimizer.check_for_nan_in_loss_and_grad``); the
                optimizer step is not applied.
        """
        self._maybe_capture_graphs()
        t0 = time.perf_counter()
        for chunk in self.model:
            chunk.train()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]
        store = self._run_schedule(self._data(self.step), self.config.training.num_microbatches, False)
        grad_norm = self._clip_grad_norm(self.config.optimizer.grad_clip)
        loss = self._reduce_loss(store)
        if self.config.optimizer.check_for_nan_in_loss_and_grad:
            self._check_finite(loss, grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.step += 1
        tokens = self.config.global_batch_size * self.config.model.seq_length
        metrics = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens / dt,
                   "tokens_seen": self.step * tokens, "step_time_s": dt,
                   "tflops": self.flops_per_token * tokens / dt / 1e12}
        if self.device.type == "cuda":
            metrics["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics["reserved_memory_gib"] = torch.cuda.memory_reserved(self.device) / 2**30
            if self.peak_tflops:
                metrics["mfu"] = metrics["tflops"] / (self.peak_tflops * self.config.world_size)
        self.history.append(metrics)
        return metrics

    def _clip_grad_norm(self, max_norm: float) -> float:
        if self.sharded:
            return self.optimizer.clip_grad_norm(max_norm)
        if self.fully_sharded:
            from .parallel import fsdp
            return fsdp.clip_grad_norm(self.model, max_norm, self.pg)
        return clip_grad_norm(self.model, max_norm, self.pg)

    def _check_finite(self, loss: float, grad_norm: float) -> None:
        """Megatron's ``check_for_nan_in_loss_and_grad``: both values are global (the same on every rank), so every
        rank raises the same error before the optimizer step -- the step is not applied and nothing is saved."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        o = self.config.optimizer
        what = " and ".join(f"{name} is {value}" for name, value in [("loss", loss), ("grad norm", grad_norm)]
                            if not math.isfinite(value))
        clip = (f"optimizer.grad_clip={o.grad_clip} is on" if o.grad_clip > 0 else
                "enable optimizer.grad_clip (e.g. 1.0)")
        raise NonFiniteLossError(
            f"step {self.step + 1}: {what} (loss {loss}, grad norm {grad_norm}); the training diverged, so the step "
            f"was not applied and no checkpoint was written. Try a lower optimizer.lr (now {o.lr:g}; warmup "
            f"optimizer.warmup_steps={o.warmup_steps}) and {clip}; resume from the last checkpoint with --resume, "
            f"or set optimizer.check_for_nan_in_loss_and_grad=false to continue anyway")

    def _reduce_loss(self, store: list) -> float:
        """Sum the ``[loss sum, tokens]`` pairs of the loss stage, average over data-parallel replicas and broadcast
        the mean over the pipeline group (so every rank returns it)."""
        total = torch.zeros(2, dtype=torch.float64)
        if self.pp_rank == self.loss_rank:
            for entry in store:
                total += entry["lm loss"].detach().to("cpu", torch.float64)
            if self.dp_size > 1:
                total = _all_reduce_cpu(total, self.pg.dp)
        if self.pp_size > 1:
            total = _broadcast_cpu(total, self.pg.pp_ranks[self.loss_rank], self.pg.pp)
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss (nats per token) with the forward-only schedule over ``training.eval_iters`` fixed
        batches; the same value on every rank."""
        for chunk in self.model:
            chunk.eval()
        c, total = self.config, torch.zeros(2, dtype=torch.float64)
        m = c.eval_microbatches
        for i in range(c.training.eval_iters):
            data = (self.batches.val(i, c.training.eval_iters, m, self._reads_tokens, self._reads_labels)
                    if self.batches is not None else None)
            for entry in self._run_schedule(data, m, True):
                total += entry["lm loss"].detach().to("cpu", torch.float64)
        for chunk in self.model:
            chunk.train()
        if self.pp_rank == self.loss_rank and self.dp_size > 1:
            total = _all_reduce_cpu(total, self.pg.dp)
        if self.pp_size > 1:
            total = _broadcast_cpu(total, self.pg.pp_ranks[self.loss_rank], self.pg.pp)
        loss = float(total[0] / total[1])
        self.val_history.append((self.step, loss))
        return loss

    # ---- sampling ---------------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The run's tokenizer on ranks that read data (None elsewhere, and for ``.bin`` token ids)."""
        return None if self.batches is None else self.batches.corpus.tokenizer

    def _next_token_logits(self, ids: list[int]) -> torch.Tensor | None:
        """Logits ``[V]`` after the last ``seq_length`` tokens of ``ids``: one forward-only pipeline pass of
        microbatches ``[1, s]`` (one; a schedule that groups microbatches, interleaved 1F1B, needs a whole group,
        so G copies there), the context right-padded to ``s`` (causal attention: padding after the position read
        cannot change it).  Returns the logits on the last pipeline stage, None elsewhere."""
        p = self.config.parallel
        m = (self.schedule.group_size or p.pipeline) if "group_size" in self.schedule.spec.options else 1
        s = self.config.model.seq_length
        window = ids[-s:]
        n = len(window)
        tokens = torch.tensor([window + [0] * (s - n)], dtype=torch.int64, device=self.device)

        def step(data_iterator, model):
            if data_iterator is not None:
                next(data_iterator)
            return model(tokens if model.is_first else None), lambda out, non_loss_data=False: out[n - 1, 0].float()

        batch = iter([{}] * m) if self.batches is not None else None
        store = self._run_schedule(batch, m, True, forward_step_func=step, micro_batch_size=1,
                                   collect_non_loss_data=True)
        return store[0].cpu() if self.pp_rank == self.loss_rank and store else None

    @torch.no_grad()
    def sample(self, num_tokens: int, temperature: float = 0.8, top_k: int | None = 50,
               seed: int | None = None) -> list[int]:
        """Collective (every rank): ``num_tokens`` token ids generated after a newline prompt by the model as it
        is now (eval mode, the training RNG untouched: draws come from a generator seeded with ``seed``, default
        ``training.seed + step``).  Returns the ids on every rank (sampled on the last stage, broadcast over the
        pipeline group); see :func:`engine.training.generate.sample_token`."""
        from .generate import encode_prompt, sample_token
        for chunk in self.model:
            chunk.eval()
        tok, vocab = self.tokenizer, self.config.model.vocab_size
        ids = encode_prompt(tok, "", vocab) if self.batches is not None else [0]
        generator = torch.Generator().manual_seed(self.config.training.seed + self.step if seed is None else seed)
        suspend = self._graphs.suspend() if self._graphs is not None else contextlib.nullcontext()
        new: list[int] = []
        with suspend:
            for _ in range(num_tokens):
                logits = self._next_token_logits(ids)
                token = torch.tensor([-1 if logits is None else sample_token(logits, temperature, top_k, generator)],
                                     dtype=torch.int64)
                if self.pp_size > 1:
                    token = _broadcast_cpu(token, self.pg.pp_ranks[self.loss_rank], self.pg.pp)
                ids.append(int(token))
                new.append(int(token))
        for chunk in self.model:
            chunk.train()
        return new

    def _log_sample(self) -> None:
        """``logging.sample_every_eval`` tokens of text, logged after an evaluation (collective)."""
        n = self.config.logging.sample_every_eval
        if not n:
            return
        ids = self.sample(n)
        if self.is_log_rank:
            from .generate import decode
            text = "".join(ch if ch in "\n\t" or ch.isprintable() else ascii(ch)[1:-1]
                           for ch in decode(self.tokenizer, ids))  # no raw control bytes into the terminal / log
            log.info("step %d | sample of %d tokens (temperature 0.8, top-k 50):\n%s", self.step, n, text)

    # ---- the loop ---------------------------------------------------------------------------------------------
    def train(self, steps: int | None = None) -> list[dict]:
        """Train until ``training.steps`` (or ``steps`` more steps), evaluating every ``training.eval_interval``
        steps (and before the first step of this run, fresh or resumed, and at the end) and checkpointing every
        ``checkpoint.interval`` steps and at the end.  Returns the per-step metrics of this call.

        SIGTERM (to any rank, while training) stops every rank after the current step with a checkpoint of it
        (:mod:`engine.training.preempt`); :attr:`preempted` is then that checkpoint's path (None otherwise).

        Raises:
            ConfigError: a fresh run (nothing loaded) whose ``checkpoint.dir`` holds another run's checkpoints.
            NonFiniteLossError: the loss or grad norm is NaN / inf (``optimizer.check_for_nan_in_loss_and_grad``).
        """
        c = self.config
        if self.step == 0 and not self._resumed:
            check_fresh_run(c, resume=False)  # every rank raises the same error (the folder is shared)
        end = c.training.steps if steps is None else min(c.training.steps, self.step + steps)
        start = self.step
        if self.step >= c.training.steps:
            if self.is_log_rank:
                log.info("nothing to do: %s step %d >= training.steps=%d; raise training.steps to train further",
                         "checkpoint" if self._resumed else "trainer", self.step, c.training.steps)
            return []
        if self.is_log_rank and self._metrics is None:
            self._metrics = MetricsLog(self.run_dir, self.step if self._resumed else None, c.logging.tensorboard,
                                       title=f"{self.run_dir.name}: {c.schedule_name}, pipeline={c.parallel.pipeline}"
                                             f" virtual={c.parallel.virtual} data={self.dp_size}")
        if not self.val_history:  # also at the start of a resumed run: "val loss A -> B" covers this run
            self._log_eval(self.evaluate())
            self._log_sample()
        with self._progress(start, end) as bar, preempt.sigterm_requests():
            while self.step < end:
                metrics = self.train_step()
                if self.step % c.logging.log_interval == 0 or self.step == end:
                    self._log_step(metrics)
                if (c.training.eval_interval and self.step % c.training.eval_interval == 0) or \
                        self.step == c.training.steps:
                    metrics["val_loss"] = self.evaluate()
                    self._log_eval(metrics["val_loss"])
                    self._log_sample()
                if c.checkpoint.interval and self.step % c.checkpoint.interval == 0:
                    self.save()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}")
                if self.step < end and preempt.stop_agreed():  # collective: every rank stops after this step
                    self.preempted = self._save_for_stop()
                    break
        if self._metrics is not None and self.val_history[-1][0] != self.step:
            self._metrics.plot()  # the end (an evaluation at this step has drawn it already)
        if c.checkpoint.save_at_end and self.step == c.training.steps and self.step > start and \
                not (c.checkpoint.interval and self.step % c.checkpoint.interval == 0):
            self.save()
        return self.history[len(self.history) - (self.step - start):]

    def _save_for_stop(self) -> Path:
        """SIGTERM reached a rank: save this step (unless ``checkpoint.interval`` just did) and say so."""
        latest = latest_checkpoint(self.config.checkpoint_dir)
        path = latest if latest is not None and latest.name == f"step_{self.step:08d}" else self.save()
        if self.is_log_rank:
            log.info("step %d | SIGTERM: stopped after this step; checkpoint %s (continue with --resume)",
                     self.step, path)
        return path

    @contextlib.contextmanager
    def _progress(self, start: int, end: int):
        mode = self.config.logging.progress_bar
        on = self.is_log_rank and (mode is True or (mode == "auto" and sys.stderr.isatty()))
        if not on:
            yield None
            return
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
        with logging_redirect_tqdm(loggers=[logging.getLogger("pipecast")]), \
                tqdm(total=end, initial=start, desc="train", unit="step", dynamic_ncols=True) as bar:
            yield bar

    def _log_step(self, m: dict) -> None:
        """One log line and one ``metrics.jsonl`` line (logging rank)."""
        if not self.is_log_rank:
            return
        memory = f" | mem {m['max_memory_gib']:.2f} GiB" if "max_memory_gib" in m else ""
        mfu = f" | MFU {100 * m['mfu']:.1f}%" if "mfu" in m else ""
        log.info("step %d/%d | loss %.4f | grad norm %.3f | lr %.3e | %.0f tokens/s | %.3g TFLOP/s%s | step %.3f s%s",
                 m["step"], self.config.training.steps, m["loss"], m["grad_norm"], m["lr"], m["tokens_per_s"],
                 m["tflops"], mfu, m["step_time_s"], memory)
        if self._metrics is not None:
            self._metrics.write({k: v for k, v in m.items() if k != "val_loss"})

    def _log_eval(self, loss: float) -> None:
        """The validation line of the log and of ``metrics.jsonl``; redraws ``loss.png`` (logging rank)."""
        if self.is_log_rank:
            log.info("step %d/%d | val loss %.4f", self.step, self.config.training.steps, loss)
            if self._metrics is not None:
                self._metrics.write({"step": self.step, "val_loss": loss})
                self._metrics.plot()

    # ---- state ------------------------------------------------------------------------------------------------
    def _dcp_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        model_sd, optim_sd = get_state_dict(self.canonical, self.optimizer, options=options)
        return model_sd, optim_sd, options

    def state_dict(self) -> dict:
        """Everything a resume needs, as nested dicts of tensors: model and AdamW state under layout-independent
        names, the step (= data position and LR-schedule position) and this rank's RNG states."""
        model_sd, optim_sd, _ = self._dcp_state()
        if self.config.parallel.tensor > 1 or self.fully_sharded:  # saved unsharded (tensor_parallel.full_state)
            from .parallel.tensor_parallel import full_state
            model_sd, optim_sd = full_state(model_sd), full_state(optim_sd)
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"model": model_sd, "optim": {k: v for k, v in optim_sd.items() if k.startswith("state.")},
                "trainer": {"step": torch.tensor(self.step, dtype=torch.int64)},
                "scheduler": _scheduler_tensors(self.lr_scheduler.state_dict()),
                "rng": {f"rank{self.rank}": rng}}

    def save(self, directory: str | Path | None = None) -> Path:
        """Collective: write a checkpoint of the current step (``checkpoint.dir`` by default); returns its path."""
        if self.step == 0:
            raise RuntimeError("nothing to save before the first training step")
        tok = getattr(self.batches.corpus, "tokenizer", None) if self.batches is not None else None
        extra = {"tokenizer.json": tok.to_str()} if getattr(tok, "kind", None) == "bpe" else None
        path = save_checkpoint(self.state_dict(), directory or self.config.checkpoint_dir, self.step,
                               self.config.checkpoint.keep, meta=self._checkpoint_meta(), extra_files=extra)
        if self.is_log_rank:
            log.info("step %d | saved checkpoint %s", self.step, path)
        return path

    def _checkpoint_meta(self) -> dict:
        """Saved beside the tensors: what a resume must match (``model``: the settings that fix parameter names
        and shapes, ``ffn_hidden_size`` resolved), and what ``pipecast sample`` / ``export`` need to rebuild the
        model in one process (``model_config``: every model field; ``tokenizer``: ``bytes``, ``bpe`` with its
        ``tokenizer.json`` in the checkpoint folder, or ``none`` for ``.bin`` token files)."""
        c = self.config
        kind = "none" if c.data.source == "bin" else c.data.tokenizer
        return {"step": self.step, "model": {k: getattr(c.model, k) for k in MODEL_MUST_MATCH} |
                {"ffn_hidden_size": c.ffn_hidden_size},
                "model_config": dataclasses.asdict(c.model) | {"ffn_hidden_size": c.ffn_hidden_size},
                "tokenizer": {"kind": kind} | ({"file": "tokenizer.json"} if kind == "bpe" else {}),
                "seed": c.training.seed, "run": run_settings(c)}

    def _check_checkpoint_meta(self, path: Path) -> list[str]:
        """Compare the model and run settings saved with ``path`` to this config before loading any tensor
        (:func:`engine.training.checkpoint.resume.resume_differences`: which changes are refused, which warned, and
        why).  Returns the warned changes (``load`` logs them once, on the logging rank, into train.log).

        Raises:
            CheckpointError: one message naming every refused field with both values, and the fix.
        """
        refused, warned = resume_differences(read_checkpoint_meta(path), self.config)
        if refused:
            raise CheckpointError(refusal_message(path, refused))
        return warned

    def load(self, path: str | Path | None = None) -> Path | None:
        """Collective: restore model, optimizer, LR schedule, data position and RNG from ``path`` (default: the
        checkpoint of ``checkpoint.load_step``, else the newest intact one in ``checkpoint.dir``, each newer broken
        one named in a warning; None is returned when there is none).  Every rank verifies its share of the files
        first (:func:`engine.training.checkpoint.dcp.checkpoint_to_load`).

        Raises:
            CheckpointError: a broken checkpoint named by ``path`` or ``checkpoint.load_step``, no intact one, or
                one written for another model (the model settings saved with it differ: each differing field is
                named with both values).
        """
        from torch.distributed.checkpoint.state_dict import set_state_dict
        path, skipped = checkpoint_to_load(self.config.checkpoint_dir, self.config.checkpoint.load_step, path)
        for line in skipped if self.is_log_rank else ():
            log.warning("%s", line)
        if path is None:
            return None
        keys = checkpoint_keys(path)
        warned = self._check_checkpoint_meta(Path(path))
        model_sd, optim_sd, options = self._dcp_state()
        sharded = self.config.parallel.tensor > 1 or self.fully_sharded  # full on disk, this rank's shards in memory
        if sharded:
            from .parallel.tensor_parallel import full_templates, reshard_like
            model_tp, optim_tp = model_sd, optim_sd
            model_sd, optim_sd = full_templates(model_sd), full_templates(optim_sd)
        target = {"model": model_sd, "optim": {k: v for k, v in optim_sd.items() if k.startswith("state.")},
                  "trainer": {"step": torch.tensor(0, dtype=torch.int64)}}
        rng_key = f"rng.rank{self.rank}.cpu"
        if rng_key in keys:
            target["rng"] = {f"rank{self.rank}": {"cpu": torch.get_rng_state()}}
        load_checkpoint(target, path, verify=False)
        optim_sd.update(target["optim"])
        if sharded:
            target["model"], optim_sd = reshard_like(target["model"], model_tp), reshard_like(optim_sd, optim_tp)
        set_state_dict(self.canonical, self.optimizer, model_state_dict=target["model"], optim_state_dict=optim_sd,
                       options=options)
        self.step = int(target["trainer"]["step"])
        self._load_scheduler()
        if "rng" in target:
            torch.set_rng_state(target["rng"][f"rank{self.rank}"]["cpu"])
        self._resumed = True
        self._open_run_files()  # this run continues the folder's run: its train.log and config.yaml are ours
        if self.is_log_rank:
            log.info("resumed from %s at step %d", path, self.step)
            if warned:
                log.warning("resumed with changed settings (the run continues with the new values): %s",
                            "; ".join(warned))
        return Path(path)

    def _open_run_files(self) -> None:
        if self._run_files_open:
            return
        self._run_files_open = True
        self._log_file = _setup_logging(self.config, self.is_log_rank, self.run_dir)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(self.config, self.run_dir / "config.yaml")

    def _load_scheduler(self) -> None:
        """Put the LR schedule at ``self.step`` (``step`` scheduler steps taken) of *this* config's schedule, then
        set each group's LR to it.  The schedule is a function of the step and the config (``lr_lambda``), so a
        run resumed with more ``training.steps`` or another ``optimizer.lr`` follows its own schedule from its first
        step (issue 36); the scheduler state saved with the checkpoint (the old schedule's last LR and base LR) is
        not read back.  With an unchanged config the LRs are bitwise those of the run that saved (the same
        ``base * lr_lambda(step)`` as ``LambdaLR``)."""
        state = self.lr_scheduler.state_dict()
        lrs = [base * self._lr_multiplier(self.step) for base in self.lr_scheduler.base_lrs]
        state.update(last_epoch=self.step, _step_count=self.step + 1, _last_lr=lrs)
        self.lr_scheduler.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
            group["lr"] = lr

    def close(self, failed: bool = False) -> None:
        """Release hooks and process groups (and the default group if this trainer created it).

        After a successful run every rank first meets at a barrier, so no rank tears down its groups while a peer
        still has communication in flight; ``failed=True`` (closing because of an exception) skips the barrier,
        which could otherwise block on a dead peer.
        """
        if not failed and dist.is_initialized():
            dist.barrier()
        self.grad_sync.close()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._graphs is not None:
            self._graphs.close()
        if self._log_file is not None:
            logging.getLogger("pipecast").removeHandler(self._log_file)
            self._log_file.close()
        self.pg.destroy()
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


# model settings that fix the parameter names and shapes (ffn_hidden_size is saved resolved)

_SCHEDULER_FIELDS = {"last_epoch": int, "_step_count": int, "base_lrs": list, "_last_lr": list}


def _scheduler_tensors(state: dict) -> dict:
    """The numeric entries of ``LambdaLR.state_dict()`` as tensors (checkpoints store tensors only)."""
    return {k: torch.tensor(state[k], dtype=torch.int64 if kind is int else torch.float64)
            for k, kind in _SCHEDULER_FIELDS.items() if k in state}


def _loss_func(output: torch.Tensor):
    """Megatron 3-tuple loss contract (``forward_step_calc_loss``): ``(loss sum, token count, {"lm loss": [sum, count]})`` from the
    per-token losses ``[b, s]``; the schedule divides by the token count and the number of microbatches."""
    total = output.sum()
    count = torch.tensor(output.numel(), dtype=torch.int, device=output.device)
    return total, count, {"lm loss": torch.stack([total.detach().double(), count.double()])}


def _all_reduce_cpu(t: torch.Tensor, group) -> torch.Tensor:
    dev = _collective_device(group)
    out = t.to(dev)
    dist.all_reduce(out, group=group)
    return out.cpu()


def _broadcast_cpu(t: torch.Tensor, src: int, group) -> torch.Tensor:
    dev = _collective_device(group)
    out = t.to(dev)
    dist.broadcast(out, src=src, group=group)
    return out.cpu()


def _collective_device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


class _Stderr(logging.StreamHandler):
    """Log lines to the ``sys.stderr`` of the moment (not the one when the first trainer of the process was built,
    which a test's or a notebook's capture may have closed since)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _setup_logging(config: TrainConfig, is_log_rank: bool, run_dir: Path,
                   to_file: bool = True) -> logging.Handler | None:
    """stdlib logging: INFO lines on the logging rank (stderr and, when ``to_file``, ``<run_dir>/train.log``),
    warnings elsewhere.  Returns the file handler this call added (removed by :meth:`Trainer.close`)."""
    logger = logging.getLogger("pipecast")
    logger.setLevel(getattr(logging, config.logging.level) if is_log_rank else logging.WARNING)
    if not any(getattr(h, "_pipecast", False) for h in logger.handlers):
        handler = _Stderr()
        handler._pipecast = True
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    if not (is_log_rank and to_file):
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    target = str((run_dir / "train.log").resolve())
    if any(getattr(h, "baseFilename", None) == target for h in logger.handlers):
        return None
    fh = LogFile(target)  # a failed write: one WriteError naming train.log, not a traceback per line
    fh.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(fh)
    return fh
