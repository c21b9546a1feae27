"""Parallelism of the training recipe: one :class:`Parallelism` object per run (``parallelism.py``) over the
data-parallel gradient sync (``data_parallel.py``), ZeRO-1 (``zero1.py``), FSDP2 (``fsdp.py``), tensor parallelism
(``tensor_parallel.py``), the one global-norm clip (``grad_norm.py``) and the DTensor helpers (``dtensor.py``).

A new parallelism is a module here and a step in :func:`~engine.training.parallel.parallelism.parallelize`.
"""
from __future__ import annotations

__all__ = ["Parallelism", "parallelize", "clip_grad_norm_"]


def __getattr__(name: str):  # lazy: importing one submodule does not pull in the others
    if name in ("Parallelism", "parallelize"):
        from . import parallelism
        return getattr(parallelism, name)
    if name == "clip_grad_norm_":
        from .grad_norm import clip_grad_norm_
        return clip_grad_norm_
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
