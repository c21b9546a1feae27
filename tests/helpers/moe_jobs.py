"""A user's mixture-of-experts model on gloo ranks, and its plain single-process reference.

The model is written as a user would write it on ``engine.moe``: a block ``x + tanh(mix(x))`` then
``+ MoE(rmsnorm(x))`` (top-2 of 4 SwiGLU experts, a shared expert, a load-balancing loss), one block per virtual
pipeline stage, the experts sharded over the expert-parallel group.  Every block's weights come from a seed of its
own, so any process can build the whole model; :func:`reference_run` recomputes the losses and gradients with
:mod:`tests.helpers.moe_reference` (a per-token loop; no ``engine.moe`` code) and plain autograd.

:func:`job` runs on 4 ranks: expert-parallel dispatch at EP 1 / 2 / 4 (balanced, random and one-expert routing,
all-to-all bytes counted) and pipeline 2 x expert 2 under every schedule, with the cells overlapped or not.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from engine import schedules
from engine.model_parallel_config import ModelParallelConfig
from engine.moe import A2A_TRAFFIC, MoELayer
from engine.plan import build_plan
from engine.profiling.timeline import TimelineRecorder
from engine.runtime.tracing import use_tracer
from engine.runtime.process_groups import build_process_groups
from tests.helpers.moe_reference import expert, reference

__all__ = ["H", "E", "K", "S", "B", "M", "Block", "make_block", "canonical_grads", "make_items", "reference_run",
           "PIPELINE_CASES", "job"]

H, FFN, E, K, SHARED, COEFF = 8, 12, 4, 2, 4, 0.01
S, B, M = 4, 2, 4  # sequence, micro batch size, microbatches


class Block(nn.Module):
    """``x + tanh(mix(x))``, then ``+ MoE(norm(x))`` on ``[s, b, h]`` (a user's layer on ``engine.moe``)."""

    def __init__(self, index: int, ep_group=None, num_experts: int = E, top_k: int = K, **moe):
        super().__init__()
        self.mix = nn.Linear(H, H)
        self.norm = nn.RMSNorm(H, eps=1e-6)
        options = dict(shared_ffn_hidden_size=SHARED, aux_loss_coeff=COEFF) | moe
        self.moe = MoELayer(H, FFN, num_experts, top_k, ep_group=ep_group, name=f"L{index}", **options)

    def forward(self, x):
        x = x + torch.tanh(self.mix(x))
        return x + self.moe(self.norm(x))


def make_block(index: int, ep_group=None, **moe) -> Block:
    """Block ``index`` with its seeded weights; with ``ep_group`` only this rank's experts (built whole, then
    :meth:`~engine.moe.MoELayer.shard_experts`, so every expert-parallel layout holds the same weights)."""
    with torch.random.fork_rng():
        torch.manual_seed(1000 + index)
        block = Block(index, **moe)
        with torch.no_grad():
            block.norm.weight.uniform_(0.5, 1.5)
    if ep_group is not None:
        block.moe.shard_experts(ep_group)
    return block


def canonical_grads(blocks: dict) -> dict:
    """``{"<block>.<param>": grad}`` (experts are named by their global index; zeros for no gradient)."""
    return {f"{index}.{name}": (torch.zeros_like(p) if p.grad is None else p.grad).detach().clone()
            for index, block in blocks.items() for name, p in block.named_parameters()}


def make_items(dp_rank: int) -> list:
    g = torch.Generator().manual_seed(77 + dp_rank)
    return [{"x": torch.randn(S, B, H, generator=g), "target": torch.randn(S, B, H, generator=g)} for _ in range(M)]


# ---- reference ----------------------------------------------------------------------------------------------------
def _reference_block(block: Block, x):
    x = x + torch.tanh(x @ block.mix.weight.t() + block.mix.bias)
    n = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * block.norm.weight
    moe = block.moe
    out, aux, _ = reference(moe, n.reshape(-1, H), k=moe.router.top_k, coeff=moe.router.aux_loss_coeff,
                            experts=list(moe.experts.local))
    return x + out.view_as(x), aux


def reference_run(num_blocks: int, dp_size: int):
    """Per data-parallel rank ``d``: ``(losses [M], grads of sum_m (loss + aux) / M)`` over the full model."""
    out = []
    for d in range(dp_size):
        blocks = {i: make_block(i) for i in range(num_blocks)}
        losses, total = [], 0.0
        for item in make_items(d):
            x, aux_sum = item["x"], 0.0
            for i in range(num_blocks):
                x, aux = _reference_block(blocks[i], x)
                aux_sum = aux_sum + aux
            loss = ((x - item["target"]) ** 2).mean()
            losses.append(loss.item())
            total = total + (loss + aux_sum) / M
        total.backward()
        out.append((losses, canonical_grads(blocks)))
    return out


# ---- the pipeline run on the ranks --------------------------------------------------------------------------------
class _Chunk(nn.Module):
    def __init__(self, blocks: dict, config, first: bool, last: bool):
        super().__init__()
        self.blocks = nn.ModuleDict({str(k): v for k, v in blocks.items()})
        self.config, self.first, self.last = config, first, last
        self._input = None

    def set_input_tensor(self, tensors):
        self._input = tensors[0]

    def forward(self, x):
        x = x if self.first else self._input
        for block in self.blocks.values():
            x = block(x)
        return x


def _loss(target, y):
    loss = ((y - target) ** 2).mean()
    return loss, {"loss": loss.detach().clone()}  # the schedule divides the loss by M in place


def _forward_step(it, model):
    item = next(it)
    return model(item["x"]), partial(_loss, item["target"])


PIPELINE_CASES = [  # (schedule, chunks, overlap): pp2 x ep2 on 4 ranks
    ("1f1b", 1, False), ("zb_h1", 1, False), ("interleaved", 2, False), ("interleaved", 2, True),
    ("zbv", 2, False), ("dualpipev", 2, False), ("dualpipev", 2, True)]


def _run_pipeline(pgc, schedule: str, chunks: int, overlap: bool) -> dict:
    pp, r = pgc.pipeline_model_parallel_size, pgc.pipeline_model_parallel_rank
    plan = build_plan(schedule, pp, M, chunks)
    config = ModelParallelConfig(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, hidden_size=H,
                                 num_moe_experts=E, overlap_moe_expert_parallel_comm=overlap,
                                 virtual_pipeline_model_parallel_size=chunks if schedule == "interleaved" else None)
    models, blocks = [], {}
    for c, stage in enumerate(plan.stages_of(r)):
        blocks[stage] = make_block(stage, pgc.ep)
        models.append(_Chunk({stage: blocks[stage]}, config, stage == 0, stage == plan.num_stages - 1))
    items = make_items(pgc.data_parallel_rank)
    common = dict(forward_step_func=_forward_step, data_iterator=[iter(items) for _ in models], num_microbatches=M,
                  seq_length=S, micro_batch_size=B, p2p_communicator=schedules.P2PCommunicator(pgc.pp, config),
                  pg_collection=pgc)
    A2A_TRAFFIC.reset()
    rec = TimelineRecorder()
    with use_tracer(rec):
        if schedule == "1f1b":
            store = schedules.forward_backward_pipelining_without_interleaving(
                model=models[0], **(common | {"data_iterator": common["data_iterator"][0]}))
        elif schedule == "interleaved":
            store = schedules.forward_backward_pipelining_with_interleaving(model=models, **common)
        else:
            store = schedules.forward_backward_pipelining_with_schedule(schedule=schedule, model=models, **common)
    return {"losses": [s["loss"].item() for s in store], "grads": canonical_grads(blocks),
            "dp_rank": pgc.data_parallel_rank, "ep_ranks": pgc.ep_ranks, "a2a_exchanges": A2A_TRAFFIC.exchanges,
            "hidden": _hidden_exchanges(rec.spans()),
            "cells": len(build_plan(schedule, pp, M, chunks, **({"overlap_moe_expert_parallel_comm": True}
                                                                if overlap else {})).overlap_cells(r))}


def _hidden_exchanges(spans) -> int:
    """All-to-alls in flight over a compute span of another action (``"F3.0 a2a ..."`` around ``"B1.1"``)."""
    compute = [s for s in spans if s.category == "compute"]
    return sum(1 for c in spans if c.category == "comm" and any(
        s.label != c.label.split()[0] and c.start_ns <= s.start_ns and s.end_ns <= c.end_ns for s in compute))


# ---- expert-parallel dispatch without a pipeline ------------------------------------------------------------------
def _tokens(rank: int, kind: str, n: int = 12, h: int = H):
    g = torch.Generator().manual_seed(500 + rank)
    if kind == "balanced":  # token t: top-2 = experts t % h and (t + 1) % h under an identity router
        x = torch.zeros(n, h)
        for t in range(n):
            x[t, t % h], x[t, (t + 1) % h] = 2.0, 1.0
        return x
    x = torch.randn(n, h, generator=g)
    return x.abs() + 0.5 if kind == "one_expert" else x


DISPATCH_CASES = [  # (expert-parallel size, routing, experts, top_k)
    (1, "random", 4, 2), (2, "random", 4, 2), (4, "random", 4, 2), (4, "random", 8, 3), (4, "one_expert", 4, 1),
    (2, "one_expert", 4, 1), (4, "balanced", 8, 2)]


def _run_dispatch(rank: int, pgc, routing: str, num_experts: int, top_k: int) -> dict:
    block = make_block(0, pgc.ep, num_experts=num_experts, top_k=top_k)
    moe = block.moe
    with torch.no_grad():
        if routing == "one_expert":  # every token to the last expert (held by the last expert-parallel rank)
            moe.router.linear.weight.fill_(-1.0)
            moe.router.linear.weight[-1].fill_(1.0)
        elif routing == "balanced":
            moe.router.linear.weight.copy_(torch.eye(num_experts, H))
    h = 16 if routing == "balanced" else 12
    x = _tokens(rank, routing, n=h).requires_grad_()
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(900 + rank))
    A2A_TRAFFIC.reset()
    y = moe(x)
    (y * w).sum().backward()
    grads = canonical_grads({0: block})
    return {"y": y.detach(), "x_grad": x.grad.clone(), "grads": {k: v for k, v in grads.items() if ".moe." in k},
            "tokens": moe.router.stats().tokens_per_expert.tolist(), "bytes": A2A_TRAFFIC.bytes_sent,
            "exchanges": A2A_TRAFFIC.exchanges, "ep_ranks": pgc.ep_ranks, "first": moe.experts.first}


