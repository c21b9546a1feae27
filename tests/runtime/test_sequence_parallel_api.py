"""Megatron-style tensor and sequence parallelism through the schedules API: pipeline 2 x tensor 2 on 4 gloo ranks.

The user model is written the Megatron way (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", arXiv:2205.05198, section 4.2.2; Megatron-Core ``tensor_parallel/mappings.py``): each pipeline
stage is a pre-norm MLP block whose first linear is column-parallel (``[f/T, h]`` per rank) and whose second is
row-parallel (``[h, f/T]``).  With ``sequence_parallel`` every tensor-parallel rank holds its sequence shard
``[s/T, b, h]`` between blocks and stages: the norm runs on the shard, an all-gather along the sequence feeds the
column-parallel linear and a reduce-scatter along the sequence follows the row-parallel one.  Without it the
residual stream is the replicated ``[s, b, h]``, entered through an identity whose backward all-reduces and left
through an all-reduce.  The collectives are plain ``torch.distributed`` calls in the autograd functions below.

One spawned job runs four cases through ``get_forward_backward_func()`` (1F1B, and interleaved 1F1B with two
chunks per rank) under :func:`engine.runtime.p2p.record_messages`, and returns every rank's losses, local
gradients and P2P records.  The tests check

* the P2P layer posts ``[s/T, b, h]`` activation and gradient messages with ``sequence_parallel`` and
  ``[s, b, h]`` without; the activation bytes sent with it are exactly ``1/T`` of those without and of ``T = 1``;
* losses and every gradient shard equal a single-process fp32 reference written here with plain ``nn.Linear`` /
  ``nn.LayerNorm`` on the unsharded weights.  Not bitwise: the row-parallel product sums ``T`` partial products
  (then an all-reduce) where the reference sums ``f`` terms in one matmul, and the replicated norm / bias gradients
  are the sum of ``T`` sequence-shard partials; the differences are a few fp32 ulps (tolerance 1e-5 relative).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine import parallel_state as ps
from engine.model_parallel_config import ModelParallelConfig
from engine.runtime.p2p import TAG_ACT, TAG_GRAD, activation_bytes, record_messages
from engine.schedules import get_forward_backward_func

try:
    from tests.helpers.distributed import run_ranks
except ImportError:  # tests/ itself on sys.path (pytest's default "prepend" import mode)
    from distributed import run_ranks

WORLD, PP = 4, 2
SEQ, MBS, HIDDEN, FFN, M = 8, 2, 8, 16, 4
CASES = {"t1": (1, False, None), "t2": (2, False, None), "t2_sp": (2, True, None), "t2_sp_vp2": (2, True, 2)}
"""case -> (tensor_model_parallel_size, sequence_parallel, virtual_pipeline_model_parallel_size)."""
TOL = 1e-5


# ---- the reference: one process, unsharded ----------------------------------------------------------------------

def full_weights(stages: int) -> list[dict]:
    """The unsharded weights of every stage (the same on every rank: a fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    return [{"norm_w": 1 + 0.1 * torch.randn(HIDDEN, generator=g), "norm_b": 0.1 * torch.randn(HIDDEN, generator=g),
             "w1": torch.randn(FFN, HIDDEN, generator=g) / HIDDEN ** 0.5, "b1": 0.1 * torch.randn(FFN, generator=g),
             "w2": torch.randn(HIDDEN, FFN, generator=g) / FFN ** 0.5, "b2": 0.1 * torch.randn(HIDDEN, generator=g)}
            for _ in range(stages)]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(SEQ, MBS, HIDDEN, generator=g), torch.randn(SEQ, MBS, HIDDEN, generator=g))
            for _ in range(M)]


class RefBlock(nn.Module):
    def __init__(self, w: dict):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
        with torch.no_grad():
            for p, k in ((self.norm.weight, "norm_w"), (self.norm.bias, "norm_b"), (self.fc1.weight, "w1"),
                         (self.fc1.bias, "b1"), (self.fc2.weight, "w2"), (self.fc2.bias, "b2")):
                p.copy_(w[k])

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))

    def grads(self) -> dict:
        return {"norm_w": self.norm.weight.grad, "norm_b": self.norm.bias.grad, "w1": self.fc1.weight.grad,
                "b1": self.fc1.bias.grad, "w2": self.fc2.weight.grad, "b2": self.fc2.bias.grad}


