"""``torch``: pipecast's own ordered capture on ``torch.cuda.CUDAGraph`` (torch's CUDA Graphs API).

Unlike ``torch.cuda.make_graphed_callables`` (all forwards, then all backwards reversed: wrong for 1F1B),
the forward and backward graph of every ``(chunk, microbatch, layer)`` are captured in the rank's runtime order,
into one shared memory pool, so that a block freed during one capture is only reused by graphs that the runtime
replays after that block is dead (the pool's liveness rule, :mod:`graphs.liveness`).  Warmup runs on a side stream with
``torch.cuda.set_sync_debug_mode("error")`` (a host sync raises there, before any capture); Python GC is off during
capture (TE PR #2092); extra RNG generators are registered with every graph so dropout masks advance per replay
(pytorch#84614); parameter gradients are accumulated inside each backward graph (``graphs.backends.common``).

Split backward (zero-bubble plans): three graphs per slot, captured where the plan runs ``F``, ``B`` and ``W``.
The ``B`` graph computes the input gradients and the gradients arriving at the layer's intermediates
(:mod:`graphs.backends.split`); those tensors stay referenced as the slot's static ``W`` inputs, and the captured
autograd graph (the saved activations) is kept until the ``W`` capture, which accumulates the parameter gradients
into the per-parameter buffers inside the graph and then drops both -- so the activations' and the recorded
gradients' blocks return to the pool exactly where the runtime's ``W`` ends their life, and later captures reuse
them: the pool holds the recorded gradients of the pending ``W`` passes only (their peak per chunk), whatever the
number of microbatches.

Every CUDA call goes through :data:`cuda` (``torch.cuda``; tests substitute a fake to exercise failure paths on
CPU).  :func:`graph_capture` restores the caller's stream whatever happens: ``torch.cuda.graph.__exit__`` calls
``capture_end()`` before it leaves its stream context, so when a capture was invalidated (a host sync inside it)
it raises and would leave the thread on the capture stream for the rest of the process.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Sequence

import torch

from .. import decision
from .common import ReplaySlot

__all__ = ["TorchBackend", "CudaGraphSlot", "warmup_context", "capture_context", "graph_capture", "cuda",
           "FORWARD_CAPTURE_MODE"]

cuda = torch.cuda  # replaced by a fake in CPU tests of the failure paths
# ``torch.cuda.graph(..., capture_error_mode=)`` of forward captures.  A forward runs on the capturing thread, so
# "thread_local" still refuses a potentially unsafe CUDA call there, while other threads (a pinned-memory data
# loader, the NCCL watchdog querying events) may run during the capture instead of invalidating it (Megatron's
# full-iteration graphs capture so).  Backward and weight-gradient captures keep "global": their kernels are
# launched from autograd's device thread, which "thread_local" (scoped to the thread that began the capture) would
# not check, so an illegal call inside a backward would no longer invalidate the capture loudly.
FORWARD_CAPTURE_MODE = "thread_local"


@contextlib.contextmanager
def graph_capture(graph, pool, capture_error_mode: str = "global"):
    """``torch.cuda.graph(graph, pool=pool, capture_error_mode=...)`` that always returns the thread to the
    caller's current stream."""
    caller = cuda.current_stream()
    try:
        with cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
            yield
    finally:
        cuda.set_stream(caller)


