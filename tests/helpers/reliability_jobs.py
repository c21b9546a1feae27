"""Worker functions for the reliability tests: training runs with an injected fault, and tiny pipeline jobs.

They live in an importable module (not in a test file) because ``engine.training.launch.launch_ranks`` and
``tests.helpers.distributed.run_ranks`` start ranks with the ``spawn`` method, which imports the function by name.

Faults (``Fault``): a rank SIGKILLs itself, or raises in its forward step, at the start of a given training step
(1-based, counted by the trainer).  Each rank writes ``<record_dir>/rank<r>.json`` after every step (pid, the step
losses so far, and a digest of its model weights), so the parent can compare runs and check that no process is
left behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["Fault", "tiny_overrides", "write_corpus", "faulty_train_worker", "weights_digest", "read_records"]


@dataclass(frozen=True)
class Fault:
    """Inject ``kind`` (``"sigkill"``, ``"raise"``, ``"hang"`` or ``"sigstop"``) on global rank ``rank`` when it
    starts step ``step``."""

    kind: str
    rank: int
    step: int


def write_corpus(path: Path, size: int = 60_000) -> Path:
    """A small deterministic byte corpus (repeated, slightly varied English-ish text)."""
    words = [b"pipeline", b"stage", b"microbatch", b"warmup", b"cooldown", b"bubble", b"gradient", b"tensor",
             b"rank", b"chunk", b"the", b"a", b"of", b"and", b"schedule", b"forward", b"backward"]
    out, i = bytearray(), 0
    while len(out) < size:
        out += words[(i * 7 + i // 5) % len(words)] + (b".\n" if i % 11 == 10 else b" ")
        i += 1
    path.write_bytes(bytes(out[:size]))
    return path


def tiny_overrides(corpus: Path, run_dir: Path, **extra) -> dict:
    """A tiny GPT config (4 layers, h=32, s=16) that trains 20 steps in a few seconds on 4 CPU ranks."""
    base = {"model.num_layers": 4, "model.hidden_size": 32, "model.num_attention_heads": 2,
            "model.seq_length": 16, "data.source": "text", "data.paths": [str(corpus)],
            "training.micro_batch_size": 2, "training.num_microbatches": 4, "training.steps": 20,
            "training.eval_interval": 0, "optimizer.lr": 1e-2, "optimizer.min_lr": 1e-3,
            "optimizer.warmup_steps": 3, "logging.level": "WARNING",
            "logging.run_dir": str(run_dir), "checkpoint.dir": str(run_dir / "checkpoints"),
            "parallel.timeout_s": 20}
    base.update(extra)
    return base


def weights_digest(trainer) -> str:
    """sha256 over this rank's parameters (layout-independent names, sorted)."""
    h = hashlib.sha256()
    for name, t in sorted(trainer.canonical.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _record(record_dir: Path, rank: int, payload: dict) -> None:
    tmp = record_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, record_dir / f"rank{rank}.json")


def read_records(record_dir: Path) -> dict[int, dict]:
    out = {}
    for f in sorted(Path(record_dir).glob("rank*.json")):
        out[int(f.stem[4:])] = json.loads(f.read_text())
    return out


def faulty_train_worker(config, resume: bool, record_dir: str, fault: Fault | None = None,
                        then_straight: bool = False) -> None:
    """``engine.training.launch.train_worker`` with a fault and a per-step record.

    ``resume``: load the latest checkpoint first.  Checkpoints follow ``checkpoint.interval``.  ``then_straight``:
    afterwards, train a fresh :class:`Trainer` for all ``training.steps`` without checkpoints in the same processes
    and record it as ``straight`` (the reference an interrupted + resumed run must equal).
    """
    from engine.training.trainer import Trainer
    rank = dist.get_rank()
    record_dir = Path(record_dir)
    record = {"pid": os.getpid(), "losses": {}, "digest": None, "resumed_at": 0}
    _record(record_dir, rank, record)
    with Trainer(config) as trainer:
        record.update(pp_rank=trainer.pp_rank, dp_rank=trainer.dp_rank)
        if resume:
            trainer.load()
            record["resumed_at"] = trainer.step
        if fault is not None and fault.rank == rank:
            _arm(trainer, fault, lambda: _record(record_dir, rank, {**record, "fault_at": time.time()}))
        _train(trainer, record, lambda: _record(record_dir, rank, record), save=True)
    if then_straight:
        straight = record["straight"] = {"losses": {}, "digest": None}
        with Trainer(config) as trainer:
            _train(trainer, straight, lambda: None, save=False)
        _record(record_dir, rank, record)
    _fast_exit()


def _train(trainer, record: dict, flush, save: bool) -> None:
    """Train to ``training.steps``, recording each step's loss and the weights digest."""
    interval = trainer.config.checkpoint.interval
    while trainer.step < trainer.config.training.steps:
        loss = trainer.train_step()["loss"]
        record["losses"][str(trainer.step)] = loss
        if save and interval and trainer.step % interval == 0:
            trainer.save()
        record["digest"] = weights_digest(trainer)
        flush()


