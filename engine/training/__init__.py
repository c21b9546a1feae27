"""The training recipe on top of the engine API: config, GPT model chunks, data, trainer, checkpoints, launcher.

``from engine.training import Trainer, load_config`` (also re-exported lazily by ``engine``).  Nothing in the
engine API imports this package.
"""
from __future__ import annotations

from .config import ConfigError, TrainConfig, load_config

__all__ = ["Trainer", "TrainConfig", "ConfigError", "load_config", "launch_ranks"]


def __getattr__(name: str):
    if name == "Trainer":
        from .trainer import Trainer
        return Trainer
    if name == "launch_ranks":
        from .launch import launch_ranks
        return launch_ranks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
