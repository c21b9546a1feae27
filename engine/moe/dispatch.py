"""Token dispatch and combine across the expert-parallel ranks: two ``all_to_all_single`` with uneven splits.

The ``E`` experts of a layer are split evenly over the ``P`` ranks of the expert-parallel group: rank ``j`` holds
experts ``j*E/P .. (j+1)*E/P - 1`` (its *local* experts).  For ``n`` tokens routed to ``k`` experts each
(:class:`engine.moe.router.Routing`):

1. *permute*: the kept token slots, ordered by global expert (stable: token order within an expert), ``[m, h]``;
2. *counts*: one ``all_to_all_single`` of the per-expert slot counts ``[E]`` (each rank learns how many rows every
   peer sends it, per local expert) -- so the next exchange can use uneven splits;
3. *dispatch*: ``all_to_all_single`` of the rows, ``input_split_sizes`` = rows per destination rank; rank ``j``
   receives its peers' rows in source-rank order, each source's block ordered by local expert, and regroups them
   by local expert (source order within an expert) for the experts;
4. *combine*: the experts' outputs go back the same way (the inverse regrouping, then the reverse
   ``all_to_all_single``), are put back at their token slots ``[n, k, h]`` and summed over the slots in slot order
   with the routing probabilities as weights.

Every order above is a function of the routing alone, so results do not depend on timing.  The two row exchanges
are autograd functions whose backward is the reverse exchange; both directions go through
:func:`engine.runtime.overlap.exchange` (an overlap point: in an overlapped cell the other microbatch runs while the
rows are in flight).  With ``P = 1`` nothing is exchanged.

Bytes: each row exchange sends ``rows x h x element size`` bytes to other ranks; :data:`A2A_TRAFFIC` counts them
(host integers: the splits are on the host anyway), so a step's all-to-all volume can be measured.  For ``T``
tokens per rank, top-``k`` routing and uniformly spread experts one exchange sends ``T k h d (P-1)/P`` bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..runtime.overlap import exchange
from ..runtime.process_groups import group_rank, group_size

__all__ = ["A2ATraffic", "A2A_TRAFFIC", "Dispatch", "dispatch", "combine", "all_to_all"]


class A2ATraffic:
    """Counts the bytes this process's row exchanges sent to other ranks, and the exchanges."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.bytes_sent = 0
        self.exchanges = 0

    def add(self, rows_to_others: int, row_bytes: int) -> None:
        self.bytes_sent += rows_to_others * row_bytes
        self.exchanges += 1


A2A_TRAFFIC = A2ATraffic()


def all_to_all(x: torch.Tensor, output_split_sizes: list, input_split_sizes: list, group, label: str):
    """``all_to_all_single`` of the rows of ``x`` ``[sum(input_split_sizes), ...]`` over ``group`` with uneven
    splits, as an autograd function (backward: the reverse exchange) and an overlap point both ways.  Returns
    ``[sum(output_split_sizes), ...]``."""
    return _AllToAll.apply(x, tuple(output_split_sizes), tuple(input_split_sizes), group, label)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, label):
        ctx.splits, ctx.group, ctx.label = (out_splits, in_splits), group, label
        return _exchange(x, out_splits, in_splits, group, label)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad.contiguous(), in_splits, out_splits, ctx.group, f"{ctx.label} backward"), None, \
            None, None, None


def _exchange(x: torch.Tensor, out_splits, in_splits, group, label: str) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    me = group_rank(group)
    A2A_TRAFFIC.add(sum(s for j, s in enumerate(in_splits) if j != me), x[:1].numel() * x.element_size())
    exchange(lambda: dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group,
                                            async_op=True), label)
    return out


@dataclass
class Dispatch:
    """What :func:`combine` needs from :func:`dispatch`: the kept slots' indices (``slots`` ``[m]`` into the
    ``n*k`` slots, expert-ordered), the regrouping ``regroup`` (received row order -> local-expert order; None
    when ``P = 1``), the row splits, ``n``, ``k``, the group and the layer's label."""

    slots: torch.Tensor
    regroup: Optional[torch.Tensor]
    send_splits: list
    recv_splits: list
    num_tokens: int
    top_k: int
    group: object
    label: str


def dispatch(x: torch.Tensor, experts: torch.Tensor, num_experts: int, group, label: str = "moe"):
    """Send the rows of ``x`` ``[n, h]`` routed by ``experts`` ``[n, k]`` (``-1``: dropped) to the ranks holding
    their experts (module doc).  Returns ``(rows, tokens_per_local_expert, state)``: ``rows`` ``[r, h]`` grouped by
    local expert, the count per local expert (host ints), and the :class:`Dispatch` for :func:`combine`.

    Raises ``ValueError`` if ``num_experts`` is not a multiple of the group's size."""
    ranks = group_size(group)
    if num_experts % ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {ranks}; every "
                         "expert-parallel rank holds the same number of experts")
    local = num_experts // ranks
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    slots = order[flat[order] >= 0]  # kept slots, by global expert, token order within an expert
    rows = x.index_select(0, torch.div(slots, k, rounding_mode="floor"))
    counts = torch.bincount(flat[slots], minlength=num_experts)  # [E]
    if ranks == 1:
        return rows, counts.tolist(), Dispatch(slots, None, [], [], n, k, group, label)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    per_source = received.view(ranks, local).tolist()  # rows each source sends me, per local expert
    send_splits = counts.view(ranks, local).sum(1).tolist()
    recv_splits = [sum(r) for r in per_source]
    got = all_to_all(rows, recv_splits, send_splits, group, f"{label} a2a dispatch")
    regroup = _regroup(per_source, x.device)
    per_expert = [sum(per_source[s][e] for s in range(ranks)) for e in range(local)]
    return got.index_select(0, regroup), per_expert, Dispatch(slots, regroup, send_splits, recv_splits, n, k,
                                                               group, label)


def _regroup(per_source: list, device) -> torch.Tensor:
    """Indices that take rows received in (source, local expert) order to (local expert, source) order."""
    counts = torch.tensor(per_source, dtype=torch.int64)  # [P, E/P]
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view_as(counts)  # of each block, received order
    c, s = counts.t().reshape(-1), starts.t().reshape(-1)  # blocks in (expert, source) order
    within = torch.arange(int(c.sum())) - torch.repeat_interleave(c.cumsum(0) - c, c)
    return (torch.repeat_interleave(s, c) + within).to(device)


def combine(y: torch.Tensor, probs: torch.Tensor, state: Dispatch) -> torch.Tensor:
    """Send the experts' outputs ``y`` ``[r, h]`` (local-expert order, as :func:`dispatch` returned the rows) back
    and sum them per token: ``out[t] = sum_j probs[t, j] * y(t, j)`` in slot order, dropped slots adding nothing.
    Returns ``[n, h]``."""
    if state.regroup is not None:
        back = torch.empty_like(state.regroup)  # the inverse regrouping: local-expert order -> received order
        back[state.regroup] = torch.arange(state.regroup.numel(), device=back.device)
        y = all_to_all(y.index_select(0, back), state.send_splits, state.recv_splits, state.group,
                       f"{state.label} a2a combine")
    n, k = state.num_tokens, state.top_k
    slots = y.new_zeros((n * k,) + tuple(y.shape[1:])).index_copy(0, state.slots, y)
    return (slots.view(n, k, -1) * probs.unsqueeze(-1).to(y.dtype)).sum(1)
