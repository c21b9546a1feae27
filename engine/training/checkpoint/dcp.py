"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, verified, resumable, never unpickled.

Layout: ``<dir>/step_00000100/`` (a DCP folder: ``.metadata`` + the ``.distcp`` files the ranks write, however DCP
lays them out; ``pipecast.json``; ``manifest.json``).  A save writes into ``<dir>/.step_00000100.tmp``; once every
rank has finished, each rank hashes the files it wrote, rank 0 writes the manifest of every file's size and SHA-256
(:mod:`.integrity`) and renames the folder (it must be on a file system all ranks share), so a crash mid-write
leaves only a ``.tmp`` folder that is never loaded; the previous checkpoint stays valid.  ``keep`` checkpoints are
kept (every ``step_*`` folder counts, broken or not; never removing the one just written).
A save also writes ``pipecast.json`` into the folder (:data:`META_FILE`): plain JSON describing the run (the model
settings a resume must match, when given) and naming the manifest, read by :func:`read_checkpoint_meta` before any
tensor is loaded.

Every load is verified first (:func:`verify_checkpoint`: collective, each rank hashes its share of the files and
all ranks take the same decision before any rank reads a tensor); a broken checkpoint is refused in one line
naming the file and what is wrong, and a resume falls back to the newest intact one (:func:`checkpoint_to_load`).

Only tensors are stored (step, scheduler step and RNG states included).  Loading unpickles nothing a file can
choose: tensors are read by DCP with ``weights_only=True``, and DCP's ``.metadata`` (itself a pickle) is read by
:class:`_MetadataUnpickler`, which only builds DCP's metadata records, ``torch.Size`` / dtypes / layouts and paths;
metadata that declares a pickled-object entry (which DCP would load with ``weights_only=False``) is rejected.  Model and
optimizer state are keyed by layout-independent names (``engine.training.models.chunk.canonical_module``): the two
bitwise-equal copies of the tied embedding share one key, data-parallel replicas are deduplicated by DCP.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import torch.distributed as dist

from .integrity import (MANIFEST_FILE, META_FILE, CheckpointError, check_checkpoint, checkpoint_folders,
                        file_digest, is_unverified, manifest_body, pick_checkpoint, refusal)

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints",
           "checkpoint_keys", "read_checkpoint_meta", "verify_checkpoint", "checkpoint_to_load", "META_FILE"]

