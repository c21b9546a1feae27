"""Per-layer dispatch: each graphed layer calls the graph of its current microbatch.

:class:`GraphedLayers` replaces the ``forward`` of every graphed layer (an instance attribute, no module hook) by a
dispatcher.  In training mode with graphs installed, a call of layer ``l`` of model chunk ``c`` replays the graph
of ``(c, m, l)`` where ``m = layer.current_microbatch`` -- the attribute Megatron's ``set_current_microbatch``
writes before every forward step (``megatron/core/transformer/cuda_graphs.py``).  Everything else runs the original forward:
eval mode, no graphs, or while suspended (capture, evaluation passes in training mode).

Guards instead of silent corruption:

* ``m`` missing or ``m >= M`` (the captured microbatch count) raises ``RuntimeError`` -- Megatron's
  ``current_microbatch % len(graphs)`` wraps around silently;
* a call the graph cannot replay -- tensors that differ in shape, dtype, device or ``requires_grad`` from the capture
  (a shorter last batch), other constants, another autocast state; TE does not check -- runs the layer's original
  forward instead, with the rest of that ``(chunk, microbatch)`` pass, and says so once per kind of difference
  (WARNING on ``pipecast.graphs``).  That slot's graphs are not replayed this step: the replay guard skips its
  ``F``, ``B`` and ``W`` passes, and since an eager pass writes no graph memory the other graphs' buffers are
  untouched.  No collective decision is needed: the choice follows the call's shapes, which every tensor-parallel
  rank of a stage shares, and an eager pass issues the same collectives, in the same order, as its replay would;
* :class:`ReplayGuard` checks every forward and backward pass against the capture order and raises at the first
  divergence: a graph replayed out of its captured order uses memory another graph may own (NVIDIA/Megatron-LM#6022; :mod:`graphs.liveness`).

The dispatcher can also *record* eager passes (``start_recording``): the ``(F|B, chunk, microbatch, layer)``
sequence the executor really runs and each call's argument layout, from which the runtime builds sample
arguments and checks the capture order before capturing.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .hazards import GeneratorsSeen
from .order import LayerEvent, flat_index, layer_events
from .specs import AutocastState, CallSpec, current_autocast

__all__ = ["GraphedLayers", "GraphSet", "ReplayGuard", "Recording", "layers_of_chunk"]

_MISSING = object()
log = logging.getLogger("pipecast.graphs")


def layers_of_chunk(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The graphable layers of a model chunk: ``chunk.decoder.layers`` (Megatron) or ``chunk.layers``."""
    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", None) if decoder is not None else None
    if layers is None:
        layers = getattr(chunk, "layers", None)
    if layers is None:
        raise ValueError(f"{type(chunk).__name__} has neither .decoder.layers nor .layers; pass the layers to graph "
                         f"explicitly (modules_per_chunk)")
    return list(layers)


class ReplayGuard:
    """Checks that passes arrive in the order the graphs were captured; wraps around at the end of a step.

    :meth:`skip` takes the forward of a ``(chunk, microbatch, layer)`` that runs eagerly this step: its backward
    and weight-gradient passes are then passed over, wherever they fall in the order."""

    def __init__(self, events: Sequence[LayerEvent]):
        self.events = list(events)
        self.position = 0
        self.skipped: set[tuple[int, int, int]] = set()

    def skip(self, event: LayerEvent) -> None:
        """``event`` (a forward, expected now) runs eagerly: consume it and pass over its later ``B`` / ``W``."""
        self.expect(event)
        if self.events:
            self.skipped.add((event.chunk, event.microbatch, event.layer))
            self._pass_skipped()

    def _pass_skipped(self) -> None:
        while self.skipped:
            ev = self.events[self.position]
            if ev.kind == "F" or (ev.chunk, ev.microbatch, ev.layer) not in self.skipped:
                return
            self._advance()

    def _advance(self) -> None:
        self.position = (self.position + 1) % len(self.events)
        if self.position == 0:
            self.skipped.clear()

    def expect(self, event: LayerEvent) -> None:
        if not self.events:
            return
        want = self.events[self.position]
        if event != want:
            pos = self.position
            self.position = 0
            raise RuntimeError(
                f"CUDA-graph replay order diverged from the capture order at pass {pos}: the runtime ran "
                f"'{event}' but the graphs were captured for '{want}' there. A graph replayed out of its captured "
                f"order reads and writes memory that other graphs own (wrong gradients, not an error, on a GPU); "
                f"the executor must run graphs.order.capture_order(plan, rank) -- recapture after changing the "
                f"schedule")
        self._advance()
        self._pass_skipped()

    def reset(self) -> None:
        self.position = 0
        self.skipped.clear()

    @property
    def at_step_boundary(self) -> bool:
        return self.position == 0


