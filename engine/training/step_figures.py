"""The figures of training steps, kept on the device until the host reads them at a log interval.

A step's loss and gradient norm are device tensors (the loss reduced over data-parallel replicas and broadcast over
the pipeline on the device, the norm from :func:`engine.training.parallel.grad_norm.clip_grad_norm_`).
:class:`StepFigures` holds them for every step the host has not read yet and reads them all with one copy when
the trainer logs, evaluates or saves (nanoGPT's ``train.py`` reads ``loss.item()`` -- "a CPU-GPU sync point" --
only at its log interval; torchtitan keeps its token count on the device for the same reason).

The NaN / inf check (``optimizer.check_for_nan_in_loss_and_grad``, Megatron's ``check_for_nan_in_loss_and_grad``)
runs on the device too: each step folds ``not (isfinite(loss) and isfinite(norm))`` into one sticky 0-dim
``float32`` flag, the ``found_inf`` that torch's fused optimizers take (the ``torch.amp.GradScaler`` contract:
``torch.optim.AdamW(fused=True)`` reads the optimizer's ``found_inf`` attribute; its kernel leaves parameters and
moments untouched when it is 1 and its step count is put back, see ``torch/optim/adam.py: _fused_adam``).  From
the first non-finite step on, every step is skipped on every rank (the flag is global: the loss and the norm are);
the host learns of it at its next read and raises :class:`NonFiniteLossError` naming that first step, the model
and optimizer state being those before it.
"""
from __future__ import annotations

import math
import time

import torch

__all__ = ["StepFigures", "NonFiniteLossError", "nonfinite_message"]


class NonFiniteLossError(RuntimeError):
    """The loss or the global grad norm of a step is NaN or infinite (the run diverged); raised on every rank.  Its
    message names the step, the values and what to change: the whole report, without a traceback."""

    one_line = True  # engine.runtime.spawn.needs_traceback


class StepFigures:
    """The unread steps' figures of one trainer (see the module docstring).

    Args:
        device: where the figures live (the run's device).
        check_finite: keep the sticky skip flag (``optimizer.check_for_nan_in_loss_and_grad``); without it every
            step is applied whatever its values.
    """

    def __init__(self, device: torch.device, check_finite: bool):
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device) if check_finite else None
        self._pending: list[tuple[int, float, torch.Tensor]] = []  # (step, lr, [loss, norm] float64 on the device)
        self._since: float | None = None

    def start(self) -> None:
        """Call at the start of a step: the first unread step starts the clock of the next read's step time."""
        if self._since is None:
            self._since = time.perf_counter()

    def add(self, step: int, lr: float, loss_sums: torch.Tensor, norm: torch.Tensor) -> torch.Tensor | None:
        """Record step ``step`` (1-based): its LR, its global ``[loss sum, tokens]`` (float64, on the device) and
        its gradient norm (0-dim, on the device).  Returns the ``found_inf`` flag the optimizer step takes (None
        without the check); no host synchronisation."""
        loss = loss_sums[0] / loss_sums[1]
        self._pending.append((step, lr, torch.stack([loss, norm.to(torch.float64)])))
        if self.found_inf is not None:
            bad = torch.logical_not(torch.isfinite(loss) & torch.isfinite(norm))
            torch.maximum(self.found_inf, bad.to(self.found_inf.dtype), out=self.found_inf)
        return self.found_inf

    def read(self) -> tuple[list[tuple[int, float, float, float]], float]:
        """The host sync: ``[(step, lr, loss, grad norm)]`` of every unread step (one device-to-host copy) and the
        wall seconds from the start of the first of them to now (the device's work included: the copy waits
        for it).  Empties the list."""
        if not self._pending:
            return [], 0.0
        values = torch.stack([v for *_, v in self._pending]).tolist()
        elapsed = time.perf_counter() - self._since
        rows = [(step, lr, loss, norm) for (step, lr, _), (loss, norm) in zip(self._pending, values)]
        self._pending, self._since = [], None
        return rows, elapsed

    def first_nonfinite(self, rows: list[tuple[int, float, float, float]]):
        """The first row of :meth:`read` whose loss or norm is NaN / inf when the check is on (None otherwise);
        then the flag is cleared, so steps after the raise apply again."""
        if self.found_inf is None:
            return None
        bad = next((r for r in rows if not (math.isfinite(r[2]) and math.isfinite(r[3]))), None)
        if bad is not None:
            self.found_inf.zero_()
        return bad


def nonfinite_message(step: int, loss: float, norm: float, last_run: int, optimizer) -> str:
    """The :class:`NonFiniteLossError` line for step ``step`` (its ``loss`` and ``norm``) found when the host read
    the figures after step ``last_run``; ``optimizer`` is the run's ``optimizer`` config section."""
    what = " and ".join(f"{name} is {value}" for name, value in [("loss", loss), ("grad norm", norm)]
                        if not math.isfinite(value))
    later = (f" (nor were steps {step + 1}-{last_run}, run on the device before the host read the figures at step "
             f"{last_run})" if last_run > step else "")
    clip = (f"optimizer.grad_clip={optimizer.grad_clip} is on" if optimizer.grad_clip > 0 else
            "enable optimizer.grad_clip (e.g. 1.0)")
    return (f"step {step}: {what} (loss {loss:.6g}, grad norm {norm:.6g}); the training diverged, so the step was not "
            f"applied{later} and no checkpoint was written. Try a lower optimizer.lr (now {optimizer.lr:g}; warmup "
            f"optimizer.warmup_steps={optimizer.warmup_steps}) and {clip}; resume from the last checkpoint with "
            f"--resume, or set optimizer.check_for_nan_in_loss_and_grad=false to continue anyway")
