"""Profiling: tracer hook, timeline recorder, Chrome trace, measured bubble, Gantt chart, torch.profiler window."""
from __future__ import annotations

import json
import re

import pytest

from engine.plan import build_plan
from engine.profiling import (NvtxTracer, Span, StepProfiler, TimelineRecorder, measured_bubble, merge_rank_files,
                              save_rank_spans, write_chrome_trace)
from engine.profiling.bubble import busy_ns, union_ns
from engine.profiling.gantt import action_costs, parse_action_label, plot_measured_timeline, simulated_bubble
from engine.profiling.session import TimelineSession
from engine.plan.simulate import simulate
from engine.runtime.tracing import NULL_TRACER, FanoutTracer, current_tracer, use_tracer


# -- tracer hook ---------------------------------------------------------------------------------------------------
def test_use_tracer_installs_and_restores():
    a, b = TimelineRecorder(), TimelineRecorder()
    assert current_tracer() is NULL_TRACER
    with use_tracer(a):
        assert current_tracer() is a
        with use_tracer(b):
            assert current_tracer() is b
        with use_tracer(None):
            assert current_tracer() is NULL_TRACER
        assert current_tracer() is a
    assert current_tracer() is NULL_TRACER
    with pytest.raises(TypeError, match="span"):
        with use_tracer(object()):
            pass


def test_fanout_reports_to_every_tracer_in_nesting_order():
    a, b = TimelineRecorder(), TimelineRecorder()
    fan = FanoutTracer(a, NULL_TRACER, b)
    with fan.span("compute", "F0.0"):
        with fan.span("p2p", "send act F0.0"):
            pass
    for rec in (a, b):
        assert [(s.category, s.label, s.depth) for s in rec.spans()] == [
            ("p2p", "send act F0.0", 1), ("compute", "F0.0", 0)]


# -- timeline recorder -----------------------------------------------------------------------------------------------
def test_recorder_spans_steps_nesting_and_times():
    rec = TimelineRecorder(rank=3)
    with rec.step(7):
        with rec.span("compute", "F3.1"):
            with rec.span("p2p", "recv act F3.1"):
                pass
        with rec.span("compute", "B3.1"):
            pass
    with rec.span("sync", "finalize"):
        pass
    spans = rec.spans()
    assert [(s.category, s.label, s.step, s.depth) for s in spans] == [
        ("p2p", "recv act F3.1", 7, 1), ("compute", "F3.1", 7, 0), ("compute", "B3.1", 7, 0),
        ("sync", "finalize", -1, 0)]
    f, inner = spans[1], spans[0]
    assert f.start_ns <= inner.start_ns <= inner.end_ns <= f.end_ns <= spans[2].start_ns
    assert all(s.duration_ns >= 0 for s in spans)
    rec.clear()
    assert rec.spans() == []


def test_recorder_disabled_and_misuse():
    rec = TimelineRecorder(enabled=False)
    with rec.span("compute", "F0.0"):
        pass
    assert rec.spans() == []
    with pytest.raises(RuntimeError, match="span"):
        with TimelineRecorder():
            pass
    with pytest.raises(ValueError, match="device"):
        TimelineRecorder(device="tpu")


def test_nvtx_tracer_ranges_nest_and_are_cached():
    tracer = NvtxTracer()
    with tracer.span("compute", "F0.0"):
        with tracer.span("p2p", "send act F0.0"):
            pass
    assert tracer.span("compute", "F0.0") is tracer.span("compute", "F0.0")
    with pytest.raises(ValueError, match="backend"):
        NvtxTracer(backend="nsight")


# -- synthetic timelines from the simulator ---------------------------------------------------------------------------
def _spans_from_simulation(sim, step=0, scale=1_000_000):
    """Per rank, compute spans with the simulated times (time unit -> ns), labelled like the executor."""
    out = [[] for _ in range(sim.plan.pp_size)]
    for rank, acts in enumerate(sim.plan.actions):
        for a, s, e in zip(acts, sim.start[rank], sim.end[rank]):
            out[rank].append(Span("compute", a.label, round(s * scale), round(e * scale), step, 0))
    return out


@pytest.mark.parametrize("schedule,pp,m,chunks", [("1f1b", 4, 8, 1), ("interleaved", 2, 8, 2),
                                                  ("interleaved", 3, 6, 3)])
