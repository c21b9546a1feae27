"""The executor reports the plan to the tracer: spans of a real 2-rank gloo run, merged trace, chart, bubble."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.distributed import run_ranks


def _job(rank, world, out_dir):
    import torch.distributed as dist
    from engine import schedules
    from engine.model_parallel_config import ModelParallelConfig
    from engine.plan import build_plan
    from engine.runtime.process_groups import build_process_groups
    from engine.profiling import NvtxTracer
    from engine.profiling.session import TimelineSession
    from engine.runtime.tracing import FanoutTracer, use_tracer
    from tests.helpers import models as tm

    pgc = build_process_groups(world)
    results = {}
    for schedule, chunks, M in (("1f1b", 1, 4), ("interleaved", 2, 4)):
        vp = chunks if chunks > 1 else None
        cfg = ModelParallelConfig(pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=vp,
                                  pipeline_dtype=torch.float32, hidden_size=8, deallocate_pipeline_outputs=True)
        model, _ = tm.build_chunks(cfg, world, rank, chunks)
        plan = build_plan(schedule, world, M, chunks)
        session = TimelineSession(f"{out_dir}/{schedule}", plan, group=pgc.pp)
        func = schedules.get_forward_backward_func(world, vp)
        comm = schedules.P2PCommunicator(pgc.pp, cfg)
        for step in range(2):
            data = tm.make_data(M, 4, 2, 8)
            with session.step(step), use_tracer(FanoutTracer(NvtxTracer(), session.recorder)):
                func(forward_step_func=tm.make_forward_step(), data_iterator=tm.iterators(data, chunks),
                     model=model if chunks > 1 else model[0], num_microbatches=M, seq_length=4, micro_batch_size=2,
                     p2p_communicator=comm, pg_collection=pgc)
        spans = [(s.category, s.label, s.start_ns, s.end_ns, s.step, s.depth) for s in session.recorder.spans()]
        summary = session.finish()
        results[schedule] = {"spans": spans, "summary": summary,
                             "plan_labels": [a.label for a in plan.actions[rank]],
                             "inputs": [None if (m := plan.input_message(rank, a)) is None else
                                        f"recv {m.kind} {a}"
                                        for a in plan.actions[rank]]}
    dist.barrier()
    return results


@pytest.mark.timeout(120)
def test_executor_spans_follow_the_plan_and_session_writes_trace_and_chart(tmp_path):
    results = run_ranks(_job, 2, str(tmp_path), timeout=100)
    for schedule in ("1f1b", "interleaved"):
        for rank, res in enumerate(results):
            r = res[schedule]
            for step in range(2):
                spans = sorted((s for s in r["spans"] if s[4] == step), key=lambda s: s[2])
                compute = [s for s in spans if s[0] == "compute"]
                # one compute span per action, in the plan's order
                assert [s[1] for s in compute] == r["plan_labels"], (schedule, rank)
                # every receive an action needs is waited (a p2p span with its label) before that action starts
                for action, want, span in zip(r["plan_labels"], r["inputs"], compute):
                    if want is None:
                        continue
                    waits = [s for s in spans if s[0] == "p2p" and s[1] == want]
                    assert len(waits) == 1, (schedule, rank, action, want)
                    assert waits[0][3] <= span[2], (schedule, rank, action)
        summary = results[0][schedule]["summary"]
        assert results[1][schedule]["summary"] is None  # only the pipeline's first rank writes
        assert [s["step"] for s in summary["steps"]] == [0, 1]
        assert all(0.0 <= b < 1.0 for b in summary["measured_bubble"] + summary["simulated_bubble"])
        out = tmp_path / schedule
        assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
        trace = json.loads((out / "timeline.json").read_text())
        pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert pids == {0, 1}
        for rank in range(2):
            names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank
                     and e["cat"] == "compute"]
            assert names == results[rank][schedule]["plan_labels"] * 2
