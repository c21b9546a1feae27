"""The training recipe's error for a bad configuration, in a module of its own so that every module of the
package can raise it without importing the config module (:mod:`engine.training.config` re-exports it)."""
from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, its value and the fix (the whole report: a
    rank raising it is reported without its traceback, ``engine.runtime.spawn.needs_traceback``)."""

    one_line = True
