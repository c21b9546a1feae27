"""What the checkpoint manifest costs: ``Trainer.save`` with and without hashing, side by side in one job.

A config's trainer (default ``configs/default.yaml``: pp2 x vp2, two ranks) takes one training step, then saves
``--repeats`` times in each of two modes, alternating in a shuffled order per round (outside load falls on both):

* ``manifest``: the save as it runs (each rank reads back the files it wrote and hashes them with SHA-256, rank 0
  writes ``manifest.json``);
* ``no hashing``: the same save with the digest replaced by the file size alone (the manifest is still written, so
  the difference is the hashing: what this version adds to a save over the previous one).

A save's time is the slowest rank's, from a barrier before it to the barrier after it, as wall and as CPU time of
the rank's main thread (CPU time is what a loaded machine disturbs least); the hashing time is the time inside the
digest.  Printed and written to ``benchmarks/results/checkpoint_save.json``: the medians per mode and the bytes.

    python benchmarks/checkpoint_save.py [--config configs/default.yaml] [--repeats 10] [--section.key=value ...]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, write_json  # noqa: E402

MODES = ("manifest", "no hashing")


def _size_only(path) -> dict:
    import os
    return {"bytes": os.path.getsize(path), "sha256": ""}


def job(rank: int, world: int, config_path: str, overrides: list[str], repeats: int, folder: str) -> dict:
    import torch
    import torch.distributed as dist

    from engine.training.checkpoint import dcp as ckpt_dcp
    from engine.training.config import load_config
    from engine.training.trainer import Trainer
    config = load_config(config_path, overrides + [f"logging.run_dir={folder}/run", "logging.level=WARNING",
                                                   "logging.progress_bar=false"])
    real = getattr(ckpt_dcp, "file_digest", None)  # None: a version without the manifest (both modes alike)
    spent = [0.0, 0.0]  # inside the digest of the current save: wall, CPU (this thread) seconds

    def timed_digest(path):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = real(path)
        spent[0] += time.perf_counter() - t0
        spent[1] += time.thread_time() - c0
        return out
    rows = {m: [] for m in MODES}  # per save: wall s, CPU s, hashing wall s, hashing CPU s
    with Trainer(config) as trainer:
        trainer.train_step()
        order = random.Random(0)
        for i in range(repeats):
            for mode in order.sample(MODES, len(MODES)):
                if real is not None:
                    ckpt_dcp.file_digest = timed_digest if mode == "manifest" else _size_only
                spent[:] = [0.0, 0.0]
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                path = trainer.save(f"{folder}/{mode.replace(' ', '_')}")
                dist.barrier()
                rows[mode].append([time.perf_counter() - t0, time.thread_time() - c0, *spent])
        if real is not None:
            ckpt_dcp.file_digest = real
        nbytes = sum(f.stat().st_size for f in Path(path).iterdir())
    slowest = {m: torch.tensor(r, dtype=torch.float64) for m, r in rows.items()}
    for t in slowest.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"rows": {m: t.tolist() for m, t in slowest.items()}, "bytes": nbytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/checkpoint_save.json)")
    args, extra = parser.parse_known_args(argv)
    from engine.training.config import load_config, parse_override_args
    overrides = parse_override_args(extra)
    world = load_config(args.config, overrides).world_size
    with tempfile.TemporaryDirectory() as folder:
        result = launch(job, world, args.config, overrides, args.repeats, folder, threads=1)[0]
    rows = result["rows"]
    median = {m: [statistics.median(r[k] for r in rows[m]) * 1e3 for k in range(4)] for m in MODES}
    for m in MODES:
        print(f"{m:>10}: median save {median[m][0]:.1f} ms wall, {median[m][1]:.1f} ms CPU (slowest rank, "
              f"{args.repeats} saves)")
    hashing = median["manifest"][2:]
    print(f"hashing inside a save: {hashing[0]:.1f} ms wall, {hashing[1]:.1f} ms CPU = "
          f"{100 * hashing[1] / median['manifest'][1]:.1f}% of the save's CPU time; checkpoint "
          f"{result['bytes'] / 2**20:.2f} MiB on {world} ranks")
    table = [{"mode": m, **dict(zip(("wall_ms", "cpu_ms", "hash_wall_ms", "hash_cpu_ms"), median[m]))}
             for m in MODES]
    path = write_json("checkpoint_save", {"config": args.config, "overrides": overrides, "world": world,
                                          "repeats": args.repeats, "checkpoint_bytes": result["bytes"],
                                          "rows": table, "saves_s": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
