"""Megatron-exact schedule arithmetic: warmup counts, the schedule table and the CUDA-graph order.

Pure functions (no torch.distributed).  Their results equal Megatron-Core 0.16.1
(``pipeline_parallel.schedules.get_pp_rank_microbatches`` / ``get_schedule_table`` and
``transformer.cuda_graphs.convert_schedule_table_to_order``) on every vector in
``tests/data/megatron_schedules.json`` (``tests/plan/test_vectors_pure.py``).

Notation: ``P`` pipeline size, ``r`` pipeline rank, ``C`` model chunks per rank (virtual pipeline size),
``M`` microbatches, ``G`` = ``microbatch_group_size_per_vp_stage``, ``T = M * C`` virtual microbatches,
``W`` warmup forward steps, ``R = T - W`` steady (1F1B) steps.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "MicrobatchCounts",
    "pp_rank_microbatches",
    "get_schedule_table",
    "convert_schedule_table_to_order",
    "validate_interleaved_microbatches",
]


class MicrobatchCounts(NamedTuple):
    """``(T, all_warmup, W, R)`` as returned by Megatron's ``get_pp_rank_microbatches``."""

    total_num_microbatches: int
    are_all_microbatches_in_warmup: bool
    num_warmup_microbatches: int
    num_microbatches_remaining: int


def pp_rank_microbatches(num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int,
                         pp_size: int, pp_rank: int, vp_size: int | None, forward_only: bool = False,
                         overlap_moe_expert_parallel_comm: bool = False) -> MicrobatchCounts:
    """Warmup / steady counts of one pipeline rank, with the pipeline topology given explicitly.

    Formula (Megatron-Core 0.16.1, ``get_pp_rank_microbatches``): ``T = M*C``; raw warmup ``w`` is ``T`` when forward-only,
    ``P-r-1`` for 1F1B (``vp_size`` None), ``2(P-r-1) + (C-1)G (+1 with MoE overlap)`` for interleaved 1F1B and
    ``0`` when ``P == 1``; ``W = min(w, T)``.  Like Megatron, it validates nothing.
    """
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    elif pp_size > 1 and vp_size is None:
        warmup = pp_size - pp_rank - 1
    elif pp_size > 1:
        warmup = 2 * (pp_size - pp_rank - 1) + (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
        warmup += int(bool(overlap_moe_expert_parallel_comm))
    else:
        warmup = 0
    all_warmup = warmup >= total
    warmup = total if all_warmup else warmup
    return MicrobatchCounts(total, all_warmup, warmup, total - warmup)


def get_schedule_table(num_microbatches: int, num_model_chunks: int,
                       microbatch_group_size_per_vp_stage: int) -> list[tuple[int, int]]:
    """Forward execution order of one rank as ``[(microbatch_id, model_chunk_id), ...]`` of length ``M*C``.

    Microbatches run in groups of ``G``; within a group every model chunk runs in turn; the last group is truncated
    to ``M`` (Megatron-Core 0.16.1, ``get_schedule_table``).  The backward order is the same table with the chunk mirrored
    (``C-1-chunk``).  Example: ``M=5, C=2, G=3`` -> ``(0,0) (1,0) (2,0) (0,1) (1,1) (2,1) (3,0) (4,0) (3,1) (4,1)``.

    Raises:
        ValueError: ``microbatch_group_size_per_vp_stage`` is 0 (Megatron raises the same, from ``range``).
    """
    if microbatch_group_size_per_vp_stage == 0:
        raise ValueError("microbatch_group_size_per_vp_stage=0: the schedule table needs groups of at least one "
                         "microbatch; set microbatch_group_size_per_vp_stage >= 1 (usually the pipeline size)")
    table = []
    for start in range(0, num_microbatches, microbatch_group_size_per_vp_stage):
        end = min(start + microbatch_group_size_per_vp_stage, num_microbatches)
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in range(start, end))
    return table


def convert_schedule_table_to_order(num_warmup_microbatches: int, num_model_chunks: int,
                                    schedule_table: list[tuple[int, int]]) -> list[int]:
    """Per-rank execution order of forward/backward passes, in Transformer Engine's ``_order`` notation.

    Entry ``+(c+1)`` is a forward of model chunk ``c``, ``-(c+1)`` a backward of chunk ``c`` (1-based, sign =
    direction).  The first ``W`` entries are warmup forwards; then forward ``i`` and backward ``i-W`` alternate
    (steady 1F1B); the last ``W`` backwards form the cooldown.  Length ``2*len(table)`` for ``0 <= W <= T``;
    ``W > T`` behaves as ``W = T``.  Source: Megatron-Core 0.16.1 ``transformer/cuda_graphs.py``.
    No validation: the order is realisable only when ``W >= (C-1)*min(G, M)``.
    """
    chunks = [chunk for _, chunk in schedule_table]
    forwards = [chunk + 1 for chunk in chunks]
    backwards = [chunk - num_model_chunks for chunk in chunks]
    warmup = num_warmup_microbatches
    order = forwards[:warmup]
    for i in range(warmup, len(forwards)):
        order += [forwards[i], backwards[i - warmup]]
    if warmup > 0:
        order += backwards[-warmup:]
    return order


def validate_interleaved_microbatches(num_microbatches: int, pp_size: int, group_size: int) -> None:
    """Megatron's checks of M against ``microbatch_group_size_per_vp_stage`` for interleaved 1F1B (Megatron-Core 0.16.1, ``megatron/core/pipeline_parallel/schedules.py``).

    Raises:
        ValueError: ``G > M`` or ``G < P`` (allowed range ``[P, M]``).
        RuntimeError: ``0 < M mod G < P`` (the last group would be shorter than the pipeline).
    """
    if group_size > num_microbatches or group_size < pp_size:
        raise ValueError(
            f"microbatch_group_size_per_vp_stage={group_size} is out of range for num_microbatches="
            f"{num_microbatches} and pipeline_model_parallel_size={pp_size}: interleaved 1F1B needs "
            f"{pp_size} <= microbatch_group_size_per_vp_stage <= num_microbatches; set it in [{pp_size}, "
            f"{num_microbatches}]" + ("" if num_microbatches >= pp_size else
                                      f" (that needs num_microbatches >= {pp_size})"))
    remainder = num_microbatches % group_size
    if 0 < remainder < pp_size:
        raise RuntimeError(
            f"num_microbatches={num_microbatches} leaves a last group of {remainder} microbatches with "
            f"microbatch_group_size_per_vp_stage={group_size}, fewer than pipeline_model_parallel_size={pp_size}; "
            f"use a num_microbatches whose remainder modulo {group_size} is 0 or at least {pp_size}, "
            f"or change microbatch_group_size_per_vp_stage")
