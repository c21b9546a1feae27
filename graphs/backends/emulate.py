"""``emulate``: a CPU (any device) backend with the static-buffer semantics of a CUDA graph.

Each ``(chunk, microbatch, layer)`` slot owns fixed input, output, grad-output and grad-input tensors (chained
between consecutive layers like the ``torch`` backend's) and accumulates parameter gradients into the same
per-parameter buffers.  A forward "replay" copies the call's tensors into the static inputs, re-runs the layer
eagerly on them and writes the result into the *same* static output tensors; the autograd graph it builds replaces
the slot's previous one, exactly as a real replay overwrites the activations saved in the graph's memory.  A
backward "replay" differentiates the slot's current graph and writes into the same static grad-input tensors.  So
every buffer-lifetime mistake a real graph would make gives wrong numbers here too, on
CPU.

What a real replay freezes, the emulation enforces instead of silently re-running Python:

* replays run under the *captured* autocast state with the cast cache off (a graph recasts weights on every
  replay; a caller's cached autocast would reuse stale casts);
* every replay runs under :class:`graphs.hazards.HazardCheck` and must repeat the capture's trace: the same ops
  and scalar arguments (no Python-state branches) and no tensor read from storage the capture did not see
  (parameters replaced by ``p.data = ...`` / ``load_state_dict(assign=True)``, rebound closure tensors);
* host syncs and unregistered generators raise already in the warmup (``graphs.backends.common.walk_capture``);
* Python-level torch-function modes (the executor's weight-gradient deferral around a split-backward forward) do
  not reach a replayed forward (``ReplaySlot.run_eager``), as no Python runs in a real replay.

Split backward: a ``B`` replay writes the input gradients *and* the gradients recorded at the layer's intermediates
into the slot's own static buffers (``static_weight_inputs``, fixed tensors overwritten by every ``B`` replay of
that slot); a ``W`` replay reads those buffers -- not the live autograd values -- so a ``W`` that read another
microbatch's buffers would give wrong gradients here as on a GPU.
"""
from __future__ import annotations

import contextlib

import torch

from ..hazards import CallTrace
from ..specs import autocast_context
from .common import ReplaySlot, WeightInputPool, redirected_grads

__all__ = ["EmulatedSlot", "warmup_context"]


