"""What the ``torch`` and ``emulate`` backends share: one replay slot per ``(chunk, microbatch, layer)``, the
autograd function that replays it, the per-parameter gradient buffers, and the walk that warms up and captures
slots in the rank's order.

Static-buffer semantics (as torch's ``torch.cuda.graph`` and TE's ``transformer_engine/pytorch/graph.py`` define them), identical in both backends:

* a forward replay copies the call's tensors into the slot's static inputs (skipped when the address is already
  the static input's) and writes the outputs into the slot's static outputs; the caller gets detached aliases of
  them, valid until this slot replays again;
* **chained buffers**: layer ``l``'s static input *is* layer ``l-1``'s static output of the same ``(chunk,
  microbatch)`` (same storage), and layer ``l-1``'s static grad-output is layer ``l``'s static input gradient, so
  no copy happens between consecutive layers; a chained layer called on anything else raises;
* a backward replay copies the incoming gradients into the slot's static grad-outputs, writes the input gradients
  into static grad-inputs (returned as aliases) and **accumulates each parameter gradient inside the graph** into
  one persistent buffer per parameter (Megatron's ``main_grad`` approach) that is installed as ``param.grad``: no
  per-microbatch parameter-gradient copy is held and no clone is made (pytorch/pytorch#181723, NVIDIA/TransformerEngine#2937).  Before a
  backward replay a parameter whose ``.grad`` is ``None`` gets the zeroed buffer, one with another ``.grad`` gets
  the buffer holding its value -- the values eager ``AccumulateGrad`` produces, in the same order.  The parameters
  are no inputs of the replaying autograd function (their gradients never pass through autograd), so the backward
  replay runs their post-accumulate-grad hooks itself (data-parallel grad sync), once per replay, after the
  accumulation -- where eager's ``AccumulateGrad`` would.

**Gradients written inside the backward**: a layer whose backward runs a backward of its own -- activation
recomputation (``engine.runtime.recompute``, Megatron's ``CheckpointFunction``) recomputes the segment and
backpropagates it there -- writes its parameters' ``.grad`` through ``AccumulateGrad`` rather than returning them.
A captured graph would write into whatever ``.grad`` was at capture (lost once the caller resets it), so the
warmup notes those parameters (:attr:`ReplaySlot.side_params`, :func:`redirected_grads`), and their buffers are
installed as ``.grad`` around the capture and before every replay of that backward (``B`` when split), their
hooks silenced inside it and fired by the slot as for the others.

Split backward (zero-bubble plans, :mod:`graphs.backends.split`): a slot then has three graphs.  Its ``B`` replay
computes only the input gradients and writes the gradients ``W`` needs into the slot's static buffers
(:attr:`ReplaySlot.static_weight_inputs`); it hands a callable to ``SlotOptions.defer_weight_grad`` (the split
backward in progress queues it with the other weight-gradient work of that ``(chunk, microbatch)``), and that
callable's ``W`` replay reads those buffers and accumulates the parameter gradients into the per-parameter buffers
(installed as ``.grad`` then, as ``AccumulateGrad`` would).  The parameters are then no inputs of the autograd
function: nothing is accumulated in ``B``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

from ..hazards import HazardCheck, describe, storage_names
from ..order import LayerEvent
from ..specs import AutocastState, CallSpec, TensorSpec, flatten_outputs
from . import split as layer_split

__all__ = ["ReplaySlot", "SlotOptions", "GradBuffers", "WeightInputPool", "walk_capture", "module_params",
           "check_capturable", "CaptureError", "PARAM_GRAD_MODES", "pending_weight_sets", "fire_post_accumulate_hooks",
           "redirected_grads"]

_NULL = contextlib.nullcontext()
PARAM_GRAD_MODES = ("accumulate", "clone", "alias")


class CaptureError(RuntimeError):
    """Capture cannot proceed (a module or argument breaks a requirement of graph capture)."""


def module_params(module: torch.nn.Module) -> tuple[torch.nn.Parameter, ...]:
    """The parameters that receive gradients, in ``module.parameters()`` order (the order of the grad slots)."""
    return tuple(p for p in module.parameters() if p.requires_grad)


def check_capturable(module: torch.nn.Module, where: str) -> None:
    """Graph capture needs a module in training mode, without module hooks (they would be frozen or skipped) and
    without buffers that require grad (TE's ``make_graphed_callables`` and torch's impose the same).

    Raises:
        CaptureError: naming ``where`` (``"chunk 1 layer 0"``) and the offending property.
    """
    for sub_name, sub in module.named_modules():
        name = f"{where}{'.' + sub_name if sub_name else ''}"
        if not sub.training:
            raise CaptureError(f"{name} is in eval mode; capture graphs from a model in training mode")
        hooks = [h for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
                 if getattr(sub, h, None)]
        if hooks:
            raise CaptureError(f"{name} has module hooks ({', '.join(hooks)}); hooks do not run inside a replayed "
                               f"graph -- remove them before capture")
        if any(b.requires_grad for b in sub.buffers(recurse=False)):
            raise CaptureError(f"{name} has a buffer with requires_grad=True, which a graph cannot differentiate")


class GradBuffers:
    """One persistent gradient buffer per parameter (same shape and dtype), shared by every slot of its layer."""

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}

    def of(self, p: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(id(p))
        if buf is None:
            buf = self.buffers[id(p)] = torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
        return buf

    @staticmethod
    def attach(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make every ``p.grad`` its buffer: zeroed if ``p.grad`` was ``None``, holding its value otherwise.
        Called from the replayed backward, where grad mode is off."""
        for p, buf in pairs:
            g = p.grad
            if g is buf:
                continue
            if g is None:
                buf.zero_()
            else:
                buf.copy_(g)
            p.grad = buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def pending_weight_sets(events: Sequence[LayerEvent]) -> tuple[dict[tuple[int, int, int], int], dict]:
    """Which set of ``W``-input buffers each ``(chunk, microbatch, layer)`` uses, reusing a set once its ``W`` ran.

    Walks ``events`` (the rank's per-layer order, ``B`` and ``W`` included): at ``B`` of ``(c, m, l)`` it takes the
    lowest free set of ``(c, l)`` (or opens one), at ``W`` it frees it.  Returns ``(assignment, peak)``:
    ``assignment[(c, m, l)]`` is the set index, ``peak[(c, l)]`` the number of sets ``(c, l)`` needs -- the peak
    number of that layer's microbatches between ``B`` and ``W`` (the plan's peak pending ``W`` per chunk), not the
    microbatch count.
    """
    free: dict[tuple[int, int], list[int]] = {}
    peak: dict[tuple[int, int], int] = {}
    held: dict[tuple[int, int, int], int] = {}
    assignment: dict[tuple[int, int, int], int] = {}
    for ev in events:
        key, slot = (ev.chunk, ev.layer), (ev.chunk, ev.microbatch, ev.layer)
        if ev.kind == "B":
            sets = free.setdefault(key, [])
            k = min(sets) if sets else peak.get(key, 0)
            if sets:
                sets.remove(k)
            else:
                peak[key] = k + 1
            held[slot] = assignment[slot] = k
        elif ev.kind == "W" and slot in held:
            free.setdefault(key, []).append(held.pop(slot))
    return assignment, peak