class CudaGraphSlot(ReplaySlot):
    """One real forward/backward CUDA-graph pair (with split backward: forward, input-gradient and
    weight-gradient graphs).  Set :attr:`pool` before capture."""

    pool = None
    fwd_graph: "torch.cuda.CUDAGraph | None" = None
    bwd_graph: "torch.cuda.CUDAGraph | None" = None
    wgt_graph: "torch.cuda.CUDAGraph | None" = None
    _capture_outputs: list[torch.Tensor] | None = None

    def _new_graph(self) -> "torch.cuda.CUDAGraph":
        g = cuda.CUDAGraph()
        for gen in self.options.generators:
            if gen.device.type == "cuda":
                g.register_generator_state(gen)
        return g

    def capture_forward(self) -> None:
        self.chain_input()
        self.fwd_graph = self._new_graph()
        with graph_capture(self.fwd_graph, self.pool, FORWARD_CAPTURE_MODE):
            outs = self.run_eager()
        self.diff_outputs = [o.requires_grad for o in outs]
        self._capture_outputs = outs  # keeps the captured autograd graph until the backward is captured
        self.static_outputs = [o.detach() for o in outs]

    def capture_backward(self) -> None:
        outs = self._capture_outputs
        chained = self.chained_grad_output()
        # allocated outside the capture: they live as long as the slot
        self.static_grad_outputs = [chained] if chained is not None else [
            torch.empty_like(o) for o, d in zip(outs, self.diff_outputs) if d]
        self.bwd_graph = self._new_graph()
        if self.splits:
            with self.capturing_side_writes(), graph_capture(self.bwd_graph, self.pool):
                in_grads, recorded = self.split_input_grads(outs)
            self.static_grad_inputs = [None if g is None else g.detach() for g in in_grads]
            self.static_weight_inputs = recorded  # written by every B replay, read by the W replay
            return  # the captured graph (saved activations) stays until W is captured
        with self.capturing_side_writes(), graph_capture(self.bwd_graph, self.pool):
            in_grads, param_grads = self.split_grads(self.eager_backward(outs, self.static_grad_outputs))
            if self.options.param_grads == "accumulate":
                buffers = {id(p): buf for p, buf in self.accumulate}
                for p, g in zip(self.params, param_grads):
                    if g is not None:
                        buffers[id(p)].add_(g)  # inside the graph: one persistent buffer per parameter
                kept = in_grads
            else:
                kept = in_grads + param_grads
        self.static_grad_inputs = [None if g is None else g.detach() for g in kept]
        self._capture_outputs = None  # frees the saved activations back to the pool, as the runtime will

    def capture_weight(self) -> None:
        self.wgt_graph = self._new_graph()
        with graph_capture(self.wgt_graph, self.pool):
            self.accumulate_param_grads(self.split_weight_grads(self._capture_outputs, self.static_weight_inputs))
        # the activations and B's recorded gradients are dead after W: their blocks go back to the pool, where
        # only graphs captured later -- replayed after this W -- can take them (I1), so the pool holds recorded
        # gradients of the pending W only, not of every microbatch (issue 24)
        self._capture_outputs = None
        self.static_weight_inputs = []
        self.split = None

    def replay_weight(self) -> None:
        self.wgt_graph.replay()

    def replay_forward(self) -> None:
        self.fwd_graph.replay()

    def replay_backward(self) -> None:
        self.bwd_graph.replay()

    def release(self) -> None:
        """Drop every graph and static tensor (never raises: a graph of a failed capture may be broken)."""
        for g in (self.fwd_graph, self.bwd_graph, self.wgt_graph):
            try:
                if g is not None and hasattr(g, "reset"):
                    g.reset()
            except Exception:  # noqa: BLE001 - cleanup must go on; the capture error is reported by the caller
                pass
        self.fwd_graph = self.bwd_graph = self.wgt_graph = None
        self._capture_outputs = None
        self.static_weight_inputs = []
        self.split = None
        self.static_outputs = []
        self.static_grad_outputs = []
        self.static_grad_inputs = []


@contextlib.contextmanager
def warmup_context():
    """Warmup on a fresh side stream ordered after the current stream (torch's own recipe), with host syncs
    raising (``set_sync_debug_mode("error")``); the caller's stream and debug mode are restored whatever happens."""
    caller, mode = cuda.current_stream(), cuda.get_sync_debug_mode()
    side = cuda.Stream()
    side.wait_stream(caller)
    try:
        cuda.set_sync_debug_mode("error")
        with cuda.stream(side):
            yield
    finally:
        cuda.set_sync_debug_mode(mode)
        cuda.set_stream(caller)
    caller.wait_stream(side)
    cuda.synchronize()


def capture_context(slots: Sequence[CudaGraphSlot], pool=None):
    """Give every slot the shared pool (a fresh ``graph_pool_handle`` unless ``pool``); returns the pool."""
    pool = cuda.graph_pool_handle() if pool is None else pool
    for s in slots:
        s.pool = pool
    return pool


class TorchBackend:
    """The ``torch`` backend (alias ``pipecast``; :class:`graphs.backends.Backend`): on CUDA, splits the backward.

    Before the capture: one device sync, a GC pass (no stale graph may die during capture, when GC is off) and
    ``empty_cache``; every graph of the rank shares one memory pool (``job.pool`` or a fresh one)."""

    name = "torch"
    supports_split_backward = True
    needs_cuda_tensors = True

    def unavailable_reason(self) -> str | None:
        return None if decision.cuda_ready() else "no CUDA device"

    def split_backward_reason(self) -> str:
        return ""

    def capture(self, job, capture_slots):
        pool = []

        def prepare(slots):
            cuda.synchronize()
            gc.collect()  # before GC is disabled for the capture: no stale graph may die during it
            cuda.empty_cache()
            pool.append(capture_context(slots, job.pool))  # one shared pool for every graph of this rank

        graphs = capture_slots(CudaGraphSlot, warmup_context, prepare=prepare)
        graphs.backend = self.name
        graphs.extra["pool_id"] = pool[0] if pool else None  # graphs.accounting.pool_bytes reads its segments
        cuda.synchronize()
        return graphs
