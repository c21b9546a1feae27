"""``capture``: graphs per ``(model chunk, microbatch, layer)`` of one pipeline rank, in the rank's order.

One entry point for every backend; each captures in the order of the rank's plan (:func:`graphs.order.capture_order`):

* ``"te"``: Transformer Engine ``make_graphed_callables(..., _order=...)`` through :mod:`graphs.backends.te`;
* ``"torch"`` (alias ``"pipecast"``): pipecast's ordered capture on ``torch.cuda.CUDAGraph``;
* ``"emulate"``: CPU static-buffer emulation (tests);
* ``"eager"``: no graphs;
* ``"auto"``: ``te`` if CUDA and an ordered TE are available, else ``torch`` on CUDA, else eager; ``torch`` for
  split-backward plans;
* any backend added with :func:`graphs.backends.register_backend`.

Each backend is one file behind the :class:`graphs.backends.Backend` protocol (why it is unavailable here, capture
one job, whether it supports split backward); this module picks one by name through the registry and never names
a backend itself.

Split-backward plans (``zb_h1``, ``zbv``, ``zb``: ``W`` actions) get three graphs per ``(chunk, microbatch,
layer)``: ``F``, ``B`` (input gradient only) and ``W`` (weight gradients), captured in the plan's order with the
``W`` actions in it (``graphs.order.capture_order``); the caller passes ``defer_weight_grad`` (the split backward's
queue, ``engine.runtime.split_backward.defer_weight_grad``).  The ``torch`` and ``emulate`` backends support
this; ``te`` falls back to eager with the reason (:func:`graphs.backends.te.split_backward_reason`).

The graphs-or-eager decision is collective (:func:`graphs.decision.agree`) both before capture (availability) and
after it (capture errors); a fallback logs one line with the reason.  The result is a :class:`GraphedLayers`
whose layers dispatch to the graph of their current microbatch; ``.report`` says what happened.
"""
from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Sequence

import torch

from engine.plan import Plan

from . import decision
from . import backends
from .accounting import LiveBytes
from .backends import common, torch_cuda
from .dispatch import GraphedLayers, GraphSet
from .hazards import HazardError
from .order import LayerEvent, check_order, flat_index, capture_order, layer_events, max_in_flight, num_graphs
from .specs import AutocastState, CallSpec, autocast_context, current_autocast

__all__ = ["BACKENDS", "CaptureReport", "DebugOptions", "capture", "resolve_backend", "make_sample_args",
           "describe_failure", "root_cause"]

log = logging.getLogger("pipecast.graphs")
BACKENDS = ("auto", "te", "torch", "pipecast", "emulate", "eager")  # the built-ins; all: backends.backend_names()
CAPTURE_TIMEOUT_FRACTION = 0.8  # of the collective timeout: a longer projected capture stops (see capture)
_clock = time.perf_counter  # replaced by a fake clock in CPU tests of the capture-time check


