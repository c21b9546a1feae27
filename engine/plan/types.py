"""The plan's types: :class:`Op`, :class:`Action`, :class:`Message`, :class:`Plan` and the stage placements.

Every schedule builder (:mod:`engine.plan.megatron`, :mod:`engine.plan.zero_bubble`, a user's builder registered
with :func:`engine.plan.register_schedule`) imports this module and nothing of the others, so the builders, the
registry and the analyses (validator, simulator, lowering) form no import circle.

A :class:`Plan` holds, for every pipeline rank, the ordered list of :class:`Action` s that rank performs in one
step -- ``F(chunk, microbatch)``, ``B(chunk, microbatch)`` and, for split-backward schedules, ``W``.  Everything
else is derived from it: the executor runs it, the CUDA-graph capture uses its order, the profiler labels and the
timeline plot name its actions, the validator and simulator read it.

Placement is data: a plan carries its stage -> (rank, chunk) map (:attr:`Plan.placement`).  Megatron's looped
placement puts virtual stage ``c*P + r`` on rank ``r`` as chunk ``c`` (:func:`looped_placement`); the V placement
puts stages ``r`` and ``2P-1-r`` on rank ``r`` (:func:`v_placement`).  Activations flow from stage ``s`` to
``s+1``, gradients back; consecutive stages on one rank hand over locally (a :class:`Message` with ``src == dst``).
Pure: no torch.
"""
from __future__ import annotations

import enum
import re
from array import array
from dataclasses import dataclass
from functools import cached_property

__all__ = ["Op", "Action", "Compound", "parse_cell", "Message", "Plan", "Placement", "MAX_PLAN_FORWARDS", "looped_placement", "v_placement",
           "PLACEMENTS", "placement_of"]

MAX_PLAN_FORWARDS = 2 ** 24
"""Upper bound on ``P * C * M`` (forwards per step over all ranks) accepted by :func:`build_plan`: the plan holds
every action as a Python object (~0.5 KB each), so 2**24 forwards are already ~16 GB and minutes to build."""

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


_COMPOUND = re.compile(r"^[FBW]\d+\.\d+(\+[FBW]\d+\.\d+)+$")


@dataclass(frozen=True, slots=True)
class Compound:
    """Several actions of one rank that form one cell of the schedule, run as their parts in order.

    DualPipeV's overlapped forward and backward (torch's ``OVERLAP_F_B``, DeepSeek-AI, "DeepSeek-V3 Technical
    Report", arXiv:2412.19437, sec. 3.2.1) is the compound of a forward and a full backward, e.g. ``F3.0+B1.1+W1.1``
    (a full backward in a split plan is its ``B`` followed by its ``W``).  Notation: the parts' notations joined by
    ``+``; ``Compound.parse(str(c)) == c``.  A plan keeps its compounds as spans of its flat action list
    (:attr:`Plan.compounds`), so every analysis that reads :attr:`Plan.actions` sees the parts; the runtime runs
    them back to back, in order, as separate steps on CPU.
    """

    parts: tuple[Action, ...]

    def __str__(self) -> str:
        return "+".join(map(str, self.parts))

    @property
    def label(self) -> str:
        """The compound's notation (``str(compound)``)."""
        return str(self)

    @classmethod
    def parse(cls, text: str) -> "Compound":
        """The compound written ``text`` (``"F3.0+B1.1+W1.1"``).

        Raises:
            ValueError: ``text`` is not two or more actions joined by ``+``.
        """
        if not isinstance(text, str) or _COMPOUND.match(text.strip()) is None:
            raise ValueError(f"{text!r} is not a compound action: write actions joined by '+', e.g. F3.0+B1.1")
        return cls(tuple(Action.parse(part) for part in text.strip().split("+")))


