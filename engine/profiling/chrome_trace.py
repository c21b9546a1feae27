"""Merge per-rank timelines into one Chrome / Perfetto trace (``chrome://tracing``, https://ui.perfetto.dev).

Format: the Trace Event Format's JSON object form, ``{"traceEvents": [...], "displayTimeUnit": "ms"}``, with one
complete event (``"ph": "X"``, ``ts``/``dur`` in microseconds) per span, ``pid`` = pipeline rank, ``tid`` = span
category (compute, p2p, graph, sync in that order), plus ``process_name`` / ``thread_name`` metadata events so each
rank shows as "pipeline rank r".  Reference: the Trace Event Format document (Google, "Trace Event Format").

Ranks are gathered either in-process (:func:`gather_spans`, ``torch.distributed.gather_object`` to one rank) or
through per-rank files (:func:`save_rank_spans` then :func:`load_rank_spans` / :func:`merge_rank_files`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from ..runtime.tracing import CATEGORIES
from .timeline import Span

__all__ = ["to_chrome_trace", "write_chrome_trace", "gather_spans", "save_rank_spans", "load_rank_spans",
           "merge_rank_files"]


def _tid(category: str) -> int:
    return CATEGORIES.index(category) if category in CATEGORIES else len(CATEGORIES)


def to_chrome_trace(rank_spans: Sequence[Iterable[Span]], metadata: dict | None = None) -> dict:
    """One trace object for all ranks.

    Args:
        rank_spans: per pipeline rank, its spans (times in ns since a common anchor).
        metadata: stored under ``"otherData"`` (e.g. schedule, pp, vp, microbatches, simulated bubble).

    Returns:
        A JSON-serializable dict ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.
    """
    events: list[dict] = []
    for rank, spans in enumerate(rank_spans):
        spans = list(spans)
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"pipeline rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for cat in sorted({s.category for s in spans}, key=_tid):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": _tid(cat), "args": {"name": cat}})
        for s in sorted(spans, key=lambda s: (s.start_ns, s.depth)):
            events.append({"name": s.label, "cat": s.category, "ph": "X", "pid": rank, "tid": _tid(s.category),
                           "ts": s.start_ns / 1e3, "dur": max(s.end_ns - s.start_ns, 0) / 1e3,
                           "args": {"step": s.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def write_chrome_trace(path: str | os.PathLike, rank_spans: Sequence[Iterable[Span]],
                       metadata: dict | None = None) -> Path:
    """Write :func:`to_chrome_trace` to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome_trace(rank_spans, metadata)))
    return path


def gather_spans(spans: Sequence[Span], group=None, dst: int = 0) -> list[list[Span]] | None:
    """Collect every rank's spans on global rank ``dst`` of ``group`` (``torch.distributed.gather_object``).

    Collective: every rank of ``group`` must call it.  Returns the per-rank lists (in group-rank order) on ``dst``,
    ``None`` elsewhere.  Without an initialized process group it returns ``[spans]``.
    """
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return [list(spans)]
    payload = [tuple(_span_tuple(s)) for s in spans]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(payload, out, dst=dst, group=group)
    if out is None:
        return None
    return [[Span(*t) for t in rank_payload] for rank_payload in out]


def _span_tuple(s: Span) -> tuple:
    return (s.category, s.label, s.start_ns, s.end_ns, s.step, s.depth)


def save_rank_spans(path: str | os.PathLike, rank: int, spans: Sequence[Span]) -> Path:
    """Write one rank's spans as JSON (``{"rank": r, "spans": [[category, label, start_ns, end_ns, step, depth]]}``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "spans": [_span_tuple(s) for s in spans]}))
    return path


def load_rank_spans(path: str | os.PathLike) -> tuple[int, list[Span]]:
    """Read a file written by :func:`save_rank_spans`; returns ``(rank, spans)``.

    Raises:
        ValueError: the file is not a pipecast rank timeline.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "rank" not in data or "spans" not in data:
        raise ValueError(f"{path} is not a pipecast rank timeline (expected keys 'rank' and 'spans')")
    return int(data["rank"]), [Span(*t) for t in data["spans"]]


def merge_rank_files(paths: Iterable[str | os.PathLike]) -> list[list[Span]]:
    """Load several rank files into per-rank span lists indexed by rank.

    Raises:
        ValueError: two files claim the same rank, or a rank between 0 and the largest is missing.
    """
    by_rank: dict[int, list[Span]] = {}
    for p in paths:
        rank, spans = load_rank_spans(p)
        if rank in by_rank:
            raise ValueError(f"two timeline files for rank {rank} (second: {p}); pass one file per rank")
        by_rank[rank] = spans
    missing = sorted(set(range(max(by_rank, default=-1) + 1)) - set(by_rank))
    if missing:
        raise ValueError(f"timeline files for ranks {missing} are missing; pass one file per rank")
    return [by_rank[r] for r in range(len(by_rank))]
