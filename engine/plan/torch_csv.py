"""Schedules from and to torch.distributed.pipelining's action-grammar CSV (the compute-only form).

torch writes one row per pipeline rank and one cell per action slot, each action ``<stage><type><microbatch>``:
``F`` forward, ``I`` input-gradient backward, ``W`` weight-gradient backward, ``B`` full backward (torch's
``_Action`` notation, e.g. ``2F0``, ``1I3``); an empty cell is an idle slot.  An imported schedule becomes a
:class:`~engine.plan.build.Plan`: the ranks are the rows; each rank's stages, in increasing order, are its model
chunks 0, 1, ... (so Megatron's looped placement and the V placement come out as themselves); ``I`` is pipecast's
``B`` of a split plan, and a full ``B`` in a plan with ``W`` passes becomes a ``B`` followed at once by its ``W``.
The plan is then checked like every plan (:func:`engine.plan.validate.validate_plan`: data flow, deadlock, memory),
so a bad schedule is refused with the first bad action named in pipecast's notation (``B3.1`` = microbatch 3 of
chunk 1) and its place in the grid.  Pure: no torch.
"""
from __future__ import annotations

import csv
import io
import re

from .build import Action, Op, Plan

__all__ = ["plan_from_csv", "plan_to_csv", "CsvScheduleError"]

_CELL = re.compile(r"^(\d+)(F|I|W|B)(\d+)$")


class CsvScheduleError(ValueError):
    """A CSV schedule that cannot be read: names the row (pipeline rank), column and cell."""


def _parse_rows(text: str) -> list[list[tuple[int, str, int]]]:
    rows = []
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        actions = []
        for col, cell in enumerate(row):
            cell = cell.strip()
            if cell in ("", "None"):
                continue
            m = _CELL.match(cell)
            if m is None:
                raise CsvScheduleError(f"row {r} (pipeline rank {r}), column {col}: {cell!r} is not a compute action "
                                       "<stage><F|I|W|B><microbatch> (e.g. 2F0); only the compute-only form is read")
            actions.append((int(m.group(1)), m.group(2), int(m.group(3))))
        rows.append(actions)
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise CsvScheduleError("the CSV holds no action; write one row of actions per pipeline rank")
    return rows


def _placement(rows) -> tuple[tuple[int, int], ...]:
    """Stage -> ``(rank, chunk)``: each rank's stages in increasing order are its chunks."""
    owner: dict[int, int] = {}
    for r, actions in enumerate(rows):
        for stage, _, _ in actions:
            if owner.setdefault(stage, r) != r:
                raise CsvScheduleError(f"stage {stage} appears on pipeline ranks {owner[stage]} and {r}; each stage "
                                       "lives on one rank")
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
        kinds = {(s, t, m) for s, t, m in actions}
        for s, t, m in sorted(kinds):
            other = {"I": "W", "W": "I"}.get(t)
            if other is not None and (s, other, m) not in kinds:
                raise CsvScheduleError(f"row {r} (pipeline rank {r}): {s}{t}{m} has no {s}{other}{m}; a split backward "
                                       "needs both the input-gradient (I) and the weight-gradient (W) pass")


def plan_from_csv(text: str, name: str = "csv") -> Plan:
    """The plan of a compute-only CSV schedule (module doc); checked by the validator before it is returned.

    Raises:
        CsvScheduleError: a cell that is not a compute action, a stage on two ranks, missing stages or unequal
            chunk counts (names row, column or stage).
        PlanError: the schedule is incomplete, out of order, routes data wrongly or deadlocks (names the rank and
            the first bad action).
    """
    from .validate import validate_plan  # the validator builds on the plan module, as this one does
    rows = _parse_rows(text)
    placement = _placement(rows)
    where = {s: loc for s, loc in enumerate(placement)}
    split = any(t in "IW" for actions in rows for _, t, _ in actions)
    _check_pairs(rows)
    per_rank = []
    for r, actions in enumerate(rows):
        acts = []
        for stage, kind, mb in actions:
            chunk = where[stage][1]
            if kind == "F":
                acts.append(Action(Op.FORWARD, chunk, mb))
            elif kind in "IB":
                acts.append(Action(Op.BACKWARD, chunk, mb))
                if kind == "B" and split:
                    acts.append(Action(Op.WEIGHT, chunk, mb))
            else:
                acts.append(Action(Op.WEIGHT, chunk, mb))
        per_rank.append(tuple(acts))
    num_microbatches = 1 + max(mb for actions in rows for _, _, mb in actions)
    chunks = len(placement) // len(rows)
    warmup = tuple(next((i for i, a in enumerate(acts) if a.op is not Op.FORWARD), len(acts)) for acts in per_rank)
    forward_only = not any(a.op is not Op.FORWARD for acts in per_rank for a in acts)
    plan = Plan(name, len(rows), chunks, num_microbatches, num_microbatches, forward_only, warmup, tuple(per_rank),
                placement)
    validate_plan(plan)
    return plan


def plan_to_csv(plan: Plan) -> str:
    """``plan`` as a compute-only CSV in torch's action grammar: split plans write ``I`` and ``W``, unsplit ones
    ``B`` for the backward."""
    split = plan.splits_backward
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank, acts in enumerate(plan.actions):
        cells = []
        for a in acts:
            kind = {Op.FORWARD: "F", Op.WEIGHT: "W"}.get(a.op, "I" if split else "B")
            cells.append(f"{plan.stage(rank, a.chunk)}{kind}{a.microbatch}")
        writer.writerow(cells)
    return out.getvalue()
