"""Building plans: :func:`build_plan` looks the schedule up in the registry and runs its builder.

The plan's types live in :mod:`engine.plan.types` (re-exported here); each schedule's builder in its own module
(:mod:`engine.plan.megatron`, :mod:`engine.plan.zero_bubble`, or a user's module registered with
:func:`engine.plan.register_schedule`); the registry (:mod:`engine.plan.registry`) says which builder a name runs
and what sizes it takes.  Pure: no torch.
"""
from __future__ import annotations

from .megatron import check_positive
from .pass_costs import PassCosts
from .registry import OPTIONS, auto_schedule, get_schedule, schedule_names
from .types import MAX_PLAN_FORWARDS, Action, Message, Op, Placement, Plan, looped_placement, v_placement

__all__ = ["Op", "Action", "Message", "Plan", "Placement", "MAX_PLAN_FORWARDS", "build_plan", "schedule_name",
           "looped_placement", "v_placement"]


def schedule_name(pp_size: int, vp_size: int | None) -> str:
    """The schedule Megatron picks for a topology, as its name (:func:`engine.plan.registry.auto_schedule`)."""
    return auto_schedule(pp_size, vp_size)


def build_plan(schedule, pp_size: int, num_microbatches: int, num_model_chunks: int = 1,
               group_size: int | None = None, forward_only: bool = False, *,
               max_in_flight: int | tuple[int, ...] | None = None, max_pending_w: int | tuple[int, ...] | None = None,
               costs=None, overlap_moe_expert_parallel_comm: bool | None = None) -> Plan:
    """Build the plan of one step for every pipeline rank.

    Args:
        schedule: a registered schedule's name (:func:`engine.plan.registry.schedule_names`; the built-ins:
            ``"no_pipelining"``, ``"1f1b"``, ``"interleaved"``, ``"zb_h1"``, ``"zbv"``, ``"zb"``,
            ``"dualpipev"``) or its :class:`~engine.plan.registry.ScheduleSpec`.
        pp_size: pipeline ranks ``P``.
        num_microbatches: ``M >= 1``.
        num_model_chunks: ``C``, as many as the schedule takes (:attr:`ScheduleSpec.chunks`).
        group_size: ``microbatch_group_size_per_vp_stage``, for schedules that take it (interleaved; default ``P``
            like Megatron); ignored by the others, as Megatron-Core's other schedules ignore it.
        forward_only: evaluation plan, forwards only (the schedule's own placement).
        max_in_flight: for schedules that take it (``"zb"``, ``"zbv"``): per-rank limit on activations held
            (forward done, input-gradient pass not), one number for every rank or one per rank; default ``C*(P -
            r)`` (1F1B's) for ``zb``, ``2P`` for ``zbv``; about ``2P`` gives ZB-H2-like ``zb`` plans.  With
            ``costs`` it also counts each pending ``W`` as ``costs.weight_memory`` of an activation.
        max_pending_w: for the same schedules: per-rank limit on pending weight-gradient passes (default: equal to
            ``max_in_flight``; with ``costs`` whose ``weight_memory`` is above 0, none).
        costs: for the same schedules: a :class:`~engine.plan.pass_costs.PassCosts` (or its notation,
            ``"forward=1 backward=1 weight=0.5 transfer=0.05"``); the plan is then the cost-aware order
            (:mod:`engine.plan.cost_aware`) for them.
        overlap_moe_expert_parallel_comm: for schedules that take it: forward-backward cells that overlap the
            expert all-to-all (``"no_pipelining"`` / ``"interleaved"``: Megatron's combined 1F1B,
            :mod:`engine.plan.megatron`; ``"dualpipev"``: its cells, always there).

    Raises:
        ValueError: unknown schedule, non-positive sizes, ``P * C * M`` above :data:`MAX_PLAN_FORWARDS`, sizes the
            schedule does not take, an option the schedule does not take, bad costs, or what the builder raises
            (e.g. interleaved: a group size outside ``[P, M]``, Megatron's check).
        TypeError: ``costs`` is neither a :class:`~engine.plan.pass_costs.PassCosts` nor a string.
        RuntimeError: (interleaved) ``0 < M mod G < P``, as Megatron raises.
    """
    spec = get_schedule(schedule)
    _check_sizes(pp_size, num_microbatches, num_model_chunks)
    spec.check(pp_size, num_model_chunks)
    given = {"group_size": group_size, "max_in_flight": max_in_flight, "max_pending_w": max_pending_w,
             "costs": PassCosts.of(costs), "overlap_moe_expert_parallel_comm": overlap_moe_expert_parallel_comm or None}
    for option, value in given.items():
        if value is not None and option not in spec.options and option != "group_size":
            takers = [n for n in schedule_names() if option in get_schedule(n).options]
            raise ValueError(f"{option}={value!r} is for schedule={' / '.join(map(repr, takers))} only "
                             f"(schedule={spec.name!r})")
    options = {o: given[o] for o in OPTIONS if o in spec.options}
    return spec.build(pp_size, num_microbatches, num_model_chunks, forward_only, **options)


def _check_sizes(pp_size: int, num_microbatches: int, num_model_chunks: int) -> None:
    check_positive("pp_size", pp_size, "the pipeline needs at least one rank")
    check_positive("num_microbatches", num_microbatches, "a step needs at least one microbatch")
    check_positive("num_model_chunks", num_model_chunks, "each rank holds at least one model chunk")
    forwards = pp_size * num_model_chunks * num_microbatches
    if forwards > MAX_PLAN_FORWARDS:
        raise ValueError(f"pp_size={pp_size} x num_model_chunks={num_model_chunks} x num_microbatches="
                         f"{num_microbatches} = {forwards} forwards per step is more than {MAX_PLAN_FORWARDS} (2**24): "
                         "the plan holds every action in memory (~0.5 KB each); use fewer microbatches per step")
