"""Megatron-Core compatible ``pipeline_parallel.schedules`` API.

Reference: ``shared/reference/schedules_api.md``; behaviour: ``shared/spec/schedules.md``.
"""
from __future__ import annotations

from .schedule_table import convert_schedule_table_to_order, get_schedule_table, pp_rank_microbatches
from .step import (backward_step, check_first_val_step, clear_embedding_activation_buffer, custom_backward,
                   deallocate_output_tensor, finish_embedding_wgrad_compute, forward_step, forward_step_calc_loss,
                   get_attr_wrapped_model, get_model_config, get_tensor_shapes, set_current_microbatch)


def get_pp_rank_microbatches(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage,
                             forward_only=False, overlap_moe_expert_parallel_comm=False, p2p_communicator=None):
    """``(total_num_microbatches, are_all_microbatches_in_warmup, num_warmup_microbatches,
    num_microbatches_remaining)`` for this pipeline rank (Megatron-Core 0.16.1, spec 1.12).

    The topology comes from ``p2p_communicator`` (``pp_group.size()``, ``pp_group.rank()``,
    ``virtual_pipeline_model_parallel_size``; any object with those works) or else from ``engine.parallel_state``.
    Like Megatron it validates nothing.
    """
    if p2p_communicator is not None:
        pp_size, pp_rank = p2p_communicator.pp_group.size(), p2p_communicator.pp_group.rank()
        vp_size = p2p_communicator.virtual_pipeline_model_parallel_size
    else:
        from . import parallel_state as ps
        pp_size = ps.get_pipeline_model_parallel_world_size()
        pp_rank = ps.get_pipeline_model_parallel_rank()
        vp_size = ps.get_virtual_pipeline_model_parallel_world_size()
    return tuple(pp_rank_microbatches(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage,
                                      pp_size, pp_rank, vp_size, forward_only, overlap_moe_expert_parallel_comm))


__all__ = ["get_pp_rank_microbatches", "get_schedule_table", "convert_schedule_table_to_order",
           # per-microbatch functions (engine/step.py)
           "deallocate_output_tensor", "custom_backward", "set_current_microbatch", "forward_step_calc_loss",
           "forward_step", "backward_step", "check_first_val_step", "clear_embedding_activation_buffer",
           "finish_embedding_wgrad_compute", "get_tensor_shapes", "get_model_config", "get_attr_wrapped_model"]
