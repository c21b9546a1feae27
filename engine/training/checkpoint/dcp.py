"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, resumable, never unpickled.

Layout: ``<dir>/step_00000100/`` (a DCP folder: ``.metadata`` + one ``.distcp`` file per writing rank).  A save
writes into ``<dir>/.step_00000100.tmp`` and rank 0 renames it once every rank has finished (the folder must be
on a file system all ranks share), so a crash mid-write leaves only a ``.tmp`` folder that is never loaded; the
previous checkpoint stays valid.  ``keep`` completed checkpoints are kept (never removing the one just written).
A save may also write ``pipecast.json`` into the folder (:data:`META_FILE`): plain JSON describing the run (the model
settings a resume must match), read by :func:`read_checkpoint_meta` before any tensor is loaded.

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
import re
import shutil
from pathlib import Path

import torch.distributed as dist

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints",
           "checkpoint_keys", "read_checkpoint_meta", "META_FILE"]

log = logging.getLogger("pipecast." + __name__.rsplit(".", 1)[-1])
_NAME = re.compile(r"^step_(\d{8})$")
META_FILE = "pipecast.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, truncated or does not match the model (or cannot be written); the message
    names it and the fix (the whole report: ``engine.runtime.spawn.needs_traceback``)."""

    one_line = True


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Completed checkpoints in ``directory`` (a ``.metadata`` file present), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if _NAME.match(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The completed checkpoint with the highest step, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(state: dict, directory: str | os.PathLike, step: int, keep: int = 2,
                    meta: dict | None = None, extra_files: dict[str, str] | None = None) -> Path:
    """Collectively save ``state`` (nested dicts of tensors) as ``<directory>/step_<step>``; returns the path.

    Every rank calls it.  Writes to a temporary folder (with ``meta`` as JSON in :data:`META_FILE` when given, and
    rank 0's ``extra_files``, ``{file name: text}``, e.g. the run's ``tokenizer.json``),
    then rank 0 renames it and removes temporary folders left by crashed saves and the oldest checkpoints so that
    ``keep`` remain -- the one just written always stays, even beside higher-step checkpoints of another run.
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
        dcp.save(state, storage_writer=_recording_writer(tmp))
        _barrier()
        if _rank() == 0 and meta is not None:
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
        for name, text in ((extra_files or {}).items() if _rank() == 0 else ()):
            (tmp / name).write_text(text)
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


def _recording_writer(path: Path):
    """DCP's ``FileSystemWriter`` for ``path`` whose write errors keep their cause.

    torch's zip writer (``torch.save`` into DCP's file stream) turns an ``OSError`` raised by the stream -- a full
    disk -- into ``RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos``, hiding ``No space left
    on device``.  This writer's streams record the first ``OSError`` (with the file's path when it names none), and
    a failed ``write_data`` / ``finish`` raises that ``OSError`` (the RuntimeError as its cause), which DCP then
    reports in its per-rank failures on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem
    errors: list[OSError] = []

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
            try:
                with super().create_stream(where, mode) as raw:
                    yield _Stream(raw, where)
            except OSError as exc:
                record(exc, where)
                raise

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
    writer.fs = _FileSystem()
    return writer


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


def load_checkpoint(state: dict, path: str | os.PathLike) -> None:
    """Collectively load ``path`` into ``state`` in place (every rank calls it).

    Raises:
        CheckpointError: missing / corrupt / truncated files, or keys the checkpoint lacks (a different model).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        dcp.load(state, storage_reader=_safe_reader(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises CheckpointException (a
        # BaseException) on every rank when any rank fails to read
        from ...runtime.spawn import describe_exception  # the line that names the error, not DCP's traceback
        raise CheckpointError(f"cannot load checkpoint {str(path)!r}: it is corrupt, truncated or was written for "
                              f"another model ({describe_exception(exc, 300)}); delete it or resume from an older "
                              "one") from None
