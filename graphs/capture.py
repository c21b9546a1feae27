"""``capture``: graphs per ``(model chunk, microbatch, layer)`` of one pipeline rank, in the rank's order.

One entry point for every backend (``shared/spec/cuda_graphs.md``; DESIGN.md "Graphs"):

* ``"te"``: Transformer Engine ``make_graphed_callables(..., _order=...)`` through :mod:`graphs.backends.te`;
* ``"torch"`` (alias ``"pipecast"``): pipecast's ordered capture on ``torch.cuda.CUDAGraph``;
* ``"emulate"``: CPU static-buffer emulation (tests);
* ``"eager"``: no graphs;
* ``"auto"``: ``te`` if CUDA and an ordered TE are available, else ``torch`` on CUDA, else eager.

The graphs-or-eager decision is collective (:func:`graphs.decision.agree`) both before capture (availability) and
after it (capture errors); a fallback logs one line with the reason.  The result is a :class:`GraphedLayers`
whose layers dispatch to the graph of their current microbatch; ``.report`` says what happened.
"""
from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engine.plan import Plan

from . import decision
from .backends import common, emulate as emulate_backend, te as te_backend, torch_cuda
from .dispatch import GraphedLayers, GraphSet
from .order import (LayerEvent, check_order, flat_index, graph_order, layer_events, max_in_flight, num_graphs,
                    order_events)
from .specs import AutocastState, CallSpec, autocast_context, current_autocast

__all__ = ["BACKENDS", "CaptureReport", "capture", "resolve_backend", "make_sample_args"]

BACKENDS = ("auto", "te", "torch", "pipecast", "emulate", "eager")


@dataclass
class CaptureReport:
    """What :func:`capture` did.

    Attributes:
        requested: the backend asked for.
        backend: the backend in use (``"eager"`` after a fallback).
        reason: why graphs are off (``None`` when they are on).
        order: the capture order (TE notation).
        num_graphs: forward/backward graph pairs captured.
        seconds: wall time of warmup + capture.
        te_kwargs: keyword arguments passed to TE (``te`` backend), for inspection.
        te_features: feature detection summary of the installed TE.
    """

    requested: str
    backend: str
    reason: str | None = None
    order: list[int] = field(default_factory=list)
    num_graphs: int = 0
    seconds: float = 0.0
    te_kwargs: dict[str, Any] | None = None
    te_features: str | None = None
    log_line: str | None = None
    traceback: str | None = None  # of a local capture error, for diagnosis (not logged)


def resolve_backend_name(requested: str) -> str:
    """The canonical backend name (``"pipecast"`` is ``"torch"``).

    Raises:
        ValueError: unknown backend name.
    """
    if requested not in BACKENDS:
        raise ValueError(f"cuda_graphs.backend={requested!r} is unknown; use one of {', '.join(BACKENDS)}")
    return "torch" if requested == "pipecast" else requested


def resolve_backend(requested: str) -> tuple[str, str | None]:
    """``(backend, reason)``: the backend to use for ``requested`` here, or ``("eager", why)``.

    Raises:
        ValueError: unknown backend name.
    """
    requested = resolve_backend_name(requested)
    if requested == "eager":
        return "eager", "cuda_graphs.backend='eager'"
    if requested == "emulate":
        return "emulate", None
    if not decision.cuda_ready():
        return "eager", "no CUDA device"
    if requested == "torch":
        return "torch", None
    te_reason = te_backend.te_unavailable_reason()
    if requested == "te":
        return ("eager", te_reason) if te_reason else ("te", None)
    return ("torch", None) if te_reason else ("te", None)


