"""Split backward for zero-bubble schedules: B (input gradient) now, W (weight gradients) later.

One (model chunk, microbatch) backward is split into

* **B** -- :func:`backward_input_step`: the gradient of the chunk's input (``[s, b, h]``, sent upstream at once),
  returned with a :class:`WeightGradWork` holding what the weight gradients need;
* **W** -- :meth:`WeightGradWork.run`, later: computes the weight gradients and *accumulates* them into ``.grad``
  through autograd's own ``AccumulateGrad`` (tensor hooks and post-accumulate-grad hooks on parameters fire then,
  once per parameter and microbatch, as in the unsplit backward), then frees what it held.

Two mechanisms (``mode``):

``"layer"`` -- layer-level deferral.  Inside :func:`weight_grad_deferral` (or on a module given to
    :func:`enable_layer_deferral`) every ``F.linear``, ``F.layer_norm``, ``F.rms_norm`` and ``F.embedding`` whose
    weight (and bias) are leaf tensors requiring grad -- so ``nn.Linear``, ``nn.LayerNorm``, ``nn.RMSNorm``,
    ``nn.Embedding`` and a bare
    ``F.linear(x, embedding.weight)`` head -- runs behind a bridge node.  ``F.linear`` on a contiguous ``[n, in]`` /
    ``[s, b, in]`` input (with bias for 3-D; no autocast) uses autograd's own formulas written out (B: ``grad @ W``;
    W: ``grad^T @ x`` and ``grad.sum(0)``); every other deferred op runs as its own small autograd graph, B taking
    the op's input gradient from it and W the rest.  DTensor linears (``torch.distributed.tensor.parallel``
    column- / row-parallel layouts on a 1-D mesh, 3-D input with or without bias) take the written-out formulas
    too: B with DTensor ops, W on the local shards (:func:`_linear_weight_grads`), so W issues no collective.  Everything else backpropagates in B as in
    :func:`~engine.runtime.step.backward_step` (B *is* ``backward_step``, with the recorder on); W backpropagates
    the microbatch's records in few autograd calls restricted to the parameters.  Held until W: per deferred op
    its output gradient and the tensors its backward saved (the op's input; for layer norm also mean and rstd),
    i.e. about (input, grad_output) per layer.  No recomputation.
``"generic"`` -- a split over the autograd graph, for any chunk.  B walks the graph from the output, marks the
    nodes from which an input is reachable (the input path), and hooks the *intermediates*: input-path nodes with
    an edge leaving the path towards the weights.  B runs autograd from the output to the inputs only, with the
    graph retained, the hooks recording the gradient arriving at each intermediate.  W re-runs each intermediate
    from its recorded gradient, computing only its edges leaving the path (ops honour autograd's needed-output
    mask, so an ``addmm`` computes only ``mat2``'s gradient; a custom ``autograd.Function`` computes all of its
    outputs again), sums those edge gradients per target in B's execution order, and backpropagates them to the
    leaves in one call.  Cost: the retained graph keeps **every saved tensor of the chunk's graph below the first
    intermediate** (about all its activations, as after the forward) alive until W, plus the gradient recorded
    at each intermediate (about one activation per weight op); the intermediates' backward runs twice with
    disjoint output masks; where one parameter is used by two ops on the input path (a module applied twice) W
    also re-runs the input path between the two uses (values discarded).  Tensor hooks on the intermediates'
    output tensors run again in W (their result is replaced by B's); parameters' tensor hooks run once.
``"auto"`` -- ``"layer"`` when no parameter is reached outside deferred ops (the graph has no ``AccumulateGrad``
    besides the inputs'), else ``"generic"``.

When no input requires grad (the first stage, ``input_tensor`` None) B computes nothing in generic mode and W is
the whole backward; in layer mode B still backpropagates through the chunk down to the deferred ops.

Exactness: each parameter's gradient of one microbatch is summed by autograd from the same per-op contributions in
the same order as the unsplit backward and accumulated into ``.grad`` once, so running each chunk's W in microbatch
order gives bitwise the unsplit ``.grad`` (tests/runtime/test_split_backward.py).

Activation recomputation: pipecast's own (:mod:`engine.runtime.recompute`: ``recompute``, ``apply_recompute``)
splits exactly in both modes -- the recomputed forward runs in B (under the deferral again when the forward ran
under it), and W keeps only what its weight gradients need (:func:`segment_backward`).  ``torch.utils.checkpoint``
inside a split chunk: non-reentrant checkpointing works in generic mode (recomputed in B, exact, but the retained
graph recomputes again in W); in layer mode the recomputed forward does not run under the deferral and torch's
checkpoint raises ``CheckpointError``; reentrant checkpointing is refused by torch in generic mode and is not split
in layer mode (all gradients in B).
Not deferred: sparse embeddings and ``max_norm`` (run as plain ops).  Not supported: two threads running split
backward at once (the recorder is one process-wide slot, so that autograd's device threads see it).
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode

from .step import ScheduleContractError, backward_step
from .storage import storage_sizes

__all__ = ["MODES", "WeightGradWork", "backward_input_step", "weight_grad_deferral", "enable_layer_deferral",
           "defer_weight_grad", "deferring", "segment_backward"]

MODES = ("auto", "layer", "generic")
"""The values of ``backward_input_step(..., mode=...)``."""

# ---- layer-level deferral ----------------------------------------------------------------------------------------

_recorder: Optional[list] = None
"""Where deferred ops record their W during a split B (None: they compute their weight gradients at once).  One
process-wide slot, not thread-local: autograd runs CUDA nodes' backward on its own device threads."""

