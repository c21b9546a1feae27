"""The ``parallel`` section of a run against the model, the schedule and the world: sizes, the schedule's options,
sharding, tensor and sequence parallelism, every plan the run builds (built and validated before any rank starts)
and the world size.  Pure (no torch, no communication); part of :func:`engine.training.config.validate`.
"""
from __future__ import annotations

import dataclasses

from ...plan.pass_costs import PassCosts
from ...plan.registry import get_schedule
from ...plan.table import validate_interleaved_microbatches
from ...plan.types import placement_of
from ..models import get_family
from .errors import ConfigError
from .schema import TrainConfig, schedules_taking

__all__ = ["validate_parallel", "validate_tensor_parallel", "validate_expert_parallel", "has_overlap_cells",
           "run_plans", "validate_plans", "validate_world_size"]


def _validate_schedule(config: TrainConfig) -> None:
    """``parallel.schedule`` against the pipeline / virtual sizes and the options its registry entry takes
    (``tuned`` is checked when it is resolved, :func:`engine.training.tune.result.resolve_tuned`)."""
    p = config.parallel
    if p.schedule == "tuned":
        _validate_shard(config)
        return
    spec = get_schedule(config.schedule_name)
    if p.max_in_flight is not None and "max_in_flight" not in spec.options:
        raise ConfigError(f"parallel.max_in_flight={p.max_in_flight} only applies to parallel.schedule="
                          f"{schedules_taking('max_in_flight')} (got parallel.schedule={p.schedule}); remove it or set "
                          f"parallel.schedule={schedules_taking('max_in_flight')}")
    _validate_costs(p, spec)
    why = spec.fits(p.pipeline, p.virtual)
    if why is not None:
        picked = f" (Megatron's choice: {spec.name})" if p.schedule == "auto" else ""
        hint = ("; parallel.virtual > 1 needs parallel.pipeline >= 2 (interleaved 1F1B runs on at least two "
                "pipeline ranks): set parallel.virtual=1 or parallel.pipeline >= 2") if p.schedule == "auto" else ""
        raise ConfigError(f"parallel.schedule={p.schedule}{picked} does not fit parallel.pipeline={p.pipeline}, "
                          f"parallel.virtual={p.virtual}: {why}{hint}")
    if spec.splits_backward and config.cuda_graphs.enabled and config.cuda_graphs.backend == "te":
        raise ConfigError(f"parallel.schedule={p.schedule} (split backward) with cuda_graphs.backend=te: Transformer "
                          "Engine's capture has no weight-gradient (W) graphs for these layers; set "
                          "cuda_graphs.backend=torch (pipecast's capture: F, B and W graphs) or auto")
    _refuse_te_layers_with_split(config, spec)
    if p.microbatch_group_size_per_vp_stage is not None and "group_size" not in spec.options:
        raise ConfigError(f"parallel.microbatch_group_size_per_vp_stage={p.microbatch_group_size_per_vp_stage} only "
                          f"applies to parallel.schedule={schedules_taking('group_size')} (interleaved 1F1B), not "
                          f"{spec.name}; remove it or set parallel.virtual >= 2")
    _validate_shard(config, spec)
    if p.overlap_p2p_comm and not spec.overlap_p2p:
        raise ConfigError(f"parallel.overlap_p2p_comm=true is not supported by {spec.name} (as in Megatron-Core's "
                          "1F1B); set parallel.virtual >= 2 or parallel.overlap_p2p_comm=false")


def _validate_costs(p, spec) -> None:
    """``parallel.schedule_costs``: for a schedule that takes costs, in :class:`~engine.plan.pass_costs.PassCosts`'
    notation, one number or one per rank and chunk."""
    if p.schedule_costs is None:
        return
    if "costs" not in spec.options:
        raise ConfigError(f"parallel.schedule_costs={p.schedule_costs!r} only applies to parallel.schedule="
                          f"{schedules_taking('costs')} (got parallel.schedule={p.schedule}); remove it or set "
                          f"parallel.schedule={schedules_taking('costs')}")
    try:
        costs = PassCosts.parse(p.schedule_costs)
        for name in ("forward", "backward", "weight", "weight_memory"):
            costs.table(name, p.pipeline, p.virtual)
    except ValueError as exc:
        raise ConfigError(f"parallel.schedule_costs={p.schedule_costs!r} is invalid: {exc}") from None


