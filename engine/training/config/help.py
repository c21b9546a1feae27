"""The config reference, generated from the dataclasses of :mod:`.schema`: every field with its type and default
read from the dataclass and its meaning from the field's own metadata (:func:`.fields.setting`; a meaning that
lists schedules or families reads their registry when the help is shown).  ``pipecast train --help`` prints
:func:`help_text`; :func:`markdown_table` gives the same rows for documentation.
"""
from __future__ import annotations

import dataclasses
import textwrap

from .fields import config_fields, field_help, field_value, type_name
from .schema import TrainConfig

__all__ = ["field_rows", "help_text", "markdown_table"]


def _shown(value) -> str:
    if dataclasses.is_dataclass(value):
        return "{...}"  # a subsection that is set: its fields follow
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def field_rows(config: TrainConfig | None = None) -> list[tuple[str, str, str, str]]:
    """``(section.field, type, value, meaning)`` for every config field, in dataclass order; ``value`` is the
    built-in default, or the field's value in ``config`` when one is given."""
    rows = []
    for name, hint, f in config_fields(TrainConfig):
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if config is not None:
            value = field_value(config, name)
        rows.append((name, type_name(hint), _shown(value), field_help(f)))
    return rows


def help_text(width: int = 118, config: TrainConfig | None = None, source: str | None = None) -> str:
    """Every field as ``--section.key TYPE`` with its value and meaning (for ``pipecast train --help``).

    Without ``config``: the built-in defaults, marked as such (a config file replaces them).  With ``config`` (the
    file ``source`` after the command line's overrides, as :func:`engine.training.config.load_config` resolves it):
    the values a run would use, and the built-in default beside each value that differs from it.
    """
    builtin = {name: value for name, _, value, _ in field_rows()}
    if config is None:
        lines = ["config fields (set in the YAML file or override with --section.key=value). The values shown are "
                 "the built-in defaults, which a config file replaces: `pipecast train CONFIG --help` shows the "
                 "values a run of CONFIG would use."]
    else:
        lines = [f"config fields with the values a run of {source} would use (that file, then the overrides given; "
                 f"override with --section.key=value):"]
    lines = textwrap.wrap(lines[0], width)
    for name, kind, value, meaning in field_rows(config):
        if config is None:
            lines.append(f"  --{name} {kind} (built-in default {value})")
        else:
            differs = f"; built-in default {builtin[name]}" if builtin[name] != value else ""
            lines.append(f"  --{name} {kind} = {value} ({differs[2:] if differs else 'built-in default'})")
        lines.extend(textwrap.wrap(meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def markdown_table() -> str:
    """The same rows as a Markdown table."""
    out = ["| field | type | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{n}` | {k.replace('|', '/')} | {d} | {m} |" for n, k, d, m in field_rows()]
    return "\n".join(out)