class WeightInputPool:
    """The buffers that carry a split layer's recorded gradients from its ``B`` to its ``W`` replay, one set per
    ``(chunk, layer, k)`` with ``k`` from :func:`pending_weight_sets`: microbatches whose ``B..W`` intervals do not
    overlap in the rank's order share a set, so the bytes held are bounded by the peak pending ``W``, not by the
    number of microbatches (issue 24).  Every slot of ``(chunk, layer)`` records the same tensors (same layer, same
    shapes), so the sets are interchangeable."""

    def __init__(self, assignment: dict[tuple[int, int, int], int]):
        self.assignment = assignment
        self.sets: dict[tuple[int, int, int], list] = {}

    def of(self, event: LayerEvent, recorded: Sequence) -> list:
        """The set of ``event``'s ``(chunk, microbatch, layer)``, allocated like ``recorded`` on first use
        (``None`` where nothing was recorded); not filled."""
        key = (event.chunk, event.layer, self.assignment[(event.chunk, event.microbatch, event.layer)])
        found = self.sets.get(key)
        if found is None:
            found = self.sets[key] = [None if r is None else tuple(None if g is None else torch.empty_like(g)
                                                                   for g in r) for r in recorded]
        return found

    @staticmethod
    def fill(statics: Sequence, recorded: Sequence) -> None:
        """Copy what one ``B`` recorded into its set (grad mode off: a plain copy, not differentiated)."""
        with torch.no_grad():
            for dst, src in zip(statics, recorded):
                for static, g in zip(dst or (), src or ()):
                    if static is not None:
                        static.zero_() if g is None else static.copy_(g)


