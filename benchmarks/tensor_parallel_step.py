"""Step time of pipeline 2 x data parallel 2 (``parallel.shard`` none, optimizer, full) against pipeline 2 x tensor
parallel 2 (with and without ``sequence_parallel``) on 4 CPU ranks, same global batch, with the share of the step
spent in collectives (torch.profiler).

Each layout trains the YAML trainer's GPT (``configs/pp2_dp2.yaml``'s model unless overridden) on 4 gloo ranks:
``--warmup`` untimed steps, then ``--steps`` timed ones (a barrier before each, the maximum over ranks), then one
profiled step.  The collective share is the CPU time of the profiler's ``c10d::`` / ``gloo:`` collective events
other than send / recv (all-reduce, all-gather, broadcast) over the step's wall time, on rank 0 -- at pp2 x tp2 these
are the tensor-parallel all-reduces and all-gathers (plus the small grad-norm / tied-embedding ones; with
``sequence_parallel`` all-gathers and reduce-scatters), at pp2 x dp2 the data-parallel gradient all-reduce (ZeRO-1:
reduce-scatter and the all-gather of the updated shards; FSDP2: the parameter all-gather and gradient
reduce-scatter).

    python benchmarks/tensor_parallel_step.py [--steps 5] [--warmup 2] [--threads 1] [--out PATH]

Prints one row per layout and writes ``benchmarks/results/tensor_parallel_step.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, median, timed_steps, write_json  # noqa: E402

LAYOUTS = {  # name -> parallel.* overrides; 4 ranks each
    "pp2_dp2": dict(pipeline=2, data=2),
    "pp2_dp2_zero1": dict(pipeline=2, data=2, shard="optimizer"),
    "pp2_dp2_fsdp": dict(pipeline=2, data=2, shard="full"),
    "pp2_tp2": dict(pipeline=2, tensor=2, data=1),
    "pp2_tp2_sp": dict(pipeline=2, tensor=2, data=1, sequence_parallel=True),
}
MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128)
MICRO_BATCH, GLOBAL_MICROBATCHES = 4, 8


def _collective_share(trainer) -> tuple[float, float]:
    """(collective CPU seconds, wall seconds) of one profiled step on this rank."""
    import time
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        trainer.train_step()
        wall = time.perf_counter() - t0
    names = ("allreduce", "all_reduce", "allgather", "all_gather", "broadcast", "reduce_scatter", "reducescatter")
    total = 0.0
    for e in prof.key_averages():
        n = e.key.lower()
        if (n.startswith("c10d::") or n.startswith("gloo:")) and any(k in n for k in names):
            total += e.cpu_time_total / 1e6
    return total, wall


def _rank(rank, world, name, parallel, run_dir, warmup, steps):
    from engine import Trainer
    from engine.training.config import load_config
    data = parallel.get("data", 1)
    over = {**{f"model.{k}": v for k, v in MODEL.items()}, **{f"parallel.{k}": v for k, v in parallel.items()},
            "training.micro_batch_size": MICRO_BATCH, "training.num_microbatches": GLOBAL_MICROBATCHES // data,
            "training.steps": warmup + steps + 2, "training.eval_interval": 0, "logging.level": "WARNING",
            "logging.progress_bar": False, "logging.run_dir": f"{run_dir}/{name}", "data.max_bytes": 2_000_000}
    with Trainer(load_config(None, over)) as trainer:
        times = timed_steps(trainer.train_step, warmup, steps)
        coll, wall = _collective_share(trainer)
    return {"times": times, "collective_s": coll, "profiled_wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import tempfile
    rows = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for name, parallel in LAYOUTS.items():
            per_rank = launch(_rank, 4, name, parallel, run_dir, args.warmup, args.steps, threads=args.threads)
            r0 = per_rank[0]
            rows[name] = {"median_step_s": median(r0["times"]), "step_s": r0["times"],
                          "collective_share_rank0": r0["collective_s"] / r0["profiled_wall_s"],
                          "collective_share_per_rank": [r["collective_s"] / r["profiled_wall_s"] for r in per_rank]}
            print(f"{name}: median step {rows[name]['median_step_s']:.3f} s over {args.steps} steps; collectives "
                  f"(all-reduce / all-gather / reduce-scatter / broadcast) {100 * rows[name]['collective_share_rank0']:.1f}% of a "
                  f"profiled step on rank 0 (per rank: "
                  f"{', '.join(f'{100 * s:.0f}%' for s in rows[name]['collective_share_per_rank'])})")
    path = write_json("tensor_parallel_step", {"model": MODEL, "micro_batch_size": MICRO_BATCH,
                                               "global_microbatches": GLOBAL_MICROBATCHES, "threads": args.threads,
                                               "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
