"""DualPipeV on 2 and 4 gloo ranks equals the single-process unpipelined reference.

Cases join the shared PP = 2 and PP = 4 jobs of ``tests/helpers/pipeline_jobs.py`` (one spawn per world size):
``schedule="dualpipev"`` through ``forward_backward_pipelining_with_schedule`` at ``M = 2P`` and odd ``M``, in every
P2P mode (batched, unbatched, ``overlap_p2p_comm``), output deallocation on and off, repeated calls accumulating,
forward-only, and the grad-sync hooks.  Losses and gradients are checked against the independent reference
(``tests.helpers.models.reference``: plain autograd over the unsplit layer stack) and, since DualPipeV and ZB-V both
sum each chunk's weight gradients in microbatch order on the same V placement, bitwise against ZB-V's run of the
same case.  Every call's recorded compute order must be the plan's (the compounds' parts in order).
"""
from __future__ import annotations

import pytest

from tests.helpers.pipeline_jobs import case, check_ranks, register, shared_results

TOL = 1e-5
MODES = [dict(batch=True, overlap=False), dict(batch=False, overlap=False), dict(batch=False, overlap=True)]


def _grid(pp: int) -> list[dict]:
    """At P = 2 every mode at both M; at P = 4 (dearer ranks) each mode once."""
    pairs = [(M, i) for M in (2 * pp, 2 * pp + 1) for i in range(3)] if pp == 2 else [(8, 0), (9, 1), (9, 2)]
    cases = [case(schedule="dualpipev", chunks=2, M=M, dealloc=i % 2 == 1, **MODES[i]) for M, i in pairs]
    if pp == 2:
        cases += [case(schedule="dualpipev", chunks=2, M=2 * pp, repeats=2, dealloc=True, **MODES[2]),
                  case(schedule="dualpipev", chunks=2, M=2 * pp, forward_only=True)]
    cases += [case(schedule="dualpipev", chunks=2, M=2 * pp, hooks=True),
              case(schedule="zbv", chunks=2, M=2 * pp, dealloc=False, **MODES[0])]  # bitwise twin of cases[0]
    return cases


GRIDS = {pp: _grid(pp) for pp in (2, 4)}
SLICES = {pp: register(pp, GRIDS[pp]) for pp in (2, 4)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [2, 4])
def test_dualpipev_equals_the_reference(pp):
    results = shared_results(pp)[SLICES[pp]]
    for c, per_rank in zip(GRIDS[pp], results):
        where = f"pp={pp} {c['schedule']} M={c['M']} batch={c['batch']} overlap={c['overlap']} fo={c['forward_only']}"
        check_ranks(where, per_rank, TOL)
        for r in per_rank:  # the V placement puts the last stage on rank 0: it alone returns the M losses
            assert all(call["store_len"] == (c["M"] if r["pp_rank"] == 0 else 0) for call in r["calls"]), where
    dual, zbv = results[0], results[-1]
    for a, b in zip(dual, zbv):  # same sums in the same order as ZB-V: bitwise equal
        assert a["calls"][0].get("losses") == b["calls"][0].get("losses"), f"pp={pp}: losses differ from ZB-V's"
        assert a["grad_err"] == b["grad_err"], f"pp={pp}: rank {a['rank']} gradients differ from ZB-V's"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [2, 4])
def test_dualpipev_grad_sync_follows_each_chunks_last_weight_pass(pp):
    """``grad_sync_func`` runs once per chunk after its last W pass, with no backward of that chunk after it."""
    c = GRIDS[pp][-2]
    assert c["hooks"]
    for r in shared_results(pp)[SLICES[pp]][len(GRIDS[pp]) - 2]:
        events = r["calls"][0]["events"]
        syncs = [e for e in events if e.startswith("grad_sync_func")]
        assert sorted(syncs) == [f"grad_sync_func(params_c{k})" for k in range(2)], (pp, syncs)
        assert events[0] == "no_sync enter" and events[-1].startswith("finalize_model_grads_func"), events
        for k in range(2):
            at = events.index(f"grad_sync_func(params_c{k})")
            assert not [e for e in events[at:] if e.startswith("B m") and e.split()[2] == f"c{k}"], (pp, k, events)