_anchors: dict = {}


def _engine(roots: Sequence, grads: Sequence, inputs: Sequence = (), keep_graph: bool = False,
            accumulate: bool = True):
    """Run autograd's engine from ``roots`` (tensors or ``GradientEdge``) with ``grads``: accumulate into the
    leaves (all, or only ``inputs``), or with ``accumulate=False`` return the gradients of ``inputs``.

    ``torch.autograd.backward`` / ``grad`` make the same call after Python-side shape checks that cost tens of
    microseconds per ``GradientEdge`` root (symbolic-shape comparisons); the shapes are checked by the engine
    anyway.  The same PyTorch-private entry as :func:`engine.runtime.step.custom_backward`."""
    return Variable._execution_engine.run_backward(
        tensors=tuple(roots), grad_tensors=tuple(grads), keep_graph=keep_graph, create_graph=False,
        inputs=tuple(inputs), allow_unreachable=True, accumulate_grad=accumulate)


@contextlib.contextmanager
def _recording(records: Optional[list]):
    global _recorder
    previous, _recorder = _recorder, records
    try:
        yield
    finally:
        _recorder = previous


def _anchor(device: torch.device) -> torch.Tensor:
    """A 0-dim leaf requiring grad: the bridge input of an op whose own input needs no gradient (an embedding),
    so the bridge is a node of the chunk's graph.  Never receives a gradient."""
    anchor = _anchors.get(device)
    if anchor is None:
        anchor = _anchors[device] = torch.zeros((), device=device, requires_grad=True)
    return anchor


class _Record:
    """What one deferred op's W needs: ``roots()`` -> ``[(GradientEdge, gradient), ...]`` to backpropagate (its
    own graph's output, or a parameter's ``AccumulateGrad`` with a computed weight gradient), ``params`` (the
    leaves it accumulates into), ``held`` (the tensors it keeps alive, counted only when asked:
    :meth:`WeightGradWork.held_storages`); or ``run``, a
    callable doing its own W (:func:`defer_weight_grad`)."""

    __slots__ = ("roots", "params", "held", "run")

    def __init__(self, roots: Optional[Callable[[], list]], params: tuple, held: tuple,
                 run: Optional[Callable[[], None]] = None) -> None:
        self.roots, self.params, self.held, self.run = roots, params, held, run


def defer_weight_grad(run: Callable[[], None]) -> bool:
    """Queue ``run`` as part of the W of the split B in progress; ``True`` if queued, ``False`` if no split B is
    running (the caller then does its weight-gradient work at once).

    For autograd nodes that do their own weight-gradient pass, e.g. a CUDA-graphed layer replaying its W graph
    (``graphs``: the trainer passes this function to the capture).  Called from the node's backward during B;
    ``WeightGradWork.run()`` calls ``run()`` in the order B queued it, among the deferred ops' records.  ``run``
    accumulates into parameters that no other record of the microbatch touches.
    """
    records = _recorder
    if records is None:
        return False
    records.append(_Record(None, (), (), run=run))
    return True


class _Bridge(torch.autograd.Function):
    """Runs one op as its own autograd graph: ``op(x)`` with the parameters; backward = B part (+ a record)."""

    @staticmethod
    def forward(ctx, anchor, op, params, through):
        local_in = anchor.detach().requires_grad_() if through else None
        with torch.enable_grad():
            out = op(local_in)
        ctx.local_in, ctx.params, ctx.edge = local_in, params, get_gradient_edge(out)
        ctx.held = () if local_in is None else (local_in,)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        local_in, edge, records = ctx.local_in, ctx.edge, _recorder
        del ctx.edge
        if records is None:  # unsplit backward: everything now, as the plain op would
            _engine([edge], [grad])
            return (None if local_in is None else local_in.grad), None, None, None
        records.append(_Record(lambda: [(edge, grad)], ctx.params, ctx.held + (grad,)))
        if local_in is None:
            return None, None, None, None
        (grad_in,) = _engine([edge], [grad], [local_in], keep_graph=True, accumulate=False)
        return grad_in, None, None, None


