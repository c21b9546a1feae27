"""Mixed precision of the training recipe, ``model.precision: bf16``, as Megatron-LM and torchtitan train: bf16
parameters and activations in the model chunks and bf16 messages between pipeline stages, each microbatch's
weight gradient summed into fp32 gradients over the step's microbatches, AdamW stepping fp32 master weights, the
loss and the global-norm clip in fp32 (Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740; bf16
needs no loss scaling: Kalamkar et al., arXiv:1905.12322).

Two forms, by the data-parallel form that runs (:class:`engine.training.parallel.Parallelism`):

* ``parallel.shard: none / optimizer``, with or without tensor parallelism -- Megatron's
  (``megatron/core/optimizer/optimizer.py``: ``Float16OptimizerWithFloat16Params``; its distributed optimizer for
  ZeRO-1): :class:`MasterWeights`.  The chunks are built in fp32 as for an fp32 run (the same seeded initial
  weights); each fp32 ``Parameter`` then moves into a *master* chunk -- a module tree of the same classes and
  names holding the fp32 ``Parameter`` objects themselves (tensor-parallel ``DTensor`` shards, ``shared_embedding``
  marks and all) -- and the model chunk gets a bf16 copy.  A post-accumulate-grad hook on each bf16 parameter adds
  the gradient autograd just accumulated into the master's fp32 ``.grad`` (Megatron's ``main_grad``: an exact
  upcast, one fp32 rounding; :func:`engine.runtime.main_grad.add_grad`) and clears it, so after a step the master
  gradient is the fp32 sum, in the order the backward passes ran (microbatch order per chunk under every schedule,
  split backward's ``W`` passes included), of each microbatch's bf16 gradient.  Everything that reads or writes
  the model's state -- the data-parallel reduction, ZeRO-1's shards, the clip, AdamW, checkpoints, ``init_from``,
  export -- works on the master chunks as on an fp32 run's chunks (``Parallelism.state_chunks``); after each
  optimizer step, after the optimizer is built and after a ``load_state_dict`` of a master module the bf16
  parameters are copied from the masters (round to nearest even).
* ``parallel.shard: full`` -- torchtitan's: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
  (:func:`engine.training.parallel.fsdp.shard_chunks`).  The sharded fp32 parameters are the master weights (the
  optimizer and checkpoints see them as in an fp32 run); each all-gather casts them to bf16 for the step; each
  microbatch's bf16 gradient is added into FSDP's fp32 unsharded accumulator as autograd writes it
  (:func:`engine.training.parallel.fsdp.accumulate_in_fp32`), then reduce-scattered in fp32.

Why two: a master copy beside bf16 parameters keeps the parameters a schedule, tensor parallelism and CUDA graphs
see plain modules (bf16 ``DTensor`` shards under tensor parallelism), and ZeRO-1 shards only AdamW's state as
before; under FSDP2 the sharded fp32 parameters already are one master copy, and FSDP's cast at the all-gather
costs nothing more.  Not done: Megatron's sharded master copy under ZeRO-1 (here every replica keeps the whole fp32
master, ``4`` bytes per parameter; its pieces are what ZeRO-1 shards), and the data-parallel all-reduce overlapped
with the backward (``parallel.overlap_grad_reduce``) for bf16: it runs in ``finalize_model_grads``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ...runtime.main_grad import add_grad

__all__ = ["MasterWeights", "COMPUTE_DTYPE"]

COMPUTE_DTYPE = torch.bfloat16
"""The dtype of parameters, activations and pipeline messages under ``model.precision: bf16``."""


class MasterWeights:
    """bf16 model chunks with fp32 master chunks (the first form of the module doc), built from fp32 ``chunks``
    in place: afterwards ``chunks`` hold bf16 parameters and :attr:`masters` the fp32 ones.

    Attributes:
        masters: per chunk its master module (same classes, names and attributes; never run).
    """

    def __init__(self, chunks: Sequence[nn.Module]):
        compute: dict[int, nn.Parameter] = {}
        for chunk in chunks:
            for p in chunk.parameters():
                if id(p) not in compute:
                    compute[id(p)] = nn.Parameter(p.detach().to(COMPUTE_DTYPE), requires_grad=p.requires_grad)
        memo: dict[int, nn.Module] = {}
        self.masters = [_mirror(chunk, compute, memo) for chunk in chunks]
        self._pairs = _pairs(chunks, self.masters)
        self._compute_of = {id(m): p for p, m in self._pairs}
        self._handles = [p.register_post_accumulate_grad_hook(_to_master(m)) for p, m in self._pairs
                         if p.requires_grad]
        self._handles += [m.register_load_state_dict_post_hook(self._after_load) for m in memo.values()]

    @torch.no_grad()
    def copy_to_compute(self) -> None:
        """Every bf16 parameter from its fp32 master (round to nearest even).  Local."""
        for p, m in self._pairs:
            p.copy_(m)

    def _after_load(self, module, incompatible_keys) -> None:
        """A master module was loaded (a resume): its bf16 parameters follow."""
        with torch.no_grad():
            for m in module.parameters(recurse=False):
                self._compute_of[id(m)].copy_(m)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy the masters into the bf16 parameters now (``init_from`` may have changed them) and after every
        ``optimizer.step()``."""
        self.copy_to_compute()
        self._handles.append(optimizer.register_step_post_hook(lambda *_: self.copy_to_compute()))

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _mirror(module: nn.Module, compute: dict[int, nn.Parameter], memo: dict[int, nn.Module]) -> nn.Module:
    """A module of ``module``'s class and attributes holding ``module``'s ``Parameter`` objects, its submodules
    mirrored alike (``memo``: a module seen twice is mirrored once); ``module`` gets ``compute[id(p)]`` in place of
    each ``p``.  Module hooks are not copied (the mirror never runs); buffers are shared."""
    if id(module) in memo:
        return memo[id(module)]
    twin = type(module).__new__(type(module))
    nn.Module.__init__(twin)
    internals = set(twin.__dict__)
    twin.__dict__.update({k: v for k, v in module.__dict__.items() if k not in internals and k != "forward"})
    twin.training = module.training
    twin._buffers = dict(module._buffers)
    twin._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    memo[id(module)] = twin
    for name, p in module._parameters.items():
        twin._parameters[name] = p
        if p is not None:
            module._parameters[name] = compute[id(p)]
    for name, child in module._modules.items():
        twin._modules[name] = None if child is None else _mirror(child, compute, memo)
    return twin


def _pairs(chunks: Sequence[nn.Module], masters: Sequence[nn.Module]) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """``(bf16 parameter, its fp32 master)``, each once, in chunk and parameter order."""
    seen, out = set(), []
    for chunk, master in zip(chunks, masters):
        for (_, p), (_, m) in zip(chunk.named_parameters(), master.named_parameters()):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((p, m))
    return out


def _to_master(master: nn.Parameter):
    """The post-accumulate-grad hook of one bf16 parameter: its ``.grad`` added into ``master.grad`` (fp32, zeros
    first when None), then cleared."""
    def hook(p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if master.grad is None:
            master.grad = torch.zeros_like(master)
        add_grad(master.grad, g)
        p.grad = None
    return hook
