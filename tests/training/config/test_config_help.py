"""``pipecast train --help`` shows the values a run would use: with a config, that file's values after the
overrides (the built-in default beside each one that differs); without one, the built-in defaults, marked as such.

Each field's meaning is written once, in its own dataclass field (:func:`engine.training.config.fields.setting`):
:func:`test_each_fields_help_text_is_defined_once` reads every field's metadata and scans the sources for a second
table of field texts.
"""
from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
from pathlib import Path

import pytest

from engine.cli import main
from engine.training.config import TrainConfig, load_config
from engine.training.config.fields import config_fields, field_help

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = ROOT / "engine" / "training" / "config" / "schema.py"


def _help(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = main(["train", *argv])
    except SystemExit as exit_:
        rc = exit_.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_help_of_a_config_shows_its_values_after_the_overrides(capsys):
    rc, text, _ = _help(capsys, "configs/default.yaml", "--training.steps=7", "--help")
    assert rc == 0
    assert "values a run of configs/default.yaml would use" in text
    assert "--optimizer.lr float = 0.003 (built-in default 0.001)" in text  # the file's value
    assert "--training.steps int = 7 (built-in default 100)" in text  # the override's
    assert "--optimizer.beta1 float = 0.9 (built-in default)" in text  # left at the default
    config = load_config("configs/default.yaml", ["training.steps=7"])
    for section in dataclasses.fields(config):  # every field, with the value the run would use
        for f in dataclasses.fields(getattr(config, section.name)):
            value = getattr(getattr(config, section.name), f.name)
            shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            assert f"--{section.name}.{f.name} " in text and f" = {shown} (" in text


def test_help_without_a_config_says_the_values_are_built_in_defaults(capsys):
    rc, text, _ = _help(capsys, "--help")
    assert rc == 0
    assert "--optimizer.lr float (built-in default 0.001)" in text and "pipecast train CONFIG --help" in text


def test_help_of_a_bad_config_is_one_error_line(capsys):
    rc, _, err = _help(capsys, "configs/default.yaml", "--help", "--optimizer.lr=1e300")
    assert rc == 2 and err.startswith("error: optimizer.lr=1e+300") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["configs/default.yaml", "--help"], ["--help"]])
def test_help_starts_no_run(capsys, monkeypatch, argv):
    from engine.training import launch
    monkeypatch.setattr(launch, "run_spawned", lambda *a, **k: pytest.fail("--help started a run"))
    assert _help(capsys, *argv)[0] == 0


# ---- each field described once -----------------------------------------------------------------------------------
FIELDS = {name: f for name, _, f in config_fields(TrainConfig)}


def _is_text(node) -> bool:
    """A value a table of field descriptions would hold: a string, an f-string, a function giving one, or a call
    building a description (such as a range)."""
    return isinstance(node, (ast.JoinedStr, ast.Lambda, ast.Call)) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str))


def second_tables(sources: dict[str, str]) -> list[str]:
    """Places in ``sources`` (path -> Python text) that describe config fields a second time: a dict whose keys
    include two or more ``section.field`` names with text-like values (a help or range table), or a string that
    repeats a field's help text outside the schema."""
    texts = {field_help(f): name for name, f in FIELDS.items() if not callable(f.metadata["help"])}
    found = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Dict):
                keyed = [v for k, v in zip(node.keys, node.values)
                         if isinstance(k, ast.Constant) and k.value in FIELDS and _is_text(v)]
                if len(keyed) >= 2:
                    found.append(f"{path}:{node.lineno}: a table of {len(keyed)} config fields")
            elif isinstance(node, ast.Constant) and node.value in texts and Path(path) != SCHEMA:
                found.append(f"{path}:{node.lineno}: the help text of {texts[node.value]}")
    return found


def _sources() -> dict[str, str]:
    paths = [*(ROOT / "engine").rglob("*.py"), *(ROOT / "graphs").rglob("*.py")]
    return {str(p): p.read_text() for p in sorted(paths)}


def commented_fields(text: str) -> list[str]:
    """Lines of the section dataclasses in the schema ``text`` that carry a comment (a second description of a
    field)."""
    bodies = [range(c.lineno, c.end_lineno + 1) for c in ast.parse(text).body if isinstance(c, ast.ClassDef)
              and c.name.endswith("Config") and c.name != "TrainConfig"]
    return [f"schema.py:{tok.start[0]}: {tok.string}" for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT and any(tok.start[0] in body for body in bodies)]


def test_each_fields_help_text_is_defined_once(capsys):
    """Every field carries its meaning in its own metadata, ``--help`` shows exactly that text, and no module
    holds a second table of field texts or ranges (nor a comment on a field in the schema)."""
    assert [n for n, f in FIELDS.items() if not field_help(f).strip()] == []
    _, text, _ = _help(capsys, "--help")
    for name, f in FIELDS.items():
        shown = text.split(f"  --{name} ", 1)[1].split("\n  --", 1)[0]
        assert "".join(shown.split("\n", 1)[1].split()) == "".join(field_help(f).split()), name  # wrapped text
    assert second_tables(_sources()) == []
    assert commented_fields(SCHEMA.read_text()) == []


def test_the_second_table_check_catches_a_planted_table():
    """Negative control: a help table, a range table and a copied help text planted in a module are found."""
    planted = {
        "help.py": 'FIELD_HELP = {"model.num_layers": "blocks", "model.hidden_size": lambda: "width"}\n',
        "ranges.py": 'RANGES = {"training.steps": Range(1, 9, "x"), "training.seed": Range(0, 9, "y")}\n',
        "metrics.py": f'NOTE = {field_help(FIELDS["optimizer.lr"])!r}\n',
        "values.py": 'V = {"parallel.pipeline": p.pipeline, "parallel.data": p.data}\n',  # values, not texts
    }
    found = second_tables(planted)
    assert [f.split(":")[0] for f in found] == ["help.py", "ranges.py", "metrics.py"], found
    schema = SCHEMA.read_text()
    planted_comment = schema.replace("    num_layers: int = setting(", "    # transformer blocks\n"
                                     "    num_layers: int = setting(", 1)
    assert planted_comment != schema and len(commented_fields(planted_comment)) == 1
