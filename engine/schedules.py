"""Megatron-Core compatible ``pipeline_parallel.schedules`` API.

Reference: Megatron-Core 0.16.1, ``megatron/core/pipeline_parallel/schedules.py``.

The three schedule functions are thin compositions: validate the call (Megatron-Core's errors plus pipecast's own,
agreed over the pipeline group before any pipeline communication), build the plan of the schedule
(``engine.plan.build_plan``, cached), run it with the one executor (``engine.runtime.executor``) and return
``forward_data_store`` (the loss stage's reduced losses, one per microbatch; ``[]`` on every other
rank).

Deliberate deviations from Megatron-Core 0.16.1:

* ``num_microbatches < 1`` is a ``ValueError`` (Megatron's no-pipelining schedule runs one microbatch with id -1,
  the 1F1B one silently does nothing).
* Interleaving with ``P = 2`` is correct in every P2P mode (tags + receives posted in the sender's order), so it is
  not rejected; the interleaved schedule with ``P = 1`` raises ``ValueError`` (Megatron: ``IndexError`` mid-step).
* ``config`` is not mutated (Megatron turns single ``grad_sync_func`` / ``param_sync_func`` into per-chunk lists);
  both forms are accepted.  ``no_sync`` is left at the end of forward-only calls too.
* Before communicating, the pipeline ranks all-gather a small fingerprint of the call (``num_microbatches``,
  ``forward_only``, model chunks, group size, P2P modes, tensor shapes) and an error flag: a rank whose input is rejected makes
  every rank raise instead of leaving its peers blocked, and ranks that disagree raise ``ValueError`` naming the
  field and the per-rank values.
* The interleaved schedule requires ``config.virtual_pipeline_model_parallel_size == len(model)`` (Megatron
  silently mis-detects the loss stage when they differ).
* Outputs sent downstream must have the receive shape and ``pipeline_dtype``; otherwise ``RuntimeError`` on the
  sender (Megatron hangs or reads garbage).
* Sends are posted without waiting for the receiver; a send's handle is waited once the receiver has provably
  posted the matching receive, else at the end of the step.
* ``config.overlap_moe_expert_parallel_comm`` (training calls): Megatron's combined 1F1B for no pipelining and the
  interleaved schedule (its warmup + 1; every steady forward / backward pair one cell), DualPipeV's cells for
  ``"dualpipev"``; each cell runs overlapped (``engine.runtime.overlap``: the model's expert all-to-alls are in
  flight while the other microbatch computes).  Refused, as Megatron refuses it, for non-interleaved 1F1B with
  pipelining, and for the schedules without forward-backward cells.
* Each model chunk's ``set_input_tensor``, ``set_is_first_microbatch`` and current-microbatch layers are looked up
  once per call (:class:`~engine.runtime.step.ChunkHooks`) with the other checks, so a chunk without ``set_input_tensor``
  or whose ``vp_stage`` is not its index in the model list fails on every rank before any P2P (Megatron: at that
  chunk's first forward, on that rank only).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from .plan.lowering import program_for
from .plan.registry import ScheduleSpec, auto_schedule, get_schedule, schedule_names
from .plan.resolve import ResolvedSchedule
from .plan.types import Plan
from .plan.table import (convert_schedule_table_to_order, get_schedule_table, pp_rank_microbatches,
                         validate_interleaved_microbatches)
from .runtime.executor import ExecutionContext, default_prefetch, execute
from .runtime.p2p import P2PCommunicator
from .runtime.process_groups import group_size
from .runtime.step import (ChunkHooks, ScheduleContractError, ScheduleContractTypeError, backward_step,
                           check_first_val_step, clear_embedding_activation_buffer, custom_backward,
                           deallocate_output_tensor, finish_embedding_wgrad_compute, get_attr_wrapped_model,
                           get_model_config, get_tensor_shapes, is_pp_last_stage, set_current_microbatch)
from .finalize import warn_unsynced_tied_weights
from .microbatch import forward_step, forward_step_calc_loss


def get_pp_rank_microbatches(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage,
                             forward_only=False, overlap_moe_expert_parallel_comm=False, p2p_communicator=None):
    """``(total_num_microbatches, are_all_microbatches_in_warmup, num_warmup_microbatches,
    num_microbatches_remaining)`` for this pipeline rank (Megatron-Core 0.16.1).

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


# ---- the schedules --------------------------------------------------------------------------------------------------

_NO_PIPELINING_FN = "forward_backward_no_pipelining"
_ONE_F_ONE_B_FN = "forward_backward_pipelining_without_interleaving"
_INTERLEAVED_FN = "forward_backward_pipelining_with_interleaving"
_WITH_SCHEDULE_FN = "forward_backward_pipelining_with_schedule"


def _entry_of(function: str) -> ScheduleSpec:
    """The registry entry that Megatron-Core's function ``function`` runs."""
    return next(get_schedule(n) for n in schedule_names() if get_schedule(n).megatron_function == function)


def _local(spec: ScheduleSpec) -> bool:
    """One rank, no pipeline communication (Megatron's no-pipelining contract)."""
    return spec.max_pp == 1


def _interleaved(spec: ScheduleSpec) -> bool:
    """Megatron's interleaved contract: a list of model chunks checked against the config's virtual size."""
    return spec.megatron_function == _INTERLEAVED_FN


def _schedule_id(spec: ScheduleSpec) -> int:
    names = schedule_names()
    return names.index(spec.name) if spec.name in names else len(names)
_FINGERPRINT = ("schedule", "num_microbatches", "forward_only", "num_model_chunks",
                "microbatch_group_size_per_vp_stage", "variable_seq_lengths", "activation shape", "gradient shape",
                "config.pipeline_dtype", "config.overlap_moe_expert_parallel_comm")
