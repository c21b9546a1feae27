"""What the ``torch`` and ``emulate`` backends share: one replay slot per ``(chunk, microbatch, layer)``, the
autograd function that replays it, and the walk that warms up and captures slots in the rank's order.

Static-buffer semantics (``shared/spec/cuda_graphs.md`` 1.4, 3.3), identical in both backends:

* a forward replay copies the call's tensors into the slot's static inputs (skipped when the address is already
  the static input's) and writes the outputs into the slot's static outputs; the caller gets detached aliases of
  them, valid until this slot replays again;
* a backward replay copies the incoming gradients into the slot's static grad-outputs and writes the gradients of
  the inputs and parameters into the slot's static grad-inputs; input gradients are returned as aliases, parameter
  gradients as clones (``clone_param_grads=True``), so autograd never installs a static buffer as ``param.grad``
  (pytorch#181723, TE PR #2937, ``cases/public_bugs.md`` B17).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

from ..order import LayerEvent
from ..specs import CallSpec, flatten_outputs, unflatten_outputs

__all__ = ["ReplaySlot", "walk_capture", "module_params", "check_capturable", "CaptureError"]

_NULL = contextlib.nullcontext()


class CaptureError(RuntimeError):
    """Capture cannot proceed (a module or argument breaks a requirement of graph capture)."""


def module_params(module: torch.nn.Module) -> tuple[torch.nn.Parameter, ...]:
    """The parameters that receive gradients, in ``module.parameters()`` order (the order of the grad slots)."""
    return tuple(p for p in module.parameters() if p.requires_grad)


def check_capturable(module: torch.nn.Module, where: str) -> None:
    """Graph capture needs a module in training mode, without module hooks (they would be frozen or skipped) and
    without buffers that require grad (TE and torch impose the same, spec 1.6).

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


