"""Seeds and deterministic settings, in one place."""
from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["set_seed_and_determinism"]


def set_seed_and_determinism(seed: int, pp_rank: int = 0, deterministic: bool = True) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) and choose deterministic kernels.

    The torch seed is ``seed + 100 * pp_rank`` (distinct per pipeline stage, shared by data-parallel replicas, as
    Megatron-Core's ``_set_random_seed``), used for dropout.  Parameters do not depend on it: the model is
    initialised from generators seeded per layer (``engine.training.models.chunk``).  ``deterministic`` turns on
    ``torch.use_deterministic_algorithms`` (warn-only), disables cuDNN autotuning and sets
    ``CUBLAS_WORKSPACE_CONFIG``, so a run on CPU is bitwise repeatable.
    """
    stage_seed = int(seed) + 100 * int(pp_rank)
    random.seed(stage_seed)
    np.random.seed(stage_seed % (1 << 32))
    torch.manual_seed(stage_seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(stage_seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
