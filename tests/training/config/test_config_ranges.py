"""Values that pass the type checks but cannot run are refused by :func:`engine.training.config.validate`, before
any rank starts: every numeric field against the range in its own metadata, and every plan a config implies (the
training step, evaluation's and sampling's forward-only plans) built and validated, an impossible ``max_in_flight``
named with the smallest that works."""
from __future__ import annotations

import argparse
import typing
from pathlib import Path

import pytest

from engine.plan import ScheduleSpec, register_schedule
from engine.plan.build import build_plan
from engine.plan.types import Action, Op, Plan
from engine.plan.validate import validate_plan
from engine.training import launch
from engine.training.config import ConfigError, TrainConfig, load_config
from engine.training.config.fields import config_fields, field_range

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = ROOT / "configs" / "default.yaml"


RANGES = {name: field_range(f) for name, _, f in config_fields(TrainConfig) if field_range(f) is not None}


def _numeric_fields() -> set[str]:
    """Every field (subsections' too, e.g. ``model.moe.top_k``) annotated with a number type."""
    return {name for name, hint, _ in config_fields(TrainConfig)
            if (set(typing.get_args(hint)) or {hint}) & {int, float}}


def test_every_numeric_field_has_a_range_and_no_other_field_has_one():
    assert set(RANGES) == _numeric_fields()


def _beyond(rule):
    """Values just outside each finite bound of ``rule`` (ints for int bounds)."""
    out = []
    if rule.low is not None:
        out.append(rule.low if rule.low_open else (rule.low - 1 if isinstance(rule.low, int) else rule.low - 1e-3))
    if rule.high is not None:
        out.append(rule.high if rule.high_open else (rule.high + 1 if isinstance(rule.high, int) else rule.high * 2))
    return out


@pytest.mark.parametrize("name", sorted(RANGES))
def test_each_row_refuses_values_beyond_its_bounds_naming_the_field(name):
    for value in _beyond(RANGES[name]):
        with pytest.raises(ConfigError) as info:
            load_config(None, {name: value})
        message = str(info.value)
        assert message.startswith(f"{name}="), message
        assert "\n" not in message and RANGES[name].fix in message, message


@pytest.mark.parametrize("override,field", [
    ("optimizer.lr=1e300", "optimizer.lr=1e+300 is over the upper bound"),
    ("optimizer.beta2=1", "optimizer.beta2=1.0 must be below 1"),
    ("parallel.timeout_s=1e300", "parallel.timeout_s=1e+300 is over the upper bound"),
    ("training.seed=-1", "training.seed=-1 must be an integer >= 0"),
    ("training.seed=99999999999999", "training.seed=99_999_999_999_999 is over the upper bound"),
    ("training.num_microbatches=100000000", "training.num_microbatches=100_000_000 is over the upper bound"),
])
def test_values_that_failed_on_the_ranks_are_refused(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, [override])
    assert str(info.value).startswith(field), str(info.value)


def test_tokens_per_step_must_fit():
    with pytest.raises(ConfigError, match=r"tokens per step is over the upper bound"):
        load_config(None, {"training.num_microbatches": 1 << 20, "training.micro_batch_size": 1 << 20,
                           "model.seq_length": 1 << 4})


def _plan_builds(max_in_flight: int) -> bool:
    """Independently of the config code: does zb's training plan of the default config build and validate?"""
    try:
        validate_plan(build_plan("zb", 2, 4, 2, max_in_flight=max_in_flight))
    except (ValueError, RuntimeError):
        return False
    return True


def test_an_impossible_max_in_flight_names_the_smallest_that_works():
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, ["parallel.schedule=zb", "parallel.max_in_flight=1"])
    message = str(info.value)
    least = next(k for k in range(1, 17) if _plan_builds(k))
    assert least > 1
    assert message.startswith("parallel.max_in_flight=1 is too small"), message
    assert f"use parallel.max_in_flight >= {least} " in message, message
    load_config(DEFAULT, ["parallel.schedule=zb", f"parallel.max_in_flight={least}"])  # the named value runs


def _broken_eval(pp_size, num_microbatches, num_model_chunks, forward_only, **_):
    """A one-chunk schedule whose training plan is GPipe and whose forward-only plan loses microbatch 0 on the
    last rank (its input is never consumed: the validator refuses it)."""
    def actions(rank):
        fwd = [Action(Op.FORWARD, 0, m) for m in range(num_microbatches)]
        if forward_only:
            return tuple(fwd[1:] if rank == pp_size - 1 else fwd)
        return tuple(fwd + [Action(Op.BACKWARD, 0, m) for m in range(num_microbatches)])
    return Plan("test_broken_eval", pp_size, 1, num_microbatches, pp_size, forward_only,
                tuple(num_microbatches for _ in range(pp_size)), tuple(actions(r) for r in range(pp_size)))


@pytest.fixture
def broken_eval_schedule():
    """Registered for one test only (other tests iterate over every registered schedule)."""
    from engine.plan import registry
    register_schedule(ScheduleSpec(name="test_broken_eval", build=_broken_eval, chunks=1,
                                   summary="GPipe with a broken forward-only plan"), replace=True)
    yield
    registry._REGISTRY.pop("test_broken_eval", None)


def test_a_broken_evaluation_plan_is_refused_naming_the_field(broken_eval_schedule):
    overrides = ["parallel.schedule=test_broken_eval", "parallel.virtual=1", "training.eval_microbatches=3"]
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, overrides)
    assert str(info.value).startswith("training.eval_microbatches=3: the plan of evaluation cannot be built"), \
        str(info.value)


def test_the_cli_refuses_it_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "run_spawned", lambda *a, **k: pytest.fail("ranks spawned despite a bad plan"))
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    args, extra = parser.parse_known_args([str(DEFAULT), f"--logging.run_dir={tmp_path}",
                                           "--parallel.schedule=zb", "--parallel.max_in_flight=1"])
    args.extra = extra
    assert launch.run(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: parallel.max_in_flight=1 is too small"), lines