_SHAPE_SLOTS = 4
# pipeline_dtype in the fingerprint: ranks with different P2P dtypes would exchange messages of different byte sizes
# (gloo aborts the process on a larger message and silently half-fills the buffer on a smaller one)
_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
           *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)))


_ONE_CHUNK_HINT = ("; for non-interleaved 1F1B with one model chunk per rank set "
                   "virtual_pipeline_model_parallel_size=None (any value but None, even 1, selects interleaving)")


def _single_model(model, data_iterator, schedule: str):
    """Unwrap the one-element lists the non-interleaved schedules accept (Megatron asserts length 1)."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ScheduleContractError(
                f"{schedule}: model is a list of {len(model)} chunks but this schedule runs one model chunk per "
                "rank; pass one module, or use forward_backward_pipelining_with_interleaving (set "
                "virtual_pipeline_model_parallel_size) for model chunks")
        model = model[0]
    if isinstance(data_iterator, list):
        if len(data_iterator) != 1:
            raise ScheduleContractError(f"{schedule}: data_iterator is a list of {len(data_iterator)} iterators but "
                                        "this schedule runs one model chunk; pass one iterator")
        data_iterator = data_iterator[0]
    return [model], [data_iterator]


def _check_microbatches(num_microbatches) -> None:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise TypeError(f"num_microbatches={num_microbatches!r} must be an int (microbatches per pipeline per step)")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches}: a step needs at least one microbatch; pass "
                         "num_microbatches >= 1")


def _resolve_groups(schedule: str, p2p_communicator, pg_collection):
    """Megatron's rule: both None -> from ``engine.parallel_state``; both given -> checked; one -> ValueError."""
    if not _local(schedule) and (p2p_communicator is None) != (pg_collection is None):
        raise ValueError(f"{schedule}: p2p_communicator and pg_collection must be given together or not at all, got "
                         f"p2p_communicator={'set' if p2p_communicator is not None else None}, pg_collection="
                         f"{'set' if pg_collection is not None else None}; pass both (explicit groups) or neither "
                         "(engine.parallel_state)")
    if pg_collection is None:
        from . import parallel_state as ps
        pg_collection = ps.get_pg_collection()
    else:
        missing = [a for a in ("tp", "cp") if not hasattr(pg_collection, a)]
        if missing:
            raise ScheduleContractError(f"{schedule}: pg_collection lacks the process group(s) {missing}; pass an "
                                        "engine.runtime.process_groups.ProcessGroupCollection")
    if p2p_communicator is not None:
        for attr in ("pp_group", "post", "new_buffer", "isend", "irecv"):
            if not hasattr(p2p_communicator, attr):
                raise TypeError(f"{schedule}: p2p_communicator {type(p2p_communicator).__name__} has no {attr!r}; "
                                "pass an engine.runtime.p2p.P2PCommunicator")
    return p2p_communicator, pg_collection


_COMMUNICATORS: dict = {}


def _communicator(pp_group, config) -> P2PCommunicator:
    """One communicator per (pipeline group, config) object pair (reused across calls)."""
    key = (id(pp_group), id(config))
    hit = _COMMUNICATORS.get(key)
    if hit is not None and hit.pp_group is pp_group and hit.config is config:
        return hit
    comm = P2PCommunicator(pp_group, config)
    if len(_COMMUNICATORS) > 32:
        _COMMUNICATORS.clear()
    _COMMUNICATORS[key] = comm
    return comm


def _interleaved_shape(seq_length, micro_batch_size, config, pg_collection):
    seq = seq_length // group_size(pg_collection.cp)
    if config.sequence_parallel:
        seq //= group_size(pg_collection.tp)
    return (seq, micro_batch_size, config.hidden_size)


def _check_shape(shape, schedule: str, what: str) -> tuple:
    if not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"{schedule}: the pipeline {what} shape {tuple(shape)} (from seq_length, micro_batch_size and "
                         "config.hidden_size) has a non-positive size; pass seq_length / micro_batch_size and set "
                         "ModelParallelConfig.hidden_size, or set variable_seq_lengths=True")
    if len(shape) > _SHAPE_SLOTS:
        raise ValueError(f"{schedule}: pipeline {what} shape {tuple(shape)} has more than {_SHAPE_SLOTS} dimensions")
    return tuple(shape)


class _Call:
    """A validated schedule call: everything the executor needs."""

    __slots__ = ("schedule", "models", "iters", "config", "comm", "pgc", "act_shape", "grad_shape", "group", "hooks")


def _prepare(schedule, *, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
             decoder_seq_length, forward_only, adjust_tensor_shapes_fn, comm, pgc, chunks=None) -> _Call:
    """Every local check of a schedule call (raises); no communication.  ``chunks``: the model chunks per rank of
    a split-backward plan."""
    call = _Call()
    call.schedule, call.pgc, call.group = schedule, pgc, None
    _check_microbatches(num_microbatches)
    models, iters = _models_of(schedule, model, data_iterator, adjust_tensor_shapes_fn, chunks)
    call.models, call.iters = models, iters
    call.hooks = _chunk_hooks(models, len(models) > 1 or _interleaved(schedule))
    config = get_model_config(models[0])
    call.config = config
    if getattr(config, "overlap_moe_expert_parallel_comm", False) and not forward_only:
        _check_overlap(schedule, comm.size if comm is not None else _pipeline_of(pgc))
    if comm is None and not _local(schedule):
        comm = _communicator(pgc.pp, config)
    call.comm = comm
    call.act_shape = call.grad_shape = None
    if _local(schedule):
        return call
    pp_size = comm.size
    _check_p2p_modes(schedule, config, pp_size)
    if _interleaved(schedule):
        group = config.microbatch_group_size_per_vp_stage or pp_size
        try:
            validate_interleaved_microbatches(num_microbatches, pp_size, group)
        except (ValueError, RuntimeError) as exc:
            if len(models) > 1:
                raise
            raise type(exc)(f"{exc}{_ONE_CHUNK_HINT}") from exc
        call.group = group
    if pp_size > 1 and config.pipeline_dtype is None:
        raise RuntimeError("config.pipeline_dtype is None but the pipeline has "
                           f"{pp_size} ranks; set ModelParallelConfig.pipeline_dtype (the dtype of P2P tensors, e.g. "
                           "torch.float32)")
    if pp_size > 1 and not comm.negotiates_shapes:
        _set_shapes(call, seq_length, micro_batch_size, decoder_seq_length, adjust_tensor_shapes_fn)
    return call


