"""Transformer Engine layers with a split-backward schedule are refused in config validation (issue 24 item 2)."""
from pathlib import Path

import pytest

from engine.plan.registry import get_schedule, schedule_names
from engine.training.config import ConfigError, load_config

GPU_PRESET = Path(__file__).resolve().parents[2] / "configs" / "gpu_cuda_graphs.yaml"
ON_CPU = ["parallel.device=cpu", "parallel.backend=gloo"]  # config validation only: this machine has no GPU


def _split_schedules() -> list[str]:
    return [n for n in schedule_names() if get_schedule(n).splits_backward]


def test_gpu_preset_validates_and_does_not_split():
    config = load_config(GPU_PRESET, overrides=ON_CPU)
    assert config.model.transformer_engine
    assert not get_schedule(config.schedule_name).splits_backward


@pytest.mark.parametrize("overrides", [["parallel.schedule=zbv"], ["parallel.schedule=zb_h1", "parallel.virtual=1"]])
def test_te_layers_with_split_schedule_refused_naming_fields(overrides):
    with pytest.raises(ConfigError) as info:
        load_config(GPU_PRESET, overrides=overrides + ON_CPU)
    text = str(info.value)
    assert "model.transformer_engine=true" in text
    assert f"parallel.schedule={overrides[0].split('=')[1]}" in text
    assert "set model.transformer_engine=false" in text


def test_every_split_schedule_refused_and_torch_layers_accepted():
    assert {"zb_h1", "zbv"} <= set(_split_schedules())
    refused = []
    for name in _split_schedules():
        virtual = 2 if get_schedule(name).fits(2, 1) is not None else 1
        cfg = {"model.transformer_engine": True, "parallel.pipeline": 2, "parallel.virtual": virtual,
               "parallel.schedule": name}
        try:
            load_config(None, overrides=cfg)
        except ConfigError as exc:
            if "model.transformer_engine" in str(exc):
                refused.append(name)
        load_config(None, overrides={**cfg, "model.transformer_engine": False})  # torch layers split fine
    assert refused == _split_schedules()