def reference(stages: int) -> tuple[list[float], list[dict]]:
    """Per-microbatch losses and per-stage full gradients of ``sum_i loss_i / M`` (the schedules' contract)."""
    blocks = [RefBlock(w) for w in full_weights(stages)]
    losses = []
    for x, target in batches():
        for b in blocks:
            x = b(x)
        loss = ((x - target) ** 2).mean()
        (loss / M).backward()
        losses.append(loss.item())
    return losses, [b.grads() for b in blocks]


# ---- the user model: Megatron-style tensor / sequence parallel collectives ---------------------------------------

def _own_slice(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(group.size(), 0)[group.rank()].contiguous()


class GatherSequence(torch.autograd.Function):
    """``[s/T, b, h]`` -> ``[s, b, h]`` (all-gather along the sequence).  Backward: the own slice of the gradient,
    summed over the group first when the consumer is tensor-parallel (``reduce``, Megatron's
    ``tensor_parallel_output_grad``: a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, reduce):
        ctx.group, ctx.reduce = group, reduce
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if ctx.reduce:
            dist.all_reduce(grad, group=ctx.group)
        return _own_slice(grad, ctx.group), None, None


class ReduceScatterSequence(torch.autograd.Function):
    """Partial sums ``[s, b, h]`` -> this rank's summed shard ``[s/T, b, h]``; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return _own_slice(total, group)

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(ctx.group.size())]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, 0), None


class CopyToTensorParallel(torch.autograd.Function):
    """Identity; backward all-reduces (the column-parallel input of a replicated activation)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce of the row-parallel partial sums; backward is the identity."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ParallelBlock(nn.Module):
    """One stage on one tensor-parallel rank: ``[s/T, b, h]`` (``sequence_parallel``) or ``[s, b, h]`` in and out."""

    def __init__(self, w: dict, group, sp: bool):
        super().__init__()
        tp, rank = group.size(), group.rank()
        self.group, self.sp = group, sp
        self.norm_w, self.norm_b = nn.Parameter(w["norm_w"].clone()), nn.Parameter(w["norm_b"].clone())
        self.w1 = nn.Parameter(w["w1"].chunk(tp, 0)[rank].clone())       # column-parallel [f/T, h]
        self.b1 = nn.Parameter(w["b1"].chunk(tp, 0)[rank].clone())
        self.w2 = nn.Parameter(w["w2"].chunk(tp, 1)[rank].clone())       # row-parallel [h, f/T]
        self.b2 = nn.Parameter(w["b2"].clone())                          # added once, after the reduction
        for p in (self.norm_w, self.norm_b, self.b2):
            p.sequence_parallel = sp  # Megatron's mark: gradient is a per-shard partial, all-reduced over TP

    def forward(self, x):
        y = F.layer_norm(x, (HIDDEN,), self.norm_w, self.norm_b)
        y = GatherSequence.apply(y, self.group, True) if self.sp else CopyToTensorParallel.apply(y, self.group)
        y = F.linear(torch.tanh(F.linear(y, self.w1, self.b1)), self.w2)
        y = ReduceScatterSequence.apply(y, self.group) if self.sp else ReduceFromTensorParallel.apply(y, self.group)
        return x + y + self.b2


class Stage(nn.Module):
    """A model chunk as Megatron's schedules expect it: ``config`` and ``set_input_tensor``."""

    def __init__(self, config, w: dict, group, first: bool):
        super().__init__()
        self.config, self.first, self.input_tensor = config, first, None
        self.block = ParallelBlock(w, group, config.sequence_parallel)

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0]

    def forward(self, x):
        if self.first:
            x = _own_slice(x, self.block.group) if self.config.sequence_parallel else x
        return self.block(x if self.first else self.input_tensor)


def finalize_sequence_parallel_grads(models, num_tokens, pg_collection=None, force_all_reduce=False):
    """Sum the sequence-parallel parameters' partial gradients over the tensor-parallel group (Megatron's
    ``_allreduce_non_tensor_model_parallel_grads``)."""
    group = ps.get_tensor_model_parallel_group()
    for chunk in models:
        for p in chunk.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=group)


def _forward_step(data_iterator, model):
    x, target = next(data_iterator)
    out = model(x)

    def loss_func(output):
        if model.config.sequence_parallel:  # the loss of the whole sequence, the same on every TP rank
            output = GatherSequence.apply(output, model.block.group, False)
        loss = ((output - target) ** 2).mean()
        return loss, {"lm loss": loss.detach().clone()}
    return out, loss_func


