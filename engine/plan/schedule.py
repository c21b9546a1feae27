"""The schedule type: one enum, decided in one place.

Megatron-Core picks its schedule from the pipeline and virtual pipeline sizes (``get_forward_backward_func``,
Megatron-Core 0.16.1): more than one pipeline rank selects 1F1B, or interleaved 1F1B as soon as a virtual size is given (even 1);
one rank selects no pipelining.  :func:`select_schedule` is that rule; :meth:`Schedule.megatron_function` names the
Megatron function of each Megatron schedule.  The split-backward schedules (``zb_h1``, ``zbv``, ``zb``) are
pipecast's (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).
"""
from __future__ import annotations

import enum

__all__ = ["Schedule", "select_schedule", "parse_schedule"]


class Schedule(str, enum.Enum):
    """A pipeline schedule.  Members compare equal to their value (``Schedule.ONE_F_ONE_B == "1f1b"``)."""

    NO_PIPELINING = "no_pipelining"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb_h1"      # 1F1B's activation memory, W passes fill the cooldown bubble (looped, one chunk per rank)
    ZBV = "zbv"          # V placement, two chunks per rank, near-zero bubble when F = B = W
    ZB = "zb"            # split backward under a per-rank limit on in-flight activations (looped placement)

    def __str__(self) -> str:
        return self.value

    @property
    def splits_backward(self) -> bool:
        """Backward is split into input-gradient (B) and weight-gradient (W) passes."""
        return self in (Schedule.ZB_H1, Schedule.ZBV, Schedule.ZB)

    @property
    def placement(self) -> str:
        """``"looped"`` (stage ``c*P + r`` on rank ``r``) or ``"v"`` (rank ``r`` holds stages ``r``, ``2P-1-r``)."""
        return "v" if self is Schedule.ZBV else "looped"

    @property
    def megatron_function(self) -> str | None:
        """Name of Megatron-Core's function for this schedule (``None`` for pipecast's own schedules)."""
        return {Schedule.NO_PIPELINING: "forward_backward_no_pipelining",
                Schedule.ONE_F_ONE_B: "forward_backward_pipelining_without_interleaving",
                Schedule.INTERLEAVED: "forward_backward_pipelining_with_interleaving"}.get(self)


def select_schedule(pp_size: int, vp_size: int | None) -> Schedule:
    """The schedule Megatron-Core picks for a topology (Megatron's ``get_forward_backward_func``): ``pp_size > 1`` gives interleaved 1F1B iff
    ``vp_size is not None`` (even 1), else 1F1B; ``pp_size <= 1`` gives no pipelining."""
    if pp_size > 1:
        return Schedule.ONE_F_ONE_B if vp_size is None else Schedule.INTERLEAVED
    return Schedule.NO_PIPELINING


def parse_schedule(value) -> Schedule:
    """``value`` (a :class:`Schedule` or its name) as a :class:`Schedule`.

    Raises:
        ValueError: an unknown name; the message lists the valid ones.
    """
    try:
        return Schedule(value)
    except ValueError:
        names = ", ".join(s.value for s in Schedule)
        raise ValueError(f"schedule={value!r} is unknown; use one of {names}") from None
