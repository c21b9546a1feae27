"""Tensor parallelism inside pipeline stages (``parallel.tensor: T``) on ``torch.distributed.tensor.parallel``.

Each model chunk's blocks are parallelised with ``parallelize_module`` on the ``tp`` dimension of the job's
``DeviceMesh`` (:func:`engine.runtime.process_groups.device_mesh`; Megatron's rank order, so the ``T`` ranks of one
stage are consecutive and adjacent stages pair the same tensor-parallel rank):

* each block follows its family's plan (:attr:`engine.training.models.registry.FamilySpec.tensor_parallel`):
  attention's query / key / value projections column-parallel (each rank owns ``heads / T`` heads, and
  ``num_query_groups / T`` key / value groups), the output projection row-parallel (one all-reduce of
  ``[s, b, h]`` in the forward); the MLP's input projections column-parallel, its output projection row-parallel
  (Shoeybi et al. 2019, "Megatron-LM", arXiv:1909.08053, section 3).  The blocks read the local head count from
  the tensor shapes, so one block class serves every ``T``.
* a fused ``qkv`` (``[3h, h]``, rows ``q | k | v``; style ``fused_qkv``): a plain ``Shard(0)`` would give rank 0
  all of ``q`` and half of ``k``.  The weight and bias are instead distributed with torch's strided sharding
  ``_StridedShard(0, split_factor=3)``: the dimension is cut into its three blocks and each block is sharded over
  the ``T`` ranks, so rank ``i`` holds ``[q_i; k_i; v_i]`` (its heads of each block) -- exactly what the local
  ``view(s, b, 3, heads / T, d)`` needs.  The parameter stays one fused ``[3h, h]`` DTensor: its name, global
  shape and full layout (``full_tensor()``) are the ``T = 1`` ones, so state-dict keys do not change.
* word embedding: vocabulary-parallel (``RowwiseParallel`` on ``nn.Embedding``, ``Shard(0)`` of ``[V, h]``; the
  output all-reduced); the output head (the tied embedding or the last stage's copy) is sharded the same way, so
  the tied-gradient sum over the embedding group pairs equal shards.  ``model.vocab_size`` must be a multiple of
  ``T`` (refused otherwise, not padded: padding would change the checkpoint shapes).
* the loss: the logits ``[s, b, V/T]`` are gathered (``Replicate``: one all-gather per microbatch, full logits
  on each rank) and the loss is computed in plain torch.  ``loss_parallel`` is not used: it needs the backward
  to run inside its context, and the schedules run each backward long after the forward, outside it.
* mixture-of-experts layers (:class:`engine.moe.MoELayer`, in a MoE family's blocks): not in the block plan; each
  routes its share of the sequence and keeps its experts whole (:meth:`engine.moe.MoELayer.shard_tokens`, applied
  by :func:`engine.training.parallel.parallelism.parallelize`).
* norms, the position embedding and the residual stream stay replicated plain tensors; their gradients are the
  same on every tensor-parallel rank (their inputs and output gradients are), so no extra reduction is needed.
  Activations between stages are the replicated ``[s, b, h]`` plain tensors.
* ``parallel.sequence_parallel`` (Korthikanti et al. 2022, arXiv:2205.05198, section 4.2.2): the residual stream,
  the block norms and the activations sent between stages are this rank's sequence shard ``[s/T, b, h]`` (dim 0 of
  pipecast's ``[s, b, h]``).  Norms use torch's ``SequenceParallel(sequence_dim=0)`` (weights ``Replicate``
  DTensors whose gradients come out ``Partial`` and are all-reduced by
  :func:`engine.training.parallel.dtensor.align_grads`), column-parallel
  inputs ``Shard(0)`` (an all-gather along the sequence), row-parallel outputs ``Shard(0)`` (a reduce-scatter
  replaces the all-reduce).  The embedding output is cut to the shard after the (replicated) embedding, the final
  norm's input all-gathered before it; the schedules' P2P shapes are ``[s/T, b, h]`` (the trainer's
  ``ModelParallelConfig`` carries ``sequence_parallel`` and ``tensor_model_parallel_size``), so 1/T of the bytes.

Gradients of sharded parameters are DTensors; :func:`engine.training.parallel.dtensor.local` gives the local shard
to the flat data-parallel and tied-embedding reductions, and the norm clip
(:func:`engine.training.parallel.grad_norm.clip_grad_norm_`) sums local squares with one all-reduce over the
tensor-parallel group (replicated parameters counted once).

Split backward (``zb_h1``, ``zbv``, ``dualpipev``, any schedule with B / W passes) runs the layer-level deferral of
:mod:`engine.runtime.split_backward` (``"auto"`` picks it: every parameter sits in a deferred op).  Its linear bridge
takes the DTensor projections and heads: B computes the input gradient with DTensor ops (``grad @ W``, then the
input hooks' all-reduces: *every* tensor-parallel collective of the backward runs in B), W computes
``grad^T @ x`` and ``grad.sum(0)`` on the local shards (``to_local``; column-parallel: ``x`` replicated, the
gradient's and ``W``'s rows sharded alike; row-parallel: ``x`` and ``W`` sharded on ``in``, the gradient and
bias replicated) and wraps them with the parameters' placements -- no collective in W
(tests/training/parallel/test_tensor_parallel.py counts them).  The vocabulary-parallel embedding runs behind the
deferral's generic bridge: its W is the DTensor embedding backward (a replicated ``[V, h]`` gradient, local).
Held from B to W, per linear: the input (column-parallel: the replicated ``[s, b, h]``; row-parallel: the
``[s, b, in/T]`` shard) and the output gradient (``[s, b, out/T]`` / the replicated ``[s, b, h]``); per norm and
embedding as at ``T = 1``.  Each W runs in the plan's order, the same on every tensor-parallel rank of a stage.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


__all__ = ["parallelize_chunks", "vocab_parallel_logits"]


def _styles():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedQKVColwise(ColwiseParallel):
        """Column-parallel ``[3h, h]`` linear whose ``q``, ``k`` and ``v`` row blocks are each sharded
        (``_StridedShard(0, split_factor=3)``); the output ``[s, b, 3h/T]`` is handed on as the local tensor."""

        def __init__(self, **kw):
            super().__init__(output_layouts=_StridedShard(2, split_factor=3), **kw)
            self.src_data_rank = None

        def _partition_linear_fn(self, name, module, device_mesh):
            from torch.distributed.tensor import distribute_tensor
            for pname, param in list(module.named_parameters()):
                dt = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=3)], src_data_rank=None)
                module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

    def col(**kw):
        style = ColwiseParallel(**kw)
        style.src_data_rank = None  # every rank built the same full weights: slice locally, no broadcast
        return style

    def row(**kw):
        style = RowwiseParallel(**kw)
        style.src_data_rank = None
        return style

    return FusedQKVColwise, col, row, Replicate


def _block_plan(plan: dict, sequence_parallel: bool = False) -> dict:
    """The ``parallelize_module`` plan of one block from its family's plan (submodule -> style,
    :data:`engine.training.models.registry.TP_STYLES`).  With ``sequence_parallel`` (the sequence is dim 0 of
    ``[s, b, h]``) the norms get ``SequenceParallel(sequence_dim=0)`` (replicated weights, the local shard in,
    a ``Shard(0)`` DTensor out), the column-parallel inputs are declared ``Shard(0)`` (an all-gather along the
    sequence) and the row-parallel outputs ``Shard(0)`` (a reduce-scatter instead of the all-reduce), as in
    torch's tensor-parallel tutorial; without it the norms stay plain replicated modules."""
    fused, col, row, _ = _styles()
    cin, rout, norms = {}, {}, {}
    if sequence_parallel:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import SequenceParallel
        cin, rout = {"input_layouts": Shard(0)}, {"output_layouts": Shard(0)}
        norms = {n: SequenceParallel(sequence_dim=0) for n, style in plan.items() if style == "norm"}
    build = {"colwise": lambda: col(**cin), "fused_qkv": lambda: fused(**cin), "rowwise": lambda: row(**rout)}
    return {**norms, **{n: build[style]() for n, style in plan.items() if style != "norm"}}


