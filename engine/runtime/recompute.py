"""Activation recomputation that splits exactly under every schedule: keep a segment's inputs, recompute it in B.

:func:`recompute` runs ``function(*args)`` without keeping its activations -- only the tensor arguments are saved
(``[s, b, h]`` for a decoder layer) -- and runs it again in the backward to backpropagate through it (Chen et al.,
2016, "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174; Megatron-Core's
``tensor_parallel.checkpoint``).  :func:`apply_recompute` marks modules so that each call runs through it:

* **full** recomputation marks each decoder layer: a microbatch keeps one layer input per layer;
* **selective** recomputation marks each layer's attention core (the scores, softmax, dropout and weighted sum of
  values: the part whose activations grow with ``s^2`` and cost little to recompute; Korthikanti et al., 2022,
  "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198, sec. 5): the core keeps its
  ``q``, ``k``, ``v`` inputs, the rest of the layer keeps what it keeps without recomputation;
* **partial recomputation by microbatch** (Megatron's ``num_microbatches_with_partial_activation_checkpoints``):
  the schedules pass ``checkpoint_activations_microbatch`` to each forward; marked modules recompute when it is
  True and keep their activations when it is False (:data:`engine.runtime.step.recompute_microbatch`).

Exactness: the recomputed forward runs with the random-number state and the autocast state of the first one, so
it produces the same values bit for bit, and every parameter's gradient of a microbatch is computed from the same
operands by the same kernels as without recomputation and accumulated once (fp32: no gradient bit changes; the
tests check it under 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV).  Under split backward the recomputed
forward runs in B, under the layer-level deferral again when the first forward ran under it, and W keeps only what
its weight gradients need (:func:`engine.runtime.split_backward.segment_backward`): in layer mode each deferred
op's input and output gradient, nothing else of the recomputed segment.

Not covered: a parameter shared by two recomputed segments of one microbatch (each segment accumulates its part
separately: equal up to rounding, not bitwise); tensors passed by keyword to a marked module (kept alive by the
call, not counted as saved); outputs other than a tensor or a tuple / list of tensors and other values.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterable

import torch
from torch import nn

from . import split_backward
from .step import recompute_microbatch

__all__ = ["GRANULARITIES", "recompute", "apply_recompute", "remove_recompute", "recomputed_modules"]

GRANULARITIES = ("none", "full", "selective")
"""What a model recomputes: nothing, each decoder layer from its input, or each layer's attention core."""


class _Recompute(torch.autograd.Function):
    """``function(*args)`` run without a graph; its backward runs it again and backpropagates (module doc)."""

    @staticmethod
    def forward(ctx, function, anchor, *args):
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.function, ctx.slots, ctx.state = function, slots, _State(args)
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in slots))
        with torch.no_grad():
            out = function(*args)
        flat, _ = _flatten(out)
        ctx.mark_non_differentiable(*(t for t in flat if not t.is_floating_point()))
        return tuple(flat)

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        inputs = []
        for i, saved in zip(ctx.slots, ctx.saved_tensors):
            x = saved.detach().requires_grad_(ctx.needs_input_grad[2 + i])
            args[i] = x
            if x.requires_grad:
                inputs.append((i, x))
        with ctx.state.replay(), torch.enable_grad():
            flat, _ = _flatten(ctx.function(*args))
        pairs = [(o, g) for o, g in zip(flat, grads) if g is not None and o.requires_grad]
        got = split_backward.segment_backward([o for o, _ in pairs], [g for _, g in pairs],
                                              [x for _, x in inputs]) if pairs else [None] * len(inputs)
        out = [None] * (2 + len(args))
        for (i, _), g in zip(inputs, got):
            out[2 + i] = g
        return tuple(out)


def _flatten(out) -> tuple[list, Callable]:
    """The tensors of a segment's output and a function rebuilding the output from them (a tensor, or a tuple /
    list whose tensors are replaced in order)."""
    if isinstance(out, torch.Tensor):
        return [out], lambda flat: flat[0]
    if isinstance(out, (tuple, list)):
        at = [i for i, o in enumerate(out) if isinstance(o, torch.Tensor)]

        def rebuild(flat, out=out, at=at):
            items = list(out)
            for i, t in zip(at, flat):
                items[i] = t
            return type(out)(items)
        return [out[i] for i in at], rebuild
    raise TypeError(f"recompute: the function returned {type(out).__name__}; a recomputed segment returns a tensor "
                    "or a tuple / list holding tensors")


