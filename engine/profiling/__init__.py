"""Profiling: NVTX ranges, the timeline recorder, merged Chrome/Perfetto traces, Gantt charts, torch.profiler.

All of it hangs off the one :class:`engine.runtime.tracing.Tracer` protocol the executor reports to:

* :class:`NvtxTracer` -- one NVTX range per action / P2P call / graph replay, for Nsight Systems;
* :class:`TimelineRecorder` -- start and end of every span (monotonic clock or CUDA events);
* :func:`write_chrome_trace` / :func:`gather_spans` -- one trace for all ranks;
* :func:`measured_bubble` -- per-rank bubble fraction from the recorded spans;
* :class:`StepProfiler` -- ``torch.profiler`` traces per rank (``profile: {enabled, wait, warmup, active}``);
* :class:`TimelineSession` (``engine.profiling.session``) -- the ``--timeline DIR`` glue for a training run.
"""
from .bubble import measured_bubble
from .chrome_trace import gather_spans, load_rank_spans, merge_rank_files, save_rank_spans, to_chrome_trace, \
    write_chrome_trace
from .nvtx_ranges import NvtxTracer
from .timeline import Span, TimelineRecorder
from .torch_profiler import StepProfiler

__all__ = ["NvtxTracer", "TimelineRecorder", "Span", "to_chrome_trace", "write_chrome_trace", "gather_spans",
           "save_rank_spans", "load_rank_spans", "merge_rank_files", "measured_bubble", "StepProfiler"]
