"""One resolution per run: a schedule with its settings, giving the plan for any microbatch count, cached.

A run's ``parallel.*`` fields (``schedule``, including ``auto``; ``virtual``; ``microbatch_group_size_per_vp_stage``;
``max_in_flight``; ``schedule_costs``) resolve once into a :class:`ResolvedSchedule`; the trainer, the CUDA-graph runtime, evaluation
and the Megatron-API functions take that object (or a plan it gave) and ask it for the plan of a step --
``resolved.plan(num_microbatches)`` for training, ``resolved.plan(num_microbatches, forward_only=True)`` for
evaluation -- so "the same schedule for another microbatch count" is written here only.  ``tuned`` is not a
schedule: it is resolved to one from ``pipecast tune``'s result at the entry points
(:func:`engine.training.tune.result.resolve_tuned`).  Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .build import build_plan
from .pass_costs import PassCosts
from .registry import ScheduleSpec, auto_schedule, get_schedule, virtual_or_none
from .types import Plan

__all__ = ["ResolvedSchedule", "resolve_schedule"]


@dataclass(frozen=True)
class ResolvedSchedule:
    """A schedule entry with the sizes and options of a run.

    Attributes:
        spec: the registry entry (:class:`~engine.plan.registry.ScheduleSpec`).
        pp_size: pipeline ranks ``P``.
        num_model_chunks: model chunks per rank ``C``.
        group_size: ``microbatch_group_size_per_vp_stage`` for entries that take it (``None``: the default).
        max_in_flight: per-rank in-flight limit (a number or one per rank) for entries that take it.
        overlap_moe_expert_parallel_comm: overlapped forward-backward cells, for entries that take it.
        max_pending_w: per-rank pending-``W`` limit (a number or one per rank) for entries that take it.
        costs: the :class:`~engine.plan.pass_costs.PassCosts` the training plans are built for, for entries that
            take them (evaluation plans, forward-only, do not depend on them).
    """

    spec: ScheduleSpec
    pp_size: int
    num_model_chunks: int = 1
    group_size: int | None = None
    max_in_flight: int | tuple[int, ...] | None = None
    overlap_moe_expert_parallel_comm: bool | None = None
    max_pending_w: int | tuple[int, ...] | None = None
    costs: PassCosts | None = None
    _plans: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def splits_backward(self) -> bool:
        return self.spec.splits_backward

    def plan(self, num_microbatches: int, forward_only: bool = False) -> Plan:
        """The plan of one step with ``num_microbatches`` microbatches (built once per arguments).

        Raises:
            ValueError / RuntimeError: as :func:`engine.plan.build_plan`.
        """
        key = (num_microbatches, bool(forward_only))
        plan = self._plans.get(key)
        if plan is None:
            training = {"max_in_flight": self.max_in_flight, "max_pending_w": self.max_pending_w, "costs": self.costs}
            options = {"group_size": self.group_size,
                       "overlap_moe_expert_parallel_comm": self.overlap_moe_expert_parallel_comm,
                       **{k: None if forward_only else v for k, v in training.items()}}
            plan = build_plan(self.spec, self.pp_size, num_microbatches, self.num_model_chunks,
                              forward_only=bool(forward_only),
                              **{k: v for k, v in options.items() if k in self.spec.options})
            plan.__dict__["resolution"] = self  # cache beside the plan's fields (not pickled, see Plan.__getstate__)
            if len(self._plans) >= 32:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def checked_plan(self, num_microbatches: int, forward_only: bool = False) -> Plan:
        """:meth:`plan`, validated over all ranks (:func:`engine.plan.validate.validate_plan`: data flow, deadlock
        freedom, memory) -- what an entry point calls before any rank starts.

        Raises:
            ValueError / RuntimeError: as :meth:`plan`, or :class:`~engine.plan.validate.PlanError`.
        """
        from .validate import validate_plan
        plan = self.plan(num_microbatches, forward_only)
        validate_plan(plan)
        return plan

    def smallest_max_in_flight(self, num_microbatches: int, limit: int = 4096) -> int | None:
        """The smallest ``max_in_flight`` (one number for every rank) with which the training plan of
        ``num_microbatches`` builds and validates, trying ``1, 2, ...`` through the builder up to ``limit``;
        ``None`` when the schedule takes no ``max_in_flight`` or none up to ``limit`` works."""
        if "max_in_flight" not in self.spec.options:
            return None
        for value in range(1, min(limit, self.pp_size * self.num_model_chunks * num_microbatches) + 1):
            trial = ResolvedSchedule(self.spec, self.pp_size, self.num_model_chunks, self.group_size, value,
                                     self.overlap_moe_expert_parallel_comm, self.max_pending_w, self.costs)
            try:
                trial.checked_plan(num_microbatches)
            except (ValueError, RuntimeError):
                continue
            return value
        return None

    @classmethod
    def of_plan(cls, plan: Plan) -> "ResolvedSchedule | None":
        """The resolution ``plan`` came from: the one that built it, else one rebuilt from a plan of a registered
        schedule (its sizes; ``group_size``, ``max_in_flight``, ``max_pending_w`` and the costs it was built for
        from the plan where the entry takes them); ``None`` for a plan of no registered schedule (e.g. imported
        from CSV)."""
        own = plan.__dict__.get("resolution")
        if own is not None:
            return own
        from .registry import find_schedule
        spec = find_schedule(plan.schedule)
        if spec is None:
            return None
        limits, pending = plan.max_in_flight, plan.max_pending_w
        takes = spec.options
        return cls(spec, plan.pp_size, plan.num_model_chunks, plan.group_size if "group_size" in takes else None,
                   tuple(limits) if "max_in_flight" in takes and limits is not None else None,
                   True if "overlap_moe_expert_parallel_comm" in takes and plan.compounds else None,
                   tuple(pending) if "max_pending_w" in takes and pending is not None else None,
                   plan.__dict__.get("costs") if "costs" in takes else None)


def resolve_schedule(schedule: str, pp_size: int, num_model_chunks: int = 1, group_size: int | None = None,
                     max_in_flight=None, overlap_moe_expert_parallel_comm: bool | None = None, max_pending_w=None,
                     costs=None) -> ResolvedSchedule:
    """Resolve ``schedule`` (a registered name, or ``auto``: Megatron's choice from ``pp_size`` /
    ``num_model_chunks``) with its settings; checks the sizes and options against the entry.

    Raises:
        ValueError: ``tuned`` (resolve it first), an unknown name, sizes the schedule does not take, an option
            it does not take, or costs that do not parse (:meth:`~engine.plan.pass_costs.PassCosts.parse`).
        TypeError: ``costs`` neither a :class:`~engine.plan.pass_costs.PassCosts` nor a string.
    """
    if schedule == "tuned":
        raise ValueError("schedule='tuned' is resolved from `pipecast tune`'s result first "
                         "(engine.training.tune.result.resolve_tuned)")
    if schedule == "auto":
        schedule = auto_schedule(pp_size, virtual_or_none(num_model_chunks))
    spec = get_schedule(schedule)
    spec.check(pp_size, num_model_chunks)
    costs, overlap = PassCosts.of(costs), overlap_moe_expert_parallel_comm or None
    given = {"group_size": group_size, "max_in_flight": max_in_flight, "max_pending_w": max_pending_w,
             "costs": costs, "overlap_moe_expert_parallel_comm": overlap}
    for option, value in given.items():
        if value is not None and option not in spec.options:
            raise ValueError(f"{option}={value!s} does not apply to schedule={spec.name!r}")
    return ResolvedSchedule(spec, pp_size, num_model_chunks, group_size, max_in_flight, overlap, max_pending_w, costs)
