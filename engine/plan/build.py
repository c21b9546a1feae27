"""Schedules as data: the per-rank plan of one training (or evaluation) step.

A :class:`Plan` holds, for every pipeline rank, the ordered list of :class:`Action` s that rank performs in one
step -- ``F(chunk, microbatch)`` and ``B(chunk, microbatch)`` (``W`` is reserved for split weight-gradient passes).
Everything else is derived from it: the executor runs it, the CUDA-graph capture uses its order, the profiler
labels and the timeline plot name its actions, the validator and simulator read it.

All three Megatron schedules are one construction (Megatron-Core 0.16.1, ``megatron/core/pipeline_parallel/schedules.py``): a rank runs
the forward steps of its schedule table in order, the first ``W`` as warmup, then alternates one forward and one
backward (steady 1F1B), then runs the remaining ``W`` backwards (cooldown).  No pipelining is ``W = 0``; 1F1B is
one model chunk with ``W = min(P-r-1, M)``; interleaved 1F1B uses the virtual-pipeline warmup count and the
grouped schedule table; forward-only plans keep the forward steps alone.

Placement is data: a plan carries its stage -> (rank, chunk) map (:attr:`Plan.placement`).  Megatron's looped
placement puts virtual stage ``c*P + r`` on rank ``r`` as chunk ``c`` (:func:`looped_placement`); the V placement of
ZB-V puts stages ``r`` and ``2P-1-r`` on rank ``r`` (:func:`v_placement`).  Activations flow from stage ``s`` to
``s+1``, gradients back; consecutive stages on one rank hand over locally (a :class:`Message` with ``src == dst``).
Split-backward schedules (``zb_h1``, ``zbv``, ``zb``) are built by :mod:`engine.plan.zero_bubble`.
This module is pure: it imports nothing from torch.
"""
from __future__ import annotations

import enum
import re
from array import array
from dataclasses import dataclass
from functools import cached_property

from .schedule import Schedule, parse_schedule, select_schedule
from .table import get_schedule_table, pp_rank_microbatches, validate_interleaved_microbatches

__all__ = ["Op", "Action", "Message", "Plan", "SCHEDULES", "MAX_PLAN_FORWARDS", "build_plan", "schedule_name",
           "looped_placement", "v_placement"]

MAX_PLAN_FORWARDS = 2 ** 24
"""Upper bound on ``P * C * M`` (forwards per step over all ranks) accepted by :func:`build_plan`: the plan holds
every action as a Python object (~0.5 KB each), so 2**24 forwards are already ~16 GB and minutes to build."""

SCHEDULES = tuple(s.value for s in Schedule)