def make_sample_args(specs: dict[tuple[int, int], CallSpec], layers_per_chunk: Sequence[int],
                     num_microbatches: int) -> tuple[list[tuple], list[dict]]:
    """Fresh static sample arguments in TE's flat layout from one :class:`CallSpec` per ``(chunk, layer)``.

    Returns ``(sample_args, sample_kwargs)``: per flat index a tuple of positional tensors and a dict of tensor
    keyword arguments (ones, with the recorded ``requires_grad``; Megatron uses ones too, spec 2.4).
    """
    args_out: list[tuple] = []
    kwargs_out: list[dict] = []
    for c, n_layers in enumerate(layers_per_chunk):
        for _m in range(num_microbatches):
            for l in range(n_layers):
                tensors = specs[(c, l)].make_static()
                a, k = specs[(c, l)].rebuild(tensors)
                args_out.append(tuple(a))
                kwargs_out.append({key: v for key, v in k.items() if isinstance(v, torch.Tensor)})
    return args_out, kwargs_out


def capture(modules_per_chunk: Sequence[Sequence[torch.nn.Module]] | GraphedLayers, plan: Plan, rank: int,
            sample_args: Sequence[tuple] | None = None, sample_kwargs: Sequence[dict] | None = None, *,
            specs: dict[tuple[int, int], CallSpec] | None = None, backend: str = "auto", num_warmup_iters: int = 1,
            order: Sequence[int] | None = None, check: bool = True, share_graphs: bool = False,
            allow_unsafe_sharing: bool = False, clone_param_grads: bool = True, pool=None,
            generators: Sequence[torch.Generator] = (), group=None, tracer=None,
            veto: str | None = None, autocast: AutocastState | None = None) -> GraphedLayers:
    """Capture the graphs of pipeline rank ``rank`` of ``plan`` and install them on its layers.

    Args:
        modules_per_chunk: per model chunk of this rank, the layers to graph (``[s, b, h] -> [s, b, h]`` blocks,
            in call order), or an existing :class:`GraphedLayers` (recapture).
        plan: the training plan the executor runs (``engine.plan.build_plan``).
        rank: this pipeline rank.
        sample_args: per forward pass, in TE's flat layout (``graphs.order.flat_index``, ``sum(L)*M`` entries), a
            tuple of tensors shaped, typed and ``requires_grad``-flagged like the real inputs.  They become the
            static inputs.  Either this or ``specs``.
        sample_kwargs: tensor keyword arguments per forward pass, same layout (optional).
        specs: one :class:`CallSpec` per ``(chunk, layer)``; sample arguments are made from it.
        backend: see module docstring.
        num_warmup_iters: eager warmup rounds before capture (Megatron usually passes 1).
        order: the capture order; default ``graph_order(plan, rank)``.  With ``check`` it must equal the runtime.
        check: verify the order with :func:`graphs.order.check_order` (disable only to test the replay guard).
        share_graphs: one graph per layer for all microbatches; requires at most one microbatch per chunk in
            flight (PP=1), else ``ValueError`` unless ``allow_unsafe_sharing`` (negative-control tests only).
        clone_param_grads: return parameter gradients as clones (B17); ``False`` only for negative controls.
        pool: a CUDA graph memory pool to share (torch/te); default one fresh pool for this capture.
        generators: extra CUDA generators to register with every graph (dropout under a TP RNG tracker).
        group: process group of the collective decision (default: the world, if initialised).
        tracer: receives ``"graph"`` spans around replays.
        autocast: the autocast state the layers run in at training time (``graphs.specs.current_autocast()``
            inside the forward step); default: the state at this call.  Capture runs under it with the cast cache
            off, and replay checks it.
        veto: a reason this rank must not capture (found by the caller, e.g. variable shapes); it joins the
            collective decision so every rank runs eagerly.  Sample arguments are not needed then.

    Returns:
        The :class:`GraphedLayers` (``.report`` is a :class:`CaptureReport`; ``.active`` tells graphs from eager).

    Raises:
        ValueError / TypeError: bad arguments, before any communication.  Capture failures do not raise: they make
        every rank fall back to eager with one log line.
    """
    created = not isinstance(modules_per_chunk, GraphedLayers)
    layers = GraphedLayers(modules_per_chunk, tracer=tracer) if created else modules_per_chunk
    try:
        if veto is not None:
            resolve_backend_name(backend)
            order = graph_order(plan, rank) if order is None else list(order)
        else:
            order, layer_specs, sample_args, sample_kwargs = _validate(
                layers, backend, plan, rank, sample_args, sample_kwargs, specs, order, check, share_graphs,
                allow_unsafe_sharing, num_warmup_iters)
    except BaseException:
        if created:
            layers.remove()
        raise
    layers.clear_graphs()
    lpc, M = layers.layers_per_chunk, plan.num_microbatches

    report = CaptureReport(requested=backend, backend="eager", order=list(order))
    layers.report = report
    chosen, reason = resolve_backend(backend)
    if veto is not None:
        reason = veto
    elif chosen in ("torch", "te") and reason is None:
        reason = _local_problem(layers, sample_args)
    ok, reason = decision.agree(reason is None and chosen != "eager", reason, group)
    if not ok:
        report.reason = reason
        report.log_line = decision.log_fallback(backend, reason, group)
        return layers

    start = time.perf_counter()
    graphs, error = None, None
    autocast = current_autocast() if autocast is None else autocast
    with layers.suspend(), autocast_context(autocast):
        try:
            graphs = _CAPTURERS[chosen](layers, order, lpc, M, sample_args, sample_kwargs, layer_specs,
                                        num_warmup_iters, share_graphs, clone_param_grads, pool, generators,
                                        tracer, report)
        except Exception as exc:  # noqa: BLE001 - any capture failure means eager, collectively
            error = f"capture error: {type(exc).__name__}: {exc}"
            report.traceback = traceback.format_exc()
            _cleanup_after_failure()
    ok, reason = decision.agree(error is None, error, group)
    if not ok:
        if graphs is not None:
            graphs.release()
        report.reason = reason
        report.log_line = decision.log_fallback(backend, reason, group)
        return layers
    report.backend = chosen
    report.seconds = time.perf_counter() - start
    report.num_graphs = sum(lpc) if share_graphs else num_graphs(lpc, M)
    graphs.autocast = autocast
    layers.set_graphs(graphs)
    return layers


