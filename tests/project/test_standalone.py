"""The project stands alone: no file of the repository points at a file the repository does not ship.

A bare clone must read completely, so every text file that git tracks (or would track: untracked files that are not
ignored count too) -- code, tests, benchmarks, docs, configs, CI -- is scanned for

* relative paths (``../x``) that do not resolve to a file of the repository, and ``shared/...`` paths the repository lacks;
* citations of documents the repository does not have: the word spec followed by a section number, an
  ``invariant I1`` or ``gotcha 10`` of an outside design note, any ``NAME.md`` no tracked file is named after;
* repo-relative paths (``tests/...py``, ``configs/...yaml``, ``engine/...``, ``benchmarks/...``) that do not exist;
* public-bug case ids (``B02``) that the catalogue at the top of ``tests/runtime/test_public_bugs.py`` does not
  define with a public source (an ``owner/repo#N`` issue or pull request).

Design and contract notes belong in the package docstrings; formulas cite their public source (a paper, an upstream
file such as ``megatron/core/pipeline_parallel/schedules.py``, an issue number).  Only ``tests/data``'s data files
(not its README) are skipped, and this module itself, whose patterns would match themselves.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve()
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".sh", ".json"}
TEXT_NAMES = {"run", ".gitignore"}
SKIP_DIRS = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules", "build"}
CATALOGUE = ROOT / "tests" / "runtime" / "test_public_bugs.py"

ESCAPING = re.compile(r"(?<![\w.])((?:\.\./)+[\w.\-/]*)")
SHARED = re.compile(r"(?<![\w./-])(shared/[\w.\-/]*)")
SPEC = re.compile(r"\bspec\s+(?:section\s+|§\s*|[\w-]+\.md\s+)?\d+(?:\.\d+)*|\bspec section\b|\bspec §", re.I)
OUTSIDE_NOTES = re.compile(r"\binvariant I\d+\b|\bgotcha \d+\b")
MARKDOWN = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
TOP_LEVEL = ("engine", "graphs", "tests", "configs", "benchmarks", ".ci")
REPO_PATH = re.compile(r"(?<![\w/.<{-])((?:%s)/[\w.\-/]*)" % "|".join(re.escape(t) for t in TOP_LEVEL))
CASE_ID = re.compile(r"\bB\d\d\b(?!\.\d)")
CATALOGUE_ENTRY = re.compile(r"^\s*(B\d\d)\s.*?[\w.-]+/[\w.-]+#\d+", re.M)
OUTPUT_DIRS = ("benchmarks/results/",)  # written by the scripts: a path there needs only its folder to exist


def project_files(root: Path = ROOT) -> list[Path]:
    """The repository's text files: ``git ls-files`` (tracked and untracked-not-ignored), else a walk of the tree."""
    if (root / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                             text=True, check=True).stdout
        paths = [root / p for p in out.split("\0") if p]
    else:
        paths = [Path(d) / f for d, dirs, files in os.walk(root) for f in files
                 if not dirs.__setitem__(slice(None), [x for x in dirs if x not in SKIP_DIRS])]
    out = []
    for p in paths:
        rel = p.relative_to(root)
        if not p.is_file() or (rel.parts[:2] == ("tests", "data") and p.suffix != ".md"):
            continue
        if (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES) and p.resolve() != SELF:
            out.append(p)
    return sorted(out)


def _clean(token: str) -> str:
    """A path token without the punctuation prose puts after it (``tests/x.py``, -> ``tests/x.py``)."""
    return token.rstrip(".,:;)`'\"")


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def defined_cases(catalogue: Path = CATALOGUE) -> set[str]:
    """Case ids the public-bug catalogue defines, each with a public ``owner/repo#N`` source on its line."""
    text = catalogue.read_text() if catalogue.is_file() else ""
    return set(CATALOGUE_ENTRY.findall(text))


