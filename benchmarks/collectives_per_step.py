"""Collectives per training step: how many ``torch.distributed`` collectives (not pipeline P2P messages) one
``Trainer.train_step`` makes, counted on 2 gloo ranks.

Each rank wraps the collectives of ``torch.distributed`` (all_gather, all_reduce, broadcast, barrier,
reduce-scatter, ...) with counters before any engine module is imported, builds a trainer of a tiny GPT and counts,
per phase: the first train step, each further train step, an evaluation (``eval_microbatches`` other than the
training count: the schedule call's sizes change) and the train step after it.  A layout is a set of config
overrides; the figures of rank 0 and 1 are printed (they are the same calls on both ranks of a layout here).

    PYTHONPATH=. python benchmarks/collectives_per_step.py        # prints a table, writes
                                                                    # benchmarks/results/collectives_per_step.json
"""
from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast",
               "broadcast_object_list", "barrier", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "gather", "scatter", "reduce")
STEPS = 6
LAYOUTS = {  # name -> config overrides (2 ranks each)
    "pp2 interleaved (virtual 2)": {"parallel.pipeline": 2, "parallel.virtual": 2, "model.num_layers": 4},
    "pp2 1f1b": {"parallel.pipeline": 2, "parallel.schedule": "1f1b"},
    "pp2 zbv": {"parallel.pipeline": 2, "parallel.virtual": 2, "parallel.schedule": "zbv", "model.num_layers": 4},
    "dp2": {"parallel.pipeline": 1, "parallel.data": 2},
}


def _count_collectives(counts: collections.Counter) -> None:
    """Wrap each collective of ``torch.distributed`` so that a call adds one to ``counts[name]``."""
    import torch.distributed as dist
    for name in COLLECTIVES:
        inner = getattr(dist, name, None)
        if inner is None:
            continue

        def counted(*args, _inner=inner, _name=name, **kwargs):
            counts[_name] += 1
            return _inner(*args, **kwargs)
        setattr(dist, name, counted)


def _overrides(layout: dict, run_dir: str) -> dict:
    return {"model.num_layers": 2, "model.hidden_size": 32, "model.num_attention_heads": 2, "model.seq_length": 16,
            "data.max_bytes": 40_000, "training.micro_batch_size": 2, "training.num_microbatches": 4,
            "training.eval_microbatches": 2, "training.eval_iters": 2, "training.steps": STEPS + 2,
            "logging.progress_bar": False, "logging.level": "WARNING", "logging.run_dir": run_dir,
            "checkpoint.interval": 0, "checkpoint.save_at_end": False, **layout}


def _phase(phases: list, counts: collections.Counter, label: str, fn) -> None:
    """Run ``fn()`` and append its collectives and P2P messages to ``phases``."""
    from engine.runtime.p2p import record_messages
    counts.clear()
    with record_messages() as records:
        fn()
    phases.append({"phase": label, "collectives": dict(counts), "p2p_messages": len(records)})


def _rank(rank: int, world: int, run_dir: str) -> dict:
    counts: collections.Counter = collections.Counter()
    _count_collectives(counts)
    from engine import Trainer
    from engine.training.config import load_config
    out = {}
    for name, layout in LAYOUTS.items():
        phases: list = []
        with Trainer(load_config(None, _overrides(layout, f"{run_dir}/{len(out)}"))) as trainer:
            _phase(phases, counts, "first train step", trainer.train_step)
            for i in range(STEPS - 2):
                _phase(phases, counts, f"train step {i + 2}", trainer.train_step)
            _phase(phases, counts, "evaluate (other microbatch count)", trainer.evaluate)
            _phase(phases, counts, "train step after evaluate", trainer.train_step)
        out[name] = phases
    return out


def main() -> None:
    from benchmarks.common import write_json
    from engine.runtime.spawn import spawn
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(_rank, 2, args=(tmp,), timeout_s=600, threads=1)
    rows = []
    for name in LAYOUTS:
        print(f"\n{name}")
        for rank, per_rank in enumerate(results):
            for p in per_rank[name]:
                total = sum(p["collectives"].values())
                print(f"  rank {rank} {p['phase']:<36} collectives {total:3d} {p['collectives']}  "
                      f"p2p messages {p['p2p_messages']}")
                if rank == 0:
                    rows.append({"layout": name, "phase": p["phase"], "collectives": total,
                                 **{k: p["collectives"].get(k, 0) for k in ("all_gather", "all_reduce", "broadcast")},
                                 "p2p_messages": p["p2p_messages"], "by_name": p["collectives"]})
    path = write_json("collectives_per_step", {"steps": STEPS, "rows": rows,
                                               "per_rank": {n: [r[n] for r in results] for n in LAYOUTS}})
    print(f"\nwrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
