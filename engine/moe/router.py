"""The top-k router of a mixture-of-experts layer, its load-balancing loss and its statistics.

Scores (:class:`TopKRouter`):

* ``"softmax"`` -- ``p = softmax(x W^T)`` over the ``E`` experts; the ``k`` largest are chosen and, with
  ``normalize_top_k`` (Jiang et al., arXiv:2401.04088), renormalised to sum to 1 per token;
* ``"sigmoid"`` -- DeepSeek-V3's affinities ``s = sigmoid(x W^T)``; the ``k`` largest of ``s + b`` are chosen, where
  ``b`` is a per-expert bias that no gradient touches (auxiliary-loss-free balancing: Wang et al., "Auxiliary-Loss-
  Free Load Balancing Strategy for Mixture-of-Experts", arXiv:2408.15664; DeepSeek-AI, arXiv:2412.19437, sec.
  2.1.2), and the chosen ``s`` (without ``b``) are normalised to sum to 1.  :meth:`TopKRouter.update_expert_bias`
  moves ``b`` by ``rate * sign(mean load - load)`` after a step (Megatron-Core's ``get_updated_expert_bias``).

Load-balancing loss (Fedus et al., "Switch Transformers", arXiv:2101.03961, eq. 4, in Megatron-Core's form
``switch_load_balancing_loss_func``, ``megatron/core/transformer/moe/moe_utils.py``): over the ``T`` tokens of one
forward, ``aux = coeff * E / (k * T^2) * sum_e (sum_t p_te) * c_e`` with ``p`` the full score distribution (the
normalised affinities for ``"sigmoid"``) and ``c_e`` the number of token slots routed to expert ``e`` (before any
capacity drop).  It equals ``coeff`` when routing is uniform.  The loss is not added to the model's output: like
Megatron's ``MoEAuxLossAutoScaler`` (:class:`AuxLossAutoScaler`) it rides on the routing probabilities, and the
backward gives it the gradient ``engine.runtime.step.aux_loss_scale.moe`` -- the scale the schedules set on every
forward step from ``grad_scale_func`` and the microbatch count (``s / M``, or ``s`` with per-token loss; they set it
when ``config.num_moe_experts`` is not None) -- so its gradient at the router matches the main loss's scaling
whatever the pipeline's loss scale; 1 outside the schedules.

Tensor parallelism (:meth:`engine.moe.MoELayer.shard_tokens`): each of the ``P`` ranks of ``tp_group`` routes its
own ``n = T / P`` tokens of the sequence, while the loss above is over all ``T``.  As in Megatron-Core's router
(``megatron/core/transformer/moe/router.py``, its load-balancing loss under tensor / sequence parallelism: the
tokens per expert all-reduced over the tensor x context-parallel group, the token total the group's), the
counts ``c_e`` are summed over ``tp_group`` (one all-reduce per forward) and each rank's loss is its share,
``coeff * E / (k T^2) * sum_e (sum_{t in its n} p_te) * c_e``: linear in its own scores, so the shares add up to the
loss and each share's gradient at its tokens' scores is the whole loss's -- the same gradients as one process
routing all ``T`` tokens.  The statistics record the whole loss (the score sums ride on the same all-reduce) and
this rank's tokens per expert.

Capacity (optional, ``capacity_factor``): each expert takes at most ``ceil(capacity_factor * T * k / E)`` token
slots of one forward, the earliest tokens first; the others are dropped (expert ``-1``, probability 0) and add
nothing to the output.  ``None`` (the default) is dropless.

Statistics: each forward adds its tokens per expert (after dropping) and its auxiliary loss to the router's
counters (device tensors, no host read); :meth:`TopKRouter.stats` returns them, :meth:`TopKRouter.reset_stats`
clears them (once per step, by whoever logs them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..runtime.step import aux_loss_scale

__all__ = ["SCORE_FUNCTIONS", "Routing", "RouterStats", "TopKRouter", "AuxLossAutoScaler", "load_balancing_loss"]

SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One forward's routing of ``n`` tokens: ``probs`` ``[n, k]`` (the combine weights), ``experts`` ``[n, k]``
    int64 global expert indices (``-1``: dropped slot), ``tokens_per_expert`` ``[E]`` int64 (kept slots)."""

    probs: torch.Tensor
    experts: torch.Tensor
    tokens_per_expert: torch.Tensor


@dataclass
class RouterStats:
    """Accumulated since the last reset: ``tokens_per_expert`` ``[E]`` (token slots each expert received),
    ``aux_loss`` (sum of the forwards' auxiliary losses, unscaled), ``forwards`` (their number)."""

    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor
    forwards: int