def _validate(layers, backend, plan, rank, sample_args, sample_kwargs, specs, order, check, share_graphs,
              allow_unsafe_sharing, num_warmup_iters):
    lpc = layers.layers_per_chunk
    resolve_backend_name(backend)
    if len(lpc) != plan.num_model_chunks:
        raise ValueError(f"modules_per_chunk has {len(lpc)} model chunks but the plan has num_model_chunks="
                         f"{plan.num_model_chunks}")
    order = graph_order(plan, rank) if order is None else list(order)
    if check:
        check_order(order, plan, rank)
    M = plan.num_microbatches
    layer_specs = _layer_specs(sample_args, sample_kwargs, specs, lpc, M)
    if sample_args is None:
        sample_args, sample_kwargs = make_sample_args(layer_specs, lpc, M)
    if share_graphs and max_in_flight(order) > 1 and not allow_unsafe_sharing:
        raise ValueError(f"share_graphs=True but rank {rank} has up to {max_in_flight(order)} microbatches of a chunk "
                         f"in flight; one graph per layer would be overwritten before its backward (Megatron-LM#422)"
                         f" -- share graphs only with no pipelining")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) or num_warmup_iters < 0:
        raise ValueError(f"num_warmup_iters={num_warmup_iters!r} must be an int >= 0")
    return order, layer_specs, sample_args, sample_kwargs


