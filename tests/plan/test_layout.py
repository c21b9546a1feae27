"""Pipeline layouts (``engine.plan.layout``): Megatron-Core's ``--pipeline-model-parallel-layout`` notation parsed,
checked against a run's sizes with errors that name the setting and the fix, placed by every placement, and turned
into per-stage costs for the simulator and the tuner.

The parser is checked against an independent expander written here from Megatron-Core's documented behaviour
(``megatron/core/transformer/pipeline_parallel_layer_layout.py``: commas dropped, ``(...)*N`` then ``x*N``
unrolled, stages split at ``|``) over a grid of generated layouts.
"""
from __future__ import annotations

import itertools
import random
import re

import pytest

from engine.plan import build_plan
from engine.plan.candidates import Candidate, CostModel, LayoutCosts, predict, relayout
from engine.plan.layout import (MAX_LAYOUT_LAYERS, PipelineLayout, kind_costs, parse_layout, resolve_layout,
                                stage_costs)
from engine.plan.simulate import placed_costs, simulate


def _megatron_expand(text: str) -> list[str]:
    """Megatron-Core's parse_str_to_list, re-stated: stages as strings of kinds."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def _random_layout(rng: random.Random) -> str:
    """A random layout text over the notation Megatron accepts (no nested groups)."""
    parts = ["E"]
    for _ in range(rng.randint(0, 4)):
        pick = rng.random()
        if pick < 0.3:
            parts.append(f"t*{rng.randint(0, 5)}")
        elif pick < 0.5:
            parts.append(f"(t{'t' * rng.randint(0, 2)}|)*{rng.randint(1, 4)}")
        elif pick < 0.7:
            parts.append("|" + "t" * rng.randint(1, 3))
        elif pick < 0.85:
            parts.append(f"|*{rng.randint(1, 2)}t")
        else:
            parts.append(",t")
    parts.append("L")
    return "".join(parts)


def test_parser_expands_like_megatron_over_a_grid():
    rng = random.Random(0)
    texts = ["Et*3|t*4|t*4|t*3L", "Ettt|(tt|)*29,tL", "E|t|L", "Et,t|t,tL", "(Et|)*1tL", "EL", "E|*2L"]
    texts += [_random_layout(rng) for _ in range(400)]
    for text in texts:
        assert list(parse_layout(text).stages) == _megatron_expand(text), text


def test_compact_notation_round_trips():
    rng = random.Random(1)
    for _ in range(300):
        counts = [rng.randint(0, 6) for _ in range(rng.randint(1, 8))]
        if not all(counts[1:-1]):
            continue  # an empty middle stage is refused (test_every_error_...)
        layout = resolve_layout(counts, num_layers=sum(counts), pp_size=len(counts))
        assert parse_layout(str(layout)) == layout, counts
        assert layout.layer_counts == tuple(counts)
        assert [list(layout.layers(s)) for s in range(layout.num_stages)] == \
            [list(range(sum(counts[:s]), sum(counts[:s + 1]))) for s in range(len(counts))]
    assert str(parse_layout("E,ttt|tttt|(tttt|)*1tttL")) == "Et*3|t*4|t*4|t*3L"


def test_nested_groups_and_even_layouts():
    assert parse_layout("(E(t|)*2)*1tL").stages == ("Et", "t", "tL")
    assert PipelineLayout.even(8, 4).stages == ("Ett", "tt", "tt", "ttL")
    assert PipelineLayout.even(2, 1).stages == ("EttL",)
    assert PipelineLayout.even(8, 4).is_even() and not parse_layout("Et*3|t*4|t*4|t*3L").is_even()
    assert resolve_layout(None, num_layers=8, pp_size=2, virtual=2) == PipelineLayout.even(8, 4)


@pytest.mark.parametrize("pp,virtual", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (3, 3)])
def test_resolve_accepts_exactly_the_layouts_that_fit(pp, virtual):
    """Over random per-stage counts and run sizes: accepted iff the stage count is pp x virtual, every stage holds
    a layer and the decoder layers add up to num_layers."""
    rng = random.Random(pp * 10 + virtual)
    for _ in range(200):
        n = pp * virtual + rng.choice((-1, 0, 0, 0, 1))
        counts = [rng.randint(0, 4) for _ in range(max(n, 1))]
        num_layers = sum(counts) + rng.choice((0, 0, 0, 1))
        fits = len(counts) == pp * virtual and num_layers == sum(counts) and all(counts[1:-1])
        text = str(PipelineLayout(tuple(("E" if s == 0 else "") + "t" * c + ("L" if s == len(counts) - 1 else "")
                                        for s, c in enumerate(counts))))
        try:
            got = resolve_layout(text, num_layers=num_layers, pp_size=pp, virtual=virtual)
        except ValueError:
            assert not fits, (text, num_layers)
            continue
        assert fits and got.layer_counts == tuple(counts), (text, num_layers)


ERRORS = [  # (value, num_layers, pp, virtual, what the message must say)
    ("Et*3|t*4|t*3L", 10, 4, 1, r"lists 3 stages but pp=4 x vp=1 runs 4: write 4 stages separated by '\|'"),
    ("Et*3|t*4|t*4|t*3L|t|tL", 16, 2, 2, r"lists 6 stages .* runs 4: .* or set vp=3"),
    ("t*3|t*4|t*4|t*3L", 14, 4, 1, r"lacks E: E \(the embedding\) must appear once and open the first stage"),
    ("Et*3|t*4|t*4|t*3", 14, 4, 1, r"lacks L: L \(the output head and loss\) must appear once and close the last"),
    ("Et|tE|t|tL", 4, 2, 2, r"holds E 2 times"),
    ("Et|t|tL|tL", 4, 4, 1, r"holds L 2 times"),
    ("tE|t|t|tL", 4, 4, 1, r"has E elsewhere: E .* open the first stage \(stage 0\)"),
    ("Et|t|Lt|t", 4, 4, 1, r"has L elsewhere"),
    ("Et|t|t|Lt", 4, 4, 1, r"has L elsewhere: L .* close the last stage \(stage 3\)"),
    ("Et*3||t*4|t*3L", 10, 4, 1, r"stage 1 holds no layer.*move a layer onto it .* or use fewer stages"),
    ("Et*3|t*4|t*4|t*3L", 16, 4, 1, r"places 14 decoder layers \(t\) but layers=16: place exactly 16"),
    (None, 7, 2, 2, r"layers=7 does not split evenly into 2 x 2 = 4 stages .* set model.pipeline_layout to place "
                    r"the layers, e.g. 'Et\|t\*3\|t\*2\|tL'"),
    ([3, -1, 2], 4, 3, 1, r"a stage cannot hold -1 layers"),
    ("Et(t", 2, 1, 1, r"a '\(' is never closed"),
    ("Ett)", 2, 1, 1, r"'\)' at position 3 closes no '\('"),
    ("Et*", 1, 1, 1, r"'\*' at position 2 is not followed by a count"),
    ("*3EL", 3, 1, 1, r"'\*' at position 0 repeats nothing"),
    ("Et*3*2L", 6, 1, 1, r"'\*' at position 4 repeats nothing"),
    ("Ext|L", 1, 2, 1, r"'x' at position 1 is not a layer kind"),
    ("Et|mL", 1, 2, 1, r"'m' \(a multi-token-prediction layer\) is not supported"),
    ("E()*2|L", 0, 2, 1, r"the group ending at position 2 is empty"),
    ("Et*99999999L", 1, 1, 1, rf"more than {MAX_LAYOUT_LAYERS} layers"),
]
NAMES = {"layout": "model.pipeline_layout", "num_layers": "layers", "pipeline": "pp", "virtual": "vp"}


@pytest.mark.parametrize("value,num_layers,pp,virtual,message", ERRORS)
def test_every_error_names_the_field_the_value_and_the_fix(value, num_layers, pp, virtual, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve_layout(value, num_layers=num_layers, pp_size=pp, virtual=virtual, names=NAMES)
    text = str(err.value)
    assert "model.pipeline_layout" in text or value is None or "layers" in text
    if isinstance(value, str):
        assert f"model.pipeline_layout={value!r}" in text


def test_wrong_types_are_type_errors():
    for bad in (3, 2.5, ["Et", "tL"], [True, 2], []):
        with pytest.raises(TypeError, match="layout string such as"):
            resolve_layout(bad, num_layers=2, pp_size=2)
    with pytest.raises(TypeError, match="must be a string"):
        parse_layout(None)


@pytest.mark.parametrize("schedule,pp,chunks", [("1f1b", 4, 1), ("interleaved", 2, 2), ("zb_h1", 4, 1),
                                                  ("zbv", 2, 2), ("dualpipev", 2, 2)])
def test_every_placement_gives_each_rank_its_stages_layers(schedule, pp, chunks):
    """The layout is in stage order; the plan's placement maps stage -> (rank, chunk): every decoder layer is on
    exactly one (rank, chunk), E on the rank that reads the data, L on the rank computing the loss."""
    counts = [1, 3, 3, 1] if pp * chunks == 4 else [0, 2, 1, 3]
    layout = resolve_layout(counts, num_layers=sum(counts), pp_size=pp, virtual=chunks)
    plan = build_plan(schedule, pp, 2 * pp, chunks)
    held = sorted(i for r in range(pp) for s in plan.stages_of(r) for i in layout.layers(s))
    assert held == list(range(layout.num_layers))
    for r in range(pp):
        for c in range(chunks):
            kinds = layout.stages[plan.stage(r, c)]
            assert ("E" in kinds) == plan.is_first_stage(r, c) and ("L" in kinds) == plan.is_last_stage(r, c)


def test_stage_and_kind_costs():
    layout = parse_layout("Et*3|t*4|t*4|t*3L")
    costs = {"E": 5.0, "t": 1.0, "L": 7.0}
    assert stage_costs(layout, costs) == (8.0, 4.0, 4.0, 10.0)
    even = PipelineLayout.even(16, 4)
    assert kind_costs(even, stage_costs(even, costs)) == costs
    with pytest.raises(ValueError, match="no cost for layer kind 'L'"):
        stage_costs(layout, {"E": 1.0, "t": 1.0})
    with pytest.raises(ValueError, match="middle stage"):
        kind_costs(PipelineLayout.even(4, 2), [1.0, 2.0])
    with pytest.raises(ValueError, match="middle stage"):
        kind_costs(layout, [1.0] * 4)


def _vocab_heavy_costs(layout: PipelineLayout) -> LayoutCosts:
    """Stage costs of a model whose embedding and head cost as much as 3 and 4 layers (a large vocabulary)."""
    per = {"E": 3.0, "t": 1.0, "L": 4.0}
    fwd = stage_costs(layout, per)
    return LayoutCosts(fwd, tuple(2 * x for x in fwd), (0.0,) * len(fwd), tuple(int(10 * x) for x in fwd),
                       (0,) * len(fwd), tuple(int(100 * x) for x in fwd))


def test_simulator_prefers_light_ends_for_a_vocabulary_heavy_model():
    """Per-kind costs through the layout: the layout with lighter first and last stages balances a vocabulary-heavy
    model, so its simulated 1F1B step is shorter than the even split's; relayout predicts its stages exactly."""
    even, light = PipelineLayout.even(16, 4), parse_layout("Et*2|t*6|t*6|t*2L")
    model = CostModel({(1, False): _vocab_heavy_costs(even)})
    by_even = predict(Candidate("1f1b"), model, 4, 8)
    by_light = predict(Candidate("1f1b", pipeline_layout=str(light)), model, 4, 8)
    assert by_light.predicted_ms < by_even.predicted_ms
    assert relayout(_vocab_heavy_costs(even), light) == _vocab_heavy_costs(light)
    plan = build_plan("1f1b", 4, 8)
    direct = simulate(plan, placed_costs(plan, _vocab_heavy_costs(light).forward_ms),
                      placed_costs(plan, _vocab_heavy_costs(light).backward_ms))
    assert direct.makespan == by_light.schedule_ms
    assert Candidate("1f1b", pipeline_layout=str(light)).overrides()["model.pipeline_layout"] == str(light)
    assert "model.pipeline_layout" not in Candidate("1f1b").overrides()


