"""pipecast engine: Megatron-compatible pipeline schedules, the pipeline runtime and the training recipe.

``import engine`` is light: the public names below are loaded on first use (module ``__getattr__``, PEP 562), so
importing the package pulls in neither torch.distributed machinery nor training code until asked.
"""
from __future__ import annotations

import importlib

# public name -> module (relative to this package) that defines it; resolved lazily on first access
_LAZY_EXPORTS = {
    # Megatron-compatible API
    "ModelParallelConfig": ".model_parallel_config",
    "ProcessGroupCollection": ".runtime.process_groups",
    "build_process_groups": ".runtime.process_groups",
    # bring your own model: split helper and gradient finalization
    "split_model": ".model_split",
    "PipelineChunk": ".model_split",
    "looped_stages": ".model_split",
    "v_stages": ".model_split",
    "finalize_model_grads": ".finalize",
    # fitting a model: activation recomputation, fp32 gradient accumulation for bf16 parameters, uneven stages
    "recompute": ".runtime.recompute",
    "apply_recompute": ".runtime.recompute",
    "attach_main_grad": ".runtime.main_grad",
    "parse_layout": ".plan.layout",
    # local ranks for any function (the plain launcher; ``engine.training.spawn`` runs a training config)
    "spawn": ".runtime.spawn",
    "RankError": ".runtime.spawn",
    # training recipe (never imported by the API modules above)
    "Trainer": ".training.trainer",
    "load_config": ".training.config",
    "TrainConfig": ".training.config",
}

# submodules reachable as attributes (``engine.parallel_state``, ``engine.schedules``) without an explicit import
_LAZY_SUBMODULES = ("parallel_state", "schedules", "model_parallel_config", "model_split", "finalize", "plan",
                    "runtime", "profiling", "training")

__all__ = sorted(_LAZY_EXPORTS)


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        value = getattr(importlib.import_module(_LAZY_EXPORTS[name], __name__), name)
    elif name in _LAZY_SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY_EXPORTS) | set(_LAZY_SUBMODULES))