log = logging.getLogger("pipecast." + __name__.rsplit(".", 1)[-1])


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Every checkpoint folder (``step_XXXXXXXX``) in ``directory``, intact or broken, oldest first: what
    ``keep`` counts (:func:`.integrity.checkpoint_folders`)."""
    return checkpoint_folders(directory)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint folder with the highest step (intact or not: loading it verifies it), or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(state: dict, directory: str | os.PathLike, step: int, keep: int = 2,
                    meta: dict | None = None, extra_files: dict[str, str] | None = None) -> Path:
    """Collectively save ``state`` (nested dicts of tensors) as ``<directory>/step_<step>``; returns the path.

    Every rank calls it.  Writes to a temporary folder: DCP's files, then (:func:`_publish_files`, rank 0)
    :data:`META_FILE` (``meta`` as JSON, naming the manifest), rank 0's ``extra_files`` (``{file name: text}``, e.g.
    the run's ``tokenizer.json``) and ``manifest.json`` (every file's size and SHA-256, each rank hashing the files it
    wrote); then rank 0 renames the folder and removes temporary folders left by crashed saves and the oldest
    checkpoints so that ``keep`` remain -- the one just written always stays, even beside higher-step checkpoints
    of another run.
    """
    d = Path(directory)
    final, tmp = d / f"step_{step:08d}", d / f".step_{step:08d}.tmp"
    with _save_errors(d, step, tmp):
        if _rank() == 0:
            d.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        import torch.distributed.checkpoint as dcp  # heavy (DTensor); only when checkpointing
        writer = _recording_writer(tmp)
        dcp.save(state, storage_writer=writer)
        digests = _digests_of_every_rank(tmp, writer.written)  # collective: every rank's files are complete
        if _rank() == 0:
            _publish_files(tmp, step, digests, meta, extra_files)
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        others = [p for p in list_checkpoints(d) if p != final]
        for old in others[:max(0, len(others) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in d.glob(".step_*.tmp"):  # left by saves that crashed mid-write
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def _digests_of_every_rank(tmp: Path, written: set[Path]) -> dict[str, dict]:
    """Collective: ``{file name: file_digest}`` of the files every rank wrote into ``tmp`` (each rank reads back
    its own).  A rank that cannot read one makes every rank raise the same ``OSError``."""
    mine, error = {}, None
    try:
        mine = {p.name: file_digest(p) for p in sorted(written) if p.parent == tmp}
    except OSError as exc:
        error = (exc.errno, exc.strerror or str(exc), exc.filename)
    everyone = [(mine, error)]
    if _world() > 1:
        everyone = [None] * _world()
        dist.all_gather_object(everyone, (mine, error))
    failed = next((e for _, e in everyone if e is not None), None)
    if failed is not None:
        raise OSError(*failed)
    return {name: digest for files, _ in everyone for name, digest in files.items()}


def _publish_files(tmp: Path, step: int, digests: dict[str, dict], meta: dict | None,
                   extra_files: dict[str, str] | None) -> None:
    """Rank 0, before the rename: :data:`META_FILE` (``meta`` plus ``"manifest"``), the extra files, and the manifest
    of every file in ``tmp`` -- those the ranks hashed, and any other (what DCP wrote outside its file streams)."""
    (tmp / META_FILE).write_text(json.dumps({**(meta or {}), "manifest": MANIFEST_FILE}, indent=1, sort_keys=True))
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    files = dict(digests)
    for f in sorted(tmp.iterdir()):
        if f.is_file() and f.name != MANIFEST_FILE and f.name not in files:
            files[f.name] = file_digest(f)
    (tmp / MANIFEST_FILE).write_text(manifest_body(files, step))


def _recording_writer(path: Path):
    """DCP's ``FileSystemWriter`` for ``path`` whose write errors keep their cause, and which records in
    ``.written`` (a set of paths) every file this rank wrote (renames followed: DCP writes ``.metadata.tmp``, then
    renames it) -- whatever DCP's file layout, each rank hashes exactly its own files.

    torch's zip writer (``torch.save`` into DCP's file stream) turns an ``OSError`` raised by the stream -- a full
    disk -- into ``RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos``, hiding ``No space left
    on device``.  This writer's streams record the first ``OSError`` (with the file's path when it names none), and
    a failed ``write_data`` / ``finish`` raises that ``OSError`` (the RuntimeError as its cause), which DCP then
    reports in its per-rank failures on every rank."""
    import torch.distributed.checkpoint as dcp
    errors: list[OSError] = []
    written: set[Path] = set()

    class _Writer(dcp.FileSystemWriter):
        def _cause(self, call, *args):
            try:
                return call(*args)
            except Exception as exc:
                if errors and errors[0] is not exc:
                    raise errors[0] from exc
                raise

        def write_data(self, plan, planner):
            return self._cause(super().write_data, plan, planner)

        def finish(self, metadata, results):
            return self._cause(super().finish, metadata, results)

    writer = _Writer(str(path))
    writer.fs = _recording_file_system(errors, written)
    writer.written = written
    return writer


def _recording_file_system(errors: list[OSError], written: set[Path]):
    """DCP's ``FileSystem`` whose streams append the first ``OSError`` of a write to ``errors`` (named after the
    file when it names none) and which adds every file opened for writing to ``written`` (following renames)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    def record(exc: OSError, where) -> None:
        if exc.errno is not None and not any(e is exc or e.__cause__ is exc for e in errors):
            named = exc if exc.filename is not None else OSError(exc.errno, exc.strerror, str(where))
            if named is not exc:
                named.__cause__ = exc
            errors.append(named)

    class _Stream:
        """The file stream, recording an ``OSError`` of ``write`` / ``flush`` / ``close`` before it propagates."""

        def __init__(self, raw, where):
            self._raw, self._where = raw, where

        def __getattr__(self, name):
            attr = getattr(self._raw, name)
            if name not in ("write", "flush", "close"):
                return attr

            def recorded(*args, **kwargs):
                try:
                    return attr(*args, **kwargs)
                except OSError as exc:
                    record(exc, self._where)
                    raise
            return recorded

    class _FileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, where, mode):
            if "w" in mode or "a" in mode:
                written.add(Path(where))
            try:
                with super().create_stream(where, mode) as raw:
                    yield _Stream(raw, where)
            except OSError as exc:
                record(exc, where)
                raise

        def rename(self, where, new_path):
            super().rename(where, new_path)
            if Path(where) in written:
                written.discard(Path(where))
                written.add(Path(new_path))

    return _FileSystem()


@contextlib.contextmanager
def _save_errors(directory: Path, step: int, tmp: Path):
    """Turn a failed write (an ``OSError``, or DCP's ``CheckpointException`` wrapping one on some rank) into a
    :class:`CheckpointError` whose first line carries the root cause -- the operating system's reason and the file
    (e.g. ``No space left on device: '.../__0_0.distcp'``) -- and says that the previous checkpoint is intact.
    Rank 0 removes the partial temporary folder (every rank has left DCP's collective save when it fails), so the
    space it took is free again."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        yield
    except (OSError, CheckpointException) as exc:
        from ...runtime.spawn import describe_exception, os_error_under
        os_error = os_error_under(exc)
        cause = describe_exception(exc) if os_error is None else f"{type(os_error).__name__}: {os_error}"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(directory)
        kept = f"the previous checkpoint {str(previous)!r} is intact" if previous else "no earlier checkpoint"
        full = os_error is None or os_error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
        fix = "free space or set checkpoint.dir to a folder with room" if full else \
            "set checkpoint.dir to a folder this job can write"
        raise CheckpointError(f"cannot save the checkpoint of step {step} in {str(directory)!r}: {cause}; {kept}; "
                              f"{fix}, then --resume") from exc


def read_checkpoint_meta(path: str | os.PathLike) -> dict | None:
    """The :data:`META_FILE` JSON saved with checkpoint ``path`` (None for checkpoints written without one).

    Raises:
        CheckpointError: the file exists but is not a JSON object.
    """
    f = Path(path) / META_FILE
    if not f.is_file():
        return None
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} has an unreadable {META_FILE} ({exc}); delete the "
                              f"checkpoint or resume from an older one") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {META_FILE} holds a {type(meta).__name__}, not an "
                              f"object; delete the checkpoint or resume from an older one")
    return meta


# (module, name) globals a DCP ``.metadata`` pickle may reference (torch 2.x); everything else is refused
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
     ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP ``.metadata`` files that can only construct the allow-listed globals (and torch dtypes)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            import torch
            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata (pipecast "
                                     f"checkpoints hold tensors only)")


def _read_metadata(path: Path):
    """DCP metadata of the checkpoint folder ``path`` through :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise pickle.UnpicklingError(f"entry {key!r} is a {type(entry).__name__}, not a tensor")
    return metadata