def _sequence_ends(chunk: nn.Module, tp_mesh) -> None:
    """Sequence parallelism at a chunk's ends: the embedding's replicated output ``[s, b, h]`` is cut to this
    rank's shard ``[s/T, b, h]`` (local; the backward all-gathers), and the final norm's input shard is
    all-gathered to the replicated ``[s, b, h]`` the vocabulary-parallel head and the loss read (its backward
    keeps this rank's slice of the replicated gradient)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module
    if chunk.embedding is not None:
        parallelize_module(chunk.embedding, tp_mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                                        desired_output_layouts=Shard(0)))
    if getattr(chunk, "final_norm", None) is not None:
        parallelize_module(chunk.final_norm, tp_mesh, PrepareModuleInput(input_layouts=Shard(0),
                                                                        desired_input_layouts=Replicate(),
                                                                        use_local_output=True))


def _holds(block: nn.Module, name: str) -> bool:
    try:
        block.get_submodule(name)
    except AttributeError:
        return False
    return True


def _shard_rows(embedding: nn.Embedding, mesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor
    w = embedding.weight
    embedding.weight = nn.Parameter(distribute_tensor(w.detach(), mesh, [Shard(0)], src_data_rank=None),
                                    requires_grad=w.requires_grad)


def parallelize_chunks(chunks, tp_mesh, sequence_parallel: bool = False) -> None:
    """Parallelise this rank's model chunks in place over ``tp_mesh`` (the ``tp`` sub-mesh; local, no collective:
    every rank holds the same full initial weights and keeps its slices).  Keeps the ``shared_embedding`` /
    ``shared_embedding_copy`` marks and the V placement's one shared tied ``Parameter``.  ``sequence_parallel``:
    blocks and stage boundaries hold the ``[s/T, b, h]`` sequence shard (:func:`_block_plan`,
    :func:`_sequence_ends`)."""
    from torch.distributed.tensor.parallel import parallelize_module
    _, _, row, replicate = _styles()
    first = next((c for c in chunks if c.embedding is not None), None)
    shared_heads = {id(c) for c in chunks if getattr(c, "head", None) is not None and first is not None
                    and c.head.word.weight is first.embedding.word.weight}
    for chunk in chunks:
        head = getattr(chunk, "head", None)
        shared = id(chunk) in shared_heads
        marks = {n: (getattr(p, "shared_embedding", False), getattr(p, "shared_embedding_copy", False))
                 for n, p in chunk.named_parameters(remove_duplicate=False)}
        for block in chunk.layers:  # a family's plan names what its blocks may hold (a MoE family: mlp or moe)
            plan = {n: style for n, style in chunk.family.tensor_parallel.items() if _holds(block, n)}
            parallelize_module(block, tp_mesh, _block_plan(plan, sequence_parallel))
        if chunk.embedding is not None:
            parallelize_module(chunk.embedding, tp_mesh, {"word": row(input_layouts=replicate())})
        if sequence_parallel:
            _sequence_ends(chunk, tp_mesh)
        if shared:  # V placement: the head uses the (now sharded) embedding Parameter itself
            head.word.weight = first.embedding.word.weight
        elif head is not None:
            _shard_rows(head.word, tp_mesh)
        for n, p in chunk.named_parameters(remove_duplicate=False):
            p.shared_embedding, p.shared_embedding_copy = marks.get(n, (False, False))


def vocab_parallel_logits(x: torch.Tensor, weight) -> torch.Tensor:
    """Logits ``[s, b, V]`` (plain, replicated) from the replicated final hidden state ``x`` ``[s, b, h]`` and the
    vocabulary-sharded head ``weight`` (DTensor ``[V, h]``, ``Shard(0)``): a local ``[s, b, V/T]`` matmul, then one
    all-gather; the backward slices the gradient (no communication) and all-reduces the input gradient."""
    from torch.distributed.tensor import DTensor, Replicate
    xd = DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)
    return F.linear(xd, weight).full_tensor()
