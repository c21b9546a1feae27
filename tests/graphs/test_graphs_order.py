"""Capture order, flat graph index and order checks (pure; no processes)."""
from __future__ import annotations

import itertools

import pytest

from engine.plan import build_plan
from engine.plan.table import convert_schedule_table_to_order, get_schedule_table, pp_rank_microbatches
from graphs.order import (LayerEvent, check_order, flat_index, capture_order, layer_events, max_in_flight,
                          order_events, unflat_index)

from tests.helpers.megatron_vectors import vectors


def _grid():
    """(schedule, pp, vp, M, G) covering no pipelining, 1F1B and interleaved (divisible and not, all-warmup)."""
    yield "no_pipelining", 1, 1, 3, None
    for pp, m in [(2, 1), (2, 4), (4, 3), (4, 8)]:
        yield "1f1b", pp, 1, m, None
    for pp, vp, m, g in [(2, 2, 4, 2), (2, 2, 5, 3), (4, 2, 4, 4), (4, 2, 8, 4), (2, 3, 4, 2), (4, 3, 4, 4),
                         (4, 2, 10, 5), (3, 2, 9, 3)]:
        yield "interleaved", pp, vp, m, g


GRID = list(_grid())


@pytest.mark.parametrize("schedule,pp,vp,m,g", GRID)
def test_graph_order_is_runtime_order_and_megatron_order(schedule, pp, vp, m, g):
    plan = build_plan(schedule, pp, m, vp, g)
    for rank in range(pp):
        order = capture_order(plan, rank)
        passes = list(order_events(order))
        assert passes == [(a.op.value, a.chunk, a.microbatch) for a in plan.actions[rank]]
        check_order(order, plan, rank)
        if schedule == "interleaved":
            w = pp_rank_microbatches(m, vp, g, pp, rank, vp).num_warmup_microbatches
            assert order == convert_schedule_table_to_order(w, vp, get_schedule_table(m, vp, g))


def test_graph_order_equals_megatron_traces():
    """Every training trace vector of Megatron-Core 0.16.1: the capture order walks the ranks' compute order."""
    checked = 0
    for v in vectors("trace:megatron.core.pipeline_parallel.schedules."):
        if v["args"].get("forward_only"):
            continue
        a = v["args"]
        if any(r.get("result", {}).get("status") != "ok" for r in v["result"]["per_rank"].values()):
            continue  # Megatron rejected this configuration
        if a["num_microbatches"] < 1:
            continue
        vp = a.get("vp_size") or 1
        schedule = {"non_interleaved": "1f1b"}.get(a["schedule"], a["schedule"])
        plan = build_plan(schedule, a["pp_size"], a["num_microbatches"], vp,
                          a.get("microbatch_group_size_per_vp_stage"))
        for rank, per_rank in v["result"]["per_rank"].items():
            recorded = per_rank.get("compute_order")
            if not recorded:
                continue
            mine = [f"{k}{mb}.{c}" for k, c, mb in order_events(capture_order(plan, int(rank)))]
            assert mine == recorded, (a, rank)
            checked += 1
    assert checked >= 20


def test_docstring_example():
    # Megatron's convert_schedule_table_to_order docstring: PP2 VP2 G3 M5 rank 0
    plan = build_plan("interleaved", 2, 5, 2, 3)
    assert capture_order(plan, 0) == [1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]


def test_flat_index_layout_and_roundtrip():
    lpc, m = [2, 0, 3, 1], 3
    seen = []
    for c, n in enumerate(lpc):
        for mb in range(m):
            for layer in range(n):
                i = flat_index(c, mb, layer, lpc, m)
                assert i == sum(lpc[:c]) * m + mb * n + layer  # Megatron's assignment formula
                assert unflat_index(i, lpc, m) == (c, mb, layer)
                seen.append(i)
    assert seen == list(range(sum(lpc) * m))  # chunk-major, then microbatch, then layer, dense
    with pytest.raises(IndexError):
        unflat_index(sum(lpc) * m, lpc, m)
    with pytest.raises(IndexError):
        flat_index(1, 0, 0, lpc, m)  # chunk 1 has no layers


