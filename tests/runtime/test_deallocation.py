"""Output deallocation (``deallocate_pipeline_outputs=True``) with outputs whose storage the engine does not own.

A model chunk may return a view of another tensor (through ``.view`` / ``.transpose``, or from a module with a full
backward hook, which autograd hands back as a view).  Megatron-Core 0.16 refuses such outputs; the pipecast schedules
send and free a tracked copy instead (``engine.runtime.step.sendable_output``).  Checked under 1F1B and interleaved
1F1B on 2 gloo ranks against the single-process reference: gradients and losses equal, the hooks still fire once per
backward, and the sent storage is released -- when the next forward runs, no earlier microbatch's storage owner is
alive (it is held only through the view the chunk returned).
"""
from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.pipeline_jobs import case, job

SCHEDULES = {"1f1b": dict(M=4), "interleaved": dict(chunks=2, M=4, G=2)}
CASES = [(name, output, dealloc) for name in SCHEDULES for output in ("view", "hooked") for dealloc in (True, False)]


@pytest.fixture(scope="module")
def results():
    cases = [case(output=output, dealloc=dealloc, **SCHEDULES[name]) for name, output, dealloc in CASES]
    return run_ranks(job, 2, cases, timeout=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{n}-{o}-dealloc{int(d)}" for n, o, d in CASES])
def test_outputs_not_owning_their_storage_work_and_are_released(results, index):
    name, output, dealloc = CASES[index]
    chunks = SCHEDULES[name].get("chunks", 1)
    for rank_result in (results[0][index], results[1][index]):
        assert rank_result["error"] is None, rank_result["error"]
        assert rank_result["grad_err"] < 1e-6 and rank_result["loss_err"] < 1e-6, rank_result
        call = rank_result["calls"][0]
        non_last_chunks = chunks - (1 if rank_result["pp_rank"] == 1 else 0)
        if output == "hooked":
            assert call["hook_calls"] == 4 * non_last_chunks, call["hook_calls"]  # once per backward microbatch
        if dealloc and non_last_chunks:
            assert call["bases_alive_at_forward"] == 0, "a sent output's storage outlived its send"
        if not dealloc and rank_result["pp_rank"] == 0:  # the measure sees storage kept for the backward
            assert call["bases_alive_at_forward"] > 0
