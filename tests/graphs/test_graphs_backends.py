"""The backend protocol and registry (issue 23 item 6): a backend defined in this test module, registered by name,
is taken by ``graphs.capture``; an unavailable one's reason reaches the fallback log line and the report."""
from __future__ import annotations

import copy
import logging

import pytest

from engine.plan import build_plan
from graphs import backends, capture
from graphs.backends.emulate import EmulatedSlot, warmup_context
from graphs.local_rank import WeightQueue, make_rank_data
from tests.graphs.test_graphs_emulate import B, H, S, bitwise_equal, make_chunks, run_steps, samples


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


class FakeBackend:
    """A static-buffer backend of this module: the emulate slots under another name, recording its captures."""

    supports_split_backward = True
    needs_cuda_tensors = False

    def __init__(self, name: str, reason: str | None = None, splits: bool = True):
        self.name, self.reason, self.supports_split_backward = name, reason, splits
        self.jobs = []

    def unavailable_reason(self):
        return self.reason

    def split_backward_reason(self):
        return f"{self.name} has no W graphs"

    def capture(self, job, capture_slots):
        self.jobs.append(job)
        graphs = capture_slots(EmulatedSlot, warmup_context)
        graphs.backend = self.name
        return graphs


@pytest.fixture
def register():
    added = []

    def add(backend):
        backends.register_backend(backend)
        added.append(backend.name)
        return backend

    yield add
    for name in added:
        backends.unregister_backend(name)


def test_registered_backend_is_picked_by_name(register):
    fake = register(FakeBackend("fake_static"))
    assert "fake_static" in backends.backend_names()
    plan = build_plan("1f1b", 2, 4)
    eager = make_chunks(1, 2)
    graphed = copy.deepcopy(eager)
    layers = capture(graphed, plan, 0, samples(graphed, 4), backend="fake_static")
    assert layers.active and layers.report.backend == "fake_static" and layers.report.reason is None
    assert len(fake.jobs) == 1 and fake.jobs[0].order == layers.report.order
    data = make_rank_data(1, 4, (S, B, H))
    assert bitwise_equal(run_steps(eager, plan, 0, data, 2), run_steps(graphed, plan, 0, data, 2))


def test_unavailable_backend_reason_reaches_the_fallback_log(register, caplog):
    fake = register(FakeBackend("fake_absent", reason="the fake widget is not plugged in"))
    plan = build_plan("1f1b", 2, 2)
    graphed = make_chunks(1, 1)
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        layers = capture(graphed, plan, 0, samples(graphed, 2), backend="fake_absent")
    assert not layers.active and not fake.jobs
    assert layers.report.reason == "the fake widget is not plugged in"
    lines = [r.getMessage() for r in caplog.records if r.name == "pipecast.graphs"]
    assert len(lines) == 1 and "the fake widget is not plugged in" in lines[0] and "running eagerly" in lines[0]


def test_split_plan_on_backend_without_split_support_falls_back_with_its_reason(register, caplog):
    fake = register(FakeBackend("fake_no_w", splits=False))
    plan = build_plan("zbv", 2, 4, 2)
    graphed = make_chunks(2, 1)
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        layers = capture(graphed, plan, 0, samples(graphed, 4), backend="fake_no_w",
                         defer_weight_grad=WeightQueue().defer)
    assert not layers.active and not fake.jobs and layers.report.reason == "fake_no_w has no W graphs"
    assert any("fake_no_w has no W graphs" in r.getMessage() for r in caplog.records)


def test_registry_refuses_non_backends_and_names_the_registered_ones(register):
    with pytest.raises(TypeError, match="graphs.backends.Backend"):
        backends.register_backend(object())
    register(FakeBackend("fake_named"))
    with pytest.raises(ValueError, match="fake_named"):
        capture(make_chunks(1, 1), build_plan("1f1b", 2, 2), 0, samples(make_chunks(1, 1), 2), backend="nope")
