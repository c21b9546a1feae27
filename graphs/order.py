"""Capture order of one pipeline rank, and the flat graph index of Transformer Engine's layout.

The order is the rank's sequence of forward and backward passes in Transformer Engine's ``_order`` notation:
``+(c+1)`` is a forward of model chunk ``c``, ``-(c+1)`` a backward of chunk ``c`` (1-based, sign = direction).
The ``k``-th forward of chunk ``c`` in one step is microbatch ``k`` of that chunk and backwards within a chunk are
FIFO, so the order alone names every ``(chunk, microbatch)`` (``shared/spec/cuda_graphs.md`` 1.2).

Graphs are captured per ``(chunk, microbatch, layer)`` and stored flat, chunk-major, then microbatch, then layer
(TE ``make_graphed_callables(_order=...)`` and Megatron's ``TECudaGraphHelper``, spec 1.1 / 2.6)::

    idx = (L_0 + ... + L_{c-1}) * M + m * L_c + l

with ``L_c`` the graphed layers of chunk ``c`` and ``M`` the microbatches per chunk.

This module depends only on the pure layer (``engine.plan``, ``engine.plan.table``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from engine.plan import Op, Plan
from engine.plan.table import convert_schedule_table_to_order, get_schedule_table

__all__ = [
    "LayerEvent", "graph_order", "check_order", "order_events", "layer_events", "flat_index", "unflat_index",
    "num_graphs", "layers_per_chunk_list", "max_in_flight",
]


@dataclass(frozen=True, slots=True)
class LayerEvent:
    """One graphed pass: ``kind`` ``"F"`` or ``"B"`` of layer ``layer`` of ``(chunk, microbatch)`` (0-based)."""

    kind: str
    chunk: int
    microbatch: int
    layer: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk} l{self.layer}"  # the action's notation, then the layer


def graph_order(plan: Plan, rank: int) -> list[int]:
    """The capture order of pipeline rank ``rank``: its training actions in TE ``_order`` notation.

    For interleaved plans this equals Megatron's ``convert_schedule_table_to_order(W_r, C, get_schedule_table(M, C,
    G))`` (spec schedules.md 1.14); the function checks it and raises ``RuntimeError`` if the plan disagrees.

    Raises:
        ValueError: ``rank`` outside ``[0, pp_size)`` or a forward-only plan (graphs capture training steps).
    """
    _check_rank(plan, rank)
    if plan.forward_only:
        raise ValueError("plan.forward_only=True: CUDA graphs are captured for training steps (forward and "
                         "backward); evaluation runs eagerly -- build the plan with forward_only=False")
    order = plan.order(rank)
    if plan.schedule == "interleaved":
        table = get_schedule_table(plan.num_microbatches, plan.num_model_chunks, plan.group_size)
        megatron = convert_schedule_table_to_order(plan.warmup[rank], plan.num_model_chunks, table)
        if megatron != order:
            raise RuntimeError(f"plan order of rank {rank} differs from convert_schedule_table_to_order "
                               f"(W={plan.warmup[rank]}): {order} vs {megatron}")
    return order


def order_events(order: Sequence[int]) -> Iterator[tuple[str, int, int]]:
    """Walk ``order``: yield ``("F"|"B", chunk, microbatch)`` (0-based) with per-chunk FIFO microbatch counters."""
    forwards: dict[int, int] = {}
    backwards: dict[int, int] = {}
    for entry in order:
        chunk = abs(entry) - 1
        counter = forwards if entry > 0 else backwards
        mb = counter.get(chunk, 0)
        counter[chunk] = mb + 1
        yield ("F" if entry > 0 else "B"), chunk, mb


def layer_events(order: Sequence[int], layers_per_chunk: Sequence[int]) -> list[LayerEvent]:
    """The per-layer passes of ``order``: a forward of ``(c, m)`` runs layers ``0..L_c-1``, a backward runs them
    in reverse (autograd).  This is the exact sequence in which graphs are captured and must be replayed."""
    events = []
    for kind, chunk, mb in order_events(order):
        layers = range(layers_per_chunk[chunk])
        events.extend(LayerEvent(kind, chunk, mb, l) for l in (layers if kind == "F" else reversed(layers)))
    return events


def check_order(order: Sequence[int], plan: Plan | None = None, rank: int | None = None,
                num_model_chunks: int | None = None, num_microbatches: int | None = None) -> None:
    """Check that ``order`` is a realisable capture order and, given ``plan`` and ``rank``, that it equals the
    order the runtime executes.

    Checks: entries are non-zero ints within ``[-C, C]``; causal (per chunk, no backward before its forward in
    any prefix, so backwards are FIFO); every chunk has exactly ``M`` forwards and ``M`` backwards; and, with a
    plan, equality with the rank's actions (chunk and microbatch of every pass).  TE itself checks none of this
    and fails later with an obscure error or, worse, replays graphs against the wrong buffers (spec 1.2, B15).

    Raises:
        TypeError: an entry is not an int.
        ValueError: any check fails; the message names the first offending position.
    """
    if plan is not None:
        if rank is None:
            raise ValueError("check_order(plan=...) needs rank=<pipeline rank> to compare with the runtime plan")
        _check_rank(plan, rank)
        num_model_chunks = plan.num_model_chunks if num_model_chunks is None else num_model_chunks
        num_microbatches = plan.num_microbatches if num_microbatches is None else num_microbatches
    order = list(order)
    for i, entry in enumerate(order):
        if isinstance(entry, bool) or not isinstance(entry, int):
            raise TypeError(f"order[{i}]={entry!r} is not an int; the order holds +(chunk+1) for a forward and "
                            f"-(chunk+1) for a backward")
        if entry == 0 or (num_model_chunks is not None and abs(entry) > num_model_chunks):
            raise ValueError(f"order[{i}]={entry} is out of range: entries are +-1..+-{num_model_chunks or 'C'} "
                             f"(model chunk + 1, signed)")
    chunks = num_model_chunks if num_model_chunks is not None else max((abs(e) for e in order), default=0)
    fwd = [0] * chunks
    bwd = [0] * chunks
    for i, entry in enumerate(order):
        c = abs(entry) - 1
        if entry > 0:
            fwd[c] += 1
        else:
            bwd[c] += 1
            if bwd[c] > fwd[c]:
                raise ValueError(f"order[{i}]={entry} is not causal: backward #{bwd[c]} of model chunk {c} comes "
                                 f"before its forward (only {fwd[c]} forwards of chunk {c} so far)")
    expect = num_microbatches if num_microbatches is not None else (fwd[0] if fwd else 0)
    for c in range(chunks):
        if fwd[c] != expect or bwd[c] != expect:
            raise ValueError(f"order has {fwd[c]} forwards and {bwd[c]} backwards of model chunk {c}; every chunk "
                             f"needs exactly num_microbatches={expect} of each")
    if plan is None:
        return
    runtime = [a for a in plan.actions[rank] if a.op is not Op.WEIGHT]
    if len(runtime) != len(order):
        raise ValueError(f"order has {len(order)} passes but rank {rank} of the {plan.schedule} plan runs "
                         f"{len(runtime)}; build the order with graphs.order.graph_order(plan, rank)")
    for i, ((kind, chunk, mb), action) in enumerate(zip(order_events(order), runtime)):
        if (kind, chunk, mb) != (action.op.value, action.chunk, action.microbatch):
            raise ValueError(f"order differs from the runtime plan of rank {rank} at position {i}: the order "
                             f"captures {kind}{mb}.{chunk}, the rank runs {action}; graphs captured in "
                             f"this order would be replayed against the wrong buffers -- use graph_order(plan, rank)")


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
    """TE/Megatron flat index of ``(chunk, microbatch, layer)``: ``sum(L[:c])*M + m*L[c] + l`` (spec 1.1)."""
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
    is still pending (NVIDIA/Megatron-LM#422, spec section 4 row 2).
    """
    live: dict[int, int] = {}
    peak = 0
    for entry in order:
        c = abs(entry)
        live[c] = live.get(c, 0) + (1 if entry > 0 else -1)
        peak = max(peak, live[c])
    return peak


def _check_rank(plan: Plan, rank) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.pp_size:
        raise ValueError(f"rank={rank!r} is not a pipeline rank of this plan (pp_size={plan.pp_size}); use 0..."
                         f"{plan.pp_size - 1}")