def test_measured_bubble_equals_simulator_on_simulated_spans(schedule, pp, m, chunks):
    plan = build_plan(schedule, pp, m, chunks)
    sim = simulate(plan, forward_time=1.0, backward_time=2.0)
    spans = _spans_from_simulation(sim)
    assert measured_bubble(spans) == pytest.approx(list(sim.bubble), abs=1e-9)
    if schedule == "1f1b":  # closed form (p-1)/(m+p-1) on every rank
        assert measured_bubble(spans) == pytest.approx([(pp - 1) / (m + pp - 1)] * pp, abs=1e-9)
    # the prediction from the measured action costs reproduces the same bubble
    predicted, _ = simulated_bubble(plan, spans)
    assert predicted == pytest.approx(list(sim.bubble), abs=1e-9)


def test_bubble_by_hand_with_nested_waits_and_steps():
    ms = 1_000_000
    r0 = [Span("compute", "F0.0", 0, 10 * ms, 0), Span("compute", "B0.0", 20 * ms, 30 * ms, 0),
          Span("p2p", "recv grad B0.0", 20 * ms, 24 * ms, 0, 1),   # waiting inside B: idle
          Span("compute", "F0.0", 100 * ms, 110 * ms, 1)]
    r1 = [Span("compute", "F0.0", 5 * ms, 25 * ms, 0), Span("compute", "F0.0", 100 * ms, 120 * ms, 1)]
    assert union_ns([(0, 10), (5, 12), (20, 21)]) == 13
    assert busy_ns(r0[:3]) == 16 * ms
    # step 0: window [0, 30] ms; rank 0 busy 16 ms, rank 1 busy 20 ms
    assert measured_bubble([r0, r1], [0]) == pytest.approx([1 - 16 / 30, 1 - 20 / 30])
    # step 1: window [100, 120] ms
    assert measured_bubble([r0, r1], [1]) == pytest.approx([0.5, 0.0])
    assert measured_bubble([r0, r1]) == pytest.approx([(1 - 16 / 30 + 0.5) / 2, (1 - 20 / 30) / 2])
    with pytest.raises(ValueError, match="step=5"):
        measured_bubble([r0, r1], [5])


def test_action_labels_and_costs():
    assert parse_action_label("B103.12") == ("B", 12, 103)
    assert parse_action_label("recv act F2.0") is None and parse_action_label("F c1 mb3") is None
    spans = [[Span("compute", "F0.0", 0, 10), Span("compute", "F1.0", 10, 30),
              Span("p2p", "F9.0", 0, 99)]]
    assert action_costs(spans) == {("F", 0, 0): 15}


# -- Chrome trace ------------------------------------------------------------------------------------------------------
def test_chrome_trace_is_valid_and_round_trips_through_rank_files(tmp_path):
    plan = build_plan("interleaved", 2, 4, 2)
    spans = _spans_from_simulation(simulate(plan), scale=1000)
    spans[1].append(Span("p2p", "recv act F0.0", 0, 500, 0, 0))
    paths = [save_rank_spans(tmp_path / f"rank{r}.json", r, s) for r, s in enumerate(spans)]
    merged = merge_rank_files(reversed(paths))
    assert merged == spans
    out = write_chrome_trace(tmp_path / "trace.json", merged, {"schedule": plan.schedule})
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    assert trace["otherData"] == {"schedule": "interleaved"}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(len(s) for s in spans)
    for e in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "pipeline rank 0"), (1, "pipeline rank 1")}
    # per rank, the compute events are the plan's actions in order, times in microseconds
    for rank in range(2):
        got = [e for e in complete if e["pid"] == rank and e["cat"] == "compute"]
        assert [e["name"] for e in got] == [a.label for a in plan.actions[rank]]
        first = spans[rank][0]
        assert got[0]["ts"] == pytest.approx(first.start_ns / 1e3)
    with pytest.raises(ValueError, match="rank 0"):
        merge_rank_files([paths[0], paths[0]])
    with pytest.raises(ValueError, match="missing"):
        merge_rank_files([paths[1]])


