"""CUDA graphs per (model chunk, microbatch, layer), captured in exactly the order the pipeline rank runs them.

* :mod:`graphs.order`: the rank's capture order (with the ``W`` actions of split-backward plans), TE's flat graph
  index, :func:`check_order`.
* :func:`graphs.capture.capture`: one entry point for the ``te``, ``torch``, ``emulate`` and ``eager`` backends
  and any added with :func:`register_backend` (the :class:`Backend` protocol, :mod:`graphs.backends`: one file
  per backend); returns :class:`graphs.dispatch.GraphedLayers` (layers dispatch on ``current_microbatch``).
* :class:`graphs.runtime.GraphRuntime`: the trainer's hook -- eager warmup steps, recording, collective capture,
  recapture when the microbatch count or shapes change.
* :mod:`graphs.liveness`: a shared-pool model showing why the capture order must equal the runtime order.
* :mod:`graphs.hazards`: what a frozen replay would not reproduce (host syncs, unregistered generators, replaced
  parameters, Python state read in forward), checked in warmup and on every emulated replay.
* :mod:`graphs.backends.split`: split backward inside one graphed layer (``B`` input gradients, ``W`` weight
  gradients), for the ``torch`` and ``emulate`` backends' ``B`` and ``W`` graphs.
* :mod:`graphs.accounting`: bytes held by captured graphs, their memory pool's reserved bytes, the eager step's
  peak, ops per replay.
* :mod:`graphs.local_rank`: run one rank's plan in one process (fixed received tensors), for tests and benchmarks.

Dependencies run graphs -> ``engine.plan`` / ``engine.plan.table`` (the pure layer) only.
"""
from .backends import Backend, register_backend
from .capture import BACKENDS, CaptureReport, capture, make_sample_args, resolve_backend
from .dispatch import GraphedLayers, GraphSet, Recording, ReplayGuard, layers_of_chunk
from .order import (LayerEvent, check_order, flat_index, capture_order, layer_events, max_in_flight, order_events,
                    unflat_index)
from .runtime import GraphRuntime
from .specs import CallSpec, TensorSpec

__all__ = [
    "Backend", "register_backend", "BACKENDS", "CaptureReport", "capture", "make_sample_args", "resolve_backend",
    "GraphedLayers", "GraphSet", "Recording", "ReplayGuard", "layers_of_chunk",
    "LayerEvent", "check_order", "flat_index", "capture_order", "layer_events", "max_in_flight", "order_events",
    "unflat_index", "CallSpec", "TensorSpec", "GraphRuntime",
]
