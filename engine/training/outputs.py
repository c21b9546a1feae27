"""A run's output folders: checked before any rank starts, locked while the run lasts.

* :func:`check_outputs` -- every folder the run will write (``logging.run_dir``, ``checkpoint.dir``, the
  ``--timeline`` folder) can be created and written (it is created, and a probe file written and removed), no
  path component is over the file system's name limit, and the optional packages the run needs are installed
  (matplotlib for ``--timeline``, Transformer Engine for ``cuda_graphs.backend=te``).  Each problem is a
  :class:`~engine.training.config.ConfigError` naming the field, its value, the cause and the fix.
* :func:`setup_logging` -- the run's log lines (stderr, ``train.log`` on the logging rank).
* :func:`run_lock` -- an advisory lock (``fcntl.flock``, exclusive) on ``<folder>/.pipecast.lock`` for the run
  folder and the checkpoint folder, held by the launcher for the whole run.  The kernel releases it when the
  process ends, however it ends, so a crashed run never blocks the next; a second run into a locked folder is
  refused naming the holder's pid (written into the lock file).  Nested use in one process is allowed (the
  launcher locks before it imports torch, so a second run is refused within a second, and ``launch_ranks`` locks again).  Advisory locks work between processes of one
  machine; on a network file system they are as good as its ``flock`` support.

Standard library only (no torch), so the checks take milliseconds.
"""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import socket
import sys
import time
from pathlib import Path

from .config import ConfigError, TrainConfig
from .files import LogFile

__all__ = ["check_outputs", "run_lock", "LOCK_FILE"]

LOCK_FILE = ".pipecast.lock"
_NAME_MAX = 255  # bytes per path component on Linux file systems (ext4, xfs, btrfs, tmpfs)


def check_outputs(config: TrainConfig, timeline: str | os.PathLike | None = None) -> None:
    """Refuse, before any rank starts, output paths the run could not write and optional packages it lacks.

    Creates the folders it checks (the run creates them anyway).

    Raises:
        ConfigError: naming the field (``logging.run_dir``, ``checkpoint.dir``, ``--timeline``), its value, the
            operating system's reason and the fix.
    """
    _writable_folder("logging.run_dir", config.logging.run_dir)
    ckpt_field = "checkpoint.dir" if config.checkpoint.dir else "checkpoint.dir (default <logging.run_dir>/checkpoints)"
    _writable_folder(ckpt_field, str(config.checkpoint_dir))
    if timeline is not None:
        _writable_folder("--timeline", str(timeline))
        _need_package("matplotlib", "--timeline draws the measured Gantt chart with matplotlib",
                      "pip install matplotlib (or pip install -e '.[dev]'), or run without --timeline")
    cg = config.cuda_graphs
    if cg.enabled and cg.backend == "te":
        _need_package("transformer_engine", "cuda_graphs.backend='te' captures through Transformer Engine",
                      "pip install transformer-engine[pytorch], or set cuda_graphs.backend=auto")


def _need_package(module: str, why: str, fix: str) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"{why}, but the package {module!r} is not installed; {fix}")


