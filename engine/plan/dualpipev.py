"""DualPipeV: DeepSeek-AI's DualPipe cut in half, on the V placement, with overlapped forward-backward cells.

DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, sec. 3.2.1; public code
github.com/deepseek-ai/DualPipe) feeds microbatches from both ends of the pipeline and overlaps a forward of one
microbatch with a backward of another in one cell, so that one's compute hides the other's communication.
DualPipeV, the "cut-in-half" variant (the same repository; torch 2.13's
``torch.distributed.pipelining.ScheduleDualPipeV``), keeps one direction on the V placement
(:func:`engine.plan.types.v_placement`: rank ``r`` holds stage ``r`` as chunk 0 and stage ``2P-1-r`` as chunk 1).

Rank ``r`` of ``P`` with ``M >= 2P`` microbatches runs, in eight phases (``F0`` / ``F1``: the next forward of chunk
0 / 1; a *full* backward is ``B`` followed at once by its ``W``; a *split* backward is ``B`` alone, its ``W`` queued;
``W?``: the oldest queued ``W``, if any; ``[x y]``: one :class:`~engine.plan.types.Compound` cell, x then y):

1. ``2(P-1-r)`` times ``F0``;
2. ``r+1`` times ``F0 F1``;
3. ``P-1-r`` times split ``B1``, ``W?``, ``F1``;
4. ``M-2P+r+1`` times ``[F0 full-B1] [F1 full-B0]`` -- except the last rank's first ``F0`` and ``B1``, run as two
   cells (not overlapped) to shorten its bubble;
5. ``P-1-r`` times full ``B1``, ``[F1 full-B0]``;
6. ``r+1`` times ``B1 B0``, full until the middle iteration ``(r+1)//2`` and split from there on (an odd rank splits
   that iteration's ``B1`` already, an even rank from its ``B0``);
7. ``P-1-r`` times ``W?``, ``B0`` (split once phase 6 switched);
8. ``r+1`` times ``W?``.

Every chunk's weight gradients thus accumulate in microbatch order.  The plan splits the backward (it has ``W``
passes), runs under no in-flight limit, and is checked by :func:`engine.plan.validate.validate_plan` like every plan.
The forward-only plan (evaluation) is each rank's forwards in the same order.  Pure: no torch.
"""
from __future__ import annotations

from .types import Action, Op, Plan, v_placement

__all__ = ["dualpipev_plan", "dualpipev_rank"]


class _Order:
    """One rank's actions and compound spans as they are appended (next microbatch per chunk, queued ``W``)."""

    def __init__(self):
        self.actions: list[Action] = []
        self.spans: list[tuple[int, int]] = []
        self.next_f, self.next_b, self.queued = [0, 0], [0, 0], []

    def forward(self, chunk: int) -> None:
        self.actions.append(Action(Op.FORWARD, chunk, self.next_f[chunk]))
        self.next_f[chunk] += 1

    def backward(self, chunk: int, split: bool) -> None:
        mb = self.next_b[chunk]
        self.next_b[chunk] += 1
        self.actions.append(Action(Op.BACKWARD, chunk, mb))
        if split:
            self.queued.append(Action(Op.WEIGHT, chunk, mb))
        else:
            self.actions.append(Action(Op.WEIGHT, chunk, mb))

    def weight(self) -> None:
        if self.queued:
            self.actions.append(self.queued.pop(0))

    def overlapped(self, forward_chunk: int, backward_chunk: int) -> None:
        start = len(self.actions)
        self.forward(forward_chunk)
        self.backward(backward_chunk, split=False)
        self.spans.append((start, len(self.actions)))


def dualpipev_rank(pp_size: int, num_microbatches: int, rank: int) -> tuple[list[Action], list[tuple[int, int]]]:
    """Rank ``rank``'s actions and compound spans (the eight phases of the module doc)."""
    P, M, r, o = pp_size, num_microbatches, rank, _Order()
    for _ in range(2 * (P - 1 - r)):
        o.forward(0)
    for _ in range(r + 1):
        o.forward(0)
        o.forward(1)
    for _ in range(P - 1 - r):
        o.backward(1, split=True)
        o.weight()
        o.forward(1)
    for i in range(M - 2 * P + r + 1):
        if i == 0 and r == P - 1:
            o.forward(0)
            o.backward(1, split=False)
        else:
            o.overlapped(0, 1)
        o.overlapped(1, 0)
    for _ in range(P - 1 - r):
        o.backward(1, split=False)
        o.overlapped(1, 0)
    split, middle = False, (r + 1) // 2
    for i in range(r + 1):
        split = split or (i == middle and r % 2 == 1)
        o.backward(1, split)
        split = split or (i == middle and r % 2 == 0)
        o.backward(0, split)
    for _ in range(P - 1 - r):
        o.weight()
        o.backward(0, split)
    for _ in range(r + 1):
        o.weight()
    return o.actions, o.spans


def dualpipev_plan(pp_size: int, num_microbatches: int, num_model_chunks: int = 2,
                   forward_only: bool = False, overlap_moe_expert_parallel_comm: bool | None = None) -> Plan:
    """The DualPipeV plan (module doc) for ``pp_size`` ranks, two model chunks each, ``num_microbatches``.
    ``overlap_moe_expert_parallel_comm`` changes nothing here: the cells are always there; the runtime overlaps
    them when the run asks for it.

    The forward-only plan (evaluation, sampling) takes any ``num_microbatches >= 1``: each rank runs the forwards
    of its chunk 0 for every microbatch, then those of its chunk 1 (stage order, so no rank waits on a later one).

    Raises:
        ValueError: ``num_model_chunks != 2`` or, for training, ``num_microbatches < 2 * pp_size`` (DualPipeV fills
            both chunks' pipelines before its steady phase, as torch's ScheduleDualPipeV requires).
    """
    if num_model_chunks != 2:
        raise ValueError(f"dualpipev places two model chunks on each rank, got num_model_chunks={num_model_chunks}; "
                         "set parallel.virtual: 2")
    if forward_only:
        per_rank = tuple(tuple(Action(Op.FORWARD, c, mb) for c in (0, 1) for mb in range(num_microbatches))
                         for _ in range(pp_size))
        return Plan("dualpipev", pp_size, 2, num_microbatches, num_microbatches, True,
                    tuple(len(a) for a in per_rank), per_rank, v_placement(pp_size))
    if num_microbatches < 2 * pp_size:
        raise ValueError(f"dualpipev needs num_microbatches >= 2 * pp_size = {2 * pp_size} (one per virtual stage), "
                         f"got num_microbatches={num_microbatches}; use more microbatches per step or schedule 'zbv'")
    shared: dict = {}
    per_rank, spans = [], []
    for r in range(pp_size):
        acts, mine = dualpipev_rank(pp_size, num_microbatches, r)
        per_rank.append(tuple(shared.setdefault(a, a) for a in acts))
        spans.append(tuple(mine))
    warmup = tuple(next((i for i, a in enumerate(acts) if a.op is not Op.FORWARD), len(acts)) for acts in per_rank)
    return Plan("dualpipev", pp_size, 2, num_microbatches, num_microbatches, False, warmup, tuple(per_rank),
                v_placement(pp_size), compounds=tuple(spans) if any(spans) else None)
