"""One spawner of local ranks, used by ``pipecast train``, the tests and the benchmarks.

``spawn(fn, world_size, backend="gloo", args=(...))`` starts ``world_size`` processes (``spawn`` start method), joins
them in one ``torch.distributed`` job (a rendezvous ``TCPStore`` hosted by the calling process on 127.0.0.1, on a
port the OS picks), runs ``fn(rank, world_size, *args)`` in each and returns the per-rank return values (they must
pickle; a rank that ends with ``os._exit(0)`` returns None).

Failure behaviour (what the caller sees is one exception whose ``str()`` is one line):

* a rank raises: every rank records the time it raised before it closes its groups, so the rank that raised
  first is blamed, not a peer that then failed on the closed connection; :class:`RankError` names that rank and
  the exception (type and first line, plus the operating-system error under it, e.g. ``No space left on
  device``); ``.traceback`` holds the rank's traceback, and ``.one_line`` says that the line is the whole report
  (:func:`needs_traceback`: a full disk, a bad config or checkpoint -- callers then print the line alone).  A rank
  that recorded a failure but has not exited
  within :data:`REPORT_GRACE_S` (stuck in its teardown) is reported all the same.
* a rank dies (a signal, ``os._exit(N)``): :class:`RankError` naming the rank and the signal / status; a rank
  killed by a signal the spawner did not send outranks the peers that raised because it went away.
* a rank is stopped (``SIGSTOP``, Ctrl-Z: process state ``T``) and a peer times out waiting for it:
  :class:`RankError` names the stopped rank, with the peer's timeout as the cause (not the waiting peer).

A Python warning that several ranks emit (the same text from the same place) is shown once per job, by the first
rank that emits it.
* the job runs past ``timeout_s``: :class:`JobTimeout` naming the ranks still running.
* SIGINT (Ctrl-C) to the caller, or a rank ended by SIGINT: :class:`Interrupted` (a ``KeyboardInterrupt``).
* SIGTERM to the caller (what a cluster scheduler sends): it is forwarded to every rank, which gets
  ``term_grace_s`` seconds to finish (the trainer finishes its step and saves a checkpoint) and return; the
  results are returned when every rank exits cleanly.  A second SIGTERM, the grace running out, or a rank killed
  by the SIGTERM raises :class:`Terminated`.

After any failure the other ranks are stopped: SIGINT (each rank restores its default action, so it ends at once,
quietly; SIGCONT too, so a stopped rank receives it), then SIGKILL for those alive :data:`STOP_GRACE_S` seconds
later; every process is reaped before the exception reaches the caller.  Ranks also die with the caller
(``PR_SET_PDEATHSIG`` on Linux).  Teardown after ``fn`` returns: a barrier of the default group, then
``destroy_process_group``, so no rank tears down while a peer still communicates.  Then the rank ends with
:func:`exit_process`: its non-daemon threads joined and its ``atexit`` handlers run, but no interpreter
finalization, where a thread still inside torch (a gloo worker that holds the last reference to a finished work's
tensors while a Python object keeps the group alive past ``destroy_process_group``, a daemon thread mid-op) dies
re-taking the GIL and aborts the process (``terminate called without an active exception``, SIGABRT) after its
work is done (pytorch/pytorch#190489, #179291).
"""
from __future__ import annotations

import datetime
import errno
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

__all__ = ["spawn", "exit_process", "RankError", "JobTimeout", "Interrupted", "Terminated", "free_port",
           "describe_exception", "os_error_under", "needs_traceback", "teardown", "STOP_GRACE_S", "REPORT_GRACE_S",
           "TERM_GRACE_S", "MACHINE_ERRNOS"]