class _LinearBridge(torch.autograd.Function):
    """``F.linear`` on a contiguous 2-D / 3-D input requiring grad, with autograd's own backward formulas written
    out (no graph of its own): B computes ``grad_x = grad @ W`` and records ``(x, grad)``; W computes
    ``grad_W = grad^T @ x`` and ``grad_b = grad.sum(0)`` (over ``[n, out]`` / ``[n, in]`` views, ``n = s*b``) and
    accumulates them through the parameters' ``AccumulateGrad``.  The same kernels on the same operands as
    ``addmm`` / ``mm`` backward: bitwise the plain op's gradients (tests/runtime/test_split_backward.py)."""

    @staticmethod
    def forward(ctx, x, params):
        weight, bias = params
        ctx.save_for_backward(x)
        ctx.params = params
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (x,), (weight, bias) = ctx.saved_tensors, ctx.params
        x2d = x.view(-1, x.shape[-1]) if x.dim() == 3 else x
        g2d = grad.reshape(-1, grad.shape[-1]) if x.dim() == 3 else grad
        grad_in = g2d.mm(weight)
        records = _recorder
        pairs = lambda: [(get_gradient_edge(p), g) for p, g in  # noqa: E731
                         zip((weight, bias), _linear_weight_grads(x2d, g2d, weight, bias))
                         if p is not None and p.requires_grad]
        params = tuple(p for p in (weight, bias) if p is not None and p.requires_grad)
        record = _Record(pairs, params, (x, g2d))
        if records is None:
            _backward_records([record])
        else:
            records.append(record)
        return grad_in.view(x.shape) if x.dim() == 3 else grad_in, None


def _linear_weight_grads(x2d, g2d, weight, bias) -> tuple:
    """``(grad_W, grad_b)`` of ``F.linear`` from its input ``x2d`` ``[n, in]`` and output gradient ``g2d``
    ``[n, out]``: ``g2d^T @ x2d`` and ``g2d.sum(0)`` (``grad_b`` None without a bias).  For DTensor operands in a
    tensor-parallel layout (:func:`_local_linear_layout`) the same formulas run on the local shards, wrapped back
    with the parameters' placements: no collective (a DTensor op could redistribute, and W would then
    communicate)."""
    if _local_linear_layout(x2d, g2d, weight, bias):
        from torch.distributed.tensor import DTensor
        gl, xl = g2d.to_local(), x2d.to_local()
        wrap = lambda t, p: DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,  # noqa: E731
                                               shape=p.shape, stride=p.stride())
        return wrap(gl.t().mm(xl), weight), None if bias is None else wrap(gl.sum(0), bias)
    return g2d.t().mm(x2d), None if bias is None else g2d.sum(0)