def _refuse_te_layers_with_split(config: TrainConfig, spec) -> None:
    """Transformer Engine layers under a split-backward schedule are refused.

    The split W re-runs a node's backward after B (``engine.runtime.split_backward``, ``graphs.backends.split``),
    while TE's backward functions free the tensors they saved once they ran, so W would read cleared tensors.
    TE's own deferral (modules built with ``delay_wgrad_compute=True`` and their ``backward_dw()``) is not wired
    into pipecast's W pass, so the combination is refused here, before any rank starts.

    Raises:
        ConfigError: ``model.transformer_engine=true`` with a ``parallel.schedule`` whose registry entry splits the
            backward (``zb_h1``, ``zbv``, ...).
    """
    if config.model.transformer_engine and spec.splits_backward:
        raise ConfigError(
            f"model.transformer_engine=true with parallel.schedule={config.parallel.schedule} (split backward, "
            f"{spec.name}): the W pass re-runs a layer's backward after B, but Transformer Engine's backward frees "
            f"the tensors it saved, so W would read cleared tensors -- set model.transformer_engine=false (torch "
            f"layers, which split correctly) or use a schedule without split backward (parallel.schedule=1f1b, "
            f"interleaved or auto)")


def validate_parallel(config: TrainConfig) -> None:
    """The ``parallel`` section against the model and schedule sizes (part of :func:`validate`): the pipeline
    layout (``model.pipeline_layout`` or the even split, :attr:`~.schema.TrainConfig.layout`) fits
    ``parallel.pipeline x parallel.virtual`` stages and ``model.num_layers``."""
    p, s = config.parallel, config.training
    validate_tensor_parallel(config)
    validate_expert_parallel(config)
    _validate_schedule(config)
    if p.schedule != "tuned":  # tuned's virtual size comes from tune.json: checked once resolved (resolve_tuned)
        config.layout  # noqa: B018 - model.pipeline_layout (or the even split) against the stages: ConfigError
    if p.overlap_p2p_comm and p.batch_p2p_comm:
        raise ConfigError("parallel.overlap_p2p_comm=true needs parallel.batch_p2p_comm=false (Megatron: the two "
                          "are mutually exclusive)")
    if p.schedule != "tuned" and "group_size" in get_schedule(config.schedule_name).options:
        group = p.microbatch_group_size_per_vp_stage or p.pipeline
        if p.microbatch_group_size_per_vp_stage is not None:  # the field the user set is named first
            for count in (s.num_microbatches, config.eval_microbatches):
                if not p.pipeline <= group <= count:
                    raise ConfigError(
                        f"parallel.microbatch_group_size_per_vp_stage={group} is invalid for interleaved 1F1B "
                        f"(parallel.pipeline={p.pipeline}, training.num_microbatches={s.num_microbatches}, "
                        f"eval microbatches={config.eval_microbatches}): it must be in [parallel.pipeline, "
                        f"num_microbatches] = [{p.pipeline}, {count}]; set it in that range or remove it (default: "
                        f"parallel.pipeline)")
        for where, count in [("training.num_microbatches", s.num_microbatches),
                             ("training.eval_microbatches", config.eval_microbatches)]:
            try:
                validate_interleaved_microbatches(count, p.pipeline, group)
            except (ValueError, RuntimeError) as exc:
                raise type(exc)(f"{where}={count} is invalid for interleaved 1F1B "
                                f"(parallel.pipeline={p.pipeline}, parallel.virtual={p.virtual}): {exc}") from None
    if p.device == "cpu" and p.backend == "nccl":
        raise ConfigError("parallel.backend='nccl' needs CUDA; use parallel.backend=gloo (or auto) with "
                          "parallel.device=cpu")
    validate_plans(config)