def _fast_exit() -> None:
    """End a finished rank without the interpreter's multi-second torch teardown (test speed only): wait until every
    rank is done, flush, ``os._exit(0)``."""
    import logging
    import sys
    dist.barrier()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _arm(trainer, fault: Fault, before) -> None:
    """Wrap the trainer's forward step so that the fault fires in the first forward of step ``fault.step``
    (``before()`` runs first: it records the time of the fault)."""
    inner = trainer._forward_step

    def forward_step(data_iterator, model):
        if trainer.step + 1 == fault.step:  # trainer.step counts completed steps
            before()
            if fault.kind == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "hang":  # alive but stuck: only the peers' communication timeout ends the job
                time.sleep(3600)
            if fault.kind == "sigstop":  # stopped (as by a debugger or `kill -STOP`): only the timeout ends it
                os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError(f"injected fault: rank {dist.get_rank()} raises in its forward step "
                               f"(step {fault.step})")
        return inner(data_iterator, model)

    trainer._forward_step = forward_step  # the trainer looks it up per schedule call


def patched_train_worker(config, resume: bool, record_dir: str, patch: str | None = None):
    """``engine.training.launch.train_worker`` (the real ``pipecast train`` rank, ``Trainer.train`` and all) after
    recording this rank's pid and applying ``patch``:

    * ``"slow_preempt_save"``: a checkpoint save that runs after SIGTERM writes its files, then marks
      ``<record_dir>/in_save`` and sleeps 60 s before the rename (a slow file system);
    * ``"enospc"``: the disk is full after the first checkpoint: later saves' tensor files fail with
      ``OSError(ENOSPC)`` after 1000 bytes (:func:`_full_disk`).
    """
    from engine.training import launch
    rank = dist.get_rank()
    _record(Path(record_dir), rank, {"pid": os.getpid()})
    if patch == "slow_preempt_save":
        _slow_preempt_save(Path(record_dir))
    elif patch == "enospc":
        _full_disk()
    return launch.train_worker(config, resume)


