"""The tracer interface the executor reports to: one span per action, per P2P wait and per graph replay.

The executor calls ``tracer.span(category, label)`` around each piece of work; the default :data:`NULL_TRACER`
does nothing and costs one attribute lookup and an empty context manager.  Profiling code (NVTX ranges, the
timeline recorder in :mod:`engine.profiling`) implements the same one-method protocol.

A caller that cannot pass a tracer through an API (the Megatron-compatible schedule functions have Megatron's
signature) installs one for a region with :func:`use_tracer`; the executor reads :func:`current_tracer` once per
step.  The installed tracer lives in a :class:`contextvars.ContextVar`, so threads and nested regions do not leak
into each other.

A tracer may also take *intervals* that need not nest with the spans -- an asynchronous collective from its start
to the end of its wait, during which another microbatch computes (:mod:`engine.runtime.overlap`): it then has
``begin(category, label) -> token`` and ``end(token)``; :func:`begin_interval` / :func:`end_interval` call them
when present and do nothing otherwise.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import ContextManager, Iterator, Protocol

__all__ = ["Tracer", "NULL_TRACER", "CATEGORIES", "current_tracer", "use_tracer", "FanoutTracer", "begin_interval",
           "end_interval"]

CATEGORIES = ("compute", "p2p", "comm", "graph", "sync")
"""The span categories, in the order profilers lay them out (``"comm"``: a layer's own collective in flight, e.g.
an expert all-to-all)."""


class Tracer(Protocol):
    """Receives spans from the executor.

    ``category`` is one of ``"compute"`` (an action, label like ``"F3.1"``), ``"p2p"`` (a send/receive or a wait,
    label like ``"recv act F2.0"``), ``"comm"`` (a layer's collective, e.g. ``"F3.0 a2a dispatch"``), ``"graph"``
    (a CUDA-graph replay) or ``"sync"`` (grad/param sync hooks).
    """

    def span(self, category: str, label: str) -> ContextManager[None]: ...


class _NullTracer:
    _null = contextlib.nullcontext()

    def span(self, category: str, label: str) -> ContextManager[None]:
        return self._null


NULL_TRACER: Tracer = _NullTracer()

_CURRENT: contextvars.ContextVar[Tracer] = contextvars.ContextVar("pipecast_tracer", default=NULL_TRACER)


def current_tracer() -> Tracer:
    """The tracer installed by the innermost :func:`use_tracer` of this thread/context, else :data:`NULL_TRACER`."""
    return _CURRENT.get()


@contextlib.contextmanager
def use_tracer(tracer: Tracer | None) -> Iterator[Tracer]:
    """Install ``tracer`` for the enclosed region (``None`` installs :data:`NULL_TRACER`); restores the previous one.

    Raises:
        TypeError: ``tracer`` has no ``span`` method.
    """
    tracer = NULL_TRACER if tracer is None else tracer
    if not callable(getattr(tracer, "span", None)):
        raise TypeError(f"tracer={tracer!r} has no span(category, label) method; pass an engine.runtime.tracing.Tracer")
    token = _CURRENT.set(tracer)
    try:
        yield tracer
    finally:
        _CURRENT.reset(token)


def begin_interval(tracer, category: str, label: str):
    """Start an interval on ``tracer`` if it takes intervals (module doc); returns the token for
    :func:`end_interval` (None when it does not)."""
    begin = getattr(tracer, "begin", None)
    return None if begin is None else (tracer, begin(category, label))


def end_interval(tracer, token) -> None:
    """End the interval ``token`` of :func:`begin_interval` (nothing for None)."""
    if token is not None:
        token[0].end(token[1])


class FanoutTracer:
    """Reports every span to several tracers (e.g. NVTX ranges and the timeline recorder), outermost first."""

    def __init__(self, *tracers: Tracer):
        self.tracers = tuple(t for t in tracers if t is not None and t is not NULL_TRACER)

    @contextlib.contextmanager
    def span(self, category: str, label: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for t in self.tracers:
                stack.enter_context(t.span(category, label))
            yield

    def begin(self, category: str, label: str):
        return [begin_interval(t, category, label) for t in self.tracers]

    def end(self, tokens) -> None:
        for token in tokens:
            end_interval(None, token)