class AuxLossAutoScaler(torch.autograd.Function):
    """``apply(activation, aux_loss)`` returns ``activation``; its backward passes ``activation``'s gradient
    through and gives ``aux_loss`` the gradient ``aux_loss_scale.moe`` (1 when no schedule set it) -- Megatron-Core's
    ``MoEAuxLossAutoScaler`` contract (``megatron/core/transformer/moe/moe_utils.py``)."""

    @staticmethod
    def forward(ctx, activation, aux_loss):
        ctx.save_for_backward(aux_loss)
        return activation

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        scale = aux_loss_scale.moe
        one = torch.ones_like(aux_loss)
        return grad, one if scale is None else one * scale.to(one).reshape(one.shape)


def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, top_k: int, coeff: float,
                        tokens: Optional[int] = None) -> torch.Tensor:
    """``coeff * E / (k * T^2) * sum_e (sum_t scores_te) * counts_e`` (module doc) for ``scores`` ``[n, E]`` and
    ``counts`` ``[E]``; a 0-dim tensor.  ``tokens``: ``T``, default ``n``; with ``n < T`` (this rank's share of
    the tokens, ``counts`` those of all ``T``) it is this share's part of the loss, linear in ``scores``: the
    parts of the ranks sum to the whole loss and each part's gradient is the whole loss's for its tokens."""
    n, experts = scores.shape
    tokens = n if tokens is None else tokens
    return (scores.sum(0) * counts.to(scores.dtype)).sum() * (coeff * experts / (top_k * tokens * tokens))


