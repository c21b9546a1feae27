"""``pipecast train CONFIG [--section.key=value ...] [--resume]``: start or join a training job.

* Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` set, any number of nodes) every process joins the
  job: ``init_process_group`` (NCCL on CUDA, gloo on CPU) and trains.
* Otherwise it spawns ``parallel.pipeline x parallel.data`` local ranks itself (``torch.multiprocessing``, rendezvous
  on 127.0.0.1), each with ``cpu_count // ranks`` threads; a one-rank config runs in this process.

The config is loaded and validated before any process is started or group created: a bad config exits with
status 2 and one ``error:`` line.  :func:`spawn` is the same launcher for Python code (the README example).
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .checkpoint import CheckpointError
from .config import ConfigError, TrainConfig, load_config, parse_override_args, validate_world_size

__all__ = ["add_arguments", "run", "spawn", "train_worker", "under_torchrun"]

log = logging.getLogger("pipecast.train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (e.g. configs/default.yaml)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint in checkpoint.dir (fresh start if none)")
    parser.add_argument("--timeline", metavar="DIR", default=None,
                        help="record every rank's timeline; write a Chrome/Perfetto trace, a Gantt chart and the "
                             "measured vs simulated bubble to DIR")
    parser.add_argument("--nvtx", action="store_true", help="NVTX ranges per action / P2P call (for nsys)")
    parser.epilog = ("Override any config field with --section.key=value, e.g. --schedule.steps=50 "
                     "--parallel.pipeline=4. Under torchrun each process joins the job; otherwise the configured "
                     "number of local ranks is spawned.")


def under_torchrun() -> bool:
    """True when started by torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def run(args: argparse.Namespace) -> int:
    """Entry point of ``pipecast train``; returns the exit status (0 ok, 1 a rank failed, 2 bad config)."""
    try:
        config = load_config(args.config, parse_override_args(list(getattr(args, "extra", []) or [])))
        if under_torchrun():
            config = validate_world_size(config, int(os.environ["WORLD_SIZE"]))
    except (ConfigError, TypeError, ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if under_torchrun():
        return _join_torchrun(config, args.resume, args.timeline, args.nvtx)
    try:
        spawn(train_worker, config, args.resume, args.timeline, args.nvtx)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        print(f"error: training failed: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _backend(config: TrainConfig) -> str:
    p = config.parallel
    if p.backend != "auto":
        return p.backend
    cuda = p.device == "cuda" or (p.device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def _join_torchrun(config: TrainConfig, resume: bool, timeline=None, nvtx: bool = False) -> int:
    dist.init_process_group(_backend(config), timeout=datetime.timedelta(seconds=config.parallel.timeout_s))
    try:
        train_worker(config, resume, timeline, nvtx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


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


def _entry(local_rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, rank=local_rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def spawn(fn, config: TrainConfig, *args) -> None:
    """Run ``fn(config, *args)`` on ``config.world_size`` local ranks with torch.distributed initialised.

    ``fn`` must be importable (a module-level function).  A one-rank config runs in this process.  When a rank
    raises, the others are terminated and ``torch.multiprocessing.ProcessRaisedException`` is raised here.
    """
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
    mp.start_processes(_entry, args=(world, _free_port(), backend, config.parallel.timeout_s, fn, (config, *args)),
                       nprocs=world, join=True, start_method="spawn")