def _pipeline_of(pgc) -> int:
    return group_size(pgc.pp) if pgc is not None else 1


def _check_overlap(schedule, pp_size: int) -> None:
    """``config.overlap_moe_expert_parallel_comm`` needs a schedule with forward-backward cells; Megatron-Core
    refuses it for non-interleaved 1F1B with pipelining (its ``TransformerConfig``)."""
    name = _function_name(schedule)
    if schedule.megatron_function == _ONE_F_ONE_B_FN and pp_size > 1:
        raise ValueError(f"{name}: config.overlap_moe_expert_parallel_comm=True needs virtual pipeline stages when "
                         f"pipeline_model_parallel_size={pp_size} > 1 (as Megatron-Core); use the interleaved "
                         "schedule (virtual_pipeline_model_parallel_size >= 2) or schedule='dualpipev', or set it "
                         "to False")
    if schedule is not _IMPORTED and "overlap_moe_expert_parallel_comm" not in schedule.options:
        takers = [n for n in schedule_names() if "overlap_moe_expert_parallel_comm" in get_schedule(n).options]
        raise ValueError(f"{name}: config.overlap_moe_expert_parallel_comm=True but schedule {schedule.name!r} has no "
                         f"forward-backward cells to overlap; use one of {takers}, or set it to False")


def _models_of(schedule, model, data_iterator, adjust_tensor_shapes_fn, chunks):
    """``(models, iterators)`` of the call, one per model chunk, checked against the schedule."""
    if _interleaved(schedule) or (chunks is not None and chunks > 1):
        name = _function_name(schedule)
        models, iters = _chunk_list(name, model, data_iterator, chunks)
        if adjust_tensor_shapes_fn is not None:
            raise ScheduleContractError(f"{name}: adjust_tensor_shapes_fn is only supported by the non-interleaved "
                                        "schedule; pass None")
        return models, iters
    models, iters = _single_model(model, data_iterator, _function_name(schedule))
    if _local(schedule) and adjust_tensor_shapes_fn is not None:
        raise ScheduleContractError("forward_backward_no_pipelining: adjust_tensor_shapes_fn must be None (there "
                                    "is no pipeline communication)")
    return models, iters


def _function_name(schedule) -> str:
    return schedule.megatron_function or _WITH_SCHEDULE_FN


def _chunk_list(name: str, model, data_iterator, chunks):
    """The model list of a multi-chunk schedule (interleaved: checked against the config's virtual size)."""
    if not isinstance(model, list):
        raise ScheduleContractTypeError(f"{name}: model must be a list of model chunks (one per virtual pipeline "
                                        f"stage), got {type(model).__name__}"
                                        + (_ONE_CHUNK_HINT if chunks is None else ""))
    models = list(model)
    if not models:
        raise ScheduleContractError(f"{name}: model is an empty list; pass one model chunk per virtual pipeline "
                                    "stage")
    vp = get_model_config(models[0]).virtual_pipeline_model_parallel_size if chunks is None else chunks
    what = "config.virtual_pipeline_model_parallel_size" if chunks is None else "the plan's num_model_chunks"
    if vp != len(models):  # checked before data_iterator: its length follows the model list
        fix = (f"pass model as a list of {vp} model chunks (one per virtual pipeline stage) on each rank, or set "
               if isinstance(vp, int) and vp >= 1 else "set ")
        raise ScheduleContractError(f"{name}: model is a list of {len(models)} model chunk(s) but {what}={vp}; {fix}"
                                    f"config.virtual_pipeline_model_parallel_size={len(models)}")
    iters = [None] * len(models) if data_iterator is None else data_iterator
    if not isinstance(iters, list) or len(iters) != len(models):
        raise ScheduleContractError(f"{name}: data_iterator must be a list with one iterator (or None) per model "
                                    f"chunk ({len(models)}), got {type(data_iterator).__name__}"
                                    f"{'' if not isinstance(iters, list) else f' of length {len(iters)}'}"
                                    + (_ONE_CHUNK_HINT if len(models) == 1 and chunks is None else ""))
    return models, iters


def _check_p2p_modes(schedule, config, pp_size: int) -> None:
    if not schedule.overlap_p2p and config.overlap_p2p_comm:
        raise ValueError(f"{_function_name(schedule)}: config.overlap_p2p_comm=True is not supported by the "
                         f"{schedule} schedule (as Megatron-Core's non-interleaved schedule); set "
                         "overlap_p2p_comm=False or use the interleaved schedule")
    if _interleaved(schedule):
        if config.overlap_p2p_comm and config.batch_p2p_comm:
            raise ValueError("config.overlap_p2p_comm=True and config.batch_p2p_comm=True are mutually exclusive "
                             "(Megatron-Core); set batch_p2p_comm=False to overlap P2P communication")
        if pp_size < 2:
            raise ValueError("forward_backward_pipelining_with_interleaving needs a pipeline of at least 2 ranks, "
                             f"got pipeline_model_parallel_size={pp_size}; use forward_backward_no_pipelining "
                             "(get_forward_backward_func picks it for one rank)")


