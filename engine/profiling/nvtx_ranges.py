"""NVTX ranges named by schedule action, for Nsight Systems.

:class:`NvtxTracer` turns every executor span into one NVTX push/pop range in the ``"pipecast"`` domain: one range
per action (``"F3.1"``), per P2P call (``"recv act F2.0"``), per CUDA-graph replay and per grad/param sync hook,
colored by category.  Ranges are opened on the host around graph *replays*, never inside a capture.  Without an
attached profiler the ``nvtx`` package's calls are no-ops costing well under a microsecond, but the tracer is still
opt-in (``profile.nvtx`` / ``--nvtx``).

View them with (``--cuda-graph-trace=node`` shows the kernels of each replayed graph under its range)::

    nsys profile --trace=cuda,nvtx,osrt --cuda-graph-trace=node -o pipecast_%q{RANK} pipecast train CONFIG --nvtx

Backends: the ``nvtx`` package (preferred; domains and colors), else ``torch.cuda.nvtx`` (needs a CUDA build).
"""
from __future__ import annotations

__all__ = ["NvtxTracer", "DOMAIN"]

DOMAIN = "pipecast"

_COLORS = {"F": "green", "B": "blue", "W": "cyan", "p2p": "orange", "graph": "purple", "sync": "grey"}


def _color(category: str, label: str) -> str:
    if category == "compute":
        return _COLORS.get(label[:1], "green")
    return _COLORS.get(category, "yellow")


class _NvtxPackageRange:
    __slots__ = ("_domain", "_attrs")

    def __init__(self, domain, attrs):
        self._domain, self._attrs = domain, attrs

    def __enter__(self):
        self._domain.push_range(self._attrs)

    def __exit__(self, *exc):
        self._domain.pop_range()


class _TorchNvtxRange:
    __slots__ = ("_nvtx", "_message")

    def __init__(self, torch_nvtx, message):
        self._nvtx, self._message = torch_nvtx, message

    def __enter__(self):
        self._nvtx.range_push(self._message)

    def __exit__(self, *exc):
        self._nvtx.range_pop()


class NvtxTracer:
    """A :class:`engine.runtime.tracing.Tracer` that opens one NVTX range per span.

    Args:
        backend: ``"auto"`` (the ``nvtx`` package if importable, else ``torch.cuda.nvtx``), ``"nvtx"`` or ``"torch"``.
        prefix: prepended to every range name (e.g. ``"r1 "`` to tell ranks apart in one report).

    Raises:
        RuntimeError: the chosen backend is unavailable (no ``nvtx`` package and no CUDA build of torch).
        ValueError: unknown ``backend``.
    """

    def __init__(self, backend: str = "auto", prefix: str = ""):
        if backend not in ("auto", "nvtx", "torch"):
            raise ValueError(f"backend={backend!r} is unknown; use 'auto', 'nvtx' or 'torch'")
        self.prefix = prefix
        self._ranges: dict[tuple[str, str], object] = {}  # one range object per distinct (category, label)
        self._domain = self._torch_nvtx = None
        if backend in ("auto", "nvtx"):
            try:
                import nvtx
                self._domain = nvtx.get_domain(DOMAIN)
            except ImportError:
                if backend == "nvtx":
                    raise RuntimeError("backend='nvtx' but the nvtx package is not installed; `pip install nvtx` or "
                                       "use backend='torch' on a CUDA build of torch") from None
        if self._domain is None:
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("no NVTX backend: the nvtx package is not installed and torch has no CUDA; "
                                   "`pip install nvtx`")
            self._torch_nvtx = torch.cuda.nvtx
        self.backend = "nvtx" if self._domain is not None else "torch"

    def span(self, category: str, label: str):
        key = (category, label)
        rng = self._ranges.get(key)
        if rng is None:
            message = self.prefix + label
            if self._domain is not None:
                attrs = self._domain.get_event_attributes(message=message, color=_color(category, label))
                rng = _NvtxPackageRange(self._domain, attrs)
            else:
                rng = _TorchNvtxRange(self._torch_nvtx, message)
            self._ranges[key] = rng
        return rng
