"""fp32 gradient accumulation beside low-precision parameters: Megatron's ``main_grad``.

With bf16 parameters each microbatch's weight gradient comes out of autograd in bf16; summing the microbatches of a
step in bf16 would round after every addition.  :func:`attach_main_grad` gives each parameter a ``main_grad``
(fp32, the parameter's shape) and a post-accumulate-grad hook that adds the gradient autograd just accumulated into
``.grad`` to ``main_grad`` and clears ``.grad``.  So after a step ``main_grad`` holds the fp32 sum, in the order the
backward passes ran, of each microbatch's bf16 gradient -- in microbatch order per model chunk under every pipecast
schedule (Megatron-Core's ``DistributedDataParallel`` grad buffers with ``gradient_accumulation_fusion`` off: the
per-parameter hook ``param.main_grad.add_(param.grad)``; ``megatron/core/distributed/distributed_data_parallel.py``).
Split backward's W passes accumulate through the parameters' ``AccumulateGrad`` nodes, so they add into
``main_grad`` the same way (:mod:`engine.runtime.split_backward`).

Readers of gradients take :func:`grad_of` (``main_grad`` when a parameter has one, else ``.grad``):
:func:`engine.finalize.finalize_model_grads` does, as Megatron's ``finalize_model_grads`` reads ``main_grad``.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

__all__ = ["MainGrad", "attach_main_grad", "grad_of", "add_grad"]


def grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient a reader of ``p`` should use: its ``main_grad`` (fp32 accumulation) if it has one, else
    ``p.grad``."""
    main = getattr(p, "main_grad", None)
    return p.grad if main is None else main


def add_grad(main: torch.Tensor, g: torch.Tensor) -> None:
    """``main += g`` in ``main``'s dtype (fp32 += bf16: an exact upcast, then one fp32 rounding); a ``DTensor``
    gradient laid out otherwise than ``main`` is redistributed to ``main``'s placements first."""
    placements = getattr(main, "placements", None)
    if placements is not None and tuple(g.placements) != tuple(placements):
        g = g.redistribute(main.device_mesh, placements)
    main.add_(g)


def _accumulate(p: torch.Tensor) -> None:
    """Post-accumulate-grad hook: ``main_grad += grad`` (:func:`add_grad`), ``grad = None``."""
    g = p.grad
    if g is None:
        return
    add_grad(p.main_grad, g)
    p.grad = None


class MainGrad:
    """The ``main_grad`` buffers and hooks of a set of parameters (:func:`attach_main_grad`).

    Attributes:
        params: the parameters, each once, in the order given.
    """

    def __init__(self, params: list, dtype: torch.dtype) -> None:
        self.params = params
        self._handles = []
        for p in params:
            p.main_grad = torch.zeros_like(p, dtype=dtype)
            self._handles.append(p.register_post_accumulate_grad_hook(_accumulate))

    def zero(self) -> None:
        """Zero every ``main_grad`` (the start of a step) and drop any ``.grad``."""
        for p in self.params:
            p.main_grad.zero_()
            p.grad = None

    def remove(self) -> None:
        """Take the hooks off and delete the ``main_grad`` attributes."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self.params:
            del p.main_grad


def attach_main_grad(modules: Iterable[nn.Module], dtype: torch.dtype = torch.float32) -> MainGrad:
    """Give every parameter of ``modules`` that requires grad (a parameter shared by two modules once) an fp32
    ``main_grad`` that accumulates its gradients (module doc).  Returns the :class:`MainGrad` handle.

    Raises ``ValueError`` if a parameter already has a ``main_grad`` (attach once), ``TypeError`` for a
    non-module.
    """
    params, seen = [], set()
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"attach_main_grad: expected torch.nn.Module objects, got {type(m).__name__}")
        for name, p in m.named_parameters():
            if p.requires_grad and id(p) not in seen:
                if hasattr(p, "main_grad"):
                    raise ValueError(f"attach_main_grad: parameter {name!r} already has a main_grad; attach once "
                                     "(or call remove() on the earlier handle)")
                seen.add(id(p))
                params.append(p)
    return MainGrad(params, dtype)
