"""A run's config is validated once: :func:`engine.training.config.validate` stamps the config it checked
(:func:`mark_validated`), and the trainer validates only a config whose contents differ from its stamp -- one built
or changed by hand after its last validation (:func:`is_validated`).

The stamp is a copy of the config's field values taken when the checks passed, kept on the object (so it travels
with the config to spawned ranks); a later change of any field, or a config made by ``dataclasses.replace``,
no longer matches it.  Pure: no torch, no other module of the package.
"""
from __future__ import annotations

import dataclasses

__all__ = ["mark_validated", "is_validated"]

_STAMP = "_validated_fields"


def mark_validated(config) -> None:
    """Record that ``config`` (a :class:`~engine.training.config.TrainConfig`) passed every check as it is now."""
    config.__dict__[_STAMP] = dataclasses.asdict(config)


def is_validated(config) -> bool:
    """Whether ``config`` passed the checks with the field values it has now (False for a config never validated,
    or changed since)."""
    stamp = getattr(config, "__dict__", {}).get(_STAMP)
    return stamp is not None and stamp == dataclasses.asdict(config)