def _set_shapes(call, seq_length, micro_batch_size, decoder_seq_length, adjust_tensor_shapes_fn) -> None:
    """The fixed receive shapes ``[s, b, h]`` of activations and gradients."""
    config, pgc, schedule = call.config, call.pgc, call.schedule
    if len(call.models) > 1 or _interleaved(schedule):
        shape = _interleaved_shape(seq_length, micro_batch_size, config, pgc)
        recv_shapes = send_shapes = [shape]
    else:
        recv_shapes = send_shapes = get_tensor_shapes(
            seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
            config=config, tp_group=pgc.tp, cp_group=pgc.cp)
        if adjust_tensor_shapes_fn is not None:
            recv_shapes, send_shapes = adjust_tensor_shapes_fn(recv_shapes, send_shapes)
    if len(recv_shapes) != 1 or len(send_shapes) != 1:
        raise ValueError(f"pipecast sends one tensor per pipeline message; got receive shapes {recv_shapes} and "
                         f"send shapes {send_shapes} (adjust_tensor_shapes_fn); return one shape each")
    call.act_shape = _check_shape(recv_shapes[0], schedule, "activation")
    call.grad_shape = _check_shape(send_shapes[0], schedule, "gradient")


def _chunk_hooks(models, interleaved: bool) -> list:
    """Each model chunk's :class:`ChunkHooks` (raises ``RuntimeError`` without ``set_input_tensor``), and the
    check ``forward_step_calc_loss`` makes per microbatch: a chunk's ``vp_stage``, if set, is its index."""
    hooks = []
    for c, m in enumerate(models):
        own = getattr(m, "vp_stage", None) if interleaved else None
        if own is not None and own != c:
            raise ScheduleContractError(f"model chunk {c} has vp_stage={own}; the interleaved schedule runs model[c] "
                                        "as virtual pipeline stage c: order the model list by vp_stage")
        chunk = ChunkHooks(m)
        chunk.set_input_tensor  # noqa: B018 - looked up now, so a chunk without it fails before any P2P
        hooks.append(chunk)
    return hooks


def _fingerprint(call, schedule, num_microbatches, forward_only) -> list[int]:
    def slots(shape):
        shape = list(shape or ())
        return shape + [-1] * (_SHAPE_SLOTS - len(shape))
    variable = bool(call.comm.negotiates_shapes)
    dtype = call.config.pipeline_dtype
    dtype_id = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    overlap = int(bool(getattr(call.config, "overlap_moe_expert_parallel_comm", False)))
    return ([_schedule_id(schedule), num_microbatches, int(bool(forward_only)), len(call.models), call.group or 0,
             int(variable)] + slots(call.act_shape) + slots(call.grad_shape) + [dtype_id, overlap])


def _agree(comm, error, values) -> None:
    """All-gather an error flag and the call's fingerprint over the pipeline group; raise on every rank if any rank
    rejected the call or the ranks disagree.  One small collective; nothing is sent when ``P == 1``."""
    if comm is None or comm.size == 1 or comm.pp_group is None:
        if error is not None:
            raise error
        return
    width = 8 + 2 * _SHAPE_SLOTS
    vec = torch.tensor([int(error is not None)] + (list(values) if error is None else [0] * width),
                       dtype=torch.int64, device=comm.device)
    gathered = [torch.empty_like(vec) for _ in range(comm.size)]
    dist.all_gather(gathered, vec, group=comm.pp_group)
    rows = torch.stack(gathered).tolist()
    rejected = [r for r, row in enumerate(rows) if row[0]]
    if rejected:
        _raise_shared(comm, error, rejected)
    columns = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 6 + _SHAPE_SLOTS),
               (6 + _SHAPE_SLOTS, 6 + 2 * _SHAPE_SLOTS), (6 + 2 * _SHAPE_SLOTS, 7 + 2 * _SHAPE_SLOTS),
               (7 + 2 * _SHAPE_SLOTS, 8 + 2 * _SHAPE_SLOTS)]
    for name, (a, b) in zip(_FINGERPRINT, columns):
        per_rank = [tuple(row[1 + a:1 + b]) for row in rows]
        if len(set(per_rank)) > 1:
            shown = [v[0] if len(v) == 1 else tuple(d for d in v if d >= 0) for v in per_rank]
            if name == "config.pipeline_dtype":
                shown = [str(_DTYPES[v]) if v < len(_DTYPES) else "another dtype" for v in shown]
            raise ValueError(f"the pipeline ranks called the schedule with different {name}: {shown} (index = "
                             f"pipeline rank); every pipeline rank must pass the same {name}")


_ERROR_BYTES = 1024
_SHARED_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError}