def _local_linear_layout(x2d, g2d, weight, bias) -> bool:
    """Whether ``F.linear``'s weight gradients are the local formulas on the local shards: all DTensors on one
    1-D mesh, and either column-parallel (``x`` ``Replicate``, ``W`` sharded on rows -- ``Shard(0)`` or
    ``_StridedShard(0)`` --, ``g`` sharded on its last dimension the same way, a bias sharded like ``W``) or
    row-parallel (``x`` ``Shard(1)``, ``W`` ``Shard(1)``, ``g`` and a bias ``Replicate``): then each rank's
    ``g_local^T @ x_local`` is its shard of ``g^T @ x`` (Shoeybi et al. 2019, arXiv:1909.08053, section 3)."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # torch without distributed
        return False
    if not all(isinstance(t, DTensor) for t in (x2d, g2d, weight)) or (bias is not None and not isinstance(bias,
                                                                                                         DTensor)):
        return False
    if weight.device_mesh.ndim != 1 or any(t.device_mesh != weight.device_mesh for t in (x2d, g2d)):
        return False
    (px,), (pg,), (pw,) = x2d.placements, g2d.placements, weight.placements
    pb = None if bias is None else bias.placements[0]
    sharded = lambda p, d: isinstance(p, (Shard, _StridedShard)) and p.dim == d  # noqa: E731
    same = lambda p, q: type(p) is type(q) and getattr(p, "split_factor", 1) == getattr(q, "split_factor", 1)  # noqa: E731
    if isinstance(px, Replicate) and sharded(pw, 0) and sharded(pg, 1) and same(pw, pg):
        return pb is None or (sharded(pb, 0) and same(pb, pw))
    if sharded(px, 1) and isinstance(px, Shard) and pw == Shard(1) and isinstance(pg, Replicate):
        return pb is None or isinstance(pb, Replicate)
    return False


def _fast_linear(input, weight, bias) -> bool:
    """The cases where :class:`_LinearBridge`'s formulas are autograd's for ``F.linear``: row-major operands with
    exactly row-major strides (autograd's ``mm`` backward picks its formula by the strides, and a size-1 dimension
    can carry any stride), no autocast, one dtype, ``in_features > 1``; others take the generic bridge.  A 3-D
    input without a bias (plain ``F.linear`` runs ``matmul`` there, whose backward is not these kernels) is taken
    only for a DTensor weight (tensor parallelism), so that W runs on local shards (:func:`_linear_weight_grads`);
    its gradients then equal the unsplit ones up to rounding, not bitwise."""
    return (input.requires_grad and input.dim() in (2, 3) and input.is_contiguous() and weight.dim() == 2
            and weight.stride() == (weight.shape[1], 1) and weight.shape[1] > 1 and input.dtype == weight.dtype
            and (input.dim() == 3 or input.stride() == (input.shape[1], 1))
            and (bias is None or (bias.dim() == 1 and bias.dtype == weight.dtype))
            and (input.dim() == 2 or bias is not None or _is_dtensor(weight))
            and not torch.is_autocast_enabled(input.device.type))


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _leaves(*tensors) -> Optional[tuple]:
    """The tensors requiring grad if every given tensor is None or a leaf, else None (no deferral)."""
    if any(t is not None and (not isinstance(t, torch.Tensor) or t.grad_fn is not None) for t in tensors):
        return None
    params = tuple(t for t in tensors if t is not None and t.requires_grad)
    return params or None


def _defer(x: torch.Tensor, params: tuple, op: Callable) -> torch.Tensor:
    through = x.requires_grad
    anchor = x if through else _anchor(x.device)
    return _Bridge.apply(anchor, (lambda xi: op(xi if through else x)), params, through)


def _linear(input, weight, bias=None):
    params = _leaves(weight, bias)
    if params is None or not isinstance(input, torch.Tensor):
        return F.linear(input, weight, bias)
    if _fast_linear(input, weight, bias):
        return _LinearBridge.apply(input, (weight, bias))
    return _defer(input, params, lambda x: F.linear(x, weight, bias))


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    params = _leaves(weight, bias)
    if params is None or not isinstance(input, torch.Tensor):
        return F.layer_norm(input, normalized_shape, weight, bias, eps)
    return _defer(input, params, lambda x: F.layer_norm(x, normalized_shape, weight, bias, eps))


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    params = _leaves(weight)
    if params is None or not isinstance(input, torch.Tensor):
        return F.rms_norm(input, normalized_shape, weight, eps)
    return _defer(input, params, lambda x: F.rms_norm(x, normalized_shape, weight, eps))


def _embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
    params = _leaves(weight)
    args = (padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    if params is None or max_norm is not None or sparse or not isinstance(input, torch.Tensor):
        return F.embedding(input, weight, *args)
    return _defer(input, params, lambda x: F.embedding(x, weight, *args))


_HANDLERS = {F.linear: _linear, F.layer_norm: _layer_norm, F.rms_norm: _rms_norm, F.embedding: _embedding}


_handling = [0]
"""Depth of deferred-op handling: an op run by a handler (or under a nested deferral) is not deferred again."""


_active = [0]
"""Deferral modes entered and not left (:func:`deferring`)."""


def deferring() -> bool:
    """A forward runs under layer-level weight-gradient deferral now (:func:`weight_grad_deferral` or
    :func:`enable_layer_deferral`): a segment recomputed later must run under it again
    (:mod:`engine.runtime.recompute`)."""
    return _active[0] > 0


class _DeferralMode(TorchFunctionMode):
    def __enter__(self):
        mode = super().__enter__()
        _active[0] += 1
        return mode

    def __exit__(self, *exc):
        _active[0] -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        handler = _HANDLERS.get(func)
        if handler is None or not torch.is_grad_enabled() or _handling[0]:
            return func(*args, **(kwargs or {}))
        _handling[0] += 1
        try:
            return handler(*args, **(kwargs or {}))
        finally:
            _handling[0] -= 1


def weight_grad_deferral():
    """Context manager: ops run inside it (a chunk's forward) defer their weight gradients (``mode="layer"``).

    Deferred: ``F.linear``, ``F.layer_norm``, ``F.rms_norm``, ``F.embedding`` (and the modules calling them) whose weight / bias
    are leaves requiring grad, with grad enabled; anything else runs unchanged.  The forward values are the plain
    ops' values.  Without a split B (:func:`backward_input_step`) the deferred ops backpropagate fully, so a plain
    ``loss.backward()`` still gives the unsplit gradients.  Use: ``with weight_grad_deferral(): y = model(x)``.
    """
    return _DeferralMode()


class _DeferralHooks:
    """The forward hooks of :func:`enable_layer_deferral`; ``remove()`` takes them off."""

    def __init__(self, module: torch.nn.Module):
        self._modes: List[_DeferralMode] = []
        self._handles = [module.register_forward_pre_hook(self._enter),
                         module.register_forward_hook(self._exit, always_call=True)]

    def _enter(self, module, args):
        mode = _DeferralMode()
        mode.__enter__()
        self._modes.append(mode)

    def _exit(self, module, args, output):
        self._modes.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def enable_layer_deferral(module: torch.nn.Module) -> _DeferralHooks:
    """Make every forward of ``module`` run under :func:`weight_grad_deferral` (forward hooks; user code
    unchanged).  Returns an object whose ``remove()`` undoes it.  Raises ``TypeError`` for a non-module."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"enable_layer_deferral: expected a torch.nn.Module, got {type(module).__name__}")
    return _DeferralHooks(module)


# ---- the W handle ------------------------------------------------------------------------------------------------

class WeightGradWork:
    """The W part of one (model chunk, microbatch) backward, returned by :func:`backward_input_step`.

    ``run()`` computes the weight gradients and accumulates them into ``.grad`` (once; a second call raises
    ``RuntimeError``), then drops everything it held.  ``mode`` is ``"layer"``, ``"generic"``, ``"full"`` (B found
    no input path: W is the whole backward) or ``"none"`` (nothing to do).  ``held_bytes()`` is the size of the
    tensors the handle knows it keeps alive until W: in layer mode the deferred ops' output gradients and inputs
    (distinct storages, exact for linear / embedding ops); in generic mode only the recorded gradients at the
    intermediates -- the retained graph's saved tensors come on top and are not counted.
    """

    mode = "none"

    def __init__(self) -> None:
        self.done = False

    def run(self) -> None:
        if self.done:
            raise RuntimeError(f"WeightGradWork.run: the W of this microbatch ({self.mode} mode) already ran; run "
                               "each W once, after its B")
        self.done = True
        self._run()

    def _run(self) -> None:
        pass

    def held_bytes(self) -> int:
        return sum(self.held_storages().values())

    def held_storages(self) -> dict:
        """``{storage data_ptr: bytes}`` of what :meth:`held_bytes` counts (to merge with other counts)."""
        return {}


def _sizes(tensors) -> dict:
    """``{storage data_ptr: bytes}`` of ``tensors`` (wrapper subclasses such as DTensor counted by what they wrap:
    :mod:`engine.runtime.storage`)."""
    sizes: dict = {}
    for t in tensors:
        sizes.update(storage_sizes(t))
    return sizes


W_BATCH_BYTES = 64 << 20
"""Layer-mode W backpropagates its records in as few autograd calls as keep the weight gradients computed ahead
of accumulation under this many bytes (one call costs tens of microseconds; a record's gradients are
parameter-sized)."""


def _run_records(records: list) -> None:
    """Backpropagate deferred ops' W, restricted to their parameters.  Records sharing a parameter go in one
    call (a shared weight's contributions are summed by autograd, in B's order, and accumulated once); the others
    in batches of at most :data:`W_BATCH_BYTES` of weight gradients; a ``run`` record (:func:`defer_weight_grad`)
    runs in its place in B's order."""
    uses: dict = {}
    for r in records:
        for p in r.params:
            uses[id(p)] = uses.get(id(p), 0) + 1
    shared, batch, size = [], [], 0
    for r in records:
        if r.run is not None:  # its own W, in B's order: the batch before it goes first
            _backward_records(batch)
            batch, size = [], 0
            r.run()
            continue
        if any(uses[id(p)] > 1 for p in r.params):
            shared.append(r)
            continue
        batch.append(r)
        size += sum(p.numel() * p.element_size() for p in r.params)
        if size >= W_BATCH_BYTES:
            _backward_records(batch)
            batch, size = [], 0
    _backward_records(batch)
    _backward_records(shared)


def _backward_records(records: list) -> None:
    if not records:
        return
    roots = [pair for r in records for pair in r.roots()]
    params = list({id(p): p for r in records for p in r.params}.values())
    _engine([e for e, _ in roots], [g for _, g in roots], params)


class _LayerWork(WeightGradWork):
    mode = "layer"

    def __init__(self, records: list) -> None:
        super().__init__()
        self.records = records

    def _run(self) -> None:
        records, self.records = self.records, []
        _run_records(records)

    def held_storages(self) -> dict:
        return _sizes(t for r in self.records for t in r.held)


class _FullWork(WeightGradWork):
    mode = "full"

    def __init__(self, root: GradientEdge, grad: torch.Tensor) -> None:
        super().__init__()
        self.root, self.grad = root, grad

    def _run(self) -> None:
        root, grad = self.root, self.grad
        self.root = self.grad = None
        _engine([root], [grad])

    def held_storages(self) -> dict:
        return {} if self.grad is None else _sizes([self.grad])


class _Capture:
    """Pre-hook on an intermediate: records the gradients arriving in B; replays them in W (replacing what
    the intermediate's tensor hooks made of the replayed root gradients)."""

    __slots__ = ("node", "targets", "grads", "order", "handle", "replay", "clock")

    def __init__(self, node, targets: list, clock: list) -> None:
        self.node, self.targets, self.clock = node, targets, clock
        self.grads, self.order, self.replay = None, -1, False
        self.handle = node.register_prehook(self)

    def __call__(self, grad_outputs):
        if self.replay:
            return self.grads
        self.grads, self.order = grad_outputs, len(self.clock)
        self.clock.append(self)
        return None


class _GraphWork(WeightGradWork):
    mode = "generic"

    def __init__(self, captures: List[_Capture], records: list) -> None:
        super().__init__()
        self.captures, self.records = captures, records

    def _run(self) -> None:
        captures, records = self.captures, self.records
        self.captures = self.records = []
        try:
            roots = _replay_intermediates(sorted((c for c in captures if c.grads is not None),
                                                 key=lambda c: c.order))
            if roots:
                _engine([edge for edge, _ in roots.values()], [g for _, g in roots.values()])
        finally:
            for c in captures:
                c.handle.remove()
        _run_records(records)

    def held_storages(self) -> dict:
        return _sizes([*(t for r in self.records for t in r.held),
                       *(g for c in self.captures for g in (c.grads or ()) if g is not None)])


def _replay_intermediates(captures: Sequence[_Capture]) -> dict:
    """Phase 1 of generic W: re-run each intermediate (in B's execution order) from its recorded gradients,
    computing only its edges leaving the input path; return ``{target key: (edge, summed gradient)}``.

    The edge gradients are read by a post-hook on the intermediate (as computed, before the targets' tensor hooks,
    which phase 2 applies once); the targets are only captured, so autograd computes those edges -- and, where a
    target is also reached from the intermediate's input-path edges (a parameter used by two ops on the input path,
    e.g. a module applied twice), the input path down to that other use, whose values are discarded (every
    intermediate replays B's gradients).  The graph is retained (such a segment may run more than once); it is
    freed when W drops it.  Parameters' tensor hooks are held back meanwhile (capturing at a leaf would run them)."""
    sums: dict = {}
    for c in captures:  # an intermediate reached again in another's replay runs from its B gradients too
        c.replay = True
    for c in captures:
        slots = [i for i, g in enumerate(c.grads) if g is not None]
        targets = {(id(n), nr): GradientEdge(n, nr) for _, n, nr in c.targets}
        seen: list = []
        post = c.node.register_hook(lambda grad_inputs, grad_outputs, seen=seen: seen.append(grad_inputs))
        try:
            with _hooks_held_back([n for _, n, _ in c.targets]):
                _engine([GradientEdge(c.node, i) for i in slots], [c.grads[i] for i in slots],
                        list(targets.values()), keep_graph=True, accumulate=False)
        finally:
            post.remove()
        for k, n, nr in c.targets:
            g = seen[0][k] if seen else None
            if g is not None:
                key = (id(n), nr)
                sums[key] = (targets[key], g) if key not in sums else (targets[key], sums[key][1] + g)
    for c in captures:
        c.grads = None
    return sums


@contextlib.contextmanager
def _hooks_held_back(nodes):
    """Empty the tensor-hook dicts of the leaves among ``nodes`` (``AccumulateGrad``) and restore them in order."""
    held = []
    for n in nodes:
        hooks = getattr(getattr(n, "variable", None), "_backward_hooks", None)
        if hooks:
            held.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in held:
            hooks.update(items)


# ---- graph analysis and B ----------------------------------------------------------------------------------------

class _Graph:
    """The chunk's backward graph from one root, cut at the input nodes.

    ``on_path[node]``: an input is reachable from ``node`` (inputs themselves count); ``edges[node]``: its
    ``(child, input_nr)`` edges.  Built by an iterative depth-first walk; can be extended from a new root
    (:meth:`walk`) reusing what is known.
    """

    def __init__(self, stops: set) -> None:
        self.stops = stops
        self.on_path: dict = {}
        self.edges: dict = {}

    def walk(self, root) -> bool:
        on_path, edges, stops = self.on_path, self.edges, self.stops
        stack = [(root, False)]
        while stack:
            node, finished = stack.pop()
            if finished:
                on_path[node] = any(on_path[c] for c, _ in edges[node])
            elif node not in on_path:
                if node in stops:
                    on_path[node] = True
                    continue
                edges[node] = [(c, nr) for c, nr in node.next_functions if c is not None]
                stack.append((node, True))
                stack.extend((c, False) for c, _ in edges[node] if c not in on_path)
        return on_path[root]

    def has_weights(self) -> bool:
        """A leaf requiring grad other than the inputs (and deferral anchors) is reached."""
        anchors = {id(a) for a in _anchors.values()}
        return any(hasattr(n, "variable") and n not in self.stops and id(n.variable) not in anchors
                   for n in self.on_path)

    def intermediates(self) -> list:
        """``(node, [(k, child, nr), ...])`` for each input-path node with edges leaving the path (``k``: the
        index of the edge in ``node.next_functions``)."""
        on_path = self.on_path
        return [(n, off) for n, ok in on_path.items() if ok and n not in self.stops
                for off in [[(k, c, nr) for k, (c, nr) in enumerate(n.next_functions)
                             if c is not None and not on_path[c]]] if off]


def _input_list(input_tensor) -> tuple:
    unwrap = not isinstance(input_tensor, list)
    return ([input_tensor] if unwrap else list(input_tensor)), unwrap


def _loss_root(output_tensor, output_tensor_grad, config):
    """``(root tensor, its gradient)`` as :func:`~engine.runtime.step.backward_step` backpropagates them: the
    first output / gradient of lists; on the loss stage (gradient None) the loss scaled by ``grad_scale_func``
    and a gradient of ones."""
    out = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
    grad = output_tensor_grad[0] if isinstance(output_tensor_grad, list) else output_tensor_grad
    if grad is None:
        if out.numel() != 1:
            raise ScheduleContractError(
                f"backward_input_step: the loss of this microbatch has shape {list(out.shape)} ({out.numel()} "
                "elements) but the loss stage backpropagates from a scalar: loss_func must return a one-element "
                "loss as its first value; reduce it there, e.g. return (loss.sum(), ...)")
        if config.grad_scale_func is not None:
            out = config.grad_scale_func(out)
        grad = torch.ones_like(out)
    return out, grad


def _generic_step(inputs: list, unwrap: bool, root: torch.Tensor, grad: torch.Tensor, graph: _Graph):
    """Generic B: input gradients now, the weight side captured for :class:`_GraphWork`."""
    wanted = [x for x in inputs if x is not None and x.requires_grad]
    if root.grad_fn is None:  # the output is a leaf: the input itself (identity chunk) or a weight
        grads = [grad if x is root else None for x in inputs]
        work = WeightGradWork() if any(x is root for x in inputs) else _FullWork(get_gradient_edge(root), grad)
        return (grads[0] if unwrap else grads), work
    if not wanted or not graph.walk(root.grad_fn):  # no input path: W is the whole backward
        grads = [None] * len(inputs)
        return (grads[0] if unwrap else grads), _FullWork(get_gradient_edge(root), grad)
    clock: list = []
    captures = [_Capture(node, off, clock) for node, off in graph.intermediates()]
    records: list = []
    try:
        with _recording(records):
            got = _engine([get_gradient_edge(root)], [grad], wanted, keep_graph=bool(captures), accumulate=False)
    except BaseException:
        for c in captures:
            c.handle.remove()
        raise
    by_id = {id(x): g for x, g in zip(wanted, got)}
    grads = [None if x is None else by_id.get(id(x)) for x in inputs]
    return (grads[0] if unwrap else grads), _GraphWork(captures, records)


def _reaches_weights(graph: _Graph, out: torch.Tensor) -> bool:
    """Auto mode's test: the output is a leaf, or its graph reaches a leaf outside deferred ops."""
    if out.grad_fn is None:
        return True
    graph.walk(out.grad_fn)
    return graph.has_weights()


def segment_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     inputs: Sequence[torch.Tensor]) -> list:
    """Backpropagate a graph built inside an autograd node's backward -- a segment recomputed from its inputs
    (:mod:`engine.runtime.recompute`) -- from ``outputs`` with ``grads``; return the gradients of ``inputs`` (leaves
    requiring grad, in order; None where the outputs do not depend on one).

    Outside a split B (the unsplit backward, or a split's W) every leaf the segment reaches accumulates, as the
    plain backward would.  Inside a split B (:func:`backward_input_step` running) the segment is split by the auto
    rule on its own graph: with no parameter reached outside deferred ops (the segment was recomputed under the
    deferral) everything else runs now and the deferred ops record their W into the B in progress, in its order;
    otherwise (one differentiable output) the segment's graph is split like a generic chunk and its W is queued
    into the B's W in place (:func:`defer_weight_grad`).  So each parameter's gradient of a microbatch is computed
    once, in B or in W, from the same operands as without the recomputation.
    """
    records = _recorder
    if records is not None and len(outputs) == 1 and outputs[0].grad_fn is not None:
        graph = _Graph({get_gradient_edge(x).node for x in inputs})
        if _reaches_weights(graph, outputs[0]):
            got, work = _generic_step(list(inputs), False, outputs[0], grads[0], graph)
            records.append(_Record(None, (), tuple(work.held_storages().items()), run=work.run))
            return got
    _engine(outputs, grads)
    return [x.grad for x in inputs]