class _State:
    """What the first forward ran under and the recomputation must run under again: the CPU (and, for CUDA
    arguments, device) random-number state, autocast, the layer-level weight-gradient deferral."""

    __slots__ = ("cpu_rng", "devices", "device_rng", "device_type", "autocast", "defer")

    def __init__(self, args) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.device_type = tensors[0].device.type if tensors else "cpu"
        self.cpu_rng = torch.get_rng_state()
        self.devices, self.device_rng = torch.utils.checkpoint.get_device_states(*tensors)
        dt = self.device_type
        self.autocast = (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt), torch.is_autocast_cache_enabled())
        self.defer = split_backward.deferring()

    def replay(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.random.fork_rng(devices=self.devices, device_type=self.device_type
                                                  if self.devices else "cuda"))
        torch.set_rng_state(self.cpu_rng)
        if self.devices:
            torch.utils.checkpoint.set_device_states(self.devices, self.device_rng, device_type=self.device_type)
        enabled, dtype, cache = self.autocast
        stack.enter_context(torch.autocast(self.device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
        if self.defer:
            stack.enter_context(split_backward.weight_grad_deferral())
        return stack


def recompute(function: Callable, *args, grad_without_inputs: bool = True):
    """``function(*args)``, keeping only the tensors in ``args`` for the backward, which runs it again.

    ``args``: tensors (e.g. a layer input ``[s, b, h]``) and other values, passed positionally; the output is a
    tensor or a tuple / list holding tensors.  Without grad mode the function just runs.  When no tensor argument
    requires grad but ``function`` has parameters that do (the first layer on the first stage of a model whose
    embedding is frozen, or data fed in directly), ``grad_without_inputs`` (default) ties the output to the graph
    through a 0-dim anchor so those parameters still get their gradients; pass False for a function without
    trainable parameters.

    Raises ``TypeError`` for an output of another kind, and what ``function`` raises.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    needs_anchor = grad_without_inputs and not any(t.requires_grad for t in tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    anchor = split_backward._anchor(device) if needs_anchor else None
    holder = []

    def run(*a):
        out = function(*a)
        if not holder:
            holder.append(_flatten(out)[1])
        return out
    flat = _Recompute.apply(run, anchor, *args)
    return holder[0](list(flat))


class _Marked:
    """The ``forward`` of a module marked by :func:`apply_recompute` (an instance attribute over the class's)."""

    def __init__(self, module: nn.Module) -> None:
        self.forward = module.forward  # the bound forward of the class
        self.trainable = any(p.requires_grad for p in module.parameters())

    def __call__(self, *args, **kwargs):
        if recompute_microbatch[0] is False or not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        fn = functools.partial(self.forward, **kwargs) if kwargs else self.forward
        return recompute(fn, *args, grad_without_inputs=self.trainable)


def apply_recompute(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Recompute every call of each of ``modules`` in the backward (module doc): its forward's tensor arguments are
    kept, nothing inside.  Pass each decoder layer for full recomputation, each attention core for selective; the
    modules' names, parameters and state dicts do not change.  A module already marked stays marked once.  Returns
    the modules marked.  Raises ``TypeError`` for something that is not a module."""
    out = []
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"apply_recompute: expected torch.nn.Module objects, got {type(m).__name__}")
        if not isinstance(m.__dict__.get("forward"), _Marked):
            m.forward = _Marked(m)
        out.append(m)
    return out


def remove_recompute(modules: Iterable[nn.Module]) -> None:
    """Undo :func:`apply_recompute` on ``modules`` (those not marked are left alone)."""
    for m in modules:
        if isinstance(m.__dict__.get("forward"), _Marked):
            del m.forward


def recomputed_modules(root: nn.Module) -> list[nn.Module]:
    """The modules under ``root`` (itself included) marked by :func:`apply_recompute`, in ``modules()`` order."""
    return [m for m in root.modules() if isinstance(m.__dict__.get("forward"), _Marked)]