def parse_cell(text: str) -> "Action | Compound":
    """An action (``"F3.1"``) or a compound (``"F3.0+B1.1"``) from its notation.

    Raises:
        ValueError: ``text`` is neither.
    """
    if isinstance(text, str) and "+" in text:
        return Compound.parse(text)
    return Action.parse(text)


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
        schedule: the name of the schedule that built the plan (an entry of :mod:`engine.plan.registry`), or the
            name an importer gave it (:mod:`engine.plan.torch_csv`).
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
        compounds: per rank, the ``(start, stop)`` spans of :attr:`actions` that form one :class:`Compound` each
            (sorted, disjoint, two actions or more), or ``None`` (no compound).  The actions stay flat, so the
            analyses and the executor run the parts; :meth:`cells` groups them.
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
    compounds: tuple[tuple[tuple[int, int], ...], ...] | None = None

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

    @cached_property
    def splits_backward(self) -> bool:
        """The plan runs split weight-gradient (``W``) passes: ``B`` is then the input-gradient pass only."""
        return any(a.op is Op.WEIGHT for acts in self.actions for a in acts)

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
    def te_order(self, rank: int) -> list[int]:
        """The rank's order in Transformer Engine notation (forward chunk ``c`` as ``c+1``, backward as ``-(c+1)``)."""
        return [(a.chunk + 1) if a.op is Op.FORWARD else -(a.chunk + 1)
                for a in self.actions[rank] if a.op is not Op.WEIGHT]

    def action_labels(self, rank: int) -> list[str]:
        """The rank's actions in trace notation (``"F3.1"``, Megatron-Core's trace notation)."""
        return [str(a) for a in self.actions[rank]]

    def compound_spans(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The rank's compound spans (:attr:`compounds`; empty when it has none)."""
        return () if self.compounds is None else tuple(self.compounds[rank])

    def cells(self, rank: int) -> list:
        """The rank's schedule cells in order: each an :class:`Action`, or a :class:`Compound` of the actions of one
        of its spans."""
        acts, out, at = self.actions[rank], [], 0
        for start, stop in self.compound_spans(rank):
            out.extend(acts[at:start])
            out.append(Compound(tuple(acts[start:stop])))
            at = stop
        out.extend(acts[at:])
        return out

    def overlap_cells(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The rank's compound spans that can run overlapped (one microbatch's forward with another's backward,
        :mod:`engine.runtime.overlap`): one forward and one backward ``B`` of another (chunk, microbatch), and
        optionally that backward's ``W`` after it -- DualPipeV's ``F+B+W`` and Megatron's combined-1F1B ``F+B``
        cells.  Other compounds run part after part."""
        acts, out = self.actions[rank], []
        for start, stop in self.compound_spans(rank):
            parts = acts[start:stop]
            f = [i for i, a in enumerate(parts) if a.op is Op.FORWARD]
            b = [i for i, a in enumerate(parts) if a.op is Op.BACKWARD]
            w = [i for i, a in enumerate(parts) if a.op is Op.WEIGHT]
            if len(f) != 1 or len(b) != 1 or len(w) > 1:
                continue
            key = (parts[b[0]].chunk, parts[b[0]].microbatch)
            if (parts[f[0]].chunk, parts[f[0]].microbatch) == key or (
                    w and ((parts[w[0]].chunk, parts[w[0]].microbatch) != key or w[0] < b[0])):
                continue
            out.append((start, stop))
        return tuple(out)

    def cell_labels(self, rank: int) -> list[str]:
        """The rank's cells in notation (``"F3.1"``, ``"F3.0+B1.1"``)."""
        return [str(c) for c in self.cells(rank)]

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
        """A text grid: one row per pipeline rank, one column per cell (an action, or a compound in its notation)."""
        labels = [self.cell_labels(rank) for rank in range(len(self.actions))]
        width = max((len(c) for row in labels for c in row), default=4)
        rows = []
        for rank, row in enumerate(labels):
            cells = " ".join(c.ljust(width) for c in row)
            rows.append(f"rank {rank} (warmup {self.warmup[rank]:>3}): {cells}")
        return "\n".join(rows)


PLACEMENTS = ("looped", "v")
"""The stage placements a schedule entry can name (:func:`placement_of`)."""


def placement_of(kind: str, pp_size: int, num_model_chunks: int) -> Placement:
    """The stage map of placement ``kind`` (``"looped"``: :func:`looped_placement`, ``"v"``: :func:`v_placement`,
    which needs ``num_model_chunks == 2``).

    Raises:
        ValueError: an unknown kind, or the V placement with another chunk count.
    """
    if kind == "looped":
        return looped_placement(pp_size, num_model_chunks)
    if kind == "v":
        if num_model_chunks != 2:
            raise ValueError(f"the V placement holds two model chunks per rank, got num_model_chunks="
                             f"{num_model_chunks}")
        return v_placement(pp_size)
    raise ValueError(f"placement={kind!r} is unknown; use one of {', '.join(PLACEMENTS)}")