def backward_input_step(input_tensor, output_tensor, output_tensor_grad, config, mode: str = "auto"):
    """B of one (model chunk, microbatch): return ``(input_tensor_grad, work)``; ``work.run()`` is its W.

    Arguments as :func:`~engine.runtime.step.backward_step` (newer call form): ``input_tensor`` the tensor given to
    ``set_input_tensor`` (``[s, b, h]``, a leaf requiring grad as received from P2P; None on the first stage; or a
    list), ``output_tensor`` the chunk's output (``[s, b, h]``, possibly shrunk to one element by
    ``deallocate_output_tensor``; on the loss stage the scalar loss; or a one-element list),
    ``output_tensor_grad`` the gradient received from the next stage (same shape as the undeallocated output;
    None on the loss stage, where ``config.grad_scale_func`` (if set) is applied to the loss, once, as
    ``backward_step`` does).  ``mode``: ``"layer"``, ``"generic"`` or ``"auto"`` (module docstring).

    Returns the input gradient as ``backward_step`` does (None for a None input or one the output does not depend
    on; a list if ``input_tensor`` was a list) and a :class:`WeightGradWork`.  Layer mode is ``backward_step``
    with the deferred ops recording (so ``input_tensor.grad`` is set as there); generic mode returns the gradient
    without setting ``.grad`` on the input.  Nothing is accumulated into parameters before ``work.run()`` except,
    in layer mode, parameters used outside deferred ops (their gradients are computed in B).

    The executor must call ``work.run()`` exactly once per B, for each model chunk in microbatch order (that keeps
    1F1B's accumulation order: bitwise-equal gradients), and before the chunk's gradients are synchronised
    (``grad_sync_func`` / ``finalize_model_grads_func`` follow the chunk's last W, not its last B).

    Raises ``ValueError`` for an unknown ``mode``, :class:`~engine.runtime.step.ScheduleContractError` for a
    non-scalar loss on the loss stage, and what autograd raises (e.g. a graph already freed by an unsplit
    backward).
    """
    if mode not in MODES:
        raise ValueError(f"backward_input_step: mode={mode!r} is not one of {MODES}; use 'layer' for chunks run "
                         "under weight_grad_deferral, 'generic' for any chunk, or 'auto'")
    out = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
    if mode != "layer" and isinstance(out, torch.Tensor) and out.requires_grad:
        inputs, unwrap = _input_list(input_tensor)
        graph = _Graph({get_gradient_edge(x).node for x in inputs if x is not None and x.requires_grad})
        if mode == "generic" or _reaches_weights(graph, out):
            timers = config.timers
            if timers is not None:
                timers("backward-compute", log_level=2).start()
            root, grad = _loss_root(output_tensor, output_tensor_grad, config)
            result = _generic_step(inputs, unwrap, root, grad, graph)
            if timers is not None:
                timers("backward-compute").stop()
            return result
    records: list = []
    with _recording(records):
        input_tensor_grad = backward_step(input_tensor, output_tensor, output_tensor_grad, config)
    return input_tensor_grad, (_LayerWork(records) if records else WeightGradWork())
