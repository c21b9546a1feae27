"""``te``: the one adapter around Transformer Engine's ``make_graphed_callables(..., _order=...)``.

Everything pipecast knows about TE's private ordered-capture arguments lives here (``transformer_engine/pytorch/graph.py``,
as Megatron's ``megatron/core/transformer/cuda_graphs.py`` calls it).  The installed signature is detected by feature checks on ``inspect.signature``, never by version
strings; the adapter passes exactly what TE expects:

* ``modules``: the distinct graphed layers, chunk-major (each layer once);
* ``sample_args``: one tuple of tensors per forward pass, ``sum(L_c) * M`` entries in TE's flat layout
  (``graphs.order.flat_index``); ``sample_kwargs`` alongside when the layers take tensor keyword arguments;
* ``_order``: the rank's order; ``_num_layers_per_chunk``: ``[L_0, ..., L_{V-1}]`` when supported (TE >= 2.6),
  otherwise the layer counts must be uniform (TE derives them as ``len(sample_args) / V / M``);
* ``allow_unused_input=True``, and ``num_warmup_iters`` by Megatron's rule (:func:`megatron_warmup_iters`);
* ``_reuse_graph_input_output_buffers=True`` when supported (TE >= 2.6; Megatron passes it from TE 2.7) and the
  pipeline has one stage: static inputs of passes whose ``[forward, backward]`` windows do not overlap share memory,
  and a pass's static outputs and grad-inputs return to the graph pool after its backward.  TE assumes a sent input
  gradient's transfer ends before the chunk's next backward (``transformer_engine/pytorch/graph.py``); pipecast's
  executor waits a send only once the receiver provably posted its receive or at the step's end
  (:mod:`engine.runtime.executor`), so with pipeline stages a later replay could overwrite a gradient still in
  flight to the previous stage.  With one stage nothing is sent and the reuse is safe;
* ``clone_param_grads_on_return=True`` when supported; older TE returns static aliases as parameter grads
  (NVIDIA/TransformerEngine#2937), so the adapter then registers gradient hooks that clone them while graphs are active.

TE's capture has no ``try/finally`` around its warmup and capture: if it raises, the adapter restores every module class's
``__call__``, instance ``forward`` attributes, GC, the CPU/CUDA RNG states, TE's "capturing" flag, training flags
and the parameters' ``.grad``.
"""
from __future__ import annotations

import gc
import importlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .. import decision
from ..dispatch import GraphSet
from ..order import flat_index, order_events
from .common import module_params

__all__ = ["TEBackend", "TEFeatures", "detect_features", "load_make_graphed_callables", "build_te_arguments", "te_capture",
           "StateGuard", "te_unavailable_reason", "split_backward_reason", "megatron_warmup_iters"]

MEGATRON_MIN_WARMUPS = 10  # warmup passes per layer, eager steps' microbatches included (Megatron's TECudaGraphHelper)

_FEATURES = ("_order", "_num_layers_per_chunk", "sample_kwargs", "num_warmup_iters", "allow_unused_input",
             "pool", "retain_graph_in_backward", "_reuse_graph_input_output_buffers", "clone_param_grads_on_return")


@dataclass(frozen=True)
class TEFeatures:
    """Which keyword arguments the installed ``make_graphed_callables`` accepts."""

    accepted: frozenset[str]

    def __contains__(self, name: str) -> bool:
        return name in self.accepted

    @property
    def ordered(self) -> bool:
        """Ordered (pipeline) capture exists: ``_order`` (TE >= 1.6)."""
        return "_order" in self.accepted

    def __str__(self) -> str:
        return ", ".join(f"{n}={'yes' if n in self.accepted else 'no'}" for n in _FEATURES)


def detect_features(fn: Callable) -> TEFeatures:
    """Feature-detect ``fn``'s keyword arguments (``inspect.signature``); a ``**kwargs`` catch-all counts for
    nothing, since we cannot know what it forwards."""
    params = inspect.signature(fn).parameters
    return TEFeatures(frozenset(n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD))


def load_make_graphed_callables():
    """``transformer_engine.pytorch.make_graphed_callables`` or ``None`` if TE is not importable."""
    try:
        te = importlib.import_module("transformer_engine.pytorch")
    except Exception:  # noqa: BLE001 - ImportError, or a broken install raising anything on import
        return None
    return getattr(te, "make_graphed_callables", None)


