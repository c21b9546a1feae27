"""Megatron-Core's three schedules as plans: no pipelining, 1F1B and interleaved 1F1B.

All three are one construction (Megatron-Core 0.16.1, ``megatron/core/pipeline_parallel/schedules.py``): a rank
runs the forward steps of its schedule table in order, the first ``W`` as warmup, then alternates one forward and
one backward (steady 1F1B), then runs the remaining ``W`` backwards (cooldown).  No pipelining is ``W = 0``; 1F1B is
one model chunk with ``W = min(P-r-1, M)``; interleaved 1F1B uses the virtual-pipeline warmup count and the
grouped schedule table; forward-only plans keep the forward steps alone.  Pure: no torch.

With ``overlap_moe_expert_parallel_comm`` (Megatron-Core's combined 1F1B, which overlaps one microbatch's expert
all-to-all with another's compute) each steady pair -- forward ``i`` and backward ``i - W`` -- is one
:class:`~engine.plan.types.Compound` cell, run overlapped by the runtime; the interleaved warmup takes Megatron's
one extra forward (``get_pp_rank_microbatches``) and no pipelining runs one warmup forward (Megatron's
``combined_1f1b_schedule_for_no_pipelining``: ``F0``, then ``F(i)+B(i-1)`` cells, then the last backward), so a
cell's backward never needs its own forward's output and the cell can wait for both inputs before it starts.
Megatron-Core refuses the overlap for non-interleaved 1F1B with ``P > 1`` (its ``TransformerConfig``: "virtual
pipeline ... must be specified"); so does this builder.
"""
from __future__ import annotations

from array import array

from .table import get_schedule_table, pp_rank_microbatches, validate_interleaved_microbatches
from .types import Action, Op, Plan

__all__ = ["megatron_plan", "check_positive"]


def check_positive(name: str, value, fix: str) -> None:
    """Raise ``ValueError`` naming ``name``, its value and ``fix`` unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: {fix}")


def megatron_plan(name: str, pp_size: int, num_microbatches: int, num_model_chunks: int, forward_only: bool,
                  group_size: int | None = None, *, interleaved: bool = False,
                  overlap_moe_expert_parallel_comm: bool | None = None) -> Plan:
    """The plan of one of Megatron-Core's schedules, named ``name`` (module doc): warmup, steady 1F1B, cooldown
    over the schedule table.  ``interleaved``: Megatron's virtual-pipeline warmup count and grouped table, with
    ``group_size`` (default ``P``) checked as Megatron checks it.  ``overlap_moe_expert_parallel_comm``: the
    combined-1F1B cells of the module doc (training plans only).

    Raises:
        ValueError: (interleaved) a group size outside ``[P, M]``; the overlap with non-interleaved 1F1B on
            ``P > 1`` ranks.
        RuntimeError: (interleaved) ``0 < M mod G < P``, as Megatron raises.
    """
    overlap = bool(overlap_moe_expert_parallel_comm) and not forward_only
    if overlap and not interleaved and pp_size > 1:
        raise ValueError(f"overlap_moe_expert_parallel_comm with the non-interleaved 1F1B schedule on {pp_size} "
                         "pipeline ranks is refused (as Megatron-Core: with pipelining the combined 1F1B needs "
                         "virtual pipeline stages); use schedule 'interleaved' (virtual >= 2) or 'dualpipev'")
    if interleaved:
        group_size = pp_size if group_size is None else group_size
        check_positive("microbatch_group_size_per_vp_stage", group_size, f"use a value in [{pp_size}, "
                        f"{num_microbatches}]")
        validate_interleaved_microbatches(num_microbatches, pp_size, group_size)
    else:
        group_size = num_microbatches if group_size is None else group_size  # one group; irrelevant for C = 1
    table = get_schedule_table(num_microbatches, num_model_chunks, group_size)
    vp_size = num_model_chunks if interleaved else None
    warmups = tuple(pp_rank_microbatches(num_microbatches, num_model_chunks, group_size, pp_size, rank, vp_size,
                                         forward_only, overlap).num_warmup_microbatches
                    for rank in range(pp_size))
    if overlap and not interleaved:  # no pipelining: one warmup forward
        warmups = (min(1, num_microbatches * num_model_chunks),)
    forwards, backwards, forward_keys, backward_keys = _table_actions(table, num_model_chunks, num_microbatches)
    if forward_only:
        per_rank = (tuple(forwards),) * pp_size
        keys = (forward_keys,) * pp_size
    else:
        per_rank = tuple(tuple(_one_f_one_b(forwards, backwards, w)) for w in warmups)
        keys = tuple(_one_f_one_b(forward_keys, backward_keys, w) for w in warmups)
    total = num_microbatches * num_model_chunks
    cells = tuple(tuple((w + 2 * i, w + 2 * i + 2) for i in range(total - w)) for w in warmups) if overlap else ()
    plan = Plan(name, pp_size, num_model_chunks, num_microbatches, group_size, forward_only, warmups, per_rank,
                compounds=cells if any(cells) else None)
    plan.__dict__["action_keys"] = keys  # pre-filled cache of Plan.action_keys (validator / simulator input)
    return plan


def _table_actions(table, num_model_chunks: int, num_microbatches: int):
    """Forward and backward actions in schedule-table order (one shared object per distinct action) and their keys.

    Backward step ``k`` runs table entry ``k`` with the chunk mirrored (Megatron-Core's ``forward_backward_pipelining_with_interleaving``).  Keys as in
    :meth:`Plan.action_keys`.
    """
    forwards = [Action(Op.FORWARD, c, mb) for mb, c in table]
    backwards = [Action(Op.BACKWARD, num_model_chunks - 1 - c, mb) for mb, c in table]
    stride = num_model_chunks * num_microbatches
    forward_keys = array("q", [c * num_microbatches + mb for mb, c in table])
    backward_keys = array("q", [stride + (num_model_chunks - 1 - c) * num_microbatches + mb for mb, c in table])
    return forwards, backwards, forward_keys, backward_keys


def _one_f_one_b(forwards, backwards, warmup: int):
    """Warmup forwards, then steady 1F1B (forward ``i`` then backward ``i - W``), then cooldown backwards.

    The same order as :func:`convert_schedule_table_to_order` (Megatron-Core's ``schedules.py``), built by slicing (lists or arrays).
    """
    total = len(forwards)
    warmup = min(warmup, total)
    steady = total - warmup
    middle = forwards[warmup:] + backwards[:steady]  # the right length and type; overwritten below
    middle[0::2] = forwards[warmup:]
    middle[1::2] = backwards[:steady]
    return forwards[:warmup] + middle + backwards[steady:]
