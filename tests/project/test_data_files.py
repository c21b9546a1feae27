"""The data the tests read lives in the repository, so the README's test command passes on a bare clone.

Checks every file in ``tests.helpers.megatron_vectors.FILES``: present, a regular file inside the repository (not a link
out of it), tracked by git when the tree is a git checkout, and the bytes whose sha256 ``tests/data/README.md``
records; and that no test module reads anything from a folder beside the repository.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.megatron_vectors import DATA, FILES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_vector_file_is_inside_the_repository(path):
    assert path.is_file() and not path.is_symlink(), f"{path} is missing: copy it into {DATA}"
    assert path.resolve().is_relative_to(ROOT), f"{path} resolves outside the repository ({path.resolve()})"
    if (ROOT / ".git").exists() and shutil.which("git"):
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(path.relative_to(ROOT))], cwd=ROOT,
                                 capture_output=True, text=True)
        assert tracked.returncode == 0, f"{path} is not tracked by git: a clone would not have it"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_vector_file_is_the_recorded_copy(path):
    recorded = dict(re.findall(r"`([\w.]+)`.*?sha256 `([0-9a-f]{64})`", (DATA / "README.md").read_text(), re.S))
    assert path.name in recorded, f"tests/data/README.md does not say where {path.name} came from"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == recorded[path.name], f"{path} differs from its source"


def test_no_test_reads_shared_beside_the_repository():
    pattern = re.compile(r"""parent\s*/\s*["']shared["']|["']\.\./shared""")
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("*.py")) if pattern.search(p.read_text())]
    assert not offenders, f"these test modules read the shared folder beside the repository (a bare clone has " \
                          f"none): {offenders}"


@pytest.mark.slow  # a pytest subprocess (imports torch)
def test_ci_turns_a_skip_into_a_failure(tmp_path):
    """An ``importorskip`` of a module that does not import fails under ``CI=true`` (locally it skips)."""
    (tmp_path / "test_probe.py").write_text("import pytest\n\ndef test_probe():\n"
                                           "    pytest.importorskip('engine.no_such_module')\n")
    env = {**os.environ, "CI": "true", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "--rootdir", str(tmp_path),
                          "-c", os.devnull, str(tmp_path / "test_probe.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert "1 failed" in run.stdout and "CI=true: this test skipped" in run.stdout, run.stdout + run.stderr
