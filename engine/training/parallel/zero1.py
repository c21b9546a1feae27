"""Sharded data parallelism, ``parallel.shard: optimizer``: ZeRO-1 (Megatron-Core's distributed optimizer).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20), stage 1;
Megatron-Core ``megatron/core/optimizer/distrib_optimizer.py``.  Built on torch's collectives only:

* **Layout.**  The trainable parameters of each model chunk form one flat buffer (chunk order, parameter order;
  a ``Parameter`` two chunks of one rank share belongs to the first), zero-padded to a multiple of the size ``n``
  of its *shard group*: the data-parallel group.  Under expert parallelism (``parallel.expert > 1``) a chunk's
  routed-expert parameters (:func:`engine.moe.is_expert_parameter`) form a second buffer whose shard group is the
  expert-data-parallel group ``pg.expt_dp`` (the ranks holding the same experts; Megatron-Core's distributed
  optimizer shards expert parameters over it), the buckets of
  :class:`~engine.training.parallel.data_parallel.GradSync`.  Rank ``r`` of the shard group owns the contiguous
  shard ``[r*S, (r+1)*S)``, ``S = padded / n``.  Each parameter's part of the shard is one 1-D leaf tensor (a
  *piece*); AdamW (``torch.optim.AdamW``, ``fused=True``) runs on the pieces only, so its ``exp_avg`` /
  ``exp_avg_sq`` take ``1/n`` of the bytes of ``parallel.shard: none`` (within the padding of one shard).  A
  piece is a view of its parameter's storage (fp32 training: no separate master copy).  AdamW is elementwise, so a
  piece's update is the one the whole parameter would get (bitwise: the fused kernel's result does not depend on
  an element's position).
* **Gradients** (:class:`ShardedGradSync.finalize_model_grads`, the schedules' ``finalize_model_grads_func``):
  the tied word-embedding gradients are summed over the embedding group first (a sum, so it commutes with the
  data-parallel average; Megatron averages first -- the result differs by float rounding only), then each flat
  gradient is reduce-scattered (``dist.reduce_scatter_tensor`` / ``reduce_scatter_single``, sum) over its shard
  group and divided by the data-parallel size ``dp`` (the expert buffers too: an expert's gradient already sums
  the tokens its expert-parallel peers sent it, Megatron-Core's expert gradient scaling ``1 / dp``).  The full
  ``.grad`` tensors keep this rank's local (unreduced) sums: ZeRO-1 shards optimizer state, not gradients.
  ``no_sync`` keeps its meaning (backward passes inside only accumulate); no reduction starts before
  ``finalize_model_grads``, so a split schedule's deferred ``W`` passes have all run by then.
* **Step** (:class:`ShardedAdamW.step`): AdamW on the pieces, then each updated shard is all-gathered
  (``dist.all_gather_into_tensor`` / ``all_gather_single``) over its shard group back into the parameters, so
  every replica holds the same full weights.
* **Norm and clipping** (:meth:`ShardedAdamW.shard_grads` handed to
  :func:`engine.training.parallel.grad_norm.clip_grad_norm_`): the squared norm of this rank's dense pieces (the
  tied copy of the last stage left out) summed over the data-parallel group; that of its expert pieces over the
  expert-data-parallel group, then over the expert-parallel group (the layer's other experts); both over the
  pipeline group -- every parameter counted once in the job.
* **Checkpoints.**  ``state_dict()`` gives per parameter ``exp_avg`` / ``exp_avg_sq`` of the parameter's shape
  (the format and names of ``torch.optim.AdamW``), each this rank's piece of it as
  :class:`~engine.training.parallel.dtensor.LocalChunks` (a flat range of a row-major tensor: at most three
  rectangles), so DCP writes every rank's pieces without a gather and reads any layout's tensors into them;
  ``load_state_dict`` takes them (filled in place) or full tensors (keeps this rank's slice).  DCP's
  ``get_state_dict`` / ``set_state_dict`` see a plain AdamW over the model's parameters (experts under their
  global names), so a checkpoint of ``shard: optimizer`` resumes under ``shard: none`` and any pipeline and
  expert-parallel layout, and back.

torch's ``ZeroRedundancyOptimizer`` is not used: it all-reduces full gradients and broadcasts each rank's
parameters, where this layer reduce-scatters and all-gathers (half the gradient traffic per rank).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...moe import is_expert_parameter
from ...runtime.process_groups import group_rank, group_size
from .data_parallel import GradSync

__all__ = ["ShardedAdamW", "ShardedGradSync", "ChunkShard"]

# torch 2.13 names reduce_scatter_tensor / all_gather_into_tensor *_single (same semantics); older torch has only
# the former
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")  # torch.optim.AdamW's per-parameter state (amsgrad off)


class ChunkShard:
    """One flat buffer's layout (a model chunk's dense or routed-expert parameters) and this rank's shard of it.

    Args:
        params: the buffer's trainable parameters, in bucket order.
        group: its shard group (the data-parallel group; the expert-data-parallel one for routed experts), or None
            for one rank.

    Attributes:
        size, rank: the shard group's size and this rank's index in it.
    """

    def __init__(self, params: Sequence[nn.Parameter], group=None):
        self.params, self.group = list(params), group
        self.size, self.rank = group_size(group), group_rank(group)
        numel = sum(p.numel() for p in self.params)
        self.padded = -(-numel // self.size) * self.size if numel else 0
        self.shard_size = self.padded // self.size
        lo, hi = self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        self.ranges: list[tuple[nn.Parameter, int, int, int]] = []  # (param, its offset, shard lo, shard hi)
        offset = 0
        for p in self.params:
            a, b = max(offset, lo), min(offset + p.numel(), hi)
            if a < b:
                self.ranges.append((p, offset, a - lo, b - lo))
            offset += p.numel()
        self.grad_shard: torch.Tensor | None = None  # [S], set by ShardedGradSync.finalize_model_grads

    def flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[padded]``: the tensors (one per parameter) concatenated, zero-padded."""
        ref = self.params[0]
        out = torch.zeros(self.padded, dtype=ref.dtype, device=ref.device)
        offset = 0
        for t in tensors:
            out[offset:offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        return out

    def local_grad_shard(self) -> torch.Tensor:
        """This rank's slice of the local ``.grad`` (zeros where a gradient is missing), no communication."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        lo = self.rank * self.shard_size
        return self.flat(grads)[lo:lo + self.shard_size]

    @property
    def experts(self) -> bool:
        """Whether this buffer holds routed-expert parameters (sharded over the expert-data-parallel group)."""
        return is_expert_parameter(self.params[0])


class ShardedGradSync(GradSync):
    """:class:`~engine.training.parallel.data_parallel.GradSync` whose reduction is a reduce-scatter per bucket
    (a chunk's dense parameters over the data-parallel group, its routed experts over the expert-data-parallel
    group).

    Same hooks and meaning (``no_sync``, ``finalize_model_grads``); the reduction runs in
    ``finalize_model_grads`` (no overlap).  :attr:`shards` gives each bucket's layout (for :class:`ShardedAdamW`).
    """

    def __init__(self, chunks: Sequence[nn.Module], pg, tracer=None, tied_on_one_rank: bool = False):
        super().__init__(chunks, pg, overlap=False, tracer=tracer, tied_on_one_rank=tied_on_one_rank)
        self.shards = [ChunkShard(b.params, b.group) for b in self.buckets if b.params]

    def finalize_model_grads(self, model_chunks=None, num_tokens=None, pg_collection=None,
                             force_all_reduce: bool = False) -> None:
        """Sum the tied-embedding gradients, then reduce-scatter each bucket's flat gradient over its shard group
        and divide it by the data-parallel size (the average over the replicas)."""
        from ...finalize import sum_tied_grads
        if not self._tied_on_one_rank:
            sum_tied_grads(self.tied, self.pg)
        for shard in self.shards:
            flat = shard.flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in shard.params])
            out = torch.empty(shard.shard_size, dtype=flat.dtype, device=flat.device)
            if shard.size > 1:
                _reduce_scatter(out, flat, group=shard.group)
            else:
                out.copy_(flat)
            shard.grad_shard = out.div_(self.dp_size)


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW whose state lives on the pieces of this rank's shards (see the module docstring).

    ``param_groups`` hold the model's parameters (LR schedulers and DCP see a plain AdamW); the inner
    ``torch.optim.AdamW`` holds the pieces.  ``step()`` takes the reduce-scattered gradient shards of the last
    ``finalize_model_grads`` (or, when none ran -- DCP's zero-gradient state initialisation -- this rank's slice of
    the local ``.grad``) and ends with the parameter all-gather; it is collective over each buffer's shard group.

    Args:
        groups: AdamW parameter groups over the model's parameters (``params``, ``weight_decay``).
        sync: the run's :class:`ShardedGradSync` (layout, data-parallel and pipeline groups).
        lr, betas, eps: AdamW's hyperparameters.
    """

    def __init__(self, groups, sync: ShardedGradSync, lr: float, betas, eps: float):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.sync = sync
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._pieces: list[tuple[ChunkShard, nn.Parameter, int, int, int, torch.Tensor]] = []
        inner_groups = [{"params": [], "weight_decay": g["weight_decay"]} for g in self.param_groups]
        self._inner_of: list[int] = []
        for shard in sync.shards:
            for p, off, lo, hi in shard.ranges:
                start = lo + shard.rank * shard.shard_size - off  # first element of p in this piece
                piece = p.detach().view(-1)[start:start + hi - lo].requires_grad_(True)  # a view: no master copy
                self._pieces.append((shard, p, start, lo, hi, piece))
                inner_groups[group_of[id(p)]]["params"].append(piece)
        self.inner = torch.optim.AdamW([g for g in inner_groups if g["params"]] or [{"params": []}], lr=lr,
                                       betas=betas, eps=eps, fused=True)
        self._inner_group = [i for i, g in enumerate(inner_groups) if g["params"]]

    def _attach_grads(self) -> None:
        for shard, _p, _start, lo, hi, piece in self._pieces:
            if shard.grad_shard is None:
                shard.grad_shard = shard.local_grad_shard()
            piece.grad = shard.grad_shard[lo:hi]

    def shard_grads(self) -> tuple[list[torch.Tensor], list[bool], list[bool]]:
        """This rank's pieces of the reduced gradients (``[hi - lo]`` each, views of the reduce-scattered shards,
        the clip scales them in place) and, per piece, whether it counts in the global norm (not for the last
        stage's tied-embedding copy, whose gradient equals the first stage's) and whether it is a routed
        expert's (sharded over the expert-data-parallel group).  Local."""
        self._attach_grads()
        return ([piece.grad for *_, piece in self._pieces],
                [not getattr(p, "shared_embedding_copy", False) for _s, p, *_ in self._pieces],
                [s.experts for s, *_ in self._pieces])

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on this rank's pieces, then all-gather every chunk's updated shard into the parameters.  The
        optimizer's ``found_inf`` (a 0-dim float tensor, the ``GradScaler`` contract of torch's fused optimizers)
        goes to the inner AdamW: when it is 1 no piece nor moment changes, so the all-gather writes back the same
        weights."""
        if closure is not None:
            raise ValueError("ShardedAdamW.step takes no closure")
        self.inner.found_inf = getattr(self, "found_inf", None)
        self._attach_grads()
        for inner, outer in zip(self.inner.param_groups, self._inner_group):
            inner["lr"] = self.param_groups[outer]["lr"]
        self.inner.step()
        for shard in self.sync.shards:
            mine = torch.zeros(shard.shard_size, dtype=shard.params[0].dtype, device=shard.params[0].device)
            for s, _p, _start, lo, hi, piece in self._pieces:
                if s is shard:
                    mine[lo:hi].copy_(piece)
            full = torch.empty(shard.padded, dtype=mine.dtype, device=mine.device)
            if shard.size > 1:
                _all_gather(full, mine, group=shard.group)
            else:
                full.copy_(mine)
            offset = 0
            for p in shard.params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            shard.grad_shard = None
        self._mark_state()

    def _mark_state(self) -> None:
        """``self.state[p]`` names AdamW's keys with no tensors (the tensors live on the pieces): DCP's
        ``_init_optim_state`` checks that the state exists and its flattened load reads which keys a parameter has."""
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p] = dict.fromkeys(_STATE_KEYS)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)
        for shard in self.sync.shards:
            shard.grad_shard = None

    def _init_state(self) -> None:
        """Zero moments and step 0 on every piece AdamW has not stepped yet (what its first step creates), so a
        load before the first step has storage to read into."""
        for *_, piece in self._pieces:
            if "exp_avg" not in self.inner.state[piece]:
                self.inner.state[piece] = {"step": torch.zeros((), dtype=torch.float32, device=piece.device),
                                           "exp_avg": torch.zeros_like(piece), "exp_avg_sq": torch.zeros_like(piece)}

    def _step_tensor(self) -> torch.Tensor:
        for piece_state in self.inner.state.values():
            return piece_state["step"].detach().clone()
        return torch.tensor(0.0)

    def _in_order(self):
        """``(index, parameter, start, piece)`` in the state dict's order (``piece`` None where this rank holds no
        part of the parameter)."""
        piece_of = {id(p): (start, piece) for _s, p, start, _lo, _hi, piece in self._pieces}
        params = [p for g in self.param_groups for p in g["params"]]
        return [(i, p, *piece_of.get(id(p), (0, None))) for i, p in enumerate(params)]

    def state_dict(self) -> dict:
        """``torch.optim.AdamW``'s format over the model's parameters, each moment this rank's piece of it as
        :class:`~engine.training.parallel.dtensor.LocalChunks` of the parameter's shape: DCP writes every rank's
        pieces and reads any layout's into them, nothing gathered.  Local."""
        from .dtensor import flat_range_chunks
        self._init_state()
        sd, step = super().state_dict(), self._step_tensor()
        for index, p, start, piece in self._in_order():
            state = self.inner.state[piece] if piece is not None else {}
            sd["state"][index] = {"step": step.clone()} | {
                k: flat_range_chunks(p.shape, start, state.get(k, p.new_empty(0))) for k in ("exp_avg", "exp_avg_sq")}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load an AdamW state dict over the model's parameters: :meth:`state_dict`'s form (the moments'
        ``LocalChunks``, filled by DCP in place) or full tensors (any layout's; this rank keeps its slice)."""
        from .dtensor import LocalChunks
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]  # torch's key -> parameter order
        saved = {i: state_dict["state"][k] for i, k in enumerate(keys) if k in state_dict["state"]}
        self._init_state()
        for index, _p, start, piece in self._in_order():
            if piece is None or "exp_avg" not in saved.get(index, {}):
                continue
            state = self.inner.state[piece]
            state["step"].copy_(saved[index]["step"].reshape(()))
            for k in ("exp_avg", "exp_avg_sq"):
                v = saved[index][k]
                source = v.local if isinstance(v, LocalChunks) else v.reshape(-1)[start:start + piece.numel()]
                if source is not state[k]:
                    state[k].copy_(source)
        self._mark_state()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the pieces' AdamW moments and steps)."""
        return sum(t.numel() * t.element_size() for s in self.inner.state.values() for t in s.values()
                   if torch.is_tensor(t))