def dispatch_reference(rank: int, routing: str, num_experts: int, top_k: int):
    """``(y, x.grad, grads of every expert and dense MoE parameter, token slots per expert)`` of rank ``rank``'s
    tokens, by hand."""
    block = make_block(0, num_experts=num_experts, top_k=top_k)
    moe = block.moe
    with torch.no_grad():
        if routing == "one_expert":
            moe.router.linear.weight.fill_(-1.0)
            moe.router.linear.weight[-1].fill_(1.0)
        elif routing == "balanced":
            moe.router.linear.weight.copy_(torch.eye(num_experts, H))
    n = 16 if routing == "balanced" else 12
    x = _tokens(rank, routing, n=n).requires_grad_()
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(900 + rank))
    y, aux, kept = reference(moe, x, k=top_k, coeff=COEFF, experts=list(moe.experts.local))
    ((y * w).sum() + aux).backward()
    grads = canonical_grads({0: block})
    return y.detach(), x.grad.clone(), {k: v for k, v in grads.items() if ".moe." in k}, kept


def job(rank: int, world: int) -> dict:
    out = {"dispatch": [], "pipeline": []}
    groups = {}
    for ep, routing, num_experts, top_k in DISPATCH_CASES:
        if ep not in groups:
            groups[ep] = build_process_groups(1, expert_model_parallel_size=ep)
        out["dispatch"].append(_run_dispatch(rank, groups[ep], routing, num_experts, top_k))
    pgc = build_process_groups(2, expert_model_parallel_size=2)
    for schedule, chunks, overlap in PIPELINE_CASES:
        out["pipeline"].append(_run_pipeline(pgc, schedule, chunks, overlap))
    out["pp_rank"] = pgc.pipeline_model_parallel_rank
    return out


__all__ += ["DISPATCH_CASES", "dispatch_reference", "expert"]