def _layer_specs(sample_args, sample_kwargs, specs, lpc, M) -> dict[tuple[int, int], CallSpec]:
    if specs is not None:
        missing = [(c, l) for c, n in enumerate(lpc) for l in range(n) if (c, l) not in specs]
        if missing:
            raise ValueError(f"specs lacks (chunk, layer) entries {missing}")
        return dict(specs)
    if sample_args is None:
        raise ValueError("capture needs sample_args (TE flat layout) or specs (one CallSpec per (chunk, layer))")
    expected = num_graphs(lpc, M)
    if len(sample_args) != expected:
        raise ValueError(f"len(sample_args)={len(sample_args)} but layers_per_chunk={lpc} and num_microbatches={M} "
                         f"need sum(L)*M = {expected} entries (TE flat layout: chunk, then microbatch, then layer)")
    if sample_kwargs is not None and len(sample_kwargs) != expected:
        raise ValueError(f"len(sample_kwargs)={len(sample_kwargs)} must equal len(sample_args)={expected}")
    out: dict[tuple[int, int], CallSpec] = {}
    for c, n in enumerate(lpc):
        for m in range(M):
            for l in range(n):
                i = flat_index(c, m, l, lpc, M)
                entry = sample_args[i]
                if not isinstance(entry, tuple) or not all(isinstance(t, torch.Tensor) for t in entry):
                    raise TypeError(f"sample_args[{i}] (chunk {c}, microbatch {m}, layer {l}) must be a tuple of "
                                    f"tensors, got {type(entry).__name__}")
                spec = CallSpec.of(entry, sample_kwargs[i] if sample_kwargs is not None else None)
                if out.setdefault((c, l), spec) != spec:
                    raise ValueError(f"sample_args for chunk {c} layer {l} differ between microbatches ({spec} vs "
                                     f"{out[(c, l)]}); graphs need the same shapes for every microbatch")
    return out


def _local_problem(layers: GraphedLayers, sample_args) -> str | None:
    """Why this rank cannot capture on CUDA, or ``None``."""
    for c, chunk in enumerate(layers.modules):
        for l, module in enumerate(chunk):
            try:
                common.check_capturable(module, f"chunk {c} layer {l}")
            except common.CaptureError as exc:
                return str(exc)
            if any(p.device.type != "cuda" for p in module.parameters()):
                return f"chunk {c} layer {l} has parameters off the GPU"
    if any(t.device.type != "cuda" for entry in sample_args for t in entry):
        return "sample arguments are not on the GPU"
    return None


def _cleanup_after_failure() -> None:
    gc.enable()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a failed capture can leave the device in an error state; keep going
            pass
        gc.collect()
        torch.cuda.empty_cache()


# -- backends ----------------------------------------------------------------------------------------------------
def _slot_capture(slot_cls, warmup_ctx, layers: GraphedLayers, order, lpc, M, sample_args, sample_kwargs,
                  layer_specs, num_warmup_iters, share, clone_param_grads, tracer, prepare=None) -> GraphSet:
    n_mb = 1 if share else M
    slots: list[common.ReplaySlot] = []
    for c, n in enumerate(lpc):
        for m in range(n_mb):
            for l in range(n):
                i = flat_index(c, m, l, lpc, M)
                spec = layer_specs[(c, l)]
                kw = sample_kwargs[i] if sample_kwargs is not None else {}
                static = spec.flatten(sample_args[i], kw)
                slots.append(slot_cls(LayerEvent("F", c, m, l), layers.original_forward[(c, l)],
                                      layers.modules[c][l], spec, static, clone_param_grads, tracer))
    events = layer_events(order, lpc)
    if share:
        events = [e for e in events if e.microbatch == 0]

    def slot_of(ev: LayerEvent) -> common.ReplaySlot:
        return slots[flat_index(ev.chunk, ev.microbatch, ev.layer, lpc, n_mb)]

    def release():
        for s in slots:
            s.release()

    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    gc_was = gc.isenabled()
    try:
        if prepare is not None:
            prepare(slots)
        gc.disable()  # a GC pass freeing an old graph during another capture is a CUDA error (TE PR #2092)
        common.walk_capture(events, slot_of, num_warmup_iters, warmup_ctx, lambda s: s.capture_forward(),
                            lambda s: s.capture_backward())
    except BaseException:
        release()
        raise
    finally:
        if gc_was:
            gc.enable()
        torch.set_rng_state(cpu_rng)  # warmup and capture leave no trace on dropout numerics
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return GraphSet(backend="", order=list(order), layers_per_chunk=list(lpc), num_microbatches=M,
                    specs=layer_specs, callables=slots, shared=share, release=release)


