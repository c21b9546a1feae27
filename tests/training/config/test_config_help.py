"""``pipecast train --help`` shows the values a run would use (issue 26, item 7): with a config, that file's values
after the overrides (the built-in default beside each one that differs); without one, the built-in defaults,
marked as such."""
from __future__ import annotations

import dataclasses

import pytest

from engine.cli import main
from engine.training.config import load_config


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
