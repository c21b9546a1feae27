"""Capture backends, one file each, behind one protocol (:class:`Backend`) and a name -> backend registry.

Built-ins: ``te`` (Transformer Engine adapter, :mod:`graphs.backends.te`), ``torch`` (alias ``pipecast``: ordered
``torch.cuda.CUDAGraph``, :mod:`graphs.backends.torch_cuda`), ``emulate`` (CPU static-buffer emulation,
:mod:`graphs.backends.emulate`) and ``eager`` (no graphs: never available).  ``auto`` is not a backend but a
choice: the first of :data:`AUTO_PREFERENCE` available here (and, for split-backward plans, supporting them).
:mod:`graphs.backends.common` holds what the slot-based backends (torch, emulate) share; :mod:`graphs.backends.split`
is the input / weight split of one layer's backward that they use (a helper, not a backend).

A new backend is one object with the protocol's members, added with :func:`register_backend` (from any module,
e.g. a test's); :func:`graphs.capture` and :class:`graphs.GraphRuntime` then take it by name.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

__all__ = ["Backend", "AUTO", "AUTO_PREFERENCE", "register_backend", "unregister_backend", "get_backend",
           "backend_names", "canonical_name", "resolve"]

AUTO = "auto"
_REGISTRY: dict[str, "Backend"] = {}
_ALIASES: dict[str, str] = {}
AUTO_PREFERENCE: list[str] = []  # the backends ``auto`` tries, in order


@runtime_checkable
class Backend(Protocol):
    """What :func:`graphs.capture` needs of a capture backend.

    Attributes:
        name: the ``cuda_graphs.backend`` value that selects it.
        supports_split_backward: whether it captures split-backward plans (``W`` actions: F, B and W graphs).
        needs_cuda_tensors: capture checks first that every graphed parameter and sample argument is on the GPU.
    """

    name: str
    supports_split_backward: bool
    needs_cuda_tensors: bool

    def unavailable_reason(self) -> str | None:
        """``None`` if it can capture here, else why not (one phrase; it reaches the fallback log line)."""

    def split_backward_reason(self) -> str:
        """Why it does not capture split-backward plans (asked only when ``supports_split_backward`` is false)."""

    def capture(self, job: Any, capture_slots: Callable[..., Any]) -> Any:
        """Capture one job (``graphs.capture``'s ``_Job``: layers, order, sample arguments, options, report) and
        return its ``graphs.dispatch.GraphSet``.  ``capture_slots(slot_cls, warmup_ctx, prepare=None)`` runs the
        shared slot-based walk of :mod:`graphs.backends.common` for a ``ReplaySlot`` subclass.  May raise any
        ``Exception``: capture turns it into a collective fallback to eager."""


def register_backend(backend: Backend, *, aliases: tuple[str, ...] = (), auto_position: int | None = None) -> None:
    """Add (or replace) ``backend`` under ``backend.name`` and ``aliases``; ``auto_position`` puts it in
    :data:`AUTO_PREFERENCE` at that index.

    Raises:
        TypeError: ``backend`` lacks a member of :class:`Backend`.
        ValueError: the name is ``auto``.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"{backend!r} is not a graphs backend: it needs name, supports_split_backward, "
                        f"needs_cuda_tensors, unavailable_reason(), split_backward_reason() and capture(job, "
                        f"capture_slots) (graphs.backends.Backend)")
    if backend.name == AUTO or AUTO in aliases:
        raise ValueError("'auto' is the choice among backends, not a backend name")
    _REGISTRY[backend.name] = backend
    for alias in aliases:
        _ALIASES[alias] = backend.name
    if auto_position is not None and backend.name not in AUTO_PREFERENCE:
        AUTO_PREFERENCE.insert(auto_position, backend.name)


def unregister_backend(name: str) -> None:
    """Remove a backend added with :func:`register_backend` (and its aliases); unknown names are ignored."""
    _REGISTRY.pop(name, None)
    for alias in [a for a, n in _ALIASES.items() if n == name]:
        del _ALIASES[alias]
    if name in AUTO_PREFERENCE:
        AUTO_PREFERENCE.remove(name)


def backend_names() -> tuple[str, ...]:
    """Every accepted ``cuda_graphs.backend`` value: ``auto``, the registered names, their aliases."""
    return (AUTO, *_REGISTRY, *_ALIASES)


def canonical_name(requested: str) -> str:
    """``requested`` with aliases resolved (``"pipecast"`` is ``"torch"``).

    Raises:
        ValueError: unknown backend name.
    """
    if requested != AUTO and requested not in _REGISTRY and requested not in _ALIASES:
        raise ValueError(f"cuda_graphs.backend={requested!r} is unknown; use one of {', '.join(backend_names())}")
    return _ALIASES.get(requested, requested)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name`` (or an alias of it).

    Raises:
        ValueError: unknown name, or ``auto``.
    """
    name = canonical_name(name)
    if name == AUTO:
        raise ValueError("'auto' is resolved to a backend by graphs.backends.resolve")
    return _REGISTRY[name]


def resolve(requested: str, splits: bool = False) -> tuple[str, str | None]:
    """``(backend name, None)`` to capture with here, or ``("eager", why not)``.

    An explicit backend is taken if available; ``auto`` takes the first of :data:`AUTO_PREFERENCE` that is
    available and, when ``splits``, supports split backward.  A split plan on an explicit backend that does not
    support it gives ``(name, its split_backward_reason())``: the caller falls back with that reason.

    Raises:
        ValueError: unknown backend name.
    """
    name = canonical_name(requested)
    if name != AUTO:
        backend = _REGISTRY[name]
        reason = backend.unavailable_reason()
        if reason is not None:
            return "eager", reason
        if splits and not backend.supports_split_backward:
            return name, backend.split_backward_reason()
        return name, None
    reason = "no backend is registered for cuda_graphs.backend='auto'"
    for candidate in AUTO_PREFERENCE:
        backend = _REGISTRY[candidate]
        why = backend.unavailable_reason()
        if why is None and (not splits or backend.supports_split_backward):
            return candidate, None
        reason = why if why is not None else reason
    return "eager", reason


class _Eager:
    """``eager``: no graphs (never available; its reason is the setting itself)."""

    name = "eager"
    supports_split_backward = True
    needs_cuda_tensors = False

    def unavailable_reason(self) -> str:
        return "cuda_graphs.backend='eager'"

    def split_backward_reason(self) -> str:
        return self.unavailable_reason()

    def capture(self, job, capture_slots):
        raise RuntimeError("the eager backend captures nothing")


def _register_builtins() -> None:
    from . import emulate, te, torch_cuda  # noqa: PLC0415 - they import this package's registry functions

    register_backend(te.TEBackend(), auto_position=0)
    register_backend(torch_cuda.TorchBackend(), aliases=("pipecast",), auto_position=1)
    register_backend(emulate.EmulateBackend())
    register_backend(_Eager())


_register_builtins()