class TopKRouter(nn.Module):
    """Routes each token to ``top_k`` of ``num_experts`` experts (module doc).

    Args:
        hidden_size: ``h``; the router's weight is ``[E, h]`` (``self.linear``, no bias).
        num_experts: ``E``.
        top_k: ``k``, ``1 <= k <= E``.
        score_function: ``"softmax"`` or ``"sigmoid"``.
        normalize_top_k: renormalise the chosen softmax probabilities (sigmoid ones always are when ``k > 1``).
        aux_loss_coeff: weight of the load-balancing loss (0: none).
        expert_bias: keep the selection bias ``b`` (``"sigmoid"`` only; a buffer, updated by
            :meth:`update_expert_bias`).
        capacity_factor: ``None`` (dropless) or a positive number.

    Raises:
        ValueError: an unknown score function, ``top_k`` outside ``[1, E]``, a bias without sigmoid scores, a
            non-positive capacity factor or coefficient below 0.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score_function: str = "softmax",
                 normalize_top_k: bool = True, aux_loss_coeff: float = 0.0, expert_bias: bool = False,
                 capacity_factor: Optional[float] = None):
        super().__init__()
        _check_router(num_experts, top_k, score_function, expert_bias, capacity_factor, aux_loss_coeff)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_function, self.normalize_top_k = score_function, normalize_top_k
        self.aux_loss_coeff, self.capacity_factor = float(aux_loss_coeff), capacity_factor
        self.linear = nn.Linear(hidden_size, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts) if expert_bias else None)
        self.tp_group = None  # MoELayer.shard_tokens: the tensor-parallel ranks that share one sequence
        self._tokens: Optional[torch.Tensor] = None
        self._aux: Optional[torch.Tensor] = None
        self._forwards = 0

    def forward(self, x: torch.Tensor) -> Routing:
        """Route ``x`` ``[n, h]``; returns a :class:`Routing` (the auxiliary loss rides on ``probs``)."""
        logits = self.linear(x)  # [n, E]
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs, experts = torch.topk(scores, self.top_k, dim=-1)
            if self.normalize_top_k and self.top_k > 1:
                probs = probs / probs.sum(-1, keepdim=True)
            balance = scores
        else:
            scores = torch.sigmoid(logits)
            chooser = scores.detach() if self.expert_bias is None else scores.detach() + self.expert_bias
            experts = torch.topk(chooser, self.top_k, dim=-1).indices
            probs = scores.gather(1, experts)
            if self.top_k > 1:
                probs = probs / probs.sum(-1, keepdim=True)
            balance = scores / scores.sum(-1, keepdim=True)
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        aux = whole = None
        if self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            aux, whole = self._aux_loss(balance, counts)
            probs = AuxLossAutoScaler.apply(probs, aux)
        if self.capacity_factor is not None:
            probs, experts, counts = self._drop(probs, experts)
        self._record(counts, whole)
        return Routing(probs, experts, counts)

    def _aux_loss(self, balance: torch.Tensor, counts: torch.Tensor) -> tuple:
        """``(loss, its value over the whole sequence)`` from ``balance`` ``[n, E]`` and ``counts`` ``[E]`` of this
        rank's tokens.  With :attr:`tp_group` (the tensor-parallel ranks each hold ``n`` tokens of the sequence,
        module doc) one all-reduce of ``[counts | sum_t balance]`` (fp32, ``[2E]``) gives the sequence's counts and
        score sums: the loss is this rank's share (:func:`load_balancing_loss` with ``tokens = n T``), the value
        the whole sequence's (for the statistics)."""
        if self.tp_group is None:
            aux = load_balancing_loss(balance, counts, self.top_k, self.aux_loss_coeff)
            return aux, aux.detach()
        sums = torch.cat([counts.to(torch.float32), balance.detach().sum(0).to(torch.float32)])  # [2E]
        dist.all_reduce(sums, group=self.tp_group)
        total = balance.shape[0] * dist.get_world_size(self.tp_group)
        counts, scores = sums[:self.num_experts], sums[self.num_experts:]
        aux = load_balancing_loss(balance, counts, self.top_k, self.aux_loss_coeff, tokens=total)
        whole = load_balancing_loss(scores[None].to(balance.dtype), counts, self.top_k, self.aux_loss_coeff,
                                    tokens=total)
        return aux, whole

    def _drop(self, probs: torch.Tensor, experts: torch.Tensor):
        """Keep each expert's first ``capacity`` token slots (token order, then slot order)."""
        n, k = experts.shape
        capacity = math.ceil(self.capacity_factor * n * k / self.num_experts)
        flat = experts.reshape(-1)
        position = F.one_hot(flat, self.num_experts).cumsum(0).gather(1, flat[:, None])[:, 0] - 1  # [n*k]
        keep = (position < capacity).view(n, k)
        experts = torch.where(keep, experts, torch.full_like(experts, -1))
        counts = torch.bincount(flat[keep.reshape(-1)], minlength=self.num_experts)
        return probs * keep.to(probs.dtype), experts, counts

    def _record(self, counts: torch.Tensor, aux: Optional[torch.Tensor]) -> None:
        counts = counts.detach()
        self._tokens = counts.clone() if self._tokens is None else self._tokens + counts
        if aux is not None:
            self._aux = aux.detach() if self._aux is None else self._aux + aux.detach()
        self._forwards += 1

    def stats(self) -> RouterStats:
        """The counters since the last :meth:`reset_stats` (zeros before any forward)."""
        device = self.linear.weight.device
        tokens = self._tokens if self._tokens is not None else torch.zeros(self.num_experts, dtype=torch.int64,
                                                                           device=device)
        aux = self._aux if self._aux is not None else torch.zeros((), device=device)
        return RouterStats(tokens, aux, self._forwards)

    def reset_stats(self) -> None:
        """Clear the counters."""
        self._tokens, self._aux, self._forwards = None, None, 0

    @torch.no_grad()
    def update_expert_bias(self, rate: float, tokens_per_expert: Optional[torch.Tensor] = None) -> None:
        """``b += rate * sign(mean(load) - load)`` with ``load`` = ``tokens_per_expert`` (default: the counters;
        reduce them over the data-parallel ranks first for a global update).

        Raises:
            ValueError: the router keeps no expert bias.
        """
        if self.expert_bias is None:
            raise ValueError("update_expert_bias: this router has no expert bias; build it with "
                             "score_function='sigmoid', expert_bias=True")
        load = (self.stats().tokens_per_expert if tokens_per_expert is None else tokens_per_expert).float()
        self.expert_bias += rate * torch.sign(load.mean() - load)


def _check_router(num_experts, top_k, score_function, expert_bias, capacity_factor, aux_loss_coeff) -> None:
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function={score_function!r} is unknown; use one of {SCORE_FUNCTIONS}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be an int in [1, num_experts={num_experts}]; route each token to "
                         "at most as many experts as there are")
    if expert_bias and score_function != "sigmoid":
        raise ValueError("expert_bias=True needs score_function='sigmoid' (DeepSeek-V3's auxiliary-loss-free "
                         "balancing biases the sigmoid affinities)")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be None (dropless) or > 0")
    if not aux_loss_coeff >= 0:
        raise ValueError(f"aux_loss_coeff={aux_loss_coeff!r} must be >= 0 (0: no load-balancing loss)")
