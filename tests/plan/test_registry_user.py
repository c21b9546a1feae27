"""A schedule defined outside the package (here: GPipe, all forwards then all backwards, Huang et al. 2019) joins
the registry and then works in every plan-layer consumer: build, validation, simulation, CSV export, config
choices."""
from __future__ import annotations

import pytest

from engine.plan import ScheduleSpec, build_plan, register_schedule, schedule_names
from engine.plan.registry import config_choices
from engine.plan.simulate import simulate
from engine.plan.torch_csv import plan_from_csv, plan_to_csv
from engine.plan.types import Action, Op, Plan
from engine.plan.validate import PlanError, validate_plan


def _gpipe(pp_size, num_microbatches, num_model_chunks, forward_only, **_):
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
