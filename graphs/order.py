"""Capture order of one pipeline rank, and the flat graph index of Transformer Engine's layout.

The order is the rank's sequence of forward and backward passes in Transformer Engine's ``_order`` notation:
``+(c+1)`` is a forward of model chunk ``c``, ``-(c+1)`` a backward of chunk ``c`` (1-based, sign = direction).
The ``k``-th forward of chunk ``c`` in one step is microbatch ``k`` of that chunk and backwards within a chunk are
FIFO, so the order alone names every ``(chunk, microbatch)`` (TE's ``_order`` convention, ``transformer_engine/pytorch/graph.py``).  Split-backward
plans (zero-bubble schedules) add their weight-gradient passes ``W`` as ``-(c+1) - 0.5`` (TE's notation for a
separate weight-gradient step); their ``-(c+1)`` is then the input-gradient pass ``B``, and ``W`` passes within a
chunk are FIFO too (each chunk's ``W`` run in microbatch order).

Graphs are captured per ``(chunk, microbatch, layer)`` and stored flat, chunk-major, then microbatch, then layer
(TE ``make_graphed_callables(_order=...)`` and Megatron's ``TECudaGraphHelper``)::

    idx = (L_0 + ... + L_{c-1}) * M + m * L_c + l

with ``L_c`` the graphed layers of chunk ``c`` and ``M`` the microbatches per chunk.

This module depends only on the pure layer (``engine.plan``, ``engine.plan.table``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from engine.plan import Op, Plan
from engine.plan.registry import find_schedule
from engine.plan.table import convert_schedule_table_to_order, get_schedule_table

__all__ = [
    "LayerEvent", "capture_order", "check_order", "entry_kind", "order_events", "layer_events", "flat_index", "unflat_index",
    "num_graphs", "layers_per_chunk_list", "max_in_flight",
]


@dataclass(frozen=True, slots=True)
class LayerEvent:
    """One graphed pass: ``kind`` ``"F"``, ``"B"`` or ``"W"`` of layer ``layer`` of ``(chunk, microbatch)`` (0-based)."""

    kind: str
    chunk: int
    microbatch: int
    layer: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk} l{self.layer}"  # the action's notation, then the layer


def capture_order(plan: Plan, rank: int) -> list[int | float]:
    """The capture order of pipeline rank ``rank``: its training actions in TE ``_order`` notation, ``W`` actions
    of split-backward plans included (as ``-(c+1) - 0.5``, in the plan's position).

    For plans of a schedule Megatron-Core runs (a registry entry with a ``megatron_function``) this equals
    Megatron's ``convert_schedule_table_to_order(W_r, C, get_schedule_table(M, C, G))``; the function checks it and
    raises ``RuntimeError`` if the plan disagrees.

    Raises:
        ValueError: ``rank`` outside ``[0, pp_size)`` or a forward-only plan (graphs capture training steps).
    """
    _check_rank(plan, rank)
    if plan.forward_only:
        raise ValueError("plan.forward_only=True: CUDA graphs are captured for training steps (forward and "
                         "backward); evaluation runs eagerly -- build the plan with forward_only=False")
    if plan.splits_backward:
        return [_entry(a.op.value, a.chunk) for a in plan.actions[rank]]
    order = plan.te_order(rank)
    spec = find_schedule(plan.schedule)
    if spec is not None and spec.megatron_function is not None:
        table = get_schedule_table(plan.num_microbatches, plan.num_model_chunks, plan.group_size)
        megatron = convert_schedule_table_to_order(plan.warmup[rank], plan.num_model_chunks, table)
        if megatron != order:
            raise RuntimeError(f"plan order of rank {rank} differs from convert_schedule_table_to_order "
                               f"(W={plan.warmup[rank]}): {order} vs {megatron}")
    return order


def _entry(kind: str, chunk: int) -> int | float:
    """The order entry of a ``kind`` pass of 0-based ``chunk``: ``c+1``, ``-(c+1)`` or ``-(c+1) - 0.5``."""
    return chunk + 1 if kind == "F" else (-(chunk + 1) if kind == "B" else -(chunk + 1) - 0.5)


def entry_kind(entry) -> tuple[str, int]:
    """``(kind, 0-based chunk)`` of one order entry (see the module docstring for the notation)."""
    if isinstance(entry, float):
        return "W", int(-entry - 0.5) - 1
    return ("F" if entry > 0 else "B"), abs(entry) - 1


def order_events(order: Sequence[int | float]) -> Iterator[tuple[str, int, int]]:
    """Walk ``order``: yield ``("F"|"B"|"W", chunk, microbatch)`` (0-based) with per-chunk FIFO microbatch
    counters (one counter per kind)."""
    counters: dict[tuple[str, int], int] = {}
    for entry in order:
        kind, chunk = entry_kind(entry)
        mb = counters.get((kind, chunk), 0)
        counters[(kind, chunk)] = mb + 1
        yield kind, chunk, mb


def layer_events(order: Sequence[int | float], layers_per_chunk: Sequence[int]) -> list[LayerEvent]:
    """The per-layer passes of ``order``: a forward of ``(c, m)`` runs layers ``0..L_c-1``, a backward runs them
    in reverse (autograd), and so does a weight-gradient pass (its layers' ``W`` graphs were queued by ``B`` in
    that order).  This is the exact sequence in which graphs are captured and must be replayed."""
    events = []
    for kind, chunk, mb in order_events(order):
        layers = range(layers_per_chunk[chunk])
        events.extend(LayerEvent(kind, chunk, mb, l) for l in (layers if kind == "F" else reversed(layers)))
    return events


def check_order(order: Sequence[int | float], plan: Plan | None = None, rank: int | None = None,
                num_model_chunks: int | None = None, num_microbatches: int | None = None) -> None:
    """Check that ``order`` is a realisable capture order and, given ``plan`` and ``rank``, that it equals the
    order the runtime executes.

    Checks: entries are non-zero ints within ``[-C, C]`` or ``W`` entries ``-(c+1) - 0.5``; causal (per chunk, no
    backward before its forward and no ``W`` before its ``B`` in any prefix, so both are FIFO); every chunk has
    exactly ``M`` forwards and ``M`` backwards (and ``M`` ``W`` if it has any); and, with a plan, equality with the
    rank's actions (kind, chunk and microbatch of every pass, the ``W`` of split-backward plans included).  TE
    itself checks none of this and fails later with an obscure error or, worse, replays graphs against the wrong
    buffers (NVIDIA/Megatron-LM#6022).

    Raises:
        TypeError: an entry is not an int (nor a ``W`` entry).
        ValueError: any check fails; the message names the first offending position.
    """
    if plan is not None:
        if rank is None:
            raise ValueError("check_order(plan=...) needs rank=<pipeline rank> to compare with the runtime plan")
        _check_rank(plan, rank)
        num_model_chunks = plan.num_model_chunks if num_model_chunks is None else num_model_chunks
        num_microbatches = plan.num_microbatches if num_microbatches is None else num_microbatches
    order = list(order)
    _check_entries(order, num_model_chunks)
    chunks = num_model_chunks if num_model_chunks is not None else max((entry_kind(e)[1] + 1 for e in order),
                                                                       default=0)
    counts = _check_causal(order, chunks)
    expect = num_microbatches if num_microbatches is not None else (counts["F"][0] if chunks else 0)
    for c in range(chunks):
        f, b, w = counts["F"][c], counts["B"][c], counts["W"][c]
        if f != expect or b != expect or w not in (0, expect):
            raise ValueError(f"order has {f} forwards, {b} backwards and {w} weight-gradient passes of model chunk "
                             f"{c}; every chunk needs exactly num_microbatches={expect} forwards and backwards (and "
                             f"as many weight-gradient passes, or none)")
    if plan is not None:
        _check_against_plan(order, plan, rank)


def _check_entries(order: list, num_model_chunks: int | None) -> None:
    for i, entry in enumerate(order):
        weight = isinstance(entry, float) and entry < 0 and float(entry + 0.5).is_integer()
        if isinstance(entry, bool) or not (isinstance(entry, int) or weight):
            raise TypeError(f"order[{i}]={entry!r} is not an int; the order holds +(chunk+1) for a forward, "
                            f"-(chunk+1) for a backward and -(chunk+1)-0.5 for a weight-gradient pass")
        chunk = entry_kind(entry)[1]
        if entry == 0 or chunk < 0 or (num_model_chunks is not None and chunk >= num_model_chunks):
            raise ValueError(f"order[{i}]={entry} is out of range: entries are +-1..+-{num_model_chunks or 'C'} "
                             f"(model chunk + 1, signed; -0.5 more for a weight-gradient pass)")


def _check_causal(order: list, chunks: int) -> dict[str, list[int]]:
    """Per kind, the passes of each chunk; raises at the first backward before its forward or ``W`` before its
    ``B``."""
    counts = {"F": [0] * chunks, "B": [0] * chunks, "W": [0] * chunks}
    before = {"B": ("F", "forward", "backward"), "W": ("B", "backward", "weight-gradient pass")}
    for i, entry in enumerate(order):
        kind, c = entry_kind(entry)
        counts[kind][c] += 1
        if kind in before:
            need, need_name, name = before[kind]
            if counts[kind][c] > counts[need][c]:
                raise ValueError(f"order[{i}]={entry} is not causal: {name} #{counts[kind][c]} of model chunk {c} "
                                 f"comes before its {need_name} (only {counts[need][c]} {need_name}s of chunk {c} "
                                 f"so far)")
    return counts


def _check_against_plan(order: list, plan: Plan, rank: int) -> None:
    runtime = [a for a in plan.actions[rank] if plan.splits_backward or a.op is not Op.WEIGHT]
    if len(runtime) != len(order):
        raise ValueError(f"order has {len(order)} passes but rank {rank} of the {plan.schedule} plan runs "
                         f"{len(runtime)}{' (W included)' if plan.splits_backward else ''}; build the order with "
                         f"graphs.order.capture_order(plan, rank)")
    for i, ((kind, chunk, mb), action) in enumerate(zip(order_events(order), runtime)):
        if (kind, chunk, mb) != (action.op.value, action.chunk, action.microbatch):
            raise ValueError(f"order differs from the runtime plan of rank {rank} at position {i}: the order "
                             f"captures {kind}{mb}.{chunk}, the rank runs {action}; graphs captured in "
                             f"this order would be replayed against the wrong buffers -- use capture_order(plan, rank)")


def layers_per_chunk_list(layers_per_chunk: int | Sequence[int], num_model_chunks: int) -> list[int]:
    """Normalise ``L`` (an int for every chunk, or one int per chunk) to a list of ``num_model_chunks`` ints.

    Raises:
        ValueError: wrong length or a negative count.
    """
    if isinstance(layers_per_chunk, int) and not isinstance(layers_per_chunk, bool):
        values = [layers_per_chunk] * num_model_chunks
    else:
        values = list(layers_per_chunk)
    if len(values) != num_model_chunks or any(not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"layers_per_chunk={layers_per_chunk!r} must be a non-negative int or one per model chunk "
                         f"({num_model_chunks} chunks)")
    return values


def num_graphs(layers_per_chunk: Sequence[int], num_microbatches: int) -> int:
    """Number of forward passes (= graph pairs, = TE sample-argument entries): ``sum(L_c) * M``."""
    return sum(layers_per_chunk) * num_microbatches


def flat_index(chunk: int, microbatch: int, layer: int, layers_per_chunk: Sequence[int],
               num_microbatches: int) -> int:
    """TE/Megatron flat index of ``(chunk, microbatch, layer)``: ``sum(L[:c])*M + m*L[c] + l`` (TE ``make_graphed_callables``)."""
    if not (0 <= chunk < len(layers_per_chunk) and 0 <= microbatch < num_microbatches
            and 0 <= layer < layers_per_chunk[chunk]):
        raise IndexError(f"(chunk={chunk}, microbatch={microbatch}, layer={layer}) is outside the capture "
                         f"(layers_per_chunk={list(layers_per_chunk)}, num_microbatches={num_microbatches})")
    return sum(layers_per_chunk[:chunk]) * num_microbatches + microbatch * layers_per_chunk[chunk] + layer


def unflat_index(index: int, layers_per_chunk: Sequence[int], num_microbatches: int) -> tuple[int, int, int]:
    """Inverse of :func:`flat_index`: ``(chunk, microbatch, layer)``.

    Raises:
        IndexError: ``index`` outside ``[0, sum(L)*M)``.
    """
    start = 0
    for chunk, layers in enumerate(layers_per_chunk):
        size = layers * num_microbatches
        if start <= index < start + size:
            microbatch, layer = divmod(index - start, layers)
            return chunk, microbatch, layer
        start += size
    raise IndexError(f"graph index {index} is outside [0, {start}) for layers_per_chunk={list(layers_per_chunk)}, "
                     f"num_microbatches={num_microbatches}")


def max_in_flight(order: Sequence[int]) -> int:
    """Most microbatches of one chunk that are forwarded but not yet backwarded at any point of ``order``.

    One graph per layer shared by all microbatches (Megatron's PP=1 capture) is only correct when this is 1:
    otherwise a later forward overwrites the static buffers and saved activations of a microbatch whose backward
    is still pending (NVIDIA/Megatron-LM#422).
    """
    live: dict[int, int] = {}
    peak = 0
    for entry in order:
        kind, c = entry_kind(entry)
        if kind == "W":  # a forward is in flight until its input-gradient pass B
            continue
        live[c] = live.get(c, 0) + (1 if kind == "F" else -1)
        peak = max(peak, live[c])
    return peak


def _check_rank(plan: Plan, rank) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.pp_size:
        raise ValueError(f"rank={rank!r} is not a pipeline rank of this plan (pp_size={plan.pp_size}); use 0..."
                         f"{plan.pp_size - 1}")
