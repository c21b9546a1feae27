"""Access to ``tests/data/megatron_schedules.json`` (Megatron-Core 0.16.1 behaviour vectors) for the tests.

The file lives in the repository (see ``tests/data/README.md`` for where it comes from), so
the suite runs on a bare clone.  Every test reads it through this module.  A missing file skips the tests that need
it, except under ``CI=true``, where it fails them (see :func:`missing_vectors`).
"""
from __future__ import annotations

import builtins
import json
import os
from functools import lru_cache
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
VECTORS = DATA / "megatron_schedules.json"
FILES = (VECTORS,)  # every data file the tests read (tests/project/test_data_files.py checks they are in the repository)


def in_ci() -> bool:
    """Whether this run is CI (``CI=true``, as GitHub Actions and most CI systems set it)."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def missing_vectors(reason: str) -> None:
    """Skip the calling test because vectors are missing -- or, under ``CI=true``, fail it (a run must not pass
    while checking nothing)."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: missing vectors fail the run instead of skipping)", pytrace=False)
    pytest.skip(reason)


@lru_cache(maxsize=1)
def _load() -> tuple:
    return tuple(json.loads(VECTORS.read_text()))


def all_vectors() -> tuple:
    """Every vector in the file, ``()`` when the file is absent (callers at import time decide what that means)."""
    return _load() if VECTORS.is_file() else ()


def vectors(prefix: str) -> list[dict]:
    """All vectors whose ``function`` starts with ``prefix`` (call inside a test).

    A missing file skips the test (fails it under ``CI=true``); a file without such vectors fails it.
    """
    if not VECTORS.is_file():
        missing_vectors(f"Megatron vectors not found at {VECTORS} (they belong in the repository)")
    found = [v for v in _load() if v["function"].startswith(prefix)]
    assert found, f"no vectors for {prefix!r} in {VECTORS}: the file changed shape"
    return found


def vector_params(name: str) -> list:
    """``pytest.param`` s for ``@pytest.mark.parametrize("vec", ...)`` over the vectors whose ``function`` is
    ``name`` (call at import time).  Without any, one parameter that skips instead of an empty set (which pytest
    skips without a word); under ``CI=true`` a ``RuntimeError``, so collection fails."""
    found = [v for v in all_vectors() if v["function"] == name]
    if found:
        return [pytest.param(v, id=str(i)) for i, v in enumerate(found)]
    why = f"no {name!r} vectors in {VECTORS}" + ("" if VECTORS.is_file() else " (file missing)")
    if in_ci():
        raise RuntimeError(f"{why} (CI=true: missing vectors fail the run instead of skipping)")
    return [pytest.param(None, id="missing", marks=pytest.mark.skip(reason=why))]


class FakeCommunicator:
    """Stands in for Megatron's ``P2PCommunicator``: only the attributes ``get_pp_rank_microbatches`` reads."""

    class _Group:
        def __init__(self, size: int, rank: int):
            self._size, self._rank = size, rank

        def size(self) -> int:
            return self._size

        def rank(self) -> int:
            return self._rank

    def __init__(self, pp_size: int, pp_rank: int, vp_size: int | None):
        self.pp_group = self._Group(pp_size, pp_rank)
        self.virtual_pipeline_model_parallel_size = vp_size


def error_type(result) -> type[BaseException] | None:
    """The exception class a vector records (``{"ok": false, "error": "ValueError"}``), or ``None``."""
    if isinstance(result, dict) and result.get("ok") is False:
        return getattr(builtins, result["error"])
    return None
