"""Split-backward schedules on gloo ranks equal the single-process unpipelined reference.

Cases join the shared PP = 2 and PP = 4 jobs of ``tests/helpers/pipeline_jobs.py`` (one spawn per world size): ZB-H1,
ZB-V (V placement: local hand-over on the last rank, first and last stage on rank 0), budgeted ``zb`` plans,
cost-aware ``zb`` / ``zbv`` plans, V-Half and V-Min, and
torch's CSV schedules (pipecast's exported and imported back; torch's ZBV, DualPipeV, ZB1P, interleaved 1F1B), at
M = P, odd M and larger M, every P2P mode, output deallocation on and off, forward-only calls, repeated calls
accumulating, negotiated shapes; and the grad-sync hooks around each chunk's last W.  The reference
(``tests.helpers.models.reference``) is plain autograd over the unsplit layer stack; the test model's layers are raw
``x @ W^T`` ops, so these cases run the generic autograd split (the GPT's layer-level deferral is covered by the
training tests).
"""
from __future__ import annotations

import pytest

from tests.helpers.pipeline_jobs import case, check_ranks, register, shared_results

TOL = 1e-5
COSTS = "forward=1.0 backward=1.4 weight=0.6 transfer=0.3 weight_memory=0.5"  # unequal: orders of their own
MODES = [dict(batch=True, overlap=False), dict(batch=False, overlap=False), dict(batch=False, overlap=True)]


def _grid(pp: int) -> list[dict]:
    cases = []
    for schedule, chunks, Ms in (("zb_h1", None, (pp, 3, 2 * pp + 1)), ("zbv", 2, (pp, 3, 2 * pp))):
        for M in Ms:
            for mode in MODES:
                for dealloc in (False, True):
                    cases.append(case(schedule=schedule, chunks=chunks, M=M, dealloc=dealloc, **mode))
    cases += [case(schedule="zb", chunks=2, M=2 * pp, max_in_flight=2 * pp, dealloc=True),   # ZB-H2-like budget
              case(schedule="zb", chunks=2, M=pp + 1, max_in_flight=2, batch=False),         # one microbatch a rank
              case(schedule="zb", M=2 * pp, max_in_flight=2 * pp, dealloc=True, **MODES[2]),
              case(schedule="zbv", chunks=2, M=pp, forward_only=True),
              case(schedule="zb_h1", M=3, forward_only=True),
              case(schedule="zbv", chunks=2, M=2 * pp, repeats=2, dealloc=True),
              case(schedule="zbv", chunks=2, M=pp + 1, variable=True, dealloc=True),
              case(schedule="zb_h1", M=pp + 1, variable=True, dealloc=True, batch=False),
              case(schedule="zbv", chunks=2, M=2 * pp, layers=2, hidden=16, dealloc=True, mode=3),
              case(schedule="zbv", chunks=2, M=pp, hooks=True),
              # cost-aware plans (their W per chunk in microbatch order) and the controllable-memory V schedules
              case(schedule="zb", M=2 * pp, max_in_flight=2 * pp, costs=COSTS, dealloc=True, **MODES[2]),
              case(schedule="zb", M=pp + 1, max_in_flight=pp, costs=COSTS, batch=False),
              case(schedule="zbv", chunks=2, M=2 * pp, costs=COSTS, dealloc=True),
              case(schedule="zbv", chunks=2, M=pp + 1, max_in_flight=pp + 1, costs=COSTS, forward_only=True),
              case(schedule="v_half", chunks=2, M=2 * pp, dealloc=True), case(schedule="v_min", chunks=2, M=pp + 1),
              case(schedule="v_min", chunks=2, M=2 * pp, batch=False, dealloc=True),
              case(schedule="zb_h1", M=pp, hooks=True),
              # torch's CSV action grammar, exported and imported back: the imported plans run the same
              case(schedule="csv:zbv", chunks=2, M=2 * pp, dealloc=True), case(schedule="csv:1f1b", M=pp + 1),
              case(schedule="csv:interleaved", chunks=2, M=2 * pp, batch=False),
              # CSVs written by torch's own schedule classes (tests/helpers/torch_schedules.py), imported
              case(schedule="torch:ScheduleZBVZeroBubble", chunks=2, M=2 * pp, dealloc=True, **MODES[2]),
              case(schedule="torch:ScheduleDualPipeV", chunks=2, M=2 * pp, dealloc=True),
              case(schedule="torch:ScheduleInterleavedZeroBubble", chunks=2, M=pp + 1, batch=False),
              case(schedule="torch:ScheduleInterleaved1F1B", chunks=2, M=2 * pp)]
    return cases


GRIDS = {pp: _grid(pp) for pp in (2, 4)}
SLICES = {pp: register(pp, GRIDS[pp]) for pp in (2, 4)}


def _label(c: dict) -> str:
    keys = ("schedule", "M", "batch", "overlap", "dealloc", "forward_only", "repeats", "variable", "max_in_flight",
            "hooks", "chunks", "mode", "costs")
    return ",".join(f"{k}={c[k]}" for k in keys if c[k] not in (None, False))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [2, 4])
def test_split_schedules_equal_the_reference(pp):
    results = shared_results(pp)[SLICES[pp]]
    for c, per_rank in zip(GRIDS[pp], results):
        where = f"pp={pp} {_label(c)}"
        check_ranks(where, per_rank, TOL)
        # each call returns M losses from the rank holding the last stage (rank 0 under the V placement), [] elsewhere
        loss_rank = 0 if c["schedule"].endswith(("zbv", "v_half", "v_min", "ZBVZeroBubble", "DualPipeV")) else pp - 1
        for r in per_rank:
            for call in r["calls"]:
                want = c["M"] if r["pp_rank"] == loss_rank else 0
                assert call["store_len"] == want, f"{where}: rank {r['rank']} stored {call['store_len']} losses"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [2, 4])
def test_grad_sync_follows_each_chunks_last_weight_pass(pp):
    """``grad_sync_func`` runs once per chunk, right after that chunk's last W (its gradients are complete only
    then: a sync after the last B would miss the deferred weight gradients -- pytorch issue 144530); ``no_sync`` is
    entered at the start and left around those W passes; ``finalize_model_grads_func`` once at the end."""
    from engine.plan import build_plan
    for c, per_rank in zip(GRIDS[pp], shared_results(pp)[SLICES[pp]]):
        if not c["hooks"] or c["schedule"].startswith(("csv:", "torch:")):
            continue
        C = c["chunks"] or 1
        plan = build_plan(c["schedule"], pp, c["M"], C)
        for r in per_rank:
            events = r["calls"][0]["events"]
            syncs = [e for e in events if e.startswith("grad_sync_func")]
            assert sorted(syncs) == sorted(f"grad_sync_func(params_c{k})" for k in range(C)), (pp, c, syncs)
            assert events[0] == "no_sync enter" and events[-1].startswith("finalize_model_grads_func"), events
            # every B of a chunk comes before its grad sync (the W passes in between record nothing)
            acts = plan.actions[r["pp_rank"]]
            for k in range(C):
                at = events.index(f"grad_sync_func(params_c{k})")
                later_b = [e for e in events[at:] if e.startswith("B m") and e.split()[2] == f"c{k}"]
                assert not later_b, f"chunk {k} ran a backward after its grad sync: {later_b}"
            assert sum(1 for a in acts if a.op.value == "W") == C * c["M"]
