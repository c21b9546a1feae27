"""Split-backward graphs hold B's recorded gradients for the pending W passes only (issue 24, item 1).

The gradients a ``B`` graph records for its ``W`` live from that ``B`` to that ``W``.  Their bytes must be bounded by
the plan's peak pending ``W`` per chunk, not grow with the number of microbatches:

* ``emulate`` (counted on the ``meta`` device with the training GPT block): the sets of ``W`` inputs are shared by
  microbatches whose ``B..W`` intervals do not overlap, so the bytes at M = 16 equal those at M = 4 when the peak
  pending ``W`` is the same (zbv on 2 ranks: 2 per chunk at every M);
* ``torch`` (through the fake ``torch.cuda`` of tests/graphs/test_graphs_fallback.py): a slot drops its recorded
  gradients when its ``W`` is captured, so at no point of the capture do more slots hold them than there are
  pending ``W`` passes -- the pool reuses their blocks for graphs replayed after that ``W``.

Replays stay bitwise equal to eager (tests/graphs/test_graphs_split.py runs the same captures against eager).
"""
from __future__ import annotations

import pytest
import torch

from engine.plan import build_plan
from engine.training.config import ModelConfig
from engine.training.models.gpt2.layers import Block
from graphs import capture, capture_order, layer_events
from graphs.accounting import held_bytes
from graphs.backends import torch_cuda
from graphs.backends.common import pending_weight_sets
from graphs.local_rank import WeightQueue
from tests.graphs.test_graphs_emulate import make_chunks, samples
from tests.graphs.test_graphs_fallback import fake_cuda  # noqa: F401 - the fixture

H, HEADS, S, MBS, LAYERS = 32, 4, 16, 2, 2


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs with one thread (fixture in conftest.py)."""


def _meta_split_bytes(schedule: str, pp: int, vp: int, m: int, rank: int = 0) -> tuple[dict, dict]:
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, seq_length=S)
    plan = build_plan(schedule, pp, m, vp)
    chunks = [[Block(cfg, 4 * H).to("meta") for _ in range(LAYERS)] for _ in range(vp)]
    sample = [(torch.ones(S, MBS, H, device="meta", requires_grad=True),) for _ in range(vp * m * LAYERS)]
    layers = capture(chunks, plan, rank, sample, backend="emulate", defer_weight_grad=WeightQueue().defer)
    assert layers.active, layers.report
    held = held_bytes(layers.graphs)
    layers.remove()
    return held, pending_weight_sets(layer_events(capture_order(plan, rank), [LAYERS] * vp))[1]


def test_w_inputs_on_the_meta_device_do_not_grow_with_the_microbatch_count():
    held4, peak4 = _meta_split_bytes("zbv", 2, 2, 4)
    held16, peak16 = _meta_split_bytes("zbv", 2, 2, 16)
    assert peak4 == peak16 and max(peak16.values()) == 2  # the same peak pending W per (chunk, layer)
    assert held16["weight_inputs"] == held4["weight_inputs"] > 0
    per_set = held4["weight_inputs"] // sum(peak4.values())
    assert held4["weight_inputs"] == per_set * sum(peak4.values())
    # the per-slot static buffers (inputs, outputs, their gradients) are per (chunk, microbatch) by design
    assert held16["static_outputs"] == 4 * held4["static_outputs"]


def test_w_inputs_follow_the_peak_pending_w_when_it_changes():
    """zb_h1 on 4 ranks: rank 0 has 1 pending W per layer at M = 4 and 4 at M = 16 -- the bytes follow that."""
    held4, peak4 = _meta_split_bytes("zb_h1", 4, 1, 4)
    held16, peak16 = _meta_split_bytes("zb_h1", 4, 1, 16)
    assert sum(peak4.values()) == 2 and sum(peak16.values()) == 8
    assert held16["weight_inputs"] == 4 * held4["weight_inputs"]


def test_pending_weight_sets_reuses_a_set_once_its_w_ran():
    plan = build_plan("zbv", 2, 6, 2)
    events = layer_events(capture_order(plan, 0), [1, 1])
    assignment, peak = pending_weight_sets(events)
    holder: dict = {}
    for ev in events:  # no set is taken by two microbatches at once
        key = (ev.chunk, ev.layer, assignment[(ev.chunk, ev.microbatch, ev.layer)])
        if ev.kind == "B":
            assert key not in holder, ev
            holder[key] = ev.microbatch
        elif ev.kind == "W":
            assert holder.pop(key) == ev.microbatch
    assert max(peak.values()) < 6


def test_torch_backend_holds_recorded_gradients_only_between_b_and_w(fake_cuda, monkeypatch):  # noqa: F811
    _, _ = fake_cuda
    plan = build_plan("zbv", 2, 8, 2)
    chunks = make_chunks(2, 2)
    holding: list[int] = []
    slots: list = []
    real_b, real_w = torch_cuda.CudaGraphSlot.capture_backward, torch_cuda.CudaGraphSlot.capture_weight

    def count():
        holding.append(sum(1 for s in slots if s.static_weight_inputs))

    def capture_backward(self):
        slots.append(self)
        real_b(self)
        count()

    def capture_weight(self):
        real_w(self)
        count()

    monkeypatch.setattr(torch_cuda.CudaGraphSlot, "capture_backward", capture_backward)
    monkeypatch.setattr(torch_cuda.CudaGraphSlot, "capture_weight", capture_weight)
    layers = capture(chunks, plan, 0, samples(chunks, 8), backend="torch", defer_weight_grad=WeightQueue().defer)
    assert layers.active, layers.report
    peak = pending_weight_sets(layer_events(capture_order(plan, 0), [2, 2]))[1]
    assert max(holding) == sum(peak.values()) < len(layers.graphs.callables)
    assert holding[-1] == 0 and held_bytes(layers.graphs)["weight_inputs"] == 0
    layers.remove()
