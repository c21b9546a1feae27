"""The tracer interface the executor reports to: one span per action, per P2P wait and per graph replay.

The executor calls ``tracer.span(category, label)`` around each piece of work; the default :data:`NULL_TRACER`
does nothing and costs one attribute lookup and an empty context manager.  Profiling code (NVTX ranges, the
timeline recorder) implements the same two-method protocol.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol


class Tracer(Protocol):
    """Receives spans from the executor.

    ``category`` is one of ``"compute"`` (an action, label like ``"F c1 mb3"``), ``"p2p"`` (a send/receive or a wait,
    label like ``"recv act c0 mb2"``), ``"graph"`` (a CUDA-graph replay) or ``"sync"`` (grad/param sync hooks).
    """

    def span(self, category: str, label: str) -> ContextManager[None]: ...


class _NullTracer:
    _null = contextlib.nullcontext()

    def span(self, category: str, label: str) -> ContextManager[None]:
        return self._null


NULL_TRACER: Tracer = _NullTracer()
