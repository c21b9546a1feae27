"""The quick loop's multi-rank training checks (not in ``MULTIPROCESS_MODULES``: ``pytest -m "not slow"`` runs
them), each one small spawned job with its own timeout.

* pp2 x dp2: a tiny GPT on 4 gloo ranks (pipeline 2 x data 2) trains 2 steps; every rank's gradients and loss equal
  plain autograd of the mean token cross-entropy over the global batch (the independent reference of
  ``tests/training/test_trainer_reference.py``, which runs the larger grid in the slow suite).
* Resume: a 4-step run straight through, and the same run saved after step 2 and resumed by a fresh trainer; the
  losses after the resume equal the straight run's exactly (model, optimizer state, LR schedule, data position).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.quick_jobs import resume_job
from tests.training.test_trainer_reference import STEPS, TOL, _train_world, max_rel_error, reference_grads

PP2_DP2 = {"pp2_dp2": dict(pipeline=2, data=2)}


@pytest.mark.timeout(100)
def test_pp2_dp2_step_equals_plain_autograd(tmp_path):
    per_rank = [r["pp2_dp2"]["steps"] for r in run_ranks(_train_world, 4, PP2_DP2, str(tmp_path), timeout=90)]
    for step in range(STEPS):
        loss, grads, _ = reference_grads(per_rank, step)
        for steps in per_rank:
            r = steps[step]
            where = f"step {step} pp_rank {r['pp_rank']} dp_rank {r['dp_rank']}"
            assert r["loss"] == pytest.approx(loss, rel=1e-6, abs=0), where
            for name, (_, grad) in r["params"].items():
                assert grad is not None, f"{where}: {name} has no gradient"
                err = max_rel_error(torch.from_numpy(grad), grads[name])
                assert err <= TOL, f"{where}: {name} differs from plain autograd by {err:.3g} (relative)"


@pytest.mark.timeout(100)
def test_resume_continues_exactly(tmp_path):
    for r in run_ranks(resume_job, 2, str(tmp_path), timeout=90):
        assert r["resumed_at"] == 2, r
        assert r["resumed"] == r["straight"], f"rank {r['rank']}: resumed {r['resumed']} != straight {r['straight']}"
