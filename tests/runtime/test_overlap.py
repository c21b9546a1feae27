"""Overlapped cells (``engine.runtime.overlap``) on one process: the turn order is fixed, the backward can yield
from inside autograd, a failure on either side stops the cell, and the spans show each exchange in flight across
the other side's turn."""
from __future__ import annotations

import pytest
import torch

from engine.profiling.timeline import TimelineRecorder
from engine.runtime.overlap import Cell, CellAborted, exchange, in_cell, overlap_point
from engine.runtime.tracing import use_tracer


class _Work:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(f"wait {self.name}")


def _side(log, name, n):
    def run():
        for i in range(n):
            log.append(f"{name}{i}")
            exchange(lambda i=i: (log.append(f"start {name}{i}"), _Work(log, f"{name}{i}"))[1], f"a2a {i}")
        log.append(f"{name} end")
        return name
    return run


def test_turns_alternate_at_overlap_points_backward_first():
    log = []
    assert Cell(("F", "B")).run(_side(log, "F", 2), _side(log, "B", 3)) == ("F", "B")
    assert log == ["B0", "start B0", "F0", "start F0", "wait B0", "B1", "start B1", "wait F0", "F1", "start F1",
                   "wait B1", "B2", "start B2", "wait F1", "F end",  # the forward is done: no more hand-overs
                   "wait B2", "B end"]
    overlap_point()  # outside a cell: nothing
    assert not in_cell()


class _Yield(torch.autograd.Function):
    """Identity whose backward is an overlap point (as an all-to-all's backward is)."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append("backward yields")
        overlap_point()
        ctx.log.append("backward resumes")
        return grad * 2, None


def test_the_backward_yields_from_inside_autograd():
    log = []
    w = torch.randn(3, requires_grad=True)
    loss = (_Yield.apply(w * 3, log) ** 2).sum()

    def forward():
        log.append("forward runs")
        return (torch.ones(3, requires_grad=True) * 2).sum()  # a forward building its own graph meanwhile

    out, _ = Cell().run(forward, lambda: loss.backward())
    assert log == ["backward yields", "forward runs", "backward resumes"]
    assert out.requires_grad  # grad mode of the calling thread kept for the forward
    torch.testing.assert_close(w.grad, 2 * 2 * (w.detach() * 3) * 3)


@pytest.mark.parametrize("failing", ["forward", "backward"])
def test_a_failure_stops_the_cell_and_is_raised(failing):
    log = []

    def fails():
        log.append(f"{failing} fails")
        raise ValueError(f"boom in {failing}")

    sides = {"forward": _side(log, "F", 3), "backward": _side(log, "B", 3)}
    sides[failing] = fails
    with pytest.raises(ValueError, match=f"boom in {failing}"):
        Cell().run(sides["forward"], sides["backward"])
    assert not any(e.endswith(" end") for e in log)  # the other side stopped at its next overlap point
    assert issubclass(CellAborted, RuntimeError)


def test_spans_turns_and_exchanges_in_flight():
    log = []
    rec = TimelineRecorder()
    with use_tracer(rec):
        Cell(("F3.0", "B1.1"), tracer=rec).run(_side(log, "F", 1), _side(log, "B", 1))
    spans = rec.spans()
    turns = [s.label for s in sorted(spans, key=lambda s: s.start_ns) if s.category == "compute"]
    assert turns == ["B1.1", "F3.0", "B1.1", "F3.0"]
    comm = {s.label: s for s in spans if s.category == "comm"}
    assert set(comm) == {"B1.1 a2a 0", "F3.0 a2a 0"}
    f_turn = min((s for s in spans if s.label == "F3.0"), key=lambda s: s.start_ns)
    b_comm = comm["B1.1 a2a 0"]
    assert b_comm.start_ns <= f_turn.start_ns and f_turn.end_ns <= b_comm.end_ns  # B's exchange spans F's compute
