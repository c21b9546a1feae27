"""Training config: keys and types checked against the dataclasses, cross-field validation with errors that name
the field, overrides, and the presets in configs/."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from engine.training.config import (ConfigError, TrainConfig, apply_overrides, config_from_dict, dump_config,
                                    load_config, parse_override_args, validate, validate_world_size)

ROOT = Path(__file__).resolve().parents[3]


def _load(data: dict) -> TrainConfig:
    config = config_from_dict(data)
    validate(config)
    return config


# (config dict, exception type, substrings the message must contain)
BAD = [
    ({"model": {"num_layer": 4}}, ConfigError, ["model.num_layer", "num_layers"]),
    ({"modle": {}}, ConfigError, ["'modle'", "model"]),
    ({"model": {"num_layers": "4"}}, TypeError, ["model.num_layers", "'4'", "int"]),
    ({"model": {"num_layers": True}}, TypeError, ["model.num_layers"]),
    ({"optimizer": {"lr": "fast"}}, TypeError, ["optimizer.lr"]),
    ({"data": {"paths": "a.txt", "source": "text"}}, TypeError, ["data.paths", "list"]),
    ({"model": {"num_layers": 6}, "parallel": {"pipeline": 2, "virtual": 2}, "training": {"num_microbatches": 4}},
     ConfigError, ["model.num_layers=6", "2 x 2", "divisible by 4"]),
    ({"model": {"num_layers": 0}}, ConfigError, ["model.num_layers=0", ">= 1"]),
    ({"model": {"hidden_size": 130, "num_attention_heads": 4}}, ConfigError, ["model.hidden_size=130",
                                                                               "num_attention_heads=4"]),
    ({"model": {"seq_length": 1}}, ConfigError, ["model.seq_length=1"]),
    ({"model": {"vocab_size": 100}}, ConfigError, ["model.vocab_size=100", "256"]),
    ({"parallel": {"pipeline": 1, "virtual": 2}}, ConfigError, ["parallel.virtual=2", "parallel.pipeline"]),
    ({"parallel": {"pipeline": -2}}, ConfigError, ["parallel.pipeline=-2"]),
    # interleaved: M must be a multiple of P with the default group size (Megatron's rules)
    ({"parallel": {"pipeline": 4, "virtual": 2}, "model": {"num_layers": 8}, "training": {"num_microbatches": 3}},
     ValueError, ["training.num_microbatches=3", "microbatch_group_size_per_vp_stage"]),
    ({"parallel": {"pipeline": 4, "virtual": 2}, "model": {"num_layers": 8}, "training": {"num_microbatches": 6}},
     RuntimeError, ["training.num_microbatches=6", "remainder"]),
    ({"parallel": {"pipeline": 2, "virtual": 2, "microbatch_group_size_per_vp_stage": 8},
      "training": {"num_microbatches": 4}}, ValueError, ["microbatch_group_size_per_vp_stage=8", "[2, 4]"]),
    ({"parallel": {"pipeline": 2, "virtual": 2}, "training": {"num_microbatches": 4, "eval_microbatches": 3}},
     RuntimeError, ["training.eval_microbatches=3"]),
    ({"parallel": {"pipeline": 2, "microbatch_group_size_per_vp_stage": 2}}, ConfigError,
     ["microbatch_group_size_per_vp_stage", "interleaved"]),
    ({"parallel": {"pipeline": 2, "virtual": 2, "overlap_p2p_comm": True}}, ConfigError, ["overlap_p2p_comm"]),
    ({"parallel": {"device": "tpu"}}, ConfigError, ["parallel.device='tpu'", "'cuda'"]),
    ({"optimizer": {"min_lr": 1.0, "lr": 0.1}}, ConfigError, ["optimizer.min_lr=1.0"]),
    ({"optimizer": {"warmup_steps": -1}}, ConfigError, ["optimizer.warmup_steps=-1"]),
    ({"data": {"source": "text"}}, ConfigError, ["data.paths"]),
    ({"data": {"source": "text", "paths": ["/nonexistent/corpus"]}}, ConfigError, ["data.paths[0]",
                                                                                     "/nonexistent/corpus"]),
    ({"data": {"val_fraction": 0.9}}, ConfigError, ["data.val_fraction=0.9"]),
    ({"parallel": {"timeout_s": 0}}, ConfigError, ["parallel.timeout_s=0"]),
]


@pytest.mark.parametrize("data,exc,parts", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_config_names_field(data, exc, parts):
    with pytest.raises(exc) as info:
        _load(data)
    for part in parts:
        assert part in str(info.value), f"{part!r} not in {info.value}"


def test_world_size_must_be_pipeline_times_data():
    config = _load({"parallel": {"pipeline": 2, "data": 2}})
    assert config.world_size == 4
    assert validate_world_size(config, 4).parallel.data == 2
    with pytest.raises(ConfigError, match=r"world size 6 != parallel.pipeline x parallel.data = 2 x 2"):
        validate_world_size(config, 6)
    with pytest.raises(ConfigError, match="not divisible by parallel.pipeline=2"):
        validate_world_size(config, 3)
    # data unset: derived from the world size
    assert validate_world_size(_load({"parallel": {"pipeline": 2}}), 8).parallel.data == 4


def test_types_are_coerced_only_where_safe():
    config = _load({"optimizer": {"lr": 1}, "parallel": {"data": None}})
    assert isinstance(config.optimizer.lr, float) and config.parallel.data is None


def test_overrides_are_yaml_values_and_checked(tmp_path):
    args = parse_override_args(["--training.steps=7", "--optimizer.lr", "0.01", "--data.suffixes=[.txt]"])
    assert args == ["training.steps=7", "optimizer.lr=0.01", "data.suffixes=[.txt]"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"training": {"steps": 3}}))
    config = load_config(path, args)
    assert (config.training.steps, config.optimizer.lr, config.data.suffixes) == (7, 0.01, [".txt"])
    with pytest.raises(ConfigError, match="training.stepz"):
        load_config(path, ["training.stepz=3"])
    with pytest.raises(ConfigError, match="--section.key=value"):
        parse_override_args(["steps=3"])
    with pytest.raises(ConfigError, match="section.key"):
        apply_overrides({}, ["steps=3"])


def test_resolved_config_round_trips(tmp_path):
    config = load_config(ROOT / "configs" / "default.yaml", ["training.steps=11"])
    dump_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("model: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


@pytest.mark.parametrize("name,world,schedule", [("default", 2, "interleaved"), ("pp2_dp2", 4, "1f1b"),
                                                 ("pp4_1f1b", 4, "1f1b"), ("gpu_cuda_graphs", 4, "interleaved"),
                                                 ("pp2_tp2", 4, "1f1b")])
def test_presets(name, world, schedule):
    import torch
    path = ROOT / "configs" / f"{name}.yaml"
    if name == "gpu_cuda_graphs" and not torch.cuda.is_available():
        # a CUDA preset on a machine without CUDA fails in validation (before any rank is spawned), naming the fix
        with pytest.raises(ConfigError, match=r"parallel.device='cuda' needs CUDA.*parallel.device=auto"):
            load_config(path)
        config = load_config(path, check=False)
    else:
        config = load_config(path)
    assert (config.world_size, config.schedule_name) == (world, schedule)
    if name == "gpu_cuda_graphs":
        assert config.cuda_graphs.enabled and config.parallel.device == "cuda"


@pytest.mark.parametrize("schedule,virtual", [("zb_h1", 1), ("zbv", 2)])
def test_split_schedules_take_cuda_graphs_except_through_te(schedule, virtual):
    """F, B and W graphs exist for split backward (pipecast's capture, and the CPU emulation); only Transformer
    Engine's capture cannot take them, and saying so needs the setting's name and the fix."""
    base = {"parallel": {"pipeline": 2, "virtual": virtual, "schedule": schedule}, "model": {"num_layers": 4}}
    for backend in ("auto", "torch", "emulate"):
        config = _load({**base, "cuda_graphs": {"enabled": True, "backend": backend}})
        assert config.cuda_graphs.enabled and config.schedule_name == schedule
    with pytest.raises(ConfigError) as info:
        _load({**base, "cuda_graphs": {"enabled": True, "backend": "te"}})
    for part in (f"parallel.schedule={schedule}", "cuda_graphs.backend=te", "cuda_graphs.backend=torch"):
        assert part in str(info.value), info.value
    assert _load({**base, "cuda_graphs": {"enabled": False, "backend": "te"}}).cuda_graphs.backend == "te"


def test_old_schedule_section_is_refused_naming_training(tmp_path):
    """The section that held steps / seed / batch sizes is ``training:``; a config or override of the old name gets
    one error that names the new section."""
    old = tmp_path / "old.yaml"
    old.write_text("training:\n  steps: 3\nschedule:\n  steps: 5\n  seed: 7\n")
    with pytest.raises(ConfigError, match=r"'schedule' is now called 'training' \(steps, seed\).*'training:'"):
        load_config(old, check=False)
    with pytest.raises(ConfigError, match=r"now called 'training'.*--training\.steps"):
        load_config(None, ["schedule.steps=5"], check=False)
    assert load_config(None, ["training.steps=5"], check=False).training.steps == 5


def test_schedule_costs_build_the_plan_for_them_and_are_checked():
    """``parallel.schedule_costs`` reaches the builder through the run's one resolution; costs for a schedule that
    takes none, or that do not parse / fit the sizes, are refused naming the field."""
    from engine.plan import build_plan
    from engine.plan.pass_costs import PassCosts
    costs = "forward=1.0 backward=1.2 weight=0.5 transfer=0.05 weight_memory=0.4"
    base = {"parallel": {"pipeline": 2, "virtual": 2, "schedule": "zbv"}, "model": {"num_layers": 4}}
    config = _load({**base, "parallel": {**base["parallel"], "schedule_costs": costs}})
    plan = config.resolve_schedule().plan(config.training.num_microbatches)
    want = build_plan("zbv", 2, config.training.num_microbatches, 2, costs=PassCosts.parse(costs))
    assert plan.actions == want.actions != build_plan("zbv", 2, config.training.num_microbatches, 2).actions
    for schedule, value, message in [("zb_h1", costs, "parallel.schedule_costs=.* only applies to parallel.schedule="),
                                     ("zbv", "speed=1", "parallel.schedule_costs='speed=1' is invalid"),
                                     ("zbv", "forward=1/2/3", "has 3 ranks")]:
        virtual = 1 if schedule == "zb_h1" else 2
        with pytest.raises(ConfigError, match=message):
            _load({**base, "parallel": {"pipeline": 2, "virtual": virtual, "schedule": schedule,
                                        "schedule_costs": value}})


def test_tuned_leaves_the_layer_split_to_the_recommended_virtual_size(tmp_path):
    """``parallel.schedule: tuned`` takes ``parallel.virtual`` from tune.json: 6 layers do not split into the YAML's
    pipeline 2 x virtual 2, which must not be refused before the recommendation (virtual 1) is read."""
    from engine.training.config import validate
    config = load_config(ROOT / "configs" / "default.yaml", {"parallel.schedule": "tuned", "model.num_layers": 6,
                                                  "logging.run_dir": str(tmp_path)})
    validate(config)
    with pytest.raises(ConfigError, match="does not split evenly"):
        validate(load_config(ROOT / "configs" / "default.yaml", {"model.num_layers": 6, "logging.run_dir": str(tmp_path)}))
