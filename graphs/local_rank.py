"""Run one pipeline rank's plan in a single process, for graph checks and benchmarks.

The neighbours of the rank are replaced by fixed tensors: chunk ``c``'s input for microbatch ``m`` is a fixed
"received activation" ``[s, b, h]`` and its backward is seeded with a fixed "received gradient".  The rank's
actions run in plan order, ``current_microbatch`` is set before every forward (as Megatron's
``set_current_microbatch`` does), so the graphs see exactly the passes, order and buffer lifetimes they see in a
real pipeline -- without processes, which keeps CPU tests fast and the GPU benchmark single-device.

The per-microbatch surrogate loss is ``sum(output * received_grad)`` (its gradient w.r.t. the output is the
received gradient).

Split-backward plans (``W`` actions): :class:`WeightQueue` is the one-process stand-in for the executor's split
backward -- graphs captured with ``defer_weight_grad=queue.defer`` queue their ``W`` replays during a ``B`` and the
plan's ``W`` action runs them.  Layers that are not graphed compute everything in ``B`` (an unsplit backward), so
an eager copy of the model run through the same plan is the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.plan import Op, Plan

__all__ = ["RankData", "StepResult", "WeightQueue", "make_rank_data", "run_rank_step", "sgd_step"]


@dataclass
class RankData:
    """Fixed received activations and gradients per ``(chunk, microbatch)``: ``[s, b, h]`` each."""

    inputs: list[list[torch.Tensor]]
    grads: list[list[torch.Tensor]]


@dataclass
class StepResult:
    losses: dict[tuple[int, int], torch.Tensor]       # (chunk, mb) -> surrogate loss (fp32 scalar)
    input_grads: dict[tuple[int, int], torch.Tensor]  # (chunk, mb) -> grad of the chunk input
    executed: list[tuple[str, int, int]]              # (kind, chunk, mb) in the order run


class WeightQueue:
    """``W`` work per ``(chunk, microbatch)``: :meth:`defer` (pass it as ``defer_weight_grad``) queues into the
    ``B`` in progress, :meth:`run` runs a ``W`` action's queue in order."""

    def __init__(self):
        self.current: list | None = None
        self.pending: dict[tuple[int, int], list] = {}

    def defer(self, run) -> bool:
        if self.current is None:
            return False
        self.current.append(run)
        return True

    def run(self, chunk: int, microbatch: int) -> None:
        for work in self.pending.pop((chunk, microbatch), []):
            work()


def make_rank_data(num_model_chunks: int, num_microbatches: int, shape: Sequence[int], dtype=torch.float32,
                   device="cpu", seed: int = 0) -> RankData:
    g = torch.Generator().manual_seed(seed)

    def one():
        return torch.randn(tuple(shape), generator=g).to(device=device, dtype=dtype)

    return RankData([[one() for _ in range(num_microbatches)] for _ in range(num_model_chunks)],
                    [[one() for _ in range(num_microbatches)] for _ in range(num_model_chunks)])


def run_rank_step(chunks: Sequence[Sequence[torch.nn.Module]], plan: Plan, rank: int, data: RankData,
                  order_override: Sequence[tuple[str, int, int]] | None = None,
                  weights: WeightQueue | None = None) -> StepResult:
    """Run one training step of ``rank``: every action of ``plan.actions[rank]`` (or ``order_override``).

    Args:
        chunks: per model chunk, its layers (called in sequence).
        order_override: ``(kind, chunk, microbatch)`` passes to run instead of the plan (negative controls).
        weights: split-backward plans: the queue the graphs defer their ``W`` to (``W`` actions run it); without
            one a ``W`` action does nothing (the backward was whole).
    """
    passes = order_override if order_override is not None else [
        (a.op.value, a.chunk, a.microbatch) for a in plan.actions[rank]
        if a.op is not Op.WEIGHT or weights is not None]
    live: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    result = StepResult({}, {}, [])
    for kind, c, m in passes:
        if kind == "F":
            for layer in chunks[c]:
                layer.current_microbatch = m
            x = data.inputs[c][m].detach().clone().requires_grad_(True)
            out = x
            for layer in chunks[c]:
                out = layer(out)
            result.losses[(c, m)] = (out.detach().float() * data.grads[c][m].float()).sum()
            live[(c, m)] = (x, out)
        elif kind == "W":
            weights.run(c, m)
        else:
            x, out = live.pop((c, m))
            if weights is not None:
                weights.current = weights.pending.setdefault((c, m), [])
            try:
                torch.autograd.backward(out, data.grads[c][m])
            finally:
                if weights is not None:
                    weights.current = None
            result.input_grads[(c, m)] = x.grad.detach().clone()
        result.executed.append((kind, c, m))
    return result


@torch.no_grad()
def sgd_step(chunks: Sequence[Sequence[torch.nn.Module]], lr: float = 1e-2) -> None:
    """In-place SGD on every parameter with a gradient (parameters keep their storage: graphs read them by
    address), then ``grad = None``."""
    for chunk in chunks:
        for layer in chunk:
            for p in layer.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
                    p.grad = None
