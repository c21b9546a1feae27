"""The schedules a tuner can choose from, and their predicted step time and memory under measured costs.

A :class:`Candidate` is one setting of the ``parallel.*`` fields that pick a schedule (``schedule``, ``virtual``,
``microbatch_group_size_per_vp_stage``, ``max_in_flight``).  :func:`candidates` lists every valid one for a model of
``L`` layers on ``P`` pipeline ranks with ``M`` microbatches, from each registered schedule's tune settings
(:attr:`engine.plan.registry.ScheduleSpec.tune`); for the built-ins: 1F1B, ZB-H1, interleaved 1F1B for every virtual size
``v >= 2`` with ``L % (P*v) == 0`` and every group size Megatron accepts, ZB-V where ``L % 2P == 0``, and the
memory-budgeted split schedule ``zb`` for every virtual size and in-flight limit ``1 .. 2vP`` (capped at
``vM``); candidates whose plans are identical to an earlier one are dropped, and every plan kept passes the
validator.  Once costs are measured, :func:`cost_aware_candidates` adds, for every setting of a schedule that takes
costs (``zb`` at each budget, ``zbv``), the plan built for those costs (:mod:`engine.plan.cost_aware`).

:func:`predict` simulates a candidate with a :class:`CostModel` -- per layout (virtual size ``v``, split or full
backward) and stage the measured cost of ``F``, ``B`` and ``W`` in ms, the runtime's overhead per action, the
latency of one message, the step's work outside the schedule (optimizer, gradient clipping), and per stage the
bytes of one in-flight activation, of one pending ``W``, and of its parameters with their gradients and optimizer
state; for a mixture-of-experts model also each stage's expert all-to-all time (``a2a_ms``), which the overlapped
cells of DualPipeV hide when the cost model says the run overlaps them.  Costs are keyed by *stage* (``P*v``
stages of ``L/(P*v)`` layers each), so one measurement of a layout serves every placement of it (looped and V); a
candidate whose layout was not measured cannot be predicted.  A candidate with an uneven pipeline layout
(``model.pipeline_layout``, :mod:`engine.plan.layout`) takes the even measurement of its ``(v, split)`` split into
per-kind costs (embedding, decoder layer, head and loss) and summed over its own stages (:func:`relayout`).

Memory per rank (bytes): the static bytes of its stages (a tied embedding shared by the first and last stage
counted once when both are on the rank, as under the V placement), plus the peak over its action order of
``sum(activation bytes of in-flight (chunk, microbatch)) + sum(bytes held by pending W)``: ``F`` adds the stage's
activation, ``B`` releases it (and adds the stage's pending-``W`` bytes when the plan splits the backward), ``W``
releases those.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .build import build_plan
from .layout import PipelineLayout, kind_costs, parse_layout, stage_costs
from .pass_costs import PassCosts
from .registry import get_schedule, schedule_names
from .types import Op, Plan, placement_of
from .validate import PlanError, validate_plan

__all__ = ["Candidate", "LayoutCosts", "CostModel", "Prediction", "candidates", "virtual_sizes", "predict",
           "peak_memory_bytes", "rank_predictions", "relayout", "cost_aware_candidates", "measured_costs",
           "overlap_candidates"]


@dataclass(frozen=True)
class Candidate:
    """One schedule setting (the ``parallel.*`` fields it sets are :meth:`overrides`)."""

    schedule: str
    virtual: int = 1
    group_size: int | None = None       # interleaved: microbatch_group_size_per_vp_stage (None: P)
    max_in_flight: int | None = None    # zb: per-rank limit on in-flight activations
    pipeline_layout: str | None = None  # model.pipeline_layout (engine.plan.layout); None: the even split
    costs: PassCosts | None = None      # zb / zbv: the plan is built for these (measured) costs
    recompute: str | None = None        # model.recompute (its costs: the tuner's); None: the config's own
    overlap: bool = False               # interleaved: combined 1F1B cells (overlap_moe_expert_parallel_comm)

    @property
    def splits_backward(self) -> bool:
        return get_schedule(self.schedule).splits_backward

    @property
    def layout(self) -> tuple[int, bool]:
        """``(virtual size, splits backward)``: candidates of one layout share its measured stage costs."""
        return self.virtual, self.splits_backward

    @property
    def label(self) -> str:
        """``"interleaved v=2 G=4"``, ``"zb v=1 max_in_flight=3"``, ``"zbv v=2"``, ``"zb v=1 max_in_flight=8
        cost-aware"`` (built for measured costs)."""
        extra = (f" G={self.group_size}" if self.group_size is not None else "") + (
            f" max_in_flight={self.max_in_flight}" if self.max_in_flight is not None else "") + (
            f" {self.pipeline_layout}" if self.pipeline_layout is not None else "") + (
            " cost-aware" if self.costs is not None else "") + (
            f" recompute={self.recompute}" if self.recompute is not None else "") + (" overlap" if self.overlap else "")
        return f"{self.schedule} v={self.virtual}{extra}"

    def overrides(self) -> dict:
        """The config values of this candidate (``None``: the field's default; ``model.pipeline_layout`` and
        ``model.recompute`` only when the candidate has one; ``parallel.schedule_costs`` always, so that a variant clears the config's own)."""
        out = {"parallel.schedule": self.schedule, "parallel.virtual": self.virtual,
               "parallel.microbatch_group_size_per_vp_stage": self.group_size,
               "parallel.max_in_flight": self.max_in_flight,
               "parallel.schedule_costs": None if self.costs is None else str(self.costs)}
        if self.pipeline_layout is not None:
            out["model.pipeline_layout"] = self.pipeline_layout
        if self.recompute is not None:
            out["model.recompute"] = self.recompute
        if self.overlap:
            out["parallel.overlap_moe_expert_parallel_comm"] = True
        return out

    def arguments(self) -> list[str]:
        """The overrides as ``pipecast train`` arguments (fields left at their default are omitted)."""
        return [f"--{k}={v}" for k, v in self.overrides().items() if v is not None]

    def plan(self, pp_size: int, num_microbatches: int) -> Plan:
        """The training-step plan of this candidate (built once per arguments; plans are immutable)."""
        return _plan(self, pp_size, num_microbatches)


