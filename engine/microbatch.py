"""Megatron-Core's per-microbatch functions with their public signatures: ``forward_step`` and
``forward_step_calc_loss`` (Megatron-Core 0.16.1, ``megatron/core/pipeline_parallel/schedules.py``), re-exported by :mod:`engine.schedules`.

They are the API layer's: their defaults come from :mod:`engine.parallel_state` like Megatron's.  The mechanics
(:func:`~engine.runtime.step.run_forward`, :func:`~engine.runtime.step.apply_loss`, ``backward_step``) live in the
runtime layer, which the executor calls directly.
"""
from __future__ import annotations

import torch

from .runtime.step import ChunkCall, ChunkHooks, ForwardCall, ScheduleContractError, apply_loss, run_forward

__all__ = ["forward_step", "forward_step_calc_loss"]


def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store,
                 config, cp_group_size, collect_non_loss_data=False, checkpoint_activations_microbatch=None,
                 is_first_microbatch=False, current_microbatch=None, vp_stage=None, is_last_stage=True):
    """Run one microbatch forward through one model chunk and apply the loss contract (Megatron-Core's ``forward_step``).

    ``input_tensor`` is what this chunk receives (``[s, b, h]`` activation, ``None`` on the first stage, or a list
    of them); the chunk gets it as a **list** through ``set_input_tensor`` (looked up through ``.module``
    wrappers).  Calls ``model.set_is_first_microbatch()`` (on the object itself) when ``is_first_microbatch``,
    ``set_current_microbatch`` when ``current_microbatch`` is not None, then
    ``forward_step_func(data_iterator, model[, checkpoint_activations_microbatch])`` -> ``(output, loss_func)``
    (the third argument only when not None), under autocast if ``config.enable_autocast``, then
    :func:`forward_step_calc_loss`.  Returns ``(output, num_tokens)``, with ``output`` wrapped in a one-element
    list if ``input_tensor`` was a list.  Starts the ``forward-compute`` timer (stopped in the loss step).

    Raises ``RuntimeError`` if no wrapper level has ``set_input_tensor`` or if ``forward_step_func`` raises
    ``StopIteration`` (the data iterator ran out; chained, naming the model chunk, microbatch and
    ``num_microbatches``), ``TypeError`` if ``forward_step_func`` does not return two values, plus the errors of
    :func:`forward_step_calc_loss`.
    """
    call = ForwardCall(forward_step_func, num_microbatches, forward_data_store, config, cp_group_size,
                       collect_non_loss_data, loss_step=_checked_loss_step)
    return run_forward(call, ChunkCall(ChunkHooks(model), data_iterator, model, vp_stage), input_tensor,
                       checkpoint_activations_microbatch, is_first_microbatch, current_microbatch, is_last_stage)


def forward_step_calc_loss(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data,
                           num_microbatches, forward_data_store, cp_group_size=None, is_last_stage=None):
    """Apply ``loss_func`` on the loss stage and normalise the loss (Megatron-Core's ``forward_step_calc_loss``).  Returns
    ``(output_tensor, num_tokens)``.

    On the loss stage (``is_last_stage``):

    * ``loss_func is None``: the raw ``output_tensor`` is appended to ``forward_data_store``;
    * ``collect_non_loss_data``: ``loss_func(output_tensor, non_loss_data=True)`` is appended, the output is
      returned unchanged;
    * ``loss_func(output_tensor)`` returns ``(L, reduced)``: ``L *= cp_group_size; L /= num_microbatches``;
    * returns ``(L, n, reduced)``: ``L /= max(n, 1); L /= num_microbatches`` unless
      ``config.calculate_per_token_loss`` (then ``L`` is unchanged and ``n`` is returned for the global token
      count);

    ``L`` (a tensor, normalised in place, or a Python number) is then returned as the output -- the root of this
    microbatch's backward -- and ``reduced`` is appended to ``forward_data_store``.  ``num_tokens`` is the CPU
    ``int32`` scalar 0 except for the 3-tuple pattern.  ``num_microbatches`` is the per-pipeline ``M``.
    On other stages nothing is called or stored and the output is returned untouched.

    ``cp_group_size`` and ``is_last_stage`` are both given, or both None (then taken from ``engine.parallel_state``:
    context-parallel size, last pipeline stage considering ``vp_stage``).  Also stops the ``forward-compute``
    timer and sets :data:`aux_loss_scale` on every stage.  Raises :class:`ScheduleContractError` if exactly one of
    the two is None, if ``vp_stage`` differs from ``model.vp_stage``, or if ``loss_func`` returns another number of
    values; ``TypeError`` for a non-numeric token count.
    """
    model_vp_stage = getattr(model, "vp_stage", None)
    if vp_stage is not None and model_vp_stage is not None and vp_stage != model_vp_stage:
        raise ScheduleContractError(f"forward_step_calc_loss: vp_stage={vp_stage} but model.vp_stage="
                                    f"{model_vp_stage}; pass the model chunk's own virtual pipeline stage")
    if cp_group_size is None and is_last_stage is None:
        from . import parallel_state as ps
        cp_group_size = ps.get_context_parallel_world_size()
        is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    elif cp_group_size is None or is_last_stage is None:
        raise ScheduleContractError(f"forward_step_calc_loss: cp_group_size={cp_group_size!r} and is_last_stage="
                                    f"{is_last_stage!r}: both must be provided, or neither (then both come from "
                                    "engine.parallel_state)")

    output_tensor, num_tokens = apply_loss(output_tensor, loss_func, config, collect_non_loss_data,
                                            num_microbatches, forward_data_store, cp_group_size, is_last_stage)
    return output_tensor, torch.tensor(0, dtype=torch.int) if num_tokens is None else num_tokens




def _checked_loss_step(call: ForwardCall, chunk: ChunkCall, output_tensor, loss_func, is_last_stage):
    return forward_step_calc_loss(chunk.model, output_tensor, loss_func, call.config, chunk.vp_stage,
                                  call.collect_non_loss_data, call.num_microbatches, call.forward_data_store,
                                  call.cp_group_size, is_last_stage)