def test_spec_example_flat_ids():
    """A worked example of the flat graph ids: PP2 VP2 G2 M4 rank 0, two layers per chunk."""
    plan = build_plan("interleaved", 2, 4, 2, 2)
    events = layer_events(capture_order(plan, 0), [2, 2])
    ids = [flat_index(e.chunk, e.microbatch, e.layer, [2, 2], 4) for e in events]
    assert ids[:12] == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 9, 8]
    assert ids[-4:] == [5, 4, 7, 6]
    assert events[10] == LayerEvent("B", 1, 0, 1)


def test_check_order_rejects():
    plan = build_plan("interleaved", 2, 4, 2, 2)
    good = capture_order(plan, 0)
    with pytest.raises(ValueError, match="not causal"):
        check_order([-1, 1] + good[2:])
    with pytest.raises(ValueError, match="differs from the runtime plan of rank 0 at position"):
        check_order(capture_order(plan, 1), plan, 0)
    torch_style = [e for e in good if e > 0] + [e for e in reversed(good) if e < 0]
    with pytest.raises(ValueError, match="differs from the runtime plan"):
        check_order(torch_style, plan, 0)
    with pytest.raises(ValueError, match="exactly num_microbatches"):
        check_order(good[:-1], plan, 0)
    with pytest.raises(TypeError):
        check_order([1.0, -1.0])
    with pytest.raises(ValueError, match="out of range"):
        check_order([3, -3], num_model_chunks=2)
    with pytest.raises(ValueError, match="forward_only"):
        capture_order(build_plan("1f1b", 2, 2, forward_only=True), 0)
    with pytest.raises(ValueError, match="rank"):
        capture_order(plan, 2)


def test_causality_is_exactly_megatron_realisability():
    """convert_schedule_table_to_order is realisable iff W >= (C-1)*min(G, M) (Megatron-Core 0.16.1)."""
    for m, c, g in itertools.product(range(1, 7), range(1, 4), range(1, 7)):
        if g > m:
            continue
        table = get_schedule_table(m, c, g)
        for w in range(0, m * c + 1):
            order = convert_schedule_table_to_order(w, c, table)
            try:
                check_order(order, num_model_chunks=c, num_microbatches=m)
                ok = True
            except ValueError:
                ok = False
            assert ok == (w >= (c - 1) * min(g, m)), (m, c, g, w)


def test_max_in_flight():
    assert max_in_flight([1, -1] * 4) == 1
    assert max_in_flight(capture_order(build_plan("1f1b", 4, 8), 0)) == 4


@pytest.mark.parametrize("schedule,pp,vp,m,g", GRID)
def test_pool_model_capture_in_runtime_order_has_no_conflicts(schedule, pp, vp, m, g):
    from graphs.liveness import pool_conflicts
    plan = build_plan(schedule, pp, m, vp, g)
    for rank in range(pp):
        order = capture_order(plan, rank)
        assert pool_conflicts(order, order, [2] * vp).conflicts == []


def test_pool_model_detects_capture_order_differing_from_runtime():
    """Negative control (B15 of ``tests/runtime/test_public_bugs.py``): torch's fixed capture order, or one swapped (F, B) pair at runtime, lets a
    replay overwrite live activations of another microbatch in the shared pool."""
    from graphs.liveness import pool_conflicts
    plan = build_plan("interleaved", 4, 8, 4, 4)
    order = capture_order(plan, 1)
    torch_style = [e for e in order if e > 0] + [e for e in reversed(order) if e < 0]
    same, torch_model = pool_conflicts(order, order, [1] * 4), pool_conflicts(torch_style, order, [1] * 4)
    assert torch_model.conflicts and torch_model.num_blocks > same.num_blocks
    swapped_with_conflict = 0
    for i in range(len(order) - 1):
        if (order[i] > 0) != (order[i + 1] > 0):
            runtime = list(order)
            runtime[i], runtime[i + 1] = runtime[i + 1], runtime[i]
            try:
                check_order(runtime, num_model_chunks=4, num_microbatches=8)
            except ValueError:
                continue  # not a realisable runtime order
            swapped_with_conflict += bool(pool_conflicts(order, runtime, [1] * 4).conflicts)
    assert swapped_with_conflict > 0