@functools.lru_cache(maxsize=256)
def _plan(c: Candidate, pp_size: int, num_microbatches: int) -> Plan:
    return build_plan(c.schedule, pp_size, num_microbatches, c.virtual, c.group_size, max_in_flight=c.max_in_flight,
                      costs=c.costs, overlap_moe_expert_parallel_comm=True if c.overlap else None)


def overlap_candidates(cands: Sequence[Candidate], pp_size: int, num_microbatches: int) -> list[Candidate]:
    """For every candidate whose schedule forms forward-backward cells only with Megatron's
    ``overlap_moe_expert_parallel_comm`` (interleaved 1F1B's combined 1F1B: ``megatron/core/pipeline_parallel/
    combined_1f1b.py``), the same setting with it (:attr:`Candidate.overlap`): its steady pairs then run as cells
    that hide one microbatch's all-to-all behind the other's compute.  DualPipeV has its cells either way.
    Settings the option refuses (1F1B on several ranks, as Megatron) are left out."""
    out = []
    for c in cands:
        if c.overlap or "overlap_moe_expert_parallel_comm" not in get_schedule(c.schedule).options:
            continue
        variant = dataclasses.replace(c, overlap=True)
        try:
            if c.plan(pp_size, num_microbatches).compounds or not variant.plan(pp_size, num_microbatches).compounds:
                continue
        except (ValueError, PlanError):
            continue
        out.append(variant)
    return out


