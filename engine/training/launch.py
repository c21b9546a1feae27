"""``pipecast train CONFIG [--section.key=value ...] [--resume]``: start or join a training job.

* Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` set, any number of nodes) every process joins the
  job: ``init_process_group`` (NCCL on CUDA, gloo on CPU) and trains.
* Otherwise it spawns ``parallel.pipeline x parallel.data x parallel.tensor`` local ranks itself
  (:func:`engine.runtime.spawn.spawn`, rendezvous on 127.0.0.1), each with ``cpu_count // ranks`` threads; a
  one-rank config runs in this process.

The config is loaded and validated before any process is started or group created (and before torch is imported,
so it takes well under a second): a bad config exits with status 2 and one ``error:`` line.  :func:`launch_ranks` is
the same launcher for Python code (the README example).

Each rank's memory is estimated before any rank starts (:func:`.memory.check_memory`: parameters, gradients,
optimizer state, activations in flight from the plan): a run that cannot fit the host's available memory (all local
ranks) or a GPU exits 2 naming the estimate, its parts and what to change (``training.check_memory: false`` skips).

The data is checked the same way before any rank starts (:func:`engine.training.data.corpus.check_data`: files exist,
not empty, each split long enough, ``.bin`` files whole uint16 tokens, token ids below ``model.vocab_size``);
under torchrun every process checks it.

Before any rank starts, every output path the run writes (``logging.run_dir``, ``checkpoint.dir``, ``--timeline``)
is checked and the optional packages it needs are looked up (:func:`.outputs.check_outputs`), and the run folder
and checkpoint folder are locked (:func:`.outputs.run_lock`): a second run into them exits 2 naming the holder's
pid.

Failures (the ranks are started by :func:`engine.runtime.spawn.spawn`, which documents the rules): when a rank
raises or dies the launcher stops the others and ``pipecast train`` prints the rank's traceback, then one
``error:`` line naming the rank that failed first and its cause, and exits 1.  A rank that is alive but stuck (or
stopped) is caught by the communication timeout ``parallel.timeout_s``: the peer's timeout error naming it is
reported within ``parallel.timeout_s + REPORT_GRACE_S`` (2 s) plus the stop.  No rank outlives the launcher.

Signals: SIGINT / Ctrl-C stops every rank at once and exits 130 after one line ``interrupted; stopped ranks ...``.
SIGTERM (what a cluster scheduler sends; to the launcher, which forwards it, or to any rank) makes every rank
finish its current step and save a checkpoint; ``pipecast train`` then exits :data:`EXIT_PREEMPTED` (143) after
one line ``preempted: SIGTERM; saved checkpoint of step N in PATH ...``, and ``--resume`` continues exactly.
A second SIGTERM to the launcher during the save (or the save running past
:data:`engine.runtime.spawn.TERM_GRACE_S`) kills the ranks: exit 143 with an ``error: terminated: ...`` line
naming the latest complete checkpoint, which the atomic save leaves intact.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import math
import os
import signal
import sys
import time

from ..runtime.spawn import STOP_GRACE_S, Interrupted, RankError, Terminated, needs_traceback, teardown
from .config import (ConfigError, TrainConfig, check_fresh_run, load_config, parse_override_args, validate,
                     validate_world_size)
from .tune.result import resolve_tuned

__all__ = ["add_arguments", "run", "run_spawned", "print_rank_error", "launch_ranks", "train_worker", "summary_line",
           "under_torchrun", "Interrupted", "EXIT_PREEMPTED", "STOP_GRACE_S"]

log = logging.getLogger("pipecast.train")

EXIT_PREEMPTED = 143  # 128 + SIGTERM: the run was stopped by SIGTERM (after saving a checkpoint when it could)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (e.g. configs/default.yaml)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest intact checkpoint in checkpoint.dir (fresh start if none; "
                             "newer broken ones -- a file missing, truncated or failing its checksum -- are named "
                             "and skipped), or from the step --checkpoint.load_step=N names")
    parser.add_argument("--timeline", metavar="DIR", default=None,
                        help="record every rank's timeline; write a Chrome/Perfetto trace, a Gantt chart and the "
                             "measured vs simulated bubble to DIR")
    parser.add_argument("--nvtx", action="store_true", help="NVTX ranges per action / P2P call (for nsys)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (file + overrides, validated) as YAML and exit")
    from .config.help import help_text
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG + help_text()
    for container in (parser, parser._optionals):  # replace argparse's own -h / --help by _ConfigHelp
        container.conflict_handler = "resolve"
    parser.add_argument("-h", "--help", action=_ConfigHelp, nargs=0,
                        help="show this help (with CONFIG: the values a run of CONFIG and the overrides would use) "
                             "and exit")


_EPILOG = ("Override any config field with --section.key=value, e.g. --training.steps=50 --parallel.pipeline=4. "
           "Under torchrun each process joins the job; otherwise the configured number of local ranks is spawned.\n\n")


class _ConfigHelp(argparse.Action):
    """``--help``: without a config given before it, argparse's help with the built-in defaults; after
    ``CONFIG``, the help is printed by :func:`run` once the overrides are parsed too (:func:`_print_help`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "config", None) is None:
            parser.print_help()
            parser.exit()
        namespace.help_parser = parser