def run_plans(config: TrainConfig) -> list[tuple[str, int, bool]]:
    """``(what, num_microbatches, forward_only)`` of every plan a run of ``config`` builds: the training step
    (``training.num_microbatches``), evaluation's forward-only plan (``training.eval_microbatches``) and, when
    ``logging.sample_every_eval`` asks for samples, sampling's forward-only plan (one microbatch; a whole group
    for schedules that group microbatches, see :meth:`engine.training.trainer.Trainer.sample`)."""
    s, p = config.training, config.parallel
    plans = [("training.num_microbatches", s.num_microbatches, False),
             ("training.eval_microbatches", config.eval_microbatches, True)]
    if config.logging.sample_every_eval:
        grouped = "group_size" in get_schedule(config.schedule_name).options
        plans.append(("logging.sample_every_eval", (p.microbatch_group_size_per_vp_stage or p.pipeline)
                      if grouped else 1, True))
    return plans


def validate_plans(config: TrainConfig) -> None:
    """Build and validate (:meth:`~engine.plan.resolve.ResolvedSchedule.checked_plan`) every plan of
    :func:`run_plans` before any rank starts, so that a schedule that cannot run (e.g. ``parallel.schedule=zb``
    with a ``parallel.max_in_flight`` too small for the placement: the builder's list scheduler gets stuck) is
    refused here, naming the field and the smallest ``max_in_flight`` that works.  ``tuned`` is checked once it
    is resolved.  Pure (no torch); a few milliseconds for the sizes of a config.

    Raises:
        ConfigError: naming the field, its value and the fix.
    """
    p = config.parallel
    if p.schedule == "tuned":
        return
    resolved = config.resolve_schedule()
    for where, count, forward_only in run_plans(config):
        try:
            resolved.checked_plan(count, forward_only)
        except (ValueError, RuntimeError) as exc:
            sizes = (f"parallel.schedule={config.schedule_name}, parallel.pipeline={p.pipeline}, parallel.virtual="
                     f"{p.virtual}, {count} microbatches")
            if p.max_in_flight is not None and not forward_only:
                least = resolved.smallest_max_in_flight(count)
                fix = (f"use parallel.max_in_flight >= {least} (the smallest that gives a valid plan) or remove it "
                       f"(1F1B's limit)") if least is not None else "remove parallel.max_in_flight (1F1B's limit)"
                raise ConfigError(f"parallel.max_in_flight={p.max_in_flight} is too small for {sizes}: the plan "
                                  f"cannot be built ({exc}); {fix}") from None
            if where == "logging.sample_every_eval":
                raise ConfigError(f"logging.sample_every_eval={config.logging.sample_every_eval}: sampling's "
                                  f"forward-only plan cannot be built for {sizes}: {exc}; set "
                                  f"logging.sample_every_eval=0 or change parallel.schedule") from None
            what = "evaluation" if forward_only else "the training step"
            raise ConfigError(f"{where}={count}: the plan of {what} cannot be built for {sizes}: {exc}; change "
                              f"{where} or parallel.schedule") from None


def _validate_shard(config: TrainConfig, spec=None) -> None:
    """``parallel.shard`` (every rank, before any collective).  ``optimizer`` (ZeRO-1) and ``full`` (FSDP2 per
    model chunk) with ``parallel.data = 1`` run as ``none`` (one shard is the whole state).

    Raises:
        ConfigError: an unknown value; ``optimizer`` / ``full`` with ``parallel.tensor > 1``; ``full`` with
            ``cuda_graphs.enabled`` or with tied embeddings whose two ends the placement puts on one rank (a V
            placement; any placement of several chunks on one pipeline rank) (``spec``: the schedule's
            registry entry, None for ``tuned``: the trainer checks the resolved one).
    """
    shard, p = config.parallel.shard, config.parallel
    if shard not in ("none", "optimizer", "full"):
        raise ConfigError(f"parallel.shard={shard!r} is not one of none, optimizer, full")
    if shard != "none" and p.tensor > 1:
        why = ("the sharded optimizer flattens plain tensors, not DTensor shards" if shard == "optimizer" else
               "fully_shard over the data-parallel dimension of tensor-parallel DTensors is not wired")
        raise ConfigError(f"parallel.shard={shard} with parallel.tensor={p.tensor} is not available in this version "
                          f"({why}); use parallel.shard=none with tensor parallelism, or parallel.tensor=1")
    if shard != "full":
        return
    if config.cuda_graphs.enabled:
        raise ConfigError("parallel.shard=full with cuda_graphs.enabled=true is refused: FSDP2 (fully_shard) "
                          "all-gathers each model chunk's parameters into storage it frees again after the backward "
                          "and allocates anew at the next step (another address) and swaps the modules' parameters "
                          "between the shards and the gathered copies, while a captured graph keeps reading the "
                          "addresses of its capture; use parallel.shard=optimizer (ZeRO-1: parameters whole and in "
                          "place, optimizer state sharded) or parallel.shard=none with CUDA graphs, or "
                          "cuda_graphs.enabled=false to keep parallel.shard=full")
    stages = () if spec is None else placement_of(spec.placement, p.pipeline, p.virtual)
    if config.model.tie_embeddings and len(stages) > 1 and stages[0][0] == stages[-1][0]:
        raise ConfigError(f"parallel.shard=full with parallel.schedule={p.schedule} ({spec.name}, {spec.placement} "
                          f"placement) at parallel.pipeline={p.pipeline}, parallel.virtual={p.virtual} and "
                          "model.tie_embeddings=true: the first and the last stage are two chunks of one rank sharing "
                          "one Parameter, which two fully_shard units cannot share; use a looped schedule (1f1b, "
                          "interleaved, zb_h1) on parallel.pipeline >= 2, model.tie_embeddings=false, or "
                          "parallel.shard=optimizer")