def virtual_sizes(pp_size: int, num_layers: int) -> list[int]:
    """Virtual pipeline sizes ``v`` that split ``num_layers`` into ``P*v`` equal model chunks."""
    return [v for v in range(1, num_layers // pp_size + 1) if num_layers % (pp_size * v) == 0]


def candidates(pp_size: int, num_layers: int, num_microbatches: int) -> list[Candidate]:
    """Every valid schedule setting (module doc), in a fixed order, without duplicate plans.

    Raises:
        ValueError: ``pp_size``, ``num_layers`` or ``num_microbatches`` below 1, or layers not divisible by ``P``.
    """
    P, L, M = pp_size, num_layers, num_microbatches
    for name, value in (("pp_size", P), ("num_layers", L), ("num_microbatches", M)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: use an integer >= 1")
    if L % P:
        raise ValueError(f"num_layers={L} is not divisible by pp_size={P}: no model chunks of equal size")
    raw = _raw_candidates(P, L, M)
    seen, out = set(), []
    for c in raw:
        try:
            plan = c.plan(P, M)
            validate_plan(plan)
        except (ValueError, RuntimeError, PlanError):
            continue
        key = (plan.placement, plan.actions)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _raw_candidates(P: int, L: int, M: int) -> list[Candidate]:
    """Per virtual size, each registered schedule's tune settings (:attr:`ScheduleSpec.tune`), in registry order."""
    out = []
    for v in virtual_sizes(P, L):
        for name in schedule_names():
            spec = get_schedule(name)
            if spec.tune is None or spec.fits(P, v) is not None:
                continue
            for settings in spec.tune(P, v, M):
                out.append(Candidate(name, v, settings.get("group_size"), settings.get("max_in_flight")))
    return out


def cost_aware_candidates(cands: Sequence[Candidate], model: "CostModel", pp_size: int,
                          num_microbatches: int) -> list[Candidate]:
    """For every candidate of a schedule that takes costs (``zb`` at each budget, ``zbv``) whose layout ``model``
    measured, the same setting built for the measured costs (:func:`measured_costs`); plans that fail to build
    or to validate, or equal an earlier one, are dropped."""
    seen, out = set(), []
    for c in cands:
        if c.costs is not None or "costs" not in get_schedule(c.schedule).options or c.layout not in model.layouts:
            continue
        costed = dataclasses.replace(c, costs=measured_costs(c, model, pp_size))
        try:
            plan = costed.plan(pp_size, num_microbatches)
            validate_plan(plan)
        except (ValueError, RuntimeError, PlanError):
            continue
        key = (plan.placement, plan.actions)
        if key not in seen:
            seen.add(key)
            out.append(costed)
    return out


def _layout_costs(candidate: Candidate, model: "CostModel") -> "LayoutCosts":
    """The measured costs of the candidate's layout, moved to its ``pipeline_layout`` when it has one."""
    lc = model.layouts[candidate.layout]
    return lc if candidate.pipeline_layout is None else relayout(lc, parse_layout(candidate.pipeline_layout))


def measured_costs(candidate: Candidate, model: "CostModel", pp_size: int) -> PassCosts:
    """The :class:`~engine.plan.pass_costs.PassCosts` of ``candidate``'s placement from its layout's measurements:
    per ``(rank, chunk)`` the stage's ``F``, ``B`` and ``W`` in ms plus the runtime's time per action, the message
    latency, and the bytes a pending ``W`` holds over those of an activation; 4 significant digits (the notation
    goes into the config).

    Raises:
        KeyError: ``model`` did not measure the candidate's layout.
    """
    lc, v = _layout_costs(candidate, model), candidate.virtual
    where = placement_of(get_schedule(candidate.schedule).placement, pp_size, v)
    stage = {loc: s for s, loc in enumerate(where)}

    def table(value):
        return tuple(tuple(float(f"{value(stage[(r, c)]):.4g}") for c in range(v)) for r in range(pp_size))
    o = lc.action_overhead_ms
    return PassCosts(table(lambda s: lc.forward_ms[s] + o), table(lambda s: lc.backward_ms[s] + o),
                     table(lambda s: lc.weight_ms[s] + o), float(f"{model.transfer_ms:.4g}"),
                     table(lambda s: lc.pending_w_bytes[s] / lc.activation_bytes[s] if lc.activation_bytes[s] else 0.0))


@dataclass(frozen=True)
class LayoutCosts:
    """Measured costs of one layout (``P*v`` stages) with one kind of backward; every sequence is per stage.

    Attributes:
        forward_ms, backward_ms, weight_ms: compute time of ``F``, ``B`` (input gradient alone when split; the
            whole backward otherwise) and ``W`` (0 when not split), ms.
        activation_bytes: bytes held for the backward by one in-flight microbatch of the stage.
        pending_w_bytes: bytes held from ``B`` until ``W`` by one microbatch (0 when not split).
        static_bytes: parameters, gradients and optimizer state of the stage, bytes.
        action_overhead_ms: runtime time per action outside compute and communication waits, ms.
        step_overhead_ms: time of a training step outside the schedule (optimizer step, clipping, loss), ms.
        calibration: measured step / simulated step of the schedule that was measured for this layout; it scales
            the layout's predictions (what the model leaves out and the layout's schedules share: ranks
            contending for fewer cores than ranks, delayed wake-ups on message arrival).  1: uncalibrated.
    """

    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    weight_ms: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    pending_w_bytes: tuple[int, ...]
    static_bytes: tuple[int, ...]
    action_overhead_ms: float = 0.0
    step_overhead_ms: float = 0.0
    calibration: float = 1.0
    a2a_ms: tuple[float, ...] = ()


@dataclass(frozen=True)
class CostModel:
    """What :func:`predict` needs: ``layouts[(v, splits_backward)]``, the message latency (ms) and the bytes of a
    tied embedding the first and last stage both count (0 when untied); for a mixture-of-experts model, whether
    forward-backward cells run overlapped (``overlap_moe_expert_parallel_comm``; the layouts' ``a2a_ms`` give
    each stage's expert all-to-all time per forward, :func:`engine.plan.simulate.simulate`)."""

    layouts: Mapping[tuple[int, bool], LayoutCosts]
    transfer_ms: float = 0.0
    tied_bytes: int = 0
    overlap_moe_expert_parallel_comm: bool = False


@dataclass(frozen=True)
class Prediction:
    """A candidate's training step: ``simulated_ms`` = schedule makespan + step overhead, ``predicted_ms`` = that
    times the layout's calibration; ``bubble`` =
    idle fraction of all ranks within the makespan; ``busy_ms``, ``peak_memory_bytes``, ``peak_in_flight`` and
    ``peak_pending_w`` per pipeline rank."""

    candidate: Candidate
    predicted_ms: float
    simulated_ms: float
    schedule_ms: float
    bubble: float
    busy_ms: tuple[float, ...]
    peak_memory_bytes: tuple[int, ...]
    peak_in_flight: tuple[int, ...]
    peak_pending_w: tuple[int, ...]

    def fits(self, budget_bytes: float | None) -> bool:
        return budget_bytes is None or max(self.peak_memory_bytes) <= budget_bytes


def predict(candidate: Candidate, model: CostModel, pp_size: int, num_microbatches: int) -> Prediction:
    """Simulate ``candidate`` (:func:`engine.plan.simulate.simulate`) with the measured costs of its layout.

    Raises:
        KeyError: ``model`` has no measurement of the candidate's layout (its ``(virtual, splits_backward)``).
        ValueError: a measurement's per-stage lists do not have ``P*v`` entries.
    """
    from .simulate import placed_costs, simulate
    virtual, split = candidate.layout
    if candidate.layout not in model.layouts:
        raise KeyError(f"no measured costs for virtual={virtual} with {'split' if split else 'full'} backward "
                       f"(candidate {candidate.label})")
    plan = candidate.plan(pp_size, num_microbatches)
    _check_stages(model.layouts[candidate.layout], plan.num_stages)
    lc = _layout_costs(candidate, model)

    o = lc.action_overhead_ms
    a2a = placed_costs(plan, lc.a2a_ms, 0.0) if lc.a2a_ms else 0.0
    sim = simulate(plan, placed_costs(plan, lc.forward_ms, o), placed_costs(plan, lc.backward_ms, o),
                   model.transfer_ms, placed_costs(plan, lc.weight_ms, o if split else 0.0), a2a,
                   model.overlap_moe_expert_parallel_comm)
    step = sim.makespan + lc.step_overhead_ms
    return Prediction(candidate, step * lc.calibration, step, sim.makespan, sim.bubble_overall, sim.busy,
                      peak_memory_bytes(plan, lc, model.tied_bytes), sim.peak_in_flight, sim.peak_pending_w)


_STAGE_FIELDS = ("forward_ms", "backward_ms", "weight_ms", "activation_bytes", "pending_w_bytes", "static_bytes")


def relayout(lc: LayoutCosts, layout: PipelineLayout) -> LayoutCosts:
    """The costs of ``layout``'s stages predicted from ``lc``, measured under the even layout of as many stages and
    decoder layers: each per-stage figure split into per-kind costs (:func:`engine.plan.layout.kind_costs`) and
    summed over the new stages (:func:`engine.plan.layout.stage_costs`).

    Raises:
        ValueError: the stage counts differ, or the even layout has no middle stage (:func:`kind_costs`).
    """
    _check_stages(lc, layout.num_stages)
    even = PipelineLayout.even(layout.num_layers, layout.num_stages)
    new = {}
    for name in _STAGE_FIELDS:
        values = stage_costs(layout, kind_costs(even, getattr(lc, name)))
        new[name] = values if name.endswith("_ms") else tuple(int(round(v)) for v in values)
    return dataclasses.replace(lc, **new)


def _check_stages(lc: LayoutCosts, stages: int) -> None:
    for name in _STAGE_FIELDS + ("a2a_ms",):
        if len(getattr(lc, name)) != stages and (name != "a2a_ms" or lc.a2a_ms):
            raise ValueError(f"LayoutCosts.{name} has {len(getattr(lc, name))} entries for {stages} stages")


def peak_memory_bytes(plan: Plan, lc: LayoutCosts, tied_bytes: int = 0) -> tuple[int, ...]:
    """Per rank, static bytes of its stages plus the peak of held activation and pending-W bytes (module doc)."""
    out = []
    for rank, acts in enumerate(plan.actions):
        stages = plan.stages_of(rank)
        static = sum(lc.static_bytes[s] for s in stages)
        if 0 in stages and plan.num_stages - 1 in stages and plan.num_stages > 1:
            static -= tied_bytes
        level = peak = 0
        for a in acts:
            s = plan.stage(rank, a.chunk)
            if a.op is Op.FORWARD:
                level += lc.activation_bytes[s]
            elif a.op is Op.BACKWARD:
                level += (lc.pending_w_bytes[s] if plan.splits_backward else 0) - lc.activation_bytes[s]
            else:
                level -= lc.pending_w_bytes[s]
            peak = max(peak, level)
        out.append(static + peak)
    return tuple(out)


def rank_predictions(predictions: Sequence[Prediction], budget_bytes: float | None = None) -> list[Prediction]:
    """Fitting predictions first, each group by predicted step time (then by peak memory)."""
    return sorted(predictions, key=lambda p: (not p.fits(budget_bytes), p.predicted_ms, max(p.peak_memory_bytes)))
