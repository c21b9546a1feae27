"""Uneven pipeline stages on a vocabulary-heavy model: the layout ``pipecast tune`` picks against the even split,
measured side by side (issue 33).

The preset: ``configs/pp4_1f1b.yaml`` (8 layers, hidden 128, pipeline 4) with a byte-level BPE of 8192 tokens, so
the first stage's embedding and the last stage's ``[s, b, 8192]`` head and loss weigh about as much as a few
layers.  ``pipecast tune --virtual 1`` measures the even split's stage costs and ranks every candidate, the
lighter-end layouts (``engine.plan.layout.lighter_ends``) among them, by predicted step time.  The best candidate
with a layout and the same candidate on the even split then train ``--steps`` steps each, round-robin on the same
ranks (the tuner's ``--verify`` workers); their median step times and the predictions are printed and written to
``benchmarks/results/layout.json``.

    python benchmarks/layout.py                # about 10 minutes on 2 busy cores
    python benchmarks/layout.py --steps 10
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, write_json  # noqa: E402

PRESET = ("configs/pp4_1f1b.yaml", ["--data.tokenizer=bpe", "--model.vocab_size=8192", "--data.max_bytes=2000000"])


def _candidate(entry: dict):
    from engine.plan.candidates import Candidate
    from engine.plan.pass_costs import PassCosts
    s = entry["settings"]
    costs = s.get("parallel.schedule_costs")
    return Candidate(s["parallel.schedule"], s["parallel.virtual"], s.get("parallel.microbatch_group_size_per_vp_stage"),
                     s.get("parallel.max_in_flight"), s.get("model.pipeline_layout"),
                     None if costs is None else PassCosts.parse(costs))


def side_by_side(config_path: str, overrides: list[str], layout: dict, even: dict, steps: int, run_dir: str) -> list:
    """Median step time (slowest rank, ms) of the two candidates, trained round-robin on the config's ranks."""
    from engine.training.config import load_config, parse_override_args
    from engine.training.tune.measure import step_times
    from engine.training.tune.tuner import _everywhere, _shared, verify_worker
    config = load_config(config_path, parse_override_args(overrides + [f"--logging.run_dir={run_dir}"]))
    cands = [_candidate(layout), _candidate(even)]
    per_rank = _everywhere(verify_worker, config, cands, steps, 2, _shared(run_dir), True)
    return [statistics.median(step_times(per_rank, i)) for i in range(len(cands))]


def main(argv=None) -> int:
    from engine.cli import main as pipecast
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path, overrides = str(ROOT / PRESET[0]), PRESET[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tune.json"
        status = pipecast(["tune", path, "--virtual", "1", "--steps", str(args.steps), "--json", str(out),
                           *overrides, f"--logging.run_dir={tmp}/run"])
        if status != 0:
            raise SystemExit(f"pipecast tune exited {status}")
        ranked = json.loads(out.read_text())["candidates"]
        layout = next(c for c in ranked if c["settings"].get("model.pipeline_layout"))
        even_settings = {k: v for k, v in layout["settings"].items() if k != "model.pipeline_layout"}
        even = next(c for c in ranked if c["settings"] == even_settings)
        measured = side_by_side(path, overrides, layout, even, args.steps, f"{tmp}/verify")
    rows = [{"label": c["label"], "layout": c["settings"].get("model.pipeline_layout") or "even",
             "rank": ranked.index(c) + 1, "predicted_ms": c["predicted_ms"], "measured_ms": m}
            for c, m in zip((layout, even), measured)]
    for r in rows:
        print(f"{r['label']:<48} tune rank {r['rank']:>3}  predicted {r['predicted_ms']:8.1f} ms  measured "
              f"{r['measured_ms']:8.1f} ms")
    faster = rows[0]["measured_ms"] < rows[1]["measured_ms"]
    goals = [{"goal": "the layout tune picks measures faster than the even split", "value":
              rows[1]["measured_ms"] / rows[0]["measured_ms"], "met": faster},
             {"goal": "the simulator predicted the order", "value": rows[1]["predicted_ms"] / rows[0]["predicted_ms"],
              "met": (rows[0]["predicted_ms"] < rows[1]["predicted_ms"]) == faster}]
    for g in goals:
        print(f"{'met' if g['met'] else 'MISSED'}: {g['goal']} ({g['value']:.3f})")
    print(f"wrote {write_json('layout', {'preset': [PRESET[0], *overrides], 'rows': rows, 'goals': goals}, args.out)}")
    return 0 if all(g["met"] for g in goals) else 1


if __name__ == "__main__":
    raise SystemExit(main())
