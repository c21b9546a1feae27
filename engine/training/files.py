"""Files the commands write: all-or-nothing, and a failed write named by its operating-system cause.

:func:`write_atomically` writes each file under a hidden temporary name beside it and renames them into place
when all are written; whatever fails, the temporaries are removed (a removal that fails too -- a read-only folder
-- never hides the error that stopped the write).  A write that fails for an operating-system reason (full or
read-only disk, no permission, a folder where the file should be) is a :class:`WriteError`: one line naming the
path and the reason (``strerror`` of the first ``OSError``, e.g. ``No space left on device``).  safetensors'
writer reports such errors as ``SafetensorError: ... I/O error: ... (os error 28)``; :func:`os_error_of` reads the
errno back from that text.  Any other exception propagates unchanged.  Files written piece by piece as a run goes
(``metrics.jsonl``, ``train.log``) name themselves the same way: :func:`writing` around the writes,
:class:`LogFile` for a log.  :func:`write_folder` writes a folder's whole content the same way (a folder that
holds files is replaced only when asked, and then holds the new files only).

Every file written here gets the mode a plain ``open(path, "w")`` would give it -- ``0o666`` less the umask, or
an existing file's own mode -- whatever its writer chose (safetensors writes ``0o600``).

Standard library only.
"""
from __future__ import annotations

import contextlib
import errno as _errno
import logging
import os
import re
import shutil
import sys
from pathlib import Path

__all__ = ["WriteError", "write_atomically", "write_folder", "check_folder", "make_folder", "os_error_of", "writing", "LogFile"]

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error prints an errno (safetensors)


class WriteError(OSError):
    """A file or folder could not be written; ``str()`` is one line naming the path and the operating system's
    reason.  ``errno`` / ``strerror`` / ``filename`` are those of the first ``OSError``."""

    one_line = True  # the whole report (engine.runtime.spawn.needs_traceback)

    def __init__(self, message: str, cause: OSError):
        super().__init__(cause.errno, cause.strerror, cause.filename)
        self.message = message

    def __str__(self) -> str:
        return self.message


