"""Pipeline layouts: which layers each virtual pipeline stage holds, for uneven stages.

A layout lists the virtual pipeline stages in stage order, separated by ``|``; each stage is a sequence of layer
kinds: ``E`` the embedding, ``t`` a decoder (transformer) layer, ``L`` the output head and the loss.  ``x*N``
repeats one character (``|`` included) and ``(...)*N`` a group, commas are cosmetic.  ``"Et*3|t*4|t*4|t*3L"`` puts
the embedding and three layers on stage 0, four layers on stages 1 and 2, and three layers with the head on
stage 3: a lighter first and last stage for a vocabulary-heavy model.  The notation is Megatron-Core's
``--pipeline-model-parallel-layout`` (``megatron/core/transformer/pipeline_parallel_layer_layout.py``), without its
multi-token-prediction layers (``m``); groups may nest.

A layout is independent of the placement: stage ``s`` runs wherever the plan puts it
(:attr:`engine.plan.types.Plan.stage_map`: the looped placement for 1F1B and interleaved 1F1B, the V placement for
ZB-V and DualPipeV).  :func:`resolve_layout` checks a layout against the run's sizes before anything starts;
:func:`stage_costs` turns per-kind costs (compute time, bytes) into per-stage costs for the simulator and the
tuner.  Pure: no torch.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

__all__ = ["KINDS", "PipelineLayout", "parse_layout", "resolve_layout", "stage_costs", "kind_costs", "LAYOUT_NAMES",
           "lighter_ends"]

KINDS = {"E": "the embedding", "t": "a decoder layer", "L": "the output head and loss"}
"""Layer kinds of a layout and what each stands for."""
MAX_LAYOUT_LAYERS = 1 << 20
"""Upper bound on the layers a layout may expand to (a typo such as ``t*40000000`` fails fast)."""
LAYOUT_NAMES = {"layout": "pipeline_layout", "num_layers": "num_layers",
                "pipeline": "pipeline_model_parallel_size", "virtual": "virtual_pipeline_model_parallel_size"}
"""The names :func:`resolve_layout`'s errors give the settings by default (the API's); the training recipe passes
its config fields (``model.pipeline_layout``, ``parallel.virtual``, ...)."""


@dataclass(frozen=True)
class PipelineLayout:
    """The layer kinds of every virtual pipeline stage, in stage order (module doc).

    Attributes:
        stages: per stage, its kinds in order as a string, e.g. ``("Ettt", "tttt", "tttt", "tttL")``.
    """

    stages: tuple[str, ...]

    @classmethod
    def even(cls, num_layers: int, num_stages: int) -> "PipelineLayout":
        """``num_layers / num_stages`` decoder layers per stage, ``E`` on the first and ``L`` on the last.

        Raises:
            ValueError: ``num_layers`` is not a multiple of ``num_stages`` (name the stages with a layout then).
        """
        if num_stages < 1 or num_layers < 0 or num_layers % num_stages:
            raise ValueError(f"{num_layers} decoder layers do not split evenly into {num_stages} stages; give a "
                             "pipeline layout (e.g. 'Et*3|t*4|t*3L') or a layer count divisible by the stages")
        per = "t" * (num_layers // num_stages)
        body = [per] * num_stages
        body[0] = "E" + body[0]
        body[-1] = body[-1] + "L"
        return cls(tuple(body))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @cached_property
    def layer_counts(self) -> tuple[int, ...]:
        """Decoder layers (``t``) per stage."""
        return tuple(s.count("t") for s in self.stages)

    @property
    def num_layers(self) -> int:
        """Decoder layers over all stages."""
        return sum(self.layer_counts)

    def layers(self, stage: int) -> range:
        """Global indices of the decoder layers of ``stage`` (consecutive, in stage order)."""
        start = sum(self.layer_counts[:stage])
        return range(start, start + self.layer_counts[stage])

    def is_even(self) -> bool:
        """The same number of decoder layers on every stage."""
        return len(set(self.layer_counts)) <= 1

    def __str__(self) -> str:
        """The layout in its compact notation, runs written ``x*N``: ``"Et*3|t*4|t*4|t*3L"``."""
        return "|".join(_compact(s) for s in self.stages)


def _compact(stage: str) -> str:
    out, i = [], 0
    while i < len(stage):
        j = i
        while j < len(stage) and stage[j] == stage[i]:
            j += 1
        out.append(stage[i] if j - i == 1 else f"{stage[i]}*{j - i}")
        i = j
    return "".join(out)


# ---- parsing ----------------------------------------------------------------------------------------------------

def parse_layout(text: str, field: str = LAYOUT_NAMES["layout"]) -> PipelineLayout:
    """The layout written ``text`` (module doc), syntax only (:func:`resolve_layout` checks it against a run).

    Raises:
        TypeError: ``text`` is not a string.
        ValueError: a character other than ``E t L | ( ) * ,`` and digits, unbalanced parentheses, a ``*`` without
            a count or without something to repeat, or more than :data:`MAX_LAYOUT_LAYERS` layers; the message
            names ``field``, the text and the position.
    """
    if not isinstance(text, str):
        raise TypeError(f"{field}={text!r} must be a string such as 'Et*3|t*4|t*4|t*3L'")
    src = text.strip().replace(",", "")
    expanded, end = _expand(src, 0, field, text)
    if end != len(src):  # only a ')' stops the top level early
        raise _syntax(field, text, f"')' at position {end} closes no '('")
    return PipelineLayout(tuple(expanded.split("|")))


def _syntax(field: str, text: str, what: str) -> ValueError:
    return ValueError(f"{field}={text!r} is not a pipeline layout: {what}; write stages separated by '|' using "
                      "E (embedding), t (decoder layer), L (output head and loss), x*N and (...)*N, e.g. "
                      "'Et*3|t*4|t*4|t*3L'")


def _expand(src: str, i: int, field: str, text: str) -> tuple[str, int]:
    """Expand ``src`` from ``i`` up to the first unmatched ``)`` (or the end); returns ``(text, its index)``."""
    parts: list[str] = []
    size = 0
    while i < len(src):
        c = src[i]
        if c == ")":
            break
        if c == "(":
            atom, i = _expand(src, i + 1, field, text)
            if i >= len(src):
                raise _syntax(field, text, "a '(' is never closed")
            if not atom:
                raise _syntax(field, text, f"the group ending at position {i} is empty")
            i += 1
        elif c in KINDS or c == "|":
            atom, i = c, i + 1
        elif c == "*":
            raise _syntax(field, text, f"'*' at position {i} repeats nothing")
        elif c == "m":
            raise _syntax(field, text, "'m' (a multi-token-prediction layer) is not supported by pipecast")
        else:
            raise _syntax(field, text, f"{c!r} at position {i} is not a layer kind")
        atom, i = _repeat(src, i, atom, field, text)
        size += len(atom)
        if size > MAX_LAYOUT_LAYERS:
            raise _syntax(field, text, f"it expands to more than {MAX_LAYOUT_LAYERS} layers")
        parts.append(atom)
    return "".join(parts), i


def _repeat(src: str, i: int, atom: str, field: str, text: str) -> tuple[str, int]:
    """``atom`` repeated by a ``*N`` at ``i`` (if any); returns ``(text, index after it)``."""
    if i >= len(src) or src[i] != "*":
        return atom, i
    j = i + 1
    while j < len(src) and src[j].isdigit():
        j += 1
    if j == i + 1:
        raise _syntax(field, text, f"'*' at position {i} is not followed by a count")
    count = int(src[i + 1:j])
    if count * len(atom) > MAX_LAYOUT_LAYERS:
        raise _syntax(field, text, f"it expands to more than {MAX_LAYOUT_LAYERS} layers")
    return atom * count, j


# ---- checking against a run -------------------------------------------------------------------------------------

def resolve_layout(value, *, num_layers: int, pp_size: int, virtual: int = 1,
                   names: Mapping[str, str] | None = None) -> PipelineLayout:
    """The layout of a run of ``num_layers`` decoder layers on ``pp_size`` pipeline ranks with ``virtual`` model
    chunks each (``pp_size * virtual`` virtual stages): ``value`` parsed and checked, or the even layout when
    ``value`` is None (or empty).  ``value`` may be a layout string, a :class:`PipelineLayout`, or a sequence of
    per-stage decoder-layer counts (``E`` added to the first stage, ``L`` to the last).

    ``names`` maps ``layout``, ``num_layers``, ``pipeline``, ``virtual`` to the names the errors give those settings
    (default :data:`LAYOUT_NAMES`).

    Raises:
        ValueError: a syntax error (:func:`parse_layout`); a stage count other than ``pp_size * virtual``; ``E`` or
            ``L`` missing, repeated or not opening the first / closing the last stage; a stage with no layer; a
            decoder-layer count other than ``num_layers``; no layout when ``num_layers`` does not split evenly.
            Each message names the setting, its value and the fix.
        TypeError: ``value`` of another type.
    """
    n = {**LAYOUT_NAMES, **(names or {})}
    stages = pp_size * virtual
    if value is None or value == "":
        if num_layers % stages:
            raise ValueError(f"{n['num_layers']}={num_layers} does not split evenly into {pp_size} x {virtual} = "
                             f"{stages} stages ({n['pipeline']}={pp_size}, {n['virtual']}={virtual}); set "
                             f"{n['layout']} to place the layers, e.g. {_suggest(num_layers, stages)!r}, or use a "
                             f"layer count divisible by {stages}")
        return PipelineLayout.even(num_layers, stages)
    layout = _as_layout(value, n["layout"])
    _check(layout, str(value) if isinstance(value, str) else str(layout), num_layers, pp_size, virtual, n)
    return layout


def _as_layout(value, field: str) -> PipelineLayout:
    if isinstance(value, PipelineLayout):
        return value
    if isinstance(value, str):
        return parse_layout(value, field)
    if isinstance(value, (list, tuple)) and value and all(isinstance(c, int) and not isinstance(c, bool)
                                                          for c in value):
        if min(value) < 0:
            raise ValueError(f"{field}={list(value)!r}: a stage cannot hold {min(value)} layers; give counts >= 0")
        body = ["t" * c for c in value]
        body[0] = "E" + body[0]
        body[-1] = body[-1] + "L"
        return PipelineLayout(tuple(body))
    raise TypeError(f"{field}={value!r} must be a layout string such as 'Et*3|t*4|t*4|t*3L' or a list of "
                    "decoder layers per stage such as [3, 4, 4, 3]")


def _check(layout: PipelineLayout, shown: str, num_layers: int, pp: int, virtual: int, n: Mapping) -> None:
    field, stages, want = n["layout"], layout.stages, pp * virtual
    where = f"{field}={shown!r}"
    if len(stages) != want:
        alt = (f", or set {n['virtual']}={len(stages) // pp}" if len(stages) % pp == 0 and len(stages) > 0 else "")
        raise ValueError(f"{where} lists {len(stages)} stages but {n['pipeline']}={pp} x {n['virtual']}={virtual} "
                         f"runs {want}: write {want} stages separated by '|'{alt}")
    flat = "".join(stages)
    for kind, stage, end in (("E", 0, "open the first stage"), ("L", want - 1, "close the last stage")):
        count = flat.count(kind)
        at = stages[stage][0 if kind == "E" else -1:][:1]
        if count != 1 or at != kind:
            what = (f"lacks {kind}" if count == 0 else f"holds {kind} {count} times" if count > 1 else
                    f"has {kind} elsewhere")
            raise ValueError(f"{where} {what}: {kind} ({KINDS[kind]}) must appear once and {end} (stage {stage}), "
                             f"e.g. {_suggest(max(num_layers, 0), want)!r}")
    for s, kinds in enumerate(stages):
        if not kinds:
            raise ValueError(f"{where}: stage {s} holds no layer, and every stage of a schedule runs a model chunk; "
                             "move a layer onto it (each stage needs at least one of E, t, L) or use fewer stages")
    if layout.num_layers != num_layers:
        raise ValueError(f"{where} places {layout.num_layers} decoder layers (t) but {n['num_layers']}="
                         f"{num_layers}: place exactly {num_layers}, or change {n['num_layers']}")


def _suggest(num_layers: int, stages: int) -> str:
    """A layout of ``num_layers`` over ``stages`` stages, the remainder on the middle stages (for messages)."""
    base, extra = divmod(num_layers, stages)
    counts = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    for k in range(extra):
        counts[middle[k % len(middle)]] += 1
    body = ["t" * c for c in counts]
    body[0] = "E" + body[0]
    body[-1] = body[-1] + "L"
    return str(PipelineLayout(tuple(body)))


def lighter_ends(num_layers: int, num_stages: int) -> list[PipelineLayout]:
    """A few uneven layouts to rank beside the even one (what a vocabulary-heavy model wants: the embedding's and
    the output head's stages lighter; Megatron's ``--decoder-first-pipeline-num-layers`` /
    ``--decoder-last-pipeline-num-layers``): the first stage, the last stage, and both, holding one decoder layer
    fewer, the layers moved to the middle stages (the middle ones first).  Empty when the even layout has fewer
    than 3 stages or fewer than 2 layers per stage.

    Raises:
        ValueError: ``num_layers`` does not split evenly into ``num_stages`` (:meth:`PipelineLayout.even`).
    """
    even = PipelineLayout.even(num_layers, num_stages)
    per = num_layers // num_stages
    if num_stages < 3 or per < 2:
        return []
    middle = sorted(range(1, num_stages - 1), key=lambda s: abs(2 * s - (num_stages - 1)))
    out = []
    for ends in ((0,), (num_stages - 1,), (0, num_stages - 1)):
        counts = list(even.layer_counts)
        for k, end in enumerate(ends):
            counts[end] -= 1
            counts[middle[k % len(middle)]] += 1
        out.append(_as_layout(counts, "layout"))
    return out


# ---- costs --------------------------------------------------------------------------------------------------------

def stage_costs(layout: PipelineLayout, costs: Mapping[str, float]) -> tuple[float, ...]:
    """Per stage, the sum of its layers' costs: ``costs[kind]`` for each kind it holds (``E``, ``t``, ``L``; any
    unit: milliseconds of a pass, bytes held).  The simulator takes them per ``(rank, chunk)`` through the plan's
    placement (:func:`engine.plan.simulate.placed_costs`).

    Raises:
        ValueError: ``costs`` has no entry for a kind the layout holds, or a negative one.
    """
    for kind in {k for s in layout.stages for k in s}:
        if kind not in costs:
            raise ValueError(f"no cost for layer kind {kind!r} ({KINDS[kind]}); give costs for {sorted(KINDS)}")
        if costs[kind] < 0:
            raise ValueError(f"the cost of layer kind {kind!r} is {costs[kind]}; costs are >= 0")
    return tuple(float(sum(costs[k] for k in s)) for s in layout.stages)


def kind_costs(layout: PipelineLayout, per_stage: Sequence[float]) -> dict[str, float]:
    """Per-kind costs from the per-stage costs of an even layout (``E`` + ``k`` layers, ``k`` layers, ...,
    ``k`` layers + ``L``), as measured: ``t`` = the mean middle stage / ``k``, ``E`` = the first stage - ``k*t``,
    ``L`` = the last - ``k*t`` (measurement noise can make a difference negative: it is taken as 0).
    :func:`stage_costs` of another layout then predicts its stages.

    Raises:
        ValueError: the layout is not even, has fewer than 3 stages (no middle stage tells a layer's cost from the
            embedding's and the head's: measure a layout with more stages), or ``per_stage`` has another length.
    """
    n, counts = layout.num_stages, layout.layer_counts
    if len(per_stage) != n:
        raise ValueError(f"{len(per_stage)} per-stage costs for a layout of {n} stages; give one per stage")
    if not layout.is_even() or n < 3 or counts[0] == 0 or layout.stages != PipelineLayout.even(layout.num_layers,
                                                                                               n).stages:
        raise ValueError(f"per-kind costs need the costs of an even layout with a middle stage (3 stages or more, "
                         f"a layer on each), got {str(layout)!r}")
    k = counts[0]
    t = sum(per_stage[1:-1]) / (n - 2) / k
    return {"E": max(0.0, per_stage[0] - k * t), "t": t, "L": max(0.0, per_stage[-1] - k * t)}
