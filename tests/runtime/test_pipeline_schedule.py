"""``engine.schedules.PipelineSchedule``: a schedule bound once, whose calls agree across the pipeline ranks only when
their sizes change.

One 2-rank gloo job counts the ``all_gather`` calls (the agreement's collective; nothing else in these calls
all-gathers) over phases of equal calls -- many training calls, then forward-only calls with another microbatch
count, then training again: one agreement per phase -- and checks what the agreement is for: the bound calls give
the losses and gradients of the public function (which agrees on every call: counted too), a rejection on one
rank at the first call is raised on both, and ranks whose sizes change to different values raise the
disagreement on both.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from tests.helpers import models as tm
from tests.helpers.distributed import run_ranks

M, FORWARD_M, SEQ, MBS, H = 4, 2, 4, 2, 8


def _counting_all_gather(counter: list):
    inner = dist.all_gather

    def all_gather(*args, **kwargs):
        counter[0] += 1
        return inner(*args, **kwargs)
    return inner, all_gather


def _calls(target, count: int, num_microbatches: int, forward_only: bool = False, iterators=None) -> list:
    """``count`` schedule calls through ``target`` (a bound ``forward_backward`` or the public function)."""
    out = []
    for _ in range(count):
        data = tm.make_data(num_microbatches, SEQ, MBS, H, seed=num_microbatches)
        out.append(target(forward_step_func=tm.make_forward_step(), num_microbatches=num_microbatches,
                          seq_length=SEQ, micro_batch_size=MBS, forward_only=forward_only,
                          data_iterator=tm.iterators(data, 1) if iterators is None else iterators))
    return out


def _error(target, *args, **kwargs) -> str | None:
    try:
        _calls(target, 1, *args, **kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _job(rank: int, world: int) -> dict:
    from engine import schedules
    from engine.model_parallel_config import ModelParallelConfig
    from engine.runtime.p2p import P2PCommunicator
    from engine.runtime.process_groups import build_process_groups
    pgc = build_process_groups(world)
    cfg = ModelParallelConfig(pipeline_model_parallel_size=world, pipeline_dtype=torch.float32, hidden_size=H)
    comm = P2PCommunicator(pgc.pp, cfg)
    counter = [0]
    inner, dist.all_gather = _counting_all_gather(counter)
    out = {"gathers": {}}

    def bind(model):
        return schedules.PipelineSchedule("1f1b", model=model, pg_collection=pgc, p2p_communicator=comm)

    def phase(name, *args, **kwargs):
        counter[0] = 0
        result = _calls(*args, **kwargs)
        out["gathers"][name] = counter[0]
        return result
    try:
        model, _ = tm.build_chunks(cfg, world, rank, 1)
        bound = bind(model).forward_backward
        phase("5 training calls", bound, 5, M)
        phase("3 forward-only calls, other M", bound, 3, FORWARD_M, True)
        phase("2 training calls", bound, 2, M)
        # the bound calls run what the public function runs: same losses and gradients (fresh chunks each)
        fresh, _ = tm.build_chunks(cfg, world, rank, 1)
        store = phase("bound: 2 training calls", bind(fresh).forward_backward, 2, M)
        out["bound"] = {"losses": [[float(e["loss"]) for e in s] for s in store], "grads": tm.chunk_grads(fresh)}
        fresh, _ = tm.build_chunks(cfg, world, rank, 1)
        function = functools.partial(schedules.forward_backward_pipelining_with_schedule, schedule="1f1b",
                                     model=fresh, pg_collection=pgc, p2p_communicator=comm)
        store = phase("function: 2 training calls", function, 2, M)
        out["function"] = {"losses": [[float(e["loss"]) for e in s] for s in store], "grads": tm.chunk_grads(fresh)}
        # a rejection at the first call (rank 0's data_iterator list is too long) reaches both ranks
        first = bind(model).forward_backward
        out["rejected"] = _error(first, M, iterators=[iter([]), iter([])] if rank == 0 else None)
        # after an agreed call, both ranks change their sizes -- to different counts: both raise
        _calls(first, 1, M)
        out["disagree"] = _error(first, 6 if rank == 0 else 8, True)
    finally:
        dist.all_gather = inner
        pgc.destroy()
    return out


@pytest.mark.timeout(240)
def test_agreement_runs_when_the_sizes_change_not_every_call():
    results = run_ranks(_job, 2, timeout=200)
    for rank, r in enumerate(results):
        # sizes agreed once stay agreed: the training calls after the forward-only ones gather nothing
        assert r["gathers"] == {"5 training calls": 1, "3 forward-only calls, other M": 1, "2 training calls": 0,
                                "bound: 2 training calls": 1, "function: 2 training calls": 2}, (rank, r["gathers"])
        assert r["bound"]["losses"] == r["function"]["losses"]
        for layer, grads in r["bound"]["grads"].items():
            assert all(torch.equal(a, b) for a, b in zip(grads, r["function"]["grads"][layer])), (rank, layer)
        assert r["rejected"] is not None and "data_iterator" in r["rejected"], (rank, r["rejected"])
        assert r["disagree"] is not None and "different num_microbatches" in r["disagree"], (rank, r["disagree"])
    assert results[1]["rejected"].endswith("instead of waiting for it]")  # rank 1 stops because rank 0 rejected
    assert all(results[1]["bound"]["losses"]) and not any(results[0]["bound"]["losses"])  # rank 1: the loss stage
