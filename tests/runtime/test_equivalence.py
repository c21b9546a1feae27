"""Pipelined schedules equal the single-process unpipelined reference, and run Megatron-Core's orders.

Two spawned jobs (PP = 2 on 2 ranks, PP = 4 on 4 ranks; shared with ``tests/runtime/test_public_bugs.py`` through
``tests/helpers/pipeline_jobs.py``) each run many schedule calls in one process group:

* equivalence grid: 1F1B and interleaved 1F1B (VP = 2), several M (M < PP for 1F1B, M = PP, M not a multiple of
  G with a valid remainder), every P2P mode (batched, unbatched even/odd, overlapped), output deallocation on and
  off: every per-microbatch loss and every parameter gradient equals the reference (fp32, max relative error
  <= 1e-5), the loss stage returns M entries in microbatch order and every other rank ``[]``;
* forward-only calls, repeated calls accumulating gradients, eval / train / eval sequences;
* the compute order each rank's model records equals the plan's (``Plan.action_labels``);
* every Megatron-Core 0.16.1 trace vector with PP in {2, 4}: the recorded per-rank sequence of forwards (with the
  ``is_first_microbatch`` / checkpoint / last-stage flags), backwards (with grad sync on or off), ``no_sync``
  enter/exit, ``grad_sync_func`` / ``param_sync_func`` calls and ``finalize_model_grads_func`` equals Megatron's,
  and rejected configurations raise the same exception type on every rank.
"""
from __future__ import annotations

import pytest

from tests.helpers.megatron_vectors import VECTORS, missing_vectors, vectors
from tests.helpers.pipeline_jobs import (case, check_equivalence, check_traces, label, megatron_events, register, run_case,
                                 shared_results, trace_cases)

TOL = 1e-5
MODES = [dict(batch=True, overlap=False), dict(batch=False, overlap=False), dict(batch=False, overlap=True)]
LARGEST = {}


def _grid(pp: int) -> list[dict]:
    cases = []
    one_f_one_b = (1, 2, 3, 5) if pp == 2 else (1, 2, 3, 4, 6)
    interleaved = ((2, 2), (4, 2), (5, 3), (6, 4)) if pp == 2 else ((4, 4), (8, 4), (9, 5), (10, 5))
    for M in one_f_one_b:
        for mode in MODES[:2]:
            for dealloc in (False, True):
                cases.append(case(M=M, dealloc=dealloc, **mode))
    for M, G in interleaved:
        for mode in MODES:
            for dealloc in (False, True):
                cases.append(case(chunks=2, M=M, G=G, dealloc=dealloc, **mode))
    # forward-only, repeated calls, eval/train/eval sequences (different M and sequence length per call)
    cases += [case(M=3, forward_only=True), case(chunks=2, M=interleaved[2][0], G=interleaved[2][1],
                                                 forward_only=True),
              case(chunks=2, M=2 * pp, G=pp, forward_only=True, **MODES[2]),
              case(M=4, repeats=3), case(chunks=2, M=2 * pp, G=pp, repeats=2, dealloc=True),
              case(chunks=2, G=pp, sequence=[(True, 2 * pp, 4), (False, 2 * pp, 4), (True, 3 * pp, 6),
                                             (True, 2 * pp, 4), (False, 3 * pp, 6), (False, 2 * pp, 2)]),
              case(M=3, sequence=[(True, 3, 4), (False, 5, 4), (True, 2, 6), (False, 1, 3)], batch=False),
              case(M=pp, layers=2, hidden=16, dealloc=True)]
    # negotiated shapes (variable_seq_lengths) in every P2P mode
    for mode in MODES:
        if not mode["overlap"]:
            cases.append(case(M=3, variable=True, dealloc=True, **mode))
        cases.append(case(chunks=2, M=interleaved[2][0], G=interleaved[2][1], variable=True, dealloc=True, **mode))
    return cases


def _trace_cases(pp: int):
    return trace_cases(vectors("trace:"), pp) if VECTORS.is_file() else []


def _register(pp: int):
    traces = _trace_cases(pp)
    grid = _grid(pp)
    return grid, register(pp, grid), traces, register(pp, [c for _, c in traces])


_JOBS = {pp: _register(pp) for pp in (2, 4)}  # run in the session's shared jobs (tests/helpers/pipeline_jobs.py)