class EmulatedSlot(ReplaySlot):
    """One emulated graph pair.  ``models_pool``: the capture walk follows what it allocates and keeps
    (``graphs.accounting.pool_bytes``), a stand-in for the graph pool's reserved bytes."""

    models_pool = True

    _live: list[torch.Tensor] | None = None
    _trace: CallTrace | None = None
    _side_targets: list = []  # per side parameter: the tensor its captured backward writes into

    def capture_forward(self) -> None:
        self.chain_input()
        check = self.hazard_check()
        outs = self.run_eager(check)
        self._trace = check.trace
        self.diff_outputs = [o.requires_grad for o in outs]
        self.static_outputs = [o.detach().clone() for o in outs]
        self._live = outs

    def capture_backward(self) -> None:
        chained = self.chained_grad_output()
        self.static_grad_outputs = [chained] if chained is not None else [
            torch.zeros_like(o) for o, d in zip(self.static_outputs, self.diff_outputs) if d]
        with self.capturing_side_writes():  # what a capture would write into (the caller's .grad tensors)
            self._side_targets = [p.grad for p in self.side_params]
        with redirected_grads(self.side_params, [None] * len(self.side_params)):  # a capture computes nothing
            self._capture_backward()

    def _capture_backward(self) -> None:
        if self.splits:
            in_grads, recorded = self.split_input_grads(self._live)
            self.static_grad_inputs = [None if g is None else g.detach().clone() for g in in_grads]
            if self.weight_pool is not None:  # one set per pending W of (chunk, layer), not per microbatch
                self.static_weight_inputs = self.weight_pool.of(self.event, recorded)
            else:
                self.static_weight_inputs = [None if r is None else tuple(None if g is None else torch.empty_like(g)
                                                                          for g in r) for r in recorded]
            WeightInputPool.fill(self.static_weight_inputs, recorded)
            return  # the graph stays until W is captured
        grads = self.eager_backward(self._live, self.static_grad_outputs, retain_graph=True)
        in_grads, param_grads = self.split_grads(grads)
        kept = in_grads if self.options.param_grads == "accumulate" else list(grads)
        self.static_grad_inputs = [None if g is None else g.detach().clone() for g in kept]
        self._live = None  # a captured graph keeps no activations between its capture and its first replay

    def capture_weight(self) -> None:
        self.split_weight_grads(self._live, self.static_weight_inputs)  # computed, not accumulated (a capture)
        self._live = None
        self.split = None  # its nodes hold the captured graph (the saved activations): dead after W, as on CUDA

    def replay_forward(self) -> None:
        check = self.hazard_check() if self.options.check_replays else None
        with autocast_context(self.autocast):
            outs = self.run_eager(check)
        if check is not None:
            check.compare(self._trace)
        with torch.no_grad():
            for static, out in zip(self.static_outputs, outs):
                static.copy_(out)
        self._live = outs

    def replay_backward(self) -> None:
        if self._live is None:
            raise RuntimeError(f"backward replay of {self.where} without a forward replay of that slot in this step")
        with redirected_grads(self.side_params, self._side_targets):  # .grad writes go where the capture's went
            if self.splits:
                self._replay_split_input()
            else:
                self._replay_unsplit()

    def _replay_unsplit(self) -> None:
        # retain_graph: a real backward graph can be replayed again over the same saved activations
        grads = self.eager_backward(self._live, self.static_grad_outputs, retain_graph=True)
        in_grads, param_grads = self.split_grads(grads)
        with torch.no_grad():
            kept = in_grads if self.options.param_grads == "accumulate" else grads
            for static, g in zip(self.static_grad_inputs, kept):
                if static is not None:
                    static.zero_() if g is None else static.copy_(g)
            if self.options.param_grads == "accumulate":
                buffers = {id(p): buf for p, buf in self.accumulate}
                for p, g in zip(self.params, param_grads):
                    if g is not None:
                        buffers[id(p)].data.add_(g)  # .data: a graph replay's write bumps no version counter

    def _replay_split_input(self) -> None:
        """Split ``B``: input gradients into the static grad-inputs, the recorded gradients into this slot's
        static ``W`` buffers."""
        in_grads, recorded = self.split_input_grads(self._live)
        with torch.no_grad():
            for static, g in zip(self.static_grad_inputs, in_grads):
                if static is not None:
                    static.zero_() if g is None else static.copy_(g)
        WeightInputPool.fill(self.static_weight_inputs, recorded)

    def replay_weight(self) -> None:
        if self._live is None:
            raise RuntimeError(f"weight-gradient replay of {self.where} without a forward replay of that slot in "
                               f"this step")
        self.accumulate_param_grads(self.split_weight_grads(self._live, self.static_weight_inputs),
                                    bypass_version=True)

    def release(self) -> None:
        self._live = None
        self.static_weight_inputs = []
        self._trace = None
        self.static_outputs = []
        self.static_grad_outputs = []
        self.static_grad_inputs = []


def warmup_context():
    return contextlib.nullcontext()


class EmulateBackend:
    """The ``emulate`` backend (:class:`graphs.backends.Backend`): always available, splits the backward."""

    name = "emulate"
    supports_split_backward = True
    needs_cuda_tensors = False

    def unavailable_reason(self) -> str | None:
        return None

    def split_backward_reason(self) -> str:
        return ""

    def capture(self, job, capture_slots):
        graphs = capture_slots(EmulatedSlot, warmup_context)
        graphs.backend = self.name
        return graphs