def fire_post_accumulate_hooks(params: Sequence[torch.Tensor]) -> None:
    """Run each parameter's post-accumulate-grad hooks, as ``AccumulateGrad`` does after it wrote ``.grad``.

    A graph replay accumulates into the gradient buffers without autograd, so the hooks that data-parallel grad
    sync relies on (``engine.training.parallel.data_parallel.GradSync``, FSDP) would never run; the replay calls this instead.
    The hooks live in ``Tensor._post_accumulate_grad_hooks`` (filled by the public
    ``Tensor.register_post_accumulate_grad_hook``); the buffers' version counters are bumped first
    (``torch.autograd.graph.increment_version``), since a replay's writes bypass the dispatcher that would.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch.autograd.graph.increment_version(grads)
    for p in params:
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        for hook in list((hooks or {}).values()):
            hook(p)


@contextlib.contextmanager
def redirected_grads(params: Sequence[torch.Tensor], targets: Sequence[torch.Tensor | None] | None = None):
    """Run a backward whose ``AccumulateGrad`` writes into ``params``' ``.grad`` as a side effect -- a segment
    recomputed in the backward and backpropagated there (``engine.runtime.recompute``, Megatron's
    ``CheckpointFunction``) -- the way a graph replay runs it: each parameter's post-accumulate-grad hooks are
    silenced (a replay runs no Python; the slot fires them once, after the replay) and, with ``targets``, each
    ``.grad`` is ``targets[i]`` during the run (``None``: a fresh tensor) and is put back afterwards, so what
    was written into a target the caller no longer holds is lost, as a graph's write to an address captured
    earlier.  Yields the parameters whose ``.grad`` the run wrote (a new tensor or a version bump)."""
    saved_hooks = []
    for p in params:
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        saved_hooks.append(dict(hooks) if hooks else None)
        if hooks:
            hooks.clear()
    before = [p.grad for p in params]
    if targets is not None:
        for p, t in zip(params, targets):
            p.grad = t
    start = [(p.grad, None if p.grad is None else p.grad._version) for p in params]
    written: list[torch.Tensor] = []
    try:
        yield written
        written.extend(p for p, (g, v) in zip(params, start)
                       if p.grad is not g or (g is not None and g._version != v))
    finally:
        for p, hooks, g in zip(params, saved_hooks, before):
            if hooks:
                p._post_accumulate_grad_hooks.update(hooks)
            if targets is not None or any(p is w for w in written):
                p.grad = g


@dataclass(frozen=True)
class SlotOptions:
    """How slots return parameter gradients and what they check.

    ``param_grads``: ``"accumulate"`` (in-graph, into :class:`GradBuffers`), ``"clone"`` (a copy per replay) or
    ``"alias"`` (the static buffer itself; negative-control tests only, NVIDIA/TransformerEngine#2937).  ``generators``: registered with the
    graphs.  ``check_replays``: compare every emulated replay's trace with the capture's (``graphs.hazards``).
    ``defer_weight_grad``: split backward (``B`` and ``W`` graphs) -- called from a ``B`` replay with the ``W``
    callable; returns ``True`` if a split backward in progress queued it, ``False`` to have it run at once
    (``engine.runtime.split_backward.defer_weight_grad``); ``None`` for an unsplit backward.
    """

    param_grads: str = "accumulate"
    generators: tuple[torch.Generator, ...] = ()
    tracer: Any = None
    check_replays: bool = True
    defer_weight_grad: Callable[[Callable[[], None]], bool] | None = None


class ReplaySlot:
    """Static buffers and replay of one ``(chunk, microbatch, layer)`` forward/backward pair.

    Subclasses implement :meth:`capture_forward`, :meth:`capture_backward`, :meth:`replay_forward`,
    :meth:`replay_backward` and :meth:`release`, and for split backward (:attr:`splits`) :meth:`capture_weight`
    and :meth:`replay_weight`.  The backward computes two target groups, the input gradients
    (:attr:`input_targets`) and the parameter gradients (:attr:`params`); with split backward ``B`` computes the
    first and ``W`` the second, in a graph of its own.

    Args:
        event: the ``(chunk, microbatch, layer)`` this slot serves (``kind`` is ignored).
        forward_fn: the layer's original (eager) forward.
        module: the layer, for its parameters.
        spec: layout of the call.
        static_inputs: the static input tensors (sample arguments), one per tensor argument of ``spec``.
        options: :class:`SlotOptions`.
        grads: the per-parameter buffers (``options.param_grads == "accumulate"``), else ``None``.
    """

    def __init__(self, event: LayerEvent, forward_fn: Callable, module: torch.nn.Module, spec: CallSpec,
                 static_inputs: Sequence[torch.Tensor], options: SlotOptions = SlotOptions(),
                 grads: GradBuffers | None = None):
        self.event, self.forward_fn, self.module, self.spec, self.options = event, forward_fn, module, spec, options
        self.where = describe(module, event.chunk, event.layer) + f" microbatch {event.microbatch}"
        self.params = module_params(module)
        self.static_inputs = list(static_inputs)
        self.input_needs_grad = [t.requires_grad for t in self.static_inputs]
        self.grads = grads
        self.accumulate: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, buffer) that receive a gradient
        self.side_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # those of side_params (set with the buffers)
        self._grad_params: list[torch.Tensor] = []  # noted in warmup, their buffers allocated after it
        self.side_params: tuple[torch.Tensor, ...] = ()  # .grad written inside the backward (noted in warmup)
        self.static_outputs: list[torch.Tensor] = []
        self.out_struct: Any = None
        self.diff_outputs: list[bool] = []
        self.static_grad_outputs: list[torch.Tensor] = []
        self.static_grad_inputs: list[torch.Tensor | None] = []  # per grad target (inputs needing grad[, params])
        self.prev: ReplaySlot | None = None  # layer l-1 / l+1 of the same (chunk, microbatch)
        self.next: ReplaySlot | None = None
        self.chained_input = False
        self.autocast = AutocastState()
        self.guard = None  # a graphs.dispatch.ReplayGuard checking backward passes (set by GraphedLayers)
        self.backward_event = event  # the backward pass of the current call (set by the dispatcher)
        self.replays = 0
        self.splits = options.defer_weight_grad is not None
        self.autograd_params = self._autograd_params()
        self.split: layer_split.LayerSplit | None = None  # the cut of the layer's graph (split backward)
        self.static_weight_inputs: list = []  # per intermediate: the gradients B records for W (split backward)
        self.weight_pool: WeightInputPool | None = None  # emulate: the shared sets of W inputs (split backward)
        at = f"{event.microbatch}.{event.chunk} l{event.layer}"  # the action's notation, then the layer
        self._labels = (f"replay F{at}", f"replay B{at}", f"replay W{at}")

    def _autograd_params(self) -> tuple[torch.Tensor, ...]:
        """The tensors the autograd function takes besides the call's: the parameters only where their gradients
        pass through autograd (``clone`` / ``alias``).  Accumulated in the graph (``accumulate``, split ``W``),
        they are no inputs: no ``AccumulateGrad`` node is reached, and the backward runs the post-accumulate-grad
        hooks itself (:func:`fire_post_accumulate_hooks`).  A layer none of whose inputs needs a gradient then
        gets one zero-size leaf (never given a gradient), so that its outputs still require grad and its
        backward runs."""
        if self.options.param_grads != "accumulate" and not self.splits:
            return tuple(self.params)
        if any(self.input_needs_grad) or not self.params:
            return ()
        return (torch.zeros(0, requires_grad=True),)

    # -- subclass interface ---------------------------------------------------------------------------------
    def capture_forward(self) -> None: raise NotImplementedError
    def capture_backward(self) -> None: raise NotImplementedError
    def replay_forward(self) -> None: raise NotImplementedError
    def replay_backward(self) -> None: raise NotImplementedError
    def capture_weight(self) -> None: raise NotImplementedError
    def replay_weight(self) -> None: raise NotImplementedError
    def release(self) -> None: raise NotImplementedError

    # -- helpers for subclasses -----------------------------------------------------------------------------
    @property
    def input_targets(self) -> list[torch.Tensor]:
        return [t for t, g in zip(self.static_inputs, self.input_needs_grad) if g]

    @property
    def grad_targets(self) -> list[torch.Tensor]:
        """Tensors whose gradient a backward computes: inputs that need grad, then the parameters."""
        return self.input_targets + list(self.params)

    def run_eager(self, check: HazardCheck | None = None) -> list[torch.Tensor]:
        """The layer's eager forward on the static inputs, with autograd (under ``check`` if given), with no
        Python-level torch-function mode active (the executor's weight-gradient deferral around a split-backward
        forward): what a graph captures, and what its replay runs, is the layer's own ops (``torch._C``'s switch,
        as no public one exists)."""
        args, kwargs = self.spec.rebuild(self.static_inputs)
        with torch.enable_grad(), torch._C.DisableTorchFunction(), (check if check is not None else _NULL):
            outs, struct = flatten_outputs(self.forward_fn(*args, **kwargs))
        self.out_struct = struct
        return outs

    def hazard_check(self) -> HazardCheck:
        """A fresh :class:`graphs.hazards.HazardCheck` for one call of this slot's layer."""
        return HazardCheck(self.where, self.options.generators, storage_names(self.module, self.static_inputs))

    def eager_backward(self, outs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                       retain_graph: bool = False):
        """Gradients of the grad targets for ``outs`` (only differentiable ones) seeded with ``grad_outputs``."""
        diff = [o for o, d in zip(outs, self.diff_outputs) if d]
        if not diff:
            return [None] * len(self.grad_targets)
        return torch.autograd.grad(diff, self.grad_targets, list(grad_outputs), retain_graph=retain_graph,
                                   allow_unused=True)

    def split_grads(self, grads) -> tuple[list, list]:
        """``(input grads, param grads)`` of an :meth:`eager_backward` result."""
        n = sum(self.input_needs_grad)
        return list(grads[:n]), list(grads[n:])

    def split_input_grads(self, outs: Sequence[torch.Tensor]) -> tuple[list, list]:
        """Split ``B`` on ``outs`` (this call's outputs): cut the graph, then ``(input grads, recorded)``
        (:func:`graphs.backends.split.input_grads`) seeded with the static grad-outputs."""
        diff = [o for o, d in zip(outs, self.diff_outputs) if d]
        self.split = layer_split.analyze(diff, self.input_targets)
        return layer_split.input_grads(self.split, diff, self.static_grad_outputs, self.input_targets)

    def split_weight_grads(self, outs: Sequence[torch.Tensor], recorded: Sequence) -> list:
        """Split ``W``: per parameter its gradient from ``recorded`` (:func:`graphs.backends.split.weight_grads`)."""
        diff = [o for o, d in zip(outs, self.diff_outputs) if d]
        return layer_split.weight_grads(self.split, recorded, diff, self.static_grad_outputs, self.params)

    def accumulate_param_grads(self, param_grads, bypass_version: bool = False) -> None:
        """Add each parameter's gradient into its buffer (grad mode off; inside the ``W`` graph on CUDA).
        ``bypass_version``: write through ``.data`` (no version bump), as a graph replay writes (emulate)."""
        buffers = {id(p): (buf.data if bypass_version else buf) for p, buf in self.accumulate}
        with torch.no_grad():
            for p, g in zip(self.params, param_grads):
                if g is not None and id(p) in buffers:
                    buffers[id(p)].add_(g)

    def run_weight(self, event: LayerEvent) -> None:
        """The ``W`` of this slot's current microbatch: check the order, install the buffers as ``.grad``,
        replay the ``W`` graph."""
        if self.guard is not None:
            self.guard.expect(event)
        with self.span(2):
            with torch.no_grad():
                GradBuffers.attach(self.accumulate)
            self.replay_weight()
        fire_post_accumulate_hooks([p for p, _ in self.accumulate])  # grad sync sees each W, as in eager

    def note_param_grads(self, param_grads, written: Sequence[torch.Tensor] = ()) -> None:
        """In warmup: which parameters receive a gradient (only those get a buffer installed as ``.grad``) --
        returned by the backward, or ``written`` into ``.grad`` inside it (:attr:`side_params`: a recomputed
        segment backpropagated in the layer's backward; the capture and every replay of the backward then run
        with their buffers installed as ``.grad``, so the graph writes into the buffers).  The buffers are
        allocated later, by :meth:`allocate_grad_buffers` on the caller's stream.

        Raises :class:`CaptureError` for written parameters when gradients are not accumulated into buffers
        (``param_grads`` ``"clone"`` / ``"alias"``)."""
        side = {id(p) for p in (*self.side_params, *written)}
        if side and self.grads is None:
            raise CaptureError(f"{self.where}: its backward accumulates into parameters' .grad itself (activation "
                               f"recomputation); graphs capture that only with param_grads='accumulate', not "
                               f"{self.options.param_grads!r}")
        self.side_params = tuple(p for p in self.params if id(p) in side)
        self._grad_params = [p for p, g in zip(self.params, param_grads) if g is not None or id(p) in side]

    def capturing_side_writes(self):
        """Around a backward capture: :attr:`side_params` get their buffers as ``.grad`` (the graph writes there)
        and their hooks silenced (:func:`redirected_grads`)."""
        GradBuffers.attach(self.side_pairs)
        return redirected_grads([p for p, _ in self.side_pairs])

    def allocate_grad_buffers(self) -> None:
        """After warmup, on the caller's stream (the one that replays and reads them): the per-parameter buffers
        (:attr:`accumulate`; :attr:`side_pairs`, those of :attr:`side_params`, installed as ``.grad`` before the
        backward's capture and each of its replays).  Allocated on the warmup side stream instead, their blocks
        would belong to that stream, and the caching allocator could hand them out again there while the default
        stream still uses them (``record_stream``)."""
        if self.grads is not None:
            self.accumulate = [(p, self.grads.of(p)) for p in self._grad_params]
            side = {id(p) for p in self.side_params}
            self.side_pairs = [(p, buf) for p, buf in self.accumulate if id(p) in side]

    # -- chained buffers ------------------------------------------------------------------------------------
    def chain_input(self) -> None:
        """Before forward capture: take layer ``l-1``'s static output as this layer's first static input."""
        prev, args = self.prev, self.spec.args
        if prev is None or len(prev.static_outputs) != 1 or not args or not isinstance(args[0], TensorSpec):
            return
        out, want = prev.static_outputs[0], args[0]
        if (tuple(out.shape), out.dtype, out.device) != (want.shape, want.dtype, want.device) or \
                prev.diff_outputs[0] != want.requires_grad or not out.is_contiguous():
            return
        self.static_inputs[0] = out.detach().requires_grad_(want.requires_grad)
        self.chained_input = True

    def chained_grad_output(self) -> torch.Tensor | None:
        """Before backward capture: layer ``l+1``'s static input gradient, if it can be this grad-output."""
        nxt = self.next
        if nxt is None or not nxt.chained_input or not nxt.input_needs_grad[0] or self.diff_outputs != [True]:
            return None
        return nxt.static_grad_inputs[0]

    # -- the call the dispatcher makes ----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        tensors = self.spec.flatten(args, kwargs) if kwargs or len(args) != len(self.static_inputs) else args
        outs = _GraphedPass.apply(self, *tensors, *self.autograd_params)
        return outs[0] if self.out_struct is None else self.out_struct(outs)

    def load_inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        first, static = tensors[0], self.static_inputs[0]
        if self.chained_input and (first.data_ptr() != static.data_ptr() or first.stride() != static.stride()):
            raise RuntimeError(
                f"{self.where}: its input is not layer {self.event.layer - 1}'s output, but the graphs chain static "
                f"buffers between consecutive layers (layer l reads layer l-1's static output in place); call the "
                f"layers in sequence on each other's outputs, or capture with chain_layers=False")
        _load(self.static_inputs, tensors)

    def span(self, which: int):
        tracer = self.options.tracer
        return tracer.span("graph", self._labels[which]) if tracer is not None else _NULL