class ReplaySlot:
    """Static buffers and replay of one ``(chunk, microbatch, layer)`` forward/backward pair.

    Subclasses implement :meth:`capture_forward`, :meth:`capture_backward`, :meth:`replay_forward`,
    :meth:`replay_backward` and :meth:`release`.

    Args:
        event: the ``(chunk, microbatch, layer)`` this slot serves (``kind`` is ignored).
        forward_fn: the layer's original (eager) forward.
        module: the layer, for its parameters.
        spec: layout of the call; :attr:`static_inputs` are made from it.
        static_inputs: the static input tensors (sample arguments), one per tensor argument of ``spec``.
        clone_param_grads: return parameter gradients as clones (safe) or as static aliases (only for the
            negative-control tests of B17).
        tracer: receives a ``"graph"`` span around every replay.
    """

    def __init__(self, event: LayerEvent, forward_fn: Callable, module: torch.nn.Module, spec: CallSpec,
                 static_inputs: Sequence[torch.Tensor], clone_param_grads: bool = True, tracer=None):
        self.event = event
        self.forward_fn = forward_fn
        self.spec = spec
        self.params = module_params(module)
        self.static_inputs = list(static_inputs)
        self.input_needs_grad = [t.requires_grad for t in self.static_inputs]
        self.clone_param_grads = clone_param_grads
        self.tracer = tracer
        self.static_outputs: list[torch.Tensor] = []
        self.out_struct: Any = None
        self.diff_outputs: list[bool] = []
        self.static_grad_outputs: list[torch.Tensor] = []
        self.static_grad_inputs: list[torch.Tensor | None] = []  # per grad target (inputs needing grad, params)
        self.replays = 0
        label = f"c{event.chunk} mb{event.microbatch} l{event.layer}"
        self._labels = (f"replay F {label}", f"replay B {label}")

    # -- subclass interface ---------------------------------------------------------------------------------
    def capture_forward(self) -> None: raise NotImplementedError
    def capture_backward(self) -> None: raise NotImplementedError
    def replay_forward(self) -> None: raise NotImplementedError
    def replay_backward(self) -> None: raise NotImplementedError
    def release(self) -> None: raise NotImplementedError

    # -- helpers for subclasses -----------------------------------------------------------------------------
    @property
    def grad_targets(self) -> list[torch.Tensor]:
        """Tensors whose gradient a backward computes: inputs that need grad, then the parameters."""
        return [t for t, g in zip(self.static_inputs, self.input_needs_grad) if g] + list(self.params)

    def run_eager(self) -> list[torch.Tensor]:
        """The layer's eager forward on the static inputs, with autograd; returns the flat outputs."""
        args, kwargs = self.spec.rebuild(self.static_inputs)
        with torch.enable_grad():
            outs, struct = flatten_outputs(self.forward_fn(*args, **kwargs))
        self.out_struct = struct
        return outs

    def eager_backward(self, outs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                       retain_graph: bool = False):
        """Gradients of the grad targets for ``outs`` (only differentiable ones) seeded with ``grad_outputs``."""
        diff = [o for o, d in zip(outs, self.diff_outputs) if d]
        if not diff:
            return [None] * len(self.grad_targets)
        return torch.autograd.grad(diff, self.grad_targets, list(grad_outputs), retain_graph=retain_graph,
                                   allow_unused=True)

    # -- the call the dispatcher makes ----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        tensors = self.spec.flatten(args, kwargs)
        outs = _GraphedPass.apply(self, *tensors, *self.params)
        return unflatten_outputs(list(outs), self.out_struct)

    def _load(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for d, s in zip(dst, src):
                if s is None or d is s:
                    continue
                if d.data_ptr() == s.data_ptr() and d.stride() == s.stride():
                    continue  # already in place (e.g. the previous layer's static output)
                d.copy_(s)

    def span(self, which: int):
        return self.tracer.span("graph", self._labels[which]) if self.tracer is not None else _NULL


class _GraphedPass(torch.autograd.Function):
    """Forward = copy inputs in, replay the forward graph; backward = copy grads in, replay the backward graph."""

    @staticmethod
    def forward(ctx, slot: ReplaySlot, *tensors):
        n_inputs = len(slot.static_inputs)
        with slot.span(0):
            slot._load(slot.static_inputs, tensors[:n_inputs])
            slot.replay_forward()
        slot.replays += 1
        ctx.slot = slot
        outs = tuple(o.detach() for o in slot.static_outputs)
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, slot.diff_outputs) if not d])
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        slot: ReplaySlot = ctx.slot
        diff_grads = [g for g, d in zip(grads, slot.diff_outputs) if d]
        with slot.span(1):
            slot._load(slot.static_grad_outputs, diff_grads)
            slot.replay_backward()
        n_in = sum(slot.input_needs_grad)
        in_grads = iter(slot.static_grad_inputs[:n_in])
        out: list[torch.Tensor | None] = [None]  # for ``slot``
        for needs in slot.input_needs_grad:
            g = next(in_grads) if needs else None
            out.append(None if g is None else g.detach())
        for g in slot.static_grad_inputs[n_in:]:
            if g is None:
                out.append(None)
            else:
                out.append(g.clone() if slot.clone_param_grads else g.detach())
        return tuple(out)


def walk_capture(events: Sequence[LayerEvent], slot_of: Callable[[LayerEvent], ReplaySlot],
                 num_warmup_iters: int, warmup_ctx: Callable[[], Any], capture_fwd: Callable[[ReplaySlot], None],
                 capture_bwd: Callable[[ReplaySlot], None]) -> None:
    """Warm up, then capture, every slot by walking ``events`` (the rank's per-layer order).

    Warmup runs each forward eagerly on the slot's static inputs and each backward with zero grad-outputs through
    ``torch.autograd.grad`` (it never touches ``.grad``), ``num_warmup_iters`` times, inside ``warmup_ctx()``
    (a side stream on CUDA).  Capture then calls ``capture_fwd`` / ``capture_bwd`` in exactly the order of
    ``events``, so every slot's buffers are allocated where the runtime will need them (invariant I1).
    """
    with warmup_ctx():
        for _ in range(num_warmup_iters):
            live: dict[tuple[int, int, int], list[torch.Tensor]] = {}
            for ev in events:
                slot = slot_of(ev)
                key = (ev.chunk, ev.microbatch, ev.layer)
                if ev.kind == "F":
                    live[key] = slot.run_eager()
                    if not slot.diff_outputs:
                        slot.diff_outputs = [o.requires_grad for o in live[key]]
                else:
                    outs = live.pop(key)
                    zeros = [torch.zeros_like(o) for o, d in zip(outs, slot.diff_outputs) if d]
                    slot.eager_backward(outs, zeros)
    for ev in events:
        slot = slot_of(ev)
        (capture_fwd if ev.kind == "F" else capture_bwd)(slot)