STOP_GRACE_S = 5.0  # seconds a stopped rank has to exit (after SIGINT) before SIGKILL
REPORT_GRACE_S = 2.0  # seconds a rank that recorded a failure may take to exit before it is reported anyway
SETTLE_S = 2.0  # seconds a lost-peer failure waits for the other ranks' exits before blaming (a killed rank's exit is slow)
_PEER_LOST = re.compile(r"connection (reset|closed|refused)|broken pipe|closed by peer", re.IGNORECASE)
TERM_GRACE_S = 120.0  # default seconds the ranks get after a forwarded SIGTERM (finish the step, save) to exit
_POLL_S = 0.1


class RankError(RuntimeError):
    """A spawned rank failed.  ``str()`` is one line: ``rank R failed: Type: message; stopped ranks ...`` (or
    ``rank R (pid P) was killed by SIGKILL; ...``).  Attributes: ``rank``, ``pid``, ``cause`` (the one-line
    cause), ``traceback`` (the rank's formatted traceback, "" when it died without raising), ``exit_code``
    (negative: the signal), ``signal_name`` (or None), ``stopped`` (the ranks the spawner stopped), ``one_line``
    (the cause is the whole report, :func:`needs_traceback`: print ``str()`` without the traceback)."""

    def __init__(self, rank: int, pid: int | None, cause: str, traceback: str = "", exit_code: int | None = None,
                 signal_name: str | None = None, stopped: list[int] | tuple = (), one_line: bool = False):
        self.rank, self.pid, self.cause, self.traceback, self.one_line = rank, pid, cause, traceback, one_line
        self.exit_code, self.signal_name, self.stopped = exit_code, signal_name, list(stopped)
        others = ", ".join(str(r) for r in self.stopped) or "none"
        head = f"rank {rank} failed: {cause}" if traceback else f"rank {rank} (pid {pid}) {cause}"
        super().__init__(f"{head}; stopped the other ranks ({others})")


class JobTimeout(TimeoutError):
    """The job did not finish within ``timeout_s``; ``ranks`` lists the ranks that were still running."""

    def __init__(self, ranks: list[int], timeout_s: float):
        self.ranks = list(ranks)
        super().__init__(f"ranks {self.ranks} did not finish within timeout_s={timeout_s:g} s; stopped them")


class Interrupted(KeyboardInterrupt):
    """SIGINT to the caller, or to one of its ranks; every rank has been stopped.  ``str()`` is the one line
    ``interrupted[ (SIGINT to rank R)]; stopped ranks ...``; ``ranks`` lists the stopped ranks."""

    def __init__(self, ranks: list[int], cause: str = ""):
        self.ranks = list(ranks)
        stopped = ", ".join(str(r) for r in self.ranks) or "none"
        super().__init__(f"interrupted{cause}; stopped ranks {stopped}")


class Terminated(RuntimeError):
    """SIGTERM reached the caller and the ranks did not all end cleanly (a second SIGTERM, ``term_grace_s``
    passed, or a rank was killed by it); every rank has been stopped.  ``str()`` is one line saying which."""


