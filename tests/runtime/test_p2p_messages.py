"""What crosses the pipeline: receivers allocate exactly what was sent, and large messages with deallocation.

Cases in the session's 2-rank job (``tests/helpers/pipeline_jobs.py``).  The test model records, for every activation and
output gradient a chunk receives from its neighbour, the tensor's shape and the bytes of the storage behind it.

* ``variable_seq_lengths`` (shapes negotiated per message) with a different sequence length per microbatch, in
  every P2P mode, 1F1B and interleaved: each received tensor has the sender's shape ``[s_mb, b, h]`` and a storage
  of exactly ``s_mb * b * h`` elements (no padded or reused larger buffer), one activation and one gradient per
  microbatch and chunk off the pipeline ends; fixed shapes likewise;
* 8 MiB messages (gloo sends then wait for the receiver) with ``deallocate_pipeline_outputs`` in unbatched and
  overlapped P2P: gradients equal the reference, every sent output is shrunk to one element, received buffers are
  exact.
"""
from __future__ import annotations

import pytest

from tests.helpers.pipeline_jobs import case, check_equivalence, label, register, shared_results

TOL = 1e-5
SEQS = [4, 7, 2, 5]
BIG = dict(kind="diag", hidden=131072, seq=16, mbs=1)  # 8 MiB fp32 per message
EXACT = [case(M=4, variable=True, seqs=SEQS), case(M=4, variable=True, seqs=SEQS, batch=False),
         case(chunks=2, M=4, G=2, variable=True, seqs=SEQS),
         case(chunks=2, M=4, G=2, variable=True, seqs=SEQS, batch=False, overlap=True, dealloc=True),
         case(chunks=2, M=4, G=2, seq=6, batch=False)]
LARGE = [case(M=3, batch=False, dealloc=True, **BIG),
         case(chunks=2, M=4, G=2, batch=False, overlap=True, dealloc=True, **BIG)]
_EXACT, _LARGE = register(2, EXACT), register(2, LARGE)


@pytest.fixture(scope="module")
def pp2():
    return shared_results(2)


def _expected(c: dict, pp_rank: int) -> list[tuple]:
    """``(kind, mb, shape, bytes)`` of every tensor ``pp_rank`` must receive in one call of case ``c`` (fp32)."""
    chunks, pp = c["chunks"] or 1, 2
    out = []
    for chunk in range(chunks):
        stage = chunk * pp + pp_rank
        for mb in range(c["M"]):
            s = c["seqs"][mb] if c["seqs"] else c["seq"]
            shape = (s, c["mbs"], c["hidden"])
            nbytes = s * c["mbs"] * c["hidden"] * 4
            if stage > 0:
                out.append(("act", mb, shape, nbytes))
            if stage < pp * chunks - 1:
                out.append(("grad", mb, shape, nbytes))
    return sorted(out)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("index", range(len(EXACT)), ids=lambda i: "-".join(
    f"{k}={v}" for k, v in label(EXACT[i]).items() if k not in ("M", "mode", "repeats", "layers", "seqs")))
def test_receivers_allocate_exactly_what_was_sent(pp2, index):
    c, ranks = EXACT[index], pp2[_EXACT][index]
    check_equivalence([c], [ranks], 2, TOL)
    for r in ranks:
        assert r["calls"][0]["received"] == _expected(c, r["pp_rank"]), f"{label(c)} rank {r['pp_rank']}"


@pytest.mark.timeout(280)
@pytest.mark.parametrize("index", range(len(LARGE)), ids=["1f1b-unbatched", "interleaved-overlapped"])
def test_large_messages_with_deallocation(pp2, index):
    c, ranks = LARGE[index], pp2[_LARGE][index]
    check_equivalence([c], [ranks], 2, TOL)
    for r in ranks:
        call = r["calls"][0]
        assert call["received"] == _expected(c, r["pp_rank"]), f"{label(c)} rank {r['pp_rank']}"
        if r["pp_rank"] == 0 or c["chunks"]:  # ranks that send activations
            assert call["sent_numels"] == [1], f"{label(c)} rank {r['pp_rank']}: sent outputs not deallocated"
