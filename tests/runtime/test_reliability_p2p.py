"""Reliability of the schedule API between pipeline stages (2 gloo ranks, one spawn, every case in fresh pipeline
groups with a short timeout so that a hang would show up as a timeout error, not a stuck test).  Nothing here
asserts how long a case took (the suite runs on busy machines): "before any P2P" is the count of posted sends and
receives, "the group's timeout, not a hang" is gloo's timeout error.

* bad input on only one rank (``num_microbatches=0``, a different ``num_microbatches`` / ``seq_length`` /
  ``config.pipeline_dtype``): every rank raises before any P2P, at once, naming the field and the per-rank values;
* a stage that sends a tensor of the wrong shape or dtype gets a clear error on the sender (the receiver stops at the
  pipeline group's timeout; under the launcher it is stopped as soon as the sender's process exits);
* ``variable_seq_lengths``: the shape handshake makes the receiver allocate exactly what was sent (no truncation or
  padding), and a sent shape that cannot be right is a clear error;
* the communication timeout is the pipeline group's (``parallel.timeout_s`` in training): a peer that never comes
  fails the waiting rank after that long.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.reliability_jobs import pipeline_cases

T = 2.0  # pipeline-group timeout of the cases that must wait for a peer (seconds)
SLOW = 10  # pipeline-group timeout of the cases that must fail before any wait

CASES = {
    "ok": dict(),
    "M_zero_on_one_rank": dict(num_microbatches={1: 0}, timeout_s=SLOW),
    "M_differs": dict(num_microbatches={1: 2}, timeout_s=SLOW),
    "seq_length_differs": dict(seq_length={0: 6}, timeout_s=SLOW),
    "pipeline_dtype_differs": dict(pipeline_dtype={0: "float64"}, timeout_s=SLOW),
    "pipeline_dtype_differs_variable": dict(pipeline_dtype={0: "float64"}, variable_seq_lengths=True,
                                            timeout_s=SLOW),
    "wrong_shape": dict(out_hidden={0: 9}, timeout_s=T),
    "wrong_dtype": dict(out_dtype={0: "float64"}, timeout_s=T),
    "variable_ok": dict(variable_seq_lengths=True, seq_length={0: 5, 1: 5}),
    "variable_wrong_hidden": dict(out_hidden={0: 9}, variable_seq_lengths=True, timeout_s=T),
    # the sender does not know the hidden size (config.hidden_size=0): the receiver's handshake check catches it
    "variable_wrong_hidden_receiver": dict(out_hidden={0: 9}, config_hidden={0: 0}, variable_seq_lengths=True,
                                           timeout_s=T),
    "peer_absent": dict(skip={1: T + 1}, timeout_s=T),
}


@pytest.fixture(scope="module")
def outcomes():
    names = list(CASES)
    results = run_ranks(pipeline_cases, 2, [CASES[n] for n in names], timeout=150, pg_timeout=60)
    return {name: (results[0][i], results[1][i]) for i, name in enumerate(names)}


def _both_fail_fast(out, *parts):
    for rank, r in enumerate(out):
        assert not r["ok"], f"rank {rank} did not fail"
        assert r["p2p_ops"] == 0, f"rank {rank} posted {r['p2p_ops']} P2P operations before failing"
        for part in parts:
            assert part in r["error"], f"rank {rank}: {part!r} not in {r['error']!r}"


@pytest.mark.timeout(160)
def _reference(hidden: int, seq: int, mbs: int, m: int):
    """The two stages of ``tests.helpers.reliability_jobs._Stage`` run unpipelined: per-microbatch losses and each stage's
    weight gradient of ``sum(loss) / M`` (the schedule's loss contract)."""
    weights = [(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(r)) / hidden ** 0.5)
               .requires_grad_() for r in (0, 1)]
    losses = []
    for i in range(m):
        x = torch.randn(seq, mbs, hidden, generator=torch.Generator().manual_seed(i))
        for w in weights:
            x = torch.tanh(x @ w.t())
        losses.append(x.square().mean())
    (sum(losses) / m).backward()
    return [loss.item() for loss in losses], [w.grad for w in weights]