def _slow_preempt_save(record_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from engine.training import preempt
    real = dcp.save

    def save(*args, **kwargs):
        out = real(*args, **kwargs)
        if preempt.requested():
            (record_dir / "in_save").write_text(str(time.time()))
            time.sleep(60)
        return out

    dcp.save = save


def _full_disk() -> None:
    """The disk fills up after the first checkpoint: in every later save, each tensor file takes its first 1000
    bytes, then ``write`` fails with ``OSError(ENOSPC)`` naming no file, as ``write(2)`` does -- inside
    ``torch.save``, whose zip writer reports it as ``RuntimeError: ... unexpected pos`` unless the cause is kept."""
    import contextlib
    import errno
    import io

    from torch.distributed.checkpoint import filesystem
    real, first_folder = filesystem.FileSystem.create_stream, []

    class Full(io.FileIO):
        def write(self, data):
            if self.tell() + len(memoryview(data).cast("B")) > 1000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        folder = Path(path).parent.name
        first_folder[:] = first_folder or [folder]
        if "w" not in mode or not str(path).endswith(".distcp") or folder == first_folder[0]:
            with real(self, path, mode) as stream:
                yield stream
            return
        with Full(path, "wb") as stream:
            yield stream

    filesystem.FileSystem.create_stream = create_stream


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.helpers.reliability_jobs JSON``: a ``pipecast train``-like launcher process running
    :func:`faulty_train_worker` under ``engine.training.launch.run_spawned``.

    JSON keys: ``overrides`` (config overrides), ``record_dir``, ``resume`` (bool), ``fault`` (``[kind, rank, step]``
    or null), ``then_straight`` (bool), ``sleep`` (run :func:`sleeper` instead), ``patch`` (run
    :func:`patched_train_worker` with that patch, or null for none).  Exits with the launcher's status.
    """
    import sys

    from engine.training.config import load_config
    from engine.training.launch import run_spawned
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    config = load_config(None, spec["overrides"])
    if spec.get("sleep"):
        return run_spawned(sleeper, config, spec["record_dir"])
    if "patch" in spec:
        return run_spawned(patched_train_worker, config, bool(spec.get("resume")), spec["record_dir"],
                           spec["patch"])
    fault = Fault(*spec["fault"]) if spec.get("fault") else None
    return run_spawned(faulty_train_worker, config, bool(spec.get("resume")), spec["record_dir"], fault,
                       bool(spec.get("then_straight")))



# ---- schedule-API jobs: one spawn, many cases, each in fresh pipeline groups with a short timeout -------------------

class _Stage(torch.nn.Module):
    """Pipeline stage ``[s, b, h] -> [s, b, h]`` (``tanh(x W^T)``); ``out_hidden`` / ``out_dtype`` make it send a
    wrong shape / dtype downstream."""

    def __init__(self, config, rank: int, hidden: int, out_hidden: int | None = None, out_dtype=None):
        super().__init__()
        self.config = config
        self.is_first = rank == 0
        g = torch.Generator().manual_seed(rank)
        self.weight = torch.nn.Parameter(torch.randn(out_hidden or hidden, hidden, generator=g) / hidden ** 0.5)
        self.out_dtype = out_dtype
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor

    def forward(self, x):
        x = x if self.is_first else self.input_tensor
        y = torch.tanh(x.to(self.weight.dtype) @ self.weight.t())
        return y.to(self.out_dtype) if self.out_dtype is not None else y


def _forward_step(data_iterator, model):
    x = next(data_iterator) if data_iterator is not None else None
    y = model(x)

    def loss_func(out):
        loss = out.float().square().mean()
        return loss, {"loss": loss.detach()}
    return y, loss_func


def pipeline_case(rank: int, case: dict) -> dict:
    """Run one 2-rank 1F1B schedule call described by ``case`` in fresh pipeline groups (timeout
    ``case["timeout_s"]``); returns how this rank ended: ``{"ok": bool, "error": "Type: message", "seconds": t}``,
    and after a call that ran, its ``losses`` (the stored per-microbatch losses) and this stage's weight ``grad``.

    ``case`` keys (each a value, or ``{rank: value}`` for a per-rank value): ``hidden``, ``out_hidden``,
    ``out_dtype``, ``pipeline_dtype``, ``config_hidden`` (``config.hidden_size``; default ``hidden``),
    ``variable_seq_lengths``, ``num_microbatches``, ``seq_length``,
    ``micro_batch_size``, ``skip`` (this rank does not call the schedule: it sleeps ``skip`` seconds instead).
    """
    import datetime

    from engine.model_parallel_config import ModelParallelConfig
    from engine.runtime.p2p import P2PCommunicator
    from engine.runtime.process_groups import build_process_groups
    from engine.schedules import get_forward_backward_func

    def pick(key, default=None):
        value = case.get(key, default)
        return value.get(rank, default) if isinstance(value, dict) else value

    pgc = build_process_groups(2, timeout=datetime.timedelta(seconds=case.get("timeout_s", 3)))
    hidden, seq, mbs, m = pick("hidden", 8), pick("seq_length", 4), pick("micro_batch_size", 2), \
        pick("num_microbatches", 3)
    dtype = getattr(torch, pick("pipeline_dtype", "float32"))
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=dtype,
                                 hidden_size=pick("config_hidden", hidden),
                                 variable_seq_lengths=bool(pick("variable_seq_lengths", False)))
    out_dtype = pick("out_dtype")
    model = _Stage(config, rank, hidden, pick("out_hidden"), getattr(torch, out_dtype) if out_dtype else None)
    if dtype != torch.float32 and out_dtype is None:
        model = model.to(dtype)
    data = iter([torch.randn(seq, mbs, hidden, generator=torch.Generator().manual_seed(i)) for i in range(8)])
    t0 = time.monotonic()
    result = {"ok": True, "error": None, "p2p_ops": 0}
    try:
        if pick("skip"):
            time.sleep(pick("skip"))
            result["error"] = "skipped"
        else:
            comm = _counting(P2PCommunicator(pgc.pp, config), result)
            store = get_forward_backward_func(2, None)(
                forward_step_func=_forward_step, data_iterator=data if rank == 0 else None, model=model,
                num_microbatches=m, seq_length=seq, micro_batch_size=mbs, p2p_communicator=comm,
                pg_collection=pgc)
            result["losses"] = [entry["loss"].item() for entry in store]
            result["grad"] = model.weight.grad.tolist()
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    result["seconds"] = time.monotonic() - t0
    return result


def _counting(comm, result: dict):
    """``comm`` with every posted send / receive counted in ``result["p2p_ops"]`` (shape handshakes included):
    zero shows a rank failed before any point-to-point message, whatever the time it took."""
    post, irecv = comm.post, comm.irecv

    def counted_post(ops, batched):
        result["p2p_ops"] += len(ops)
        return post(ops, batched)

    def counted_irecv(*args, **kwargs):
        result["p2p_ops"] += 1
        return irecv(*args, **kwargs)
    comm.post, comm.irecv = counted_post, counted_irecv
    return comm


def pipeline_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Every case in order on this rank; ranks re-synchronise on the default group between cases."""
    out = []
    for case in cases:
        out.append(pipeline_case(rank, case))
        dist.barrier()
    return out


def sleeper(config, record_dir: str) -> None:
    """A rank that records its pid and then blocks inside gloo (a receive nobody sends, until the group timeout):
    where a Python-level signal (torch's default parent-death SIGINT) would wait for the timeout."""
    _record(Path(record_dir), dist.get_rank(), {"pid": os.getpid()})
    dist.recv(torch.empty(1), src=1 - dist.get_rank())


def late_finisher(config, record_dir: str, late_rank: int, delay: float) -> None:
    """Rank ``late_rank`` finishes ``delay`` seconds after the others (as the log rank does after the last
    evaluation); every rank records when its ``fn`` ended and, from an ``atexit`` hook, when its interpreter began
    to exit."""
    import atexit
    rank = dist.get_rank()
    if rank == late_rank:
        time.sleep(delay)
    record = {"pid": os.getpid(), "fn_end": time.time()}
    _record(Path(record_dir), rank, record)
    atexit.register(lambda: _record(Path(record_dir), rank, {**record, "exit": time.time()}))


if __name__ == "__main__":
    raise SystemExit(main())
