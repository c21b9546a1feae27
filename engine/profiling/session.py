"""``--timeline DIR`` for a run: record every rank's spans, then write the merged trace, the Gantt chart and the
bubble figures from the first rank of the pipeline.

Files written to ``DIR`` (``_pipe<k>`` suffix for data-parallel replica ``k > 0``):

* ``timeline.json`` -- Chrome / Perfetto trace of all pipeline ranks (open in https://ui.perfetto.dev);
* ``timeline.png`` -- Gantt chart of the last recorded step, measured bubble per rank beside the simulator's;
* ``timeline_summary.json`` -- per step: step time (ms) and measured bubble per rank; simulated bubble.

Usage inside a training loop (the trainer does this when ``--timeline`` is given)::

    session = TimelineSession(out_dir, plan=plan, group=pp_group)
    for i in range(steps):
        with session.step(i), use_tracer(session.tracer):
            run_one_step()
    session.finish()            # collective over ``group``
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..tracing import FanoutTracer
from .bubble import measured_bubble, step_window, steps_of
from .chrome_trace import gather_spans, write_chrome_trace
from .timeline import TimelineRecorder

__all__ = ["TimelineSession"]


class TimelineSession:
    """Timeline recording of one run on one rank.

    Args:
        out_dir: output folder (created on the writing rank).
        plan: the :class:`engine.plan.Plan` the run executes (for the simulated bubble and the chart title).
        group: the pipeline-parallel process group (``None``: the default group, or a one-process run).
        device: ``"cpu"`` or ``"cuda"`` timing (see :class:`TimelineRecorder`).
        nvtx: also open NVTX ranges (``NvtxTracer``) for every span.
        pipeline_index: data-parallel replica of this pipeline; only replica 0 writes plain file names.
    """

    def __init__(self, out_dir: str | os.PathLike, plan=None, group=None, device: str = "cpu", nvtx: bool = False,
                 pipeline_index: int = 0):
        import torch.distributed as dist
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self._dist else 0
        self.out_dir, self.plan, self.group = Path(out_dir), plan, group
        self.suffix = "" if pipeline_index == 0 else f"_pipe{pipeline_index}"
        self.recorder = TimelineRecorder(self.rank, device)
        if nvtx:
            from .nvtx_ranges import NvtxTracer
            self.tracer = FanoutTracer(NvtxTracer(), self.recorder)
        else:
            self.tracer = self.recorder
        if self._dist:
            self.recorder.anchor(group)

    def step(self, index: int):
        """Context manager: spans inside belong to step ``index``."""
        return self.recorder.step(index)

    def finish(self, metadata: dict | None = None) -> dict | None:
        """Gather the spans to the pipeline's first rank and write the files (collective over ``group``).

        Returns the summary dict on the writing rank, ``None`` elsewhere.
        """
        import torch.distributed as dist
        dst = dist.get_global_rank(self.group, 0) if self._dist and self.group is not None else 0
        rank_spans = gather_spans(self.recorder.spans(), self.group, dst=dst)
        if rank_spans is None:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        steps = steps_of(rank_spans)
        meta = dict(metadata or {})
        if self.plan is not None:
            meta.update(schedule=self.plan.schedule, pp_size=self.plan.pp_size,
                        num_model_chunks=self.plan.num_model_chunks, num_microbatches=self.plan.num_microbatches)
        summary: dict = {"steps": []}
        for s in steps:
            lo, hi = step_window(rank_spans, s)
            summary["steps"].append({"step": s, "step_ms": (hi - lo) / 1e6,
                                     "measured_bubble": measured_bubble(rank_spans, [s])})
        write_chrome_trace(self.out_dir / f"timeline{self.suffix}.json", rank_spans, meta)
        if steps or any(rank_spans):
            from .gantt import plot_measured_timeline
            chart = plot_measured_timeline(rank_spans, self.out_dir / f"timeline{self.suffix}.png", self.plan)
            summary.update(chart=chart["path"], chart_step=chart["step"],
                           measured_bubble=chart["measured_bubble"], simulated_bubble=chart["simulated_bubble"])
        summary.update(meta)
        (self.out_dir / f"timeline_summary{self.suffix}.json").write_text(json.dumps(summary, indent=1))
        return summary
