"""One parallelism object per run: :class:`Parallelism`, built once from ``parallel.*``, the process groups and the
device.  The trainer hands it the model chunks and then only calls it; every decision that depends on
``parallel.tensor`` / ``parallel.shard`` is made here:

* :func:`parallelize` -- tensor parallelism, then expert parallelism, then activation recomputation, then FSDP2, on
  the chunks; then ``model.precision: bf16``'s fp32 master weights (:mod:`engine.training.parallel.precision`);
* the gradient sync the schedules call (``finalize_model_grads`` / ``no_sync``: data-parallel all-reduce, or
  ZeRO-1's or FSDP2's reduce-scatter -- routed experts' over the expert-data-parallel group in all three --, then
  the tied-embedding sum);
* the optimizer: ``torch.optim.AdamW``, ZeRO-1's :class:`~engine.training.parallel.zero1.ShardedAdamW` (routed
  experts' state sharded over the expert-data-parallel group), or AdamW on FSDP2's sharded parameters (experts
  sharded over the expert-data-parallel group);
* the one global-norm clip (:func:`engine.training.parallel.grad_norm.clip_grad_norm_`) over this layout's
  gradients;
* full tensors (``model.init_from``) cut to this rank's shards (:mod:`engine.training.parallel.dtensor`);
  checkpoints need nothing from it: DCP saves and reshards the ``DTensor`` shards themselves.

A new parallelism is a module in this package and a step in :func:`parallelize` (plus, if it changes how
gradients are reduced or the optimizer state is held, a branch in :meth:`Parallelism._grad_sync` /
:meth:`Parallelism.build_optimizer`); the trainer does not change.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn

from ...runtime.process_groups import ProcessGroupCollection
from . import dtensor
from .data_parallel import GradSync
from .grad_norm import clip_grad_norm_

__all__ = ["Parallelism", "parallelize"]

log = logging.getLogger("pipecast.train")


def parallelize(chunks: Sequence[nn.Module], *, tp_mesh=None, sequence_parallel: bool = False, ep_group=None,
                recompute: str = "none", attention_core: str | None = None, dp_mesh=None,
                param_dtype: torch.dtype | None = None, expert_mesh=None) -> None:
    """Apply the run's parallelisms to this rank's model chunks, in place (local: every rank built the same full
    initial weights and keeps its part; no collective but FSDP2's first gather under ``param_dtype``), in
    torchtitan's order (``parallelize_llama``):

    1. tensor parallelism over ``tp_mesh`` (None: off), ``sequence_parallel`` as configured
       (:func:`engine.training.parallel.tensor_parallel.parallelize_chunks`);
    2. mixture-of-experts layers: under tensor parallelism each routes this rank's share of the sequence
       (:meth:`engine.moe.MoELayer.shard_tokens`); under expert parallelism over ``ep_group`` (None: every rank
       keeps every expert) each keeps this rank's share of its experts (:meth:`engine.moe.MoELayer.shard_experts`);
    3. activation recomputation (``model.recompute``): each block of ``chunk.layers`` (``full``) or each block's
       attention core, the submodule named ``attention_core`` (``selective``), marked with
       :func:`engine.runtime.recompute.apply_recompute`;
    4. FSDP2 over ``dp_mesh`` (None: off; :func:`engine.training.parallel.fsdp.shard_chunks`), with ``param_dtype``
       (``model.precision: bf16``) as its mixed-precision policy; the routed experts as units of their own over
       ``expert_mesh`` (the expert-data-parallel mesh under expert parallelism; None: with the chunk).

    Why this order: tensor parallelism replaces each projection's weight by a ``DTensor`` on the ``tp`` mesh and
    installs the redistributions around its module, so a recomputed block must wrap the block as it then runs
    (its second forward repeats those collectives); FSDP2 comes last because it shards the parameters as they are
    by then (a tensor-parallel ``DTensor`` would become a 2-D one) and its all-gather before the forward and
    reduce-scatter after the backward must enclose everything the chunk runs, recomputed forwards included.
    Without FSDP2, bf16 parameters with fp32 masters are made by :class:`Parallelism` after this
    (:class:`engine.training.parallel.precision.MasterWeights`).

    Raises:
        ConfigError: FSDP2 over chunks that share a ``Parameter`` (a V placement's tied ends).
    """
    dtensor.clear_caches()  # a previous run's mesh (its groups destroyed) must not come back from a cache
    if tp_mesh is not None:
        from .tensor_parallel import parallelize_chunks
        parallelize_chunks(chunks, tp_mesh, sequence_parallel=sequence_parallel)
    if tp_mesh is not None or ep_group is not None:
        from ...moe import MoELayer
        for layer in (m for c in chunks for m in c.modules() if isinstance(m, MoELayer)):
            if tp_mesh is not None:
                layer.shard_tokens(tp_mesh, sequence_parallel)
            if ep_group is not None:
                layer.shard_experts(ep_group)
    if recompute != "none":
        from ...runtime.recompute import apply_recompute
        blocks = [block for chunk in chunks for block in chunk.layers]
        apply_recompute(blocks if recompute == "full" else [b.get_submodule(attention_core) for b in blocks])
    if dp_mesh is not None:
        from .fsdp import shard_chunks
        shard_chunks(chunks, dp_mesh, param_dtype, expert_mesh)


class Parallelism:
    """The parallel layout of one run on this rank (see the module docstring).

    Args:
        parallel: the run's ``parallel`` section (``tensor``, ``sequence_parallel``, ``expert``, ``shard``,
            ``overlap_grad_reduce``).
        pg: the run's process groups (``parallel.data`` is their data-parallel size).
        device: this rank's device.
        tied_on_one_rank: the plan puts the first and the last stage on one rank (V placement): the tied word
            embedding is one ``Parameter`` there, and no rank communicates over the embedding group.
        model: the run's ``model`` section (``precision``, ``recompute``, ``recompute_kept_microbatches``,
            ``family``); None: fp32, no recomputation.

    ``shard`` is the data-parallel form that runs: ``parallel.shard``, or ``"none"`` with one data-parallel rank
    (one shard is the whole model).  Use in this order: :meth:`apply` (once), :meth:`build_optimizer` (once), then
    per step the schedule (which calls the gradient sync), :meth:`clip_grad_norm_` and the optimizer step.

    Attributes:
        chunks: the model chunks the schedule runs.
        state_chunks: the chunks whose parameters the optimizer steps and checkpoints hold: :attr:`chunks`, or
            under ``model.precision: bf16`` without FSDP2 their fp32 master chunks
            (:mod:`engine.training.parallel.precision`).
    """

    def __init__(self, parallel, pg: ProcessGroupCollection, device: torch.device, *, tied_on_one_rank: bool = False,
                 model=None):
        self.pg, self.device = pg, device
        self.tensor, self.sequence_parallel, self.expert = parallel.tensor, parallel.sequence_parallel, parallel.expert
        self.data = pg.data_parallel_size
        self.shard = parallel.shard if self.data > 1 else "none"
        self.overlap_grad_reduce = parallel.overlap_grad_reduce
        self.tied_on_one_rank = tied_on_one_rank
        self.bf16 = model is not None and model.precision == "bf16"
        self.recompute = "none" if model is None else model.recompute
        self.kept_microbatches = None if model is None else model.recompute_kept_microbatches
        self.attention_core = None
        if self.recompute == "selective":
            from ..models import get_family
            self.attention_core = get_family(model.family).attention_core
        self.chunks: list[nn.Module] = []
        self.state_chunks: list[nn.Module] = []
        self.masters = None  # precision.MasterWeights under bf16 without FSDP2
        self._clip_params: tuple | None = None  # (parameters, counted, experts): fixed once the optimizer exists
        self.grad_sync: GradSync | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        if parallel.shard != self.shard:
            log.info("parallel.shard=%s with parallel.data=1: one shard is the whole model (runs as shard=none)",
                     parallel.shard)

    def describe(self) -> str:
        """``data=D tensor=T [sequence parallel] [expert=E] shard=S [bf16] [recompute=R]``, for the start-up
        line."""
        sp = " (sequence parallel)" if self.sequence_parallel and self.tensor > 1 else ""
        ep = f" expert={self.expert}" if self.expert > 1 else ""
        fit = (" bf16" if self.bf16 else "") + (f" recompute={self.recompute}" if self.recompute != "none" else "")
        return f"data={self.data} tensor={self.tensor}{sp}{ep} shard={self.shard}{fit}"

    def apply(self, chunks: Sequence[nn.Module], config) -> None:
        """:func:`parallelize` ``chunks`` (in place; under bf16 without FSDP2 then their fp32 masters split off,
        :class:`~engine.training.parallel.precision.MasterWeights`), set ``config``'s precision and partial
        recomputation (``pipeline_dtype``, ``params_dtype``, ``num_microbatches_with_partial_activation_checkpoints``)
        and build the gradient sync, installed as ``config``'s ``finalize_model_grads_func`` / ``no_sync_func`` (a
        :class:`~engine.model_parallel_config.ModelParallelConfig`, the chunks' ``.config``).  Local but for FSDP2's
        first gather under bf16."""
        from .precision import COMPUTE_DTYPE, MasterWeights
        tp_mesh = dp_mesh = expert_mesh = None
        if self.tensor > 1 or self.shard == "full":
            from ...runtime.process_groups import device_mesh, expert_data_mesh
            mesh = device_mesh(self.pg, self.device.type)
            tp_mesh = mesh["tp"] if self.tensor > 1 else None
            dp_mesh = mesh["dp"] if self.shard == "full" else None
            if self.shard == "full" and self.expert > 1:
                expert_mesh = expert_data_mesh(self.pg, self.device.type)
        dtype = COMPUTE_DTYPE if self.bf16 else torch.float32
        parallelize(chunks, tp_mesh=tp_mesh, sequence_parallel=self.sequence_parallel,
                    ep_group=self.pg.ep if self.expert > 1 else None, recompute=self.recompute,
                    attention_core=self.attention_core, dp_mesh=dp_mesh,
                    param_dtype=dtype if self.bf16 and dp_mesh is not None else None, expert_mesh=expert_mesh)
        self.chunks = list(chunks)
        if self.bf16 and dp_mesh is None:
            self.masters = MasterWeights(self.chunks)
        self.state_chunks = self.masters.masters if self.masters is not None else self.chunks
        config.pipeline_dtype = config.params_dtype = dtype
        config.num_microbatches_with_partial_activation_checkpoints = (
            self.kept_microbatches if self.recompute != "none" else None)
        self.grad_sync = self._grad_sync()
        config.finalize_model_grads_func = self.grad_sync.finalize_model_grads
        config.no_sync_func = self.grad_sync.no_sync

    def _grad_sync(self) -> GradSync:
        if self.shard == "optimizer":
            from .zero1 import ShardedGradSync
            return ShardedGradSync(self.state_chunks, self.pg, tied_on_one_rank=self.tied_on_one_rank)
        if self.shard == "full":
            from .fsdp import FSDPGradSync
            return FSDPGradSync(self.chunks, self.pg)
        # master gradients are written by the bf16 parameters' hooks, not by autograd: reduced in finalize
        return GradSync(self.state_chunks, self.pg, overlap=self.overlap_grad_reduce and self.masters is None,
                        tied_on_one_rank=self.tied_on_one_rank)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters (of :attr:`state_chunks`), each once (the V placement's tied ends share
        one)."""
        return list({id(p): p for c in self.state_chunks for p in c.parameters() if p.requires_grad}.values())

    def local_parameter_count(self) -> int:
        """Elements of the parameters this rank holds (a ``DTensor`` counts its local shard)."""
        return sum(dtensor.local(p).numel() for p in self.parameters())

    def build_optimizer(self, *, lr: float, betas: tuple[float, float], eps: float,
                        weight_decay: float) -> torch.optim.Optimizer:
        """AdamW over :meth:`parameters` (weight decay on matrices, none on vectors), in the run's shard form:
        ZeRO-1's :class:`~engine.training.parallel.zero1.ShardedAdamW` for ``shard=optimizer``, else
        ``torch.optim.AdamW`` (on FSDP2's sharded parameters for ``shard=full``).  Fused (``fused=True``, CPU and
        CUDA; tensor parallelism's DTensor parameters in groups of their own, as the fused kernel takes no mix): its
        step counts live on the device and it honours the optimizer's ``found_inf`` attribute (the
        trainer's NaN skip, :mod:`engine.training.step_figures`) without a host read.  Call after :meth:`apply`."""
        from torch.distributed.tensor import DTensor
        params = self.parameters()
        groups = [{"params": [p for p in params if (p.dim() >= 2) == matrix and isinstance(p, DTensor) == split],
                   "weight_decay": weight_decay if matrix else 0.0} for matrix in (True, False) for split in (False, True)]
        groups = [g for g in groups if g["params"]]  # one fused kernel call per group: DTensors and plain apart
        if self.shard == "optimizer":
            from .zero1 import ShardedAdamW
            self.optimizer = ShardedAdamW(groups, self.grad_sync, lr=lr, betas=betas, eps=eps)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        if self.masters is not None:
            self.masters.attach(self.optimizer)
        return self.optimizer

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of the gradients of the whole model, then clip them to ``max_norm`` (``<= 0``: no
        clip); the gradients must be reduced (after the schedule's ``finalize_model_grads``).  Returns the norm
        before clipping as an fp32 scalar tensor on the device, the same on every rank.  Collective."""
        expert_group = self.pg.ep if self.expert > 1 else None
        if self.shard == "optimizer":
            grads, counted, experts = self.optimizer.shard_grads()
            sharded_experts = any(s.experts for s in self.grad_sync.shards)  # the same on a stage's ranks
            return clip_grad_norm_(grads, max_norm, counted=counted, pipeline_group=self.pg.pp,
                                   shard_group=self.pg.dp, device=self.device, experts=experts,
                                   expert_group=expert_group,
                                   expert_shard_group=self.pg.expt_dp if sharded_experts else None)
        if self._clip_params is None:
            from ...moe import is_expert_parameter
            params = self.parameters()
            self._clip_params = (params, [not getattr(p, "shared_embedding_copy", False) for p in params],
                                 [is_expert_parameter(p) for p in params])
        params, counted, experts = self._clip_params
        have = [i for i, p in enumerate(params) if p.grad is not None]
        return clip_grad_norm_([params[i].grad for i in have], max_norm, pipeline_group=self.pg.pp, device=self.device,
                               counted=[counted[i] for i in have], experts=[experts[i] for i in have],
                               expert_group=expert_group)

    def after_forward_only(self) -> None:
        """After a forward-only schedule call (evaluation, sampling): FSDP2 frees the parameters it gathered (a
        training step does so in ``finalize_model_grads``).  Local."""
        if self.shard == "full":
            from .fsdp import reshard
            reshard(self.chunks)

    # ---- checkpoint state: DCP saves the DTensor shards and reshards them at load (trainer.state_dict) --------
    @staticmethod
    def reshard_like(loaded: dict, template: dict) -> dict:
        """Full tensors ``loaded`` cut to this rank's shards of ``template``'s ``DTensor`` entries (local;
        ``model.init_from``'s Hugging Face tensors)."""
        return dtensor.reshard_like(loaded, template)

    def close(self) -> None:
        """Remove the gradient sync's and the master weights' hooks."""
        if self.grad_sync is not None:
            self.grad_sync.close()
        if self.masters is not None:
            self.masters.close()
