"""Overlapped cells: one microbatch's forward and another's backward on one rank, taking turns at their
communication, so that one's all-to-all is in flight while the other computes.

DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, sec. 3.2.1; github.com/deepseek-ai/DualPipe,
``overlapped_forward_backward``) and Megatron-Core's combined 1F1B (``overlap_moe_expert_parallel_comm``;
``megatron/core/models/common/model_chunk_schedule_plan.py``: ``TransformerLayerSchedulePlan.run``) pair the
forward of one microbatch with the backward of another and interleave them at the expert all-to-all boundaries:
combine-backward (communication) | attention forward (compute) | MLP backward | dispatch forward | dispatch
backward | MLP forward | combine forward | attention backward.  Both split every layer into sub-modules that the
schedule calls.  pipecast keeps the model whole and lets it *yield* instead:

**The protocol.**  A layer that starts an asynchronous collective calls :func:`overlap_point` before waiting on
it (or uses :func:`exchange`, which does the three steps and records the span).  Inside a :class:`Cell` that hands
the rank to the other microbatch until that one reaches its own overlap point (or ends), then returns; anywhere
else it does nothing.  The forward and the backward (an autograd ``Function`` whose ``backward`` calls
:func:`exchange`) yield alike, so any model whose layers communicate through :func:`exchange` -- pipecast's
``engine.moe`` layers or a user's own -- gets the overlap with no other change; its forward / backward code is
the same with overlap on or off.

**How.**  A cell runs the forward on the calling thread and the backward on a helper thread, with one baton: at
any moment exactly one of them runs, and they alternate only at overlap points, in a fixed order (the backward
first, as Megatron-Core's and DualPipe's order begins with the combine backward).  So the work is the same and
in the same order on every rank whatever the timing -- the expert-parallel peers issue their all-to-alls in one
order, and the results do not depend on timing.  The backward is one ordinary autograd call (split-backward ``B``
or full backward) that yields from inside: it computes every gradient with the same kernels in the same order as
without overlap, so gradients are bitwise those of the plain backward, and the input / weight-gradient split
(``B`` / ``W``) composes unchanged (``W`` runs its records after ``B`` on the same side).

**Limits.**  Thread-local state is per side: the forward keeps the caller's (grad mode, autocast, torch function
modes such as the split-backward deferral), the backward starts with a new thread's defaults and the caller's
``contextvars`` (the installed tracer).  On CUDA, autograd runs the backward's CUDA nodes on its device thread,
where no cell is active: those yield nothing (correct, not overlapped).  A failure on one side makes the other
side's next overlap point raise :class:`CellAborted`, and the cell re-raises the first error.

Spans (``engine.runtime.tracing``): each turn of a side is a ``"compute"`` span labelled with its action
(``"F3.0"``, ``"B1.1"``); each :func:`exchange` a ``"comm"`` interval from its start to the end of its wait,
labelled ``"<action> <what>"`` inside a cell.
"""
from __future__ import annotations

import contextvars
import threading
from typing import Callable, Optional

from .tracing import NULL_TRACER, begin_interval, current_tracer, end_interval

__all__ = ["Cell", "CellAborted", "overlap_point", "exchange", "in_cell"]

_local = threading.local()


class CellAborted(RuntimeError):
    """The other side of an overlapped cell failed; this side stops at its next overlap point."""


def in_cell() -> bool:
    """Whether this thread runs one side of an overlapped :class:`Cell`."""
    return getattr(_local, "cell", None) is not None


def overlap_point() -> None:
    """Let the other microbatch of the running cell run until its next overlap point (or its end), then return.

    Call it where this microbatch waits on communication it has started (module doc).  Outside a cell, or once
    the other side has finished, it returns at once.  Raises :class:`CellAborted` if the other side failed."""
    cell = getattr(_local, "cell", None)
    if cell is not None:
        cell.switch(_local.side)


def exchange(start: Callable[[], object], label: str) -> None:
    """Run an asynchronous collective with the cell's overlap: ``work = start()`` (e.g.
    ``torch.distributed.all_to_all_single(..., async_op=True)``), :func:`overlap_point`, ``work.wait()``.

    Records a ``"comm"`` interval on the installed tracer, when it takes intervals (``engine.runtime.tracing``).
    """
    cell = getattr(_local, "cell", None)
    if cell is not None:
        label = f"{cell.labels[_local.side]} {label}"
    tracer = current_tracer()
    token = begin_interval(tracer, "comm", label)
    work = start()
    if cell is not None:
        cell.switch(_local.side)
    work.wait()
    end_interval(tracer, token)


class Cell:
    """Runs ``forward()`` on this thread and ``backward()`` on a helper thread, one at a time, alternating at
    overlap points (module doc); the backward side runs first.

    ``labels``: the two sides' action labels (``"F3.0"``, ``"B1.1"``) for the spans; ``tracer`` receives each
    turn as a ``"compute"`` span (default: none).
    """

    def __init__(self, labels: tuple[str, str] = ("F", "B"), tracer=None) -> None:
        self.labels = labels
        self.tracer = NULL_TRACER if tracer is None else tracer
        self._cond = threading.Condition()
        self._turn = 1
        self._done = [False, False]
        self._error: Optional[BaseException] = None
        self._spans = [None, None]
        self._results = [None, None]

    def run(self, forward: Callable[[], object], backward: Callable[[], object]) -> tuple:
        """Run both sides to their end; return ``(forward(), backward())``.

        Raises the first side's exception (the other side stops at its next overlap point)."""
        helper = threading.Thread(target=self._side, args=(1, backward, contextvars.copy_context(), _device()),
                                  name="pipecast-cell-backward", daemon=True)
        helper.start()
        self._side(0, forward, None, None)
        with self._cond:
            while not self._done[1] and self._error is None:
                self._cond.wait()
        if self._error is not None:
            raise self._error
        helper.join()
        return tuple(self._results)

    def switch(self, side: int) -> None:
        """Hand the turn from ``side`` to the other side (unless it has ended) and wait for it to come back."""
        self._close(side)
        with self._cond:
            if not self._done[1 - side]:
                self._turn = 1 - side
                self._cond.notify_all()
                while self._turn != side and self._error is None:
                    self._cond.wait()
            if self._error is not None:
                raise CellAborted(f"the other microbatch of the overlapped cell ({self.labels[1 - side]}) failed: "
                                  f"{self._error!r}")
        self._open(side)

    def _side(self, side: int, fn: Callable[[], object], context, device) -> None:
        _local.cell, _local.side = self, side
        try:
            if device is not None:
                import torch
                torch.cuda.set_device(device)
            with self._cond:
                while self._turn != side and not self._done[1 - side] and self._error is None:
                    self._cond.wait()
            if self._error is None:
                self._open(side)
                self._results[side] = fn() if context is None else context.run(fn)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of run()
            with self._cond:
                if self._error is None:
                    self._error = exc
        finally:
            self._close(side)
            _local.cell = None
            with self._cond:
                self._done[side] = True
                self._turn = 1 - side
                self._cond.notify_all()

    def _open(self, side: int) -> None:
        span = self.tracer.span("compute", self.labels[side])
        span.__enter__()
        self._spans[side] = span

    def _close(self, side: int) -> None:
        span, self._spans[side] = self._spans[side], None
        if span is not None:
            span.__exit__(None, None, None)


def _device():
    """The calling thread's CUDA device, for the helper thread (None without CUDA in use)."""
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None
