"""Recomputation, bf16 with fp32 ``main_grad`` and uneven stages on 2 gloo ranks, through the public schedules API.

A user's small decoder (``tests/helpers/fit_jobs.py``: its own attention core module, untied head) is split by
``engine.split_model`` with an uneven pipeline layout for each schedule (1F1B, interleaved 1F1B, ZB-H1, ZB-V,
DualPipeV; the last three split the backward through the layer-level deferral, and a variant with an elementwise
parameter through the generic autograd split) and trained one step.  The cases join the shared PP = 2 job of
``tests/helpers/pipeline_jobs.py``:

* recomputation -- full (every layer), selective (every attention core), partial by microbatch (Megatron's
  ``num_microbatches_with_partial_activation_checkpoints = 1``) -- changes no gradient bit against the same schedule
  without it, with dropout on (the recomputation replays the random state);
* without dropout, every schedule's fp32 gradients equal the single-process unsplit model's bit for bit (uneven
  stages);
* bf16 parameters and bf16 stage messages with ``main_grad``: the gradients equal, bit for bit, the fp32 sum in
  microbatch order of each microbatch's bf16 gradient of the unsplit model, with and without full recomputation,
  and every message carries half the bytes of fp32's.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import fit_jobs as fj
from tests.helpers.pipeline_jobs import register, shared_results

SLICE = register(2, [("tests.helpers.fit_jobs", "pipeline_job")])


def _results() -> list:
    return shared_results(2)[SLICE][0]


def _merged(ranks: list, key) -> dict:
    out = {}
    for r in ranks:
        out.update(r[key]["grads"])
    return out


def _layer_calls(ranks, key) -> list:
    return [c for r in ranks for c in r[key]["calls"]]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", list(fj.SCHEDULES))
def test_recomputation_changes_no_gradient_bit(schedule):
    ranks = _results()
    base = _merged(ranks, (schedule, "none", False, False, 0.1))
    assert len(base) == len(dict(fj.TinyLM().named_parameters()))
    for recompute in ("full", "selective", "partial"):
        got = _merged(ranks, (schedule, recompute, False, False, 0.1))
        differ = [n for n in base if not torch.equal(got[n], base[n])]
        assert differ == [], f"{schedule} {recompute}: gradients differ in {differ[:4]}"
    calls = _layer_calls(ranks, (schedule, "full", False, False, 0.1))
    layers = fj.NUM_LAYERS * fj.M
    assert sorted(calls) == [(None, False)] * layers + [(None, True)] * layers  # each layer once more, in B
    # partial: the forwards flagged True run without grad (then once more with grad, in B), the others keep their
    # activations (one call with grad); some microbatches of each kind
    partial = _layer_calls(ranks, (schedule, "partial", False, False, 0.1))
    first = [flag for flag, grad in partial if not grad]
    assert set(first) == {True} and 0 < len(first) < layers, partial
    assert sum(1 for _, grad in partial if grad) == layers
    assert any(flag is False for flag, _ in partial)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generic_split_recomputes_exactly():
    """An elementwise parameter outside the deferred ops: ZB-H1 splits over the autograd graph, recomputed
    segments included."""
    ranks = _results()
    base = _merged(ranks, ("zb_h1", "none", True, False, 0.1))
    for recompute in ("full", "selective"):
        got = _merged(ranks, ("zb_h1", recompute, True, False, 0.1))
        assert all(torch.equal(got[n], base[n]) for n in base), recompute
    assert any(n.endswith("gate") for n in base)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", list(fj.SCHEDULES))
def test_uneven_stages_equal_the_unsplit_model(schedule, one_thread):
    """Bitwise: each chunk accumulates its microbatches' gradients in microbatch order, as the reference's
    backward passes do (the reference on one thread, as the ranks)."""
    ref = fj.reference_grads(fj.TinyLM(dropout=0.0), per_microbatch=False)
    ranks = _results()
    layers = {s: n for r in ranks for s, n in r[(schedule, "none", False, False, 0.0)]["layers"].items()}
    assert [layers[s] for s in sorted(layers)] == fj.SCHEDULES[schedule][2]  # the layout's stages, placed
    got = _merged(ranks, (schedule, "none", False, False, 0.0))
    assert set(got) == set(ref)
    differ = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert differ == [], f"{schedule}: gradients differ from the unsplit model's in {differ[:4]}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", list(fj.SCHEDULES))
def test_bf16_main_grad_is_the_fp32_sum_of_each_microbatchs_bf16_gradient(schedule, one_thread):
    """The reference runs on one thread as the ranks do (bf16 reductions split over threads round otherwise)."""
    ranks = _results()
    ref = fj.reference_grads(fj.TinyLM(dropout=0.0, dtype=torch.bfloat16), per_microbatch=True)
    fp32_bytes = sorted(b for r in ranks for b in r[(schedule, "none", False, False, 0.0)]["received"])
    for recompute in ("none", "full"):
        key = (schedule, recompute, False, True, 0.0)
        got = _merged(ranks, key)
        assert all(g.dtype == torch.float32 for g in got.values())
        differ = [n for n in ref if not torch.equal(got[n], ref[n])]
        assert differ == [], f"{schedule} {recompute}: main_grad differs in {differ[:4]}"
        assert not any(r[key]["grad_left"] for r in ranks), ".grad left beside main_grad"
        received = sorted(b for r in ranks for b in r[key]["received"])
        assert received and [2 * b for b in received] == fp32_bytes  # [s, b, h] in bf16: half of fp32
