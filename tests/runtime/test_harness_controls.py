"""Negative controls: the equivalence harness detects what it exists to detect.

Cases that must fail, run in the session's 2-rank job (``tests/helpers/pipeline_jobs.py``) next to the real ones, and
asserted to be *caught* by the same checks the equivalence and trace tests apply:

* a ``grad_scale_func`` (x 2) that the reference does not apply -> gradients differ (``check_equivalence``);
* a loss without ``/ M`` (the loss function returns ``M x`` the loss) -> gradients differ;
* rank 0 running its last two backwards swapped -> gradients are unchanged (the numeric check cannot see it),
  but the compute order differs from Megatron's trace of the same schedule (``check_traces``).

And the matching positive controls: the same cases without the plant pass.
"""
from __future__ import annotations

import pytest

from tests.helpers.megatron_vectors import vectors
from tests.helpers.pipeline_jobs import case, check_equivalence, check_traces, register, shared_results, trace_cases

TOL = 1e-5
PLANTED = [case(M=4, plant="grad_scale"), case(chunks=2, M=4, G=2, plant="no_M"), case(M=3, plant="no_M", mode=3)]
CONTROLS = [case(M=4, grad_scale=2.0), case(chunks=2, M=4, G=2), case(M=3, mode=3)]
_PLANTED, _CONTROLS = register(2, PLANTED), register(2, CONTROLS)
_SWAPPED = register(2, [("tests.helpers.pipeline_jobs", "swapped_backward_plan")])


@pytest.fixture(scope="module")
def pp2():
    return shared_results(2)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("index", range(len(PLANTED)), ids=[c["plant"] + f"-{c['chunks'] or 1}c" for c in PLANTED])
def test_planted_loss_scaling_is_detected(pp2, index):
    ranks = pp2[_PLANTED][index]
    with pytest.raises(AssertionError, match="rank"):
        check_equivalence([PLANTED[index]], [ranks], 2, TOL)
    assert max(r["grad_err"] for r in ranks) > 0.4  # x 2, x 4, x 3: far outside fp32 rounding


@pytest.mark.timeout(280)
def test_controls_without_the_plant_pass(pp2):
    check_equivalence(CONTROLS, pp2[_CONTROLS], 2, TOL)


def _interleaved_trace(pp: int, M: int, G: int):
    for vector, c in trace_cases(vectors("trace:megatron.core.pipeline_parallel.schedules."), pp):
        if (c["chunks"], c["M"], c["G"], c["batch"], c["forward_only"], c["dealloc"], c["hooks"]) == \
                (2, M, G, True, False, False, False):
            return vector, c
    raise AssertionError(f"no interleaved PP={pp} M={M} G={G} trace vector")


@pytest.mark.timeout(280)
def test_swapped_backwards_are_caught_by_the_traces_not_the_numbers(pp2):
    ranks = pp2[_SWAPPED][0]
    assert max(r["grad_err"] for r in ranks) <= TOL  # numerically equivalent: the reason order checks exist
    assert all(r["order"] == r["plan_order"] for r in ranks)  # the executor ran the (swapped) plan it was given
    vector, c = _interleaved_trace(2, 4, 2)
    assert ranks[1]["order"] == vector["result"]["per_rank"]["1"]["compute_order"]
    as_run = [{"pp_rank": r["pp_rank"], "error": None, "calls": [{"order": r["order"]}]} for r in ranks]
    with pytest.raises(AssertionError, match="rank 0"):
        check_traces([(vector, c)], [as_run])