@dataclass
class CaptureReport:
    """What :func:`capture` did.

    Attributes:
        requested: the backend asked for.
        backend: the backend in use (``"eager"`` after a fallback).
        reason: why graphs are off (``None`` when they are on).
        order: the capture order (TE notation).
        num_graphs: graph sets captured, one per ``(chunk, microbatch, layer)`` (or per ``(chunk, layer)`` when
            shared): forward and backward, plus weight-gradient with split backward.
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
    """The canonical backend name (``"pipecast"`` is ``"torch"``; :func:`graphs.backends.canonical_name`).

    Raises:
        ValueError: unknown backend name.
    """
    return backends.canonical_name(requested)


def resolve_backend(requested: str, splits: bool = False) -> tuple[str, str | None]:
    """``(backend, reason)``: the backend to use for ``requested`` here, or ``("eager", why)``
    (:func:`graphs.backends.resolve`; ``splits``: the plan has ``W`` actions).

    Raises:
        ValueError: unknown backend name.
    """
    return backends.resolve(requested, splits)


def make_sample_args(specs: dict[tuple[int, int], CallSpec], layers_per_chunk: Sequence[int],
                     num_microbatches: int) -> tuple[list[tuple], list[dict]]:
    """Fresh static sample arguments in TE's flat layout from one :class:`CallSpec` per ``(chunk, layer)``.

    Returns ``(sample_args, sample_kwargs)``: per flat index a tuple of positional tensors and a dict of tensor
    keyword arguments (ones, with the recorded ``requires_grad``; Megatron's ``megatron/core/transformer/cuda_graphs.py`` uses ones too).
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


@dataclass(frozen=True)
class DebugOptions:
    """Switches that only negative-control tests use; never set in training (``capture(..., _debug=...)``).

    Attributes:
        check_order: verify the capture order against the plan (off: test the replay guard).
        allow_unsafe_sharing: allow ``share_graphs`` with several microbatches in flight (Megatron-LM#422).
        param_grads: ``"accumulate"`` (default, in-graph), ``"clone"`` or ``"alias"`` (the failure of NVIDIA/TransformerEngine#2937).
    """

    check_order: bool = True
    allow_unsafe_sharing: bool = False
    param_grads: str = "accumulate"

    def __post_init__(self):
        if self.param_grads not in common.PARAM_GRAD_MODES:
            raise ValueError(f"param_grads={self.param_grads!r}; use one of {common.PARAM_GRAD_MODES}")


@dataclass
class _Job:
    """Everything one capture needs, validated."""

    layers: GraphedLayers
    order: list[int]
    M: int
    sample_args: Sequence[tuple] | None
    sample_kwargs: Sequence[dict] | None
    layer_specs: dict[tuple[int, int], CallSpec] | None
    num_warmup_iters: int
    share: bool
    chain: bool
    pool: Any
    generators: tuple
    tracer: Any
    autocast: AutocastState
    test: DebugOptions
    report: CaptureReport | None = None
    defer_weight_grad: Any = None
    splits: bool = False
    timeout_s: float | None = None
    eager_microbatches: int = 0
    pp_size: int = 1

    @property
    def lpc(self) -> list[int]:
        return self.layers.layers_per_chunk


def capture(modules_per_chunk: Sequence[Sequence[torch.nn.Module]] | GraphedLayers, plan: Plan, rank: int,
            sample_args: Sequence[tuple] | None = None, sample_kwargs: Sequence[dict] | None = None, *,
            specs: dict[tuple[int, int], CallSpec] | None = None, backend: str = "auto", num_warmup_iters: int = 1,
            order: Sequence[int] | None = None, share_graphs: bool = False, chain_layers: bool = True, pool=None,
            generators: Sequence[torch.Generator] = (), group=None, tracer=None, veto: str | None = None,
            autocast: AutocastState | None = None, defer_weight_grad=None, timeout_s: float | None = None,
            eager_microbatches: int = 0, _debug: DebugOptions | None = None) -> GraphedLayers:
    """Capture the graphs of pipeline rank ``rank`` of ``plan`` and install them on its layers.

    Args:
        modules_per_chunk: per model chunk of this rank, its layers to graph (``[s, b, h] -> [s, b, h]`` blocks,
            in call order), or an existing :class:`GraphedLayers` (recapture).
        plan, rank: the training plan the executor runs (``engine.plan.build_plan``) and this pipeline rank.
        sample_args: per forward pass in TE's flat layout (``graphs.order.flat_index``, ``sum(L)*M`` entries) a
            tuple of tensors shaped, typed and ``requires_grad``-flagged like the real inputs (the static inputs);
            ``sample_kwargs``: tensor keyword arguments, same layout.  Or ``specs``: a :class:`CallSpec` per
            ``(chunk, layer)``.
        backend: see module docstring.  ``num_warmup_iters``: eager rounds before capture (at least one runs).
        order: the capture order (default ``capture_order(plan, rank)``); it must equal the runtime's.
        share_graphs: one graph per layer for all microbatches; only with one microbatch per chunk in flight.
        chain_layers: layer ``l``'s static input is layer ``l-1``'s static output (torch/emulate: no copy); each
            layer must then be called on its predecessor's output.
        pool: a CUDA graph memory pool to share (torch/te); default one fresh pool.
        generators: generators to register with every graph (dropout under a TP RNG tracker); a layer drawing
            from any other non-default generator fails the capture (``graphs.hazards``).
        group: process group of the collective decision (default: the world, if initialised).
        tracer: receives ``"graph"`` spans around replays.
        veto: a reason this rank must not capture (e.g. variable shapes); it joins the collective decision.
        autocast: the autocast state of the forward steps (default: the state at this call); capture and every
            emulated replay run under it with the cast cache off, and replay checks the caller is in it.
        defer_weight_grad: split-backward plans only (required there): ``fn(w) -> bool`` queueing a layer's ``W``
            replay ``w`` into the split backward in progress (``engine.runtime.split_backward.defer_weight_grad``).
        timeout_s: the collective timeout of ``group`` (``parallel.timeout_s``), seconds: the other ranks wait in
            the decision after the capture for at most this long.  Each graph's capture synchronises the device and
            empties the cache, so a capture of many graphs can take long: once a few graphs are captured, a capture
            projected to take more than :data:`CAPTURE_TIMEOUT_FRACTION` of it stops with the reason (all ranks
            then run eagerly), and one that took more than half of it logs a warning.  ``None``: no check.
        eager_microbatches: microbatches this rank ran eagerly before the capture (the runtime's warmup steps);
            the ``te`` backend counts them in Megatron's warmup rule (``graphs.backends.te.megatron_warmup_iters``).
        _debug: :class:`DebugOptions` for negative-control tests.

    Returns:
        The :class:`GraphedLayers` (``.report`` is a :class:`CaptureReport`; ``.active`` tells graphs from eager).

    Raises:
        ValueError / TypeError: bad arguments (a split-backward plan without ``defer_weight_grad``, shared graphs or
            a ``param_grads`` test mode with one), before any communication.  Capture failures do not raise: every
        rank falls back to eager with one log line naming the failing rank and the root error.
    """
    created = not isinstance(modules_per_chunk, GraphedLayers)
    layers = GraphedLayers(modules_per_chunk, tracer=tracer) if created else modules_per_chunk
    try:
        job = _Job(layers, [], plan.num_microbatches, sample_args, sample_kwargs, None, num_warmup_iters,
                   share_graphs, chain_layers, pool, tuple(generators), tracer,
                   current_autocast() if autocast is None else autocast, _debug or DebugOptions(),
                   defer_weight_grad=defer_weight_grad, splits=plan.splits_backward and not plan.forward_only,
                   timeout_s=timeout_s, eager_microbatches=eager_microbatches,
                   pp_size=plan.pp_size)
        _validate(job, backend, plan, rank, specs, order, veto)
    except BaseException:
        if created:
            layers.remove()
        raise
    layers.clear_graphs()
    job.report = layers.report = CaptureReport(requested=backend, backend="eager", order=list(job.order))
    chosen, reason = _local_verdict(job, backend, veto)
    ok, reason = decision.agree(reason is None, reason, group)
    if not ok:
        return _fall_back(layers, backend, reason, group)
    graphs, error = _run_capture(chosen, job)
    ok, reason = decision.agree(error is None, error, group)  # every rank gets here, whatever capture did
    if not ok:
        if graphs is not None:
            _quietly(graphs.release)
        return _fall_back(layers, backend, reason, group)
    return _install(job, chosen, graphs)


def _install(job: _Job, chosen: str, graphs: GraphSet) -> GraphedLayers:
    job.report.backend = chosen
    job.report.num_graphs = sum(job.lpc) if job.share else num_graphs(job.lpc, job.M)
    graphs.autocast = job.autocast
    job.layers.set_graphs(graphs)
    return job.layers


def _local_verdict(job: _Job, backend: str, veto: str | None) -> tuple[str, str | None]:
    """``(backend, reason this rank cannot capture or None)`` before the first collective decision."""
    chosen, reason = resolve_backend(backend, splits=job.splits)
    if veto is not None:
        return chosen, veto
    if job.splits and reason is None:
        reason = _split_problem(job)
    if reason is None and backends.get_backend(chosen).needs_cuda_tensors:
        reason = _local_problem(job.layers, job.sample_args)
    return chosen, reason


def _split_problem(job: _Job) -> str | None:
    """Split backward: every graphed layer needs an input that requires grad (else its backward would only run
    inside a later ``W``, out of the captured order)."""
    for (c, l), spec in sorted(job.layer_specs.items()):
        if not any(t.requires_grad for t in spec.tensor_specs):
            return (f"split backward: chunk {c} layer {l} is called on inputs that need no gradient, so "
                    f"its backward would run in the W pass, not in B where the graphs are captured -- "
                    f"put a layer with parameters (an embedding, an input projection) before the first "
                    f"graphed layer, or graph only layers after it")
    return None


def _fall_back(layers: GraphedLayers, backend: str, reason: str, group) -> GraphedLayers:
    layers.report.reason = reason
    layers.report.log_line = decision.log_fallback(backend, reason, group)
    return layers


def _validate(job: _Job, backend: str, plan: Plan, rank: int, specs, order, veto) -> None:
    lpc = job.lpc
    resolve_backend_name(backend)
    job.order = capture_order(plan, rank) if order is None else list(order)
    if veto is not None:
        return
    if len(lpc) != plan.num_model_chunks:
        raise ValueError(f"modules_per_chunk has {len(lpc)} model chunks but the plan has num_model_chunks="
                         f"{plan.num_model_chunks}")
    if job.test.check_order:
        check_order(job.order, plan, rank)
    job.layer_specs = _layer_specs(job.sample_args, job.sample_kwargs, specs, lpc, job.M)
    if job.sample_args is None:
        job.sample_args, job.sample_kwargs = make_sample_args(job.layer_specs, lpc, job.M)
    if job.splits:
        _validate_split(job)
    if job.share and max_in_flight(job.order) > 1 and not job.test.allow_unsafe_sharing:
        raise ValueError(f"share_graphs=True but rank {rank} has up to {max_in_flight(job.order)} microbatches of a "
                         f"chunk in flight; one graph per layer would be overwritten before its backward "
                         f"(Megatron-LM#422) -- share graphs only with no pipelining")
    n = job.num_warmup_iters
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"num_warmup_iters={n!r} must be an int >= 0")


