"""A memory-pool model of ordered capture: why graphs must be captured in the order they are replayed.

All graphs of a rank share one memory pool (``torch.cuda.graph(pool=...)``).  While capturing, a block freed by
one capture can be handed to any later capture; at replay, a graph writes every block it used when captured.  If a
graph replays while another graph's live data sits in one of its blocks, that data is silently overwritten:
so a graph may replay only when no other graph's live data sits in its blocks.

The model, with blocks of one size and a first-fit allocator:

* forward capture of ``(c, m, l)``: allocate its saved-activation block (kept until its backward is captured), then
  a scratch block (freed at once);
* backward capture: allocate a scratch block (freed at once), free the saved-activation block;
* replay: a forward writes its activation and scratch blocks, a backward writes its scratch block and reads its
  activation block; a write into a block that holds another pass's live activations is a *conflict*.

Static outputs and gradient buffers are never freed, so they cannot conflict and are left out.  Capturing in the
runtime order gives zero conflicts by construction; torch's fixed order (all forwards, then all backwards reversed)
or a single swapped pair does not (``tests/graphs/test_graphs_order.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .order import LayerEvent, layer_events

__all__ = ["PoolModel", "pool_conflicts"]


@dataclass
class PoolModel:
    """Result of :func:`pool_conflicts`: pool size in blocks and the conflicts found at replay."""

    num_blocks: int
    conflicts: list[tuple[LayerEvent, LayerEvent, int]] = field(default_factory=list)  # (writer, victim, block)


def _first_fit(free: set[int], top: list[int]) -> int:
    if free:
        block = min(free)
        free.remove(block)
        return block
    top[0] += 1
    return top[0] - 1


def pool_conflicts(capture_order: Sequence[int], runtime_order: Sequence[int],
                   layers_per_chunk: Sequence[int]) -> PoolModel:
    """Capture in ``capture_order``, replay in ``runtime_order`` (TE order notation), report conflicts."""
    free: set[int] = set()
    top = [0]
    act: dict[tuple[int, int, int], int] = {}
    writes: dict[LayerEvent, tuple[int, ...]] = {}
    for ev in layer_events(capture_order, layers_per_chunk):
        key = (ev.chunk, ev.microbatch, ev.layer)
        if ev.kind == "F":
            act[key] = _first_fit(free, top)
            scratch = _first_fit(free, top)
            free.add(scratch)
            writes[ev] = (act[key], scratch)
        else:
            scratch = _first_fit(free, top)
            free.add(scratch)
            writes[ev] = (scratch,)
            free.add(act[key])
    model = PoolModel(top[0])
    owner: dict[int, LayerEvent] = {}  # block -> forward pass whose activations live there at runtime
    for ev in layer_events(runtime_order, layers_per_chunk):
        mine = LayerEvent("F", ev.chunk, ev.microbatch, ev.layer)
        for block in writes[ev]:
            victim = owner.get(block)
            if victim is not None and victim != mine:
                model.conflicts.append((ev, victim, block))
        if ev.kind == "F":
            owner[act[(ev.chunk, ev.microbatch, ev.layer)]] = mine
        else:
            block = act[(ev.chunk, ev.microbatch, ev.layer)]
            if owner.get(block) == mine:
                del owner[block]
    return model