@dataclass
class _Job:
    procs: list
    record_dir: str
    term_grace_s: float
    terms: int = 0  # SIGTERMs received by the caller
    term_deadline: float | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for launchers that need a port number up front, such as
    ``torchrun --master-port``; :func:`spawn` lets the OS pick its store's port instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size: int, *, backend: str = "gloo", args: tuple = (), timeout_s: float | None = None,
          env: dict | None = None, threads: int | None = None, group_timeout_s: float = 60.0,
          term_grace_s: float = TERM_GRACE_S, pin_cpus: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks in one ``torch.distributed`` job.

    Args:
        fn: a module-level (importable) function; its return value must pickle.
        backend: ``"gloo"`` or ``"nccl"`` (the default process group's backend).
        timeout_s: seconds the whole job may take (None: no limit); then :class:`JobTimeout`.
        env: environment variables set in every rank before ``fn`` runs (``RANK``, ``WORLD_SIZE``,
            ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` are always set).
        threads: ``torch.set_num_threads`` per rank (default ``cpu_count // world_size``, at least 1).
        group_timeout_s: the default group's communication timeout (seconds).
        term_grace_s: seconds the ranks get to exit after a SIGTERM to the caller is forwarded to them.
        pin_cpus: pin rank ``r`` (all its threads) to CPU ``r mod cpu_count``.

    Returns: the per-rank return values, in rank order.

    Raises:
        ValueError: ``world_size < 1``.
        RankError / JobTimeout / Interrupted / Terminated: see the module docstring; every rank is gone by then.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spawn(world_size={world_size!r}): need a positive int number of ranks")
    import torch.distributed as dist
    import torch.multiprocessing as mp
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=group_timeout_s),
                          wait_for_workers=False)
    job = _Job([], tempfile.mkdtemp(prefix="pipecast-spawn-"), term_grace_s)
    setup = _RankSetup(world_size, store.port, backend, group_timeout_s, threads, pin_cpus, dict(env or {}),
                       os.getpid(), job.record_dir)
    ctx = mp.get_context("spawn")
    try:
        with _caller_sigterm(job):
            job.procs = [ctx.Process(target=_rank_main, args=(r, setup, fn, tuple(args)), name=f"rank{r}")
                         for r in range(world_size)]
            for p in job.procs:
                p.start()
            _watch(job, timeout_s)
        return [_read_result(job.record_dir, r) for r in range(world_size)]
    finally:
        _stop(job.procs)
        shutil.rmtree(job.record_dir, ignore_errors=True)
        del store


@dataclass(frozen=True)
class _RankSetup:
    world_size: int
    port: int
    backend: str
    group_timeout_s: float
    threads: int | None
    pin_cpus: bool
    env: dict
    parent_pid: int
    record_dir: str


# ---- the caller's side ------------------------------------------------------------------------------------------

class _caller_sigterm:
    """While the job runs, SIGTERM to the caller counts in ``job.terms`` (main thread only; else untouched)."""

    def __init__(self, job: _Job):
        self.job, self.previous = job, None

    def __enter__(self):
        def on_term(signum, frame):
            self.job.terms += 1
        try:
            self.previous = signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not the main thread
            self.previous = None
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _watch(job: _Job, timeout_s: float | None) -> None:
    """Wait until every rank has exited 0, or raise (after stopping the others) at the first failure."""
    from multiprocessing.connection import wait
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    first_record_seen: float | None = None
    try:
        while any(p.exitcode is None for p in job.procs):
            wait([p.sentinel for p in job.procs if p.exitcode is None], _POLL_S)
            if any(p.exitcode not in (None, 0) for p in job.procs):
                _fail(job)
            if first_record_seen is None and _records(job.record_dir):
                first_record_seen = time.monotonic()
            if first_record_seen is not None and time.monotonic() - first_record_seen > REPORT_GRACE_S:
                _fail(job)  # a rank raised but hangs in its teardown: report it anyway
            _check_term(job)
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r, p in enumerate(job.procs) if p.exitcode is None]
                _stop(job.procs)
                raise JobTimeout(running, timeout_s)
        if any(p.exitcode != 0 for p in job.procs):  # the last ranks may be reaped after the check in the loop
            _fail(job)
    except KeyboardInterrupt:
        raise Interrupted(_stop(job.procs)) from None


def _check_term(job: _Job) -> None:
    """Forward the caller's first SIGTERM to every rank; raise :class:`Terminated` on a second one or when the
    grace has passed."""
    if job.terms == 0:
        return
    if job.term_deadline is None:
        job.term_deadline = time.monotonic() + job.term_grace_s
        for p in job.procs:
            if p.exitcode is None:
                _signal(p, signal.SIGTERM)
        return
    if job.terms > 1:
        stopped = _stop(job.procs, grace=0.0)
        raise Terminated(f"terminated: a second SIGTERM arrived while the ranks were finishing; killed ranks "
                         f"{_ranks(stopped)}")
    if time.monotonic() > job.term_deadline:
        stopped = _stop(job.procs, grace=0.0)
        raise Terminated(f"terminated: the ranks did not finish within term_grace_s={job.term_grace_s:g} s of "
                         f"the SIGTERM; killed ranks {_ranks(stopped)}")


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks) or "none"


def _process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``/proc``: ``R`` running, ``S`` sleeping, ``T`` stopped, ...), or ``""``."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _fail(job: _Job) -> None:
    """Stop every rank and raise the exception for the rank to blame (see :func:`_blame`; a stopped rank a peer
    timed out waiting for is blamed before that peer)."""
    codes = [p.exitcode for p in job.procs]  # a fresh look: a rank killed by a signal may have just been reaped
    if not _killed(codes) and any(_PEER_LOST.search(rec[2]) for rec in _records(job.record_dir).values()):
        codes = _settled_codes(job.procs)  # a peer's death may be what that rank saw
    running = [r for r, c in enumerate(codes) if c is None]
    states = {r: _process_state(job.procs[r].pid) for r in running}  # before the stop wakes them
    _stop(job.procs)
    records = _records(job.record_dir)
    rank = _blame(codes, records)
    pid = job.procs[rank].pid
    stopped = [r for r in range(len(codes)) if r != rank]
    if job.terms and codes[rank] == -signal.SIGTERM:
        raise Terminated(f"terminated: rank {rank} was killed by the forwarded SIGTERM (it does not handle it); "
                         f"stopped ranks {_ranks(running)}")
    if codes[rank] == -signal.SIGINT:
        raise Interrupted(sorted(set(running) | {rank}), f" (SIGINT to rank {rank})")
    frozen = [r for r in running if r != rank and states[r] in ("T", "t")]
    timed_out = rank in records and ("timed out" in records[rank][2].lower() or "timeout" in records[rank][2].lower())
    if frozen and timed_out:  # the peer's timeout is the symptom; the stopped rank is the cause
        others = [r for r in range(len(codes)) if r != frozen[0]]
        raise RankError(frozen[0], job.procs[frozen[0]].pid, f"was stopped (process state T: SIGSTOP or Ctrl-Z) "
                        f"and rank {rank} timed out waiting for it: {records[rank][2]}", "", None, None, others,
                        True)
    if rank in records:
        _, one_line, cause, trace = records[rank]
        raise RankError(rank, pid, cause, trace or cause, codes[rank], None, stopped, one_line)
    code = codes[rank]
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        raise RankError(rank, pid, f"was killed by {name}", "", code, name, stopped)
    raise RankError(rank, pid, f"exited with status {code}", "", code, None, stopped)


def _settled_codes(procs, settle_s: float = SETTLE_S) -> list:
    """The ranks' exit codes once a rank killed by a signal shows among them, or after ``settle_s`` seconds.  A
    killed process closes its sockets before it becomes a zombie (the kernel tears down its memory in between, long
    for a big process), so a peer can raise on the closed connection and exit first: a look right then would blame
    that peer."""
    from multiprocessing.connection import wait
    deadline = time.monotonic() + settle_s
    while True:
        codes = [p.exitcode for p in procs]
        running = [p.sentinel for p, c in zip(procs, codes) if c is None]
        if not running or _killed(codes) or time.monotonic() >= deadline:
            return codes
        wait(running, max(0.0, deadline - time.monotonic()))


def _killed(codes: list) -> list[int]:
    """The ranks killed by a signal other than SIGINT (the spawner's stop signal)."""
    return [r for r, c in enumerate(codes) if c is not None and c < 0 and -c != signal.SIGINT]


def _blame(codes: list, records: dict) -> int:
    """The rank to blame: one killed by a signal other than SIGINT (the spawner's stop signal), else the rank that
    recorded the earliest raise, else the first rank that exited non-zero (``codes``: exit codes, None = was still
    running when the failure was seen; ``records``: rank -> (ns, cause, traceback))."""
    killed = _killed(codes)
    if killed:
        return killed[0]
    if records:
        return min(records, key=lambda r: (records[r][0], r))
    interrupted = [r for r, c in enumerate(codes) if c == -signal.SIGINT]
    return next((r for r, c in enumerate(codes) if c not in (None, 0)), interrupted[0] if interrupted else 0)


def _signal(proc, sig) -> None:
    try:
        os.kill(proc.pid, sig)
        os.kill(proc.pid, signal.SIGCONT)  # a stopped (SIGSTOP) rank receives the signal too
    except (ProcessLookupError, TypeError):
        pass


def _stop(procs, grace: float = STOP_GRACE_S) -> list[int]:
    """SIGINT (+ SIGCONT) every rank still running, SIGKILL those alive ``grace`` seconds later, reap them all;
    returns the ranks that had not finished cleanly (exit status 0).  A SIGINT meanwhile is ignored."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        previous = None
    try:
        stopped = [r for r, p in enumerate(procs) if p.exitcode != 0]
        for p in procs:
            if p.exitcode is None:
                _signal(p, signal.SIGINT)
        deadline = time.monotonic() + grace
        for p in procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
                p.join()
        return stopped
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _records(record_dir: str) -> dict[int, tuple[int, bool, str, str]]:
    """rank -> (ns when it raised, whether the cause is the whole report, one-line cause, traceback) of every rank
    that recorded a failure."""
    out = {}
    for name in os.listdir(record_dir):
        if not (name.startswith("failed_") and name[7:].isdigit()):
            continue
        try:
            with open(os.path.join(record_dir, name), encoding="utf-8") as fh:
                stamp, one_line, cause, trace = fh.read().split("\n", 3)
            out[int(name[7:])] = (int(stamp), one_line == "1", cause, trace)
        except (OSError, ValueError):
            continue
    return out


def _read_result(record_dir: str, rank: int):
    try:
        with open(os.path.join(record_dir, f"result_{rank}"), "rb") as fh:
            return pickle.load(fh)  # noqa: S301 - written by our own child process
    except FileNotFoundError:
        return None


# ---- the rank's side --------------------------------------------------------------------------------------------

def _rank_main(rank: int, setup: _RankSetup, fn, args: tuple) -> None:
    """Process entry of rank ``rank``: join the job, run ``fn``, record the result or the failure, tear down."""
    _die_with_parent(setup.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the spawner's stop signal ends a rank at once, quietly
    os.environ.update(setup.env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(setup.port), RANK=str(rank),
                      WORLD_SIZE=str(setup.world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(setup.world_size))
    if setup.pin_cpus:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    import torch
    import torch.distributed as dist
    torch.set_num_threads(setup.threads or max(1, (os.cpu_count() or 1) // setup.world_size))
    _warn_once_per_job(setup.record_dir)
    ok = False
    try:
        timeout = datetime.timedelta(seconds=setup.group_timeout_s)
        store = dist.TCPStore("127.0.0.1", setup.port, None, False, timeout=timeout)
        dist.init_process_group(setup.backend, store=store, rank=rank, world_size=setup.world_size,
                                timeout=timeout)
        result = fn(rank, setup.world_size, *args)
        _write(setup.record_dir, f"result_{rank}", pickle.dumps(result))
        ok = True
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        one_line = int(not needs_traceback(exc))
        text = f"{time.time_ns()}\n{one_line}\n{describe_exception(exc)}\n{traceback.format_exc()}"
        _write(setup.record_dir, f"failed_{rank}", text.encode())
    finally:
        teardown(ok)
    exit_process(0 if ok else 1)


def _warn_once_per_job(record_dir: str) -> None:
    """Show each distinct Python warning (category, text, file and line) once per job: the first rank to emit it
    claims it with an exclusive marker file in the job's record folder; the other ranks stay quiet about it."""
    import hashlib
    import warnings
    show = warnings.showwarning

    def once(message, category, filename, lineno, file=None, line=None):
        key = hashlib.sha1(f"{category.__name__}|{message}|{filename}|{lineno}".encode()).hexdigest()[:20]
        try:
            os.close(os.open(os.path.join(record_dir, f"warned_{key}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        except OSError:
            pass  # no record folder: show it
        show(message, category, filename, lineno, file, line)
    warnings.showwarning = once


def exit_process(code: int) -> None:
    """End this process with status ``code`` the way ``sys.exit`` would, minus interpreter finalization.

    Joins the non-daemon threads, runs the ``atexit`` handlers, flushes ``logging`` and the standard streams,
    then ``os._exit(code)``.  Finalization is skipped on purpose: a thread still inside torch when it starts (a
    daemon thread mid-op, a gloo worker releasing a finished work) aborts the process while re-taking the GIL, so a
    rank whose work succeeded would be reported killed by SIGABRT.  Used by every spawned rank and by ``pipecast
    train`` / ``tune`` under torchrun (``engine.cli.entry``).  Does not return.
    """
    import atexit
    import logging
    import threading
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)


def teardown(ok: bool) -> None:
    """Destroy the default group (if initialised).  After a successful run (``ok``) first a barrier, so no rank
    destroys its groups while a peer still communicates; after a failure no barrier (the peers may be gone; the
    spawner stops them).  Every spawned rank runs it; ``pipecast train`` under torchrun too."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    try:
        if ok and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _write(record_dir: str, name: str, data: bytes) -> None:
    path = os.path.join(record_dir, name)
    with open(path + ".tmp", "wb") as fh:
        fh.write(data)
    os.replace(path + ".tmp", path)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this rank when the spawning process dies (no orphaned ranks)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def describe_exception(exc: BaseException, limit: int = 1000) -> str:
    """One line for ``exc``: ``Type: first line of its message``, then, when an operating-system error lies under
    it (its ``__cause__`` / ``__context__`` chain, or the per-rank failures of a DCP ``CheckpointException``) and
    the line does not already say it, `` (OSError: [Errno 28] No space left on device: 'path')``."""
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    os_error = os_error_under(exc)
    if os_error is not None and (os_error.strerror or str(os_error)) not in line:
        line += f" ({type(os_error).__name__}: {os_error})"
    return line if len(line) <= limit else line[:limit - 3] + "..."


MACHINE_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "EFBIG",
                                                       "EIO", "ENAMETOOLONG") if hasattr(errno, n))
"""Operating-system errors about the machine rather than the code: a full, read-only or failing disk, a quota,
a permission, a path too long."""


def needs_traceback(exc: BaseException) -> bool:
    """Whether a failure is reported with its traceback.  Not when its one line (:func:`describe_exception`) is
    the whole report: an exception whose class says so (``one_line = True``: an error whose message names the
    field or file, the value and the fix, e.g. ``engine.training``'s ``ConfigError``, ``CheckpointError``,
    ``WriteError``), or one with an operating-system error about the machine (:data:`MACHINE_ERRNOS`) under it
    -- a traceback there shows where the write was, not what to do."""
    if getattr(exc, "one_line", False):
        return False
    found = os_error_under(exc)
    return found is None or found.errno not in MACHINE_ERRNOS


def os_error_under(exc: BaseException, depth: int = 0) -> OSError | None:
    """The operating-system error (an ``OSError`` with an ``errno``) that ``exc`` is or wraps -- through its
    ``__cause__`` / ``__context__`` chain or the per-rank failures of a DCP ``CheckpointException`` -- or None."""
    if depth > 8 or exc is None:
        return None
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc
    for wrapped in (getattr(exc, "failures", None) or {}).values():  # DCP: rank -> (exception, traceback)
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            found = os_error_under(inner, depth + 1)
            if found is not None:
                return found
    return os_error_under(exc.__cause__ or exc.__context__, depth + 1)