def _print_help(args: argparse.Namespace) -> int:
    """``pipecast train CONFIG [--section.key=value ...] --help``: the help with the values a run would use (the
    file after the overrides, validated); exit status 0, or 2 with one ``error:`` line for a bad config."""
    from .config.help import help_text
    try:
        config = load_config(args.config, parse_override_args(list(getattr(args, "extra", []) or [])))
    except (ConfigError, TypeError, ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser = args.help_parser
    parser.epilog = _EPILOG + help_text(config=config, source=args.config)
    parser.print_help()
    return 0


def under_torchrun() -> bool:
    """True when started by torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def run(args: argparse.Namespace) -> int:
    """Entry point of ``pipecast train``; returns the exit status (0 ok, 1 a rank failed, 2 bad config, data or
    output path, or the run folder is locked by another run; 130 interrupted; 143 stopped by SIGTERM)."""
    if getattr(args, "help_parser", None) is not None:
        return _print_help(args)
    try:
        with contextlib.ExitStack() as held:
            try:
                config = resolve_tuned(load_config(args.config,
                                                   parse_override_args(list(getattr(args, "extra", []) or []))))
                if under_torchrun():  # parallel.data from the job's world size: validate the config that runs
                    config = validate_world_size(config, int(os.environ["WORLD_SIZE"]))
                    validate(config)
                if getattr(args, "print_config", False):
                    return _print_config(config)
                from .checkpoint.init_from import check_init_weights
                from .data.corpus import check_data
                check_data(config)
                check_init_weights(config)
                from .outputs import check_outputs, run_lock
                check_outputs(config, args.timeline)
                if not under_torchrun():  # locked before torch is imported: a second run is refused at once
                    held.enter_context(run_lock(config))
                check_fresh_run(config, bool(args.resume))
                if args.resume:  # a resume that would continue another trajectory is refused here (warnings: ranks)
                    from .checkpoint.resume import check_resume
                    check_resume(config, ConfigError)
                from ..runtime import gloo_io
                gloo_io.check_environment()
                from .memory import check_memory  # refuses a run that cannot fit this machine
                torchrun = under_torchrun()
                check_memory(config, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if torchrun else None,
                             own_device=int(os.environ.get("LOCAL_RANK", 0)) if torchrun else None)
            except (ConfigError, TypeError, ValueError, RuntimeError, OSError) as exc:
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
    """:func:`launch_ranks` ``fn(config, *args)`` and turn the outcome into an exit status and one line on stderr.

    0: done.  1: a rank raised or died (``error: rank R failed: Type: message; ...``, after the rank's traceback
    unless that line is the whole report: a full disk, :func:`print_rank_error`; a one-rank run's such error: its
    line alone).
    2: bad config / checkpoint in a one-rank run, or the run folder is locked by another run.  130: interrupted
    (``interrupted; stopped ranks ...``).  :data:`EXIT_PREEMPTED` (143): stopped by SIGTERM -- ``preempted:
    saved checkpoint of step N ...`` when every rank saved (``fn`` returned :func:`preempted_result` dicts), else
    ``error: terminated: ...`` (the previous checkpoint stays intact: saves are atomic).
    """
    from .checkpoint.dcp import CheckpointError
    try:
        results = launch_ranks(fn, config, *args)
    except RankError as exc:
        print_rank_error(exc)
        return 1
    except Terminated as exc:
        print(f"error: {exc}; {_previous_checkpoint(config)}", file=sys.stderr)
        return EXIT_PREEMPTED
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(str(exc) if isinstance(exc, Interrupted) else "interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a one-rank run in this process: a full disk is one line, as from a spawned rank
        if needs_traceback(exc):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _preempted_status(results)


def print_rank_error(exc: RankError) -> None:
    """The report of a failed rank on stderr: its traceback (unless the cause is the whole report:
    ``exc.one_line``, a full disk or a bad config), then the one ``error:`` line."""
    if exc.traceback and not exc.one_line:
        print(exc.traceback.rstrip(), file=sys.stderr)
    print(f"error: {exc}", file=sys.stderr)


def preempted_result(step: int, path) -> dict:
    """What :func:`train_worker` returns when SIGTERM stopped the run after saving step ``step`` to ``path``."""
    return {"preempted": True, "step": int(step), "checkpoint": str(path)}


def _preempted_status(results) -> int:
    """0, or :data:`EXIT_PREEMPTED` after printing the one ``preempted:`` line when the ranks saved on SIGTERM."""
    done = [r for r in (results or []) if isinstance(r, dict) and r.get("preempted")]
    if not done:
        return 0
    print(f"preempted: SIGTERM; saved checkpoint of step {done[0]['step']} in {done[0]['checkpoint']} on every "
          f"rank; continue with --resume", file=sys.stderr)
    return EXIT_PREEMPTED


def _previous_checkpoint(config: TrainConfig) -> str:
    from .checkpoint.dcp import latest_checkpoint
    last = latest_checkpoint(config.checkpoint_dir)
    return (f"the latest complete checkpoint is {last} (--resume continues from it)" if last is not None
            else f"no checkpoint in {config.checkpoint_dir}")


def _backend(config: TrainConfig) -> str:
    import torch
    p = config.parallel
    if p.backend != "auto":
        return p.backend
    cuda = p.device == "cuda" or (p.device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def _join_torchrun(config: TrainConfig, resume: bool, timeline=None, nvtx: bool = False) -> int:
    import torch.distributed as dist
    from .outputs import run_lock
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends this rank at once, quietly (torchrun reports it)
    lock = run_lock(config) if int(os.environ["RANK"]) == 0 else contextlib.nullcontext()
    with lock:  # global rank 0 holds the run's lock (a second run's rank 0 exits 2; torchrun stops its peers)
        dist.init_process_group(_backend(config), timeout=datetime.timedelta(seconds=config.parallel.timeout_s))
        ok = False
        try:
            result = train_worker(config, resume, timeline, nvtx)
            ok = True
        finally:
            teardown(ok)
    return _preempted_status([result]) if int(os.environ["RANK"]) == 0 else (
        EXIT_PREEMPTED if result else 0)


def train_worker(config: TrainConfig, resume: bool = False, timeline=None, nvtx: bool = False) -> dict | None:
    """What every rank runs: build the :class:`~engine.training.trainer.Trainer`, optionally resume, train
    (with ``engine.profiling`` around the steps when ``timeline`` / ``nvtx`` / ``profile.enabled`` ask for it).
    Returns None, or :func:`preempted_result` when SIGTERM stopped the run after a checkpoint."""
    from ..profiling.session import TrainerProfiling
    from .trainer import Trainer
    t0 = time.perf_counter()
    with Trainer(config) as trainer:
        if resume and trainer.load() is None and trainer.is_log_rank:
            log.info("--resume: no checkpoint in %s; starting from step 0", config.checkpoint_dir)
        with TrainerProfiling(trainer, timeline, nvtx):
            trainer.train()
        if trainer.is_log_rank and trainer.val_history:
            log.info("%s", summary_line(trainer.step, time.perf_counter() - t0, trainer.val_history,
                                        trainer.preempted is not None))
        if trainer.preempted is not None:
            return preempted_result(trainer.step, trainer.preempted)
    return None


def summary_line(step: int, seconds: float, val_history: list[tuple[int, float]], preempted: bool = False) -> str:
    """The run's last log line: ``done: step N in T s | val loss A -> B (x% lower)`` over this run's evaluations
    ``val_history`` (``(step, loss)``, first at the run's start).  With one evaluation only -- SIGTERM stopped the
    run before the next, or no step reached one -- there is nothing to compare: the line gives that loss, its step
    and why no later one exists."""
    head = f"{'stopped (SIGTERM)' if preempted else 'done'}: step {step} in {seconds:.1f} s"
    (first_step, first), (last_step, last) = val_history[0], val_history[-1]
    if last_step == first_step:
        why = "stopped by SIGTERM before the next evaluation" if preempted else "no evaluation since"
        return f"{head} | val loss {first:.4f} at step {first_step} ({why}; training.eval_interval sets how often)"
    change = (f"{100 * (1 - last / first):.1f}% lower" if last <= first else f"{100 * (last / first - 1):.1f}% higher") \
        if first > 0 and math.isfinite(first) and math.isfinite(last) else "no ratio"
    return f"{head} | val loss {first:.4f} -> {last:.4f} ({change})"


def _train_rank(rank: int, world_size: int, fn, config: TrainConfig, *args):
    """What :func:`launch_ranks` runs in each rank: ``fn(config, *args)`` (the rank is in ``torch.distributed``)."""
    return fn(config, *args)


def launch_ranks(fn, config: TrainConfig, *args):
    """Run ``fn(config, *args)`` on ``config.world_size`` local ranks with torch.distributed initialised; returns
    the per-rank return values.

    ``fn`` must be importable (a module-level function).  A one-rank config runs in this process.  The ranks are
    started by :func:`engine.runtime.spawn.spawn` (its failure behaviour: one exception with a one-line message,
    :class:`~engine.runtime.spawn.RankError` naming the first failing rank and its cause, no rank left behind).
    While the job runs, the run folder and the checkpoint folder are locked (:func:`.outputs.run_lock`).

    Raises:
        RankError / Interrupted / Terminated: from :func:`engine.runtime.spawn.spawn`.
        ConfigError: another run holds the run folder's or checkpoint folder's lock.
    """
    from .outputs import check_outputs, run_lock
    check_outputs(config)
    with run_lock(config):
        import torch.distributed as dist
        from ..runtime.spawn import spawn as spawn_ranks
        if config.world_size == 1 and not dist.is_initialized():
            dist.init_process_group(_backend(config), store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=config.parallel.timeout_s))
            try:
                return [fn(config, *args)]
            finally:
                dist.destroy_process_group()
        return spawn_ranks(_train_rank, config.world_size, backend=_backend(config), args=(fn, config, *args),
                           group_timeout_s=config.parallel.timeout_s)