def _capture_emulate(layers, order, lpc, M, sample_args, sample_kwargs, layer_specs, num_warmup_iters, share,
                     clone_param_grads, pool, generators, tracer, report) -> GraphSet:
    gs = _slot_capture(emulate_backend.EmulatedSlot, emulate_backend.warmup_context, layers, order, lpc, M,
                       sample_args, sample_kwargs, layer_specs, num_warmup_iters, share, clone_param_grads, tracer)
    gs.backend = "emulate"
    return gs


def _capture_torch(layers, order, lpc, M, sample_args, sample_kwargs, layer_specs, num_warmup_iters, share,
                   clone_param_grads, pool, generators, tracer, report) -> GraphSet:
    def prepare(slots):
        torch.cuda.synchronize()
        gc.collect()  # before GC is disabled for the capture: no stale graph may die during it
        torch.cuda.empty_cache()
        torch_cuda.capture_context(slots, pool, generators)  # one shared pool for every graph of this rank

    gs = _slot_capture(torch_cuda.CudaGraphSlot, torch_cuda.warmup_context, layers, order, lpc, M, sample_args,
                       sample_kwargs, layer_specs, num_warmup_iters, share, clone_param_grads, tracer,
                       prepare=prepare)
    gs.backend = "torch"
    torch.cuda.synchronize()
    return gs


def _capture_te(layers, order, lpc, M, sample_args, sample_kwargs, layer_specs, num_warmup_iters, share,
                clone_param_grads, pool, generators, tracer, report) -> GraphSet:
    runtime_order = list(order)
    if share:
        order = _single_microbatch_order(order)
        n_mb = 1
        sample_args = [sample_args[flat_index(c, 0, l, lpc, M)] for c, n in enumerate(lpc) for l in range(n)]
        if sample_kwargs is not None:
            sample_kwargs = [sample_kwargs[flat_index(c, 0, l, lpc, M)] for c, n in enumerate(lpc)
                             for l in range(n)]
    else:
        n_mb = M
    fn = te_backend.load_make_graphed_callables()
    modules = [m for chunk in layers.modules for m in chunk]
    callables, features, kwargs = te_backend.te_capture(fn, modules, sample_args, sample_kwargs, order, lpc, n_mb,
                                                       num_warmup_iters, pool)
    report.te_kwargs = {k: v for k, v in kwargs.items()}
    report.te_features = str(features)
    hooks = []
    if "clone_param_grads_on_return" not in features and clone_param_grads:
        # TE <= 2.18 returns static buffers as parameter grads (B17): clone them before AccumulateGrad keeps them
        for module in modules:
            for p in common.module_params(module):
                hooks.append(p.register_hook(lambda g: g.clone()))

    def release():
        for h in hooks:
            h.remove()
        for f in callables:
            reset = getattr(f, "reset", None)
            if callable(reset):
                reset()

    return GraphSet(backend="te", order=runtime_order, layers_per_chunk=list(lpc),
                    num_microbatches=M, specs=layer_specs, callables=callables, shared=share, release=release)


def _single_microbatch_order(order: Sequence[int]) -> list[int]:
    """The order restricted to microbatch 0 of every chunk (shared graphs capture one microbatch)."""
    return [(c + 1) if kind == "F" else -(c + 1) for kind, c, m in order_events(order) if m == 0]


_CAPTURERS = {"emulate": _capture_emulate, "torch": _capture_torch, "te": _capture_te}