def os_error_of(exc: BaseException, path: str | os.PathLike | None = None, depth: int = 0) -> OSError | None:
    """The operating-system error ``exc`` is or stands for -- itself, its ``__cause__`` / ``__context__`` chain,
    or an ``(os error N)`` in a safetensors error's text -- with ``filename`` set to ``path`` when it names none;
    None when there is none (a programming error, which the caller must let through)."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.filename is None and path is not None:
            return OSError(exc.errno, exc.strerror, str(path))
        return exc
    found = _RUST_OS_ERROR.search(str(exc)) if type(exc).__name__ == "SafetensorError" else None
    if found is not None:
        code = int(found.group(1))
        return OSError(code, os.strerror(code), None if path is None else str(path))
    return os_error_of(exc.__cause__ or exc.__context__, path, depth + 1)


def _describe(cause: OSError, path: Path, option: str) -> str:
    """``reason (the OS error's path, when another); the fix`` -- free space for a full disk, another path else."""
    where = f" ({cause.filename})" if cause.filename and str(cause.filename) != str(path) else ""
    full = cause.errno in (_errno.ENOSPC, getattr(_errno, "EDQUOT", _errno.ENOSPC))
    fix = f"free space there or choose another {option}" if full else f"choose another {option} (a folder you can write)"
    return f"{cause.strerror or _errno.errorcode.get(cause.errno, cause.errno)}{where}; {fix}"


def _write_error(exc: BaseException, path: Path, option: str, note: str = "", at: Path | None = None
                 ) -> WriteError | None:
    """The :class:`WriteError` for ``exc`` failing a write of ``path`` (the file written: ``at``, by default
    ``path``), or None if no operating-system error lies under it."""
    cause = os_error_of(exc, at or path)
    if cause is None:
        return None
    return WriteError(f"cannot write {str(path)!r}: {_describe(cause, path, option)}{note}", cause)


@contextlib.contextmanager
def writing(path: str | os.PathLike, option: str = "logging.run_dir"):
    """Run the block that writes ``path``; an operating-system error inside it (a full disk: ``write`` names no
    file) becomes a :class:`WriteError` naming ``path``, the reason and the fix (free space, or another
    ``option``).  Other exceptions propagate unchanged."""
    try:
        yield
    except Exception as exc:
        error = None if isinstance(exc, WriteError) else _write_error(exc, Path(path), option)
        if error is None:
            raise
        raise error from exc


class LogFile(logging.FileHandler):
    """A log file (``train.log``) whose failed write raises one :class:`WriteError` naming it from the logging
    call, instead of ``logging``'s ``--- Logging error ---`` traceback on stderr for every later line (a full
    disk); after that it writes nothing.  Opening it raises :class:`WriteError` too."""

    def __init__(self, path: str | os.PathLike, option: str = "logging.run_dir"):
        self.option, self.failed = option, False
        with writing(path, option):
            super().__init__(path)

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = _write_error(sys.exc_info()[1], Path(self.baseFilename), self.option)
        if error is None:
            super().handleError(record)
            return
        self.failed = True
        raise error

    def close(self) -> None:
        with writing(self.baseFilename, self.option):
            try:
                super().close()
            except OSError:
                if not self.failed:  # the failure was reported when it happened
                    raise


def make_folder(path: str | os.PathLike, option: str = "--out") -> Path:
    """``mkdir(path, exist_ok=True)`` (its parent must exist).

    Raises:
        WriteError: the folder cannot be created (read-only disk, no permission, ...), naming it and the reason.
    """
    path = Path(path)
    try:
        path.mkdir(exist_ok=True)
    except OSError as exc:
        cause = os_error_of(exc, path)
        raise WriteError(f"cannot create folder {str(path)!r}: {_describe(cause, path, option)}", cause) from exc
    return path


def _remove_quietly(path: Path) -> None:
    """Remove a temporary file; a failure here (a read-only or vanished folder: nothing to remove) must not hide
    the error that stopped the write."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def write_atomically(writes: list, option: str = "--out") -> list[Path]:
    """Write each ``(final_path, write_fn)`` -- ``write_fn(path)`` writes the file at ``path`` -- to a hidden
    ``.NAME.tmp`` beside it, then rename them all into place (a reader never sees a half-written file); the
    temporaries are removed whatever happens.  Returns the final paths.

    Raises:
        WriteError: a write or rename failed for an operating-system reason; the message names the file, the
            first ``OSError``'s reason and the fix (free space, or another ``option``).  Other exceptions propagate unchanged.
    """
    tmps = [(Path(final), Path(final).with_name(f".{Path(final).name}.tmp")) for final, _ in writes]
    current = tmps[0][0] if tmps else Path(".")
    try:
        for (_, write), (final, tmp) in zip(writes, tmps):
            current = final
            write(tmp)
            _plain_mode(tmp, final)
        for final, tmp in tmps:
            current = final
            os.replace(tmp, final)
    except Exception as exc:
        error = _write_error(exc, current, option, " (no file is left half-written)",
                             current.with_name(f".{current.name}.tmp"))
        if error is None:
            raise
        raise error from exc
    finally:
        for _, tmp in tmps:
            _remove_quietly(tmp)
    return [final for final, _ in tmps]


def _umask() -> int:
    """This process's umask, read from ``/proc/self/status`` (Linux) without changing it; elsewhere set and
    restored at once."""
    try:
        found = re.search(r"^Umask:\s*([0-7]+)", Path("/proc/self/status").read_text(), re.M)
        if found:
            return int(found.group(1), 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _plain_mode(path: Path, final: Path | None = None) -> None:
    """Give ``path`` (to become ``final``) the mode ``open(final, "w")`` would: ``final``'s own when it exists,
    else (a new file) ``0o666`` less the umask."""
    try:
        mode = final.stat().st_mode & 0o7777 if final is not None else None
    except OSError:
        mode = None
    os.chmod(path, 0o666 & ~_umask() if mode is None else mode)


def write_folder(folder: str | os.PathLike, writes: list, option: str = "--out", overwrite: bool = False,
                 flag: str = "--overwrite") -> list[Path]:
    """Write the files ``writes`` (``(name, write_fn)``; ``write_fn(path)`` writes one file) as the whole content
    of ``folder``: into a hidden temporary folder beside it, which takes the folder's place only once every file is
    complete (an existing folder is moved aside, then removed; a failure before leaves it as it was).  So the folder
    never holds a half-written file, nor a stale file of what it held before.  Returns the paths written.

    Raises:
        ValueError: ``folder`` is a file, its parent does not exist, or it holds files and ``overwrite`` is false
            (naming some and ``flag``).
        WriteError: a file or a folder could not be written (read-only or full disk, no permission), naming it
            (its final path) and the reason; ``folder`` is left as it was."""
    folder = check_folder(folder, option, overwrite, flag)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    try:
        make_folder(tmp, option)
        if folder.is_dir():
            shutil.copymode(folder, tmp)
        for name, write in writes:
            with writing(folder / name, option):
                write(tmp / name)
                _plain_mode(tmp / name)
        with writing(folder, option):
            _swap(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [folder / name for name, _ in writes]


def check_folder(folder: str | os.PathLike, option: str = "--out", overwrite: bool = False,
                 flag: str = "--overwrite") -> Path:
    """What :func:`write_folder` checks before writing (call it before slow work to refuse early).

    Raises:
        ValueError: ``folder`` is a file, its parent does not exist, or it holds files and ``overwrite`` is false."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{option}={str(folder)!r} is a file; give a folder path")
    if not folder.parent.is_dir():
        raise ValueError(f"{option}={str(folder)!r}: folder {str(folder.parent)!r} does not exist; create it first")
    held = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ValueError(f"{option}={str(folder)!r} is not empty ({shown}); pass {flag} to replace it (it then "
                         f"holds the new files only) or choose a new or empty folder")
    return folder


def _swap(new: Path, folder: Path) -> None:
    """Put folder ``new`` in ``folder``'s place: move the existing one aside, rename, remove the old one (put back
    if the rename fails)."""
    if not folder.exists():
        os.rename(new, folder)
        return
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    os.rename(folder, old)
    try:
        os.rename(new, folder)
    except OSError:
        os.rename(old, folder)
        raise
    shutil.rmtree(old, ignore_errors=True)
