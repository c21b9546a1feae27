"""Gantt charts of pipeline timelines (simulated or measured), drawn with matplotlib's Agg backend.

:func:`plot_timeline` takes generic :class:`Bar` rows, so the simulator (``pipecast schedule --plot``) and the
profiler (measured per-rank timelines) share it.  matplotlib is imported only when a chart is drawn; no pyplot
global state is touched (a ``Figure`` with an Agg canvas), so it works headless and inside tests.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

__all__ = ["Bar", "plot_timeline", "plot_formats", "check_plot_path", "KIND_COLOURS"]

KIND_COLOURS = {"F": "#4C78A8", "B": "#F58518", "W": "#54A24B"}
"""Colours of the known kinds: forward, backward, weight-gradient.  Other kinds get the ``_EXTRA`` palette."""
_EXTRA = ("#B279A2", "#9D755D", "#72B7B2", "#E45756", "#BAB0AC", "#EECA3B")
_KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


class Bar(NamedTuple):
    """One bar of a timeline: ``kind`` work on pipeline ``rank`` from ``start`` to ``end`` (any time unit)."""

    rank: int
    start: float
    end: float
    label: str
    kind: str


def plot_formats() -> tuple[str, ...]:
    """The file suffixes (without the dot) matplotlib's Agg canvas writes (``png``, ``pdf``, ``svg``, ...).

    Raises:
        ValueError: matplotlib is not installed (naming the fix)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("drawing a chart needs matplotlib, which is not installed; pip install matplotlib (or "
                         "pip install -e '.[dev]')") from None
    return tuple(sorted(FigureCanvasAgg(Figure()).get_supported_filetypes()))


def check_plot_path(path: str | Path) -> None:
    """Refuse, before any work, a chart path whose suffix matplotlib cannot write.

    Raises:
        ValueError: no suffix or an unsupported one (naming the formats it can write), or no matplotlib.
    """
    suffix = Path(path).suffix.lower().lstrip(".")
    formats = plot_formats()
    if suffix not in formats:
        what = f"'.{suffix}' is not an image format matplotlib writes" if suffix else "the name has no file suffix"
        raise ValueError(f"{what}; end the name in one of {', '.join('.' + f for f in formats)} (e.g. "
                         f"{Path(path).with_suffix('.png').name})")


def plot_timeline(rows: Iterable[Bar | Sequence], path: str | Path, title: str,
                  bubbles: Sequence[float] | Mapping[int, float] | None = None, time_unit: str = "time") -> Path:
    """Draw one row per rank (rank 0 on top), one bar per span coloured by kind and labelled where it fits.

    Args:
        rows: spans ``(rank, start, end, label, kind)``; kinds ``"F"``, ``"B"``, ``"W"`` have fixed colours.
        path: output file; the format follows its suffix (``.png`` recommended).
        title: chart title.
        bubbles: optional bubble fraction per rank (sequence indexed by rank or ``{rank: fraction}``), printed
            beside each row as a percentage.
        time_unit: x-axis label.

    Returns:
        The written path.

    Raises:
        ValueError: a span with ``end < start`` or a negative rank, or no spans at all.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    spans = [Bar(*r) for r in rows]
    if not spans:
        raise ValueError("plot_timeline got no spans: nothing to draw")
    for s in spans:
        if s.end < s.start or s.rank < 0:
            raise ValueError(f"span {s} is invalid: needs rank >= 0 and end >= start")
    ranks = max(s.rank for s in spans) + 1
    t0 = min(s.start for s in spans)
    t1 = max(s.end for s in spans)
    extent = (t1 - t0) or 1.0
    colours = dict(KIND_COLOURS)
    for kind in dict.fromkeys(s.kind for s in spans):
        colours.setdefault(kind, _EXTRA[(len(colours) - len(KIND_COLOURS)) % len(_EXTRA)])

    per_rank = max(sum(1 for s in spans if s.rank == r) for r in range(ranks))
    width_in = min(max(12.0, 0.32 * per_rank + 3.0), 48.0)  # wide enough to label typical bars
    row_in, top_in, bottom_in = 0.5, 0.5, 0.8
    height_in = top_in + row_in * ranks + bottom_in
    fig = Figure(figsize=(width_in, height_in), dpi=110)
    FigureCanvasAgg(fig)
    left, right = 0.9 / width_in, 1.0 - 1.3 / width_in
    fig.subplots_adjust(left=left, right=right, top=1 - top_in / height_in, bottom=bottom_in / height_in)
    ax = fig.add_subplot(1, 1, 1)
    axis_in = width_in * (right - left)
    font = 7 if ranks <= 16 else 5
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in spans:
        groups.setdefault((s.kind, s.rank), []).append((s.start, s.end - s.start))
    for (kind, rank), bars in groups.items():
        ax.broken_barh(bars, (rank - 0.4, 0.8), facecolors=colours[kind], edgecolor="white", linewidth=0.5)
    for s in spans:  # label a bar only where the text fits inside it
        text_in = len(s.label) * 0.55 * font / 72 + 0.03
        if s.label and (s.end - s.start) / extent * axis_in >= text_in:
            ax.text((s.start + s.end) / 2, s.rank, s.label, ha="center", va="center", fontsize=font, color="white")
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.set_xlim(t0, t1)
    ax.set_xlabel(time_unit)
    ax.set_title(title)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    if bubbles is not None:
        values = dict(bubbles) if isinstance(bubbles, Mapping) else dict(enumerate(bubbles))
        for rank, fraction in values.items():
            ax.annotate(f"bubble {100 * fraction:.1f}%", xy=(1.01, rank), xycoords=("axes fraction", "data"),
                        va="center", fontsize=8)
    handles = [Patch(facecolor=c, label=_KIND_NAMES.get(k, k)) for k, c in colours.items()
               if any(s.kind == k and s.end > s.start for s in spans)]  # a kind drawn (zero-length W: not)
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    path = Path(path)
    fig.savefig(path)
    return path
