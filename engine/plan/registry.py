"""The schedule registry: one :class:`ScheduleSpec` per pipeline schedule, the only place that names schedules.

Everything that offers or picks a schedule reads this registry: the values of ``parallel.schedule`` (with ``auto``
and ``tuned``), ``pipecast schedule --schedule``, :func:`engine.plan.build_plan`, the tuner's candidates
(:mod:`engine.plan.candidates`), the Megatron-API dispatch (:mod:`engine.schedules`), the lowering's sync-hook
points (:mod:`engine.plan.hooks`) and the trainer.  A schedule defined outside the package is added with
:func:`register_schedule`; from then on it works everywhere in that process (build, validation, simulation,
plots, CSV export, ``forward_backward_pipelining_with_schedule``, the trainer).  Ranks started by
:func:`engine.spawn` (and ``engine.training.launch_ranks``) import the module of the function they run, so a module that registers its schedule at import
time has it registered on every rank.

A builder is ``build(pp_size, num_microbatches, num_model_chunks, forward_only, **options) -> Plan``; it gets sizes
already checked against the entry (:meth:`ScheduleSpec.check`) and the options the entry lists (``None`` when not
given), and returns a :class:`~engine.plan.types.Plan` whose ``schedule`` is the entry's name.

The built-in entries: Megatron-Core 0.16.1's three schedules (no pipelining, 1F1B, interleaved 1F1B; Megatron
picks among them from the pipeline and virtual sizes, :func:`auto_schedule`) and the split-backward schedules of
Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (ZB-H1, ZB-V and a memory-budgeted one; ``zb`` and ``zbv``
given ``costs`` are built for them, :mod:`engine.plan.cost_aware`), the controllable-memory V schedules V-Half and
V-Min (:mod:`engine.plan.controllable`) and DeepSeek-AI's DualPipeV (:mod:`engine.plan.dualpipev`).  Pure: no torch.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .controllable import controllable_plan
from .dualpipev import dualpipev_plan
from .hooks import interleaved_hooks, last_backward_hooks, last_forward_hooks, last_weight_hooks
from .megatron import megatron_plan
from .table import validate_interleaved_microbatches
from .types import PLACEMENTS, Plan
from .zero_bubble import budget_limits, zb_h1_limits, zbv_limits, zero_bubble_plan

__all__ = ["ScheduleSpec", "OPTIONS", "RESERVED", "register_schedule", "get_schedule", "find_schedule",
           "schedule_names", "config_choices", "auto_schedule", "virtual_or_none"]

OPTIONS = ("group_size", "max_in_flight", "max_pending_w", "costs", "overlap_moe_expert_parallel_comm")
"""The build options an entry may take: ``group_size`` (``microbatch_group_size_per_vp_stage``, config field
``parallel.microbatch_group_size_per_vp_stage``), ``max_in_flight`` (``parallel.max_in_flight``), ``max_pending_w``
(a limit on pending weight-gradient passes; Python and ``pipecast schedule`` only), ``costs`` (a
:class:`~engine.plan.pass_costs.PassCosts` the plan is built for: ``parallel.schedule_costs``) and
``overlap_moe_expert_parallel_comm`` (Megatron's field: forward-backward cells that overlap the expert all-to-all;
an entry that takes it has such cells, built or always there)."""
RESERVED = ("auto", "tuned")
"""``parallel.schedule`` values that are not schedules: Megatron's choice from the sizes, and the result of
``pipecast tune``."""


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule: what it needs, how its plan is built, and what the runtime and the tuner must know.

    Attributes:
        name: the value of ``parallel.schedule`` / ``--schedule`` / ``Plan.schedule``.
        build: the builder (module doc).
        placement: ``"looped"`` (stage ``c*P + r`` on rank ``r``) or ``"v"`` (rank ``r`` holds stages ``r`` and
            ``2P-1-r``): what a model split for a rank must hold.
        chunks: model chunks per rank it needs (``None``: any number >= 1); ``chunks_why`` says why and what to
            do instead (shown in the error for another count).
        min_pp, max_pp: the pipeline sizes it runs on (``max_pp`` ``None``: no upper bound); ``pp_why`` explains.
        splits_backward: runs separate input-gradient (``B``) and weight-gradient (``W``) passes.
        options: the build options it takes (a subset of :data:`OPTIONS`).
        hooks: the rule for when the grad / param sync hooks fire (:mod:`engine.plan.hooks`).
        megatron_function: the name of the Megatron-Core function that runs it, if any (:mod:`engine.schedules`).
        overlap_p2p: accepts ``overlap_p2p_comm`` (Megatron's 1F1B does not).
        tune: ``tune(pp_size, virtual, num_microbatches)`` -> the settings (dicts of :data:`OPTIONS`) the tuner
            tries with ``virtual`` model chunks per rank; ``None``: the tuner never proposes it.
        summary: one line for ``--help``.
    """

    name: str
    build: Callable[..., Plan]
    placement: str = "looped"
    chunks: int | None = 1
    chunks_why: str = ""
    min_pp: int = 1
    max_pp: int | None = None
    pp_why: str = ""
    splits_backward: bool = False
    options: tuple[str, ...] = ()
    hooks: Callable | None = None
    megatron_function: str | None = None
    overlap_p2p: bool = True
    tune: Callable[[int, int, int], Iterable[dict]] | None = None
    summary: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_]+", self.name):
            raise ValueError(f"ScheduleSpec(name={self.name!r}): a schedule name is a word of letters, digits and "
                             "'_' (it is a YAML value and a CLI choice)")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"ScheduleSpec {self.name!r}: placement={self.placement!r} is unknown; use one of "
                             f"{', '.join(PLACEMENTS)}")
        unknown = [o for o in self.options if o not in OPTIONS]
        if unknown:
            raise ValueError(f"ScheduleSpec {self.name!r}: options {unknown} are unknown; use some of {OPTIONS}")
        if self.placement == "v" and self.chunks != 2:
            raise ValueError(f"ScheduleSpec {self.name!r}: the V placement holds two model chunks per rank; set "
                             "chunks=2")
        if self.hooks is None:
            object.__setattr__(self, "hooks", last_weight_hooks if self.splits_backward else last_backward_hooks)

    def __str__(self) -> str:
        return self.name

    def fits(self, pp_size: int, num_model_chunks: int) -> str | None:
        """``None`` when the schedule runs on ``pp_size`` ranks with ``num_model_chunks`` chunks each, else why
        not and the fix."""
        if pp_size < self.min_pp or (self.max_pp is not None and pp_size > self.max_pp):
            span = f"{self.min_pp}" + (f"..{self.max_pp}" if self.max_pp != self.min_pp else "") if \
                self.max_pp is not None else f">= {self.min_pp}"
            return f"it runs on pipeline sizes {span}, got {pp_size}" + (f"; {self.pp_why}" if self.pp_why else "")
        if self.chunks is not None and num_model_chunks != self.chunks:
            return (f"it takes {self.chunks} model chunk(s) per rank, got {num_model_chunks}"
                    + (f"; {self.chunks_why}" if self.chunks_why else ""))
        return None

    def check(self, pp_size: int, num_model_chunks: int) -> None:
        """Raise ``ValueError`` (naming the schedule, the sizes and the fix) unless :meth:`fits`."""
        why = self.fits(pp_size, num_model_chunks)
        if why is not None:
            raise ValueError(f"schedule={self.name!r} does not fit pp_size={pp_size}, num_model_chunks="
                             f"{num_model_chunks}: {why}")