def te_unavailable_reason() -> str | None:
    """``None`` if the TE backend can be used here, else why not (one phrase)."""
    fn = load_make_graphed_callables()
    if fn is None:
        return "Transformer Engine is not installed (transformer_engine.pytorch.make_graphed_callables)"
    if not detect_features(fn).ordered:
        return "the installed Transformer Engine has no _order argument (needs TE >= 1.6)"
    return None


def split_backward_reason() -> str:
    """Why the TE backend does not capture split-backward (``W``) plans; the caller falls back to eager with it.

    TE's ``_order`` knows weight-gradient steps only as fractional ``-k - 0.5`` entries (TE >= 2.10,
    ``transformer_engine/pytorch/graph.py``) that replay ``backward_dw()`` of TE modules built with ``delay_wgrad_compute=True``, with exactly one
    layer per chunk; its integer backward entries compute input *and* weight gradients.  Nothing in the installed
    signature says a graphed layer defers its weight gradients, so graphs captured through TE would compute them
    in ``B`` and not in the plan's ``W``: wrong accumulation points, not an error.
    """
    return ("cuda_graphs.backend='te' cannot capture a split-backward plan (W actions): Transformer Engine's "
            "_order has weight-gradient entries (-k-0.5) only for its own delay_wgrad_compute modules, one layer "
            "per chunk, and its backward graphs compute the weight gradients in B -- use cuda_graphs.backend="
            "'torch' (pipecast's capture: F, B and W graphs per (chunk, microbatch, layer)) or 'auto'")


def megatron_warmup_iters(eager_microbatches: int, captured_microbatches: int) -> int:
    """Megatron's ``num_warmup_iters`` for TE (``TECudaGraphHelper`` in ``megatron/core/transformer/cuda_graphs.py``):
    at least one warmup per layer and microbatch inside TE, and at least :data:`MEGATRON_MIN_WARMUPS` per layer
    counting the ``eager_microbatches`` the eager warmup steps ran before the capture:
    ``max(1, ceil((10 - eager_microbatches) / captured_microbatches))``."""
    return max(1, math.ceil((MEGATRON_MIN_WARMUPS - eager_microbatches) / max(1, captured_microbatches)))