def outside_references(path: Path, root: Path = ROOT, cases: set[str] | None = None,
                       basenames: set[str] | None = None) -> list[str]:
    """Every reference in ``path`` to something outside the repository, as ``"file:line: reason"``."""
    text = path.read_text(errors="replace")
    rel = path.relative_to(root)
    cases = defined_cases() if cases is None else cases
    basenames = {p.name for p in project_files(root)} | {SELF.name} if basenames is None else basenames
    found = []

    def add(pos, why):
        found.append(f"{rel}:{_line(text, pos)}: {why}")

    for m in ESCAPING.finditer(text):
        target = Path(os.path.normpath(path.parent / _clean(m.group(1))))
        if not (target.is_relative_to(root) and target.exists()):
            add(m.start(), f"{m.group(1)!r} resolves outside the repository, or to nothing in it")
    for m in SHARED.finditer(text):
        if not (root / _clean(m.group(1))).exists():
            add(m.start(), f"{m.group(1)!r}: the repository has no such shared/ path")
    for m in SPEC.finditer(text):
        add(m.start(), f"{m.group(0)!r} cites a spec the repository does not ship")
    for m in OUTSIDE_NOTES.finditer(text):
        add(m.start(), f"{m.group(0)!r} cites an outside design note")
    for m in MARKDOWN.finditer(text):
        if m.group(1) not in basenames:
            add(m.start(), f"{m.group(1)!r}: no file of the repository has that name")
    for m in REPO_PATH.finditer(text):
        token = _clean(m.group(1))
        output = token.startswith(OUTPUT_DIRS) and (root / token).parent.is_dir()
        if not (root / token).exists() and not output and not any(ch in token for ch in "*<{"):
            add(m.start(), f"{token!r} does not exist in the repository")
    if path.resolve() != CATALOGUE.resolve():
        for m in CASE_ID.finditer(text):
            if m.group(0) not in cases:
                add(m.start(), f"case {m.group(0)} is not defined in {CATALOGUE.relative_to(ROOT)}")
    return found


def test_no_file_points_outside_the_repository():
    files = project_files()
    assert len(files) > 100, f"found only {len(files)} project files under {ROOT}"
    cases, basenames = defined_cases(), {p.name for p in files} | {SELF.name}
    offenders = [ref for f in files for ref in outside_references(f, cases=cases, basenames=basenames)]
    assert not offenders, "references to files the repository does not ship:\n" + "\n".join(offenders)


def test_the_catalogue_defines_each_case_with_a_public_source():
    cases = defined_cases()
    used = set(CASE_ID.findall(CATALOGUE.read_text()))
    assert cases and used <= cases, f"cases used but not defined with a public source: {sorted(used - cases)}"


# the planted texts are assembled, so this file itself names no outside path and cites no section
_SHARED, _SPEC = "sha" + "red", "sp" + "ec"


@pytest.mark.parametrize("planted, reason", [
    (f"see ../{_SHARED}/{_SPEC}/schedules.md", "resolves outside the repository"),
    (f"copied from {_SHARED}/vectors/x.json", "no such shared/ path"),
    (f"warmup count ({_SPEC} 1.12)", "cites a spec"),
    (f"the {_SPEC} section 2 loss contract", "cites a spec"),
    ("as DESIGN.md explains", "no file of the repository has that name"),
    ("STYLE.md rule", "no file of the repository has that name"),
    ("keeps invariant I1", "outside design note"),
    ("run tests/runtime/test_no_such_file.py", "does not exist"),
    ("configs/missing.yaml", "does not exist"),
    ("public case B99", "is not defined"),
], ids=lambda v: v[:24])
def test_a_planted_reference_is_found(tmp_path, planted, reason):
    """Negative control: each kind of outside reference, planted in a docstring of a file in a small tree."""
    (tmp_path / "tests" / "runtime").mkdir(parents=True)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "default.yaml").write_text("training: {}\n")
    module = tmp_path / "tests" / "runtime" / "mod.py"
    module.write_text(f'"""Fine: configs/default.yaml, Narayanan et al. SC\'21, section 2.2.\n\n{planted}\n"""\n')
    clean = outside_references(module, root=tmp_path, cases={"B02"}, basenames={"README.md"})
    assert any(reason in ref for ref in clean), clean
    module.write_text('"""Fine: configs/default.yaml, NVIDIA/Megatron-LM#750 (B02), torch schedules.py."""\n')
    assert outside_references(module, root=tmp_path, cases={"B02"}, basenames={"README.md"}) == []