def test_placed_costs_follow_the_v_placement():
    plan = build_plan("zbv", 2, 4, 2)
    assert placed_costs(plan, [1.0, 2.0, 3.0, 4.0]) == [[1.0, 4.0], [2.0, 3.0]]
    with pytest.raises(ValueError, match="3 per-stage costs for a plan of 4 stages"):
        placed_costs(plan, [1.0, 2.0, 3.0])


def test_grid_of_small_layouts_is_exhaustive():
    """Every assignment of 0..2 layers to 3 stages with 4 layers: accepted iff the middle stage holds one."""
    for counts in itertools.product(range(3), repeat=3):
        if sum(counts) != 4:
            continue
        try:
            resolve_layout(list(counts), num_layers=4, pp_size=3)
            ok = True
        except ValueError:
            ok = False
        assert ok == (counts[1] > 0), counts


def test_lighter_ends_moves_a_layer_from_each_end_to_the_middle():
    from engine.plan.layout import lighter_ends
    assert [str(x) for x in lighter_ends(8, 4)] == ["Et|t*3|t*2|t*2L", "Et*2|t*3|t*2|tL", "Et|t*3|t*3|tL"]
    assert [str(x) for x in lighter_ends(12, 3)] == ["Et*3|t*5|t*4L", "Et*4|t*5|t*3L", "Et*3|t*6|t*3L"]
    for layouts in (lighter_ends(8, 4), lighter_ends(12, 3), lighter_ends(10, 5)):
        assert all(x.num_layers == layouts[0].num_layers and not x.is_even() for x in layouts)
    assert lighter_ends(8, 2) == [] and lighter_ends(4, 4) == []  # no middle stage / one layer per stage
