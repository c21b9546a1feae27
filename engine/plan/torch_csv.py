"""Schedules from and to torch.distributed.pipelining's action-grammar CSV (the compute-only form).

torch writes one row per pipeline rank and one cell per action slot, each action ``<stage><type><microbatch>``:
``F`` forward, ``I`` input-gradient backward, ``W`` weight-gradient backward, ``B`` full backward (torch's
``_Action`` notation, e.g. ``2F0``, ``1I3``); an empty cell is an idle slot.  Two more cells of torch's own
schedules are read: DualPipeV's ``(0F3;3B1)OVERLAP_F_B`` is its sub-actions in order (how torch runs it without a
custom overlap function), kept as one :class:`~engine.plan.types.Compound` (:attr:`Plan.compounds`), and ``<stage>REDUCE_GRAD`` (torch's single-stage schedules end each stage with it) is
dropped: pipecast syncs a chunk's gradients after its last backward pass in any case.  An imported schedule becomes a
:class:`~engine.plan.build.Plan`: the ranks are the rows; each rank's stages, in increasing order, are its model
chunks 0, 1, ... (so Megatron's looped placement and the V placement come out as themselves); ``I`` is pipecast's
``B`` of a split plan, and a full ``B`` in a plan with ``W`` passes becomes a ``B`` followed at once by its ``W``.
The microbatches are those stage 0 forwards (``0..M-1``); a cell of another microbatch is refused.  The plan is
then checked like every plan (:func:`engine.plan.validate.validate_plan`: data flow, deadlock, memory), so a bad
schedule is refused with the first bad action named in pipecast's notation (``B3.1`` = microbatch 3 of chunk 1) and
its cell in the grid (``[CSV row 0, column 5: '3F1']``; columns count idle cells).  torch 2.13's
``Schedule1F1B.pipeline_order`` is refused this way: its last rank forwards microbatches ``1..M``.  Export writes a
plan's compounds back as ``OVERLAP_F_B`` cells (a ``B`` followed by its ``W`` inside one as torch's full ``B``).
Pure: no torch.
"""
from __future__ import annotations

import csv
import io
import re
from typing import NamedTuple

from .types import Action, Op, Plan
from .validate import PlanError, validate_plan

__all__ = ["plan_from_csv", "plan_to_csv", "CsvScheduleError"]

