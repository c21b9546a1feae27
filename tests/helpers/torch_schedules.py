"""CSV schedules written by torch.distributed.pipelining's own schedule classes, built without a process group.

torch's schedule classes compute every rank's compute-only order (``pipeline_order``: rank -> list of ``_Action``
or ``None`` for an idle slot) in their constructor from the stages they are given; the stages are only read for
``stage_index``, ``num_stages``, ``group_size`` (pipeline ranks), ``group_rank`` and ``submod`` (the split-backward
classes refuse compiled modules).  :class:`_StageStub` carries just those, so a schedule is built without
``init_process_group`` and without a model; :func:`torch_schedule_csv` writes its order in the CSV form torch's
``_dump_csv(format="compute_only")`` writes (one row per rank, ``str(action)`` per cell, an empty cell per idle
slot).  :func:`torch_load_csv` goes the other way: torch's runtime loads a CSV (``_load_csv``: its own validation,
then its lowering to sends and receives) and dry-runs it (``_simulate_comms_compute``, which flags deadlocks).  Used
by ``tests/plan/test_torch_csv.py`` and the ``torch:<class>`` cases of ``tests/helpers/pipeline_jobs.py``.
"""
from __future__ import annotations

import csv
import io
import os
import tempfile

__all__ = ["TORCH_CLASSES", "torch_schedule_csv", "torch_load_csv"]

# class name -> (stages per rank, placement): "looped" = stage c*P + r on rank r, "v" = stages r and 2P-1-r
TORCH_CLASSES = {
    "ScheduleGPipe": (1, "looped"),
    "Schedule1F1B": (1, "looped"),
    "ScheduleInterleaved1F1B": (2, "looped"),
    "ScheduleLoopedBFS": (2, "looped"),
    "ScheduleInterleavedZeroBubble": (2, "looped"),
    "ScheduleZBVZeroBubble": (2, "v"),
    "ScheduleDualPipeV": (2, "v"),
}


class _StageStub:
    """The fields of a pipeline stage that torch's schedule constructors read (no module, no process group)."""

    def __init__(self, stage_index: int, num_stages: int, pp_size: int, rank: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = pp_size, rank
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None


def _rank0_stages(pp: int, per_rank: int, placement: str) -> list[int]:
    n = pp * per_rank
    return [0, n - 1] if placement == "v" else [c * pp for c in range(per_rank)]


def torch_schedule_csv(name: str, pp: int, num_microbatches: int, stages_per_rank: int | None = None,
                       comms: bool = False) -> str:
    """The compute-only CSV of torch's schedule class ``name`` (a key of :data:`TORCH_CLASSES`) for ``pp`` ranks,
    ``stages_per_rank`` stages each (default the class's) and ``num_microbatches`` microbatches; ``comms``: the
    compute_comms form instead (``pipeline_order_with_comms``, with SEND_/RECV_ cells; the runtime classes only).

    Raises:
        KeyError: ``name`` is not in :data:`TORCH_CLASSES`.
        ValueError: torch's own refusal of the sizes (e.g. Schedule1F1B with fewer microbatches than stages,
            DualPipeV with fewer microbatches than ``2 * pp``, Interleaved1F1B with ``M`` not a multiple of its
            rounds ``max(1, M // pp)``).
        RuntimeError: the build initialized a process group (it must not need one).
    """
    import torch.distributed as dist  # here, not at import: torch.distributed.pipelining takes a second to import
    from torch.distributed.pipelining import schedules as torch_schedules
    default_per_rank, placement = TORCH_CLASSES[name]
    per_rank = stages_per_rank or default_per_rank
    stages = [_StageStub(s, pp * per_rank, pp, 0) for s in _rank0_stages(pp, per_rank, placement)]
    cls, had_group = getattr(torch_schedules, name), dist.is_initialized()
    loss = lambda output, target: output  # noqa: E731 -- only "has a loss" (training, with backward) matters
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        schedule = cls(stages[0], num_microbatches, loss_fn=loss)
    else:
        schedule = cls(stages, num_microbatches, loss_fn=loss)
    if dist.is_initialized() and not had_group:
        raise RuntimeError(f"building torch's {name} initialized a process group")
    order = schedule.pipeline_order_with_comms if comms else schedule.pipeline_order
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in range(pp):
        writer.writerow(["" if a is None else str(a) for a in order[rank]])
    return out.getvalue()


def torch_load_csv(text: str, pp: int, num_microbatches: int, stages_per_rank: int,
                   placement: str = "looped") -> dict[int, int]:
    """Load the compute-only CSV ``text`` into torch's ``_PipelineScheduleRuntime`` (stage stubs, no process group),
    lower it to communication actions and dry-run it; return torch's stage -> rank mapping.

    Raises:
        AssertionError, RuntimeError or ValueError: torch's refusal (a malformed cell, an out-of-order action, a
            schedule it cannot place sends and receives for, or one its dry run finds not progressing).
    """
    from torch.distributed.pipelining import schedules as torch_schedules
    n = pp * stages_per_rank
    stages = [_StageStub(s, n, pp, 0) for s in _rank0_stages(pp, stages_per_rank, placement)]
    schedule = torch_schedules._PipelineScheduleRuntime(stages, num_microbatches, loss_fn=lambda output, target: output)
    fd, path = tempfile.mkstemp(suffix=".csv")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        schedule._load_csv(path)
    finally:
        os.unlink(path)
    # the dry run models compute and transfers only: drop the FSDP (UNSHARD/RESHARD) and gradient-reduction cells
    skip = {"UNSHARD", "RESHARD", "REDUCE_GRAD"}
    order = {rank: [a for a in actions if a is not None and a.computation_type.value not in skip]
             for rank, actions in schedule.pipeline_order_with_comms.items()}
    mapping = dict(schedule.stage_index_to_group_rank)
    torch_schedules._simulate_comms_compute(order, lambda stage: mapping[stage], n)
    return mapping
