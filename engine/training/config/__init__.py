"""Typed training configuration: YAML is storage, the dataclasses of :mod:`.schema` are the source of truth.

``load_config(path, overrides)`` (:mod:`.load`) reads a YAML file with a safe loader, applies ``section.key=value``
overrides, checks every key and type against the dataclasses, fills the architecture from ``model.init_from``
(:mod:`.init_from`) and validates the whole run (:func:`validate`, :mod:`.validate` and :mod:`.layout`) before any
process group exists.  Every error is a :class:`ConfigError` (a ``ValueError``) or ``TypeError`` that names the
field, the value and the fix.

Sections: ``model``, ``parallel``, ``data``, ``optimizer``, ``training``, ``checkpoint``, ``logging``,
``cuda_graphs``, ``profile``.  Each field's type, default, meaning and range are written once, where the field is
defined (:func:`.fields.setting`); ``pipecast train --help`` (:mod:`.help`) lists them all from there.
"""
from __future__ import annotations

from .errors import ConfigError
from .layout import run_plans, validate_parallel, validate_plans, validate_tensor_parallel, validate_world_size
from .load import (ConfigLoader, apply_overrides, config_from_dict, config_to_dict, dump_config, load_config,
                   parse_override_args)
from .schema import (CheckpointConfig, CudaGraphsConfig, DataConfig, LoggingConfig, ModelConfig, MoEConfig,
                     OptimizerConfig, ParallelConfig, ProfileConfig, TrainConfig, TrainingConfig)
from .validate import check_fresh_run, validate, validate_model_family

__all__ = ["ConfigError", "ModelConfig", "MoEConfig", "ParallelConfig", "DataConfig", "OptimizerConfig", "TrainingConfig",
           "CheckpointConfig", "LoggingConfig", "CudaGraphsConfig", "ProfileConfig", "TrainConfig",
           "load_config", "config_from_dict", "config_to_dict", "apply_overrides", "parse_override_args",
           "validate", "validate_parallel", "validate_tensor_parallel", "validate_plans", "run_plans",
           "validate_model_family", "validate_world_size", "dump_config", "ConfigLoader", "check_fresh_run"]
