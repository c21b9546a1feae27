"""The training loop: a :class:`Trainer` that owns init, ``train_step``, ``train``, ``evaluate``, checkpoints and
``close`` (torchtitan's shape).  It resolves the run once and then only steps:

* the config is validated once (:func:`engine.training.config.validate`, which ``load_config`` runs; a config built
  or changed by hand is validated here), before any communication;
* the schedule is resolved once (:class:`engine.plan.resolve.ResolvedSchedule`) and bound once to the model
  chunks and groups (:class:`engine.schedules.PipelineSchedule`, the public API): each call runs the resolution's
  plan for its microbatch count, and the pipeline ranks agree on a call only when its sizes change;
* the parallel layout is one :class:`engine.training.parallel.Parallelism` built from ``parallel.*``: it
  parallelises the chunks, owns the gradient sync the schedule calls (``finalize_model_grads_func`` /
  ``no_sync_func`` on the chunks' ``ModelParallelConfig``), the optimizer, the global-norm clip and the
  checkpoint state's gather / scatter; the trainer never asks which layout runs.

One training step (every rank; :meth:`Trainer.step_on_device`)::

    zero grads -> schedule(forward_step_func, data iterators, chunks, M microbatches)   # the run's plan
               -> finalize_model_grads (data-parallel reduction, tied-embedding sum)    # called by the schedule
               -> global grad-norm clip -> loss reduced -> AdamW step (skipped if NaN / inf) -> LR schedule step

Nothing in it waits on the device: the loss is owned by the last pipeline stage (on the last rank, or rank 0 under
the V placement); it is summed over data-parallel replicas and broadcast over the pipeline on the device, and the
NaN / inf check skips the optimizer step on the device (:mod:`engine.training.step_figures`).  The host reads the
figures only when the loop logs (``logging.log_interval``), evaluates or saves (:meth:`Trainer.read_pending`);
every rank then raises the same :class:`NonFiniteLossError` if a step diverged.  The log line is written by the
last stage of data-parallel replica 0 (tensor-parallel rank 0).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import sys
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from ..model_parallel_config import ModelParallelConfig
from ..plan.registry import virtual_or_none
from ..runtime.process_groups import ProcessGroupCollection, build_process_groups, group_size
from .checkpoint.dcp import (CheckpointError, checkpoint_keys, checkpoint_to_load, latest_checkpoint, list_checkpoints,
                             load_checkpoint, read_checkpoint_meta, save_checkpoint)
from .checkpoint.resume import checkpoint_meta, refusal_message, resume_differences
from .config import TrainConfig, check_fresh_run, dump_config, validate, validate_world_size
from .config.validated import is_validated
from .data.corpus import Batches, load_corpus
from .parallel.dtensor import checkpoint_form
from .parallel.parallelism import Parallelism
from . import preempt
from .metrics import MetricsLog, RouterMetrics, known_peak_tflops, model_flops_per_token
from .models.chunk import build_model_chunks, canonical_module
from .outputs import setup_logging
from .seed import set_seed_and_determinism
from .step_figures import NonFiniteLossError, StepFigures, nonfinite_message

__all__ = ["Trainer", "lr_lambda", "NonFiniteLossError"]

log = logging.getLogger("pipecast.train")


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
        config: a :class:`~engine.training.config.TrainConfig` (``load_config`` validates it; one built or changed
            by hand is validated here, on every rank, before any process group is created).

    ``torch.distributed`` must be initialised with ``parallel.pipeline x parallel.data x parallel.tensor`` ranks
    (``pipecast train`` and ``engine.training.launch_ranks`` do it; torchrun plus ``init_process_group`` works too);
    a one-rank config initialises a one-process gloo group itself.  Use as a context manager or call :meth:`close`.

    Raises:
        ConfigError / RuntimeError: invalid config or world size (before any process group is created).
    """

    def __init__(self, config: TrainConfig):
        if not is_validated(config):  # load_config / validate() stamped it: not checked twice
            validate(config)
        self._owns_default_group = self._init_distributed(config)
        self.config = config = validate_world_size(config, dist.get_world_size())
        self.rank = dist.get_rank()
        self.device = self._pick_device(config)
        self.pg: ProcessGroupCollection = _process_groups(config.parallel)
        self.pp_rank, self.pp_size = self.pg.pipeline_model_parallel_rank, config.parallel.pipeline
        self.dp_rank, self.dp_size = self.pg.data_parallel_rank, self.pg.data_parallel_size
        self.schedule = config.resolve_schedule()  # the run's one resolution: it gives every plan of the run
        self.plan = self.schedule.plan(config.training.num_microbatches)  # its placement: the stages held here
        self.loss_rank = self.plan.stage_location(self.plan.num_stages - 1)[0]  # pipeline rank of the loss stage
        self.is_log_rank = self.pp_rank == self.loss_rank and self.dp_rank == 0 == self.pg.tensor_model_parallel_rank
        self.run_dir = Path(config.logging.run_dir)
        # a folder with checkpoints belongs to another run until load() resumes it: its train.log and config.yaml
        # are left alone (train() refuses a fresh start there, see check_fresh_run)
        self._run_files_open = not list_checkpoints(config.checkpoint_dir)
        self._log_file = setup_logging(config, self.is_log_rank, self.run_dir, to_file=self._run_files_open)
        set_seed_and_determinism(config.training.seed, self.pp_rank, config.training.deterministic)
        self.tracer = None  # an engine.runtime.tracing.Tracer; the profiling tools set it
        self._build_model()
        self.batches = self._build_batches()
        self.step = 0
        self.history: list[dict] = []  # the figures of every step read so far (read_pending)
        self._figures = StepFigures(self.device, config.optimizer.check_for_nan_in_loss_and_grad)
        self.val_history: list[tuple[int, float]] = []
        self._graphs = None  # graphs.runtime.GraphRuntime, created by _maybe_capture_graphs when enabled
        self._resumed = False
        self.preempted: Path | None = None  # the checkpoint saved when SIGTERM stopped train()
        self._metrics: MetricsLog | None = None  # opened by train() on the logging rank
        self.flops_per_token = model_flops_per_token(config.model, config.ffn_hidden_size)
        self.peak_tflops = self._peak_tflops()
        self._pipeline = self._bind_schedule()
        if self.rank == 0 and self._run_files_open:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(config, self.run_dir / "config.yaml")
        self._log_start()

    # ---- setup ------------------------------------------------------------------------------------------------
    @staticmethod
    def _init_distributed(config: TrainConfig) -> bool:
        if dist.is_initialized():
            return False
        if config.world_size != 1:
            p = config.parallel
            raise RuntimeError(
                f"the config needs {config.world_size} ranks (parallel.pipeline x parallel.data x parallel.tensor = "
                f"{p.pipeline} x {config.data_parallel_size} x {p.tensor}) but torch.distributed is not "
                f"initialised; launch with `pipecast train CONFIG`, torchrun, or engine.training.launch_ranks")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return True

    def _build_model(self) -> None:
        """This rank's model chunks, laid out by the run's :class:`Parallelism` (which also installs the gradient
        sync on their config), the canonical view for checkpoints, the optimizer and the LR schedule."""
        c, p = self.config, self.config.parallel
        first, last = (self.plan.stage_location(s)[0] for s in (0, self.plan.num_stages - 1))
        self.mp_config = self._model_parallel_config()
        self.parallelism = Parallelism(p, self.pg, self.device, tied_on_one_rank=first == last, model=c.model)
        self.model = build_model_chunks(c.model, c.ffn_hidden_size, p.pipeline, self.pp_rank, p.virtual,
                                        c.training.seed, self.mp_config, self.device,
                                        stages=self.plan.stages_of(self.pp_rank))
        self.parallelism.apply(self.model, self.mp_config)
        self.canonical = canonical_module(self.parallelism.state_chunks)  # what the optimizer steps (fp32)
        moe = c.model.moe
        self.router_metrics = (RouterMetrics(canonical_module(self.model), c.model.num_layers, moe.num_experts,
                                             self.device) if moe is not None else None)  # the chunks that run
        if c.model.init_from:
            self._init_from_hf()
        o = c.optimizer
        self.optimizer = self.parallelism.build_optimizer(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                                          weight_decay=o.weight_decay)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_multiplier)

    def _bind_schedule(self):
        """The public API's schedule object, bound once to this rank's chunks and groups."""
        from ..runtime.p2p import P2PCommunicator
        from ..schedules import PipelineSchedule  # the public API; imported late: `engine` never imports the trainer
        return PipelineSchedule(self.schedule, model=self.model, pg_collection=self.pg,
                                p2p_communicator=P2PCommunicator(self.pg.pp, self.mp_config))

    def _log_start(self) -> None:
        c, p = self.config, self.config.parallel
        log.info("pipecast: %s schedule, pipeline=%d virtual=%d %s (world size %d), %d layers, %.2fM parameters held "
                 "on this rank, device %s, simulated bubble %.1f%%, data: %s", c.schedule_name + (
                     f" (max_in_flight {p.max_in_flight})" if p.max_in_flight else ""), p.pipeline, p.virtual,
                 self.parallelism.describe(), c.world_size, c.model.num_layers,
                 self.parallelism.local_parameter_count() / 1e6, self.device, 100 * self.simulated_bubble(),
                 self.batches.corpus.description if self.batches else "(not read on this stage)")

    @torch.no_grad()
    def _init_from_hf(self) -> None:
        """``model.init_from``: copy the Hugging Face folder's tensors into this rank's parameters (each rank reads
        only what its model chunks hold; a tied copy on the last stage reads the word embedding; a sharded
        parameter takes its shard).  A later ``load()`` (resume) overwrites them.

        Raises:
            ConfigError: missing or unexpected tensors, or a shape that differs (naming the tensor)."""
        from .config import ConfigError
        from .checkpoint.hf import load_hf_weights
        params = dict(self.canonical.named_parameters())
        full = load_hf_weights(self.config.model.init_from, self.config.model, params)
        tensors = self.parallelism.reshard_like({n: full[n].to(p.dtype) for n, p in params.items()}, params)
        for name, param in params.items():
            value = tensors[name]
            if tuple(value.shape) != tuple(param.shape):
                raise ConfigError(f"model.init_from={self.config.model.init_from!r}: tensor for {name} has shape "
                                  f"{list(value.shape)}, the model expects {list(param.shape)}")
            param.copy_(value)
        if self.is_log_rank:
            log.info("model.init_from: %d tensors from %s", len(params), self.config.model.init_from)

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
        return ModelParallelConfig(  # precision (pipeline_dtype) and recomputation: set by Parallelism.apply
            pipeline_model_parallel_size=p.pipeline, tensor_model_parallel_size=p.tensor,
            sequence_parallel=p.sequence_parallel,  # the schedules then send [s / tensor, b, h]
            virtual_pipeline_model_parallel_size=virtual_or_none(p.virtual),
            microbatch_group_size_per_vp_stage=p.microbatch_group_size_per_vp_stage,
            pipeline_dtype=torch.float32, hidden_size=c.model.hidden_size,
            batch_p2p_comm=p.batch_p2p_comm, overlap_p2p_comm=p.overlap_p2p_comm,
            deallocate_pipeline_outputs=p.deallocate_pipeline_outputs, deterministic_mode=c.training.deterministic,
            expert_model_parallel_size=p.expert, expert_tensor_parallel_size=1,
            num_moe_experts=c.model.moe.num_experts if c.model.moe is not None else None,  # the aux-loss scale
            overlap_moe_expert_parallel_comm=p.overlap_moe_expert_parallel_comm)

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

    # ---- one step ---------------------------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model, checkpoint_activations_microbatch=None):
        """``forward_step_func(data_iterator, model[, checkpoint_activations_microbatch]) -> (output, loss_func)``:
        only the first stage reads tokens, only the last reads labels (their chunks get an iterator; the others get
        None).  The recomputation flag reaches the recomputed modules through the schedule
        (:data:`engine.runtime.step.recompute_microbatch`)."""
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
        """One call of the run's schedule (its plan for ``num_microbatches``); ``_forward_step`` is looked up per
        call."""
        c = self.config
        out = self._pipeline.forward_backward(
            forward_step_func=forward_step_func or self._forward_step, data_iterator=self._iterators(microbatches),
            num_microbatches=num_microbatches, seq_length=c.model.seq_length,
            micro_batch_size=micro_batch_size or c.training.micro_batch_size, forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data)
        if forward_only:  # a training step's finalize_model_grads does the parallelism's end-of-step work
            self.parallelism.after_forward_only()
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
        if self._graphs is None:
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

    def step_on_device(self) -> None:
        """Run one optimizer step without waiting on the device: the schedule, the clip and the optimizer step
        are queued, the loss is reduced on the device (:meth:`_global_sums`), and with
        ``optimizer.check_for_nan_in_loss_and_grad`` a non-finite loss or grad norm skips the step on the device
        (:class:`~engine.training.step_figures.StepFigures`: the optimizer's ``found_inf``).  The figures stay on
        the device until :meth:`read_pending` (the loop calls it when it logs, evaluates or saves).  No host
        synchronisation on pipecast's side (tests/training/test_host_syncs.py counts them)."""
        self._maybe_capture_graphs()
        self._figures.start()
        for chunk in self.model:
            if not chunk.training:  # after an evaluation (a walk over every module: not every step)
                chunk.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.router_metrics is not None:
            self.router_metrics.reset()
        lr = self.optimizer.param_groups[0]["lr"]
        store = self._run_schedule(self._data(self.step), self.config.training.num_microbatches, False)
        norm = self.parallelism.clip_grad_norm_(self.config.optimizer.grad_clip)
        sums = self._global_sums(_loss_sums(store, self.device))
        self.optimizer.found_inf = self._figures.add(self.step + 1, lr, sums, norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.step += 1

    def train_step(self) -> dict:
        """Run one optimizer step and read its figures (a host sync; :meth:`step_on_device` is the step without
        it); returns ``{step, loss, grad_norm, lr, tokens_per_s, tokens_seen, step_time_s, tflops}`` plus on CUDA
        ``max_memory_gib``, ``reserved_memory_gib`` and ``mfu`` (see :meth:`read_pending`).

        Raises:
            NonFiniteLossError: NaN / inf loss or grad norm (when ``optimizer.check_for_nan_in_loss_and_grad``); the
                optimizer step is not applied.
        """
        self.step_on_device()
        return self.read_pending()[-1]

    def read_pending(self) -> list[dict]:
        """Read the figures of every step run since the last read (the host waits for the device here, and only
        here and in :meth:`evaluate`), append them to :attr:`history` and return them: per step ``{step, loss,
        grad_norm, lr, tokens_per_s, tokens_seen, step_time_s, tflops}`` (same on every rank; ``loss`` in nats per
        token, averaged over the global batch; ``step_time_s``: the wall time from the start of the first unread
        step to this read, divided by the steps read; ``tflops``: model TFLOP/s of the whole job from
        :func:`~engine.training.metrics.model_flops_per_token`), plus on CUDA ``max_memory_gib``,
        ``reserved_memory_gib`` and ``mfu``.

        Raises:
            NonFiniteLossError: a step's loss or grad norm is NaN / inf (``optimizer.check_for_nan_in_loss_and_grad``;
                every rank raises the same error).  That step and every later one were skipped on the device; the
                trainer is put back at the step before it (:attr:`step`, LR schedule), nothing was saved; the
                steps before it are in :attr:`history`.
        """
        rows, elapsed = self._figures.read()
        bad = self._figures.first_nonfinite(rows)
        per_step = elapsed / max(len(rows), 1)
        metrics = [self._step_metrics(step, loss, norm, lr, per_step) for step, lr, loss, norm in rows
                   if bad is None or step < bad[0]]
        self.history.extend(metrics)
        if bad is not None:
            last = self.step
            self.step = bad[0] - 1
            self._set_lr_schedule()
            raise NonFiniteLossError(nonfinite_message(bad[0], bad[2], bad[3], last, self.config.optimizer))
        return metrics

    def _step_metrics(self, step: int, loss: float, grad_norm: float, lr: float, dt: float) -> dict:
        """The metrics :meth:`read_pending` returns for step ``step`` of ``dt`` seconds."""
        tokens = self.config.global_batch_size * self.config.model.seq_length
        metrics = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens / dt,
                   "tokens_seen": step * tokens, "step_time_s": dt,
                   "tflops": self.flops_per_token * tokens / dt / 1e12}
        if self.device.type == "cuda":
            metrics["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics["reserved_memory_gib"] = torch.cuda.memory_reserved(self.device) / 2**30
            if self.peak_tflops:
                metrics["mfu"] = metrics["tflops"] / (self.peak_tflops * self.config.world_size)
        return metrics

    def _global_sums(self, total: torch.Tensor) -> torch.Tensor:
        """The global batch's ``[loss sum, tokens]`` (float64, on the device) from this rank's (:func:`_loss_sums`,
        nonzero on the loss stage only): summed over data-parallel replicas on the loss stage, broadcast over the
        pipeline group, so every rank holds it.  Collective, no host synchronisation."""
        if self.pp_rank == self.loss_rank and group_size(self.pg.dp) > 1:
            dist.all_reduce(total, group=self.pg.dp)
        if group_size(self.pg.pp) > 1:
            dist.broadcast(total, src=self.pg.pp_ranks[self.loss_rank], group=self.pg.pp)
        return total

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss (nats per token) with the forward-only schedule over ``training.eval_iters`` fixed
        batches; the same value on every rank."""
        for chunk in self.model:
            chunk.eval()
        c, total = self.config, torch.zeros(2, dtype=torch.float64, device=self.device)
        m = c.eval_microbatches
        for i in range(c.training.eval_iters):
            data = (self.batches.val(i, c.training.eval_iters, m, self._reads_tokens, self._reads_labels)
                    if self.batches is not None else None)
            total += _loss_sums(self._run_schedule(data, m, True), self.device)
        for chunk in self.model:
            chunk.train()
        total = self._global_sums(total).tolist()  # the host reads the evaluation's figures
        loss = total[0] / total[1] if total[1] > 0 else float("nan")
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

        def step(data_iterator, model, *_):
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
                token = torch.full((1,), -1 if logits is None else sample_token(logits, temperature, top_k, generator),
                                   dtype=torch.int64, device=self.device)
                if group_size(self.pg.pp) > 1:
                    dist.broadcast(token, src=self.pg.pp_ranks[self.loss_rank], group=self.pg.pp)
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
        start, end = self.step, c.training.steps if steps is None else min(c.training.steps, self.step + steps)
        if not self._begin_run():
            return []
        with self._progress(start, end) as bar, preempt.sigterm_requests():
            while self.step < end:
                self.step_on_device()
                if self._after_step(end, bar):  # every rank agreed to stop (SIGTERM) after this step
                    self.preempted = self._save_for_stop()
                    break
        if self._metrics is not None and self.val_history[-1][0] != self.step:
            self._metrics.plot()  # the end (an evaluation at this step has drawn it already)
        if c.checkpoint.save_at_end and self.step == c.training.steps and self.step > start and \
                not (c.checkpoint.interval and self.step % c.checkpoint.interval == 0):
            self.save()
        return self.history[len(self.history) - (self.step - start):]

    def _begin_run(self) -> bool:
        """Before the first step of :meth:`train`: refuse a fresh start in another run's folder, open the metrics
        log, evaluate (also at the start of a resumed run: "val loss A -> B" covers this run).  False when the
        run is already at ``training.steps`` (said in one line)."""
        c = self.config
        if self.step == 0 and not self._resumed:
            check_fresh_run(c, resume=False)  # every rank raises the same error (the folder is shared)
        if self.step >= c.training.steps:
            if self.is_log_rank:
                log.info("nothing to do: %s step %d >= training.steps=%d; raise training.steps to train further",
                         "checkpoint" if self._resumed else "trainer", self.step, c.training.steps)
            return False
        if self.is_log_rank and self._metrics is None:
            self._metrics = MetricsLog(self.run_dir, self.step if self._resumed else None, c.logging.tensorboard,
                                       title=f"{self.run_dir.name}: {c.schedule_name}, pipeline={c.parallel.pipeline}"
                                             f" virtual={c.parallel.virtual} {self.parallelism.describe()}")
        if not self.val_history:
            self._log_eval(self.evaluate())
            self._log_sample()
        return True

    def _after_step(self, end: int, bar) -> bool:
        """After a step of :meth:`train` (up to ``end``): when the step logs, evaluates or saves, the host reads the
        figures of the steps since the last read (:meth:`read_pending`, which raises on a NaN / inf step), then
        the log line, evaluation and checkpoint follow, and the ranks agree whether SIGTERM stops them
        (:func:`engine.training.preempt.stop_agreed`, a collective: only at these steps, where the host waits
        anyway).  Returns that agreement (False at the other steps, which make no host synchronisation)."""
        c = self.config
        logs = self.step % c.logging.log_interval == 0 or self.step == end
        evaluates = (c.training.eval_interval and self.step % c.training.eval_interval == 0) or \
            self.step == c.training.steps
        saves = c.checkpoint.interval and self.step % c.checkpoint.interval == 0
        if bar is not None:
            bar.update(1)
        if not (logs or evaluates or saves):
            return False
        metrics = self.read_pending()[-1]
        if logs:
            if self.router_metrics is not None:  # collective; the host reads the routers' counters only here
                metrics.update(self.router_metrics.collect())
            self._log_step(metrics)
        if evaluates:
            metrics["val_loss"] = self.evaluate()
            self._log_eval(metrics["val_loss"])
            self._log_sample()
        if saves:
            self.save()
        if bar is not None:
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        return self.step < end and preempt.stop_agreed()

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
        moe = (f" | moe aux {m['moe_aux_loss']:.4f} imbalance {m['moe_load_imbalance']:.2f}"
               if "moe_aux_loss" in m else "")
        log.info("step %d/%d | loss %.4f | grad norm %.3f | lr %.3e | %.0f tokens/s | %.3g TFLOP/s%s | step %.3f s%s%s",
                 m["step"], self.config.training.steps, m["loss"], m["grad_norm"], m["lr"], m["tokens_per_s"],
                 m["tflops"], mfu, m["step_time_s"], memory, moe)
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
        names, the step (= data position and LR-schedule position) and this rank's RNG states.  Tensor-parallel
        and FSDP2 tensors stay ``DTensor`` shards: DCP writes each rank's own shard with its place in the full
        tensor (no gather; :func:`~engine.training.parallel.dtensor.checkpoint_form`), and reads back any
        layout's shards (``torch.distributed.checkpoint`` resharding); ZeRO-1's moments are this rank's pieces
        (:meth:`~engine.training.parallel.zero1.ShardedAdamW.state_dict`).  Local."""
        model_sd, optim_sd, _ = self._dcp_state()
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"model": checkpoint_form(model_sd),
                "optim": checkpoint_form({k: v for k, v in optim_sd.items() if k.startswith("state.")}),
                "trainer": {"step": torch.tensor(self.step, dtype=torch.int64)},
                "scheduler": _scheduler_tensors(self.lr_scheduler.state_dict()),
                "rng": {f"rank{self.rank}": rng}}

    def save(self, directory: str | Path | None = None) -> Path:
        """Collective: write a checkpoint of the current step (``checkpoint.dir`` by default); returns its path."""
        if self.step == 0:
            raise RuntimeError("nothing to save before the first training step")
        tok = getattr(self.batches.corpus, "tokenizer", None) if self.batches is not None else None
        extra = {"tokenizer.json": tok.to_str()} if getattr(tok, "kind", None) == "bpe" else None
        self.read_pending()  # a NaN / inf step not read yet raises here: nothing is saved
        path = save_checkpoint(self.state_dict(), directory or self.config.checkpoint_dir, self.step,
                               self.config.checkpoint.keep, meta=checkpoint_meta(self.config, self.step), extra_files=extra)
        if self.is_log_rank:
            log.info("step %d | saved checkpoint %s", self.step, path)
        return path

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
        warned = self._check_checkpoint_meta(Path(path))
        model_sd, optim_sd, options = self._dcp_state()
        target = self._load_target(checkpoint_keys(path), model_sd, optim_sd)
        load_checkpoint(checkpoint_form(target), path, verify=False)  # each shard read from any saved layout
        set_state_dict(self.canonical, self.optimizer, options=options, model_state_dict=target["model"],
                       optim_state_dict=optim_sd | target["optim"])
        self.step = int(target["trainer"]["step"])
        self._set_lr_schedule()
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

    def _load_target(self, keys, model_sd: dict, optim_sd: dict) -> dict:
        """What :meth:`load` reads the checkpoint (``keys``: the ones it holds) into: this rank's model and
        optimizer state (``DTensor`` shards where the run shards them; DCP fills each from whatever layout wrote
        the checkpoint, sharded or full), the step, and this rank's CPU RNG where the checkpoint has it
        (checkpoints of earlier versions hold the step only)."""
        target = {"model": model_sd, "optim": {k: v for k, v in optim_sd.items() if k.startswith("state.")},
                  "trainer": {"step": torch.tensor(0, dtype=torch.int64)}}
        if f"rng.rank{self.rank}.cpu" in keys:
            target["rng"] = {f"rank{self.rank}": {"cpu": torch.get_rng_state()}}
        return target

    def _open_run_files(self) -> None:
        if self._run_files_open:
            return
        self._run_files_open = True
        self._log_file = setup_logging(self.config, self.is_log_rank, self.run_dir)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(self.config, self.run_dir / "config.yaml")

    def _set_lr_schedule(self) -> None:
        """Put the LR schedule at ``self.step`` (``step`` scheduler steps taken) of *this* config's schedule, then
        set each group's LR to it.  The schedule is a function of the step and the config (``lr_lambda``), so a
        run resumed with more ``training.steps`` or another ``optimizer.lr`` follows its own schedule from its first
        step; the scheduler state saved with the checkpoint (the old schedule's last LR and base LR) is
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
        self.parallelism.close()
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


_SCHEDULER_FIELDS = {"last_epoch": int, "_step_count": int, "base_lrs": list, "_last_lr": list}


def _scheduler_tensors(state: dict) -> dict:
    """The numeric entries of ``LambdaLR.state_dict()`` as tensors (checkpoints store tensors only)."""
    return {k: torch.tensor(state[k], dtype=torch.int64 if kind is int else torch.float64)
            for k, kind in _SCHEDULER_FIELDS.items() if k in state}


def _loss_func(output: torch.Tensor):
    """Megatron 3-tuple loss contract (``forward_step_calc_loss``): ``(loss sum, token count, {"lm loss": [sum, count]})`` from the
    per-token losses ``[b, s]``; the schedule divides by the token count and the number of microbatches.  The count
    is filled on the device (``torch.tensor(n, device=...)`` would be a blocking host-to-device copy)."""
    total = output.sum()
    count = torch.full((), output.numel(), dtype=torch.int, device=output.device)
    return total, count, {"lm loss": torch.stack([total.detach().double(), count.double()])}


def _loss_sums(store: list, device: torch.device) -> torch.Tensor:
    """``[loss sum, tokens]`` (float64, on ``device``) of a schedule call's ``forward_data_store`` (empty off the
    loss stage: zeros), summed in microbatch order on the device."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for entry in store:
        total += entry["lm loss"].detach()
    return total


def _process_groups(p) -> ProcessGroupCollection:
    """The run's process groups from the ``parallel`` section (collective: every rank creates every group)."""
    return build_process_groups(p.pipeline, virtual_or_none(p.virtual),
                                backend=None if p.backend == "auto" else p.backend,
                                timeout=datetime.timedelta(seconds=p.timeout_s), tensor_model_parallel_size=p.tensor,
                                expert_model_parallel_size=p.expert, expert_tensor_parallel_size=1)