def _validate_split(job: _Job) -> None:
    if job.defer_weight_grad is None or not callable(job.defer_weight_grad):
        raise ValueError("the plan splits the backward (W actions): capture needs defer_weight_grad=<callable> that "
                         "queues a layer's W replay into the running split backward -- pass "
                         "engine.runtime.split_backward.defer_weight_grad")
    if job.share:
        raise ValueError("share_graphs=True with a split-backward plan: a W replay reads the buffers its B wrote, "
                         "which a later microbatch's B would overwrite -- capture one graph set per microbatch")
    if job.test.param_grads != "accumulate":
        raise ValueError(f"param_grads={job.test.param_grads!r} with a split-backward plan: W graphs accumulate "
                         f"into the parameter buffers; use 'accumulate'")


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
    return _nccl_register_problem(layers)


def _nccl_register_problem(layers: GraphedLayers) -> str | None:
    """Tensor-parallel layers (DTensor parameters) capture NCCL collectives; NCCL registers a graph's buffers
    assuming contiguous allocations, which expandable segments break (illegal memory access or hangs:
    NVIDIA/Megatron-LM#5474, pytorch#158029) unless ``NCCL_GRAPH_REGISTER=0``."""
    expandable = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    if not expandable or os.environ.get("NCCL_GRAPH_REGISTER") == "0":
        return None
    if any(hasattr(p, "device_mesh") for chunk in layers.modules for m in chunk for p in m.parameters()):
        return ("tensor-parallel collectives inside CUDA graphs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                "need NCCL_GRAPH_REGISTER=0 (NCCL registers graph buffers as contiguous allocations; "
                "NVIDIA/Megatron-LM#5474) -- set NCCL_GRAPH_REGISTER=0 or drop expandable_segments")
    return None


# -- running a capture: the caller's state comes back whatever happens ---------------------------------------------
@dataclass
class _CallerState:
    """GC setting, RNG states and (on CUDA) the current stream of the caller, restored step by step, never
    raising: a failed restore must not keep this rank from the collective decision."""

    gc_enabled: bool
    cpu_rng: torch.Tensor
    cuda_rng: list | None
    stream: Any
    generators: list[tuple[torch.Generator, torch.Tensor]]

    @classmethod
    def save(cls, generators: Sequence[torch.Generator] = ()) -> "_CallerState":
        on_cuda = _quietly(torch_cuda.cuda.is_available) or False
        return cls(gc.isenabled(), torch.get_rng_state(),
                   _quietly(torch_cuda.cuda.get_rng_state_all) if on_cuda else None,
                   _quietly(torch_cuda.cuda.current_stream) if on_cuda else None,
                   [(g, g.get_state()) for g in generators])

    def restore(self) -> list[str]:
        """Restore everything; returns the errors of the steps that failed (for the report)."""
        errors: list[str] = []
        _quietly(gc.enable if self.gc_enabled else gc.disable, errors=errors)
        _quietly(torch.set_rng_state, self.cpu_rng, errors=errors)  # warmup/capture leave no trace on dropout
        if self.cuda_rng is not None:
            _quietly(torch_cuda.cuda.set_rng_state_all, self.cuda_rng, errors=errors)
        for g, state in self.generators:  # the registered generators too (TE restores its tracker's)
            _quietly(g.set_state, state, errors=errors)
        if self.stream is not None:
            _quietly(torch_cuda.cuda.set_stream, self.stream, errors=errors)
        return errors


def _quietly(fn, *args, errors: list[str] | None = None):
    """``fn(*args)``, or ``None`` if it raises (the error text is appended to ``errors``)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - cleanup steps must never raise
        if errors is not None:
            errors.append(f"{getattr(fn, '__name__', fn)}: {type(exc).__name__}: {_first_line(exc)}")
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def root_cause(exc: BaseException) -> BaseException:
    """The first error of a chain (``__cause__`` / ``__context__``): a failed capture's ``capture_end()`` error
    hides the host sync that invalidated it."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ or exc.__context__
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def describe_failure(exc: BaseException) -> str:
    """One line: the root error, then the error that surfaced if it differs."""
    root = root_cause(exc)
    line = f"capture error: {type(root).__name__}: {_first_line(root)}"
    if root is not exc:
        line += f" (then {type(exc).__name__}: {_first_line(exc)})"
    return line


def _run_capture(chosen: str, job: _Job):
    """``(GraphSet, None)`` or ``(None, one-line error)``; never raises an ``Exception``."""
    caller = _CallerState.save(job.generators)
    start = _clock()
    try:
        with job.layers.suspend(), autocast_context(job.autocast):
            return backends.get_backend(chosen).capture(job, partial(_slot_capture, job=job)), None
    except Exception as exc:  # noqa: BLE001 - any capture failure means eager, collectively
        job.report.traceback = traceback.format_exc()
        return None, describe_failure(exc)
    finally:
        cleanup = caller.restore()
        if job.report.traceback is not None:
            cleanup += _release_device_memory()
            if cleanup:
                job.report.traceback += "cleanup errors: " + "; ".join(cleanup) + "\n"
        job.report.seconds = _clock() - start
        if job.timeout_s is not None and job.report.seconds > 0.5 * job.timeout_s:
            log.warning("CUDA graphs: capture took %.1fs, more than half of the collective timeout "
                        "parallel.timeout_s=%s; raise it if captures grow", job.report.seconds, job.timeout_s)


def _release_device_memory() -> list[str]:
    """After a failed capture: collect the dropped graphs and return the pool's blocks to the driver."""
    errors: list[str] = []
    _quietly(gc.collect, errors=errors)
    if _quietly(torch_cuda.cuda.is_available):
        _quietly(torch_cuda.cuda.synchronize, errors=errors)
        _quietly(torch_cuda.cuda.empty_cache, errors=errors)
    return errors


# -- backends ----------------------------------------------------------------------------------------------------
def _make_slots(slot_cls, job: _Job, n_mb: int) -> list[common.ReplaySlot]:
    """One slot per ``(chunk, microbatch, layer)`` (``n_mb`` microbatches), consecutive layers linked."""
    options = common.SlotOptions(job.test.param_grads, job.generators, job.tracer,
                                 defer_weight_grad=job.defer_weight_grad if job.splits else None)
    grads = common.GradBuffers() if job.test.param_grads == "accumulate" else None
    slots: list[common.ReplaySlot] = []
    for c, n in enumerate(job.lpc):
        for m in range(n_mb):
            for l in range(n):
                i = flat_index(c, m, l, job.lpc, job.M)
                spec = job.layer_specs[(c, l)]
                kw = job.sample_kwargs[i] if job.sample_kwargs is not None else {}
                slot = slot_cls(LayerEvent("F", c, m, l), job.layers.original_forward[(c, l)],
                                job.layers.modules[c][l], spec, spec.flatten(job.sample_args[i], kw), options, grads)
                slot.autocast = job.autocast
                if l > 0 and job.chain:
                    slot.prev, slots[-1].next = slots[-1], slot
                slots.append(slot)
    return slots


def _slot_capture(slot_cls, warmup_ctx, job: _Job, prepare=None) -> GraphSet:
    """The slot-based capture walk (torch, emulate): one ``slot_cls`` per ``(chunk, microbatch, layer)``, warmup
    under ``warmup_ctx``, then F / B / W captures in the job's order; ``prepare(slots)`` runs first."""
    n_mb = 1 if job.share else job.M
    slots = _make_slots(slot_cls, job, n_mb)
    events = layer_events(job.order, job.lpc)
    if job.share:
        events = [e for e in events if e.microbatch == 0]
    if job.splits:
        pool = common.WeightInputPool(common.pending_weight_sets(events)[0])
        for s in slots:
            s.weight_pool = pool

    def slot_of(ev: LayerEvent) -> common.ReplaySlot:
        return slots[flat_index(ev.chunk, ev.microbatch, ev.layer, job.lpc, n_mb)]

    def release():
        for s in slots:
            _quietly(s.release)

    timer = _CaptureTimer(job.timeout_s, len(events))
    tracker = LiveBytes(per_op=False) if getattr(slot_cls, "models_pool", False) else None
    try:
        if prepare is not None:
            prepare(slots)
        gc.disable()  # a GC pass freeing an old graph during another capture is a CUDA error (TE PR #2092)
        common.walk_capture(events, slot_of, job.num_warmup_iters, warmup_ctx,
                            timer.timed(lambda s: s.capture_forward()), timer.timed(lambda s: s.capture_backward()),
                            timer.timed(lambda s: s.capture_weight()), tracker=tracker)
    except BaseException:
        release()  # drops every graph and static tensor: the pool's blocks become free
        raise
    gs = GraphSet(backend="", order=list(job.order), layers_per_chunk=list(job.lpc), num_microbatches=job.M,
                  specs=job.layer_specs, callables=slots, shared=job.share, release=release)
    gs.extra["grad_buffers"] = slots[0].grads if slots else None
    if tracker is not None:
        gs.extra["pool_model"] = {"peak": tracker.peak, "held": tracker.final}
    gs.check_step = _storage_check(job)
    return gs


class _CaptureTimer:
    """Projects the capture's wall time from the graphs captured so far (after the first few) and stops it when the
    projection exceeds :data:`CAPTURE_TIMEOUT_FRACTION` of the collective timeout."""

    MIN_GRAPHS = 4

    def __init__(self, timeout_s: float | None, total: int):
        self.timeout_s, self.total, self.done = timeout_s, total, 0
        self.start = _clock()
        self.first: float | None = None

    def timed(self, fn):
        def run(slot):
            if self.first is None:
                self.first = _clock()  # warmup is over
            fn(slot)
            self.tick()
        return run

    def tick(self) -> None:
        self.done += 1
        if self.timeout_s is None or self.done < min(self.MIN_GRAPHS, self.total):
            return
        now = _clock()
        projected = (self.first - self.start) + (now - self.first) / self.done * self.total
        if projected > CAPTURE_TIMEOUT_FRACTION * self.timeout_s:
            raise common.CaptureError(
                f"capture would take about {projected:.0f}s ({self.total} graphs, {self.done} captured in "
                f"{now - self.first:.1f}s after {self.first - self.start:.1f}s of warmup), more than "
                f"{CAPTURE_TIMEOUT_FRACTION:.0%} of the collective timeout parallel.timeout_s={self.timeout_s:g} "
                f"that the other ranks wait for -- raise parallel.timeout_s, or graph fewer microbatches / layers")


def _storage_check(job: _Job):
    """A check, run once per step, that every graphed parameter still has the storage its graphs read."""
    captured = [(f"chunk {c} layer {l} ({type(m).__name__}) parameter {n}", m, n, p, p.data_ptr())
                for c, chunk in enumerate(job.layers.modules) for l, m in enumerate(chunk)
                for n, p in m.named_parameters()]

    def check() -> None:
        for name, module, pname, p, ptr in captured:
            now = module.get_parameter(pname)
            if now is not p or now.data_ptr() != ptr:
                raise HazardError(f"{name} was replaced (p.data = ..., load_state_dict(assign=True)): the graphs "
                                   f"read its old storage -- update parameters in place (p.copy_(new)) or recapture")
    return check
