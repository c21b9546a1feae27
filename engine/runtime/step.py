"""The per-microbatch functions of Megatron-Core's schedules API: forward step, loss contract, backward step.

Names, signatures, return values and the loss-reduction contract follow Megatron-Core 0.16.1
(``megatron/core/pipeline_parallel/schedules.py``;
the vectors in ``tests/data/megatron_schedules.json`` pin them).  The schedules in ``engine.schedules`` compose these with a plan and the executor; users may call them
directly in their own loops.

Deviations from Megatron-Core 0.16.1, all on error paths or inputs Megatron would reject later:

* Where Megatron uses ``assert`` on the caller's input, pipecast raises :class:`ScheduleContractError` (a
  ``ValueError`` that is also an ``AssertionError``, so ``except AssertionError`` in ported code still works) or
  :class:`ScheduleContractTypeError` (``TypeError`` + ``AssertionError``), with a message naming the value and fix.
* ``forward_step_calc_loss`` accepts a Python number or a floating tensor as the token count of a 3-tuple loss and
  returns it as an ``int32`` tensor (rounded); Megatron returns it unchanged and its schedules then fail when adding
  a floating count into their ``int32`` total.  Integer tensors are returned unchanged, as in Megatron.
* ``backward_step`` accepts both the 0.16.1 call ``(input, output, grad, model_type, config)`` and the newer
  ``(input, output, grad, config)``; it does not rebind the caller's list when applying ``grad_scale_func``.
* ``backward_step`` rejects a non-scalar loss (``output_tensor_grad`` None) with a message naming ``loss_func``
  (Megatron's error comes from ``custom_backward`` or ``torch.autograd.backward`` and blames deallocation);
  ``forward_step`` turns a ``StopIteration`` of ``forward_step_func`` (data iterator exhausted) into a
  ``RuntimeError`` naming the model chunk and microbatch.
* ``forward_step`` runs autocast on ``"cuda"`` when CUDA is available and on ``"cpu"`` otherwise (Megatron always
  uses ``"cuda"``, which is a no-op without a GPU).
* MoE / MTP auxiliary-loss scales are published on :data:`aux_loss_scale` (pipecast has no MoE layers to set them
  on); they are computed on every pipeline stage, never from a last-stage-only value (NVIDIA/Megatron-LM#721).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch
from torch.autograd.variable import Variable

from .process_groups import group_rank, group_size

__all__ = [
    "ScheduleContractError", "ScheduleContractTypeError", "ChunkHooks", "ForwardCall", "ChunkCall", "run_forward",
    "apply_loss", "sendable_output", "sendable_grad", "get_attr_wrapped_model", "get_model_config", "set_current_microbatch",
    "check_first_val_step", "deallocate_output_tensor", "custom_backward", "backward_step", "get_tensor_shapes",
    "clear_embedding_activation_buffer", "finish_embedding_wgrad_compute", "is_pp_first_stage", "is_pp_last_stage",
    "is_vp_first_stage", "is_vp_last_stage", "aux_loss_scale", "AuxLossScale", "Shape",
]

Shape = Union[List[int], torch.Size]
"""A P2P tensor shape (Megatron-Core ``schedules.Shape``), e.g. ``[s, b, h]``."""


class ScheduleContractError(ValueError, AssertionError):
    """A value breaks the schedules' contract where Megatron-Core would fail an ``assert``."""


class ScheduleContractTypeError(TypeError, AssertionError):
    """An argument of the wrong type where Megatron-Core would fail an ``assert``."""


# ---- model lookup -----------------------------------------------------------------------------------------------

