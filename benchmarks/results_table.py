"""Regenerate ``benchmarks/README.md`` (the scripts and their latest results) from the JSON the benchmarks wrote.

Reads ``benchmarks/results/*.json`` (or the files given), prints the markdown and writes it, after the fixed
header :data:`HEADER`, to ``benchmarks/README.md``.  Each table says the machine, load average and the command that
produced it.

    python benchmarks/results_table.py
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HEADER = """# Benchmarks

Speed and memory are measured here, not in the tests.  Each script prints its figures and writes JSON to
`benchmarks/results/`; this page is generated from those files by `python benchmarks/results_table.py`.

| script | measures |
|---|---|
| `vs_torch_pipelining.py [--pin]` | step time of pipecast 1F1B / interleaved / ZB-H1 / ZB-V against every torch.distributed.pipelining schedule, same model, data and loss (`loss_matches`), side by side in the same jobs |
| `tune_configs.py` | `pipecast tune --verify` on the default and the pp=4 config: ranked candidates, predicted vs measured step time |
| `runtime_overhead.py` | per-action runtime cost over compute, pp=1 and pp=2, pipecast and torch |
| `memory.py [--sharding / --tensor / --recompute / --estimate]` | peak in-flight activations and pending W per rank against the closed form and the simulator; bytes held by sent outputs with and without deallocation; `--recompute`: saved-activation bytes per layer, fp32 / bf16 x none / selective / full; `--estimate`: `engine.training.memory`'s per-rank estimate (parameters, gradients, optimizer state, activations) against measured bytes |
| `checkpoint_save.py` | `Trainer.save` with and without the manifest's SHA-256 hashing, side by side: wall and CPU time, the hashing share |
| `split_backward.py` | B + W against the full backward of one chunk; bytes held between B and W |
| `profile_step.py` | a timeline of pipecast steps, each against its floor (the plan simulated with measured costs) |
| `plan_scale.py` | build + validate + simulate for p=64, v=8, m=1024 |
| `zero_bubble_costs.py` | cost-aware `zb` plans on the zero-bubble paper's profiled costs (its ZB-1p / ZB-2p bubble rates beside), V-Half / V-Min bubble and memory, build times up to p=32, m=256 |
| `cuda_graphs_bench.py` | one GPU: eager vs graph replay (bitwise equality, step time, memory); `--memory-only` on CPU |
| `gpu_check.py [--dry-run] [--out DIR]` | the first-GPU-run check: GPT-block F/B/W graphs vs eager (interleaved, zb_h1, zbv; fp32 bitwise, bf16 tolerance), caller state, dropout under replay, graph-pool bytes at M = 4 / 16, capture seconds, trainer graphs on/off (zbv, 1f1b, bf16, interleaved pp2), host syncs, cuda tests, bench goals; one JSON rewritten around every check, within a time budget |
| `collectives_per_step.py` | torch.distributed collectives and P2P messages per trainer phase on 2 gloo ranks (train steps, an evaluation with another microbatch count, the step after it) |
| `host_syncs.py [--root DIR]` | host syncs per training step (`.item()`, `.tolist()`, `float(t)`, device copies), counted on the CPU at pp1, pp2 x dp2 ZeRO-1 and pp2 x tp2; `--root`: another checkout's trainer |
| `checkpoint_shards.py` | per rank: bytes of the DCP files it writes and peak extra resident memory during `Trainer.save`, at pp2 x tp2, pp2 x dp2 `shard: full` and `shard: optimizer` |
| `investigations/p2p_stalls.py`, `investigations/gloo_post_stalls.py` | one-off studies of gloo receive posting and send stalls |