def validate_expert_parallel(config: TrainConfig) -> None:
    """``parallel.expert`` and ``parallel.overlap_moe_expert_parallel_comm`` against the model and the layout
    (every rank, before any collective; the layers: :mod:`engine.moe`, the parallelism:
    :mod:`engine.training.parallel.parallelism`).

    Raises:
        ConfigError: experts without ``model.moe``; ``E`` not dividing ``model.moe.num_experts`` or
            ``parallel.data``; ``model.moe`` with ``parallel.tensor > 1`` not dividing ``model.seq_length``, or
            with a capacity factor, or (``E > 1``) without sequence parallelism; ``model.moe`` with CUDA graphs;
            the overlap without ``model.moe`` or with a schedule that has no forward-backward cells.  (``E > 1``
            with ``parallel.shard`` optimizer / full is accepted: the routed experts' shards live on the
            expert-data-parallel group, :mod:`engine.training.parallel.zero1`, :mod:`engine.training.parallel.fsdp`.)
    """
    m, p = config.model, config.parallel
    e, moe = p.expert, m.moe
    if e > 1 and moe is None:
        raise ConfigError(f"parallel.expert={e} but model.moe is not set: there are no experts to split; set "
                          f"model.moe (with a family that holds one) or parallel.expert=1")
    if moe is not None and moe.num_experts % e:
        raise ConfigError(f"parallel.expert={e} does not divide model.moe.num_experts={moe.num_experts}: each "
                          f"expert-parallel rank holds num_experts / expert of them; use a divisor of "
                          f"{moe.num_experts}")
    if p.data is not None and p.data % e:
        raise ConfigError(f"parallel.expert={e} does not divide parallel.data={p.data}: the expert-parallel ranks "
                          f"are taken from the data-parallel ones; use a divisor of {p.data} or more data replicas")
    if moe is not None:
        _validate_moe_layout(config)
    _validate_moe_overlap(config)


def _validate_moe_layout(config: TrainConfig) -> None:
    p = config.parallel
    if p.tensor > 1:
        _validate_moe_tensor_parallel(config)
    if config.cuda_graphs.enabled:
        raise ConfigError("model.moe with cuda_graphs.enabled=true is refused: dropless routing sends each expert "
                          "a data-dependent number of tokens (the all-to-all's splits are read on the host every "
                          "step), which a captured graph cannot replay; set cuda_graphs.enabled=false")