def _run_case(tp: int, sp: bool, vp) -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=PP,
                                 virtual_pipeline_model_parallel_size=vp)
    try:
        chunks, pp_rank = vp or 1, ps.get_pipeline_model_parallel_rank()
        config = ModelParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=PP,
                                     virtual_pipeline_model_parallel_size=vp, sequence_parallel=sp,
                                     pipeline_dtype=torch.float32, hidden_size=HIDDEN,
                                     finalize_model_grads_func=finalize_sequence_parallel_grads)
        weights, group = full_weights(PP * chunks), ps.get_tensor_model_parallel_group()
        stages = [c * PP + pp_rank for c in range(chunks)]
        model = [Stage(config, weights[s], group, first=(s == 0)) for s in stages]
        data = batches()
        iters = [iter(data) for _ in model] if vp else iter(data)
        with record_messages() as records:
            losses = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=iters, model=model if vp else model[0],
                num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        grads = {s: {n: p.grad.clone() for n, p in m.block.named_parameters()} for s, m in zip(stages, model)}
        return {"losses": [d["lm loss"].item() for d in losses], "grads": grads, "tp_rank": group.rank(),
                "records": [(r.direction, r.tag, r.shape, r.nbytes) for r in records],
                "act_sent": activation_bytes(records)}
    finally:
        ps.destroy_model_parallel()


def _job(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return {name: _run_case(*c) for name, c in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_job, WORLD, timeout=120)


def _stage_rank(rank: int) -> int:
    """Megatron's rank order (tensor fastest, then data, pipeline slowest): ranks 0, 1 are stage 0, ranks 2, 3
    stage 1, whatever the tensor / data split."""
    return rank // (WORLD // PP)


def _shard(full: torch.Tensor, name: str, tp: int, rank: int) -> torch.Tensor:
    dim = {"w1": 0, "b1": 0, "w2": 1}.get(name)
    return full if dim is None else full.chunk(tp, dim)[rank]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_losses_and_gradients_match_single_process_reference(results, name):
    tp, _, vp = CASES[name]
    ref_losses, ref_grads = reference(PP * (vp or 1))
    seen = set()
    for rank, res in enumerate(results):
        got = res[name]
        last = _stage_rank(rank) == PP - 1
        if last:
            assert got["losses"] == pytest.approx(ref_losses, rel=TOL), (rank, got["losses"], ref_losses)
        else:
            assert got["losses"] == []
        for stage, grads in got["grads"].items():
            seen.add(stage)
            for pname, g in grads.items():
                want = _shard(ref_grads[stage][pname], pname, tp, got["tp_rank"])
                err = ((g - want).abs().max() / want.abs().max()).item()
                assert g.shape == want.shape and err < TOL, (name, rank, stage, pname, err)
    assert seen == set(range(PP * (vp or 1)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_p2p_messages_carry_the_sequence_shard(results, name):
    tp, sp, vp = CASES[name]
    want = (SEQ // tp if sp else SEQ, MBS, HIDDEN)
    for rank, res in enumerate(results):
        data = [r for r in res[name]["records"] if r[1] in (TAG_ACT, TAG_GRAD)]
        assert data, (name, rank)
        assert {r[2] for r in data} == {want}, (name, rank, {r[2] for r in data})
        first = _stage_rank(rank) == 0
        sends = [r for r in data if r[0] == "send" and r[1] == TAG_ACT]
        # every chunk but the last virtual stage sends M activations (rank 0 holds stages 0, 2; rank 1 stages 1, 3)
        expected = M * (vp if first else vp - 1) if vp else (M if first else 0)
        assert len(sends) == expected, (name, rank, len(sends))


@pytest.mark.timeout(300)
def test_activation_bytes_with_sequence_parallel_are_one_over_t(results):
    for rank, res in enumerate(results):
        t1, t2, sp = (res[k]["act_sent"] for k in ("t1", "t2", "t2_sp"))
        if _stage_rank(rank) == 0:  # the first stage's ranks send the activations of 1F1B
            assert t1 == M * SEQ * MBS * HIDDEN * 4 and t2 == t1, (rank, t1, t2)
            assert sp * 2 == t2, (rank, sp, t2)  # exactly 1/T with T = 2
        else:
            assert t1 == t2 == sp == 0
