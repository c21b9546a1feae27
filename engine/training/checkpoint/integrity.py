"""Checkpoints that prove themselves: per-file checksums written with every checkpoint, checked before any load.

**The manifest.**  A save writes ``manifest.json`` (:data:`MANIFEST_FILE`) into the checkpoint's temporary folder
after every file of every rank is complete and before the rename that publishes the checkpoint: for each file of
the folder (DCP's ``.metadata``, every ``.distcp`` file however DCP lays them out, ``pipecast.json``,
``tokenizer.json``) its size in bytes and its SHA-256 (:data:`HASH`, read in blocks; ``sha256sum FILE`` gives the
same digest).  The checkpoint's ``pipecast.json`` names the manifest (its ``"manifest"`` entry), so a manifest that
went missing is told apart from a checkpoint written before checksums existed.

**A broken checkpoint** is a ``step_XXXXXXXX`` folder that fails :func:`check_checkpoint`: a file the manifest lists
is missing, shorter than written (truncated), longer, or its bytes differ (checksum mismatch); the manifest is
missing (while ``pipecast.json`` says it was written) or unreadable; or DCP's ``.metadata`` is missing.  The rules,
one for every reader:

* ``--resume`` loads the newest intact checkpoint; each newer broken one is named in a warning with what is wrong
  (:func:`pick_checkpoint`).  ``checkpoint.load_step`` names the one to load: if it is broken the run is refused.
* ``pipecast sample`` / ``export`` (one named checkpoint, or a run folder's newest) refuse a broken one.
* Every ``step_XXXXXXXX`` folder, intact or not, is a checkpoint for ``checkpoint.keep`` (the oldest are removed
  first) and for the fresh-run check: broken folders are counted and removed by age like any other, never left
  behind uncounted.

A checkpoint without a manifest whose ``pipecast.json`` does not name one was written by an earlier pipecast: it is
loaded unverified, with a warning (:func:`is_unverified`) -- refusing it would strand every run started before
this version, and it carries the guarantees it was written with (atomic rename).

Pure (the standard library only): the launcher uses it before any rank starts.  The collective check every rank
runs before a load (each rank hashes its share, :func:`share`, and all ranks take the same decision) is
:func:`engine.training.checkpoint.dcp.verify_checkpoint`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterable

__all__ = ["CheckpointError", "MANIFEST_FILE", "META_FILE", "HASH", "file_digest", "manifest_body",
           "read_manifest", "check_checkpoint", "is_unverified", "share", "checkpoint_folders", "step_of",
           "pick_checkpoint", "refusal"]

MANIFEST_FILE = "manifest.json"
META_FILE = "pipecast.json"
HASH = "sha256"
_FORMAT = "pipecast checkpoint manifest"
_NAME = re.compile(r"^step_(\d{8})$")
_BLOCK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, truncated or does not match the model (or cannot be written); the message
    names it and the fix (the whole report: ``engine.runtime.spawn.needs_traceback``)."""

    one_line = True


def file_digest(path: str | os.PathLike) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of the file at ``path``, read in 1 MiB blocks."""
    h = hashlib.new(HASH)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return {"bytes": os.path.getsize(path), HASH: h.hexdigest()}


def manifest_body(files: dict[str, dict], step: int) -> str:
    """The text of a manifest for ``files`` (``{file name: file_digest}``) of the checkpoint of ``step``."""
    return json.dumps({"format": _FORMAT, "version": 1, "hash": HASH, "step": step,
                       "files": dict(sorted(files.items()))}, indent=1) + "\n"


def read_manifest(path: str | os.PathLike) -> dict | None:
    """The ``files`` entry of checkpoint ``path``'s manifest (``{name: {"bytes", "sha256"}}``); None when the folder
    has no manifest.

    Raises:
        ValueError: the manifest is unreadable or not a pipecast manifest (the reason)."""
    f = Path(path) / MANIFEST_FILE
    try:
        body = json.loads(f.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{MANIFEST_FILE} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict) or body.get("format") != _FORMAT or body.get("hash") != HASH:
        raise ValueError(f"{MANIFEST_FILE} is not a pipecast {HASH} manifest")
    files = body.get("files")
    if not isinstance(files, dict) or not all(isinstance(e, dict) and isinstance(e.get("bytes"), int) and
                                              isinstance(e.get(HASH), str) for e in files.values()):
        raise ValueError(f"{MANIFEST_FILE} has no valid 'files' entry")
    return files


def _names_manifest(path: Path) -> bool:
    """Whether ``pipecast.json`` says a manifest was written (False when it is absent or unreadable)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("manifest") == MANIFEST_FILE


def is_unverified(path: str | os.PathLike) -> bool:
    """A checkpoint written before checksums: no manifest, and a ``pipecast.json`` that names none."""
    p = Path(path)
    return not (p / MANIFEST_FILE).exists() and not _names_manifest(p)


def share(files: dict[str, dict], part: int, parts: int) -> list[str]:
    """The file names rank ``part`` of ``parts`` hashes: the largest file first to the least loaded part (ties: the
    lower part), so each part reads about ``1/parts`` of the bytes; the same split on every rank."""
    load, mine = [0] * parts, []
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        k = min(range(parts), key=lambda i: (load[i], i))
        load[k] += files[name]["bytes"]
        if k == part:
            mine.append(name)
    return mine