Method on a shared machine: each fresh job builds all engines and steps them round-robin (shuffled order per
round), so outside load falls on all engines alike; figures are medians over jobs.  `--pin` pins each rank to its
own core for every engine alike.
"""


def _machine(d: dict) -> str:
    m = d.get("machine", {})
    load = m.get("loadavg")
    start = m.get("loadavg_at_start")
    load_s = (f", load average {start[0]:.2f} at start, {load[0]:.2f} at end" if start and load else
              f", load average {load[0]:.2f} at end" if load else "")
    return (f"*{m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}, "
            f"{m.get('date_utc', '?')} UTC, commit {m.get('git', '?')}{load_s}.*  \n"
            f"*Command:* `{d.get('command', '?')}`")


def _goals(d: dict) -> list[str]:
    return [f"- {'met' if g['met'] else '**missed**'}: {g['goal']} (measured {g['value']:.3f})"
            for g in d.get("goals", [])]


def vs_torch(d: dict) -> list[str]:
    w = d["workload"]
    pin = " each rank pinned to its own core," if d.get("pin") else ""
    out = [f"### Step time vs torch.distributed.pipelining{' (ranks pinned)' if d.get('pin') else ''}",
           f"MLP stack hidden {w['hidden']}, {w['layers']} layers, {w['sequences']} sequences x {w['seq_length']} "
           f"tokens in {w['microbatches']} microbatches, fp32, 2 ranks on gloo, {d['threads']} thread per rank,{pin} "
           f"all engines stepped round-robin inside each fresh 2-rank job; median over {d['repeats']} jobs of the "
           f"median of {d['steps']} steps (p10: 10th percentile of all steps).", "",
           "| engine | step (ms) | p10 (ms) | range over jobs (ms) | speedup vs 1 process | bound | of bound | loss |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        bound = f"{r['bound']:.3f}" if "bound" in r else ""
        of = f"{r['of_bound']:.3f}" if "of_bound" in r else ""
        ok = "" if r["loss_matches"] else " (mismatch)"
        out.append(f"| {r['engine']} | {r['step_ms']:.1f} | {r.get('p10_ms', float('nan')):.1f} | "
                   f"{r['min_ms']:.1f}-{r['max_ms']:.1f} | {r['speedup']:.3f} | {bound} | {of} | "
                   f"{r['loss']:.6f}{ok} |")
    return out + [""] + _goals(d) + ["", _machine(d)]


def overhead(d: dict) -> list[str]:
    ms = d["microbatches"]
    out = ["### Runtime overhead per action",
           f"Tiny model (hidden {d['hidden']}, {d['layers']} layers, {d['seq_length']} tokens per microbatch); "
           f"slope of the median step time over M = {', '.join(map(str, ms))}, minus the single-process compute "
           f"slope, per action (one forward + one backward per microbatch and rank); median of {d['repeats']} "
           "fresh-process repeats.", "",
           "| case | " + " | ".join(f"M={m} (ms)" for m in ms) + " | slope (us/microbatch) | overhead (us/action) |",
           "|---|" + "---:|" * (len(ms) + 2)]
    for r in d["rows"]:
        ov = r.get("overhead_us_per_action")
        out.append(f"| {r['case']} | " + " | ".join(f"{r['step_ms'][str(m)] if str(m) in r['step_ms'] else r['step_ms'][m]:.2f}"
                                                 for m in ms) +
                   f" | {r['slope_us_per_microbatch']:.1f} | {'' if ov is None else f'{ov:.1f}'} |")
    if d.get("gloo_one_way_us") is not None:
        out += ["", f"gloo one-way latency in the same run: {d['gloo_one_way_us']:.1f} us for the tiny model's "
                f"activation ({4 * d['hidden'] * d['seq_length']} B)" +
                (f", {d['gloo_one_way_big_us']:.1f} us for {d['big_message_bytes'] // 1024} KiB (one activation of "
                 "the vs-torch workload)." if d.get("gloo_one_way_big_us") is not None else ".")]
    return out + [""] + _goals(d) + ["", _machine(d)]


def memory(d: dict) -> list[str]:
    out = ["### Memory: in-flight activations, pending W and sent outputs",
           "Peak (model chunk, microbatch) activations alive per rank, measured from autograd's saved tensors, "
           "against the closed form and the simulator (split schedules: alive until W, against the plan's count; "
           "the simulator's in-flight = F done, B not; pending W = B done, W not); peak bytes held by sent outputs "
           "(their storage), without and with `deallocate_pipeline_outputs`.", "",
           "| schedule | pp | vp | m | measured | theory | simulator in-flight | pending W | one output (B) | "
           "sent-output bytes peak | with deallocation |",
           "|---|---:|---:|---:|---|---|---|---|---:|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r.get('schedule', '')} | {r['pp']} | {r['chunks']} | {r['microbatches']} | {r['measured']} | "
                   f"{r['theory']} | {r['simulator']} | {r.get('simulator_pending_w', '')} | {r['output_bytes']} | "
                   f"{r['sent_output_bytes_peak']} | {r['sent_output_bytes_peak_dealloc']} |")
    return out + [""] + _goals(d) + ["", _machine(d)]


def stalls(d: dict) -> list[str]:
    out = [f"### Receive posting / waiting variants ({'interleaved 1F1B' if d['chunks'] > 1 else '1F1B'}"
           f"{', ranks pinned' if d.get('pin_all') else ''})",
           "Same workload as above; all variants stepped round-robin inside each fresh job.", "",
           "| variant | median (ms) | p10 (ms) | p90 (ms) | receive waits > "
           f"{d['stall_ms']:g} ms per step |", "|---|---:|---:|---:|---:|"]
    for r in d["rows"]:
        out.append(f"| {r['variant']} | {r['median_ms']:.1f} | {r['p10_ms']:.1f} | {r['p90_ms']:.1f} | "
                   f"{r['stalls_per_step']:.2f} |")
    return out + ["", _machine(d)]


def post_stalls(d: dict) -> list[str]:
    out = [f"### Posting a gloo send while both ranks compute{' (ranks pinned)' if d.get('pin') else ''}",
           f"Two ranks loop {d['iterations']} times: about 2 ms of matmuls, then post one send of "
           f"{d['message_bytes'] // 1024} KiB and one receive (three ahead); time of each posting call.", "",
           "| variant | rank | op | median (us) | p99 (us) | max (us) | posts > 1 ms |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in d["rows"]:
        out.append(f"| {r['variant']} | {r['rank']} | {r['op']} | {r['median_us']:.0f} | {r['p99_us']:.0f} | "
                   f"{r['max_us']:.0f} | {r['over_1ms']} |")
    return out + ["", _machine(d)]


def split_backward(d: dict) -> list[str]:
    w = d["workload"]
    s, b, h = w["microbatch_sbh"]
    out = [f"### Split backward: B + W against the full backward (hidden {w['hidden']})",
           f"One model chunk of {w['layers_per_chunk']} layers, one microbatch [s, b, h] = [{s}, {b}, {h}], "
           f"{d['threads']} thread; medians (minima in brackets) of {d['repeats']} repetitions.  Full backward "
           f"{d['full_backward_ms']:.3f} ms ({d['full_backward_min_ms']:.3f}); the unsplit backward holds "
           f"{d['activation_bytes_after_forward']} B after the forward.", "",
           "| mode | forward (ms) | B (ms) | W (ms) | B + W / full | bytes held between B and W | of which the "
           "handle's |", "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, r in d["modes"].items():
        out.append(f"| {mode} | {d['forward_ms'][mode]:.3f} | {r['b_ms']:.3f} | {r['w_ms']:.3f} | "
                   f"{r['ratio_to_full']:.3f} ({r['min_ratio_to_full']:.3f}) | {r['bytes_between_b_and_w']} | "
                   f"{r['handle_held_bytes']} |")
    return out + [""] + _goals(d) + ["", _machine(d)]


def generic(d: dict) -> list[str]:
    out = [f"### {d.get('benchmark', 'benchmark')}"]
    rows = d.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        keys = [k for k in rows[0] if not isinstance(rows[0][k], (dict, list))]
        out += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in rows:
            out.append("| " + " | ".join(f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k))
                                          for k in keys) + " |")
    else:
        out += ["", "```", json.dumps({k: v for k, v in d.items() if k not in ("machine", "command")}, indent=1)[:2000],
                "```"]
    return out + [""] + _goals(d) + ["", _machine(d)]


def tune(d: dict) -> list[str]:
    out = [f"### pipecast tune --verify ({d['steps']} recorded steps per layout)"]
    for r in d["runs"]:
        out += ["", f"`{r['config']}` ({r['seconds']:.0f} s): top predicted {r.get('top', r['best'])}, recommended "
                    f"**{r['best']}** (minimum gain {100 * r.get('min_gain', 0):.1f}%), the config's own {r['own']}; "
                    f"measured fastest {r['fastest_measured']}.", "",
                "| candidate (top 6 of {}) | predicted ms | bubble | peak MiB per rank |".format(len(r["candidates"])),
                "|---|---|---|---|"]
        for c in r["candidates"][:6]:
            mem = "/".join(f"{b / 2**20:.1f}" for b in c["peak_memory_bytes"])
            out.append(f"| {c['label']} | {c['predicted_ms']:.1f} | {100 * c['bubble']:.1f}% | {mem} |")
        if "drift" in r:
            out += ["", f"The config's own step changed {100 * r['drift']:+.1f}% from measuring to verifying."]
        out += ["", "| verified | predicted ms | measured ms | error | ratio to config's own: error |",
                "|---|---|---|---|---|"]
        for v in r["verified"]:
            own = " (config)" if v["is_config"] else ""
            rel = f"{100 * v['relative_error']:+.1f}%" if "relative_error" in v else "-"
            out.append(f"| {v['label']}{own} | {v['predicted_ms']:.1f} | {v['measured_ms']:.1f} | "
                       f"{100 * v['error']:+.1f}% | {rel} |")
    return out + [""] + _goals(d) + ["", _machine(d)]


def zero_bubble_costs(d: dict) -> list[str]:
    out = ["### Cost-aware zero-bubble plans on the zero-bubble paper's settings (arXiv:2401.10241, Tables 5 and 9)",
           "", "Bubble rate `(cost - m(F+B+W)) / cost`; ours: `zb` built for the profiled costs at an activation budget "
           "of p / 2p (a pending W counts M_W/M_B of an activation, the paper's Table 1); peak: its memory in M_B.", "",
           "| model | p | m | 1F1B | ZB-H1 | ZB-1p (paper) | ours, p | peak | ZB-2p (paper) | ours, 2p | peak |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["paper_settings"]:
        out.append(f"| {r['model']} | {r['p']} | {r['m']} | {r['1f1b']:.4f} | {r['zb_h1']:.4f} | "
                   f"{r['paper']['zb_1p']:.4f} | {r['cost_aware_1p']:.4f} | {r['peak_memory_1p']:.1f} | "
                   f"{r['paper']['zb_2p']:.4f} | {r['cost_aware_2p']:.4f} | {r['peak_memory_2p']:.1f} |")
    out += ["", "V-Half / V-Min with F = B = W (m = 3p): bubble in chunk-pass slots against 1F1B's, activation memory "
            "(F to W, microbatches) against the controllable-memory paper's.", "",
            "| schedule | p | bubble | of 1F1B's | memory | paper |", "|---|---:|---:|---:|---:|---:|"]
    for r in d["controllable"]:
        out.append(f"| {r['schedule']} | {r['p']} | {r['bubble_slots']:.0f} | "
                   f"{r['bubble_slots'] / r['1f1b_bubble_slots']:.3f} | {r['memory_microbatches']:.1f} | "
                   f"{r['paper_memory']} |")
    out += ["", "| build | p | m | CPU s | wall s |", "|---|---:|---:|---:|---:|"]
    out += [f"| {r['schedule']} (budget {r['budget']}) | {r['p']} | {r['m']} | {r['cpu_s']:.2f} | {r['wall_s']:.2f} |"
            for r in d["build_times"]]
    return out + ["", f"Goal (at or below ZB-1p / ZB-2p on every setting): {'met' if d['goal_met'] else 'missed'}.",
                  "", _machine(d)]


RENDER = {"zero_bubble_costs": zero_bubble_costs, "vs_torch_pipelining": vs_torch, "tune_configs": tune, "vs_torch_pipelining_pinned": vs_torch, "runtime_overhead": overhead,
          "memory": memory, "p2p_stalls_1f1b": stalls, "p2p_stalls_interleaved": stalls,
          "gloo_post_stalls": post_stalls, "split_backward": split_backward}
ORDER = ["vs_torch_pipelining", "vs_torch_pipelining_pinned", "tune_configs", "runtime_overhead", "memory", "p2p_stalls_1f1b",
         "p2p_stalls_interleaved", "gloo_post_stalls"]


def render(paths) -> str:
    docs = []
    for p in paths:
        try:
            d = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{p}: not a benchmark JSON ({e}); rerun the benchmark that writes it") from None
        docs.append(d)
    docs.sort(key=lambda d: (ORDER.index(d.get("benchmark")) if d.get("benchmark") in ORDER else len(ORDER),
                             str(d.get("benchmark"))))
    lines = ["## Results", "", "Regenerate with `python benchmarks/results_table.py` after running the benchmarks.", ""]
    for d in docs:
        lines += RENDER.get(d.get("benchmark"), generic)(d) + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="benchmark JSON files (default: benchmarks/results/*.json)")
    ap.add_argument("--out", default=str(RESULTS.parent / "README.md"))
    args = ap.parse_args(argv)
    files = args.files or sorted(RESULTS.glob("*.json"))
    if not files:
        print("no benchmark results found; run benchmarks/vs_torch_pipelining.py, runtime_overhead.py, memory.py",
              file=sys.stderr)
        return 1
    text = HEADER + "\n" + render(files)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
