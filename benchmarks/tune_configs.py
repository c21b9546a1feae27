"""``pipecast tune --verify`` on the default config (pp=2) and on ``configs/pp4_1f1b.yaml``: the ranked table,
predicted against measured step time of the verified candidates, and whether the best measures no slower than the
config's own schedule.  Writes ``benchmarks/results/tune_configs.json``.

    python benchmarks/tune_configs.py                 # both configs, 20 recorded steps per layout (~4 min)
    python benchmarks/tune_configs.py --steps 8 --configs configs/default.yaml
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, write_json  # noqa: E402

CONFIGS = ["configs/default.yaml", "configs/pp4_1f1b.yaml"]


def tune(config: str, steps: int, warmup: int, top: int) -> dict:
    from engine.cli import main as pipecast
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tune.json"
        t0 = time.perf_counter()
        status = pipecast(["tune", str(ROOT / config), "--steps", str(steps), "--warmup", str(warmup), "--verify",
                           "--verify-top", str(top), "--json", str(out), f"--logging.run_dir={tmp}/run"])
        seconds = time.perf_counter() - t0
        if status != 0:
            raise SystemExit(f"pipecast tune {config} exited {status}")
        result = json.loads(out.read_text())
    verified = result["verified"]
    own = next(r for r in verified if r["is_config"])
    predicted = result.get("best_predicted") or result["best"]  # the recommendation before --verify measured
    best = next(r for r in verified if r["label"] == predicted["label"])
    fastest = min(verified, key=lambda r: r["measured_ms"])
    return {"config": config, "seconds": seconds, "best": predicted["label"], "after_verify": result["best"]["label"],
            "top": result["candidates"][0]["label"], "min_gain": result["min_gain"],
            "own": result["config"]["label"], "candidates": [
                {k: c[k] for k in ("label", "predicted_ms", "bubble", "peak_memory_bytes", "fits")}
                for c in result["candidates"]],
            "verified": verified,
            "drift": own["measured_ms"] / result["measured"]["layouts"][result["config"]["label"]]["step_ms"] - 1,
            "best_measured_no_slower": best["measured_ms"] <= own["measured_ms"],
            "fastest_measured": fastest["label"], "measured": result["measured"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=CONFIGS)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--verify-top", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = [tune(c, args.steps, args.warmup, args.verify_top) for c in args.configs]
    goals = []
    for r in runs:
        worst = max(abs(v["error"]) for v in r["verified"])
        relative = max(abs(v["relative_error"]) for v in r["verified"])
        goals += [{"goal": f"{r['config']}: every verified prediction within 10% (worst |error|)", "value": worst,
                   "met": worst <= 0.10},
                  {"goal": f"{r['config']}: every verified ratio to the config's own within 10% (worst |error|)",
                   "value": relative, "met": relative <= 0.10},
                  {"goal": f"{r['config']}: the recommendation ({r['best']}) measures no slower than the config's own "
                           f"(1 = yes)",
                   "value": float(r["best_measured_no_slower"]), "met": r["best_measured_no_slower"]}]
        if r["config"] == "configs/default.yaml":
            goals.append({"goal": "tune --verify on the default config under 120 s (seconds)", "value": r["seconds"],
                          "met": r["seconds"] < 120})
    path = write_json("tune_configs", {"steps": args.steps, "warmup": args.warmup, "runs": runs, "goals": goals},
                      args.out)
    for g in goals:
        print(f"{'met' if g['met'] else 'MISSED'}: {g['goal']}: {g['value']:.3f}")
    print(f"wrote {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
