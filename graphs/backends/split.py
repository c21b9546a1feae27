"""Split backward inside one graphed layer: ``B`` computes the input gradients, ``W`` later the weight gradients.

The cut is made on the layer's autograd graph (the generic split of :mod:`engine.runtime.split_backward`), once per
captured graph: the *input path* is every node from which a static input is reachable; an *intermediate* is an
input-path node with an edge leaving the path (towards parameters), e.g. the ``addmm`` of a linear layer.

* ``B`` (:func:`input_grads`) backpropagates from the outputs to the inputs only, with the graph retained.
  Autograd computes only the outputs each node needs, so an intermediate's weight-side GEMM is skipped; a
  pre-hook on every intermediate records the gradient arriving there.  Those recorded gradients are what ``W``
  needs -- the static buffers a ``B`` replay writes and the ``W`` replay of the same ``(chunk, microbatch,
  layer)`` reads.
* ``W`` (:func:`weight_grads`) re-runs each intermediate from its recorded gradient, computing only its edges
  leaving the path (a post-hook reads them, so a parameter that two input-path ops share is still counted once
  per use), sums them per target in ``B``'s execution order, and backpropagates those sums -- plus the outputs
  whose graph reaches no input, with their grad-outputs -- to the parameters in one call.

Each parameter gradient is thus the sum of the same per-op contributions as in the unsplit backward, computed by
the same autograd formulas; held from ``B`` to ``W``: the saved activations of the layer's graph and one recorded
gradient per intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["LayerSplit", "analyze", "input_grads", "weight_grads"]


@dataclass
class LayerSplit:
    """The cut of one layer call's autograd graph.

    Attributes:
        intermediates: ``(node, [(k, child, input_nr), ...])`` per input-path node with edges leaving the path
            (``k``: the edge's index in ``node.next_functions``), in discovery order.
        path_outputs: indices (into the differentiable outputs) whose graph reaches an input.
        weight_only_outputs: indices of the others: their whole backward belongs to ``W``.
        b_order: indices into ``intermediates`` in the order ``B`` ran them (set by :func:`input_grads`; the
            autograd engine runs one graph in one order, so every replay of it repeats this one); ``W`` sums the
            gradients of a shared target in this order, as ``AccumulateGrad`` / an input buffer does in eager.
    """

    intermediates: list = field(default_factory=list)
    path_outputs: list[int] = field(default_factory=list)
    weight_only_outputs: list[int] = field(default_factory=list)
    b_order: list[int] = field(default_factory=list)


def analyze(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> LayerSplit:
    """Cut the graph from ``outputs`` (differentiable outputs) at ``inputs`` (leaves requiring grad).

    Raises:
        ValueError: an output is a leaf (the layer returns a parameter or an input): nothing to split.
    """
    stops = {get_gradient_edge(x).node for x in inputs}
    on_path: dict = {}
    edges: dict = {}
    split = LayerSplit()
    for i, out in enumerate(outputs):
        if out.grad_fn is None:
            raise ValueError(f"output {i} of the layer is a leaf tensor (an input or a parameter returned as is); "
                             f"split-backward graphs need every differentiable output computed in the layer")
        (split.path_outputs if _walk(out.grad_fn, stops, on_path, edges) else split.weight_only_outputs).append(i)
    for node, ok in on_path.items():
        if ok and node not in stops:
            off = [(k, c, nr) for k, (c, nr) in enumerate(edges[node]) if c is not None and not on_path[c]]
            if off:
                split.intermediates.append((node, off))
    return split


def _walk(root, stops: set, on_path: dict, edges: dict) -> bool:
    """Iterative depth-first walk filling ``on_path[node]`` (an input is reachable from it) and ``edges``."""
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            on_path[node] = any(c is not None and on_path[c] for c, _ in edges[node])
        elif node not in on_path:
            if node in stops:
                on_path[node] = True
                continue
            edges[node] = list(node.next_functions)
            on_path[node] = False  # provisional: the graph is a DAG, finished below
            stack.append((node, True))
            stack.extend((c, False) for c, _ in edges[node] if c is not None and c not in on_path)
    return on_path[root]


def input_grads(split: LayerSplit, outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                inputs: Sequence[torch.Tensor]) -> tuple[list, list]:
    """``B``: ``(input gradients, recorded)`` -- per input its gradient (``None`` if unreached), per intermediate
    the tuple of gradients that arrived at it (``None`` where the node did not run).  The graph is retained."""
    recorded: list = [None] * len(split.intermediates)
    if not inputs or not split.path_outputs:
        return [None] * len(inputs), recorded
    fired: list[int] = []

    def recorder(i):
        def hook(grads):
            recorded[i] = tuple(None if g is None else g.detach() for g in grads)
            fired.append(i)
        return hook

    handles = [node.register_prehook(recorder(i)) for i, (node, _) in enumerate(split.intermediates)]
    try:
        grads = torch.autograd.grad([outputs[i] for i in split.path_outputs],
                                    list(inputs), [grad_outputs[i] for i in split.path_outputs],
                                    retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    split.b_order = fired + [i for i in range(len(recorded)) if i not in set(fired)]
    return list(grads), recorded


def weight_grads(split: LayerSplit, recorded: Sequence, outputs: Sequence[torch.Tensor],
                 grad_outputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list:
    """``W``: the gradient of every parameter (``None`` if it gets none) from ``recorded`` (what ``B`` recorded,
    or buffers holding those values) and the grad-outputs of the weight-only outputs.  The graph is retained."""
    sums: dict = {}
    order = split.b_order or range(len(split.intermediates))
    for i in order:
        (node, off), grads = split.intermediates[i], recorded[i]
        if grads is None:
            continue
        for (_, c, nr), g in zip(off, _edge_grads(node, off, grads)):
            if g is not None:
                key = (id(c), nr)
                sums[key] = (GradientEdge(c, nr), g if key not in sums else sums[key][1] + g)
    roots = list(sums.values()) + [(get_gradient_edge(outputs[i]), grad_outputs[i])
                                   for i in split.weight_only_outputs]
    if not roots or not params:
        return [None] * len(params)
    return list(torch.autograd.grad([e for e, _ in roots], list(params), [g for _, g in roots],
                                    retain_graph=True, allow_unused=True))


def _edge_grads(node, off: list, grads: tuple) -> list:
    """Re-run ``node`` from ``grads`` computing its edges in ``off`` only; return their gradients (its own
    contribution, read by a post-hook)."""
    slots = [i for i, g in enumerate(grads) if g is not None]
    seen: list = []
    post = node.register_hook(lambda grad_inputs, grad_outs: seen.append(grad_inputs))
    try:
        torch.autograd.grad([GradientEdge(node, i) for i in slots], [GradientEdge(c, nr) for _, c, nr in off],
                            [grads[i] for i in slots], retain_graph=True, allow_unused=True)
    finally:
        post.remove()
    return [seen[0][k] if seen else None for k, _, _ in off]
