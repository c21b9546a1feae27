"""Host syncs per training step on pipecast's side, counted on the CPU (:mod:`engine.profiling.host_syncs`).

For each layout (``pp1``: one process; ``pp2_dp2_zero1``: pipeline 2 x data 2, ``shard: optimizer``, 4 gloo ranks;
``pp2_tp2``: pipeline 2 x tensor 2) a tiny GPT takes one step (the schedule call's agreement), then
``--steps`` more steps are counted one by one: ``Trainer.step_on_device`` (a step that logs nothing) where the
trainer has it, else ``Trainer.train_step`` (a version whose every step read its figures).  Printed per layout and
rank as ``{kind: count}`` per step, written to ``benchmarks/results/host_syncs.json``.

``--root DIR`` runs the trainer of another checkout (e.g. a commit before the device-side step) with this
checkout's counter:

    python benchmarks/host_syncs.py [--steps 2] [--root /path/to/other/checkout] [--out FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
LAYOUTS = {"pp1": {}, "pp2_dp2_zero1": {"pipeline": 2, "data": 2, "shard": "optimizer"},
           "pp2_tp2": {"pipeline": 2, "tensor": 2}}


def _counter_module():
    """This checkout's :mod:`engine.profiling.host_syncs`, loaded by path (``--root`` may lack it)."""
    spec = importlib.util.spec_from_file_location("_host_syncs", HERE / "engine/profiling/host_syncs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def job(rank: int, world: int, root: str, run_dir: str, parallel: dict, steps: int) -> list[dict]:
    sys.path.insert(0, root)
    from engine import Trainer
    from engine.training.config import load_config
    count_host_syncs = _counter_module().count_host_syncs
    overrides = {"model.num_layers": 4, "model.hidden_size": 16, "model.num_attention_heads": 2,
                 "model.seq_length": 8, "data.max_bytes": 40_000, "training.micro_batch_size": 2,
                 "training.num_microbatches": 2, "training.steps": steps + 1, "training.eval_interval": 0,
                 "checkpoint.interval": 0, "checkpoint.save_at_end": False, "logging.log_interval": 100,
                 "logging.progress_bar": False, "logging.level": "WARNING", "logging.run_dir": run_dir,
                 **{f"parallel.{k}": v for k, v in parallel.items()}}
    with Trainer(load_config(None, overrides)) as trainer:
        step = getattr(trainer, "step_on_device", None) or trainer.train_step
        step()
        counts = []
        for _ in range(steps):
            with count_host_syncs() as counter:
                step()
            counts.append({k: v for k, v in sorted(counter.counts.items()) if v})
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--root", default=str(HERE), help="the checkout whose trainer runs (default: this one)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/host_syncs.json)")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.root)
    from engine.runtime.spawn import spawn
    sys.path.append(str(HERE))  # after --root: spawned ranks inherit sys.path, their engine is --root's
    from benchmarks.common import write_json
    rows = {}
    for name, parallel in LAYOUTS.items():
        world = parallel.get("pipeline", 1) * parallel.get("data", 1) * parallel.get("tensor", 1)
        with tempfile.TemporaryDirectory() as run_dir:
            rows[name] = spawn(job, world, args=(args.root, run_dir, parallel, args.steps), threads=1,
                               timeout_s=600)
        for rank, per_step in enumerate(rows[name]):
            print(f"{name:>14} rank {rank}: " + " | ".join(f"{sum(c.values())} {c}" for c in per_step))
    path = write_json("host_syncs", {"root": "." if Path(args.root).resolve() == HERE.resolve() else args.root, "steps": args.steps, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
