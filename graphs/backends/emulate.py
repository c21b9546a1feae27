"""``emulate``: a CPU (any device) backend with the static-buffer semantics of a CUDA graph.

Each ``(chunk, microbatch, layer)`` slot owns fixed input, output, grad-output and grad-input tensors.  A forward
"replay" copies the call's tensors into the static inputs, re-runs the layer eagerly on them and writes the result
into the *same* static output tensors; the autograd graph it builds replaces the slot's previous one, exactly as a
real replay overwrites the activations saved in the graph's memory.  A backward "replay" differentiates the slot's
current graph and writes into the same static grad-input tensors.  So every buffer-lifetime mistake a real graph
would make (one graph shared by microbatches that are in flight together, a gradient aliasing a static buffer kept
past the next replay) gives wrong numbers here too, and CPU tests catch it (``shared/spec/cuda_graphs.md`` 5.1.5).
"""
from __future__ import annotations

import contextlib

import torch

from .common import ReplaySlot

__all__ = ["EmulatedSlot", "warmup_context"]


class EmulatedSlot(ReplaySlot):
    """One emulated graph pair."""

    _live: list[torch.Tensor] | None = None

    def capture_forward(self) -> None:
        outs = self.run_eager()
        self.diff_outputs = [o.requires_grad for o in outs]
        self.static_outputs = [o.detach().clone() for o in outs]
        self._live = outs

    def capture_backward(self) -> None:
        self.static_grad_outputs = [torch.zeros_like(o) for o, d in zip(self.static_outputs, self.diff_outputs)
                                    if d]
        grads = self.eager_backward(self._live, self.static_grad_outputs, retain_graph=True)
        self.static_grad_inputs = [None if g is None else g.detach().clone() for g in grads]
        self._live = None  # a captured graph keeps no activations between its capture and its first replay

    def replay_forward(self) -> None:
        outs = self.run_eager()
        with torch.no_grad():
            for static, out in zip(self.static_outputs, outs):
                static.copy_(out)
        self._live = outs

    def replay_backward(self) -> None:
        if self._live is None:
            raise RuntimeError(f"backward replay of {self.event.chunk, self.event.microbatch, self.event.layer} "
                               f"without a forward replay of that slot in this step")
        # retain_graph: a real backward graph can be replayed again over the same saved activations
        grads = self.eager_backward(self._live, self.static_grad_outputs, retain_graph=True)
        with torch.no_grad():
            for static, g in zip(self.static_grad_inputs, grads):
                if static is None:
                    continue
                if g is None:
                    static.zero_()
                else:
                    static.copy_(g)

    def release(self) -> None:
        self._live = None
        self.static_outputs = []
        self.static_grad_outputs = []
        self.static_grad_inputs = []


def warmup_context():
    return contextlib.nullcontext()