def _file_problem(path: Path, name: str, entry: dict, hashes: bool) -> str | None:
    f = path / name
    try:
        size = f.stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    if size < entry["bytes"]:
        return f"{name} is truncated ({size:,} of {entry['bytes']:,} bytes)"
    if size > entry["bytes"]:
        return f"{name} has {size:,} bytes, the manifest says {entry['bytes']:,}"
    if hashes and file_digest(f)[HASH] != entry[HASH]:
        return f"{name} fails its {HASH} checksum (its bytes changed after the save)"
    return None


def check_checkpoint(path: str | os.PathLike, part: int = 0, parts: int = 1, hashes: bool = True) -> str | None:
    """What is wrong with checkpoint folder ``path`` (one phrase naming the file), or None when it is intact.

    The folder-level checks (manifest present and readable, ``.metadata`` present) run on every part; the files of
    the manifest are checked by the part that :func:`share` gives them (sizes, and with ``hashes`` the SHA-256).
    A checkpoint without a manifest (:func:`is_unverified`) passes when its ``.metadata`` is there.
    """
    p = Path(path)
    try:
        files = read_manifest(p)
    except ValueError as exc:
        return str(exc)
    if files is None:
        if _names_manifest(p):
            return f"{MANIFEST_FILE} is missing (its {META_FILE} says the save wrote one)"
        return None if (p / ".metadata").is_file() else "has no .metadata (DCP's index of the tensors)"
    if ".metadata" not in files:
        return f"{MANIFEST_FILE} does not list .metadata"
    for name in share(files, part, parts):
        problem = _file_problem(p, name, files[name], hashes)
        if problem is not None:
            return problem
    return None


def refusal(path: str | os.PathLike, problem: str, fix: str | None = None) -> str:
    """The one line refusing checkpoint ``path`` because of ``problem``; ``fix`` (default: how to resume from
    another checkpoint) ends it."""
    fix = fix or ("resume from an older checkpoint (--resume picks the newest intact one, checkpoint.load_step a "
                  "given step) or delete this one")
    return f"checkpoint {str(path)!r} is broken: {problem}; {fix}"


def step_of(path: str | os.PathLike) -> int:
    """The step of a ``step_XXXXXXXX`` folder."""
    return int(_NAME.match(Path(path).name).group(1))


def checkpoint_folders(directory: str | os.PathLike) -> list[Path]:
    """Every ``step_XXXXXXXX`` folder in ``directory``, intact or broken, oldest first (what ``checkpoint.keep``
    counts); ``[]`` when the folder does not exist."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _NAME.match(p.name) and p.is_dir()), key=step_of)


def _steps(folders: Iterable[Path]) -> str:
    steps = [str(step_of(p)) for p in folders]
    return ", ".join(steps[-8:]) if steps else "none"


def pick_checkpoint(directory: str | os.PathLike, step: int | None,
                    check: Callable[[Path], str | None]) -> tuple[Path | None, list[str]]:
    """The checkpoint a resume loads, and one warning per broken checkpoint it skipped.

    ``step`` None: the newest checkpoint of ``directory`` that ``check`` passes (None when the folder holds no
    checkpoint); every newer one is skipped with a warning naming it, its problem and the one loaded instead.
    ``step`` given (``checkpoint.load_step``): that checkpoint.  ``check(path)`` returns a problem or None
    (:func:`check_checkpoint`, or the collective :func:`engine.training.checkpoint.dcp.verify_checkpoint`: it is
    called in the same order on every rank).

    Raises:
        CheckpointError: no checkpoint of ``step``; the checkpoint of ``step`` is broken; or every checkpoint of
            the folder is broken -- each one line naming the checkpoint, the problem and the fix.
    """
    folders = checkpoint_folders(directory)
    if step is not None:
        path = Path(directory) / f"step_{step:08d}"
        if path not in folders:
            raise CheckpointError(f"checkpoint.load_step={step}: {str(directory)!r} holds no checkpoint of step "
                                  f"{step} (its steps: {_steps(folders)}); set checkpoint.load_step to one of them, "
                                  f"or to null for the newest intact one")
        problem = check(path)
        if problem is not None:
            raise CheckpointError(refusal(path, problem))
        return path, []
    skipped = []
    for path in reversed(folders):
        problem = check(path)
        if problem is None:
            return path, [f"checkpoint {str(old)} is broken: {why}; skipped it, resuming from {str(path)}"
                          for old, why in skipped]
        skipped.append((path, problem))
    if not skipped:
        return None, []
    newest, why = skipped[0]
    older = f" (and the {len(skipped) - 1} older ones)" if len(skipped) > 1 else ""
    raise CheckpointError(f"no intact checkpoint in {str(directory)!r}: the newest, {newest.name}, is broken: {why}"
                          f"{older}; delete the folder (or set logging.run_dir / checkpoint.dir to a new one) to "
                          f"start afresh")
