"""``pipecast train CONFIG [--section.key=value ...] [--resume]``: start or join a training job.

* Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` set, any number of nodes) every process joins the
  job: ``init_process_group`` (NCCL on CUDA, gloo on CPU) and trains.
* Otherwise it spawns ``parallel.pipeline x parallel.data`` local ranks itself (``torch.multiprocessing``, rendezvous
  on 127.0.0.1), each with ``cpu_count // ranks`` threads; a one-rank config runs in this process.

The config is loaded and validated before any process is started or group created (and before torch is imported,
so it takes well under a second): a bad config exits with status 2 and one ``error:`` line.  :func:`spawn` is the
same launcher for Python code (the README example).

The data is checked the same way before any rank starts (:func:`engine.training.data.check_data`: files exist,
not empty, each split long enough, ``.bin`` files whole uint16 tokens, token ids below ``model.vocab_size``);
under torchrun every process checks it.

Failure behaviour of spawned ranks: the launcher watches every rank; when one raises or dies (e.g. SIGKILL) it stops
the others (SIGTERM, then SIGKILL) and ``pipecast train`` exits with status 1 and an ``error:`` line naming the
failed rank and its exception (type and first line; the rank's traceback follows).  Ranks also die with the
launcher (``PR_SET_PDEATHSIG`` on Linux), so killing it leaves no rank behind.  A rank that is alive but stuck is
caught by the communication timeout ``parallel.timeout_s``.

Interrupts: SIGINT / Ctrl-C to the launcher stops every rank (SIGTERM, then SIGKILL after
:data:`STOP_GRACE_S`) and ``pipecast train`` exits with status 130 after one line ``interrupted; stopped ranks
...``.  A rank that receives SIGINT itself (Ctrl-C reaches the whole process group) ends at once without a
traceback, and the launcher reports the interrupt the same way.

Teardown: after ``fn`` returns, every rank waits at a barrier of the default group before destroying it, so that
no rank tears down its process groups while a peer is still communicating; in a spawned job rank 0, which hosts
the rendezvous store, then tears down and exits last (see :func:`_teardown`).
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import socket
import sys
import time

from .config import (ConfigError, TrainConfig, check_fresh_run, load_config, parse_override_args,
                     validate_world_size)

__all__ = ["add_arguments", "run", "run_spawned", "spawn", "train_worker", "under_torchrun", "Interrupted"]

log = logging.getLogger("pipecast.train")

STOP_GRACE_S = 5.0  # seconds a rank has to exit after SIGTERM before the launcher sends SIGKILL


class Interrupted(KeyboardInterrupt):
    """:func:`spawn` was interrupted (SIGINT to the launcher, or to one of its ranks); every rank has been stopped.
    ``str()`` is the one line ``pipecast train`` prints; ``ranks`` lists the stopped ranks."""

    def __init__(self, ranks: list[int], cause: str = ""):
        self.ranks = list(ranks)
        stopped = ", ".join(str(r) for r in self.ranks) or "none"
        super().__init__(f"interrupted{cause}; stopped ranks {stopped}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (e.g. configs/default.yaml)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint in checkpoint.dir (fresh start if none)")
    parser.add_argument("--timeline", metavar="DIR", default=None,
                        help="record every rank's timeline; write a Chrome/Perfetto trace, a Gantt chart and the "
                             "measured vs simulated bubble to DIR")
    parser.add_argument("--nvtx", action="store_true", help="NVTX ranges per action / P2P call (for nsys)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (file + overrides, validated) as YAML and exit")
    from .config_help import help_text
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("Override any config field with --section.key=value, e.g. --schedule.steps=50 "
                     "--parallel.pipeline=4. Under torchrun each process joins the job; otherwise the configured "
                     "number of local ranks is spawned.\n\n" + help_text())


def under_torchrun() -> bool:
    """True when started by torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def run(args: argparse.Namespace) -> int:
    """Entry point of ``pipecast train``; returns the exit status (0 ok, 1 a rank failed, 2 bad config or data,
    130 interrupted)."""
    try:
        try:
            config = load_config(args.config, parse_override_args(list(getattr(args, "extra", []) or [])))
            if under_torchrun():
                config = validate_world_size(config, int(os.environ["WORLD_SIZE"]))
            if getattr(args, "print_config", False):
                return _print_config(config)
            from .data import check_data
            check_data(config)
            check_fresh_run(config, bool(args.resume))
            from ..runtime import gloo_io
            gloo_io.check_environment()
        except (ConfigError, TypeError, ValueError, RuntimeError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if under_torchrun():
            return _join_torchrun(config, args.resume, args.timeline, args.nvtx)
        return run_spawned(train_worker, config, args.resume, args.timeline, args.nvtx)
    except KeyboardInterrupt:  # before the ranks started, or a one-rank run in this process
        print("interrupted", file=sys.stderr)
        return 130


def _print_config(config: TrainConfig) -> int:
    """``--print-config``: the resolved config as YAML on stdout (``parallel.data`` filled in); exit status 0."""
    import yaml
    from .config import config_to_dict
    resolved = config if under_torchrun() else validate_world_size(config, config.world_size)
    sys.stdout.write(yaml.safe_dump(config_to_dict(resolved), sort_keys=False))
    return 0


def run_spawned(fn, config: TrainConfig, *args) -> int:
    """:func:`spawn` ``fn(config, *args)`` and turn a failure into an exit status and one ``error:`` line on stderr
    (1: a rank raised or died, named with its error; 2: bad config / checkpoint in a one-rank run; 130:
    interrupted, with the line ``interrupted; stopped ranks ...``)."""
    import torch.multiprocessing as mp
    from .checkpoint import CheckpointError
    # the launcher's own lines name the failed rank and the stopped ones; torch's "Terminating process ..." adds none
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        spawn(fn, config, *args)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        print(f"error: {_describe_failure(exc, config.world_size)}", file=sys.stderr)
        return 1
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(str(exc) if isinstance(exc, Interrupted) else "interrupted", file=sys.stderr)
        return 130
    return 0


def _describe_failure(exc, world: int) -> str:
    """One line naming the failed rank and what happened, then (for a raise) the rank's traceback."""
    import torch.multiprocessing as mp
    rank = exc.error_index
    others = ", ".join(str(r) for r in range(world) if r != rank) or "none"
    stopped = f"the launcher stopped the other ranks ({others})"
    if isinstance(exc, mp.ProcessExitedException):
        how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with status {exc.exit_code}"
        return f"rank {rank} (pid {exc.error_pid}) {how}; {stopped}"
    trace = str(exc).strip()
    return f"rank {rank} failed: {exception_line(trace)}; {stopped}\n{trace}"


_CHAIN_LINES = ("During handling of the above exception, another exception occurred:",
                "The above exception was the direct cause of the following exception:")


def exception_line(trace: str, limit: int = 1000) -> str:
    """``"Type: first line of the message"`` of the exception that ended a formatted traceback (the last one of
    a chain), never traceback text: the exception line is the first unindented line after a ``Traceback`` header,
    and the message runs to the next chain separator, so a multi-line message (or one quoting another traceback)
    still gives its own first line.  The type is given without its module; ``limit`` caps the length."""
    lines = trace.splitlines()
    found, i = None, 0
    while i < len(lines):
        if lines[i].strip() == "Traceback (most recent call last):":
            j = i + 1
            while j < len(lines) and (not lines[j] or lines[j][0].isspace()):
                j += 1  # frames and source lines are indented
            if j < len(lines):
                found = j
            i = j + 1
            while i < len(lines) and lines[i].strip() not in _CHAIN_LINES:
                i += 1  # the rest of this exception's message
        else:
            i += 1
    if found is None:  # no traceback: the last unindented line (where Python puts the exception)
        text = next((ln.strip() for ln in reversed(lines) if ln.strip() and not ln[0].isspace()), "")
        return text[:limit] or "unknown error"
    head, message = lines[found], lines[found + 1:]
    kind, sep, first = head.partition(": ")
    kind = kind.rsplit(".", 1)[-1] if " " not in kind else kind
    first = first.strip()
    if not first:  # the message starts on the next line
        first = next((ln.strip() for ln in message if ln.strip() and ln.strip() not in _CHAIN_LINES), "")
    line = f"{kind}: {first}" if first else kind
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _backend(config: TrainConfig) -> str:
    import torch
    p = config.parallel
    if p.backend != "auto":
        return p.backend
    cuda = p.device == "cuda" or (p.device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def _join_torchrun(config: TrainConfig, resume: bool, timeline=None, nvtx: bool = False) -> int:
    import torch.distributed as dist
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends this rank at once, quietly (torchrun reports it)
    dist.init_process_group(_backend(config), timeout=datetime.timedelta(seconds=config.parallel.timeout_s))
    ok = False
    try:
        train_worker(config, resume, timeline, nvtx)
        ok = True
    finally:
        _teardown(ok)
    return 0


def _teardown(ok: bool, store=None) -> None:
    """Destroy the default group.  After a successful ``fn``: first wait for every rank at a barrier, so that no
    rank destroys its groups while a peer is still communicating; then, with the rendezvous ``store`` of a spawned
    job, the rank that hosts it (rank 0) destroys its groups and exits last, once every peer has torn down (each
    peer marks ``teardown/<rank>`` in the store; rank 0 waits for those marks up to 30 s).  After a failure there
    is no barrier (the peers may be gone; the launcher stops them)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    ordered = ok and store is not None and world > 1
    try:
        if ok and world > 1:
            dist.barrier()
        if ordered and rank == 0:
            try:
                store.wait([f"teardown/{r}" for r in range(1, world)], datetime.timedelta(seconds=30))
            except RuntimeError:  # a peer died after the barrier: nothing left to order
                pass
    finally:
        dist.destroy_process_group()
    if ordered and rank != 0:
        store.set(f"teardown/{rank}", "1")


def train_worker(config: TrainConfig, resume: bool = False, timeline=None, nvtx: bool = False) -> None:
    """What every rank runs: build the :class:`~engine.training.trainer.Trainer`, optionally resume, train
    (with ``engine.profiling`` around the steps when ``timeline`` / ``nvtx`` / ``profile.enabled`` ask for it)."""
    from ..profiling.session import TrainerProfiling
    from .trainer import Trainer
    t0 = time.perf_counter()
    with Trainer(config) as trainer:
        if resume and trainer.load() is None and trainer.is_log_rank:
            log.info("--resume: no checkpoint in %s; starting from step 0", config.checkpoint_dir)
        with TrainerProfiling(trainer, timeline, nvtx):
            trainer.train()
        if trainer.is_log_rank and trainer.val_history:
            first, last = trainer.val_history[0][1], trainer.val_history[-1][1]
            log.info("done: step %d in %.1f s | val loss %.4f -> %.4f (%.1f%% lower)", trainer.step,
                     time.perf_counter() - t0, first, last, 100 * (1 - last / first) if first == first else 0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_launcher(launcher_pid: int) -> None:
    """Ask Linux to SIGKILL this rank when the launcher process dies (no orphaned ranks after ``kill <launcher>``)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher_pid:  # the launcher died before the request took effect
        os._exit(1)


def _record_failure(failure_dir: str, rank: int) -> None:
    """Write this rank's traceback with the time it raised to ``failure_dir/rank_<rank>`` (before its process groups
    close, so the launcher can tell the rank that failed first from peers that failed because it went away)."""
    import traceback
    path = os.path.join(failure_dir, f"rank_{rank}")
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(f"{time.time_ns()}\n{traceback.format_exc()}")
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _first_failure(failure_dir: str) -> tuple[int, str] | None:
    """``(rank, traceback)`` of the rank that recorded the earliest failure in ``failure_dir``, or None."""
    first = None
    for name in os.listdir(failure_dir):
        if not (name.startswith("rank_") and name[5:].isdigit()):
            continue
        try:
            with open(os.path.join(failure_dir, name), encoding="utf-8") as fh:
                stamp, _, trace = fh.read().partition("\n")
            key = (int(stamp), int(name[5:]))
        except (OSError, ValueError):
            continue
        if first is None or key < first[0]:
            first = (key, trace)
    return None if first is None else (first[0][1], first[1])


def _blame_first_failure(context, exc, failure_dir: str) -> None:
    """If another rank raised before the reported one (which then failed on the closed connection), report it."""
    import torch.multiprocessing as mp
    first = _first_failure(failure_dir)
    if first is None or first[0] == exc.error_index:
        return
    rank, trace = first
    raise mp.ProcessRaisedException(f"\n\n-- Process {rank} terminated with the following error:\n{trace}", rank,
                                    context.processes[rank].pid) from exc


def _entry(local_rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn, args,
           launcher_pid: int = 0, failure_dir: str = "") -> None:
    import torch
    import torch.distributed as dist
    if launcher_pid:
        _die_with_launcher(launcher_pid)
    # SIGINT (Ctrl-C reaches the whole process group) ends a rank at once without a traceback; the launcher, which
    # gets it too, stops the others and reports the interrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    timeout = datetime.timedelta(seconds=timeout_s)
    # the rendezvous store is made here (rank 0 hosts it) so that the teardown can order the exits through it
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=local_rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=local_rank, world_size=world_size, timeout=timeout)
    ok = False
    try:
        fn(*args)
        ok = True
    except Exception:
        if failure_dir:
            _record_failure(failure_dir, local_rank)
        raise
    finally:
        _teardown(ok, store)


def spawn(fn, config: TrainConfig, *args) -> None:
    """Run ``fn(config, *args)`` on ``config.world_size`` local ranks with torch.distributed initialised.

    ``fn`` must be importable (a module-level function).  A one-rank config runs in this process.  When a rank
    raises or dies, the others are terminated (SIGTERM, then SIGKILL) and
    ``torch.multiprocessing.ProcessRaisedException`` / ``ProcessExitedException`` is raised here; its
    ``error_index`` is the failed rank: a rank killed by a signal is preferred over ranks that merely lost it, and
    of the ranks that raised, the one that raised first (each records the time before closing its groups).
    On SIGINT (``KeyboardInterrupt`` here, or a rank ended by SIGINT) every rank is stopped (SIGTERM, then SIGKILL
    after :data:`STOP_GRACE_S`) and :class:`Interrupted` (a ``KeyboardInterrupt``) is raised.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp
    world = config.world_size
    backend = _backend(config)
    if world == 1 and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=config.parallel.timeout_s))
        try:
            fn(config, *args)
        finally:
            dist.destroy_process_group()
        return
    import shutil
    import tempfile
    failure_dir = tempfile.mkdtemp(prefix="pipecast-failures-")
    context = mp.start_processes(_entry, args=(world, _free_port(), backend, config.parallel.timeout_s, fn,
                                               (config, *args), os.getpid(), failure_dir),
                                 nprocs=world, join=False, start_method="spawn")
    try:
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException as exc:
            _blame_killed_rank(context, exc)
            _blame_first_failure(context, exc, failure_dir)
            raise
    except KeyboardInterrupt:
        raise Interrupted(_stop_ranks(context.processes)) from None
    except mp.ProcessExitedException as exc:
        if exc.signal_name != "SIGINT":
            raise
        stopped = _stop_ranks(context.processes)
        raise Interrupted(sorted(set(stopped) | {exc.error_index}),
                          f" (SIGINT to rank {exc.error_index})") from None
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)


def _stop_ranks(processes, grace: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM every rank still running, SIGKILL those alive ``grace`` seconds later, and reap them all; returns
    the ranks that had not finished cleanly (exit status 0) when called.  A second SIGINT meanwhile is ignored."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        previous = None
    try:
        stopped = [r for r, p in enumerate(processes) if p.exitcode != 0]
        for p in processes:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join()
        return stopped
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _blame_killed_rank(context, exc) -> None:
    """If the reported rank raised only because another rank was killed by a signal (its peer connection closed),
    report the killed rank instead.  Ranks stopped by the launcher exit by SIGTERM and are not blamed."""
    import signal
    import torch.multiprocessing as mp
    for rank, proc in enumerate(context.processes):
        code = proc.exitcode
        if rank != exc.error_index and code is not None and code < 0 and -code != signal.SIGTERM:
            name = signal.Signals(-code).name
            raise mp.ProcessExitedException(f"process {rank} terminated with signal {name}", error_index=rank,
                                            error_pid=proc.pid, exit_code=code, signal_name=name) from exc