def _load(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """Copy ``src`` into ``dst`` except where a source already is its destination (same address and strides).
    Called inside :class:`_GraphedPass` (grad mode off: no ``no_grad`` context on the hot path)."""
    for d, s in zip(dst, src):
        if s is None or d is s or (d.data_ptr() == s.data_ptr() and d.stride() == s.stride()):
            continue
        d.copy_(s)


class _GraphedPass(torch.autograd.Function):
    """Forward = copy inputs in, replay the forward graph; backward = copy grads in, replay the backward graph."""

    @staticmethod
    def forward(ctx, slot: ReplaySlot, *tensors):
        with slot.span(0):
            slot.load_inputs(tensors[:len(slot.static_inputs)])
            slot.replay_forward()
        slot.replays += 1
        ctx.slot, ctx.event = slot, slot.backward_event
        outs = tuple(o.detach() for o in slot.static_outputs)
        if not all(slot.diff_outputs):
            ctx.mark_non_differentiable(*[o for o, d in zip(outs, slot.diff_outputs) if not d])
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        slot: ReplaySlot = ctx.slot
        if slot.guard is not None:
            slot.guard.expect(ctx.event)
        with slot.span(1):
            GradBuffers.attach(slot.side_pairs if slot.splits else slot.accumulate)
            _load(slot.static_grad_outputs, grads if all(slot.diff_outputs) else
                  [g for g, d in zip(grads, slot.diff_outputs) if d])
            slot.replay_backward()
        if not slot.splits and slot.accumulate:  # explicitly: no AccumulateGrad node runs for these parameters
            fire_post_accumulate_hooks([p for p, _ in slot.accumulate])
        if slot.splits:
            ev = ctx.event
            weight = (lambda: slot.run_weight(LayerEvent("W", ev.chunk, ev.microbatch, ev.layer)))
            if not slot.options.defer_weight_grad(weight):
                weight()  # no split backward in progress: W right after B
        return (None, *_backward_results(slot))


def _backward_results(slot: ReplaySlot) -> list[torch.Tensor | None]:
    """What autograd receives: input-gradient aliases, then per parameter ``None`` (accumulated in the graph), a
    clone, or the static buffer itself (``alias``, negative controls)."""
    n_in = sum(slot.input_needs_grad)
    in_grads = iter(slot.static_grad_inputs[:n_in])
    out: list[torch.Tensor | None] = []
    for needs in slot.input_needs_grad:
        g = next(in_grads) if needs else None
        out.append(None if g is None else g.detach())
    mode = slot.options.param_grads
    if mode == "accumulate" or slot.splits:  # the parameters are no inputs of the autograd function
        return out + [None] * len(slot.autograd_params)
    for g in slot.static_grad_inputs[n_in:]:
        out.append(None if g is None else (g.clone() if mode == "clone" else g.detach()))
    return out


def walk_capture(events: Sequence[LayerEvent], slot_of: Callable[[LayerEvent], ReplaySlot],
                 num_warmup_iters: int, warmup_ctx: Callable[[], Any], capture_fwd: Callable[[ReplaySlot], None],
                 capture_bwd: Callable[[ReplaySlot], None],
                 capture_wgt: Callable[[ReplaySlot], None] | None = None, tracker=None) -> None:
    """Warm up, then capture, every slot by walking ``events`` (the rank's per-layer order).

    Warmup runs each forward eagerly on the slot's static inputs under a :class:`graphs.hazards.HazardCheck` (a
    host sync or an unregistered generator raises :class:`graphs.hazards.HazardError` naming the layer and op,
    before any capture) and each backward with zero grad-outputs through ``torch.autograd.grad`` (it never touches
    ``.grad``), ``max(1, num_warmup_iters)`` times, inside ``warmup_ctx()`` (a side stream on CUDA).  Capture then
    calls ``capture_fwd`` / ``capture_bwd`` / ``capture_wgt`` (split backward's ``W`` events) in exactly the order
    of ``events``, so every slot's buffers are allocated where the runtime will need them (the pool's liveness rule, :mod:`graphs.liveness`).
    ``tracker`` (a :class:`graphs.accounting.LiveBytes`, ``per_op=False``), if given, follows the capture (not the
    warmup) and is sampled after every event: the emulate backend's model of the graph pool.
    """
    with warmup_ctx():
        for _ in range(max(1, num_warmup_iters)):
            _warmup_round(events, slot_of)
    for ev in events:  # back on the caller's stream
        if ev.kind == "F":
            slot_of(ev).allocate_grad_buffers()
    capturers = {"F": capture_fwd, "B": capture_bwd, "W": capture_wgt}
    with tracker if tracker is not None else _NULL:
        for ev in events:
            capturers[ev.kind](slot_of(ev))
            if tracker is not None:
                tracker.sample()


def _warmup_round(events: Sequence[LayerEvent], slot_of: Callable[[LayerEvent], ReplaySlot]) -> None:
    live: dict[tuple[int, int, int], list[torch.Tensor]] = {}
    for ev in events:
        slot = slot_of(ev)
        key = (ev.chunk, ev.microbatch, ev.layer)
        if ev.kind == "F":
            live[key] = slot.run_eager(slot.hazard_check())
            slot.diff_outputs = [o.requires_grad for o in live[key]]
        elif ev.kind == "B":  # the full backward (it touches every kernel B and W use); W: nothing left to warm
            outs = live.pop(key)
            zeros = [torch.zeros_like(o) for o, d in zip(outs, slot.diff_outputs) if d]
            with redirected_grads(slot.params) as written:  # written .grad is put back: zeros were added
                grads = slot.eager_backward(outs, zeros)
            slot.note_param_grads(slot.split_grads(grads)[1], written)