# -- Gantt chart and the --timeline session -----------------------------------------------------------------------------
def test_gantt_png_written_with_both_bubbles(tmp_path):
    plan = build_plan("1f1b", 2, 4)
    sim = simulate(plan, 1.0, 2.0)
    spans = _spans_from_simulation(sim, step=3)
    spans[0].append(Span("p2p", "recv grad B0.0", 2_000_000, 4_000_000, 3, 0))  # the idle wait
    info = plot_measured_timeline(spans, tmp_path / "t.png", plan)
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert info["step"] == 3
    assert info["measured_bubble"] == pytest.approx(list(sim.bubble))
    assert info["simulated_bubble"] == pytest.approx(list(sim.bubble))
    assert info["step_ms"] == pytest.approx(sim.makespan)


def test_timeline_session_without_process_group(tmp_path):
    plan = build_plan("no_pipelining", 1, 3)
    session = TimelineSession(tmp_path / "tl", plan=plan)
    for i in range(2):
        with session.step(i), use_tracer(session.tracer):
            for a in plan.actions[0]:
                with current_tracer().span("compute", a.label):
                    sum(range(2000))
    summary = session.finish({"run": "test"})
    files = sorted(p.name for p in (tmp_path / "tl").iterdir())
    assert files == ["timeline.json", "timeline.png", "timeline_summary.json"]
    assert [s["step"] for s in summary["steps"]] == [0, 1]
    assert summary["schedule"] == "no_pipelining" and summary["run"] == "test"
    assert summary["measured_bubble"][0] == pytest.approx(0.0, abs=0.5)  # back-to-back actions, tiny gaps
    assert json.loads((tmp_path / "tl" / "timeline_summary.json").read_text())["chart_step"] == 1


# -- torch.profiler ------------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_step_profiler_writes_one_trace_per_window(tmp_path):
    import torch
    with StepProfiler.from_config({"enabled": True, "wait": 1, "warmup": 0, "active": 1}, tmp_path, rank=1) as prof:
        for _ in range(3):
            torch.ones(8).sum()
            prof.step()
    assert [p.name for p in prof.written] == ["torch_profile_rank1_step2.json"]
    json.loads(prof.written[0].read_text())
    with StepProfiler(tmp_path / "off", enabled=False) as off:
        off.step()
    assert not (tmp_path / "off").exists()
    with pytest.raises(ValueError, match="profile.active"):
        StepProfiler(tmp_path, active=0)


# -- pipecast train --timeline -------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_pipecast_train_writes_timeline_and_torch_profile(tmp_path, capsys):
    """The timeline numbers its steps as the log does (issue 36: its chart was one step behind the log's last
    ``step 2/2``), and repeats the start-up line's simulated bubble (nominal costs) beside the simulation at the
    measured costs."""
    from engine.cli import main
    run_dir, tl = tmp_path / "run", tmp_path / "timeline"
    status = main(["train", "configs/default.yaml", "--parallel.pipeline=1", "--parallel.virtual=1",
                   "--training.steps=2", "--training.eval_interval=0", "--training.eval_iters=1",
                   "--training.micro_batch_size=2", "--training.num_microbatches=3", "--model.num_layers=1",
                   "--model.hidden_size=32", "--model.num_attention_heads=2", "--model.seq_length=16",
                   "--data.max_bytes=200000", "--checkpoint.save_at_end=false", f"--logging.run_dir={run_dir}",
                   "--profile.enabled=true", "--profile.wait=1", "--profile.warmup=0", "--profile.active=1",
                   "--timeline", str(tl), "--nvtx"])
    assert status == 0
    summary = json.loads((tl / "timeline_summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == [1, 2] and summary["chart_step"] == 2
    err = capsys.readouterr().err
    start_up = re.search(r"simulated bubble (\d+\.\d)%", err).group(1)
    assert f"timeline: wrote {tl} (step 2:" in err and f"at nominal costs {start_up}% overall" in err, err
    assert summary["schedule"] == "no_pipelining" and summary["num_microbatches"] == 3
    trace = json.loads((tl / "timeline.json").read_text())
    labels = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    assert labels == ["F0.0", "B0.0", "F1.0", "B1.0", "F2.0", "B2.0"] * 2
    assert (tl / "timeline.png").is_file()
    assert [p.name for p in (run_dir / "profile").iterdir()] == ["torch_profile_rank0_step2.json"]  # after wait + active steps
