"""A small user model fitted the way large models are: recomputation, bf16 with fp32 ``main_grad``, uneven stages.

:class:`TinyLM` is a user's own decoder (not pipecast's): embedding ``emb``, ``layers`` of pre-norm blocks whose
attention core is its own module (:class:`CoreAttention`, explicit softmax attention with dropout: the part
selective recomputation recomputes), final norm ``ln_f`` and an untied head; ``gate=True`` adds an elementwise
parameter outside every ``nn.Linear`` / ``nn.LayerNorm``, so split backward takes its generic (autograd-graph)
split instead of the layer-level deferral.  :func:`chunks_of` cuts it with ``engine.split_model`` by a pipeline
layout; :func:`pipeline_job` runs it through the public schedules API on gloo ranks (one entry of the shared PP = 2
job of ``tests/helpers/pipeline_jobs.py``), :func:`reference_grads` computes the single-process references.
"""
from __future__ import annotations

import datetime
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine import ModelParallelConfig, split_model
from engine.runtime.main_grad import attach_main_grad
from engine.runtime.recompute import apply_recompute

V, H, HEADS, S, B, M = 32, 16, 2, 8, 2, 4
NUM_LAYERS = 6


class CoreAttention(nn.Module):
    """Causal softmax attention over ``q, k, v`` ``[b, nh, s, d]`` with dropout (no parameters)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v):
        s = q.shape[-2]
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [b, nh, s, s]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return F.dropout(scores.softmax(-1), self.dropout, self.training) @ v


class Block(nn.Module):
    """Pre-norm block on ``[s, b, h]``; ``gate``: an elementwise parameter on the MLP output."""

    def __init__(self, dropout: float, gate: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.core = CoreAttention(dropout)
        self.gate = nn.Parameter(torch.rand(H) + 0.5) if gate else None

    def forward(self, x):
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, HEADS, h // HEADS).permute(2, 1, 3, 0, 4)  # [b, nh, s, d]
        x = x + self.proj(self.core(q, k, v).permute(2, 0, 1, 3).reshape(s, b, h))
        y = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + (y if self.gate is None else y * self.gate)


class TinyLM(nn.Module):
    def __init__(self, dropout: float = 0.1, gate: bool = False, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Block(dropout, gate) for _ in range(NUM_LAYERS))
        self.ln_f = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        self.to(dtype)

    def forward(self, ids):  # [b, s] -> logits [s, b, V]
        x = embed(self, ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def embed(chunk, ids):
    return chunk.emb(ids).transpose(0, 1).contiguous()  # [s, b, h]


def chunks_of(model: TinyLM, config, stages, layout) -> list:
    return split_model(model, layers="layers", stages=stages, config=config, first=["emb"], last=["ln_f", "head"],
                       embed=embed, layout=layout)


def data(step: int = 0) -> list:
    g = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, V, (M, B, S + 1), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def loss_func(labels, logits):
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.t().flatten())
    return loss, {"loss": loss.detach().clone()}


def reference_grads(model: TinyLM, *, per_microbatch: bool) -> dict:
    """The unsplit ``model`` (no dropout) in this process, microbatch by microbatch, each loss divided by M as the
    schedules divide it.  ``per_microbatch``: the fp32 sum, in microbatch order, of each microbatch's own gradient
    (computed in the parameters' dtype) -- what ``main_grad`` must hold; else autograd's accumulation into ``.grad``."""
    total = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    for ids, labels in data():
        if per_microbatch:
            model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(ids).float().flatten(0, 1), labels.t().flatten())
        (loss / M).backward()
        if per_microbatch:
            for n, p in model.named_parameters():
                total[n] += p.grad.float()
    if not per_microbatch:
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    return total


SCHEDULES = {  # name -> (chunks per rank, a layout with uneven stages over 2 ranks, its layers per stage)
    "1f1b": (1, "Et*2|t*4L", [2, 4]),
    "interleaved": (2, "Et|t*2|t*2|tL", [1, 2, 2, 1]),
    "zb_h1": (1, "Et*4|t*2L", [4, 2]),
    "zbv": (2, "E|t*2|t*3|tL", [0, 2, 3, 1]),
    "dualpipev": (2, "Et*2|t|t*2|tL", [2, 1, 2, 1]),
}
RECOMPUTE = {"none": None, "full": "full", "selective": "selective", "partial": "full"}


def _run(rank: int, pgc, schedule: str, recompute: str, *, gate: bool = False, bf16: bool = False,
         dropout: float = 0.1) -> dict:
    """One training step of :class:`TinyLM` on this rank through the public schedules API: its gradients by
    parameter name (``main_grad`` with ``bf16``), the storage bytes of each activation received, and per call of a
    marked module ``(checkpoint_activations_microbatch, grad enabled)`` -- a recomputed call runs once without grad
    in the forward and once with grad in the backward."""
    from engine import schedules
    from engine.plan import build_plan
    from engine.runtime.p2p import P2PCommunicator
    chunks_per_rank, layout, _ = SCHEDULES[schedule]
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=dtype, hidden_size=H,
                                 deallocate_pipeline_outputs=True, params_dtype=dtype,
                                 virtual_pipeline_model_parallel_size=2 if schedule == "interleaved" else None,
                                 num_microbatches_with_partial_activation_checkpoints=1 if recompute == "partial"
                                 else None)
    model = TinyLM(dropout=dropout, gate=gate, dtype=dtype)
    chunks = chunks_of(model, config, build_plan(schedule, 2, M, chunks_per_rank).stages_of(rank), layout)
    handle = attach_main_grad(chunks) if bf16 else None
    seen = {"received": [], "calls": [], "layers": {c.stage: len(c.body_layers) for c in chunks}}
    flag = _trace_calls(_mark(chunks, RECOMPUTE[recompute]), seen["calls"])
    torch.manual_seed(7 + rank)

    def forward_step(data_iterator, chunk, checkpoint_activations_microbatch=None):
        ids, labels = next(data_iterator)
        if not chunk.is_first:
            seen["received"].append(chunk.input_tensor.untyped_storage().nbytes())
        flag[0] = checkpoint_activations_microbatch
        return chunk(ids), partial(loss_func, labels)

    one = chunks_per_rank == 1
    schedules.forward_backward_pipelining_with_schedule(
        schedule=schedule, forward_step_func=forward_step, model=chunks[0] if one else chunks,
        data_iterator=iter(data()) if one else [iter(data()) for _ in chunks], num_microbatches=M, seq_length=S,
        micro_batch_size=B, p2p_communicator=P2PCommunicator(pgc.pp, config), pg_collection=pgc)
    grads = {n: (p.main_grad if bf16 else p.grad).clone() for c in chunks for n, p in c.named_parameters()}
    seen["grad_left"] = handle is not None and any(p.grad is not None for p in handle.params)
    return {"grads": grads, **seen}


def _mark(chunks, granularity):
    if granularity == "full":
        return apply_recompute(layer for c in chunks for layer in c.body_layers)
    if granularity == "selective":
        return apply_recompute(layer.core for c in chunks for layer in c.body_layers)
    return []


def _trace_calls(marked, calls: list) -> list:
    """Wrap the forward each marked module recomputes (the class's bound forward) to record, per call,
    ``(checkpoint_activations_microbatch of the forward step, grad enabled)``; returns the flag's slot."""
    flag = [None]
    for m in marked:
        inner = m.forward.forward

        def traced(*a, inner=inner, **k):
            calls.append((flag[0], torch.is_grad_enabled()))
            return inner(*a, **k)
        m.forward.forward = traced
    return flag


def pipeline_job(rank: int, world: int) -> dict:
    """Every case on this rank of a 2-rank pipeline: ``{(schedule, recompute, gate, bf16, dropout): result}``."""
    from engine.runtime.process_groups import build_process_groups
    pgc = build_process_groups(2, timeout=datetime.timedelta(seconds=60))
    out = {}
    try:
        for schedule in SCHEDULES:
            out[(schedule, "none", False, False, 0.0)] = _run(rank, pgc, schedule, "none", dropout=0.0)
            for recompute in RECOMPUTE:
                out[(schedule, recompute, False, False, 0.1)] = _run(rank, pgc, schedule, recompute)
            for recompute in ("none", "full"):
                out[(schedule, recompute, False, True, 0.0)] = _run(rank, pgc, schedule, recompute, bf16=True,
                                                                    dropout=0.0)
        for recompute in ("none", "full", "selective"):
            out[("zb_h1", recompute, True, False, 0.1)] = _run(rank, pgc, "zb_h1", recompute, gate=True)
    finally:
        pgc.destroy()
    return out
