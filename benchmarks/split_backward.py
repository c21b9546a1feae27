"""Split backward on CPU: time of B + W against the unsplit backward, and the bytes held between B and W.

One model chunk of the vs-torch workload (``benchmarks.common``: residual ``h + gelu(Linear(h))`` layers, hidden
512, 4 layers = one chunk of 8 layers at P=2; one microbatch ``[s, b, h] = [64, 2, 512]``) in one process with
``torch.set_num_threads(--threads)``.  For each repetition and variant (interleaved, so they share conditions):
forward a fresh microbatch (timed: the deferral's forward overhead shows in ``layer``), then time

* ``full``: ``backward_step`` (the unsplit backward),
* ``layer``: forward under ``weight_grad_deferral``, ``backward_input_step(mode="layer")`` (B) then ``run()`` (W),
* ``generic``: plain forward, ``backward_input_step(mode="generic")`` then ``run()``.

Bytes between B and W: the distinct non-parameter storages still saved by autograd (saved-tensor hooks) plus the
handle's recorded gradients (``WeightGradWork.held_bytes``); "after F" is the same saved-tensor count after the
forward (what the unsplit backward holds until it runs).  Times are medians, with the minimum alongside (less
sensitive to a loaded machine).

    python benchmarks/split_backward.py               # ~20 s
    python benchmarks/split_backward.py --repeats 5   # smoke test
    python benchmarks/split_backward.py --hidden 8 --seq-length 4 --out /tmp/overhead.json   # per-call overhead
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import weakref
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Workload, stage_layers, write_json  # noqa: E402
from engine.model_parallel_config import ModelParallelConfig  # noqa: E402
from engine.runtime.split_backward import backward_input_step, weight_grad_deferral  # noqa: E402
from engine.runtime.step import backward_step  # noqa: E402
from engine.runtime.storage import storage_sizes  # noqa: E402

VARIANTS = ("full", "layer", "generic")


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class SavedBytes:
    """Saved-tensor hooks that remember what autograd saves; :meth:`held` counts what is still saved."""

    def __init__(self, params):
        self.params = {ptr for p in params for ptr in storage_sizes(p)}
        self.refs: list = []

    def hooks(self):
        def pack(t):
            box = _Box(t)
            self.refs.append(weakref.ref(box))
            return box
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t)

    def held(self, extra: dict | None = None) -> int:
        """Bytes of the distinct non-parameter storages still saved, merged with ``extra`` ({data_ptr: bytes})."""
        gc.collect()
        sizes = dict(extra or {})
        for ref in self.refs:
            box = ref()
            if box is not None:
                sizes.update((ptr, n) for ptr, n in storage_sizes(box.t).items() if ptr not in self.params)
        return sum(sizes.values())


def one(chunk, variant: str, x0, gy, config, measure: bool) -> dict:
    """One microbatch's forward and timed backward; with ``measure`` also the bytes held (slow: gc)."""
    saved = SavedBytes(chunk.parameters())
    x = x0.clone().requires_grad_()
    tf = time.perf_counter()
    with (saved.hooks() if measure else torch.enable_grad()), \
            (weight_grad_deferral() if variant == "layer" else torch.enable_grad()):
        y = chunk(x)
    t0 = time.perf_counter()
    row = {"after_f_bytes": saved.held()} if measure else {"f_ms": (t0 - tf) * 1e3}
    t0 = time.perf_counter()
    if variant == "full":
        backward_step(x, y, gy, config)
        row["full_ms"] = (time.perf_counter() - t0) * 1e3
        return row
    _, work = backward_input_step(x, y, gy, config, mode=variant)
    t1 = time.perf_counter()
    if measure:
        del y
        row["between_bytes"] = saved.held(work.held_storages())
        row["handle_bytes"] = work.held_bytes()
    t2 = time.perf_counter()
    work.run()
    row.update(b_ms=(t1 - t0) * 1e3, w_ms=(time.perf_counter() - t2) * 1e3)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=Workload.hidden, help="e.g. 8 to see the per-call overhead")
    ap.add_argument("--seq-length", type=int, default=Workload.seq_length)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/split_backward.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    w = Workload(hidden=args.hidden, seq_length=args.seq_length)
    chunk = stage_layers(w, 2, 1, 0)
    g = torch.Generator().manual_seed(0)
    shape = (w.seq_length, w.micro_batch_size, w.hidden)
    x0, gy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    config = ModelParallelConfig()
    rows = {v: [] for v in VARIANTS}
    for i in range(args.repeats + 3):  # 3 warm-up rounds
        for v in VARIANTS:
            r = one(chunk, v, x0, gy, config, measure=False)
            if i >= 3:
                rows[v].append(r)
    memory = {v: one(chunk, v, x0, gy, config, measure=True) for v in VARIANTS}
    result = summarize(rows, memory, w, chunk, args)
    path = write_json("split_backward", result, args.out)
    print_table(result)
    print(f"wrote {path}")
    return result


def summarize(rows, memory, w, chunk, args) -> dict:
    med = statistics.median
    full = med(r["full_ms"] for r in rows["full"])
    full_min = min(r["full_ms"] for r in rows["full"])
    out = {"workload": {"hidden": w.hidden, "layers_per_chunk": len(chunk), "microbatch_sbh":
                        [w.seq_length, w.micro_batch_size, w.hidden]},
           "threads": args.threads, "repeats": args.repeats, "full_backward_ms": full,
           "full_backward_min_ms": full_min,
           "forward_ms": {v: med(r["f_ms"] for r in rows[v]) for v in VARIANTS},
           "activation_bytes_after_forward": memory["full"]["after_f_bytes"], "modes": {}}
    for v in ("layer", "generic"):
        b, wt = med(r["b_ms"] for r in rows[v]), med(r["w_ms"] for r in rows[v])
        best = min(r["b_ms"] + r["w_ms"] for r in rows[v])
        out["modes"][v] = {"b_ms": b, "w_ms": wt, "b_plus_w_ms": b + wt, "ratio_to_full": (b + wt) / full,
                           "b_plus_w_min_ms": best, "min_ratio_to_full": best / full_min,
                           "bytes_between_b_and_w": memory[v]["between_bytes"],
                           "handle_held_bytes": memory[v]["handle_bytes"]}
    return out


def print_table(r: dict) -> None:
    print(f"chunk {r['workload']}, {r['threads']} thread(s), median of {r['repeats']}")
    print(f"full backward: {r['full_backward_ms']:.3f} ms; saved after F: {r['activation_bytes_after_forward']} B")
    print("forward ms: " + ", ".join(f"{v} {ms:.3f}" for v, ms in r["forward_ms"].items()))
    print(f"{'mode':8} {'B ms':>8} {'W ms':>8} {'B+W ms':>8} {'/full':>6} {'min /full':>9} {'held B..W bytes':>16} "
          f"{'handle':>10}")
    for v, m in r["modes"].items():
        print(f"{v:8} {m['b_ms']:8.3f} {m['w_ms']:8.3f} {m['b_plus_w_ms']:8.3f} {m['ratio_to_full']:6.2f} "
              f"{m['min_ratio_to_full']:9.2f} "
              f"{m['bytes_between_b_and_w']:16d} {m['handle_held_bytes']:10d}")


if __name__ == "__main__":
    main()