def _raise_shared(comm, error, rejected: list) -> None:
    """Some pipeline ranks rejected the call: gather their messages (a second small collective, only on this error
    path) so that every rank raises the first rejecting rank's error -- same type, same field / value / fix -- and
    the log of every rank shows the cause."""
    text = "" if error is None else f"{type(error).__name__}\0{error}"
    data = text.encode("utf-8", "replace")[:_ERROR_BYTES]
    buf = torch.zeros(_ERROR_BYTES, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(comm.device)
    gathered = [torch.empty_like(buf) for _ in range(comm.size)]
    dist.all_gather(gathered, buf, group=comm.pp_group)
    if error is not None:
        raise error
    first = rejected[0]
    raw = bytes(gathered[first].cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")
    kind, _, message = raw.partition("\0")
    others = f" (and pipeline rank(s) {rejected[1:]})" if len(rejected) > 1 else ""
    raise _SHARED_TYPES.get(kind, RuntimeError)(
        f"{message} [raised on pipeline rank {first}{others}; pipeline rank {comm.rank} stops too instead of "
        f"waiting for it]")


def _run_schedule(schedule, *, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                  micro_batch_size, decoder_seq_length=None, forward_only=False, collect_non_loss_data=False,
                  first_val_step=None, adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
                  force_all_reduce=False, plan: Optional[Plan] = None, agreement=None):
    """Validate (locally, then agreed across the pipeline), build the plan, run the executor.  ``agreement``: a
    :class:`PipelineSchedule` whose agreed fingerprints let a call seen before skip the agreement."""
    comm, pgc = _resolve_groups(schedule, p2p_communicator, pg_collection)
    error, call = None, None
    try:
        call = _prepare(schedule, data_iterator=data_iterator, model=model, num_microbatches=num_microbatches,
                        seq_length=seq_length, micro_batch_size=micro_batch_size,
                        decoder_seq_length=decoder_seq_length, forward_only=forward_only,
                        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, comm=comm, pgc=pgc,
                        chunks=None if plan is None else plan.num_model_chunks)
        if plan is not None:
            _check_plan(plan, call, num_microbatches, forward_only)
    except (ValueError, TypeError, RuntimeError, AssertionError, AttributeError) as exc:
        error = exc
    if _local(schedule):
        if error is not None:
            raise error
    else:
        fingerprint = None if error is not None else _fingerprint(call, schedule, num_microbatches, forward_only)
        if agreement is None or fingerprint is None or tuple(fingerprint) not in agreement.agreed:
            agree_comm = comm or (call.comm if call is not None else _communicator(pgc.pp, None))
            _agree(agree_comm, error, fingerprint)
            if agreement is not None:
                agreement.agreed.add(tuple(fingerprint))
    if not forward_only and call.config.finalize_model_grads_func is None:
        warn_unsynced_tied_weights(call.models)
    return execute(_program(call, schedule, num_microbatches, forward_only, plan),
                   _context(call, schedule, forward_step_func, num_microbatches, micro_batch_size,
                            collect_non_loss_data, first_val_step, force_all_reduce, forward_only, plan))


def _program(call, schedule, num_microbatches, forward_only, plan):
    """The rank's compiled program of ``plan``, or (a Megatron function's call) of the plan its registry entry
    builds for the call's sizes."""
    config, comm = call.config, call.comm
    pp_size, rank = (1, 0) if comm is None else (comm.size, comm.rank)
    prefetch, batched = default_prefetch(config, comm), bool(config.batch_p2p_comm)
    overlap = bool(getattr(config, "overlap_moe_expert_parallel_comm", False)) and not forward_only
    if plan is None:
        group = call.group if "group_size" in schedule.options else None
        options = {"overlap_moe_expert_parallel_comm": True} if overlap else {}
        plan = _resolved(schedule, pp_size, len(call.models), group, **options).plan(num_microbatches,
                                                                                      bool(forward_only))
    return program_for(plan, rank, prefetch, batched, overlap)


@functools.lru_cache(maxsize=64)
def _resolved(spec: ScheduleSpec, pp_size: int, num_model_chunks: int, group_size=None,
              overlap_moe_expert_parallel_comm=None) -> ResolvedSchedule:
    """The resolution of a Megatron function's call (kept: it caches its plans)."""
    return ResolvedSchedule(spec, pp_size, num_model_chunks, group_size,
                            overlap_moe_expert_parallel_comm=overlap_moe_expert_parallel_comm)


def _context(call, schedule, forward_step_func, num_microbatches, micro_batch_size, collect_non_loss_data,
             first_val_step, force_all_reduce, forward_only, plan) -> ExecutionContext:
    config, comm, pgc = call.config, call.comm, call.pgc
    before_finalize = None
    multi = len(call.models) > 1 or _interleaved(schedule)
    if not _local(schedule) and not forward_only and config.finalize_model_grads_func is not None:
        last = (is_pp_last_stage(comm.pp_group) if plan is None else
                any(plan.is_last_stage(comm.rank, c) for c in range(plan.num_model_chunks)))
        embedding_module = clear_embedding_activation_buffer(config, call.models if multi else call.models[0], last)

        def before_finalize():
            finish_embedding_wgrad_compute(config, embedding_module, last, pgc.tp)
    return ExecutionContext(
        forward_step_func=forward_step_func, data_iterators=call.iters, models=call.models, config=config,
        communicator=comm if comm is not None else _LocalComm(config), num_microbatches=num_microbatches,
        act_shape=call.act_shape, grad_shape=call.grad_shape, collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step, cp_group_size=group_size(pgc.cp), vp_stages=multi,
        per_stage_last=not _local(schedule), checkpoint=not _local(schedule), pg_collection=pgc,
        force_all_reduce=force_all_reduce, micro_batch_size=micro_batch_size,
        finalize_models=list(call.models) if multi else [call.models[0]],
        before_finalize=before_finalize, chunk_hooks=call.hooks)


def _check_plan(plan: Plan, call, num_microbatches, forward_only) -> None:
    """A plan handed to :func:`forward_backward_pipelining_with_schedule` must fit the call."""
    size = 1 if call.comm is None else call.comm.size
    for name, want, got in (("pp_size", size, plan.pp_size), ("num_microbatches", num_microbatches,
                                                               plan.num_microbatches),
                            ("forward_only", bool(forward_only), plan.forward_only)):
        if want != got:
            raise ValueError(f"forward_backward_pipelining_with_schedule: plan.{name}={got} but the call has "
                             f"{name}={want}; build the plan for this call (engine.plan.build_plan)")


class _LocalComm:
    """The communicator of a one-rank schedule: no peers, CPU / current-device token counter."""

    size, rank, pp_group = 1, 0, None
    negotiates_shapes = False

    def __init__(self, config):
        self.config = config
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches: int,
                                   seq_length: int, micro_batch_size: int, decoder_seq_length=None,
                                   forward_only: bool = False, collect_non_loss_data: bool = False,
                                   first_val_step=None, adjust_tensor_shapes_fn=None, pg_collection=None,
                                   force_all_reduce: bool = False, p2p_communicator=None) -> list:
    """Run ``num_microbatches`` forward (and backward) passes of one model chunk, no pipeline.

    ``model`` / ``data_iterator`` may be one-element lists.  Every microbatch but the last runs inside
    ``config.no_sync_func``; ``finalize_model_grads_func`` runs at the end of training calls.  ``seq_length``,
    ``micro_batch_size``, ``decoder_seq_length`` and ``p2p_communicator`` are unused.

    Returns ``forward_data_store``: the reduced value of each microbatch's loss function, in microbatch
    order.  Raises ``ValueError`` / ``TypeError`` (``ScheduleContractError`` where Megatron asserts) before running.
    """
    return _run_schedule(_entry_of(_NO_PIPELINING_FN), forward_step_func=forward_step_func, data_iterator=data_iterator,
                         model=model, num_microbatches=num_microbatches, seq_length=seq_length,
                         micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                         forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                         first_val_step=first_val_step, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
                         pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def forward_backward_pipelining_without_interleaving(*, forward_step_func, data_iterator, model,
                                                     num_microbatches: int, seq_length: int, micro_batch_size: int,
                                                     decoder_seq_length=None, forward_only: bool = False,
                                                     collect_non_loss_data: bool = False, first_val_step=None,
                                                     adjust_tensor_shapes_fn=None, p2p_communicator=None,
                                                     pg_collection=None, force_all_reduce: bool = False) -> list:
    """Non-interleaved 1F1B (PipeDream-flush) over the pipeline group: one model chunk per rank (Narayanan et al., SC'21).

    Rank ``r`` runs ``min(P-r-1, M)`` warmup forwards, then one forward / one backward per step, then the remaining
    backwards.  P2P tensors are ``[s, b, h]`` with ``s = (decoder_seq_length or seq_length) // cp``
    (``get_tensor_shapes``, optionally changed by ``adjust_tensor_shapes_fn``), in ``config.pipeline_dtype``.

    Returns the loss stage's ``forward_data_store`` (``[]`` on other ranks).  Raises ``ValueError`` for
    ``config.overlap_p2p_comm`` and for ``p2p_communicator`` without ``pg_collection`` (or the reverse), plus the
    checks listed in the module docstring -- on every pipeline rank, before any pipeline communication.
    """
    return _run_schedule(_entry_of(_ONE_F_ONE_B_FN), forward_step_func=forward_step_func, data_iterator=data_iterator,
                         model=model, num_microbatches=num_microbatches, seq_length=seq_length,
                         micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                         forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                         first_val_step=first_val_step, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
                         p2p_communicator=p2p_communicator, pg_collection=pg_collection,
                         force_all_reduce=force_all_reduce)


def forward_backward_pipelining_with_interleaving(*, forward_step_func, data_iterator, model,
                                                  num_microbatches: int, seq_length: int, micro_batch_size: int,
                                                  decoder_seq_length=None, forward_only: bool = False,
                                                  collect_non_loss_data: bool = False, first_val_step=None,
                                                  adjust_tensor_shapes_fn=None, p2p_communicator=None,
                                                  pg_collection=None, force_all_reduce: bool = False) -> list:
    """Interleaved 1F1B: ``len(model)`` model chunks per rank (virtual pipeline stages; Narayanan et al., SC'21).

    ``model`` and ``data_iterator`` are lists, one entry per chunk (``data_iterator=None`` is accepted for ranks that
    read no data).  Forward order per rank = ``get_schedule_table(M, C, G)`` with ``G =
    config.microbatch_group_size_per_vp_stage``; warmup ``min(M*C, 2(P-r-1) + (C-1)G)``.  P2P tensors are
    ``[seq_length // cp, micro_batch_size, hidden_size]``.

    Returns the loss stage's ``forward_data_store`` (chunk ``C-1`` of the last rank; ``[]`` elsewhere).
    Raises, on every pipeline rank before any pipeline communication: ``ValueError`` for
    ``overlap_p2p_comm`` with ``batch_p2p_comm``, for ``G`` outside ``[P, M]``, for ``P < 2``;
    ``RuntimeError`` for ``0 < M mod G < P`` (Megatron-Core's checks, in that order), plus the pipecast checks.
    """
    return _run_schedule(_entry_of(_INTERLEAVED_FN), forward_step_func=forward_step_func, data_iterator=data_iterator,
                         model=model, num_microbatches=num_microbatches, seq_length=seq_length,
                         micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                         forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                         first_val_step=first_val_step, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
                         p2p_communicator=p2p_communicator, pg_collection=pg_collection,
                         force_all_reduce=force_all_reduce)


def forward_backward_pipelining_with_schedule(*, schedule="zb_h1", forward_step_func, data_iterator, model,
                                             num_microbatches: int, seq_length: int, micro_batch_size: int,
                                             decoder_seq_length=None, forward_only: bool = False,
                                             collect_non_loss_data: bool = False, first_val_step=None,
                                             adjust_tensor_shapes_fn=None, p2p_communicator=None,
                                             pg_collection=None, force_all_reduce: bool = False) -> list:
    """Run any pipecast schedule -- by name, or a :class:`~engine.plan.build.Plan` -- with the keyword arguments
    and loss contract of Megatron's schedule functions.

    ``schedule``: a registered schedule's name (:func:`engine.plan.schedule_names`; a schedule with a Megatron
    function runs through that function), or a plan built for this pipeline size (a plan of a registered
    schedule stands for its schedule: the plan its resolution, :class:`engine.plan.resolve.ResolvedSchedule`,
    gives for this call's ``num_microbatches`` and ``forward_only`` runs when they differ; other plans, e.g.
    imported from CSV, must match the call).  Built-in split-backward schedules: ``"zb_h1"`` (one chunk per rank),
    ``"zbv"`` (V placement: model chunk 0 of rank ``r`` is stage ``r``, chunk 1 is stage ``2P-1-r``), ``"zb"``.  ``model`` /
    ``data_iterator``: one entry per model chunk of the plan (a single module is accepted for one chunk).  P2P
    tensors are ``[s, b, h]`` in ``config.pipeline_dtype``.  Split-backward schedules run ``B`` (input gradient)
    and ``W`` (weight gradient) separately; each chunk's ``W`` passes run in microbatch order, so the gradients
    equal 1F1B's (see ``engine.runtime.split_backward`` for what is held until ``W``); ``no_sync_func`` is left
    and ``grad_sync_func`` called around each chunk's last ``W``.

    Returns the loss stage's ``forward_data_store`` (``[]`` elsewhere).  Raises ``ValueError`` for an unknown
    schedule or a plan that does not fit the call, plus the checks of the Megatron schedule functions -- on every
    pipeline rank, before any pipeline communication.
    """
    if isinstance(schedule, Plan):
        plan, spec = _plan_for_call(schedule, num_microbatches, forward_only)
    else:
        try:
            spec = get_schedule(schedule)
        except ValueError as exc:
            raise ValueError(f"{_WITH_SCHEDULE_FN}: {exc}") from None
        if spec.megatron_function is not None:
            func = _BY_NAME[spec.megatron_function]
            return func(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                        decoder_seq_length=decoder_seq_length, forward_only=forward_only,
                        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
                        pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        chunks = spec.chunks or (len(model) if isinstance(model, list) else 1)
        plan = _cached_plan(spec, _pipeline_size(p2p_communicator), num_microbatches, chunks, bool(forward_only))
    return _run_schedule(spec, forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                         num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                         decoder_seq_length=decoder_seq_length, forward_only=forward_only,
                         collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                         adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
                         pg_collection=pg_collection, force_all_reduce=force_all_reduce, plan=plan)


def _pipeline_size(p2p_communicator) -> int:
    if p2p_communicator is not None:
        return p2p_communicator.pp_group.size()
    from . import parallel_state as ps
    return ps.get_pipeline_model_parallel_world_size()


def _cached_plan(spec, pp_size, num_microbatches, num_model_chunks, forward_only) -> Plan:
    """The plan of a named schedule for a call, through its (kept) resolution."""
    try:
        spec.check(pp_size, num_model_chunks)
        return _resolved(spec, pp_size, num_model_chunks).plan(num_microbatches, forward_only)
    except ValueError as exc:
        raise ValueError(f"{_WITH_SCHEDULE_FN}: {exc}") from None


_IMPORTED = ScheduleSpec("imported", lambda *a, **k: None, chunks=None)
"""Stands for a plan of no registered schedule (e.g. imported from CSV): a pipelined schedule of any chunk count."""


def _plan_for_call(plan: Plan, num_microbatches, forward_only):
    """``(plan, entry)`` for a plan handed to :func:`forward_backward_pipelining_with_schedule`: a plan of a
    registered schedule stands for that schedule -- the plan its resolution gives for this call's microbatches and
    forward-only flag (evaluation and sampling run other counts than the training step); any other plan runs as
    given (it must fit the call)."""
    resolution = ResolvedSchedule.of_plan(plan)
    if resolution is None:
        return plan, _IMPORTED
    if (plan.forward_only, plan.num_microbatches) != (bool(forward_only), num_microbatches):
        try:
            plan = resolution.plan(num_microbatches, bool(forward_only))
        except ValueError as exc:
            raise ValueError(f"{_WITH_SCHEDULE_FN}: {exc}") from None
    return plan, resolution.spec


class PipelineSchedule:
    """A schedule bound once to a run's model chunks and groups, called every step like
    :func:`forward_backward_pipelining_with_schedule` (torchtitan's "build one schedule object, then only step it").

    Args:
        schedule: a :class:`~engine.plan.resolve.ResolvedSchedule` (a run's one resolution: each call runs its plan
            for the call's ``num_microbatches`` and ``forward_only``), a registered schedule's name (resolved here
            for this pipeline and ``len(model)`` chunks), or a :class:`~engine.plan.types.Plan` (one of a
            registered schedule stands for its resolution; any other must fit every call).
        model, pg_collection, p2p_communicator: as for :func:`forward_backward_pipelining_with_schedule`, fixed for
            every call.

    :meth:`forward_backward` runs every local check of the call each time (argument types, model list, data
    iterators, P2P modes, shapes, the plan that fits: no communication, no host synchronisation), but the
    all-gather by which the pipeline ranks agree on the call and share a rejection runs only when the call's
    fingerprint (schedule, ``num_microbatches``, ``forward_only``, model chunks, group size, variable sequence
    lengths, activation and gradient shapes, ``pipeline_dtype``) is one they have not agreed on before: at the
    first call of each set of sizes (the first training step, the first evaluation with another microbatch count,
    the first sampling call with ``micro_batch_size=1``), not at every step nor at every return to sizes seen
    before (a training step after an evaluation).  :attr:`agreed` is the set of those fingerprints (tuples of
    ints; empty before the first agreement).

    Contract, as for any collective: every pipeline rank makes the same sequence of calls, so a change of sizes
    reaches all ranks at the same call.  A rejection raised on some ranks is still raised on every rank when the
    call changes the fingerprint on all of them; a rank whose call alone changed (or alone was rejected) is not
    seen by peers that skip the agreement, and both sides stop at the communication timeout instead.

    Raises (construction): ``ValueError`` for an unknown schedule or sizes it does not take.
    """

    def __init__(self, schedule, *, model, pg_collection=None, p2p_communicator=None):
        self.model, self.pg_collection, self.p2p_communicator = model, pg_collection, p2p_communicator
        self.resolution, self._fixed_plan = _bind_schedule(schedule, model, p2p_communicator)
        self.agreed: set[tuple[int, ...]] = set()

    def plan(self, num_microbatches: int, forward_only: bool = False) -> Plan:
        """The plan a call with these sizes runs (built once per sizes by the resolution)."""
        if self.resolution is None:
            return self._fixed_plan
        try:
            return self.resolution.plan(num_microbatches, bool(forward_only))
        except ValueError as exc:
            raise ValueError(f"{_WITH_SCHEDULE_FN}: {exc}") from None

    def forward_backward(self, *, forward_step_func, data_iterator, num_microbatches: int, seq_length: int,
                         micro_batch_size: int, decoder_seq_length=None, forward_only: bool = False,
                         collect_non_loss_data: bool = False, first_val_step=None, adjust_tensor_shapes_fn=None,
                         force_all_reduce: bool = False) -> list:
        """One schedule call (the keyword arguments and result of
        :func:`forward_backward_pipelining_with_schedule`); see the class docstring for when ranks agree."""
        _check_microbatches(num_microbatches)
        plan = self.plan(num_microbatches, forward_only)
        spec = self.resolution.spec if self.resolution is not None else _IMPORTED
        return _run_schedule(spec, forward_step_func=forward_step_func, data_iterator=data_iterator,
                             model=self.model, num_microbatches=num_microbatches, seq_length=seq_length,
                             micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                             forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                             first_val_step=first_val_step, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
                             p2p_communicator=self.p2p_communicator, pg_collection=self.pg_collection,
                             force_all_reduce=force_all_reduce, plan=plan, agreement=self)


def _bind_schedule(schedule, model, p2p_communicator) -> tuple[Optional[ResolvedSchedule], Optional[Plan]]:
    """``(resolution, None)``, or ``(None, plan)`` for a plan of no registered schedule."""
    if isinstance(schedule, ResolvedSchedule):
        return schedule, None
    if isinstance(schedule, Plan):
        resolution = ResolvedSchedule.of_plan(schedule)
        return (resolution, None) if resolution is not None else (None, schedule)
    try:
        spec = get_schedule(schedule)
        models = model if isinstance(model, list) else [model]
        chunks = spec.chunks or len(models)
        group = get_model_config(models[0]).microbatch_group_size_per_vp_stage \
            if "group_size" in spec.options else None
        spec.check(_pipeline_size(p2p_communicator), chunks)
        return _resolved(spec, _pipeline_size(p2p_communicator), chunks, group), None
    except ValueError as exc:
        raise ValueError(f"PipelineSchedule: {exc}") from None


_BY_NAME = {
    "forward_backward_no_pipelining": forward_backward_no_pipelining,
    "forward_backward_pipelining_without_interleaving": forward_backward_pipelining_without_interleaving,
    "forward_backward_pipelining_with_interleaving": forward_backward_pipelining_with_interleaving,
}


def get_forward_backward_func(pp_size=None, vp_size=None):
    """The schedule function for a pipeline of ``pp_size`` ranks with ``vp_size`` model chunks each.

    Both None: read from ``engine.parallel_state``.  ``pp_size > 1``: interleaved iff ``vp_size is not None`` (even
    1), else non-interleaved 1F1B; otherwise no pipelining.  Raises ``TypeError`` for ``pp_size=None`` with a
    ``vp_size``.  Every returned function takes the keyword-only arguments of Megatron's schedule functions.
    """
    return _BY_NAME[select_schedule_name(pp_size, vp_size)]


def select_schedule_name(pp_size: Optional[int] = None, vp_size: Optional[int] = None) -> str:
    """Name of the schedule function ``get_forward_backward_func(pp_size, vp_size)`` returns.

    Both None: read the pipeline and virtual pipeline sizes from ``engine.parallel_state``; one None: used as
    given (:func:`engine.plan.registry.auto_schedule`).  Raises ``TypeError`` for ``pp_size=None`` with a
    ``vp_size`` (as Megatron's ``None > 1`` does).
    """
    if pp_size is None and vp_size is None:
        from . import parallel_state as ps
        pp_size = ps.get_pipeline_model_parallel_world_size()
        vp_size = ps.get_virtual_pipeline_model_parallel_world_size()
    if pp_size is None:
        raise TypeError(f"get_forward_backward_func(pp_size=None, vp_size={vp_size}): pass pp_size as well, or "
                        "neither to read both from engine.parallel_state")
    return get_schedule(auto_schedule(pp_size, vp_size)).megatron_function


__all__ = ["get_forward_backward_func", "forward_backward_no_pipelining", "forward_backward_pipelining_with_schedule",
           "PipelineSchedule",
           "forward_backward_pipelining_without_interleaving", "forward_backward_pipelining_with_interleaving",
           "P2PCommunicator", "get_pp_rank_microbatches", "get_schedule_table", "convert_schedule_table_to_order",
           # per-microbatch functions (engine/microbatch.py, engine/runtime/step.py)
           "deallocate_output_tensor", "custom_backward", "set_current_microbatch", "forward_step_calc_loss",
           "forward_step", "backward_step", "check_first_val_step", "clear_embedding_activation_buffer",
           "finish_embedding_wgrad_compute", "get_tensor_shapes", "get_model_config", "get_attr_wrapped_model"]
