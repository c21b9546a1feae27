"""The pure Megatron functions against every stored Megatron-Core 0.16.1 vector (values and raised exception types).

``get_pp_rank_microbatches`` is called through ``engine.schedules`` with a fake communicator, as Megatron's
CUDA-graph code calls it.  ``per_rank_order`` vectors check the composition used for CUDA-graph capture:
warmup count -> schedule table -> TE order.
"""
from __future__ import annotations

import pytest

from engine.schedules import convert_schedule_table_to_order, get_pp_rank_microbatches, get_schedule_table

from tests.helpers.megatron_vectors import FakeCommunicator, error_type, vectors

_COUNT_FIELDS = ("total_num_microbatches", "are_all_microbatches_in_warmup", "num_warmup_microbatches",
                 "num_microbatches_remaining")


def _outcome(fn, *args, **kwargs):
    """``("ok", value)`` or ``("raised", exception type)``."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the vectors record the type
        return "raised", type(exc)


def _check_all(cases, compute, expected_of) -> None:
    """Run every case; assert all agree, listing every mismatch (value or exception type)."""
    mismatches = []
    for case in cases:
        expected_error = error_type(case["result"])
        status, got = _outcome(compute, case["args"])
        if expected_error is not None:
            if status != "raised" or not issubclass(got, expected_error):
                mismatches.append((case["args"], f"expected {expected_error.__name__}, got {status} {got!r}"))
        elif status != "ok" or got != expected_of(case["result"]):
            mismatches.append((case["args"], f"expected {expected_of(case['result'])!r}, got {status} {got!r}"))
    assert not mismatches, f"{len(mismatches)} of {len(cases)} vectors differ, first: {mismatches[:3]}"


def test_get_schedule_table_vectors():
    cases = vectors("get_schedule_table")
    assert any(error_type(c["result"]) for c in cases), "the file should hold the G=0 error vector"

    def compute(a):
        table = get_schedule_table(a["num_microbatches"], a["num_model_chunks"],
                                   a["microbatch_group_size_per_vp_stage"])
        return [list(entry) for entry in table]

    _check_all(cases, compute, lambda r: r)


def test_get_schedule_table_error_names_the_fix():
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage=0"):
        get_schedule_table(5, 2, 0)


def test_convert_schedule_table_to_order_vectors():
    cases = vectors("convert_schedule_table_to_order")

    def compute(a):
        table = [tuple(entry) for entry in a["schedule_table"]]
        built = a.get("_table_from")
        if built is not None:  # the stored table is the one get_schedule_table gives
            assert get_schedule_table(built["num_microbatches"], a["num_model_chunks"],
                                      built["microbatch_group_size_per_vp_stage"]) == table
        return convert_schedule_table_to_order(a["num_warmup_microbatches"], a["num_model_chunks"], table)

    _check_all(cases, compute, lambda r: r)


def test_get_pp_rank_microbatches_vectors_through_communicator():
    cases = vectors("get_pp_rank_microbatches")

    def compute(a):
        comm = FakeCommunicator(a["pp_size"], a["pp_rank"], a["vp_size"])
        return get_pp_rank_microbatches(a["num_microbatches"], a["num_model_chunks"],
                                        a["microbatch_group_size_per_vp_stage"], forward_only=a["forward_only"],
                                        overlap_moe_expert_parallel_comm=a["overlap_moe_expert_parallel_comm"],
                                        p2p_communicator=comm)

    _check_all(cases, compute, lambda r: tuple(r[f] for f in _COUNT_FIELDS))


def test_get_pp_rank_microbatches_covers_all_branches():
    """The stored vectors exercise forward-only, MoE overlap, P=1, non-interleaved and interleaved formulas."""
    args = [c["args"] for c in vectors("get_pp_rank_microbatches")]
    assert any(a["forward_only"] for a in args)
    assert any(a["overlap_moe_expert_parallel_comm"] for a in args)
    assert any(a["pp_size"] == 1 for a in args)
    assert any(a["vp_size"] is None and a["pp_size"] > 1 for a in args)
    assert any(a["vp_size"] is not None and a["pp_size"] > 1 for a in args)


def test_per_rank_order_composition_vectors():
    cases = vectors("per_rank_order")

    def compute(a):
        comm = FakeCommunicator(a["pp_size"], a["pp_rank"], a["vp_size"])
        counts = get_pp_rank_microbatches(a["num_microbatches"], a["num_model_chunks"],
                                          a["microbatch_group_size_per_vp_stage"], p2p_communicator=comm)
        assert counts[2] == a["num_warmup_microbatches"], (a, counts)
        table = get_schedule_table(a["num_microbatches"], a["num_model_chunks"],
                                   a["microbatch_group_size_per_vp_stage"])
        return convert_schedule_table_to_order(counts[2], a["num_model_chunks"], table)

    _check_all(cases, compute, lambda r: r)