class Op(str, enum.Enum):
    """What an action computes."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"  # split weight-gradient pass (zero-bubble schedules); BACKWARD is then the input-gradient pass

    def __str__(self) -> str:
        return self.value


_NOTATION = re.compile(r"^([FBW])(\d+)\.(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One compute step of a pipeline rank: ``op`` on ``(model chunk, microbatch)``.

    One notation everywhere (grids, JSON, spans, NVTX ranges, errors): ``<op><microbatch>.<chunk>``, e.g. ``F3.1``
    is the forward of microbatch 3 on model chunk 1 (the notation of Megatron-Core's traces);
    ``Action.parse(str(a)) == a``.
    """

    op: Op
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op.value}{self.microbatch}.{self.chunk}"

    @property
    def label(self) -> str:
        """The action's notation (``str(action)``), as profiler spans and NVTX ranges show it."""
        return str(self)

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action written ``text`` (``"F3.1"``).

        Raises:
            ValueError: ``text`` is not ``<F|B|W><microbatch>.<chunk>``.
        """
        m = _NOTATION.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"{text!r} is not an action: write <F|B|W><microbatch>.<chunk>, e.g. F3.1")
        return cls(Op(m.group(1)), int(m.group(3)), int(m.group(2)))


@dataclass(frozen=True, slots=True)
class Message:
    """A tensor that crosses between pipeline ranks: an activation (``"act"``) or a gradient (``"grad"``).

    ``src_chunk`` produced it on ``src``; ``dst_chunk`` consumes it on ``dst``; both for ``microbatch``.
    """

    kind: str
    src: int
    src_chunk: int
    dst: int
    dst_chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}[r{self.src}c{self.src_chunk}m{self.microbatch}->r{self.dst}c{self.dst_chunk}]"


def schedule_name(pp_size: int, vp_size: int | None) -> str:
    """The schedule Megatron picks for a topology, as its name (:func:`engine.plan.schedule.select_schedule`)."""
    return select_schedule(pp_size, vp_size).value


Placement = tuple[tuple[int, int], ...]
"""Stage -> ``(rank, chunk)``: entry ``s`` is the location of virtual pipeline stage ``s``."""


def looped_placement(pp_size: int, num_model_chunks: int) -> Placement:
    """Megatron's placement: stage ``c*P + r`` is chunk ``c`` of rank ``r``."""
    return tuple((s % pp_size, s // pp_size) for s in range(pp_size * num_model_chunks))


def v_placement(pp_size: int) -> Placement:
    """The V placement of ZB-V / DualPipeV: rank ``r`` holds stage ``r`` (chunk 0) and ``2P-1-r`` (chunk 1), so the
    last rank hands stage ``P-1`` to ``P`` locally and rank 0 holds the first and the last stage."""
    return tuple((s, 0) if s < pp_size else (2 * pp_size - 1 - s, 1) for s in range(2 * pp_size))


@dataclass(frozen=True)
class Plan:
    """The actions of every pipeline rank for one step.

    Attributes:
        schedule: ``"no_pipelining"``, ``"1f1b"`` or ``"interleaved"``.
        pp_size: pipeline ranks ``P``.
        num_model_chunks: model chunks per rank ``C`` (the virtual pipeline size; 1 unless interleaved).
        num_microbatches: ``M``.
        group_size: ``microbatch_group_size_per_vp_stage`` ``G``.
        forward_only: no backward actions (evaluation).
        warmup: per rank, the number of warmup forward steps ``W`` (forwards before the first backward).
        actions: per rank, the ordered actions.
        placement: stage -> ``(rank, chunk)`` (:data:`Placement`); ``None`` means :func:`looped_placement`.
        max_in_flight: per rank, the limit on activations held (forward done, backward not) that the validator
            enforces, or ``None`` (no limit).
        max_pending_w: per rank, the limit on weight-gradient passes pending (backward done, ``W`` not), or ``None``.
    """

    schedule: str
    pp_size: int
    num_model_chunks: int
    num_microbatches: int
    group_size: int
    forward_only: bool
    warmup: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    placement: Placement | None = None
    max_in_flight: tuple[int, ...] | None = None
    max_pending_w: tuple[int, ...] | None = None

    def __getstate__(self) -> dict:
        """Pickle only the fields: derived caches (keys, dependency graph, execution order) are rebuilt on demand."""
        return {f: self.__dict__[f] for f in self.__dataclass_fields__}

    # -- topology -------------------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Virtual pipeline stages ``P*C``."""
        return self.pp_size * self.num_model_chunks

    @cached_property
    def stage_map(self) -> Placement:
        """Stage -> ``(rank, chunk)`` (:attr:`placement`, or the looped placement when it is ``None``)."""
        if self.placement is None:
            return looped_placement(self.pp_size, self.num_model_chunks)
        return tuple(tuple(loc) for loc in self.placement)

    @cached_property
    def _stage_of(self) -> dict:
        return {loc: s for s, loc in enumerate(self.stage_map)}

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage index of ``(rank, chunk)`` (``chunk*P + rank`` under the looped placement); -1 if the
        placement has no such location."""
        return self._stage_of.get((rank, chunk), -1)

    def stage_location(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding virtual stage ``stage``."""
        return self.stage_map[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages ``rank`` holds, in chunk order (what a model split for this rank needs)."""
        return tuple(self.stage(rank, c) for c in range(self.num_model_chunks))

    @property
    def splits_backward(self) -> bool:
        """The plan runs split weight-gradient (``W``) passes: ``B`` is then the input-gradient pass only."""
        return Schedule(self.schedule).splits_backward if self.schedule in SCHEDULES else any(
            a.op is Op.WEIGHT for acts in self.actions for a in acts)

    def is_first_stage(self, rank: int, chunk: int) -> bool:
        """Holds the input embedding (reads the data)."""
        return self.stage(rank, chunk) == 0

    def is_last_stage(self, rank: int, chunk: int) -> bool:
        """Holds the output head and computes the loss."""
        return self.stage(rank, chunk) == self.num_stages - 1

    # -- communication derived from the actions --------------------------------------------------------------
    def input_message(self, rank: int, action: Action) -> Message | None:
        """The tensor ``action`` must receive before it runs, or ``None``.

        A forward off the first stage receives the previous stage's activation; a backward off the last stage
        receives the next stage's gradient (a forward-only plan has no backward).
        """
        s = self.stage(rank, action.chunk)
        if action.op is Op.FORWARD and s > 0:
            src, src_chunk = self.stage_location(s - 1)
            return Message("act", src, src_chunk, rank, action.chunk, action.microbatch)
        if action.op is Op.BACKWARD and s < self.num_stages - 1:
            src, src_chunk = self.stage_location(s + 1)
            return Message("grad", src, src_chunk, rank, action.chunk, action.microbatch)
        return None

    def output_message(self, rank: int, action: Action) -> Message | None:
        """The tensor ``action`` sends when it is done, or ``None`` (see :meth:`input_message`)."""
        s = self.stage(rank, action.chunk)
        if action.op is Op.FORWARD and s < self.num_stages - 1:
            dst, dst_chunk = self.stage_location(s + 1)
            return Message("act", rank, action.chunk, dst, dst_chunk, action.microbatch)
        if action.op is Op.BACKWARD and s > 0:
            dst, dst_chunk = self.stage_location(s - 1)
            return Message("grad", rank, action.chunk, dst, dst_chunk, action.microbatch)
        return None

    def sends(self, rank: int) -> list[Message]:
        """Every message ``rank`` sends in one step, in the order it sends them."""
        return [m for a in self.actions[rank] if (m := self.output_message(rank, a)) is not None]

    def link_order(self, src: int, dst: int) -> list[Message]:
        """Messages on the directed link ``src -> dst`` in the sender's order.

        A receiver that posts its receives in this order matches the sender one to one even where the transport
        ignores tags (NCCL), including ``P = 2`` where activations and gradients share the same pair of ranks.
        """
        return [m for m in self.sends(src) if m.dst == dst]

    # -- views ------------------------------------------------------------------------------------------------
    def order(self, rank: int) -> list[int]:
        """The rank's order in Transformer Engine notation (forward chunk ``c`` as ``c+1``, backward as ``-(c+1)``)."""
        return [(a.chunk + 1) if a.op is Op.FORWARD else -(a.chunk + 1)
                for a in self.actions[rank] if a.op is not Op.WEIGHT]

    def compute_order(self, rank: int) -> list[str]:
        """The rank's actions in trace notation (``"F3.1"``), as in ``tests/data/megatron_schedules.json``."""
        return [str(a) for a in self.actions[rank]]

    @cached_property
    def total_actions(self) -> int:
        """Number of actions over all ranks."""
        return sum(len(a) for a in self.actions)

    @cached_property
    def action_keys(self) -> tuple[array, ...]:
        """Per rank, one integer per action (an ``array('q')``): ``op*C*M + chunk*M + microbatch`` (op F=0, B=1, W=2).

        ``-1`` marks an entry that is not an action of this plan (not an :class:`Action`, chunk not in ``[0, C)``
        or microbatch not in ``[0, M)``).
        The validator and the simulator work on these keys instead of the action objects (about 1M actions for
        P=64, C=8, M=1024).  Plans from :func:`build_plan` come with the keys precomputed.
        """
        chunks, microbatches = self.num_model_chunks, self.num_microbatches
        stride = chunks * microbatches
        op_index = {Op.FORWARD: 0, Op.BACKWARD: 1, Op.WEIGHT: 2}
        distinct = {}  # id -> action; plans share action objects between ranks, so this stays small
        for acts in self.actions:
            distinct.update(zip(map(id, acts), acts))
        key_of = {}
        for ident, a in distinct.items():
            valid = (isinstance(a, Action) and isinstance(a.chunk, int) and isinstance(a.microbatch, int)
                     and 0 <= a.chunk < chunks and 0 <= a.microbatch < microbatches and a.op in op_index)
            key_of[ident] = op_index[a.op] * stride + a.chunk * microbatches + a.microbatch if valid else -1
        return tuple(array("q", map(key_of.__getitem__, map(id, acts))) for acts in self.actions)

    def grid(self) -> str:
        """A text grid: one row per pipeline rank, one column per action slot."""
        width = max((len(str(a)) for acts in self.actions for a in acts), default=4)
        rows = []
        for rank, acts in enumerate(self.actions):
            cells = " ".join(str(a).ljust(width) for a in acts)
            rows.append(f"rank {rank} (warmup {self.warmup[rank]:>3}): {cells}")
        return "\n".join(rows)


def _check_positive(name: str, value, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: {fix}")


def build_plan(schedule: str, pp_size: int, num_microbatches: int, num_model_chunks: int = 1,
               group_size: int | None = None, forward_only: bool = False, *,
               max_in_flight: int | tuple[int, ...] | None = None) -> Plan:
    """Build the plan of one step for every pipeline rank.

    Args:
        schedule: a :class:`~engine.plan.schedule.Schedule` or its name: ``"no_pipelining"`` (``P = 1``, one
            chunk), ``"1f1b"`` (one chunk per rank), ``"interleaved"`` (``num_model_chunks`` chunks per rank),
            ``"zb_h1"`` (one chunk per rank, split backward), ``"zbv"`` (V placement, two chunks per rank, split
            backward) or ``"zb"`` (split backward under ``max_in_flight``, looped placement).
        pp_size: pipeline ranks ``P``.
        num_microbatches: ``M >= 1``.
        num_model_chunks: ``C``; 1 for ``"1f1b"`` / ``"zb_h1"``, 2 for ``"zbv"``.
        group_size: ``microbatch_group_size_per_vp_stage`` (interleaved only); defaults to ``P`` like Megatron.
        forward_only: evaluation plan, forwards only (schedule-table order; the same placement for ``"zbv"``).
        max_in_flight: ``"zb"`` only: per-rank limit on activations held (forward done, input-gradient pass not),
            one number for every rank or one per rank; default ``C*(P - r)`` (1F1B's); about ``2P`` gives
            ZB-H2-like plans.  The pending-``W`` limit equals it.

    Raises:
        ValueError: unknown schedule, non-positive sizes, ``P * C * M`` above :data:`MAX_PLAN_FORWARDS`, a chunk
            count the schedule does not take, ``max_in_flight`` given for another schedule or below 1, or
            (interleaved) a group size outside ``[P, M]`` (Megatron's check).
        RuntimeError: (interleaved) ``0 < M mod G < P``, as Megatron raises.
    """
    kind = parse_schedule(schedule)
    _check_sizes(kind, pp_size, num_microbatches, num_model_chunks)
    if max_in_flight is not None and kind is not Schedule.ZB:
        raise ValueError(f"max_in_flight={max_in_flight!r} is for schedule='zb' only (schedule={kind.value!r})")
    if kind.splits_backward:
        from .zero_bubble import zero_bubble_plan  # builds on this module
        return zero_bubble_plan(kind, pp_size, num_microbatches, num_model_chunks, forward_only, max_in_flight)
    return _megatron_plan(kind, pp_size, num_microbatches, num_model_chunks, group_size, forward_only)


_CHUNKS = {Schedule.ONE_F_ONE_B: 1, Schedule.ZB_H1: 1, Schedule.ZBV: 2}
_CHUNK_FIX = {Schedule.NO_PIPELINING: "use '1f1b' or 'interleaved' for pp_size > 1",
              Schedule.ONE_F_ONE_B: "use 'interleaved' for virtual pipeline stages",
              Schedule.ZB_H1: "use 'zbv' (two chunks, V placement) or 'zb' for several chunks per rank",
              Schedule.ZBV: "ZB-V places exactly two model chunks on each rank (virtual pipeline size 2)"}


def _check_sizes(kind: Schedule, pp_size: int, num_microbatches: int, num_model_chunks: int) -> None:
    _check_positive("pp_size", pp_size, "the pipeline needs at least one rank")
    _check_positive("num_microbatches", num_microbatches, "a step needs at least one microbatch")
    _check_positive("num_model_chunks", num_model_chunks, "each rank holds at least one model chunk")
    forwards = pp_size * num_model_chunks * num_microbatches
    if forwards > MAX_PLAN_FORWARDS:
        raise ValueError(f"pp_size={pp_size} x num_model_chunks={num_model_chunks} x num_microbatches="
                         f"{num_microbatches} = {forwards} forwards per step is more than {MAX_PLAN_FORWARDS} (2**24): "
                         "the plan holds every action in memory (~0.5 KB each); use fewer microbatches per step")
    if kind is Schedule.NO_PIPELINING and (pp_size != 1 or num_model_chunks != 1):
        raise ValueError(f"schedule='no_pipelining' runs one model chunk on one rank, got pp_size={pp_size}, "
                         f"num_model_chunks={num_model_chunks}; {_CHUNK_FIX[kind]}")
    elif kind in _CHUNKS and num_model_chunks != _CHUNKS[kind]:
        raise ValueError(f"schedule={kind.value!r} takes {_CHUNKS[kind]} model chunk(s) per rank, got "
                         f"num_model_chunks={num_model_chunks}; {_CHUNK_FIX[kind]}")
    if kind is Schedule.INTERLEAVED and pp_size < 2:
        raise ValueError(f"schedule='interleaved' needs pp_size >= 2, got pp_size={pp_size}; with one pipeline "
                         f"rank use 'no_pipelining' (one model chunk)")


def _megatron_plan(kind: Schedule, pp_size: int, num_microbatches: int, num_model_chunks: int,
                   group_size: int | None, forward_only: bool) -> Plan:
    """No pipelining, 1F1B and interleaved 1F1B: warmup, steady 1F1B, cooldown over the schedule table."""
    if kind is Schedule.INTERLEAVED:
        group_size = pp_size if group_size is None else group_size
        _check_positive("microbatch_group_size_per_vp_stage", group_size, f"use a value in [{pp_size}, "
                        f"{num_microbatches}]")
        validate_interleaved_microbatches(num_microbatches, pp_size, group_size)
    else:
        group_size = num_microbatches if group_size is None else group_size  # one group; irrelevant for C = 1
    table = get_schedule_table(num_microbatches, num_model_chunks, group_size)
    vp_size = num_model_chunks if kind is Schedule.INTERLEAVED else None
    warmups = tuple(pp_rank_microbatches(num_microbatches, num_model_chunks, group_size, pp_size, rank, vp_size,
                                         forward_only=forward_only).num_warmup_microbatches
                    for rank in range(pp_size))
    forwards, backwards, forward_keys, backward_keys = _table_actions(table, num_model_chunks, num_microbatches)
    if forward_only:
        per_rank = (tuple(forwards),) * pp_size
        keys = (forward_keys,) * pp_size
    else:
        per_rank = tuple(tuple(_one_f_one_b(forwards, backwards, w)) for w in warmups)
        keys = tuple(_one_f_one_b(forward_keys, backward_keys, w) for w in warmups)
    plan = Plan(kind, pp_size, num_model_chunks, num_microbatches, group_size, forward_only, warmups, per_rank)
    plan.__dict__["action_keys"] = keys  # pre-filled cache of Plan.action_keys (validator / simulator input)
    return plan


def _table_actions(table, num_model_chunks: int, num_microbatches: int):
    """Forward and backward actions in schedule-table order (one shared object per distinct action) and their keys.

    Backward step ``k`` runs table entry ``k`` with the chunk mirrored (Megatron's ``get_schedule_table``).  Keys as in
    :meth:`Plan.action_keys`.
    """
    forwards = [Action(Op.FORWARD, c, mb) for mb, c in table]
    backwards = [Action(Op.BACKWARD, num_model_chunks - 1 - c, mb) for mb, c in table]
    stride = num_model_chunks * num_microbatches
    forward_keys = array("q", [c * num_microbatches + mb for mb, c in table])
    backward_keys = array("q", [stride + (num_model_chunks - 1 - c) * num_microbatches + mb for mb, c in table])
    return forwards, backwards, forward_keys, backward_keys


def _one_f_one_b(forwards, backwards, warmup: int):
    """Warmup forwards, then steady 1F1B (forward ``i`` then backward ``i - W``), then cooldown backwards.

    The same order as :func:`convert_schedule_table_to_order` (Megatron-Core 0.16.1), built by slicing (lists or arrays).
    """
    total = len(forwards)
    warmup = min(warmup, total)
    steady = total - warmup
    middle = forwards[warmup:] + backwards[:steady]  # the right length and type; overwritten below
    middle[0::2] = forwards[warmup:]
    middle[1::2] = backwards[:steady]
    return forwards[:warmup] + middle + backwards[steady:]