def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """Find ``attr`` on ``model`` or on the first ``.module`` it wraps (DDP, Float16Module, ...).

    With ``allow_none=False`` an attribute whose value is None does not count.  Returns the attribute (or the
    object holding it with ``return_model_obj=True``).  Raises ``RuntimeError`` for a list of models or when no
    wrapper level has the attribute (Megatron-Core ``get_attr_wrapped_model``).
    """
    if isinstance(model, list):
        raise RuntimeError(f"get_attr_wrapped_model({attr!r}) was given a list of models; pass one model chunk")
    obj = model
    while not hasattr(obj, attr) or (not allow_none and getattr(obj, attr) is None):
        if not hasattr(obj, "module"):
            raise RuntimeError(f"couldn't find attribute {attr!r} on {type(model).__name__} or on any .module it "
                               "wraps")
        obj = obj.module
    return obj if return_model_obj else getattr(obj, attr)


def get_model_config(model):
    """The ``config`` of a (possibly wrapped) model chunk (a ``ModelParallelConfig``).  Raises ``RuntimeError``."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def _microbatch_layers(model) -> list:
    """The layers ``set_current_microbatch`` writes to: ``decoder.layers`` of the first object (following
    ``.module``) with a non-None ``decoder``, then the inner layer of each multi-token-prediction layer."""
    obj = model
    while getattr(obj, "decoder", None) is None:
        if not hasattr(obj, "module"):
            return []
        obj = obj.module
    layers = list(obj.decoder.layers)
    mtp = getattr(obj, "mtp", None)
    if mtp is not None:
        for mtp_layer in mtp.layers:
            inner = getattr(mtp_layer, "transformer_layer", None) or getattr(mtp_layer, "mtp_model_layer", None)
            if inner is not None:
                layers.append(inner)
    return layers


def set_current_microbatch(model, microbatch_id: int) -> None:
    """Tell every transformer layer which microbatch runs next (CUDA-graph replay picks its graph by it).

    Follows ``.module`` to the first object with a non-None ``decoder`` and sets ``current_microbatch`` on each of
    ``decoder.layers`` and on the inner layer of each multi-token-prediction layer (``mtp.layers[i]``'s
    ``transformer_layer`` or ``mtp_model_layer``).  Does nothing if no such object exists (as Megatron's ``set_current_microbatch``).
    """
    for layer in _microbatch_layers(model):
        layer.current_microbatch = microbatch_id


_UNSET = object()


class ChunkHooks:
    """What :func:`forward_step` looks up on a model chunk, each looked up on first use and then kept: the
    ``set_input_tensor`` found through ``.module`` wrappers, the chunk's own ``set_is_first_microbatch`` (or None)
    and the layers ``set_current_microbatch`` writes to.

    :func:`forward_step` makes a new one per call, so it looks things up when and as Megatron does; the schedule
    functions make one per model chunk and schedule call, so a chunk's hooks are looked up once per call, not once
    per microbatch (a chunk changed during a call keeps the hooks found at its first use in that call).
    ``set_input_tensor`` raises ``RuntimeError`` (from :func:`get_attr_wrapped_model`) when no wrapper level has it.
    """

    __slots__ = ("model", "_set_input_tensor", "_set_is_first_microbatch", "_microbatch_layers")

    def __init__(self, model) -> None:
        self.model = model
        self._set_input_tensor = self._set_is_first_microbatch = self._microbatch_layers = _UNSET

    @property
    def set_input_tensor(self):
        if self._set_input_tensor is _UNSET:
            self._set_input_tensor = get_attr_wrapped_model(self.model, "set_input_tensor")
        return self._set_input_tensor

    @property
    def set_is_first_microbatch(self):
        if self._set_is_first_microbatch is _UNSET:
            self._set_is_first_microbatch = getattr(self.model, "set_is_first_microbatch", None)
        return self._set_is_first_microbatch

    @property
    def microbatch_layers(self) -> list:
        if self._microbatch_layers is _UNSET:
            self._microbatch_layers = _microbatch_layers(self.model)
        return self._microbatch_layers


def check_first_val_step(first_val_step: Optional[bool], forward_only: bool, cond: bool) -> bool:
    """``is_first_microbatch`` flag: ``first_val_step and cond`` in validation (``forward_only``) when
    ``first_val_step`` is given, else ``cond`` (Megatron's ``check_first_val_step``)."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


# ---- stage predicates (Megatron-Core pipeline_parallel/utils.py) -------------------------------------------------

def is_pp_first_stage(pp_group) -> bool:
    """Rank 0 of ``pp_group``; True when the group is None or torch.distributed is not initialised."""
    return group_rank(pp_group) == 0


def is_pp_last_stage(pp_group) -> bool:
    """Last rank of ``pp_group``; True when the group is None or torch.distributed is not initialised."""
    return group_rank(pp_group) == group_size(pp_group) - 1


def _check_vp_stage(vp_stage, vp_size) -> bool:
    """True if virtual pipelining is off; then ``vp_stage`` must be None or 0."""
    if vp_size is None or vp_size <= 1:
        if vp_stage not in (None, 0):
            raise ScheduleContractError(f"vp_stage={vp_stage} without virtual pipelining (vp_size={vp_size}); "
                                        "pass vp_stage=None or 0")
        return True
    return False


def is_vp_first_stage(vp_stage: Optional[int], vp_size: Optional[int]) -> bool:
    """Model chunk ``vp_stage`` is the first of ``vp_size`` (always True without virtual pipelining)."""
    return _check_vp_stage(vp_stage, vp_size) or vp_stage == 0


def is_vp_last_stage(vp_stage: Optional[int], vp_size: Optional[int]) -> bool:
    """Model chunk ``vp_stage`` is the last of ``vp_size`` (always True without virtual pipelining)."""
    return _check_vp_stage(vp_stage, vp_size) or vp_stage == vp_size - 1


# ---- output deallocation and the raw backward -------------------------------------------------------------------

def deallocate_output_tensor(out, deallocate_pipeline_outputs: bool = False) -> None:
    """Free the storage of an output that has been sent downstream, keeping its autograd node (Megatron's ``deallocate_output_tensor``).

    After the call ``out`` has shape ``[1]`` (same dtype, device, ``grad_fn``, ``requires_grad``); its backward
    must then go through :func:`custom_backward`.  No-op if ``out`` is None or the flag is False.
    Raises :class:`ScheduleContractTypeError` if ``out`` is not a tensor (0.16.1 does not recurse into lists) and
    :class:`ScheduleContractError` if it is a view (``out._base`` is set; freeing it would free nothing).
    """
    if out is None or not deallocate_pipeline_outputs:
        return
    if not isinstance(out, torch.Tensor):
        raise ScheduleContractTypeError(f"deallocate_output_tensor: expected Tensor, found {type(out).__name__}; "
                                        "pass the output tensor itself (e.g. output[0] of a list)")
    if out._base is not None:
        raise ScheduleContractError("deallocate_output_tensor: counter-productive to free a view of another tensor; "
                                    "pass a tensor that owns its storage (the pipecast schedules send a copy of a "
                                    "view, see sendable_output; called directly, pass out.clone())")
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def sendable_output(out: torch.Tensor, deallocate_pipeline_outputs: bool) -> torch.Tensor:
    """The tensor a stage sends downstream (and, with ``deallocate_pipeline_outputs``, frees after the send).

    A non-contiguous output is made contiguous (a tracked copy).  With deallocation on, an output that does not own
    its storage -- a view (``out._base`` set: returned through ``.view`` / ``.transpose``, or by a module with full
    backward hooks, which autograd hands back as a view) -- is replaced by a tracked copy (``out.clone()``): freeing
    a view would free nothing (its base keeps the storage), while the copy owns what is sent, so
    :func:`deallocate_output_tensor` releases it and the view (and its base, unless autograd saved it) is
    dropped with the caller's reference.  Gradients are unchanged: the copy's backward hands ``grad`` to ``out``.
    """
    if not out.is_contiguous():
        return out.contiguous()
    if deallocate_pipeline_outputs and out._base is not None:
        return out.clone()
    return out


def sendable_grad(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The input gradient a stage hands upstream (to P2P or, under the V placement, to its own earlier chunk).

    ``backward_step`` returns ``input.grad``, which autograd lays out like the input (contiguous for a receive
    buffer); a split-backward B (``engine.runtime.split_backward.backward_input_step``) returns the raw gradient
    autograd computed, which is a strided view when the chunk reshaped its input -- e.g. a batch-first chunk that
    transposes ``[s, b, h]`` to ``[b, s, h]`` (issue 26).  P2P transports send only contiguous tensors, so a
    non-contiguous gradient is copied to a contiguous one (same values; ``None`` stays ``None``).
    """
    if grad is None or not isinstance(grad, torch.Tensor) or grad.is_contiguous():
        return grad
    return grad.contiguous()


def custom_backward(output: torch.Tensor, grad_output: Optional[torch.Tensor]) -> None:
    """Backpropagate ``grad_output`` from ``output`` without the shape check of ``torch.autograd.backward``.

    ``output`` has been shrunk by :func:`deallocate_output_tensor` (storage ``[1]``) while ``grad_output`` has the
    shape recorded in the autograd graph (e.g. ``[s, b, h]``), or ``output`` is a scalar loss (``grad_output``
    None means ones).  ``torch.autograd.backward`` would compare the two shapes in Python and refuse; the C++
    engine validates against the shape recorded in ``output.grad_fn``, so it is called directly through
    ``torch.autograd.variable.Variable._execution_engine.run_backward`` (the one PyTorch-private call in pipecast,
    kept here): one root, graph freed, no higher-order graph, gradients accumulated into leaves' ``.grad``,
    unreachable inputs allowed (Megatron-Core ``custom_backward``).

    Raises :class:`ScheduleContractError` unless ``output.numel() == 1`` and
    :class:`ScheduleContractTypeError` for non-tensor arguments.
    """
    if not isinstance(output, torch.Tensor):
        raise ScheduleContractTypeError(f"custom_backward: output must be a Tensor, found {type(output).__name__}")
    if grad_output is not None and not isinstance(grad_output, torch.Tensor):
        raise ScheduleContractTypeError("custom_backward: grad_output must be a Tensor or None, found "
                                        f"{type(grad_output).__name__}")
    if output.numel() != 1:
        raise ScheduleContractError(f"custom_backward: output should be pseudo-'freed' in schedule, to optimize "
                                    f"memory (numel {output.numel()}, shape {list(output.shape)}); call "
                                    "deallocate_output_tensor(output, True) first, or use torch.autograd.backward")
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


# ---- auxiliary-loss scales ---------------------------------------------------------------------------------------

class AuxLossScale:
    """Scale factors for auxiliary losses set on every forward step (Megatron's ``MoEAuxLossAutoScaler`` / ``MTPLossAutoScaler``).

    ``moe``: ``s`` in per-token mode, else ``s * cp_size / num_microbatches``; ``mtp``: ``s`` or
    ``s / num_microbatches``; ``s = grad_scale_func(ones(1))`` or ``ones(1)``.  Set only when the config has
    ``num_moe_experts`` / ``mtp_num_layers`` not None.  Tensors of shape ``[1]`` on the output's device.
    An auxiliary-loss layer multiplies its loss gradient by these (Megatron's ``MoEAuxLossAutoScaler``).
    """

    def __init__(self) -> None:
        self.moe: Optional[torch.Tensor] = None
        self.mtp: Optional[torch.Tensor] = None


aux_loss_scale = AuxLossScale()


def _first_tensor(obj) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for item in obj:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


def _set_aux_loss_scales(config, output_tensor, cp_group_size, num_microbatches) -> None:
    has_moe = getattr(config, "num_moe_experts", None) is not None
    has_mtp = getattr(config, "mtp_num_layers", None) is not None
    if not (has_moe or has_mtp):
        return
    ref = _first_tensor(output_tensor)  # every stage has its own output (no last-stage-only values: Megatron-LM#721)
    device = ref.device if ref is not None else torch.device("cpu")
    ones = torch.ones(1, device=device)
    s = config.grad_scale_func(ones) if config.grad_scale_func is not None else ones
    per_token = getattr(config, "calculate_per_token_loss", False)
    cp = 1 if cp_group_size is None else cp_group_size
    if has_moe:
        aux_loss_scale.moe = s if per_token else s * cp / num_microbatches
    if has_mtp:
        aux_loss_scale.mtp = s if per_token else s / num_microbatches


# ---- the loss contract -------------------------------------------------------------------------------------------

def _divide(x, d):
    """``x /= d`` in place for tensors (Megatron mutates the loss tensor), rebinding for Python numbers."""
    if isinstance(x, torch.Tensor):
        x /= d
        return x
    return x / d


def _token_count(n) -> torch.Tensor:
    """The returned token count: integer tensors unchanged, anything numeric as an ``int32`` tensor."""
    if isinstance(n, torch.Tensor):
        if n.is_floating_point() or n.is_complex():
            return torch.round(n.real if n.is_complex() else n).to(torch.int32)
        return n
    if isinstance(n, (bool, int)):
        return torch.tensor(int(n), dtype=torch.int32)
    if isinstance(n, float):
        return torch.tensor(round(n), dtype=torch.int32)
    raise TypeError(f"loss_func returned a token count of type {type(n).__name__} ({n!r}) as the second of three "
                    "values; return (loss, num_tokens, reduced) with num_tokens an int or an integer tensor")


def apply_loss(output_tensor, loss_func, config, collect_non_loss_data, num_microbatches, forward_data_store,
                cp_group_size, is_last_stage):
    """The loss contract of Megatron's ``forward_step_calc_loss`` (``megatron/core/pipeline_parallel/schedules.py``; ``engine.schedules``) once
    ``cp_group_size`` and ``is_last_stage`` are known; returns ``(output_tensor, num_tokens)``, the token count None
    unless ``loss_func`` returned one (the executor then skips the int32 zero)."""
    num_tokens = None
    if is_last_stage:
        if loss_func is None:
            forward_data_store.append(output_tensor)
        elif collect_non_loss_data:
            forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        else:
            outputs = loss_func(output_tensor)
            if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
                got = f"{len(outputs)} values" if isinstance(outputs, (tuple, list)) else type(outputs).__name__
                raise ScheduleContractError(f"loss_func must return (loss, reduced) or (loss, num_tokens, reduced), "
                                            f"got {got}; use collect_non_loss_data=True for other data")
            if len(outputs) == 3:
                output_tensor, n, reduced = outputs
                num_tokens = _token_count(n)
                if not config.calculate_per_token_loss:
                    divisor = torch.clamp(n, min=1) if isinstance(n, torch.Tensor) else max(n, 1)
                    output_tensor = _divide(output_tensor, divisor)
                    output_tensor = _divide(output_tensor, num_microbatches)
            else:
                output_tensor, reduced = outputs
                if cp_group_size != 1:  # x * 1 is exact: skip the op (and its backward node) without context parallel
                    if isinstance(output_tensor, torch.Tensor):
                        output_tensor *= cp_group_size
                    else:
                        output_tensor = output_tensor * cp_group_size
                output_tensor = _divide(output_tensor, num_microbatches)
            forward_data_store.append(reduced)

    if config.timers is not None:
        config.timers("forward-compute").stop()
    _set_aux_loss_scales(config, output_tensor, cp_group_size, num_microbatches)
    return output_tensor, num_tokens


_NO_AUTOCAST = contextlib.nullcontext()


def _autocast(config):
    if not config.enable_autocast:
        return _NO_AUTOCAST
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.autocast(device_type, dtype=config.autocast_dtype)


@dataclass(slots=True)
class ForwardCall:
    """What every forward of one schedule call shares (built once per call by the executor).

    ``loss_step(call, chunk, output_tensor, loss_func, is_last_stage) -> (output, num_tokens)`` applies the loss
    contract; None is :func:`apply_loss` (the executor: it has checked ``vp_stage`` against each chunk and passes
    ``is_last_stage`` itself; the token count is None unless ``loss_func`` returned one).  The public
    ``engine.schedules.forward_step`` passes Megatron's ``forward_step_calc_loss`` with its argument checks.
    """

    forward_step_func: Callable
    num_microbatches: int
    forward_data_store: list
    config: object
    cp_group_size: int
    collect_non_loss_data: bool = False
    loss_step: Optional[Callable] = None


@dataclass(slots=True)
class ChunkCall:
    """One model chunk within a schedule call: its hooks (resolved once), data iterator and ``vp_stage``."""

    hooks: ChunkHooks
    data_iterator: object
    model: object
    vp_stage: Optional[int] = None


def run_forward(call: ForwardCall, chunk: ChunkCall, input_tensor, checkpoint_activations_microbatch,
                is_first_microbatch, current_microbatch, is_last_stage):
    """One microbatch forward through ``chunk`` within ``call`` (Megatron's ``forward_step`` is
    ``engine.schedules.forward_step``): ``set_is_first_microbatch``, ``current_microbatch``, ``set_input_tensor``
    (always a list), ``forward_step_func`` under autocast, then the loss contract.  Returns
    ``(output, num_tokens)``, the output wrapped in a one-element list if ``input_tensor`` was a list.

    Raises ``RuntimeError`` if ``forward_step_func`` raises ``StopIteration`` (the data iterator ran out; chained,
    naming the model chunk, microbatch and ``num_microbatches``), ``TypeError`` if it does not return two values,
    plus the errors of the loss contract."""
    config, hooks = call.config, chunk.hooks
    if config.timers is not None:
        config.timers("forward-compute", log_level=2).start()
    if is_first_microbatch and hooks.set_is_first_microbatch is not None:
        hooks.set_is_first_microbatch()
    if current_microbatch is not None:
        for layer in hooks.microbatch_layers:
            layer.current_microbatch = current_microbatch
    unwrap_output = not isinstance(input_tensor, list)
    if unwrap_output:
        input_tensor = [input_tensor]
    hooks.set_input_tensor(input_tensor)
    output_tensor, loss_func = _call_forward_step_func(call, chunk, checkpoint_activations_microbatch,
                                                       current_microbatch)
    if call.loss_step is not None:
        output_tensor, num_tokens = call.loss_step(call, chunk, output_tensor, loss_func, is_last_stage)
    else:
        output_tensor, num_tokens = apply_loss(output_tensor, loss_func, config, call.collect_non_loss_data,
                                               call.num_microbatches, call.forward_data_store, call.cp_group_size,
                                               is_last_stage)
    if unwrap_output:
        return output_tensor, num_tokens
    return [output_tensor], num_tokens


recompute_microbatch: list = [None]
"""The ``checkpoint_activations_microbatch`` of the forward running now (Megatron's partial recomputation by
microbatch: True -- recompute this microbatch, False -- keep its activations), None outside such a forward or
without partial recomputation.  Set around ``forward_step_func``; read by the modules marked with
``engine.runtime.recompute.apply_recompute``."""


def _call_forward_step_func(call: ForwardCall, chunk: ChunkCall, checkpoint_activations_microbatch,
                            current_microbatch):
    """``forward_step_func(data_iterator, model[, checkpoint])`` under autocast -> ``(output, loss_func)``."""
    try:
        with _autocast(call.config):
            if checkpoint_activations_microbatch is None:
                result = call.forward_step_func(chunk.data_iterator, chunk.model)
            else:
                previous, recompute_microbatch[0] = recompute_microbatch[0], bool(checkpoint_activations_microbatch)
                try:
                    result = call.forward_step_func(chunk.data_iterator, chunk.model,
                                                    checkpoint_activations_microbatch)
                finally:
                    recompute_microbatch[0] = previous
    except StopIteration as exc:  # a bare StopIteration would end an enclosing generator / say nothing
        index = 0 if chunk.vp_stage is None else chunk.vp_stage
        where = "" if current_microbatch is None else f" at microbatch {current_microbatch}"
        n = call.num_microbatches
        raise RuntimeError(
            f"the data_iterator of model chunk {index} ran out{where} (num_microbatches={n}): "
            "forward_step_func's next(data_iterator) raised StopIteration; the iterator must yield "
            f"num_microbatches={n} items per schedule call for each model chunk that reads data "
            "(e.g. build a fresh iterator per step, or use itertools.cycle / a repeating loader)") from exc
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError("forward_step_func must return (output, loss_func), got "
                        f"{type(result).__name__}; return the model output and the loss function")
    return result


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config=None):
    """Backpropagate one microbatch through one model chunk; return the gradient of its input (Megatron's ``backward_step``).

    ``output_tensor_grad`` is the gradient received from the next stage (same shape as the output, e.g.
    ``[s, b, h]``), or None on the loss stage: then ``config.grad_scale_func`` (if set) is applied to the loss
    first -- once per microbatch, never to ``.grad`` (pytorch/torchtitan#1733).  Backward runs only if the output requires
    grad, through :func:`custom_backward` when ``config.deallocate_pipeline_outputs`` else
    ``torch.autograd.backward``; parameter gradients accumulate into ``.grad``.  Each non-None input gets
    ``retain_grad()``; the return value is ``input.grad`` (None for a None input), a list if ``input_tensor`` was a
    list.  Only the first output / gradient of lists is used.

    Both the 0.16.1 call ``backward_step(input, output, grad, model_type, config)`` and the newer
    ``backward_step(input, output, grad, config)`` are accepted (``model_type`` is unused).

    Raises :class:`ScheduleContractError` on the loss stage (``output_tensor_grad`` None) when the loss requires
    grad and has more than one element, naming ``loss_func`` and the shape (Megatron fails there inside
    ``custom_backward`` with advice about deallocation, or in ``torch.autograd.backward``).
    """
    if config is None:
        config = model_type
    if config.timers is not None:
        config.timers("backward-compute", log_level=2).start()

    unwrap_input = not isinstance(input_tensor, list)
    if unwrap_input:
        input_tensor = [input_tensor]
    for x in input_tensor:
        if x is not None:
            x.retain_grad()
    outputs = list(output_tensor) if isinstance(output_tensor, list) else [output_tensor]
    grads = list(output_tensor_grad) if isinstance(output_tensor_grad, list) else [output_tensor_grad]

    loss = outputs[0]
    if grads[0] is None and isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() != 1:
        raise ScheduleContractError(
            f"backward_step: the loss of this microbatch has shape {list(loss.shape)} ({loss.numel()} elements) but "
            "the loss stage backpropagates from a scalar: loss_func (the second value forward_step_func returns) "
            "must return a one-element loss as its first value; reduce it there, e.g. return (loss.sum(), ...) or "
            "(loss.mean(), ...)")
    if grads[0] is None and config.grad_scale_func is not None:
        outputs[0] = config.grad_scale_func(outputs[0])
    if outputs[0].requires_grad:
        if config.deallocate_pipeline_outputs:
            custom_backward(outputs[0], grads[0])
        else:
            torch.autograd.backward(outputs[0], grad_tensors=grads[0])

    input_tensor_grad = [None if x is None else x.grad for x in input_tensor]
    if config.timers is not None:
        config.timers("backward-compute").stop()
    return input_tensor_grad[0] if unwrap_input else input_tensor_grad


# ---- shapes and the deferred embedding weight gradient ----------------------------------------------------------

def get_tensor_shapes(*, seq_length, micro_batch_size, decoder_seq_length, config, tp_group, cp_group):
    """The one P2P tensor shape of the non-interleaved schedule: ``[(s, micro_batch_size, config.hidden_size)]``
    with ``s = (decoder_seq_length or seq_length) // cp_size``, further ``// tp_size`` with
    ``config.sequence_parallel`` (Megatron-Core 0.16.1, ``get_tensor_shapes``).  A None group counts as size 1."""
    seq = decoder_seq_length if decoder_seq_length is not None else seq_length
    seq //= group_size(cp_group)
    if config.sequence_parallel:
        seq //= group_size(tp_group)
    return [(seq, micro_batch_size, config.hidden_size)]


def clear_embedding_activation_buffer(config, model, is_last_stage):
    """On the last stage with ``config.defer_embedding_wgrad_compute``: empty the output layer's
    ``embedding_activation_buffer`` of the last model chunk and return the module holding it (the one with
    ``post_process``); else return None (Megatron's ``get_embedding_activation_buffer``).  Raises ``RuntimeError`` if no wrapper level has
    ``post_process``."""
    if not (is_last_stage and config.defer_embedding_wgrad_compute):
        return None
    chunk = model[-1] if isinstance(model, list) else model
    embedding_module = get_attr_wrapped_model(chunk, "post_process", return_model_obj=True)
    embedding_module.embedding_activation_buffer.clear()
    return embedding_module


def finish_embedding_wgrad_compute(config, embedding_module, is_last_stage, tp_group) -> None:
    """Compute the deferred output-layer weight gradient on the last stage (Megatron's ``finish_embedding_wgrad_compute``).

    Drains ``embedding_module.embedding_activation_buffer`` (activations ``[s, b, h]``) and
    ``grad_output_buffer`` (output gradients ``[s, b, v]``) pairwise, accumulating
    ``grad_output^T @ activation`` (``[v, h]``) into the output weight's ``main_grad`` (or ``.grad`` when the
    weight has no ``main_grad``).  The weight is ``output_layer.weight`` when
    ``share_embeddings_and_output_weights`` is set, else ``shared_embedding_or_output_weight()`` (both are the
    output layer's weight on a last pipeline stage).  No-op unless ``is_last_stage`` and
    ``config.defer_embedding_wgrad_compute``.  Raises ``ValueError`` for buffers of different lengths or a tensor
    group larger than 1 (not supported by pipecast).
    """
    if not (is_last_stage and config.defer_embedding_wgrad_compute):
        return
    if group_size(tp_group) != 1:
        raise ValueError(f"finish_embedding_wgrad_compute: tensor-parallel group of size {group_size(tp_group)} is "
                         "not supported by pipecast; use tensor_model_parallel_size=1")
    activations = embedding_module.embedding_activation_buffer
    grad_outputs = embedding_module.grad_output_buffer
    if len(activations) != len(grad_outputs):
        raise ValueError(f"finish_embedding_wgrad_compute: {len(activations)} buffered activations but "
                         f"{len(grad_outputs)} buffered output gradients; every deferred microbatch must add one of "
                         "each")
    if getattr(embedding_module, "share_embeddings_and_output_weights", False):
        weight = embedding_module.output_layer.weight
    else:
        weight = embedding_module.shared_embedding_or_output_weight()
    while activations:
        activation, grad_output = activations.pop(0), grad_outputs.pop(0)
        wgrad = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
            activation.reshape(-1, activation.shape[-1]))
        target = getattr(weight, "main_grad", None)
        if target is not None:
            target.add_(wgrad.to(target.dtype))
        elif weight.grad is None:
            weight.grad = wgrad.to(weight.dtype)
        else:
            weight.grad.add_(wgrad.to(weight.grad.dtype))