def _safe_reader(path: str | os.PathLike):
    """A DCP ``FileSystemReader`` for ``path`` whose metadata is read by :func:`_read_metadata`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeFileSystemReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            metadata = _read_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeFileSystemReader(str(path))


def checkpoint_keys(path: str | os.PathLike) -> set[str]:
    """The flattened keys a checkpoint holds (from its ``.metadata``).

    Raises:
        CheckpointError: the folder or its metadata is missing or unreadable.
    """
    p = Path(path)
    if not (p / ".metadata").is_file():
        raise CheckpointError(f"{str(p)!r} is not a complete checkpoint (no .metadata file); it may be truncated "
                              f"or still being written -- delete it or resume from an older one")
    try:
        return set(_read_metadata(p / ".metadata").state_dict_metadata)
    except Exception as exc:  # noqa: BLE001 - any read failure is a corrupt checkpoint
        raise CheckpointError(f"checkpoint {str(p)!r} has corrupt metadata ({type(exc).__name__}: {exc}); delete "
                              f"it or resume from an older one") from None


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """Collective over the default group (every rank calls it; one process without ``torch.distributed``): what
    is wrong with checkpoint ``path`` (:func:`.integrity.check_checkpoint`), or None when it is intact.

    Each rank checks the folder and hashes its share of the manifest's files (:func:`.integrity.share`: about
    ``1/world`` of the bytes); the verdicts are all-gathered, so every rank returns the same answer (the first
    problem in rank order) before any rank loads.  A checkpoint written before checksums passes, with a warning
    (rank 0) that it is loaded unverified.
    """
    try:
        problem = check_checkpoint(path, _rank(), _world())
    except OSError as exc:
        problem = f"cannot be read ({type(exc).__name__}: {exc})"
    if _world() > 1:
        verdicts = [None] * _world()
        dist.all_gather_object(verdicts, problem)
        problem = next((v for v in verdicts if v is not None), None)
    if problem is None and _rank() == 0 and is_unverified(path):
        log.warning("checkpoint %s has no %s (written by a pipecast without checksums): loading it unverified",
                    path, MANIFEST_FILE)
    return problem


def checkpoint_to_load(directory: str | os.PathLike, step: int | None = None,
                       path: str | os.PathLike | None = None) -> tuple[Path | None, list[str]]:
    """Collective: the verified checkpoint a resume loads, and the warnings for the broken ones it skipped.

    ``path`` given: that checkpoint.  Else :func:`.integrity.pick_checkpoint` over ``directory`` with
    :func:`verify_checkpoint`: the checkpoint of ``step`` (``checkpoint.load_step``), or the newest intact one (None
    when ``directory`` holds none).

    Raises:
        CheckpointError: the named checkpoint (``path`` or ``step``) is missing or broken, or every checkpoint of
            ``directory`` is broken (one line naming it and what is wrong).
    """
    if path is None:
        return pick_checkpoint(directory, step, verify_checkpoint)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(refusal(path, problem))
    return Path(path), []


def load_checkpoint(state: dict, path: str | os.PathLike, verify: bool = True) -> None:
    """Collectively load ``path`` into ``state`` in place (every rank calls it), after :func:`verify_checkpoint`
    (``verify=False``: the caller has verified it, e.g. through :func:`checkpoint_to_load`).

    Raises:
        CheckpointError: a broken checkpoint (the file and what is wrong), or keys the checkpoint lacks (a
            different model).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    if verify:
        checkpoint_to_load(Path(path).parent, path=path)
    try:
        dcp.load(state, storage_reader=_safe_reader(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises CheckpointException (a
        # BaseException) on every rank when any rank fails to read
        from ...runtime.spawn import describe_exception  # the line that names the error, not DCP's traceback
        raise CheckpointError(f"cannot load checkpoint {str(path)!r}: it is corrupt, truncated or was written for "
                              f"another model ({describe_exception(exc, 300)}); delete it or resume from an older "
                              "one") from None