_REGISTRY: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec, *, replace: bool = False) -> ScheduleSpec:
    """Add ``spec`` to the registry (module doc); returns it.

    Registering again an entry of the same name whose builder comes from the same module (the module imported
    twice, e.g. as ``__main__`` and by name) replaces it; ``replace=True`` replaces any entry.

    Raises:
        TypeError: ``spec`` is not a :class:`ScheduleSpec`.
        ValueError: the name is ``auto`` or ``tuned``, or another module registered that name.
    """
    if not isinstance(spec, ScheduleSpec):
        raise TypeError(f"register_schedule({spec!r}): pass a ScheduleSpec")
    if spec.name in RESERVED:
        raise ValueError(f"schedule name {spec.name!r} is reserved (parallel.schedule: {' / '.join(RESERVED)}); "
                         "choose another name")
    old = _REGISTRY.get(spec.name)
    if old is not None and not replace and _origin(old) != _origin(spec):
        raise ValueError(f"schedule {spec.name!r} is already registered (by {_origin(old)}); choose another name or "
                         "pass replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def _origin(spec: ScheduleSpec) -> str:
    build = spec.build.func if isinstance(spec.build, functools.partial) else spec.build
    return getattr(build, "__module__", "?")


def find_schedule(name) -> ScheduleSpec | None:
    """The entry named ``name``, or ``None``."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def get_schedule(name) -> ScheduleSpec:
    """The entry named ``name`` (a :class:`ScheduleSpec` is returned as is).

    Raises:
        ValueError: an unknown name; the message lists the registered ones.
    """
    if isinstance(name, ScheduleSpec):
        return name
    spec = find_schedule(name)
    if spec is None:
        raise ValueError(f"schedule={name!r} is unknown; use one of {', '.join(schedule_names())}")
    return spec


def schedule_names(*, builtin: bool = False) -> tuple[str, ...]:
    """The registered schedules, in registration order (built-ins first); ``builtin=True``: pipecast's own only
    (what every process has, whatever a user registered in this one)."""
    return tuple(s.name for s in _BUILTINS) if builtin else tuple(_REGISTRY)


def config_choices() -> tuple[str, ...]:
    """The values ``parallel.schedule`` takes: ``auto``, the registered schedules, ``tuned``."""
    return ("auto",) + schedule_names() + ("tuned",)


def auto_schedule(pp_size: int, vp_size: int | None) -> str:
    """The schedule Megatron-Core picks for a topology (``get_forward_backward_func``): ``pp_size > 1`` gives
    interleaved 1F1B iff ``vp_size is not None`` (even 1), else 1F1B; ``pp_size <= 1`` gives no pipelining."""
    if pp_size > 1:
        return "1f1b" if vp_size is None else "interleaved"
    return "no_pipelining"


def virtual_or_none(virtual: int) -> int | None:
    """A config's ``parallel.virtual`` as Megatron's ``virtual_pipeline_model_parallel_size``: ``None`` for one
    chunk per rank (any value, even 1, selects interleaving in Megatron-Core)."""
    return virtual if virtual > 1 else None


# ---- the built-in entries --------------------------------------------------------------------------------------------
def _one(P: int, v: int, M: int):
    return [{}] if v == 1 else []


def _interleaved_settings(P: int, v: int, M: int):
    out = []
    for g in range(P, M + 1) if v >= 2 and P >= 2 else ():
        try:
            validate_interleaved_microbatches(M, P, g)
        except (ValueError, RuntimeError):
            continue
        out.append({"group_size": None if g == P else g})
    return out


def _budget_settings(P: int, v: int, M: int):
    return [{"max_in_flight": k} for k in range(1, min(2 * v * P, v * M) + 1)]


def _v_settings(P: int, v: int, M: int):
    """ZB-V at its own budget (``2P`` chunk activations), then at the others from 2 to ``4P``."""
    return [{}] + [{"max_in_flight": k} for k in range(2, 4 * P + 1) if k != 2 * P] if v == 2 else []


_BUILTINS = (
    ScheduleSpec("no_pipelining", functools.partial(megatron_plan, "no_pipelining"), max_pp=1,
                 pp_why="use '1f1b' or 'interleaved' for pp_size > 1", chunks_why="one model chunk on one rank",
                 options=("overlap_moe_expert_parallel_comm",),
                 hooks=last_forward_hooks, megatron_function="forward_backward_no_pipelining", overlap_p2p=False,
                 tune=lambda P, v, M: _one(P, v, M) if P == 1 else [], summary="one rank, no pipeline"),
    ScheduleSpec("1f1b", functools.partial(megatron_plan, "1f1b"),
                 chunks_why="use 'interleaved' for virtual pipeline stages",
                 options=("overlap_moe_expert_parallel_comm",),
                 megatron_function="forward_backward_pipelining_without_interleaving", overlap_p2p=False,
                 tune=lambda P, v, M: _one(P, v, M) if P > 1 else [], summary="Megatron's 1F1B"),
    ScheduleSpec("interleaved", functools.partial(megatron_plan, "interleaved", interleaved=True), chunks=None,
                 min_pp=2, pp_why="with one pipeline rank use 'no_pipelining' (one model chunk)",
                 options=("group_size", "overlap_moe_expert_parallel_comm"), hooks=interleaved_hooks,
                 megatron_function="forward_backward_pipelining_with_interleaving", tune=_interleaved_settings,
                 summary="Megatron's interleaved 1F1B (virtual pipeline stages)"),
    ScheduleSpec("zb_h1", functools.partial(zero_bubble_plan, "zb_h1", "looped", zb_h1_limits),
                 chunks_why="use 'zbv' (two chunks, V placement) or 'zb' for several chunks per rank",
                 splits_backward=True, tune=_one, summary="ZB-H1: 1F1B's memory, W passes fill the cooldown"),
    ScheduleSpec("zbv", functools.partial(zero_bubble_plan, "zbv", "v", zbv_limits), placement="v", chunks=2,
                 chunks_why="ZB-V places exactly two model chunks on each rank (virtual pipeline size 2)",
                 splits_backward=True, options=("max_in_flight", "max_pending_w", "costs"), tune=_v_settings,
                 summary="ZB-V: V placement, two chunks per rank, split backward (max_in_flight: default 2*pp; "
                         "costs: built for them)"),
    ScheduleSpec("zb", functools.partial(zero_bubble_plan, "zb", "looped", budget_limits), chunks=None,
                 splits_backward=True, options=("max_in_flight", "max_pending_w", "costs"), tune=_budget_settings,
                 summary="split backward under a per-rank limit on in-flight activations (max_in_flight; costs: "
                         "built for them)"),
    ScheduleSpec("v_half", functools.partial(controllable_plan, "half", "v_half"), placement="v", chunks=2,
                 chunks_why="V-Half places exactly two model chunks on each rank (virtual pipeline size 2)",
                 splits_backward=True, tune=lambda P, v, M: [{}] if v == 2 else [],
                 summary="V-Half: V placement, half of 1F1B's activation memory (controllable-memory V schedule)"),
    ScheduleSpec("v_min", functools.partial(controllable_plan, "min", "v_min"), placement="v", chunks=2,
                 chunks_why="V-Min places exactly two model chunks on each rank (virtual pipeline size 2)",
                 splits_backward=True, tune=lambda P, v, M: [{}] if v == 2 else [],
                 summary="V-Min: V placement, a third of 1F1B's activation memory (controllable-memory V schedule)"),
    ScheduleSpec("dualpipev", dualpipev_plan, placement="v", chunks=2,
                 chunks_why="DualPipeV places exactly two model chunks on each rank (virtual pipeline size 2)",
                 splits_backward=True, options=("overlap_moe_expert_parallel_comm",),
                 tune=lambda P, v, M: [{}] if v == 2 and M >= 2 * P else [],
                 summary="DualPipeV: V placement, overlapped forward-backward cells, needs microbatches >= 2*pp"),
)
for _spec in _BUILTINS:
    register_schedule(_spec)
