"""Fully sharded data parallelism, ``parallel.shard: full``: FSDP2 (``torch.distributed.fsdp.fully_shard``) per
model chunk, composed with the pipeline schedules.

Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel" (VLDB'23); Rajbhandari et al.,
"ZeRO" (SC'20), stage 3.  The pipelined use follows torch's own reference, ``torch/distributed/pipelining/stage.py``
(``backward_maybe_with_nosync`` and ``perform_reduce_grad``):

* **Layout.**  Each model chunk is one ``fully_shard`` unit on the ``dp`` dimension of the job's ``DeviceMesh``
  (:func:`engine.runtime.process_groups.device_mesh`): every parameter becomes a ``DTensor`` with ``Shard(0)``
  over the data-parallel group (``torch.chunk`` rows, so rank ``r`` holds about ``1/dp`` of each parameter).
  ``torch.optim.AdamW`` runs on these sharded parameters: its ``exp_avg`` / ``exp_avg_sq`` are sharded alike.
* **One step.**  The chunk is built with ``reshard_after_forward=False`` and kept in the "accumulate" mode
  (``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``, ``set_is_last_backward(False)``)
  for the whole step: the first forward of the step all-gathers the chunk's parameters, they stay gathered for
  every microbatch's F, B and W, and each backward only accumulates into the gathered (unsharded) ``.grad``.
* **Gradients** (:meth:`FSDPGradSync.finalize_model_grads`, the schedules' ``finalize_model_grads_func``): FSDP's
  own post-backward hook fires when a chunk's *input* gradient is complete, which in a split (B / W) schedule is
  before its W passes ran.  So no reduction runs during the step at all; after the schedule (every W of every
  chunk done) finalize switches each chunk to sync mode and runs FSDP's post-backward by hand, as
  ``perform_reduce_grad`` does: one reduce-scatter (average over ``dp``) of each chunk's accumulated gradients into
  the sharded ``.grad``, then the reshard (the gathered parameters are freed).  Then the tied word-embedding
  gradient shards are summed over the embedding group (first and last stage hold the same rows of the same
  ``[V, h]`` shard: Megatron's order, average first).  ``no_sync`` keeps its meaning (inside it backward passes
  only accumulate -- here every backward does).
* **Norm and clipping** (:func:`engine.training.parallel.grad_norm.clip_grad_norm_`): the squares of the local
  gradient shards (the last stage's tied copy left out) summed over the data-parallel and the pipeline group.
* **Experts** (``parallel.expert > 1``): each MoE layer's routed experts are a ``fully_shard`` unit of their own
  inside the chunk's, over the expert-data-parallel group (the ranks holding the same experts; torchtitan shards
  its experts so), their reduce-scatter divided by the data-parallel size (Megatron-Core's expert gradient scaling
  ``1 / dp``); their gradients' squares are summed over that group and then the expert-parallel group.
* **Checkpoints** stay layout-free without a gather: DCP writes each rank's ``DTensor`` shards with their place
  in the full tensor and a load reads each target shard from whatever layout wrote them
  (:meth:`engine.training.trainer.Trainer.state_dict`), so a ``shard: full`` checkpoint resumes at any pipeline /
  data / shard layout and back; ``pipecast export`` reads it whole in one process.

With ``parallel.data = 1`` the run takes ``shard: full`` as ``none`` (one shard is the whole model).  Not
supported (refused by ``engine.training.config``): ``parallel.tensor > 1``, CUDA graphs, and a V placement with tied
embeddings (its first and last stage share one ``Parameter`` across two chunks, which two ``fully_shard`` units
cannot share).  Checked on CPU / gloo against a single-process run (``tests/training/parallel/test_sharding.py``;
with experts: ``tests/moe/test_moe_sharding.py``).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Sequence

import torch
from torch import nn

from ...finalize import sum_tied_grads
from ...runtime.process_groups import ProcessGroupCollection
from .data_parallel import GradSync

__all__ = ["shard_chunks", "accumulate_in_fp32", "FSDPGradSync", "reshard", "full_parameters"]


def _accumulate_mode(chunk, on: bool) -> None:
    """``on``: backward passes only accumulate into the gathered gradients and keep the parameters gathered."""
    chunk.set_requires_gradient_sync(not on)
    chunk.set_reshard_after_backward(not on)
    chunk.set_is_last_backward(not on)


def shard_chunks(chunks: Sequence[nn.Module], dp_mesh, param_dtype: torch.dtype | None = None,
                 expert_mesh=None) -> None:
    """``fully_shard`` each chunk in place over ``dp_mesh`` (the 1-D ``dp`` sub-mesh).  Local: every data-parallel
    rank built the same full initial weights and keeps its rows.  Keeps the ``shared_embedding`` /
    ``shared_embedding_copy`` and ``expert_parallel`` marks (on the new ``DTensor`` parameters) and leaves each
    chunk in accumulate mode.  ``expert_mesh`` (expert parallelism: the 1-D expert-data-parallel mesh,
    :func:`engine.runtime.process_groups.expert_data_mesh`): each MoE layer's routed experts
    (:class:`engine.moe.GroupedExperts`) first become a ``fully_shard`` unit of their own over it, whose gradient
    reduce-scatter sums and divides by the data-parallel size (Megatron-Core's expert gradient scaling ``1 / dp``:
    an expert's gradient already sums the tokens its expert-parallel peers sent it), as torchtitan shards experts.
    ``param_dtype`` (``model.precision: bf16``): torchtitan's ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``
    -- the fp32 shards are the master weights, the gathered parameters ``param_dtype`` -- with each microbatch's
    gradient added into FSDP's fp32 accumulator as autograd writes it (:func:`accumulate_in_fp32`; collective: one
    all-gather per chunk).

    Raises:
        ConfigError: two chunks share a ``Parameter`` (a V placement's tied ends; the config check refuses it
            before any collective, this one covers ``parallel.schedule=tuned``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..config import ConfigError
    seen: set[int] = set()
    for chunk in chunks:
        ids = {id(p) for p in chunk.parameters()}
        if ids & seen:
            raise ConfigError("parallel.shard=full: two model chunks of this rank share a parameter (V placement with "
                              "model.tie_embeddings=true); fully_shard units cannot share parameters -- use a looped "
                              "schedule (1f1b, interleaved, zb_h1), model.tie_embeddings=false or "
                              "parallel.shard=optimizer")
        seen |= ids
    # the last stage returns its per-token losses [b, s] as a transposed view; the loss function only reads it
    # (out of place), so FSDP's warning about in-place ops on a returned view does not apply
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    for chunk in chunks:
        marks = {n: (getattr(p, "shared_embedding", False), getattr(p, "shared_embedding_copy", False),
                     getattr(p, "expert_parallel", False)) for n, p in chunk.named_parameters()}
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
        units = _expert_units(chunk) if expert_mesh is not None else []
        for unit in units:
            fully_shard(unit, mesh=expert_mesh, reshard_after_forward=False, mp_policy=policy)
            unit.set_gradient_divide_factor(float(dp_mesh.size()))
            # a sum then one division (gloo has no PREMUL_SUM); not on one rank, where torch 2.13's foreach_reduce
            # skips the reduce-scatter and would divide the copied gradient by the factor twice
            unit.set_force_sum_reduction_for_comms(expert_mesh.size() > 1)
        fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
        for n, p in chunk.named_parameters():
            p.shared_embedding, p.shared_embedding_copy, p.expert_parallel = marks.get(n, (False, False, False))
        _accumulate_mode(chunk, True)
        if param_dtype is not None:
            for unit in units + [chunk]:
                accumulate_in_fp32(unit)


def _expert_units(chunk: nn.Module) -> list[nn.Module]:
    """The routed experts (:class:`engine.moe.GroupedExperts`) of each MoE layer of ``chunk``."""
    from ...moe import GroupedExperts
    return [m for m in chunk.modules() if isinstance(m, GroupedExperts)]


def accumulate_in_fp32(chunk: nn.Module) -> None:
    """Make every microbatch's low-precision gradient of ``chunk`` (``fully_shard`` with a ``param_dtype``) go into
    FSDP's fp32 unsharded accumulator as soon as autograd wrote it.  FSDP does this itself only in its
    post-backward hook, which fires when a backward pass of the chunk ends -- in a split (B / W) schedule before the
    ``W`` passes, so several microbatches' weight gradients would first be summed in bf16.  A
    post-accumulate-grad hook on each gathered parameter upcasts the first gradient of the step into the
    accumulator and adds the later ones (FSDP2's ``FSDPParam.to_accumulated_grad_if_needed`` /
    ``accumulate_unsharded_grad_if_needed``, the same fp32 sum in the same order).  The gathered ``Parameter``
    objects exist from the first all-gather on (FSDP2 keeps them, resizing their storage), so the chunk is gathered
    once here and freed again: collective over its data-parallel group."""
    from torch.distributed.fsdp import fully_shard
    chunk.unshard()
    for group in fully_shard.state(chunk)._fsdp_param_groups:  # the chunk's own (it is a root: no lazy init yet)
        for fsdp_param in group.fsdp_params:
            fsdp_param._unsharded_param.register_post_accumulate_grad_hook(_fp32_accumulate(fsdp_param))
    chunk.reshard()


def _fp32_accumulate(fsdp_param):
    def hook(_param) -> None:
        if fsdp_param.unsharded_accumulated_grad is None:
            fsdp_param.to_accumulated_grad_if_needed()
        else:
            fsdp_param.accumulate_unsharded_grad_if_needed()
    return hook


def _param_groups(chunk) -> tuple:
    """The chunk's FSDP state and its parameter groups (FSDP2 internals, as torch's pipelining stage reads them)."""
    from torch.distributed.fsdp import fully_shard
    state = fully_shard.state(chunk)
    return state, [g for s in state._state_ctx.all_states for g in s._fsdp_param_groups]


def reshard(chunks: Sequence[nn.Module]) -> None:
    """Free the gathered parameters of every chunk and of the ``fully_shard`` units inside (the routed experts)
    (after a forward-only call: evaluation, sampling).  Local."""
    from torch.distributed.fsdp import FSDPModule
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


class FSDPGradSync(GradSync):
    """:class:`~engine.training.parallel.data_parallel.GradSync` for ``fully_shard`` chunks: no reduction during the step, one
    reduce-scatter per chunk in :meth:`finalize_model_grads` (see the module docstring).

    Args:
        chunks: this rank's model chunks, already passed through :func:`shard_chunks`.
        pg: the process groups (``dp``, ``embd``).
        tracer: optional ``engine.runtime.tracing.Tracer``; finalize reports a ``"sync"`` span.
    """

    def __init__(self, chunks: Sequence[nn.Module], pg: ProcessGroupCollection, tracer=None):
        super().__init__(chunks, pg, overlap=False, tracer=tracer, tied_on_one_rank=False)

    def finalize_model_grads(self, model_chunks=None, num_tokens=None, pg_collection=None,
                             force_all_reduce: bool = False) -> None:
        """Reduce-scatter (average) each chunk's accumulated gradients, reshard, then sum the tied-embedding
        gradient shards over the embedding group.  Collective over ``dp`` (and ``embd``); call once per step,
        after every backward (B and W) of the step ran."""
        span = self.tracer.span("sync", "finalize grads") if self.tracer else contextlib.nullcontext()
        with span:
            for chunk in self.chunks:
                _accumulate_mode(chunk, False)
                state, groups = _param_groups(chunk)
                for group in groups:
                    group.post_backward()
                state._root_post_backward_final_callback()  # FSDP's end-of-backward bookkeeping (waits, idle)
                _accumulate_mode(chunk, True)
            sum_tied_grads(self.tied, self.pg)


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: full tensor}`` of ``module``'s parameters (DTensors gathered: collective over their mesh, same
    order on every rank)."""
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in module.named_parameters()}
