"""``torch``: pipecast's own ordered capture on ``torch.cuda.CUDAGraph`` (``shared/spec/cuda_graphs.md`` 3.3).

Unlike ``torch.cuda.make_graphed_callables`` (all forwards, then all backwards reversed: wrong for 1F1B, spec 3.1),
the forward and backward graph of every ``(chunk, microbatch, layer)`` are captured in the rank's runtime order,
into one shared memory pool, so that a block freed during one capture is only reused by graphs that the runtime
replays after that block is dead (invariant I1).  Warmup runs on a side stream; Python GC is off during capture
(TE PR #2092); extra RNG generators are registered with every graph so dropout masks advance per replay
(pytorch#84614).
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from .common import ReplaySlot

__all__ = ["CudaGraphSlot", "warmup_context", "capture_context"]


class CudaGraphSlot(ReplaySlot):
    """One real forward/backward CUDA-graph pair.  Set :attr:`pool` and :attr:`generators` before capture."""

    pool = None
    generators: Sequence[torch.Generator] = ()
    fwd_graph: "torch.cuda.CUDAGraph | None" = None
    bwd_graph: "torch.cuda.CUDAGraph | None" = None
    _capture_outputs: list[torch.Tensor] | None = None

    def _new_graph(self) -> "torch.cuda.CUDAGraph":
        g = torch.cuda.CUDAGraph()
        for gen in self.generators:
            g.register_generator_state(gen)
        return g

    def capture_forward(self) -> None:
        self.fwd_graph = self._new_graph()
        with torch.cuda.graph(self.fwd_graph, pool=self.pool):
            outs = self.run_eager()
        self.diff_outputs = [o.requires_grad for o in outs]
        self._capture_outputs = outs  # keeps the captured autograd graph until the backward is captured
        self.static_outputs = [o.detach() for o in outs]

    def capture_backward(self) -> None:
        outs = self._capture_outputs
        # allocated outside the capture: they live as long as the slot
        self.static_grad_outputs = [torch.empty_like(o) for o, d in zip(outs, self.diff_outputs) if d]
        self.bwd_graph = self._new_graph()
        with torch.cuda.graph(self.bwd_graph, pool=self.pool):
            grads = self.eager_backward(outs, self.static_grad_outputs)
        self.static_grad_inputs = [None if g is None else g.detach() for g in grads]
        self._capture_outputs = None  # frees the saved activations back to the pool, as the runtime will

    def replay_forward(self) -> None:
        self.fwd_graph.replay()

    def replay_backward(self) -> None:
        self.bwd_graph.replay()

    def release(self) -> None:
        for g in (self.fwd_graph, self.bwd_graph):
            if g is not None and hasattr(g, "reset"):
                g.reset()
        self.fwd_graph = self.bwd_graph = None
        self._capture_outputs = None
        self.static_outputs = []
        self.static_grad_outputs = []
        self.static_grad_inputs = []


@contextlib.contextmanager
def warmup_context():
    """Run warmup on a fresh side stream ordered after the current stream (torch's own recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture_context(slots: Sequence[CudaGraphSlot], pool=None, generators: Sequence[torch.Generator] = ()):
    """Give every slot the shared pool (a fresh ``graph_pool_handle`` unless ``pool``) and the generators."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    for s in slots:
        s.pool = pool
        s.generators = tuple(generators)
    return pool
