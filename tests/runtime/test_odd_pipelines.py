"""Odd and degenerate pipelines: PP = 3 through the executor, and PP = 1 with interleaving.

One spawned 3-rank job (the session's world-3 job, ``tests/helpers/pipeline_jobs.py``) runs

* every Megatron-Core 0.16.1 trace vector with PP = 3 (1F1B M = 4 with ``grad_sync_func`` / ``param_sync_func``;
  interleaved VP = 2 with M = 3 and 6): each rank's compute order, ``no_sync`` / sync-hook / finalize events,
  returned entries and gradients equal Megatron's;
* a small odd-P grid: 1F1B with M < P, M = P, M > P and interleaved VP = 2 / 3 with M = G, M a multiple of G and
  M not a multiple of G, in every P2P mode (batched, unbatched, overlapped, overlapped with the warmup flush),
  output deallocation on and off, negotiated shapes: every loss and gradient equals the single-process reference,
  and every rank runs its plan's order.

The PP = 1 interleaved trace (Megatron raises ``IndexError`` after one forward) runs in this process: pipecast
refuses it before any compute, naming the setting.
"""
from __future__ import annotations

import pytest

from tests.helpers import models as tm
from tests.helpers.megatron_vectors import VECTORS, missing_vectors, vectors
from tests.helpers.pipeline_jobs import case, check_equivalence, check_traces, label, register, shared_results, trace_cases

P = 3
TOL = 1e-5
MODES = [dict(batch=True, overlap=False), dict(batch=False, overlap=False), dict(batch=False, overlap=True),
         dict(batch=False, overlap=True, warmup_flush=True)]


def _grid() -> list[dict]:
    cases = []
    for i, M in enumerate((2, 3, 5)):  # 1F1B: M < P, M = P, M > P
        for mode in MODES[:2]:
            cases.append(case(M=M, dealloc=bool(i % 2), **mode))
    for i, (chunks, M, G) in enumerate(((2, 3, 3), (2, 6, 3), (2, 7, 4), (3, 3, 3))):
        for j, mode in enumerate(MODES):  # interleaved: M = G, M = 2G, M mod G = P, VP = 3
            cases.append(case(chunks=chunks, M=M, G=G, dealloc=bool((i + j) % 2), **mode))
    cases += [case(chunks=2, M=6, G=3, variable=True, dealloc=True, **MODES[2]), case(M=5, variable=True, batch=False),
              case(chunks=2, M=6, G=3, forward_only=True, **MODES[2])]
    return cases


GRID = _grid()
TRACES = trace_cases(vectors("trace:"), P) if VECTORS.is_file() else []
_GRID_SLICE, _TRACE_SLICE = register(P, GRID), register(P, [c for _, c in TRACES])


@pytest.fixture(scope="module")
def pp3():
    results = shared_results(P)
    return results[_GRID_SLICE], results[_TRACE_SLICE]


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_megatron_traces_pp3(pp3):
    if not VECTORS.is_file():
        missing_vectors(f"Megatron vectors not found at {VECTORS}")
    assert len(TRACES) == 3, "the three PP = 3 trace vectors"
    assert any(c["hooks"] for _, c in TRACES), "the PP = 3 1F1B trace with grad_sync_func / param_sync_func"
    check_traces(TRACES, pp3[1])


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_equivalence_pp3(pp3):
    worst = check_equivalence(GRID, pp3[0], P, TOL)
    print(f"\nlargest relative error PP={P}: {worst:.3g} over {len(GRID)} configurations")


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_compute_order_equals_plan_pp3(pp3):
    for c, ranks in zip(GRID, pp3[0]):
        for r in ranks:
            for call in r["calls"]:
                assert call["order"] == call["plan_order"], f"{label(c)} rank {r['rank']}"


@pytest.mark.timeout(60)
def test_pp1_interleaved_trace_is_refused_before_any_compute():
    """Megatron runs F0.0 and then raises IndexError (an empty FIFO); pipecast raises a ValueError naming
    ``pipeline_model_parallel_size=1`` before any forward, leaving no gradients."""
    from engine import schedules
    from engine.model_parallel_config import ModelParallelConfig
    from engine.runtime.process_groups import ProcessGroupCollection
    (vector,) = [v for v in vectors("trace:megatron.core.pipeline_parallel.schedules.")
                 if v["args"]["pp_size"] == 1 and v["args"]["schedule"] == "interleaved"]
    a, megatron = vector["args"], vector["result"]["per_rank"]["0"]
    assert (megatron["result"]["error"], megatron["compute_order"]) == ("IndexError", ["F0.0"])
    cfg = ModelParallelConfig(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=a["vp_size"],
                              microbatch_group_size_per_vp_stage=a["microbatch_group_size_per_vp_stage"],
                              hidden_size=8)
    chunks, log = tm.build_chunks(cfg, 1, 0, a["vp_size"])
    data = tm.make_data(a["num_microbatches"], 4, 2, 8)
    pgc = ProcessGroupCollection()
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=1"):
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=tm.make_forward_step(2), data_iterator=tm.iterators(data, a["vp_size"]), model=chunks,
            num_microbatches=a["num_microbatches"], seq_length=4, micro_batch_size=2, forward_only=False,
            pg_collection=pgc, p2p_communicator=schedules.P2PCommunicator(pgc.pp, cfg))
    assert log == [], "a forward ran before the refusal"
    assert all(p.grad is None for ch in chunks for p in ch.parameters())
