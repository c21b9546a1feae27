"""Expert parallelism and overlapped cells on 4 gloo ranks, against a plain single-process reference.

One spawned job (``tests.helpers.moe_jobs.job``) runs every case and returns what each rank computed:

* dispatch without a pipeline at expert-parallel size 1, 2 and 4 (random routing, 4 and 8 experts, top-2 / top-3,
  every token to one expert, balanced routing): outputs, input gradients, dense gradients (per rank) and expert
  gradients (summed over the expert-parallel group's tokens) equal the per-token reference; the all-to-all bytes
  equal the rows the reference routes to other ranks, and for balanced routing ``T k h d (P-1)/P`` per exchange;
* pipeline 2 x expert 2 (a user's MoE model written in ``tests/helpers/moe_jobs.py``) under 1F1B, ZB-H1,
  interleaved 1F1B (combined 1F1B with ``overlap_moe_expert_parallel_comm`` on and off), ZB-V and DualPipeV
  (overlap on and off): losses and gradients equal the reference; overlap on and off are bitwise equal; with
  overlap on, every overlapped cell has an all-to-all in flight across the other microbatch's compute.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import moe_jobs as mj
from tests.helpers.distributed import run_ranks

WORLD = 4
RTOL, ATOL = 1e-5, 1e-6  # fp32; ATOL for gradients that are rounding noise (a saturated top-1 router)


@pytest.fixture(scope="module")
def results():
    return run_ranks(mj.job, WORLD, timeout=400)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=what)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", range(len(mj.DISPATCH_CASES)), ids=lambda i: "-".join(map(str, mj.DISPATCH_CASES[i])))
def test_dispatch_equals_the_per_token_reference(results, case):
    ep, routing, num_experts, top_k = mj.DISPATCH_CASES[case]
    refs = [mj.dispatch_reference(r, routing, num_experts, top_k) for r in range(WORLD)]
    for r in range(WORLD):
        got = results[r]["dispatch"][case]
        y, x_grad, grads, kept = refs[r]
        where = f"ep={ep} {routing} rank {r}"
        assert len(got["ep_ranks"]) == ep and got["tokens"] == kept, where
        _close(got["y"], y, where)
        _close(got["x_grad"], x_grad, where)
        assert set(got["grads"]) == {n for n in grads if ".experts." not in n or _owned(n, got, num_experts, ep)}
        for name, g in got["grads"].items():  # an expert learns from every token of its expert-parallel group
            want = sum(refs[q][2][name] for q in got["ep_ranks"]) if ".experts." in name else grads[name]
            _close(g, want, f"{where} {name}")
        if routing == "one_expert":  # dropless: every token went through the one expert
            assert kept == [0] * (num_experts - 1) + [12] and bool((got["y"].abs().sum(1) > 0).all())


def _owned(name: str, got: dict, num_experts: int, ep: int) -> bool:
    e = int(name.split(".experts.")[1].split(".")[0])
    return got["first"] <= e < got["first"] + num_experts // ep


@pytest.mark.timeout(400)
def test_all_to_all_bytes_are_the_rows_routed_to_other_ranks(results):
    """Dispatch and combine-backward send the rows this rank routes to other ranks' experts; combine and
    dispatch-backward send back the rows its experts took from other ranks."""
    for case, (ep, routing, num_experts, top_k) in enumerate(mj.DISPATCH_CASES):
        local = num_experts // ep
        kept = [mj.dispatch_reference(r, routing, num_experts, top_k)[3] for r in range(WORLD)]
        for r in range(WORLD):
            got = results[r]["dispatch"][case]
            group, me = got["ep_ranks"], got["ep_ranks"].index(r)
            out = sum(c for e, c in enumerate(kept[r]) if e // local != me)
            into = sum(kept[q][e] for q in group if q != r for e in range(me * local, (me + 1) * local))
            exchanges = 4 if ep > 1 else 0  # dispatch and combine, forward and backward
            assert got["exchanges"] == exchanges, (case, r)
            assert got["bytes"] == (2 * out + 2 * into) * mj.H * 4 * (ep > 1), (case, r)
            if routing == "balanced":  # T k h d (P-1)/P per exchange, T = 16 tokens, k = 2, fp32
                assert got["bytes"] == 4 * 16 * 2 * mj.H * 4 * (ep - 1) // ep


@pytest.fixture(scope="module")
def reference_runs():
    return {chunks: mj.reference_run(2 * chunks, 2) for chunks in (1, 2)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", range(len(mj.PIPELINE_CASES)), ids=lambda i: "-".join(map(str, mj.PIPELINE_CASES[i])))
def test_pp2_ep2_equals_the_reference(results, reference_runs, case):
    schedule, chunks, overlap = mj.PIPELINE_CASES[case]
    ref = reference_runs[chunks]
    stores = 0
    for r in range(WORLD):
        got = results[r]["pipeline"][case]
        losses, grads = ref[got["dp_rank"]]
        where = f"{schedule} overlap={overlap} rank {r}"
        if got["losses"]:
            stores += 1
            assert got["losses"] == pytest.approx(losses, rel=RTOL), where
        for name, g in got["grads"].items():  # dense: this data-parallel rank's data; experts: both ranks' tokens
            want = ref[0][1][name] + ref[1][1][name] if ".experts." in name else grads[name]
            _close(g, want, f"{where} {name}")
        assert got["a2a_exchanges"] == 4 * mj.M * chunks  # 4 all-to-alls per block and microbatch
    assert stores == 2  # the loss stage of each data-parallel replica


@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule", ["dualpipev", "interleaved"])
def test_overlap_changes_no_bit_and_hides_each_cells_all_to_all(results, schedule):
    off, on = (mj.PIPELINE_CASES.index((schedule, 2, flag)) for flag in (False, True))
    for r in range(WORLD):
        a, b = results[r]["pipeline"][off], results[r]["pipeline"][on]
        assert a["losses"] == b["losses"]
        assert a["grads"].keys() == b["grads"].keys()
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"]), f"rank {r}"
        assert a["hidden"] == 0 and b["cells"] > 0
        assert b["hidden"] >= b["cells"], f"rank {r}: {b['hidden']} all-to-alls hidden in {b['cells']} cells"
