"""``torch.profiler`` traces per rank, as a context manager stepped by the training loop.

Configured like the ``profile:`` section of a training config, ``{enabled, wait, warmup, active}``: skip ``wait``
steps, warm the profiler up for ``warmup`` steps, record ``active`` steps, then write one Chrome trace per rank,
``<out_dir>/torch_profile_rank<r>_step<n>.json`` (open in https://ui.perfetto.dev or TensorBoard).  Semantics of
wait/warmup/active: ``torch.profiler.schedule`` (PyTorch docs).  Pattern: torchtitan's ``tools/profiler.py``.

Usage::

    with StepProfiler(out_dir, rank, enabled=True, wait=1, warmup=1, active=2) as prof:
        for step in range(steps):
            train_step()
            prof.step()
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["StepProfiler"]


class StepProfiler:
    """Per-rank ``torch.profiler`` window; a no-op when ``enabled`` is False.

    Args:
        out_dir: folder for the traces (created).
        rank: global rank, used in the file name.
        enabled, wait, warmup, active: see the module docstring (steps, ``active >= 1``).
        record_shapes, with_stack, profile_memory: passed to ``torch.profiler.profile``.

    Raises:
        ValueError: negative ``wait``/``warmup`` or ``active < 1`` (naming the field).
    """

    def __init__(self, out_dir: str | os.PathLike, rank: int = 0, enabled: bool = True, wait: int = 1,
                 warmup: int = 1, active: int = 2, record_shapes: bool = False, with_stack: bool = False,
                 profile_memory: bool = False):
        for name, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"profile.{name}={value!r} is invalid: use an integer >= {low} (steps)")
        self.out_dir, self.rank, self.enabled = Path(out_dir), rank, enabled
        self.wait, self.warmup, self.active = wait, warmup, active
        self._kwargs = dict(record_shapes=record_shapes, with_stack=with_stack, profile_memory=profile_memory)
        self._prof = None
        self.written: list[Path] = []

    @classmethod
    def from_config(cls, profile, out_dir, rank: int = 0) -> "StepProfiler":
        """Build from a ``profile`` config object or dict with ``enabled, wait, warmup, active``."""
        get = profile.get if isinstance(profile, dict) else (lambda k, d=None: getattr(profile, k, d))
        return cls(out_dir, rank, enabled=bool(get("enabled", False)), wait=get("wait", 1),
                   warmup=get("warmup", 1), active=get("active", 2))

    def _on_trace_ready(self, prof) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"torch_profile_rank{self.rank}_step{prof.step_num}.json"
        prof.export_chrome_trace(str(path))
        self.written.append(path)

    def __enter__(self) -> "StepProfiler":
        if self.enabled:
            import torch
            from torch.profiler import ProfilerActivity, profile, schedule
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities,
                                 schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
                                 on_trace_ready=self._on_trace_ready, **self._kwargs)
            self._prof.__enter__()
        return self

    def step(self) -> None:
        """Mark the end of one training step."""
        if self._prof is not None:
            self._prof.step()

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
            self._prof = None
