"""The quick loop's multi-rank runtime checks: one small job of 2 gloo ranks (not in ``MULTIPROCESS_MODULES``, so
``pytest -m "not slow"`` runs it).

* A ZB-V step (V placement: rank 1 hands stage 1's output to stage 2 locally, rank 0 holds the first and the last
  stage; split backward) equals the single-process reference and runs the plan's order.
* Summation order: six microbatches whose loss scales span nine orders of magnitude (``SCALES``), so their
  gradient contributions sum to different fp32 values in different orders.  Under 1F1B, interleaved 1F1B, ZB-H1,
  ZB-V, V-Half, V-Min and cost-aware ``zb`` / ``zbv`` plans every model chunk's ``.grad`` must be bitwise the
  plain-autograd sum in microbatch order (one backward
  per microbatch, accumulated into ``.grad``).  A weight-gradient pass (W) that runs the microbatches of a chunk out
  of order passes every tolerance check but fails this one.

The slow grid (every schedule, P2P mode and size) is in ``tests/runtime/test_zero_bubble_pipeline.py`` and
``tests/runtime/test_equivalence.py``.
"""
from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.quick_jobs import SUMMATION_SCHEDULES, pipeline_job

TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return run_ranks(pipeline_job, 2, timeout=50)


@pytest.mark.timeout(60)
def test_zbv_step_equals_the_reference(results):
    for r in results:
        z = r["zbv"]
        assert z["error"] is None, f"rank {r['zbv']['rank']} raised {z['error']}"
        assert z["grad_err"] <= TOL, f"rank {z['rank']}: gradient error {z['grad_err']:.2e} against the reference"
        assert z["loss_err"] <= TOL, f"rank {z['rank']}: loss error {z['loss_err']:.2e} against the reference"
        call = z["calls"][0]
        assert call["order"] == call["plan_order"], f"rank {z['rank']}: the F/B order is not the plan's"
        assert call["store_len"] == (4 if z["pp_rank"] == 0 else 0), "ZB-V: rank 0 holds the last stage"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", range(len(SUMMATION_SCHEDULES)), ids=[s for s, _ in SUMMATION_SCHEDULES])
def test_gradients_sum_in_microbatch_order(results, index):
    for r in results:
        s = r["sums"][index]
        assert s["order_sensitive"], f"{s['schedule']} rank {s['rank']}: the scales do not make the order visible"
        assert not s["mismatch"], (f"{s['schedule']} rank {s['rank']}: .grad is not bitwise the microbatch-order "
                                   f"sum (layer: max |diff|) {s['mismatch']}")