@dataclass
class GraphSet:
    """Captured graphs of one rank, indexed in TE's flat layout (``graphs.order.flat_index``).

    ``shared=True`` keeps one graph per layer for all microbatches (legal only when at most one microbatch per
    chunk is in flight, i.e. PP=1).
    """

    backend: str
    order: list[int]
    layers_per_chunk: list[int]
    num_microbatches: int
    specs: dict[tuple[int, int], CallSpec]
    callables: Sequence[Callable]
    shared: bool = False
    release: Callable[[], None] = lambda: None
    autocast: AutocastState = AutocastState()
    extra: dict[str, Any] = field(default_factory=dict)
    check_step: Callable[[], None] = lambda: None  # run before the first replay of every step

    def index(self, chunk: int, microbatch: int, layer: int) -> int:
        if self.shared:
            return flat_index(chunk, 0, layer, self.layers_per_chunk, 1)
        return flat_index(chunk, microbatch, layer, self.layers_per_chunk, self.num_microbatches)

    def call(self, chunk: int, microbatch: int, layer: int, args, kwargs):
        return self.callables[self.index(chunk, microbatch, layer)](*args, **kwargs)


@dataclass
class Recording:
    """Eager passes seen while recording: the per-layer event trace and each call's argument layout."""

    layers_per_chunk: list[int] = field(default_factory=list)
    events: list[LayerEvent] = field(default_factory=list)
    specs: dict[tuple[int, int, int], CallSpec] = field(default_factory=dict)
    autocast: set[AutocastState] = field(default_factory=set)
    generators: list[torch.Generator] = field(default_factory=list)  # non-default ones the layers drew from
    unchained: set[tuple[int, int]] = field(default_factory=set)  # (chunk, layer > 0) not called on l-1's output
    # split backward: the passes whose backward ran outside a split B (with the probe of start_recording)
    outside_split: list[LayerEvent] = field(default_factory=list)
    probe: Callable[[Callable[[], None]], bool] | None = None
    last_output: dict[tuple[int, int], int] = field(default_factory=dict)  # (chunk, mb) -> address of last output

    def backward_seen(self, ev: LayerEvent) -> None:
        self.events.append(ev)
        if self.probe is not None and not self.probe(lambda: None):
            self.outside_split.append(ev)

    def _starts_pass(self, ev: LayerEvent) -> bool:
        return ev.layer == (0 if ev.kind == "F" else self.layers_per_chunk[ev.chunk] - 1)

    def microbatch_passes(self) -> list[tuple[str, int, int]]:
        """``(kind, chunk, microbatch)`` per chunk pass, as recorded (checks the executor's microbatch ids)."""
        return [(ev.kind, ev.chunk, ev.microbatch) for ev in self.events if self._starts_pass(ev)]

    def chunk_order(self) -> list[int]:
        """The recorded trace in TE order notation (one entry per chunk forward / backward)."""
        return [(c + 1) if kind == "F" else -(c + 1) for kind, c, _ in self.microbatch_passes()]

    def layer_specs(self) -> tuple[dict[tuple[int, int], CallSpec] | None, str | None]:
        """One spec per ``(chunk, layer)`` if every microbatch had the same argument layout, else a reason."""
        if len(self.autocast) > 1:
            return None, f"layers ran under different autocast states ({', '.join(map(str, self.autocast))})"
        out: dict[tuple[int, int], CallSpec] = {}
        for (c, m, l), spec in sorted(self.specs.items()):
            if out.setdefault((c, l), spec) != spec:
                return None, (f"variable input shapes across microbatches (chunk {c} layer {l}: {out[(c, l)]} vs "
                              f"{spec}), e.g. variable sequence lengths")
        return out, None


