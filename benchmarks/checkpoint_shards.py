"""What a checkpoint save writes and holds per rank, for sharded layouts: file bytes per rank and peak extra memory.

For each layout of ``--layouts`` (default ``pp2_tp2``: pipeline 2 x tensor 2; ``pp2_dp2_full``: pipeline 2 x
data 2, ``shard: full``; ``pp2_dp2_optimizer``: ZeRO-1) a GPT of ``--hidden`` x ``--layers`` trains one step on
4 gloo ranks and saves once.  Per rank:

* ``state_mib``: the model and AdamW state this rank holds (a ``DTensor`` / ZeRO-1 piece counts its local part);
* ``file_mib``: the bytes of the DCP data files this rank wrote (``__<rank>_*.distcp``);
* ``peak_extra_mib``: the rise of the process's peak resident memory during ``Trainer.save`` over its resident
  memory before it (``/proc/self/clear_refs`` resets the peak, ``VmHWM`` reads it; Linux): the gathered tensors,
  DCP's serialisation buffers and the manifest's read-back, whatever the save allocates;
* ``largest_param_mib``: the largest full parameter tensor of the model (the bound a save's extra memory should
  stay near when nothing is gathered whole).

Printed as a table and written to ``benchmarks/results/checkpoint_shards.json``.  Run it at another commit (e.g.
one whose save gathered full tensors) by putting that checkout first on ``PYTHONPATH`` with ``--root``.

    python benchmarks/checkpoint_shards.py [--layouts pp2_tp2,pp2_dp2_full] [--hidden 512] [--layers 8]
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, write_json  # noqa: E402

LAYOUTS = {"pp2_tp2": {"parallel.pipeline": 2, "parallel.tensor": 2},
           "pp2_dp2_full": {"parallel.pipeline": 2, "parallel.data": 2, "parallel.shard": "full"},
           "pp2_dp2_optimizer": {"parallel.pipeline": 2, "parallel.data": 2, "parallel.shard": "optimizer"}}


def _memory_kib() -> tuple[int, int]:
    """(peak, current) resident memory of this process in KiB."""
    status = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{k}:\s+(\d+)", status).group(1)) for k in ("VmHWM", "VmRSS"))


def _held_bytes(trainer) -> int:
    from engine.training.parallel.dtensor import local
    tensors = [local(p) for p in trainer.parallelism.parameters()]
    opt = getattr(trainer.optimizer, "inner", trainer.optimizer)
    tensors += [local(v) for s in opt.state.values() for v in s.values() if hasattr(v, "numel")]
    return sum(t.numel() * t.element_size() for t in tensors)


def job(rank: int, world: int, overrides: dict, folder: str) -> dict:
    import torch.distributed as dist

    from engine.training.config import load_config
    from engine.training.trainer import Trainer
    config = load_config(None, {**overrides, "logging.run_dir": f"{folder}/run", "logging.level": "WARNING",
                                "logging.progress_bar": False})
    with Trainer(config) as trainer:
        trainer.train_step()
        largest = max(p.numel() * p.element_size() for p in trainer.canonical.parameters())
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory restarts from now
        _, before = _memory_kib()
        path = trainer.save(f"{folder}/ckpt")
        peak, _ = _memory_kib()
        held = _held_bytes(trainer)
    files = sum(f.stat().st_size for f in Path(path).glob(f"__{rank}_*.distcp"))
    return {"state_mib": held / 2**20, "file_mib": files / 2**20, "peak_extra_mib": (peak - before) / 2**10,
            "largest_param_mib": largest / 2**20}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="pp2_tp2,pp2_dp2_full")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/checkpoint_shards.json)")
    args = parser.parse_args(argv)
    model = {"model.hidden_size": args.hidden, "model.num_layers": args.layers, "model.num_attention_heads": 8,
             "model.seq_length": 64, "data.max_bytes": 200_000, "training.micro_batch_size": 2,
             "training.num_microbatches": 2, "training.eval_interval": 0, "checkpoint.interval": 0,
             "checkpoint.save_at_end": False}
    rows = []
    for name in args.layouts.split(","):
        with tempfile.TemporaryDirectory() as folder:
            per_rank = launch(job, 4, {**model, **LAYOUTS[name]}, folder, threads=1)
        for rank, r in enumerate(per_rank):
            rows.append({"layout": name, "rank": rank, **{k: round(v, 3) for k, v in r.items()}})
    print(f"{'layout':>18} {'rank':>4} {'state MiB':>10} {'file MiB':>9} {'peak extra MiB':>15} {'largest param':>14}")
    for r in rows:
        print(f"{r['layout']:>18} {r['rank']:>4} {r['state_mib']:>10.2f} {r['file_mib']:>9.2f} "
              f"{r['peak_extra_mib']:>15.2f} {r['largest_param_mib']:>14.2f}")
    for name in args.layouts.split(","):
        sizes = [r["file_mib"] for r in rows if r["layout"] == name]
        print(f"{name}: largest / smallest rank file = {max(sizes) / max(min(sizes), 1e-9):.2f}x")
    path = write_json("checkpoint_shards", {"model": model, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
