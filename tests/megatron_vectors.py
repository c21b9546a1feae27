"""Access to ``shared/vectors/megatron_schedules.json`` (Megatron-Core 0.16.1 behaviour vectors) for the tests.

CI checks the project out with ``shared/`` beside the clone, so the file is found relative to the repository.
"""
from __future__ import annotations

import builtins
import json
from functools import lru_cache
from pathlib import Path

import pytest

VECTORS = Path(__file__).resolve().parents[1].parent / "shared" / "vectors" / "megatron_schedules.json"


@lru_cache(maxsize=1)
def _load() -> tuple:
    return tuple(json.loads(VECTORS.read_text()))


def vectors(prefix: str) -> list[dict]:
    """All vectors whose ``function`` starts with ``prefix``; skips the test when the file is absent."""
    if not VECTORS.is_file():
        pytest.skip(f"Megatron vectors not found at {VECTORS} (expected shared/ beside the repository)")
    found = [v for v in _load() if v["function"].startswith(prefix)]
    assert found, f"no vectors for {prefix!r} in {VECTORS}: the file changed shape"
    return found


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
