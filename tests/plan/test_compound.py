"""Compound actions: several actions of a rank as one schedule cell (torch's ``OVERLAP_F_B``), kept as spans of the
plan's flat action list -- notation, grouping, validation and torch's CSV in and out."""
from __future__ import annotations

import dataclasses

import pytest

from engine.plan import build_plan
from engine.plan.torch_csv import plan_from_csv, plan_to_csv
from engine.plan.types import Action, Compound, Op, parse_cell
from engine.plan.validate import PlanError, validate_plan

# a hand-written 2-rank V-placement schedule (M = 4) with overlapped cells, in torch's compute-only grammar
CSV = ("0F0,0F1,0F2,3F0,3I0,3W0,3F1,(0F3;3B1)OVERLAP_F_B,(3F2;0B0)OVERLAP_F_B,3B2,(3F3;0B1)OVERLAP_F_B,3B3,0I2,0W2,"
       "0I3,0W3\n"
       "1F0,2F0,1F1,2F1,1F2,2B0,(2F2;1B0)OVERLAP_F_B,(1F3;2B1)OVERLAP_F_B,(2F3;1B1)OVERLAP_F_B,2B2,1B2,2I3,1I3,2W3,"
       "1W3\n")


def test_compound_notation_round_trips():
    c = Compound((Action(Op.FORWARD, 0, 3), Action(Op.BACKWARD, 1, 1), Action(Op.WEIGHT, 1, 1)))
    assert str(c) == c.label == "F3.0+B1.1+W1.1"
    assert Compound.parse(str(c)) == c == parse_cell(" F3.0+B1.1+W1.1 ")
    assert parse_cell("B2.1") == Action(Op.BACKWARD, 1, 2)
    for bad in ("F3.0", "F3.0+", "F3.0+X1.1", "+B1.1", 7):
        with pytest.raises(ValueError, match="compound"):
            Compound.parse(bad)


def test_overlapped_cells_import_as_compounds_and_export_back():
    plan = plan_from_csv(CSV)
    assert plan.compounds == (((7, 10), (10, 13), (15, 18)), ((7, 10), (10, 13), (13, 16)))
    cells = plan.cell_labels(0)
    assert cells[7:10] == ["F3.0+B1.1+W1.1", "F2.1+B0.0+W0.0", "B2.1"]
    assert [a for c in plan.cells(1) for a in (c.parts if isinstance(c, Compound) else (c,))] == list(plan.actions[1])
    assert "F2.1+B0.0+W0.0" in plan.grid().splitlines()[1]
    text = plan_to_csv(plan)
    assert text.splitlines()[0].split(",")[7:9] == ["(0F3;3B1)OVERLAP_F_B", "(3F2;0B0)OVERLAP_F_B"]
    assert plan_from_csv(text) == plan
    # an input-gradient pass inside a compound (no W right after it) is torch's I
    split = dataclasses.replace(plan, compounds=(((3, 5),), ()))
    assert plan_to_csv(split).splitlines()[0].split(",")[3:5] == ["(3F0;3I0)OVERLAP_F_B", "3W0"]


def test_bad_compound_spans_are_refused():
    plan = build_plan("zbv", 2, 4, 2)
    validate_plan(dataclasses.replace(plan, compounds=(((0, 2), (2, 5)), ())))
    for spans, why in ((((0, 1),), "two actions"), (((2, 4), (3, 5)), "after the previous"),
                       (((0, 99),), "within the rank")):
        with pytest.raises(PlanError, match=why):
            validate_plan(dataclasses.replace(plan, compounds=(spans, ())))
    with pytest.raises(PlanError, match="one tuple of spans per rank"):
        validate_plan(dataclasses.replace(plan, compounds=((),)))
