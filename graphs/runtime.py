"""The trainer's CUDA-graph hook: eager warmup steps, record, check, capture collectively, recapture on change.

Lifecycle (Megatron's ``cuda_graph_warmup_steps`` then ``create_cudagraphs``, ``megatron/core/transformer/cuda_graphs.py``),
driven by one call, :meth:`GraphRuntime.before_step`, at the start of every training step:

* steps ``0 .. warmup_steps-2`` run eagerly (lazy initialisation, allocator warm-up);
* step ``warmup_steps-1`` runs eagerly while the layer dispatchers *record* every pass: the
  ``(F|B, chunk, microbatch, layer)`` sequence the executor really runs and each call's argument layout;
* at the start of step ``warmup_steps`` the recording is checked -- its passes must equal the plan's (the capture
  order equals the runtime order, NVIDIA/Megatron-LM#6022), and every microbatch must have the same shapes (no variable sequence
  lengths) -- and the graphs are captured from the recorded layouts.  Every check and the capture itself feed one
  collective decision: all ranks replay graphs or all run eagerly, with one log line saying why;
* if the microbatch count or the step's shape key changes later, the graphs are dropped, one step is recorded
  eagerly and the graphs are recaptured -- never a silent wrap-around.

``current_microbatch``: Megatron's ``set_current_microbatch`` writes it on ``chunk.decoder.layers``.  For chunks
without a ``decoder`` (pipecast's ``ModelChunk`` keeps its blocks in ``.layers``) a forward pre-hook on the *chunk*
(not on a graphed layer) counts the chunk's training forwards within the step -- the ``k``-th forward of chunk ``c``
is microbatch ``k`` in every schedule, which is also TE's convention -- and writes it on the layers.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable, Sequence

import torch

from engine.plan import Op
from engine.plan.resolve import ResolvedSchedule, resolve_schedule

from .capture import capture, resolve_backend_name
from .dispatch import GraphedLayers, layers_of_chunk
from .order import max_in_flight

__all__ = ["GraphRuntime"]

log = logging.getLogger("pipecast.graphs")


class GraphRuntime:
    """CUDA graphs for the model chunks of one pipeline rank, managed across training steps.

    Args:
        model_chunks: this rank's model chunks (``len == num_model_chunks``).
        schedule: the run's :class:`engine.plan.resolve.ResolvedSchedule` (the trainer's), or a registered
            schedule's name (``engine.plan.schedule_names()``), resolved with ``pp_size``, ``num_model_chunks``
            and ``group_size``.  Split-backward schedules get F, B and W graphs, which need ``defer_weight_grad``.
        pp_size, pp_rank: pipeline size and this rank.
        num_model_chunks: model chunks per rank.
        group_size: ``microbatch_group_size_per_vp_stage`` for a schedule named by ``schedule`` that takes it
            (interleaved; default ``pp_size``).
        backend: ``auto``, ``te``, ``torch`` (= ``pipecast``), ``emulate``, ``eager`` or a name added with
            :func:`graphs.backends.register_backend`.
        warmup_steps: eager steps before capture (the last one records the passes; 0 counts as 1).
        num_warmup_iters: warmup rounds inside the capture.
        group: process group of the collective decision (default: the world).
        tracer: gets ``"graph"`` spans around replays.
        layers_of: ``chunk -> list of layers to graph`` (default ``.decoder.layers`` or ``.layers``).
        variable_seq_lengths: the run varies sequence lengths (Megatron's config flag): graphs are off, decided at
            the capture point with one log line.
        generators: generators to register with every graph; every non-default generator the layers drew from in
            the recorded step is registered as well (dropout masks then advance per replay, pytorch#84614).
        defer_weight_grad: split-backward schedules: queues a layer's ``W`` replay into the running split backward
            (``engine.runtime.split_backward.defer_weight_grad``; ``graphs.capture.capture``).
        plan: a plan of the run: its resolution (:meth:`ResolvedSchedule.of_plan`) gives the plan of each step's
            microbatch count, in whose order graphs are captured (e.g. a ``zb`` plan keeps its ``max_in_flight``);
            default: ``schedule``'s.
        timeout_s: the collective timeout (``parallel.timeout_s``): a capture projected to outlast it stops and
            every rank runs eagerly (``graphs.capture.capture``).

    Raises:
        ValueError: unknown backend, ``warmup_steps < 0``, chunk count not matching.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], schedule, pp_size: int, pp_rank: int,
                 num_model_chunks: int = 1, group_size: int | None = None, backend: str = "auto",
                 warmup_steps: int = 2, num_warmup_iters: int = 1, group=None, tracer=None,
                 layers_of: Callable[[torch.nn.Module], list] = layers_of_chunk, variable_seq_lengths: bool = False,
                 generators: Sequence[torch.Generator] = (), defer_weight_grad=None, plan=None,
                 timeout_s: float | None = None):
        resolve_backend_name(backend)  # ValueError for an unknown name (graphs.backends' registry)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"cuda_graphs.warmup_steps={warmup_steps!r}: use an int >= 1 (eager steps before "
                             f"capture; the last one records the passes and shapes the graphs are captured for)")
        if warmup_steps == 0:
            log.info("cuda_graphs.warmup_steps=0: using 1 -- one eager step records the passes and shapes to capture")
            warmup_steps = 1
        if len(model_chunks) != num_model_chunks:
            raise ValueError(f"{len(model_chunks)} model chunks but num_model_chunks={num_model_chunks}")
        self.chunks = list(model_chunks)
        resolution = ResolvedSchedule.of_plan(plan) if plan is not None else None
        if resolution is None:
            resolution = schedule if isinstance(schedule, ResolvedSchedule) else resolve_schedule(
                schedule, pp_size, num_model_chunks, group_size)
        self.resolution = resolution
        self.schedule, self.pp_size, self.pp_rank = resolution.name, pp_size, pp_rank
        self.num_model_chunks = num_model_chunks
        self.group_size = group_size
        self.backend, self.warmup_steps, self.num_warmup_iters = backend, warmup_steps, num_warmup_iters
        self.group, self.tracer = group, tracer
        self.variable_seq_lengths = variable_seq_lengths
        self.generators = list(generators)
        self.defer_weight_grad = defer_weight_grad
        self.plan = plan
        self.timeout_s = timeout_s
        self.layers = GraphedLayers([layers_of(c) for c in self.chunks], tracer=tracer)
        self.disabled_reason: str | None = None
        self.steps_seen = 0
        self._eager_steps = 0  # eager steps since (re)start of the warmup
        self._captured_key: tuple | None = None
        self._record_key = None
        self.last_recording = None  # the Recording the current graphs were captured from
        self._counters = [0] * num_model_chunks
        self._hooks = [c.register_forward_pre_hook(self._counting_hook(i))
                       for i, c in enumerate(self.chunks) if getattr(c, "decoder", None) is None]

    # -- microbatch ids for chunks without Megatron's decoder -----------------------------------------------------
    def _counting_hook(self, chunk: int):
        def hook(module, args):
            if not module.training or self.layers.suspended:
                return None
            self.layers.set_current_microbatch(chunk, self._counters[chunk])
            self._counters[chunk] += 1
            return None
        return hook

    # -- the per-step call ------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Graphs are captured and replay in training steps."""
        return self.layers.active

    def before_step(self, num_microbatches: int, shape_key: Hashable = None) -> None:
        """Call at the start of every training step, on every rank (the capture decision is collective).

        Args:
            num_microbatches: microbatches of this step.
            shape_key: anything that changes when the per-microbatch shapes change (e.g. ``(seq_length,
                micro_batch_size)``); a change triggers recapture.
        """
        self.steps_seen += 1
        self._counters = [0] * self.num_model_chunks
        if self.disabled_reason is not None:
            return
        if not self.layers.guard.at_step_boundary:  # the previous step raised half-way: start the order afresh
            log.warning("CUDA graphs: the previous step stopped at pass %d of the captured order; restarting the "
                        "order (every replay rewrites its own buffers)", self.layers.guard.position)
            self.layers.guard.reset()
        key = (num_microbatches, shape_key)
        if self.layers.active and key == self._captured_key:
            return
        if self.layers.active:  # microbatch count or shapes changed: drop graphs, record one step, recapture
            log.info("CUDA graphs: recapturing (num_microbatches/shapes %s -> %s)", self._captured_key, key)
            self.layers.clear_graphs()
            self._eager_steps = self.warmup_steps - 1
        if self.layers.recording is not None:
            self._capture(num_microbatches, key)
            return
        if self._eager_steps >= self.warmup_steps - 1:
            self.layers.start_recording(self.defer_weight_grad)
            self._record_key = key
        self._eager_steps += 1

    def _plan(self, num_microbatches: int):
        """The run's training plan for ``num_microbatches`` (from the one resolution, cached there)."""
        return self.resolution.plan(num_microbatches)

    def _capture(self, num_microbatches: int, key) -> None:
        rec = self.last_recording = self.layers.stop_recording()
        if self._record_key != key:  # the recorded step had other sizes: record again
            self.layers.start_recording(self.defer_weight_grad)
            self._record_key = key
            return
        plan = self._plan(num_microbatches)
        veto = ("variable sequence lengths (variable_seq_lengths=True): graphs replay fixed shapes only"
                if self.variable_seq_lengths else None)
        graphed_chunks = {c for c, n in enumerate(self.layers.layers_per_chunk) if n > 0}
        expected = [(a.op.value, a.chunk, a.microbatch) for a in plan.actions[self.pp_rank]
                    if a.op is not Op.WEIGHT and a.chunk in graphed_chunks]
        passes = rec.microbatch_passes()
        if veto is None and passes != expected:
            first = next((i for i, (a, b) in enumerate(zip(passes, expected)) if a != b), min(len(passes),
                                                                                              len(expected)))
            veto = (f"the executor's passes differ from the {self.schedule} plan at pass {first} "
                    f"({passes[first] if first < len(passes) else 'end'} vs "
                    f"{expected[first] if first < len(expected) else 'end'}); graphs captured in plan order would "
                    f"replay out of order")
        specs, shape_reason = rec.layer_specs()
        veto = veto or shape_reason or (_outside_split_reason(rec) if plan.splits_backward else None)
        if specs is None or veto is not None:
            specs = None
        autocast = next(iter(rec.autocast)) if len(rec.autocast) == 1 else None
        # without pipelining forward and backward alternate and nothing is sent to a neighbour, so one graph per
        # layer serves every microbatch (Megatron captures M=1 for PP=1); otherwise one per (chunk, microbatch,
        # layer) -- also on a 1F1B rank without warmup, whose static input grads may still be in flight in a send
        share = self.pp_size == 1 and max_in_flight(plan.te_order(self.pp_rank)) == 1 and not plan.splits_backward
        layers = capture(self.layers, plan, self.pp_rank, specs=specs, backend=self.backend,
                         num_warmup_iters=self.num_warmup_iters, group=self.group, tracer=self.tracer, veto=veto,
                         autocast=autocast, share_graphs=share, chain_layers=not rec.unchained,
                         defer_weight_grad=self.defer_weight_grad, timeout_s=self.timeout_s,
                         eager_microbatches=self.warmup_steps * num_microbatches,
                         generators=self.generators + [g for g in rec.generators if all(g._cdata != h._cdata for h in
                                                                                         self.generators)])
        report = layers.report
        if layers.active:
            self._captured_key = key
            log.info("CUDA graphs: %d graph sets captured with backend %s in %.2fs (order %s)", report.num_graphs,
                     report.backend, report.seconds, report.order)
        else:
            self.disabled_reason = report.reason
            log.debug("CUDA graphs disabled for this run: %s", report.reason)

    def suspend(self):
        """Context manager: eager and unrecorded (e.g. an evaluation pass in training mode)."""
        return self.layers.suspend()

    def close(self) -> None:
        """Release graphs, remove dispatchers and hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.layers.remove()


def _outside_split_reason(rec) -> str | None:
    """Why split-backward graphs cannot follow the recorded step: a layer's backward ran outside the split ``B``
    (the executor split that chunk over its autograd graph and found no input path -- the first stage with
    parameters outside the deferred ops -- so its whole backward runs in ``W``), or ``None``."""
    if not rec.outside_split:
        return None
    ev = rec.outside_split[0]
    return (f"split backward: the backward of chunk {ev.chunk} layer {ev.layer} (microbatch {ev.microbatch}) ran "
            f"outside the input-gradient pass B -- the chunk was split over its autograd graph with no input path, "
            f"so its whole backward runs in W, not where B graphs would replay; keep the chunk's parameters in "
            f"nn.Linear / nn.LayerNorm / nn.Embedding layers (layer-level deferral) or run it without CUDA graphs")
