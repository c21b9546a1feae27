"""``ModelParallelConfig``: Megatron-Core's parallelism / schedule configuration, as one dataclass.

Field names and defaults follow Megatron-Core 0.16.1 (``megatron.core.ModelParallelConfig``) for every field the
pipeline schedules, the P2P communicator and the step functions read (``megatron/core/model_parallel_config.py``),
plus the usual parallel-size fields.  A few fields that Megatron keeps on ``TransformerConfig`` but the schedules
read through the same ``config`` object (``hidden_size``, ``calculate_per_token_loss``, ``fp8``,
``num_moe_experts``, ``mtp_num_layers``, ``mtp_standalone``) live here too, so that a pipecast model chunk needs
only this one config as its ``.config``; a Megatron ``TransformerConfig`` (a subclass) works just as well.

``__post_init__`` applies Megatron's construction-time rules that matter for the schedules and raises
``ValueError`` naming the field, its value and the fix:

* ``pipeline_model_parallel_size > 1`` requires ``pipeline_dtype`` (the dtype of P2P receive buffers);
* ``microbatch_group_size_per_vp_stage`` ``None`` becomes ``pipeline_model_parallel_size`` (depth-first order);
* ``autocast_dtype`` ``None`` becomes ``params_dtype``;
* ``expert_tensor_parallel_size`` ``None`` becomes ``tensor_model_parallel_size``;
* ``sequence_parallel`` needs ``tensor_model_parallel_size > 1``;
* ``overlap_p2p_comm_warmup_flush`` needs ``overlap_p2p_comm=True`` and ``batch_p2p_comm=False``;
* ``defer_embedding_wgrad_compute`` needs pipelining and ``gradient_accumulation_fusion``, and
  ``wgrad_deferral_limit >= 0``;
* expert parallelism with tensor parallelism needs ``sequence_parallel``;
* ``cpu_offloading`` is not supported with pipelining.

pipecast adds type / range checks on the sizes (positive integers).  Which sizes the pipecast runtime supports
(any tensor-parallel and expert-parallel size; context parallel size 1) is checked where process groups are built
(``engine.runtime.process_groups``), not here: a config is data and may describe a run pipecast cannot execute.

Like Megatron's, the dataclass is mutable: the interleaved schedule turns a single ``grad_sync_func`` /
``param_sync_func`` into a per-model-chunk list in place (as Megatron-Core's interleaved schedule does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["ModelParallelConfig"]


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ModelParallelConfig.{name} must be an int{' or None' if allow_none else ''}, "
                        f"got {value!r} ({type(value).__name__}); pass a positive integer")
    if value < 1:
        raise ValueError(f"ModelParallelConfig.{name} must be >= 1, got {value}; pass a positive integer")


@dataclass
class ModelParallelConfig:
    """Parallelism and pipeline-schedule settings (Megatron-Core 0.16.1 field names and defaults).

    Model chunks carry it as ``chunk.config``; ``engine.runtime.step.get_model_config`` finds it through wrappers.
    Raises ``TypeError`` / ``ValueError`` at construction for the rules listed in the module docstring.
    """

    # ---- parallel sizes -------------------------------------------------------------------------------------
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_comm_backend: Optional[str] = None
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: Optional[list] = None
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    moe_extended_tp: bool = False

    # ---- initialisation and precision -----------------------------------------------------------------------
    perform_initialization: bool = True
    use_cpu_initialization: bool = False
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    timers: Optional[Callable] = None
    finalize_model_grads_func: Optional[Callable] = None
    grad_scale_func: Optional[Callable] = None
    no_sync_func: Optional[Callable] = None
    grad_sync_func: Optional[Callable] = None
    param_sync_func: Optional[Callable] = None
    deterministic_mode: bool = False
    enable_autocast: bool = False
    autocast_dtype: Optional[torch.dtype] = None
    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = False
    use_te_rng_tracker: bool = False
    tp_comm_overlap: bool = False

    # ---- pipeline parallel communication ----------------------------------------------------------------------
    pipeline_dtype: Optional[torch.dtype] = None
    variable_seq_lengths: bool = False
    overlap_p2p_comm: bool = False
    batch_p2p_comm: bool = True
    batch_p2p_sync: bool = True
    use_ring_exchange_p2p: bool = False
    deallocate_pipeline_outputs: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    overlap_p2p_comm_warmup_flush: bool = False
    microbatch_group_size_per_vp_stage: Optional[int] = None
    delay_wgrad_compute: bool = False

    # ---- CPU offloading / misc --------------------------------------------------------------------------------
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    barrier_with_L1_time: bool = True
    overlap_moe_expert_parallel_comm: bool = False
    fine_grained_activation_offloading: bool = False
    cuda_graph_impl: str = "none"

    # ---- read through the same config object, kept on TransformerConfig in Megatron ---------------------------
    hidden_size: int = 0
    calculate_per_token_loss: bool = False
    fp8: Optional[str] = None
    num_moe_experts: Optional[int] = None
    mtp_num_layers: Optional[int] = None
    mtp_standalone: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            _positive_int(name, getattr(self, name))
        for name in ("virtual_pipeline_model_parallel_size", "microbatch_group_size_per_vp_stage",
                     "expert_tensor_parallel_size"):
            _positive_int(name, getattr(self, name), allow_none=True)
        k = self.num_microbatches_with_partial_activation_checkpoints
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"ModelParallelConfig.num_microbatches_with_partial_activation_checkpoints must be "
                             f"None or an int >= 0, got {k!r}; pass the number of checkpointed microbatches")

        if self.sequence_parallel and self.tensor_model_parallel_size <= 1:
            raise ValueError("ModelParallelConfig.sequence_parallel=True needs tensor_model_parallel_size > 1, got "
                             f"tensor_model_parallel_size={self.tensor_model_parallel_size}; set "
                             "sequence_parallel=False")
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if (self.expert_model_parallel_size > 1 and self.tensor_model_parallel_size > 1
                and not self.sequence_parallel):
            raise ValueError("ModelParallelConfig: expert_model_parallel_size="
                             f"{self.expert_model_parallel_size} with tensor_model_parallel_size="
                             f"{self.tensor_model_parallel_size} needs sequence_parallel=True; set it")
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ValueError("ModelParallelConfig.pipeline_dtype is None with pipeline_model_parallel_size="
                             f"{self.pipeline_model_parallel_size}; set pipeline_dtype (e.g. torch.float32 or "
                             "torch.bfloat16), the dtype of the activations sent between pipeline stages")
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.defer_embedding_wgrad_compute:
            if self.pipeline_model_parallel_size == 1:
                raise ValueError("ModelParallelConfig.defer_embedding_wgrad_compute=True needs "
                                 "pipeline_model_parallel_size > 1, got 1; set defer_embedding_wgrad_compute=False")
            if not self.gradient_accumulation_fusion:
                raise ValueError("ModelParallelConfig.defer_embedding_wgrad_compute=True needs "
                                 "gradient_accumulation_fusion=True (weights with .main_grad); set it or turn "
                                 "defer_embedding_wgrad_compute off")
            if self.wgrad_deferral_limit < 0:
                raise ValueError(f"ModelParallelConfig.wgrad_deferral_limit must be >= 0, got "
                                 f"{self.wgrad_deferral_limit}; use 0 for no limit")
        if self.overlap_p2p_comm_warmup_flush and (not self.overlap_p2p_comm or self.batch_p2p_comm):
            raise ValueError("ModelParallelConfig.overlap_p2p_comm_warmup_flush=True needs overlap_p2p_comm=True "
                             f"and batch_p2p_comm=False, got overlap_p2p_comm={self.overlap_p2p_comm}, "
                             f"batch_p2p_comm={self.batch_p2p_comm}; set them so")
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size
        if self.cpu_offloading and self.pipeline_model_parallel_size > 1:
            raise ValueError("ModelParallelConfig.cpu_offloading=True is not supported with "
                             f"pipeline_model_parallel_size={self.pipeline_model_parallel_size}; turn it off")