def _validate_moe_tensor_parallel(config: TrainConfig) -> None:
    """``model.moe`` with ``parallel.tensor: T > 1``: each tensor-parallel rank routes ``seq_length / T`` tokens
    of the sequence (:meth:`engine.moe.MoELayer.shard_tokens`), so ``T`` divides ``model.seq_length``; no capacity
    (it needs the whole sequence in one place); with ``parallel.expert > 1`` sequence parallelism (Megatron-Core's
    rule).  ``parallel.shard`` other than none is refused for every ``T > 1`` already."""
    m, p = config.model, config.parallel
    if m.seq_length % p.tensor:
        raise ConfigError(f"model.moe with parallel.tensor={p.tensor} does not divide model.seq_length="
                          f"{m.seq_length}: each tensor-parallel rank routes seq_length / tensor tokens of the "
                          f"sequence; choose a seq_length that is a multiple of {p.tensor}")
    if m.moe.capacity_factor is not None:
        raise ConfigError(f"model.moe.capacity_factor={m.moe.capacity_factor} with parallel.tensor={p.tensor}: "
                          "the capacity keeps each expert's earliest tokens of the whole sequence, while each "
                          "tensor-parallel rank routes only its share; set model.moe.capacity_factor=null "
                          "(dropless) or parallel.tensor=1")
    if p.expert > 1 and not p.sequence_parallel:
        raise ConfigError(f"parallel.expert={p.expert} with parallel.tensor={p.tensor} needs "
                          "parallel.sequence_parallel=true (Megatron-Core refuses expert parallelism with tensor "
                          "parallelism without it); set parallel.sequence_parallel=true")


def has_overlap_cells(schedule: str, pipeline: int) -> bool:
    """Whether registered ``schedule`` on ``pipeline`` ranks takes ``overlap_moe_expert_parallel_comm``: it has
    forward-backward cells (Megatron-Core refuses the overlap for 1F1B without virtual stages on several ranks)."""
    spec = get_schedule(schedule)
    return "overlap_moe_expert_parallel_comm" in spec.options and not (spec.name == "1f1b" and pipeline > 1)


def _validate_moe_overlap(config: TrainConfig) -> None:
    """``parallel.overlap_moe_expert_parallel_comm``: a MoE model and a schedule with forward-backward cells
    (Megatron-Core refuses it for 1F1B without virtual stages on several pipeline ranks)."""
    p = config.parallel
    if not p.overlap_moe_expert_parallel_comm:
        return
    takers = schedules_taking("overlap_moe_expert_parallel_comm")
    if config.model.moe is None:
        raise ConfigError("parallel.overlap_moe_expert_parallel_comm=true but model.moe is not set: there is no "
                          "expert all-to-all to overlap; set model.moe or the field to false")
    if p.schedule == "tuned":
        return
    spec = get_schedule(config.schedule_name)
    if not has_overlap_cells(spec.name, p.pipeline):
        why = ("1F1B without virtual stages has no forward-backward cells on several pipeline ranks (Megatron-Core "
               "refuses it too)" if spec.name == "1f1b" else f"{spec.name} has no forward-backward cells")
        named = p.schedule if p.schedule == spec.name else f"{p.schedule} ({spec.name})"
        raise ConfigError(f"parallel.overlap_moe_expert_parallel_comm=true with parallel.schedule={named} at "
                          f"parallel.pipeline={p.pipeline}: {why}; use parallel.schedule=dualpipev, "
                          f"or interleaved (parallel.virtual >= 2) -- the schedules with cells: {takers} -- or set "
                          f"it to false")


def validate_tensor_parallel(config: TrainConfig) -> None:
    """Pure checks of ``parallel.tensor`` (every rank, before any collective; the layers:
    :mod:`engine.training.parallel.tensor_parallel`).

    Raises:
        ConfigError: ``T > 1`` for a family without a tensor-parallel plan; ``T`` not dividing
            ``model.num_attention_heads``, ``model.num_query_groups``, ``model.ffn_hidden_size`` or
            ``model.vocab_size``; ``T > 1`` with ``model.transformer_engine``.  ``cuda_graphs.enabled`` is
            accepted: the graphed layers capture their tensor-parallel collectives.
            Split-backward schedules (``zb_h1``, ``zbv``, ``dualpipev``) are accepted: their W passes issue no
            tensor-parallel collective (:mod:`engine.training.parallel.tensor_parallel`).
    """
    m, t = config.model, config.parallel.tensor
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ConfigError(f"parallel.tensor={t!r} must be an integer >= 1 (tensor-parallel ranks per stage)")
    _validate_sequence_parallel(config)
    if t == 1:
        return
    if not get_family(m.family).tensor_parallel:
        raise ConfigError(f"parallel.tensor={t} with model.family={m.family}: the family gives no tensor-parallel "
                          "plan for its block (FamilySpec.tensor_parallel); set parallel.tensor=1")
    sizes = [("model.num_attention_heads", m.num_attention_heads),
             ("model.num_query_groups", m.num_query_groups or m.num_attention_heads),
             ("model.ffn_hidden_size", config.ffn_hidden_size), ("model.vocab_size", m.vocab_size)]
    for where, value in sizes:
        if value % t:
            fix = (f"round it up to {-(-value // t) * t}" if where == "model.vocab_size" else
                   f"choose parallel.tensor dividing {value}")
            raise ConfigError(f"parallel.tensor={t} does not divide {where}={value}: each tensor-parallel rank holds "
                              f"{where.split('.')[1]} / parallel.tensor of it; {fix}")
    if m.transformer_engine:
        raise ConfigError(f"parallel.tensor={t} with model.transformer_engine=true: Transformer Engine layers "
                          "bring their own tensor parallelism, not wired here; set model.transformer_engine=false")