def build_te_arguments(features: TEFeatures, modules: Sequence[torch.nn.Module], sample_args: Sequence[tuple],
                       sample_kwargs: Sequence[dict] | None, order: Sequence[int], layers_per_chunk: Sequence[int],
                       num_microbatches: int, num_warmup_iters: int = 1, pool=None,
                       retain_graph_in_backward: bool = False, eager_microbatches: int = 0,
                       reuse_buffers: bool = False) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` for ``make_graphed_callables`` with this feature set.  ``num_warmup_iters`` is raised to
    :func:`megatron_warmup_iters` (``eager_microbatches``: microbatches the eager steps ran before the capture);
    ``reuse_buffers``: pass ``_reuse_graph_input_output_buffers=True`` if this TE has it (module docstring).

    Raises:
        ValueError: the layout cannot be expressed with the installed TE (no ``_order``; non-uniform layers per
            chunk without ``_num_layers_per_chunk``; keyword tensors without ``sample_kwargs``), or the counts are
            inconsistent (``len(modules) != sum(L)``, ``len(sample_args) != sum(L)*M``).
        TypeError: a sample argument is not a tensor.
    """
    if not features.ordered:
        raise ValueError("the installed transformer_engine make_graphed_callables has no _order argument; "
                         "per-microbatch pipeline capture needs TE >= 1.6 -- upgrade TE or use backend='torch'")
    n_layers = sum(layers_per_chunk)
    if len(modules) != n_layers:
        raise ValueError(f"{len(modules)} modules for layers_per_chunk={list(layers_per_chunk)} (sum {n_layers})")
    expected = n_layers * num_microbatches
    if len(sample_args) != expected:
        raise ValueError(f"len(sample_args)={len(sample_args)}; TE expects sum(L)*M = {n_layers}*{num_microbatches}"
                         f" = {expected} entries in its flat layout")
    for i, entry in enumerate(sample_args):
        if not isinstance(entry, tuple) or not all(isinstance(t, torch.Tensor) for t in entry):
            raise TypeError(f"sample_args[{i}] must be a tuple of tensors (TE rejects anything else)")
    kwargs: dict[str, Any] = {"_order": list(order)}
    if "_num_layers_per_chunk" in features:
        kwargs["_num_layers_per_chunk"] = list(layers_per_chunk)
    elif len(set(layers_per_chunk)) != 1 or layers_per_chunk[0] == 0:
        raise ValueError(f"layers_per_chunk={list(layers_per_chunk)} is not uniform and the installed TE has no "
                         f"_num_layers_per_chunk (TE >= 2.6); graph the same number of layers per chunk")
    if sample_kwargs is not None and any(sample_kwargs):
        if "sample_kwargs" not in features:
            raise ValueError("the layers take tensor keyword arguments but the installed TE has no sample_kwargs")
        if len(sample_kwargs) != expected:
            raise ValueError(f"len(sample_kwargs)={len(sample_kwargs)} != len(sample_args)={expected}")
        kwargs["sample_kwargs"] = list(sample_kwargs)
    if "num_warmup_iters" in features:
        kwargs["num_warmup_iters"] = max(num_warmup_iters, megatron_warmup_iters(eager_microbatches,
                                                                                 num_microbatches))
    if "allow_unused_input" in features:
        kwargs["allow_unused_input"] = True
    if reuse_buffers and "_reuse_graph_input_output_buffers" in features:
        kwargs["_reuse_graph_input_output_buffers"] = True
    if "clone_param_grads_on_return" in features:
        kwargs["clone_param_grads_on_return"] = True
    if pool is not None and "pool" in features:
        kwargs["pool"] = pool
    if retain_graph_in_backward:
        if "retain_graph_in_backward" not in features:
            raise ValueError("retain_graph_in_backward=True needs a TE with that argument")
        kwargs["retain_graph_in_backward"] = True
    return (tuple(modules), tuple(sample_args)), kwargs


_MISSING = object()


@dataclass
class StateGuard:
    """Snapshot of everything a failed TE capture can leave changed; :meth:`restore` puts it back."""

    modules: Sequence[torch.nn.Module]
    class_calls: dict[type, Any] = field(default_factory=dict)
    forwards: list[tuple[torch.nn.Module, Any]] = field(default_factory=list)
    training: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)
    grads: list[tuple[torch.nn.Parameter, Any]] = field(default_factory=list)
    gc_enabled: bool = True
    cpu_rng: torch.Tensor | None = None
    cuda_rng: list | None = None

    def save(self) -> "StateGuard":
        for m in self.modules:
            for sub in m.modules():
                self.class_calls.setdefault(type(sub), type(sub).__dict__.get("__call__", _MISSING))
                self.forwards.append((sub, sub.__dict__.get("forward", _MISSING)))
                self.training.append((sub, sub.training))
            for p in m.parameters():
                self.grads.append((p, p.grad))
        self.gc_enabled = gc.isenabled()
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return self

    def clear_grads(self) -> None:
        """Warmup must not accumulate into existing ``.grad`` tensors: hide them during capture."""
        for p, _ in self.grads:
            p.grad = None

    def restore(self, everything: bool = True) -> None:
        """Restore grads, RNG and GC; with ``everything`` also class ``__call__``, ``forward`` and training flags
        and TE's capturing flag (the failure path)."""
        for p, g in self.grads:
            p.grad = g
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if self.gc_enabled and not gc.isenabled():
            gc.enable()
        if not everything:
            return
        for cls, call in self.class_calls.items():
            if call is _MISSING:
                if "__call__" in cls.__dict__:
                    delattr(cls, "__call__")
            elif cls.__dict__.get("__call__", _MISSING) is not call:
                cls.__call__ = call
        for sub, fwd in self.forwards:
            if fwd is _MISSING:
                sub.__dict__.pop("forward", None)
            else:
                sub.__dict__["forward"] = fwd
        for sub, mode in self.training:
            sub.training = mode
        _end_te_capture()


def _end_te_capture() -> None:
    """Clear TE's module-level "graph capturing" flag if this TE has one (``graph.set_capture_end``)."""
    try:
        graph_mod = importlib.import_module("transformer_engine.pytorch.graph")
    except Exception:  # noqa: BLE001
        return
    end = getattr(graph_mod, "set_capture_end", None)
    if callable(end):
        end()


def te_capture(make_graphed_callables: Callable, modules: Sequence[torch.nn.Module], sample_args: Sequence[tuple],
               sample_kwargs: Sequence[dict] | None, order: Sequence[int], layers_per_chunk: Sequence[int],
               num_microbatches: int, num_warmup_iters: int = 1, pool=None,
               retain_graph_in_backward: bool = False, eager_microbatches: int = 0, reuse_buffers: bool = False
               ) -> tuple[tuple[Callable, ...], TEFeatures, dict]:
    """Call TE and return ``(callables in flat layout, features, the keyword arguments passed)``.

    On any exception every piece of state TE may have changed is restored (see :class:`StateGuard`) and the
    exception propagates.  On success ``.grad``, RNG and GC are restored too (warmup pollutes grads).
    """
    features = detect_features(make_graphed_callables)
    args, kwargs = build_te_arguments(features, modules, sample_args, sample_kwargs, order, layers_per_chunk,
                                      num_microbatches, num_warmup_iters, pool, retain_graph_in_backward,
                                      eager_microbatches, reuse_buffers)
    guard = StateGuard(modules).save()
    guard.clear_grads()
    try:
        out = make_graphed_callables(*args, **kwargs)
    except BaseException:
        guard.restore(everything=True)
        raise
    guard.restore(everything=False)
    callables = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(callables) != len(sample_args):
        raise RuntimeError(f"make_graphed_callables returned {len(callables)} callables for {len(sample_args)} "
                           f"forward passes; the installed TE does not follow the flat (chunk, microbatch, layer) "
                           f"layout pipecast relies on")
    return callables, features, kwargs


class TEBackend:
    """The ``te`` backend (:class:`graphs.backends.Backend`): Transformer Engine's ordered capture on CUDA; no
    split backward (:func:`split_backward_reason`)."""

    name = "te"
    supports_split_backward = False
    needs_cuda_tensors = True

    def unavailable_reason(self) -> str | None:
        return "no CUDA device" if not decision.cuda_ready() else te_unavailable_reason()

    def split_backward_reason(self) -> str:
        return split_backward_reason()

    def capture(self, job, capture_slots) -> GraphSet:
        """TE's ``make_graphed_callables`` on the job's layers in its order (one microbatch when graphs are
        shared); parameter-gradient clone hooks where the installed TE returns static aliases."""
        order, n_mb, sample_args, sample_kwargs = _te_inputs(job)
        fn = load_make_graphed_callables()
        modules = [m for chunk in job.layers.modules for m in chunk]
        callables, features, kwargs = te_capture(fn, modules, sample_args, sample_kwargs, order, job.lpc, n_mb,
                                                 job.num_warmup_iters, job.pool,
                                                 eager_microbatches=job.eager_microbatches,
                                                 reuse_buffers=job.pp_size == 1)
        job.report.te_kwargs = dict(kwargs)
        job.report.te_features = str(features)
        hooks = []
        if "clone_param_grads_on_return" not in features and job.test.param_grads != "alias":
            # TE <= 2.18 returns static buffers as parameter grads (TransformerEngine#2937): clone them before
            # AccumulateGrad keeps them
            for module in modules:
                for p in module_params(module):
                    hooks.append(p.register_hook(lambda g: g.clone()))

        def release():
            for h in hooks:
                _quietly(h.remove)
            for f in callables:
                reset = getattr(f, "reset", None)
                if callable(reset):
                    _quietly(reset)

        return GraphSet(backend=self.name, order=list(job.order), layers_per_chunk=list(job.lpc),
                        num_microbatches=job.M, specs=job.layer_specs, callables=callables, shared=job.share,
                        release=release)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - cleanup steps must never raise
        pass


def _te_inputs(job) -> tuple[list[int], int, Sequence[tuple], Sequence[dict] | None]:
    """``(order, microbatches, sample_args, sample_kwargs)`` as TE gets them (one microbatch when shared)."""
    if not job.share:
        return job.order, job.M, job.sample_args, job.sample_kwargs
    lpc, M = job.lpc, job.M
    first = [flat_index(c, 0, l, lpc, M) for c, n in enumerate(lpc) for l in range(n)]
    kwargs = None if job.sample_kwargs is None else [job.sample_kwargs[i] for i in first]
    return _single_microbatch_order(job.order), 1, [job.sample_args[i] for i in first], kwargs


def _single_microbatch_order(order: Sequence[int]) -> list[int]:
    """The order restricted to microbatch 0 of every chunk (shared graphs capture one microbatch)."""
    return [entry for entry, (kind, c, m) in zip(order, order_events(order)) if m == 0]