def test_sane_calls_run(outcomes):
    """Sane calls (fixed and negotiated shapes) return the reference's losses on the last stage and its gradients
    on both."""
    for name, seq in (("ok", 4), ("variable_ok", 5)):
        assert all(r["ok"] for r in outcomes[name]), outcomes[name]
        losses, grads = _reference(8, seq, 2, 3)
        first, last = outcomes[name]
        # the stored loss is a detach() of the loss tensor the schedule then divides by M in place (as Megatron)
        assert first["losses"] == [] and last["losses"] == pytest.approx([x / 3 for x in losses], rel=1e-6), name
        for r, want in zip((first, last), grads):
            assert torch.allclose(torch.tensor(r["grad"]), want, rtol=1e-5, atol=1e-7), name


@pytest.mark.timeout(160)
def test_bad_input_on_one_rank_fails_every_rank_before_p2p(outcomes):
    rank0, rank1 = outcomes["M_zero_on_one_rank"]
    assert rank1["error"].startswith("ValueError: num_microbatches=0") and "num_microbatches >= 1" in rank1["error"]
    # the other rank raises the same error (type, field, value, fix), saying where it came from
    assert rank0["error"].startswith(rank1["error"]) and "[raised on pipeline rank 1;" in rank0["error"], rank0
    assert rank0["p2p_ops"] == rank1["p2p_ops"] == 0, (rank0, rank1)
    _both_fail_fast(outcomes["M_differs"], "ValueError", "different num_microbatches: [3, 2]")
    _both_fail_fast(outcomes["seq_length_differs"], "ValueError", "different activation shape", "(6, 2, 8)",
                    "(4, 2, 8)")
    for name in ("pipeline_dtype_differs", "pipeline_dtype_differs_variable"):
        _both_fail_fast(outcomes[name], "ValueError", "different config.pipeline_dtype",
                        "['torch.float64', 'torch.float32']")


@pytest.mark.timeout(160)
def test_wrong_shape_or_dtype_is_a_clear_error_not_a_hang(outcomes):
    sender, receiver = outcomes["wrong_shape"]
    assert "RuntimeError" in sender["error"] and "produced shape (4, 2, 9)" in sender["error"] \
        and "expects (4, 2, 8)" in sender["error"], sender
    assert not receiver["ok"] and "Timed out" in receiver["error"], receiver  # the group timeout, not a hang
    assert "recv act F0.0 from pipeline rank 0 (global rank 0) failed" in receiver["error"], receiver
    sender, receiver = outcomes["wrong_dtype"]
    assert "torch.float64" in sender["error"] and "pipeline_dtype=torch.float32" in sender["error"], sender
    assert not receiver["ok"] and "Timed out" in receiver["error"], receiver


@pytest.mark.timeout(160)
def test_shape_handshake_catches_a_wrong_shape(outcomes):
    sender, receiver = outcomes["variable_wrong_hidden"]  # caught where it is made, before it is sent
    assert "F0.0 produced shape (4, 2, 9) on pipeline rank 0" in sender["error"] \
        and "hidden_size=8" in sender["error"], sender
    assert not receiver["ok"] and "from pipeline rank 0 (global rank 0) failed" in receiver["error"], receiver
    sender, receiver = outcomes["variable_wrong_hidden_receiver"]  # caught by the receiver's handshake check
    assert "shape handshake of recv act F0.0 from pipeline rank 0 announced shape (4, 2, 9)" in receiver["error"] \
        and "hidden_size=8" in receiver["error"], receiver
    assert not sender["ok"] and "Timed out" in sender["error"], sender  # its gradient never comes: the group timeout


@pytest.mark.timeout(160)
def test_communication_timeout_is_the_groups(outcomes):
    waiting, absent = outcomes["peer_absent"]
    assert absent["error"] == "skipped"
    assert not waiting["ok"] and "Timed out" in waiting["error"], waiting
    assert waiting["seconds"] >= T, f"gave up after {waiting['seconds']:.1f}s with a {T}s timeout"
