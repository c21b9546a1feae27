"""The mixture-of-experts layer: router, SwiGLU experts sharded over the expert-parallel ranks, optional shared
experts.

``MoELayer(x)`` for ``x`` ``[..., h]`` (e.g. ``[s, b, h]``) returns ``[..., h]``: the ``n`` tokens are routed
(:class:`~engine.moe.router.TopKRouter`), dispatched to the ranks holding their experts
(:func:`~engine.moe.dispatch.dispatch`), run through this rank's experts (:class:`GroupedExperts`: a loop over the
local experts, each a :class:`SwiGLU` on its contiguous rows), combined back with the routing weights
(:func:`~engine.moe.dispatch.combine`), plus the shared experts' output on every token when the layer has them
(DeepSeek-MoE; Dai et al., arXiv:2401.06066).  A SwiGLU expert is ``down(silu(gate(x)) * up(x))`` (Shazeer,
"GLU Variants Improve Transformer", arXiv:2002.05202), the expert layout of open mixture-of-experts language
models (Jiang et al. 2024, arXiv:2401.04088).

Every local expert runs on every forward, also on zero rows, so each expert parameter gets a gradient (zero for
an expert without tokens) on every rank and step, whatever the routing.  Expert parameters carry
``param.expert_parallel = True`` (:func:`is_expert_parameter`): their gradients are summed over the
expert-data-parallel group, not the data-parallel one (Megatron marks them ``allreduce = False``).

Tensor parallelism (:meth:`MoELayer.shard_tokens`, ``expert_tensor_parallel_size`` 1: each expert stays whole on
its rank; Megatron-Core's layout for it, ``megatron/core/transformer/moe/``): the ``P`` ranks of the
tensor-parallel group hold the same experts (or, under expert parallelism, the expert-parallel group is made of
them and the data-parallel ranks, Megatron's expert rank generator with expert-tensor size 1), so they must not
route the same token twice.  Each rank routes its own share of the sequence: the ``[s/P, b, h]`` shard it holds
under sequence parallelism, or without it its slice of the replicated ``[s, b, h]`` input, the outputs then
all-gathered back to ``[s, b, h]`` (the backward: the slice of the replicated output gradient, and an all-gather of
the input gradient).  One design for both modes, exact at any ``P``:

* the router's load-balancing loss sums its per-expert token counts over the group (:mod:`engine.moe.router`);
* the router's weight is a ``Replicate`` DTensor fed by the ``Shard(0)`` tokens (torch's ``SequenceParallel``
  style): its gradient comes out ``Partial`` and is summed over the group (the recipe:
  :func:`engine.training.parallel.dtensor.align_grads`);
* each expert's gradient holds only this rank's tokens: it is summed over the expert-data-parallel group, which
  with expert-tensor size 1 contains the tensor-parallel ranks (Megatron-Core's ``expt_dp``), so the sum covers
  the whole sequence; after it the experts' gradients are equal on the tensor-parallel ranks and a norm counts
  them once.

Capacity (``capacity_factor``) needs every token of the sequence in one place (the earliest tokens first), so it is
not available with tensor parallelism.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.process_groups import group_rank, group_size
from .dispatch import combine, dispatch
from .router import TopKRouter

__all__ = ["SwiGLU", "GroupedExperts", "MoELayer", "is_expert_parameter", "routers"]


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: ``gate``, ``up`` ``[f, h]``, ``down`` ``[h, f]``, no biases."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``down(silu(gate(x)) * up(x))``, ``[..., h] -> [..., h]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Module):
    """This rank's experts, each registered under its global index (``getattr(self, "5")`` is global expert 5), so
    parameter names (``5.gate_proj.weight``) do not depend on the expert-parallel size: a checkpoint or a Hugging
    Face folder names expert ``e`` the same whatever the layout.  ``local[i]`` is global expert ``first + i``;
    ``forward(rows, counts)`` runs local expert ``i`` on the next ``counts[i]`` rows of ``rows`` ``[sum(counts), h]``
    and returns the outputs in the same order."""

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, first: int = 0):
        super().__init__()
        self.first = first
        for i in range(num_local_experts):
            self.add_module(str(first + i), SwiGLU(hidden_size, ffn_hidden_size))
        for p in self.parameters():
            p.expert_parallel = True

    @property
    def local(self) -> list:
        """This rank's experts in global order (local expert ``i`` first)."""
        return list(self.children())

    def keep(self, first: int, count: int) -> None:
        """Drop every expert but global experts ``first .. first + count - 1`` (local, no communication)."""
        for name in list(self._modules):
            if not first <= int(name) < first + count:
                del self._modules[name]
        self.first = first

    def forward(self, rows: torch.Tensor, counts: list) -> torch.Tensor:
        """``rows`` ``[sum(counts), h]`` sorted by local expert, ``counts[e]`` rows for this rank's expert ``e``:
        each block through its expert, ``[sum(counts), h]`` in the same order."""
        parts = torch.split(rows, counts)
        return torch.cat([expert(part) for expert, part in zip(self.local, parts)])


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward layer (module doc).

    Args:
        hidden_size: ``h``.
        ffn_hidden_size: each routed expert's intermediate size.
        num_experts: ``E``, a multiple of the expert-parallel group's size.
        top_k: experts per token.
        shared_ffn_hidden_size: intermediate size of the shared experts (one SwiGLU; 0: none).
        ep_group: the expert-parallel process group (``ProcessGroupCollection.ep``, or
            ``parallel_state.get_expert_model_parallel_group()``); None: one rank holds every expert.
        name: label of this layer's all-to-all spans (e.g. ``"L3"``).
        **router_options: :class:`~engine.moe.router.TopKRouter`'s keywords (``score_function``,
            ``normalize_top_k``, ``aux_loss_coeff``, ``expert_bias``, ``capacity_factor``).

    Raises:
        ValueError: ``num_experts`` not divisible by the expert-parallel size, and the router's checks.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, *,
                 shared_ffn_hidden_size: int = 0, ep_group=None, name: str = "moe", **router_options):
        super().__init__()
        ranks = group_size(ep_group)
        if num_experts % ranks:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {ranks}; "
                             "choose a number of experts that is a multiple of expert_model_parallel_size")
        local = num_experts // ranks
        self.num_experts, self.ep_group, self.name = num_experts, ep_group, name
        self.router = TopKRouter(hidden_size, num_experts, top_k, **router_options)
        self.experts = GroupedExperts(local, hidden_size, ffn_hidden_size, first=group_rank(ep_group) * local)
        self.shared_experts: Optional[SwiGLU] = (SwiGLU(hidden_size, shared_ffn_hidden_size)
                                                 if shared_ffn_hidden_size else None)

    def shard_experts(self, ep_group) -> None:
        """Keep this rank's share of the experts of a layer built with all of them (``ep_group`` None), so that every
        expert-parallel layout holds the same weights when each process builds the whole layer from one seeded
        init: rank ``j`` of the group keeps experts ``j*E/P .. (j+1)*E/P - 1`` and dispatches over ``ep_group``.
        Local (no communication).

        Raises:
            ValueError: the layer is sharded already, or ``num_experts`` is not divisible by the group's size.
        """
        if self.ep_group is not None or len(self.experts.local) != self.num_experts:
            raise ValueError(f"MoELayer {self.name}: shard_experts needs a layer holding all {self.num_experts} "
                             f"experts (it holds {len(self.experts.local)}); build it with ep_group=None")
        ranks = group_size(ep_group)
        if self.num_experts % ranks:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the expert-parallel size {ranks}; "
                             "choose a number of experts that is a multiple of expert_model_parallel_size")
        local = self.num_experts // ranks
        self.experts.keep(group_rank(ep_group) * local, local)
        self.ep_group = ep_group

    def shard_tokens(self, tp_mesh, sequence_parallel: bool) -> None:
        """Route this rank's share of the sequence over the tensor-parallel ranks of ``tp_mesh`` (a 1-D
        ``DeviceMesh``; module doc): the layer's input is the ``[s/P, b, h]`` ``Shard(0)`` shard
        (``sequence_parallel``) or the replicated ``[s, b, h]``, of which it keeps rows ``r s/P .. (r+1) s/P - 1``
        and all-gathers the output; the router's weight becomes a ``Replicate`` DTensor (gradient ``Partial``) and
        its load-balancing loss sums the token counts over the group.  ``s`` must be a multiple of ``P``.  Local
        (no communication); expert parameters are untouched (plain tensors, reduced over the expert-data-parallel
        group).

        Raises:
            ValueError: the router has a capacity factor (its drops need the whole sequence in one place).
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import PrepareModuleInputOutput, SequenceParallel, parallelize_module
        if self.router.capacity_factor is not None:
            raise ValueError(f"MoELayer {self.name}: capacity_factor={self.router.capacity_factor} with tensor "
                             "parallelism: the capacity keeps each expert's earliest tokens of the whole sequence, "
                             "which no tensor-parallel rank holds; use capacity_factor=None (dropless)")
        held = Shard(0) if sequence_parallel else Replicate()
        parallelize_module(self, tp_mesh, PrepareModuleInputOutput(
            input_layouts=held, desired_input_layouts=Shard(0), use_local_input=True,
            output_layouts=Shard(0), desired_output_layouts=held, use_local_output=True))
        router = SequenceParallel(sequence_dim=0, use_local_output=True)
        router.src_data_rank = None  # every rank built the same weights: no broadcast
        parallelize_module(self.router.linear, tp_mesh, router)
        self.router.tp_group = tp_mesh.get_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., h] -> [..., h]``: route every token, dispatch to the experts (an all-to-all over the expert
        group when sharded), combine weighted by the router, plus the shared experts if any."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [n, h]
        routing = self.router(tokens)
        rows, counts, state = dispatch(tokens, routing.experts, self.num_experts, self.ep_group, self.name)
        out = combine(self.experts(rows, counts), routing.probs, state)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a routed expert (reduced over the expert-data-parallel group)."""
    return bool(getattr(param, "expert_parallel", False))


def routers(module: nn.Module) -> list:
    """``(name, router)`` for every :class:`~engine.moe.router.TopKRouter` in ``module``, in module order (for
    metrics: ``router.stats()`` / ``router.reset_stats()``)."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, TopKRouter)]