def _validate_sequence_parallel(config: TrainConfig) -> None:
    """``parallel.sequence_parallel`` needs ``parallel.tensor > 1`` dividing ``model.seq_length`` (each rank holds
    ``seq_length / T`` positions of the residual stream)."""
    sp, t, s = config.parallel.sequence_parallel, config.parallel.tensor, config.model.seq_length
    if not isinstance(sp, bool):
        raise ConfigError(f"parallel.sequence_parallel={sp!r} must be true or false")
    if not sp:
        return
    if t == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor > 1 (it shards the sequence over "
                          "the tensor-parallel ranks), got parallel.tensor=1; set parallel.tensor=2 or more, or "
                          "parallel.sequence_parallel=false")
    if s % t:
        raise ConfigError(f"parallel.sequence_parallel=true with parallel.tensor={t} does not divide "
                          f"model.seq_length={s}: each tensor-parallel rank holds seq_length / tensor positions; "
                          f"choose a seq_length that is a multiple of {t}")


def validate_world_size(config: TrainConfig, world_size: int) -> TrainConfig:
    """Resolve ``parallel.data`` from the job's world size and check ``world = pipeline x data x tensor``.

    Returns the config with ``parallel.data`` filled in.

    Raises:
        ConfigError: the world size is not ``parallel.pipeline x parallel.data x parallel.tensor``.
    """
    p = config.parallel
    if p.tensor > 1:
        return _validate_world_size_tp(config, world_size)
    if world_size % p.pipeline:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.pipeline={p.pipeline}; start "
                          f"a multiple of {p.pipeline} ranks or change parallel.pipeline")
    data = world_size // p.pipeline
    if p.data is not None and p.data != data:
        raise ConfigError(f"world size {world_size} != parallel.pipeline x parallel.data = {p.pipeline} x {p.data}"
                          f" = {p.pipeline * p.data}; start {p.pipeline * p.data} ranks or set parallel.data="
                          f"{data}")
    return _with_data(config, data)


def _with_data(config: TrainConfig, data: int) -> TrainConfig:
    """``config`` with ``parallel.data`` resolved to ``data``, checked against ``parallel.expert``."""
    p = config.parallel
    if data % p.expert:
        raise ConfigError(f"parallel.expert={p.expert} does not divide the data-parallel size {data} (world size / "
                          f"(pipeline x tensor)): the expert-parallel ranks are taken from the data-parallel ones; "
                          f"start more ranks or use a divisor of {data}")
    return dataclasses.replace(config, parallel=dataclasses.replace(p, data=data))


def _validate_world_size_tp(config: TrainConfig, world_size: int) -> TrainConfig:
    """:func:`validate_world_size` with ``parallel.tensor > 1``: ``world = pipeline x data x tensor``."""
    p = config.parallel
    mp = p.pipeline * p.tensor
    if world_size % mp:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.pipeline x parallel.tensor = "
                          f"{p.pipeline} x {p.tensor}; start a multiple of {mp} ranks or change the sizes")
    data = world_size // mp
    if p.data is not None and p.data != data:
        raise ConfigError(f"world size {world_size} != parallel.pipeline x parallel.data x parallel.tensor = "
                          f"{p.pipeline} x {p.data} x {p.tensor} = {mp * p.data}; start {mp * p.data} ranks or set "
                          f"parallel.data={data}")
    return _with_data(config, data)