def _results(pp: int):
    grid, grid_slice, traces, trace_slice = _JOBS[pp]
    results = shared_results(pp)
    return grid, results[grid_slice], traces, results[trace_slice]


@pytest.fixture(scope="module")
def pp2():
    return _results(2)


@pytest.fixture(scope="module")
def pp4():
    return _results(4)


def _check_equivalence(grid, per_case, pp):
    worst = check_equivalence(grid, per_case, pp, TOL)
    LARGEST[pp] = worst
    print(f"\nlargest relative error PP={pp}: {worst:.3g} over {len(grid)} configurations")


@pytest.mark.timeout(280)
def test_equivalence_pp2(pp2):
    grid, per_case, _, _ = pp2
    _check_equivalence(grid, per_case, 2)


@pytest.mark.timeout(280)
def test_equivalence_pp4(pp4):
    grid, per_case, _, _ = pp4
    _check_equivalence(grid, per_case, 4)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("fixture", ["pp2", "pp4"])
def test_compute_order_equals_plan(fixture, request):
    grid, per_case, _, _ = request.getfixturevalue(fixture)
    for c, ranks in zip(grid, per_case):
        for r in ranks:
            for call in r["calls"]:
                assert call["order"] == call["plan_order"], f"{label(c)} rank {r['rank']}"


@pytest.mark.timeout(280)
def test_dealloc_shrinks_sent_outputs(pp2):
    grid, per_case, _, _ = pp2
    for c, ranks in zip(grid, per_case):
        for r in ranks:
            for call in r["calls"]:
                if not call["sent_numels"]:
                    continue
                if c["dealloc"] and not call["forward_only"]:
                    assert call["sent_numels"] == [1], label(c)
                else:
                    assert 1 not in call["sent_numels"], label(c)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("fixture", ["pp2", "pp4"])
def test_megatron_traces(fixture, request):
    _, _, traces, per_case = request.getfixturevalue(fixture)
    if not VECTORS.is_file():
        missing_vectors(f"Megatron vectors not found at {VECTORS}")
    assert traces, "no Megatron trace vectors for this pipeline size"
    check_traces(traces, per_case)


@pytest.mark.timeout(60)
def test_megatron_traces_one_rank():
    """The PP = 1 traces (no pipelining; 1F1B on one rank) run in this process without torch.distributed."""
    from engine.runtime.process_groups import ProcessGroupCollection
    pgc = ProcessGroupCollection()
    checked = 0
    for v in vectors("trace:"):
        a = v["args"]
        if a["pp_size"] != 1 or a["schedule"] == "interleaved" or a["num_microbatches"] < 1:
            continue
        c = case(M=a["num_microbatches"], forward_only=a["forward_only"], first_val_step=a["first_val_step"],
                 hooks=a["grad_sync_func/param_sync_func given"])
        c["func"] = v["function"].split(".")[-1]
        r = run_case(0, pgc, c)
        want = v["result"]["per_rank"]["0"]
        assert r["error"] is None, r["error"]
        assert r["calls"][0]["order"] == want["compute_order"]
        assert r["calls"][0]["events"] == megatron_events(want["events"]), a
        assert r["grad_err"] <= TOL
        checked += 1
    assert checked >= 3


@pytest.mark.timeout(60)
def test_tracer_spans_one_rank():
    """The executor reports one "compute" span per action, labelled like the plan, to the installed tracer."""
    import contextlib

    from engine.plan import build_plan
    from engine.runtime.process_groups import ProcessGroupCollection
    from engine.runtime.tracing import use_tracer

    class Recorder:
        def __init__(self):
            self.spans = []

        @contextlib.contextmanager
        def span(self, category, label):
            self.spans.append((category, label))
            yield

    rec = Recorder()
    with use_tracer(rec):
        r = run_case(0, ProcessGroupCollection(), case(M=3))
    assert r["error"] is None
    plan = build_plan("no_pipelining", 1, 3)
    assert [label for cat, label in rec.spans if cat == "compute"] == [a.label for a in plan.actions[0]]


def test_largest_error_recorded(pp2, pp4):
    _check_equivalence(pp2[0], pp2[1], 2)
    _check_equivalence(pp4[0], pp4[1], 4)
    assert max(LARGEST.values()) <= TOL
    assert max(LARGEST.values()) < 1e-6, LARGEST  # fp32: the pipelined run does the reference's arithmetic