class GraphedLayers:
    """Dispatchers installed on the graphed layers of one pipeline rank.

    Args:
        modules_per_chunk: per model chunk of this rank, its graphed layers in call order.
        tracer: gets a ``"graph"`` span (``"replay F1.0 l2"``) around each replay of backends that replay in
            Python (torch, emulate); ``None`` for none.
    """

    def __init__(self, modules_per_chunk: Sequence[Sequence[torch.nn.Module]], tracer=None):
        self.modules = [list(chunk) for chunk in modules_per_chunk]
        self.layers_per_chunk = [len(c) for c in self.modules]
        self.tracer = tracer
        self.graphs: GraphSet | None = None
        self.guard = ReplayGuard([])
        self.recording: Recording | None = None
        self.suspended = 0
        self.report = None  # set by graphs.capture.capture
        self._slot_backends = False
        self.eager_passes: set[tuple[int, int]] = set()  # (chunk, microbatch) passes running eagerly this step
        self.eager_calls = 0  # layer calls that ran eagerly instead of replaying (different shapes)
        self._logged: set[str] = set()
        seen: set[int] = set()
        self._saved: list[tuple[torch.nn.Module, Any]] = []
        self.original_forward: dict[tuple[int, int], Callable] = {}
        for c, chunk in enumerate(self.modules):
            for l, module in enumerate(chunk):
                if id(module) in seen:
                    raise ValueError(f"chunk {c} layer {l} ({type(module).__name__}) appears twice in "
                                     f"modules_per_chunk; every graphed layer must be a distinct module")
                seen.add(id(module))
                if getattr(module.__dict__.get("forward"), "__pipecast_graphed__", False):
                    raise ValueError(f"chunk {c} layer {l} already has a graph dispatcher; pass its GraphedLayers "
                                     f"to graphs.capture to recapture, or call .remove() first")
        for c, chunk in enumerate(self.modules):
            for l, module in enumerate(chunk):
                self._install(c, l, module)

    # -- installation -----------------------------------------------------------------------------------------
    def _install(self, chunk: int, layer: int, module: torch.nn.Module) -> None:
        self._saved.append((module, module.__dict__.get("forward", _MISSING)))
        original = module.forward
        self.original_forward[(chunk, layer)] = original

        def forward(*args, **kwargs):
            return self._call(chunk, layer, module, original, args, kwargs)

        forward.__pipecast_graphed__ = True
        module.forward = forward

    def remove(self) -> None:
        """Release the graphs and restore every layer's original ``forward``."""
        self.clear_graphs()
        for module, saved in self._saved:
            if saved is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = saved
        self._saved = []

    # -- graphs -------------------------------------------------------------------------------------------------
    def set_graphs(self, graphs: GraphSet) -> None:
        """Install captured graphs; the replay guard expects the passes of ``graphs.order``."""
        self.clear_graphs()
        self.graphs = graphs
        self.guard = ReplayGuard(layer_events(graphs.order, self.layers_per_chunk))
        self.eager_passes.clear()
        self._slot_backends = graphs.backend in ("torch", "emulate")
        if self._slot_backends:  # their autograd function checks the backward order itself (no tensor hook)
            for slot in graphs.callables:
                slot.guard = self.guard

    def clear_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        self.guard = ReplayGuard([])

    @property
    def active(self) -> bool:
        """Graphs are installed (training-mode calls replay them)."""
        return self.graphs is not None

    def set_current_microbatch(self, chunk: int, microbatch: int) -> None:
        """Write ``current_microbatch`` on every graphed layer of ``chunk`` (for executors that do not)."""
        for module in self.modules[chunk]:
            module.current_microbatch = microbatch

    # -- recording ----------------------------------------------------------------------------------------------
    def start_recording(self, probe: Callable[[Callable[[], None]], bool] | None = None) -> None:
        """Record the next eager passes.  ``probe`` (split backward: ``defer_weight_grad``) is offered a no-op at
        every recorded backward; one it declines ran outside a split ``B`` (``Recording.outside_split``)."""
        self.recording = Recording(list(self.layers_per_chunk), probe=probe)

    def stop_recording(self) -> Recording:
        rec, self.recording = self.recording, None
        return rec if rec is not None else Recording()

    # -- suspension (capture, training-mode evaluation) -----------------------------------------------------------
    def suspend(self):
        """Context manager: run every layer eagerly and record nothing (used during capture)."""
        layers = self

        class _Suspend:
            def __enter__(self):
                layers.suspended += 1

            def __exit__(self, *exc):
                layers.suspended -= 1
                return False

        return _Suspend()

    # -- the dispatcher -------------------------------------------------------------------------------------------
    def _microbatch(self, chunk: int, layer: int, module: torch.nn.Module) -> int:
        m = getattr(module, "current_microbatch", None)
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise RuntimeError(f"chunk {chunk} layer {layer} ({type(module).__name__}) has current_microbatch={m!r};"
                               f" with CUDA graphs the executor must call set_current_microbatch(model_chunk, "
                               f"microbatch_id) before every forward step so each microbatch uses its own graph")
        return m

    def _call(self, chunk: int, layer: int, module: torch.nn.Module, original: Callable, args, kwargs):
        if self.suspended or not module.training:
            return original(*args, **kwargs)
        if self.recording is not None:
            return self._record(chunk, layer, module, original, args, kwargs)
        graphs = self.graphs
        if graphs is None:
            return original(*args, **kwargs)
        m = module.__dict__.get("current_microbatch")
        if type(m) is not int or m < 0 or m >= graphs.num_microbatches:
            m = self._checked_microbatch(chunk, layer, module, graphs)
        autocast_differs = (graphs.autocast.regions or torch._C._is_any_autocast_enabled()) and \
            current_autocast() != graphs.autocast  # (the cheap test first: autocast is usually off)
        if autocast_differs or not graphs.specs[(chunk, layer)].matches(args, kwargs) or (
                self.eager_passes and self._pass_is_eager(chunk, m, layer)):
            return self._eager_pass(chunk, layer, m, graphs, original, args, kwargs)
        if self.guard.position == 0:
            graphs.check_step()
        self.guard.expect(LayerEvent("F", chunk, m, layer))
        fn = graphs.callables[graphs.index(chunk, m, layer)]
        if self._slot_backends:  # torch/emulate: the slot reports spans and checks its backward's order
            fn.backward_event = LayerEvent("B", chunk, m, layer)
            return fn(*args, **kwargs)
        if self.tracer is not None:
            with self.tracer.span("graph", f"replay F{m}.{chunk} l{layer}"):
                out = fn(*args, **kwargs)
        else:
            out = fn(*args, **kwargs)
        self._on_backward(out, LayerEvent("B", chunk, m, layer), self.guard.expect)
        return out

    def _checked_microbatch(self, chunk: int, layer: int, module: torch.nn.Module, graphs: GraphSet) -> int:
        m = self._microbatch(chunk, layer, module)
        if m >= graphs.num_microbatches:
            raise RuntimeError(f"chunk {chunk} layer {layer}: microbatch {m} but graphs were captured for "
                               f"num_microbatches={graphs.num_microbatches}; recapture when the microbatch count "
                               f"changes (graphs.runtime.GraphRuntime does) -- graphs never wrap around")
        return m

    def _pass_is_eager(self, chunk: int, m: int, layer: int) -> bool:
        """Whether the ``(chunk, m)`` pass runs eagerly from an earlier layer on (a new pass starts at layer 0)."""
        if layer == 0:
            self.eager_passes.discard((chunk, m))
        return (chunk, m) in self.eager_passes

    def _eager_pass(self, chunk: int, layer: int, m: int, graphs: GraphSet, original, args, kwargs):
        """Run a call the graph cannot replay eagerly, with the rest of its ``(chunk, microbatch)`` pass (module
        docstring); the replay guard skips the slot's passes.  One WARNING per kind of difference."""
        problem = graphs.specs[(chunk, layer)].mismatch(args, kwargs)
        if problem is None and current_autocast() != graphs.autocast:
            problem = f"autocast is '{current_autocast()}', the graphs were captured under '{graphs.autocast}'"
        if problem is not None and problem not in self._logged:
            self._logged.add(problem)
            log.warning("CUDA graphs: chunk %d layer %d microbatch %d: %s; running this pass eagerly (a graph "
                        "replays its captured shapes only; logged once)", chunk, layer, m, problem)
        self.eager_passes.add((chunk, m))
        self.eager_calls += 1
        self.guard.skip(LayerEvent("F", chunk, m, layer))
        return original(*args, **kwargs)

    def _record(self, chunk, layer, module, original, args, kwargs):
        m = self._microbatch(chunk, layer, module)
        rec = self.recording
        rec.events.append(LayerEvent("F", chunk, m, layer))
        rec.specs[(chunk, m, layer)] = CallSpec.of(args, kwargs)
        rec.autocast.add(current_autocast())
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if layer > 0 and (first is None or rec.last_output.get((chunk, m)) != first.data_ptr()):
            rec.unchained.add((chunk, layer))
        with GeneratorsSeen(rec.generators):
            out = original(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            rec.last_output[(chunk, m)] = out.data_ptr()
        else:
            rec.last_output.pop((chunk, m), None)
        self._on_backward(out, LayerEvent("B", chunk, m, layer), rec.backward_seen)
        return out

    @staticmethod
    def _on_backward(out, event: LayerEvent, callback: Callable[[LayerEvent], None]) -> None:
        """Call ``callback(event)`` when the gradient of the layer's output arrives (its backward starts)."""
        tensors = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)] \
            if isinstance(out, (tuple, list)) else []
        for t in tensors:
            if t.requires_grad:
                t.register_hook(lambda grad, _ev=event: callback(_ev))
                return