def _writable_folder(field: str, value: str) -> None:
    """``value`` names a folder this process can create and write a file in."""
    path = Path(value)
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > _name_max(path):
            shown = value if len(value) <= 80 else value[:60] + "..."
            raise ConfigError(f"{field}={shown!r}: the path component {part[:24]!r}... is {size} bytes long, over "
                              f"the file system's limit of {_name_max(path)} bytes per name; use a shorter name")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{field}={value!r} is a file, not a folder; choose a folder (it is created if "
                          f"missing) or remove that file")
    above = _existing_ancestor(path)
    if above is not None and above != path and not above.is_dir():
        raise ConfigError(f"{field}={value!r} cannot be created: {str(above)!r} is a file, not a folder; choose a "
                          f"path under a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".pipecast-write-probe-{os.getpid()}"
        try:
            probe.write_bytes(b"pipecast write probe\n")  # not empty: a full disk refuses it
        finally:
            probe.unlink(missing_ok=True)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != value else ""
        fix = ("free space there or choose another folder" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else
               "choose a folder you can write, e.g. under your home or the working directory")
        raise ConfigError(f"{field}={value!r} cannot be written: {exc.strerror or exc}{where}; {fix}") from None


def _write_holder(fh, field: str, value: str) -> None:
    """Write this process's pid, host and start time into the held lock file (what a refused run names)."""
    from .files import writing
    try:
        with writing(fh.name, field):
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n{socket.gethostname()}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    except OSError as exc:  # a WriteError naming the lock file, the reason and the fix
        raise ConfigError(f"{field}={value!r}: {exc}") from None


def _existing_ancestor(path: Path) -> Path | None:
    """``path`` or its nearest ancestor that exists (None if none does, e.g. a relative path's first part)."""
    probe = path
    while True:
        try:
            if probe.exists():
                return probe
        except OSError:  # e.g. a component over the name limit
            pass
        if probe == probe.parent:
            return None
        probe = probe.parent


def _name_max(path: Path) -> int:
    probe = _existing_ancestor(path.absolute())
    try:
        return int(os.pathconf(probe if probe is not None else ".", "PC_NAME_MAX"))
    except (OSError, ValueError):
        return _NAME_MAX


@contextlib.contextmanager
def run_lock(config: TrainConfig):
    """Hold the locks of ``logging.run_dir`` and ``checkpoint.dir`` (created if missing) while the block runs.

    Raises:
        ConfigError: another process holds one of them (its pid, host and start time are named).
    """
    folders = {}
    for field, value in [("logging.run_dir", config.logging.run_dir),
                         ("checkpoint.dir", str(config.checkpoint_dir))]:
        folders.setdefault(Path(value).resolve(), (field, value))
    with contextlib.ExitStack() as stack:
        for folder, (field, value) in folders.items():
            stack.enter_context(_locked(folder, field, value))
        yield


_HELD: dict[Path, int] = {}  # folders this process holds the lock of -> nesting depth (run() and launch_ranks() both lock)


@contextlib.contextmanager
def _locked(folder: Path, field: str, value: str):
    if folder in _HELD:  # already ours: nested use in this process
        _HELD[folder] += 1
        try:
            yield
        finally:
            _HELD[folder] -= 1
        return
    import fcntl
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / LOCK_FILE, "a+b", buffering=0)  # noqa: SIM115 - held for the block; unbuffered: no write at close
    try:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().decode("utf-8", "replace").split("\n")
            pid = holder[0] if holder and holder[0] else "unknown"
            more = f" on {holder[1]} since {holder[2]}" if len(holder) >= 3 and holder[2] else ""
            raise ConfigError(f"{field}={value!r} is in use by another pipecast run (pid {pid}{more}); wait for it "
                              f"to finish (or stop it), or give this run another {field}") from None
        _write_holder(fh, field, value)
        _HELD[folder] = 1
        yield
    finally:
        if _HELD.get(folder) == 1:
            del _HELD[folder]
        fh.close()  # releases the lock


class _Stderr(logging.StreamHandler):
    """Log lines to the ``sys.stderr`` of the moment (not the one when the first trainer of the process was built,
    which a test's or a notebook's capture may have closed since)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(config: TrainConfig, is_log_rank: bool, run_dir: Path,
                  to_file: bool = True) -> logging.Handler | None:
    """stdlib logging of a run (the ``pipecast`` logger): INFO lines on the logging rank (stderr and, when
    ``to_file``, ``<run_dir>/train.log``), warnings elsewhere.  Returns the file handler this call added (the
    trainer removes it when it closes)."""
    logger = logging.getLogger("pipecast")
    logger.setLevel(getattr(logging, config.logging.level) if is_log_rank else logging.WARNING)
    if not any(getattr(h, "_pipecast", False) for h in logger.handlers):
        handler = _Stderr()
        handler._pipecast = True
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    if not (is_log_rank and to_file):
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    target = str((run_dir / "train.log").resolve())
    if any(getattr(h, "baseFilename", None) == target for h in logger.handlers):
        return None
    fh = LogFile(target)  # a failed write: one WriteError naming train.log, not a traceback per line
    fh.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(fh)
    return fh