_CELL = re.compile(r"^(\d+)(F|I|W|B)(\d+)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_REDUCE = re.compile(r"^(\d+)REDUCE_GRAD$")


class CsvScheduleError(ValueError):
    """A CSV schedule that cannot be read: names the row (pipeline rank), column and cell."""


class _Cell(NamedTuple):
    """One compute action read from the grid: torch's stage, ``F``/``I``/``W``/``B``, microbatch, and where it
    stood (``col``, the cell's text; a sub-action of an overlapped cell shares its cell)."""
    stage: int
    kind: str
    mb: int
    col: int
    text: str

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def _compute(text: str, col: int, cell: str, where: str) -> _Cell:
    m = _CELL.match(text)
    if m is None:
        raise CsvScheduleError(f"{where}: {text!r} is not a compute action <stage><F|I|W|B><microbatch> (e.g. 2F0); "
                               "only the compute-only form is read (pipecast derives the transfers itself: drop "
                               "SEND_/RECV_/UNSHARD/RESHARD cells)")
    return _Cell(int(m.group(1)), m.group(2), int(m.group(3)), col, cell)


def _parse_row(r: int, row: list[str]) -> list[_Cell]:
    """One rank's compute actions in order.  ``(a;b)OVERLAP_F_B`` (DualPipeV's overlapped forward and backward)
    becomes its sub-actions in order, as torch runs it without a custom overlap function; ``<stage>REDUCE_GRAD``
    (torch's gradient reduction after a stage's last backward) is dropped, since pipecast syncs each chunk's
    gradients after its last backward pass anyway -- but it must come after that stage's backward passes."""
    actions, reduced = [], {}
    for col, cell in enumerate(row):
        cell, where = cell.strip(), f"row {r} (pipeline rank {r}), column {col}"
        if cell in ("", "None"):
            continue
        overlap, reduce = _OVERLAP.match(cell), _REDUCE.match(cell)
        if overlap is not None:
            subs = overlap.group(1).split(";")
            actions += [_compute(sub.strip(), col, cell, f"{where}, in {cell!r}") for sub in subs]
        elif reduce is not None:
            reduced.setdefault(int(reduce.group(1)), (col, cell, len(actions)))
        else:
            actions.append(_compute(cell, col, cell, where))
    for stage, (col, cell, at) in reduced.items():
        later = next((a for a in actions[at:] if a.stage == stage and a.kind != "F"), None)
        if later is not None:
            raise CsvScheduleError(f"row {r} (pipeline rank {r}), column {col}: {cell} comes before {later} (column "
                                   f"{later.col}); a stage's gradients are reduced after its last backward pass, so "
                                   "move REDUCE_GRAD after it (or drop it)")
    return actions


def _parse_rows(text: str) -> list[list[_Cell]]:
    rows = [_parse_row(r, row) for r, row in enumerate(csv.reader(io.StringIO(text)))]
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise CsvScheduleError("the CSV holds no action; write one row of actions per pipeline rank")
    return rows


def _placement(rows) -> tuple[tuple[int, int], ...]:
    """Stage -> ``(rank, chunk)``: each rank's stages in increasing order are its chunks."""
    owner: dict[int, int] = {}
    for r, actions in enumerate(rows):
        for a in actions:
            if owner.setdefault(a.stage, r) != r:
                raise CsvScheduleError(f"stage {a.stage} appears on pipeline ranks {owner[a.stage]} and {r} (row {r}, "
                                       f"column {a.col}: {a.text!r}); each stage lives on one rank")
    stages = sorted(owner)
    if stages != list(range(len(stages))):
        raise CsvScheduleError(f"the stages are {stages}; a pipeline of S stages uses stages 0..S-1")
    per_rank = [sorted(s for s, o in owner.items() if o == r) for r in range(len(rows))]
    if len({len(p) for p in per_rank}) != 1:
        raise CsvScheduleError(f"the ranks hold {[len(p) for p in per_rank]} stages; pipecast places the same "
                               "number of model chunks on every rank")
    placement = [None] * len(stages)
    for r, mine in enumerate(per_rank):
        for c, s in enumerate(mine):
            placement[s] = (r, c)
    return tuple(placement)


def _check_pairs(rows) -> None:
    """Every input-gradient pass ``I`` has its weight-gradient pass ``W`` and the reverse (same stage and
    microbatch)."""
    for r, actions in enumerate(rows):
        kinds = {(a.stage, a.kind, a.mb) for a in actions}
        for a in actions:
            other = {"I": "W", "W": "I"}.get(a.kind)
            if other is not None and (a.stage, other, a.mb) not in kinds:
                raise CsvScheduleError(f"row {r} (pipeline rank {r}), column {a.col}: {a} has no "
                                       f"{a.stage}{other}{a.mb}; a split backward needs both the input-gradient (I) "
                                       "and the weight-gradient (W) pass")


def _num_microbatches(rows) -> int:
    """``M``: the microbatches stage 0 forwards are 0..M-1 (no gaps: ``M`` is at most the number of cells, so a
    huge microbatch number is refused before it sizes anything); an action of another microbatch is refused."""
    firsts = [a.mb for actions in rows for a in actions if a.stage == 0 and a.kind == "F"]
    if not firsts:
        raise CsvScheduleError("no cell forwards stage 0 (0F<microbatch>); stage 0 forwards each microbatch 0..M-1 "
                               "once, so a schedule without it runs nothing")
    M = 1 + max(firsts)
    if M > len(firsts):  # a gap: checked before M sizes anything (0F99999999999999999999 is one cell, not 1e20)
        missing = min(set(range(len(firsts) + 1)) - set(firsts))
        r, top = next((r, a) for r, actions in enumerate(rows) for a in actions
                      if a.stage == 0 and a.kind == "F" and a.mb == M - 1)
        raise CsvScheduleError(f"row {r} (pipeline rank {r}), column {top.col}: {top} is microbatch {top.mb}, but "
                               f"stage 0 forwards no microbatch {missing}; stage 0 forwards each microbatch 0..M-1 "
                               "once (number them from 0 without gaps)")
    for r, actions in enumerate(rows):
        bad = next((a for a in actions if a.mb >= M), None)
        if bad is not None:
            raise CsvScheduleError(f"row {r} (pipeline rank {r}), column {bad.col}: {bad} is microbatch {bad.mb}, "
                                   f"but stage 0 forwards microbatches 0..{M - 1}; every stage runs the same "
                                   "microbatches")
    return M


def _lower(rows, placement) -> tuple[list[tuple[Action, ...]], list[list[_Cell]]]:
    """Per rank, pipecast's actions and, for each, the cell it came from (a full ``B`` in a split plan gives a
    ``B`` and a ``W``, both from its cell)."""
    split = any(a.kind in "IW" for actions in rows for a in actions)
    per_rank, origin = [], []
    for actions in rows:
        acts, came = [], []
        for a in actions:
            chunk = placement[a.stage][1]
            ops = {"F": (Op.FORWARD,), "I": (Op.BACKWARD,), "W": (Op.WEIGHT,),
                   "B": (Op.BACKWARD, Op.WEIGHT) if split else (Op.BACKWARD,)}[a.kind]
            acts += [Action(op, chunk, a.mb) for op in ops]
            came += [a] * len(ops)
        per_rank.append(tuple(acts))
        origin.append(came)
    return per_rank, origin


def _compound_spans(origin):
    """Per rank, the ``(start, stop)`` spans of the actions that came from one ``OVERLAP_F_B`` cell; ``None`` when
    no rank has one."""
    spans = []
    for came in origin:
        mine, i = [], 0
        while i < len(came):
            j = i + 1
            while j < len(came) and came[j].col == came[i].col:
                j += 1
            if _OVERLAP.match(came[i].text) is not None and j - i >= 2:
                mine.append((i, j))
            i = j
        spans.append(tuple(mine))
    return tuple(spans) if any(spans) else None


def plan_from_csv(text: str, name: str = "csv") -> Plan:
    """The plan of a compute-only CSV schedule (module doc); checked by the validator before it is returned.

    Raises:
        CsvScheduleError: a cell that is not a compute action, a stage on two ranks, missing stages, unequal
            chunk counts, a microbatch stage 0 does not forward, an ``I`` without its ``W`` or a ``REDUCE_GRAD``
            before its stage's last backward (names row, column and cell).
        PlanError: the schedule is incomplete, out of order, routes data wrongly or deadlocks (names the rank, the
            first bad action and, for an action that has a cell, its row and column in the CSV).
    """
    rows = _parse_rows(text)
    placement = _placement(rows)
    _check_pairs(rows)
    num_microbatches = _num_microbatches(rows)
    per_rank, origin = _lower(rows, placement)
    chunks = len(placement) // len(rows)
    warmup = tuple(next((i for i, a in enumerate(acts) if a.op is not Op.FORWARD), len(acts)) for acts in per_rank)
    forward_only = not any(a.op is not Op.FORWARD for acts in per_rank for a in acts)
    plan = Plan(name, len(rows), chunks, num_microbatches, num_microbatches, forward_only, warmup, tuple(per_rank),
                placement, compounds=_compound_spans(origin))
    try:
        validate_plan(plan)
    except PlanError as exc:
        if exc.rank is None or exc.index is None or exc.index >= len(origin[exc.rank]):
            raise
        cell = origin[exc.rank][exc.index]
        raise PlanError(exc.rank, exc.index, exc.action,
                        f"{exc.reason} [CSV row {exc.rank}, column {cell.col}: {cell.text!r}]") from None
    return plan


def plan_to_csv(plan: Plan) -> str:
    """``plan`` as a compute-only CSV in torch's action grammar: split plans write ``I`` and ``W``, unsplit ones
    ``B`` for the backward; a compound is one ``(a;b)OVERLAP_F_B`` cell, where a ``B`` followed by its own ``W`` is
    torch's full backward ``B``."""
    split = plan.splits_backward
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in range(plan.pp_size):
        cells = []
        for cell in plan.cells(rank):
            if isinstance(cell, Action):
                cells.append(_torch_action(plan, rank, cell, "I" if split else "B"))
            else:
                cells.append(f"({';'.join(_torch_parts(plan, rank, cell.parts, split))})OVERLAP_F_B")
        writer.writerow(cells)
    return out.getvalue()


def _torch_action(plan: Plan, rank: int, a: Action, backward: str) -> str:
    kind = {Op.FORWARD: "F", Op.WEIGHT: "W"}.get(a.op, backward)
    return f"{plan.stage(rank, a.chunk)}{kind}{a.microbatch}"


def _torch_parts(plan: Plan, rank: int, parts, split: bool) -> list[str]:
    """A compound's parts as torch's sub-actions: ``B`` then its ``W`` is one full ``B``."""
    out, i = [], 0
    while i < len(parts):
        a = parts[i]
        full = (a.op is Op.BACKWARD and i + 1 < len(parts) and parts[i + 1] == Action(Op.WEIGHT, a.chunk, a.microbatch))
        out.append(_torch_action(plan, rank, a, "B" if full or not split else "I"))
        i += 2 if full else 1
    return out
