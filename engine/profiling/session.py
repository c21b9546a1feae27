"""``--timeline DIR`` for a run: record every rank's spans, then write the merged trace, the Gantt chart and the
bubble figures from the first rank of the pipeline.

Files written to ``DIR`` (``_pipe<k>`` suffix for data-parallel replica ``k > 0``):

* ``timeline.json`` -- Chrome / Perfetto trace of all pipeline ranks (open in https://ui.perfetto.dev);
* ``timeline.png`` -- Gantt chart of the last recorded step, measured bubble per rank beside the simulator's;
* ``timeline_summary.json`` -- per step: step time (ms) and measured bubble per rank; the simulated bubble per
  rank at the measured costs, and overall at nominal costs (``simulated_bubble_nominal``: the figure ``pipecast
  train`` prints at start-up, :func:`engine.plan.simulate.simulate_nominal`).

A write the operating system refuses (a full disk, where ``write`` names no file) raises an ``OSError`` naming the
file, which ``pipecast train`` reports as its one line.

Usage inside a training loop (the trainer does this when ``--timeline`` is given)::

    session = TimelineSession(out_dir, plan=plan, group=pp_group)
    for i in range(steps):
        with session.step(i), use_tracer(session.tracer):
            run_one_step()
    session.finish()            # collective over ``group``
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ..runtime.tracing import FanoutTracer
from .bubble import measured_bubble, step_window, steps_of
from .chrome_trace import gather_spans, write_chrome_trace
from .timeline import TimelineRecorder

__all__ = ["TimelineSession", "TrainerProfiling"]


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
            from ..plan.simulate import simulate_nominal
            meta.update(schedule=self.plan.schedule, pp_size=self.plan.pp_size,
                        num_model_chunks=self.plan.num_model_chunks, num_microbatches=self.plan.num_microbatches,
                        simulated_bubble_nominal=simulate_nominal(self.plan).bubble_overall)
        summary: dict = {"steps": []}
        for s in steps:
            lo, hi = step_window(rank_spans, s)
            summary["steps"].append({"step": s, "step_ms": (hi - lo) / 1e6,
                                     "measured_bubble": measured_bubble(rank_spans, [s])})
        trace, png = self.out_dir / f"timeline{self.suffix}.json", self.out_dir / f"timeline{self.suffix}.png"
        with _naming(trace):
            write_chrome_trace(trace, rank_spans, meta)
        if steps or any(rank_spans):
            from .gantt import plot_measured_timeline
            with _naming(png):
                chart = plot_measured_timeline(rank_spans, png, self.plan)
            summary.update(chart=chart["path"], chart_step=chart["step"],
                           measured_bubble=chart["measured_bubble"], simulated_bubble=chart["simulated_bubble"])
        summary = {**meta, **summary}  # the measured fields win over metadata of the same name
        path = self.out_dir / f"timeline_summary{self.suffix}.json"
        with _naming(path):
            path.write_text(json.dumps(summary, indent=1))
        return summary


@contextlib.contextmanager
def _naming(path: Path):
    """Re-raise an operating-system error inside the block that names no file (``write`` on a full disk) as one
    naming ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


class TrainerProfiling:
    """Profiling of a :class:`engine.training.trainer.Trainer` run: what ``pipecast train --timeline DIR`` and the
    ``profile:`` config section turn on, around every training step (``step_on_device``; evaluation steps are not
    recorded).

    * ``timeline`` (a folder): a :class:`TimelineSession` over the pipeline group, installed with
      :func:`engine.runtime.tracing.use_tracer` for each training step; files written at :meth:`close` (collective).
    * ``nvtx``: NVTX ranges for every span (also without a timeline).
    * ``config.profile.enabled``: ``torch.profiler`` traces per rank in ``<run_dir>/profile`` (wait / warmup /
      active steps, see :class:`StepProfiler`).

    The trainer's ``tracer`` attribute is set to the tracer in use.  Use as a context manager around
    ``trainer.train()``.
    """

    def __init__(self, trainer, timeline: str | os.PathLike | None = None, nvtx: bool = False):
        from .torch_profiler import StepProfiler
        c = trainer.config
        self.trainer = trainer
        self.session = None
        tracers = []
        if nvtx or getattr(c.profile, "nvtx", False):
            from .nvtx_ranges import NvtxTracer
            tracers.append(NvtxTracer())
        if timeline is not None:
            self.session = TimelineSession(timeline, trainer.plan, group=trainer.pg.pp,
                                           device="cuda" if trainer.device.type == "cuda" else "cpu",
                                           pipeline_index=trainer.dp_rank)
            tracers.append(self.session.recorder)
        self.tracer = tracers[0] if len(tracers) == 1 else (FanoutTracer(*tracers) if tracers else None)
        trainer.tracer = self.tracer
        self.profiler = StepProfiler.from_config(c.profile, trainer.run_dir / "profile", trainer.rank)
        self._inner = trainer.step_on_device
        trainer.step_on_device = self._step  # instance attribute: the class is untouched

    def _step(self) -> None:
        from ..runtime.tracing import use_tracer
        step = self.trainer.step + 1  # the step's number as its log line names it ("step 3/3": the 3rd step)
        scope = self.session.step(step) if self.session is not None else contextlib.nullcontext()
        with scope, use_tracer(self.tracer):
            self._inner()
        self.profiler.step()

    def __enter__(self) -> "TrainerProfiling":
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)

    def close(self, failed: bool = False) -> dict | None:
        """Stop the profiler, restore ``step_on_device`` and (collective, unless ``failed``) write the timeline."""
        self.profiler.__exit__(None, None, None)
        self.trainer.step_on_device = self._inner
        self.trainer.tracer = None
        if self.session is None or failed:
            return None
        summary = self.session.finish({"trained_to_step": self.trainer.step})
        if summary is not None:  # the pipeline's first rank, which is not the logging rank: print
            import sys
            print(f"timeline: wrote {self.session.out_dir} (step {summary.get('chart_step')}: bubble per rank "
                  f"measured {_pct(summary.get('measured_bubble'))}, simulated at the measured costs "
                  f"{_pct(summary.get('simulated_bubble'))}; at nominal costs "
                  f"{_pct(summary.get('simulated_bubble_nominal'))} overall, the start-up line's figure)",
                  file=sys.stderr, flush=True)
        return summary


def _pct(values) -> str:
    values = [values] if isinstance(values, float) else values
    return "-" if not values else "/".join(f"{100 * v:.1f}%" for v in values)

