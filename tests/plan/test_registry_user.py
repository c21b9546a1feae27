"""A schedule defined outside the package (here: GPipe, all forwards then all backwards, Huang et al. 2019) joins
the registry and then works everywhere: build, validation, simulation, CSV export, config choices and
``pipecast train --help``, ``forward_backward_pipelining_with_schedule`` on 2 gloo ranks, and a training run started
by ``engine.training.launch_ranks`` (the ranks import this module to find the rank function, and so register the schedule
too)."""
from __future__ import annotations

import math

import pytest

from engine.plan import ScheduleSpec, build_plan, register_schedule, schedule_names
from engine.plan.registry import config_choices
from engine.plan.simulate import simulate
from engine.plan.torch_csv import plan_from_csv, plan_to_csv
from engine.plan.types import Action, Op, Plan
from engine.plan.validate import PlanError, validate_plan


BUILT = []   # (pp_size, num_microbatches, forward_only) of every plan built by this process


def _gpipe(pp_size, num_microbatches, num_model_chunks, forward_only, **_):
    BUILT.append((pp_size, num_microbatches, forward_only))
    fwd = tuple(Action(Op.FORWARD, 0, m) for m in range(num_microbatches))
    bwd = () if forward_only else tuple(Action(Op.BACKWARD, 0, m) for m in range(num_microbatches))
    return Plan("test_gpipe", pp_size, 1, num_microbatches, pp_size, forward_only,
                tuple(num_microbatches for _ in range(pp_size)), tuple(fwd + bwd for _ in range(pp_size)))


SPEC = register_schedule(ScheduleSpec(name="test_gpipe", build=_gpipe, summary="GPipe: all F, then all B"),
                         replace=True)


@pytest.mark.parametrize("P,M", [(1, 1), (2, 4), (4, 3), (4, 8)])
def test_a_user_schedule_builds_validates_simulates_and_exports(P, M):
    assert "test_gpipe" in schedule_names() and "test_gpipe" in config_choices()
    plan = build_plan("test_gpipe", P, M, 1)
    validate_plan(plan)
    sim = simulate(plan, forward_time=1.0, backward_time=2.0)
    # GPipe's step: (M + P - 1) forward slots and (M + P - 1) backward slots on the critical path
    assert sim.makespan == pytest.approx((M + P - 1) * 3.0)
    back = plan_from_csv(plan_to_csv(plan))
    assert back.actions == plan.actions
    assert not any(a.op is Op.BACKWARD for r in build_plan("test_gpipe", P, M, 1, forward_only=True).actions
                   for a in r)


def test_a_broken_user_builder_is_caught_by_the_validator():
    bad = _gpipe(2, 3, 1, False)
    swapped = tuple(tuple(reversed(r)) for r in bad.actions)   # backwards before their forwards
    with pytest.raises(PlanError):
        validate_plan(Plan("test_gpipe", 2, 1, 3, 2, False, bad.warmup, swapped))


def test_the_help_lists_a_user_schedule():
    from engine.training.config.help import field_rows
    meaning = {name: text for name, _, _, text in field_rows()}["parallel.schedule"]
    assert "test_gpipe: GPipe: all F, then all B" in meaning and "zbv: " in meaning


# ---- on 2 gloo ranks: the executor and the trainer ----------------------------------------------------------------
STEPS, M = 3, 4   # M >= 3: a sum of gradients in another order could differ in fp32 (two terms commute exactly)


def _user_job(config, other_config) -> dict:
    """One rank of the job (:func:`engine.training.launch_ranks` runs it): test_gpipe through
    ``forward_backward_pipelining_with_schedule`` against the single-process reference (a training call and a
    forward-only call, by name), then ``STEPS`` training steps under ``config`` (test_gpipe) and ``other_config``
    (1F1B)."""
    import torch
    import torch.distributed as dist

    from engine import Trainer
    from engine.runtime.process_groups import build_process_groups
    from tests.helpers.pipeline_jobs import case, run_case
    rank = dist.get_rank()
    executor = run_case(rank, build_process_groups(dist.get_world_size()),
                        case(schedule="test_gpipe", M=4, sequence=[(False, 4, 4), (True, 3, 4)]))
    losses, plans, grads = {}, {}, {}
    for cfg in (config, other_config):
        BUILT.clear()
        with Trainer(cfg) as trainer:
            name = trainer.schedule.spec.name
            losses[name] = [trainer.train_step()["loss"] for _ in range(STEPS)]
            plans[name] = (trainer.plan.schedule, list(BUILT))
            grads[name] = [p.grad.clone() for chunk in trainer.model for p in chunk.parameters()]  # the last step's
    return {"rank": rank, "executor": executor, "losses": losses, "plans": plans,
            "grads_equal": all(torch.equal(a, b) for a, b in zip(grads["test_gpipe"], grads["1f1b"]))}


@pytest.mark.slow   # ~12 s on an idle 2-core machine: two trainers and a spawn
@pytest.mark.multiprocess
@pytest.mark.timeout(100)
def test_a_user_schedule_runs_on_ranks_and_trains(tmp_path):
    from engine.training import launch_ranks, load_config
    from tests.helpers.quick_jobs import resume_overrides
    gpipe, ofob = (load_config(None, resume_overrides(str(tmp_path / name), STEPS)
                               + [f"parallel.schedule={name}", f"training.num_microbatches={M}"])
                   for name in ("test_gpipe", "1f1b"))
    for r in launch_ranks(_user_job, gpipe, ofob):
        ex = r["executor"]
        assert ex["error"] is None, ex["error"]
        train, forward_only = ex["calls"]
        assert train["order"] == train["plan_order"] and forward_only["order"] == forward_only["plan_order"]
        assert ex["grad_err"] <= 1e-6 and ex["loss_err"] <= 1e-6, ex   # against the single-process reference
        assert forward_only["grads_unchanged"]
        if r["rank"] == 1:   # the loss stage returns one entry per microbatch, in order
            assert train["store_mbs"] == [0, 1, 2, 3] and forward_only["store_len"] == 3
        # the trainer resolved the config to the user's entry and built its training plan with the user's builder
        # (config validation builds the training and evaluation plans first, so the builder may run more often)
        name, calls = r["plans"]["test_gpipe"]
        assert name == "test_gpipe" and (2, M, False) in calls and set(calls) <= {(2, M, False), (2, M, True)}
        assert r["plans"]["1f1b"] == ("1f1b", [])
        got, want = r["losses"]["test_gpipe"], r["losses"]["1f1b"]
        assert all(math.isfinite(x) for x in got), got
        # GPipe and 1F1B run each microbatch's F and B on the same values and accumulate the B passes in microbatch
        # order on every rank, so the steps agree bitwise: losses and the last step's gradients
        assert got == want, f"rank {r['rank']}: test_gpipe {got} != 1f1b {want}"
        assert r["grads_equal"], f"rank {r['rank']}: test_gpipe's gradients differ from 1f1b's"
