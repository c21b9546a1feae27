"""Cost-aware zero-bubble plans on the zero-bubble paper's settings, V-Half / V-Min, and build times.

Source of the settings: Qi, Wan, Huang and Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:2401.10241 --
Table 9 (appendix D: profiled ``T_F``, ``T_B``, ``T_W``, ``T_comm`` in ms per model, ``p`` and ``m``), Table 5 (the
bubble rates of 1F1B, ZB-H1, ZB-H2 and of the automatic ZB-1p / ZB-2p), Table 3 (hidden size ``h``, heads ``a``,
sequence ``s = 1024``) and Table 1 (activation memory of a layer: ``M_B = sb(34h + 5as)`` for ``B``, ``M_W = 32sbh``
held until ``W``).  Bubble rate as the paper defines it: ``(cost - m (T_F + T_B + T_W)) / cost``, cost the longest
stage from its first forward to its last action (the simulated plan's longest rank span).

The cost-aware plan (``zb`` given costs, :mod:`engine.plan.cost_aware`) is built for the table's costs with the
paper's memory model -- a pending ``W`` holds ``M_W / M_B`` of an activation -- under an activation budget of ``p``
(ZB-1p) and ``2p`` (ZB-2p) activations per rank; its peak memory (activations held plus weighted pending ``W``, in
``M_B``) is printed beside.  For context: ZB-H1 and the list scheduler's plan at ``2p`` (``zb`` without costs,
H2-shaped), simulated with the same costs.  V-Half / V-Min (:mod:`engine.plan.controllable`) with ``F = B = W``:
bubble (chunk-pass slots) against 1F1B's ``6(p-1)`` and activation memory (microbatches, ``F`` to ``W``) against the
controllable-memory paper's ``(p+2)//2`` / ``(p+4)//3`` (Qi et al., NeurIPS 2024, arXiv:2405.15362).  Build times:
this process's CPU time (the machine may be shared), best of ``--repeat``.

    python benchmarks/zero_bubble_costs.py [--repeat 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_json  # noqa: E402
from engine.plan import Op, build_plan  # noqa: E402
from engine.plan.pass_costs import PassCosts  # noqa: E402
from engine.plan.simulate import simulate  # noqa: E402
from engine.plan.validate import validate_plan  # noqa: E402

# Table 9: (model, p, m) -> (T_F, T_B, T_W, T_comm) in ms
PROFILED = {("1.5B", 8, 24): (18.522, 18.086, 9.337, 0.601), ("1.5B", 8, 32): (18.513, 18.086, 9.331, 0.626),
            ("1.5B", 8, 64): (18.546, 18.097, 9.321, 0.762), ("6.2B", 8, 24): (29.718, 29.444, 19.927, 0.527),
            ("6.2B", 8, 32): (29.802, 29.428, 19.530, 0.577), ("6.2B", 8, 64): (29.935, 29.621, 19.388, 0.535),
            ("14.6B", 16, 48): (11.347, 11.248, 8.132, 0.377), ("14.6B", 16, 64): (11.307, 11.254, 8.101, 0.379),
            ("14.6B", 16, 128): (11.325, 11.308, 8.109, 0.378), ("28.3B", 32, 96): (10.419, 10.207, 7.715, 0.408),
            ("28.3B", 32, 128): (10.408, 10.204, 7.703, 0.408), ("28.3B", 32, 256): (10.402, 10.248, 7.698, 0.460)}
# Table 5: (model, p, m) -> (1F1B, ZB-H1, ZB-H2, ZB-1p, ZB-2p) bubble rates
PAPER = {("1.5B", 8, 24): (0.2431, 0.1585, 0.1083, 0.1585, 0.0433),
         ("1.5B", 8, 32): (0.1985, 0.1242, 0.0837, 0.1242, 0.0039),
         ("1.5B", 8, 64): (0.1240, 0.0674, 0.0444, 0.0674, 0.0026),
         ("6.2B", 8, 24): (0.2347, 0.1323, 0.0698, 0.1323, 0.0029),
         ("6.2B", 8, 32): (0.1898, 0.1045, 0.0559, 0.1045, 0.0022),
         ("6.2B", 8, 64): (0.1091, 0.0554, 0.0294, 0.0554, 0.0010),
         ("14.6B", 16, 48): (0.2552, 0.1397, 0.0672, 0.1397, 0.0066),
         ("14.6B", 16, 64): (0.2082, 0.1088, 0.0516, 0.1088, 0.0054),
         ("14.6B", 16, 128): (0.1251, 0.0576, 0.0266, 0.0576, 0.0028),
         ("28.3B", 32, 96): (0.2646, 0.1421, 0.0641, 0.1421, 0.0038),
         ("28.3B", 32, 128): (0.2168, 0.1106, 0.0490, 0.1106, 0.0029),
         ("28.3B", 32, 256): (0.1352, 0.0594, 0.0257, 0.0594, 0.0018)}
SHAPE = {"1.5B": (2304, 24), "6.2B": (4096, 32), "14.6B": (5120, 40), "28.3B": (6144, 48)}  # Table 3: h, a


def weight_memory(model: str, seq: int = 1024) -> float:
    """``M_W / M_B`` of Table 1 for the model's ``h`` and ``a``."""
    h, a = SHAPE[model]
    return 32 * h / (34 * h + 5 * a * seq)


def paper_rate(plan, costs: PassCosts, m: int) -> float:
    """The paper's bubble rate of ``plan`` simulated under ``costs`` (one cost per pass)."""
    sim = simulate(plan, **costs.simulation()) if plan.splits_backward else simulate(
        plan, costs.forward, costs.backward + costs.weight, costs.transfer)
    cost = max(end[-1] - start[0] for start, end in zip(sim.start, sim.end))
    return (cost - m * (costs.forward + costs.backward + costs.weight)) / cost


def peak_memory(plan, w: float) -> float:
    """Largest per-rank peak of activations held plus ``w`` per pending W, in activations (``M_B``)."""
    peak = 0.0
    for acts in plan.actions:
        level = 0.0
        for a in acts:
            level += 1.0 if a.op is Op.FORWARD else (w - 1.0 if a.op is Op.BACKWARD else -w)
            peak = max(peak, level)
    return peak


def paper_rows() -> list[dict]:
    rows = []
    for (model, p, m), (f, b, w, t) in PROFILED.items():
        costs = PassCosts(f, b, w, t, weight_memory(model))
        paper = dict(zip(("1f1b", "zb_h1", "zb_h2", "zb_1p", "zb_2p"), PAPER[(model, p, m)]))
        row = {"model": model, "p": p, "m": m, "costs": str(costs), "paper": paper,
               "1f1b": paper_rate(build_plan("1f1b", p, m), costs, m),
               "zb_h1": paper_rate(build_plan("zb_h1", p, m), costs, m),
               "zb_list_2p": paper_rate(build_plan("zb", p, m, max_in_flight=2 * p), costs, m)}
        for budget, key in ((p, "1p"), (2 * p, "2p")):
            t0 = time.process_time()
            plan = build_plan("zb", p, m, max_in_flight=budget, costs=costs)
            row[f"build_cpu_s_{key}"] = time.process_time() - t0
            validate_plan(plan)
            row[f"cost_aware_{key}"] = paper_rate(plan, costs, m)
            row[f"peak_memory_{key}"] = peak_memory(plan, costs.weight_memory)
            row[f"at_or_below_{key}"] = round(row[f"cost_aware_{key}"], 4) <= paper[f"zb_{key}"]
        rows.append(row)
    return rows


def print_paper(rows: list[dict]) -> None:
    print("bubble rate on the zero-bubble paper's settings (arXiv:2401.10241, Tables 5 and 9); cost-aware = zb built "
          "for the costs, budget p / 2p activations (pending W weighted by M_W/M_B); peak = its memory in M_B")
    print(f"{'model':>6} {'p':>3} {'m':>4} | {'1F1B':>7} {'ZB-H1':>7} {'list 2p':>7} | {'ZB-1p':>7} {'ours 1p':>7} "
          f"{'peak':>5} | {'ZB-2p':>7} {'ours 2p':>7} {'peak':>5} | ok")
    for r in rows:
        ok = "yes" if r["at_or_below_1p"] and r["at_or_below_2p"] else "NO"
        print(f"{r['model']:>6} {r['p']:>3} {r['m']:>4} | {r['1f1b']:7.4f} {r['zb_h1']:7.4f} {r['zb_list_2p']:7.4f} | "
              f"{r['paper']['zb_1p']:7.4f} {r['cost_aware_1p']:7.4f} {r['peak_memory_1p']:5.1f} | "
              f"{r['paper']['zb_2p']:7.4f} {r['cost_aware_2p']:7.4f} {r['peak_memory_2p']:5.1f} | {ok}")


def controllable_rows() -> list[dict]:
    rows = []
    for p in (4, 8, 16, 32):
        m = 3 * p
        for name, paper in (("v_half", (p + 2) // 2), ("v_min", (p + 4) // 3), ("1f1b", p)):
            chunks = 1 if name == "1f1b" else 2
            plan = build_plan(name, p, m, chunks)
            unit = 2.0 / chunks  # one chunk pass is one slot: a stage of one chunk costs two
            sim = simulate(plan, unit, unit, 0.0, unit) if plan.splits_backward else simulate(plan, unit, 2 * unit)
            span = max(end[-1] - start[0] for start, end in zip(sim.start, sim.end))
            release = Op.WEIGHT if plan.splits_backward else Op.BACKWARD
            held = max(_held(acts, release) for acts in plan.actions) / chunks
            rows.append({"schedule": name, "p": p, "m": m, "bubble_slots": span - 6 * m,
                         "1f1b_bubble_slots": 6 * (p - 1), "memory_microbatches": held, "paper_memory": paper})
    return rows


def _held(acts, release: Op) -> int:
    """Peak chunk activations of a rank, each from its F to its ``release`` pass (W when split)."""
    level = peak = 0
    for a in acts:
        level += (a.op is Op.FORWARD) - (a.op is release)
        peak = max(peak, level)
    return peak


def print_controllable(rows: list[dict]) -> None:
    print("\nV-Half / V-Min with F = B = W (one slot per chunk pass; m = 3p): bubble against 1F1B's, memory (F to W, "
          "microbatches) against the controllable-memory paper (arXiv:2405.15362)")
    print(f"{'schedule':>8} {'p':>3} | {'bubble':>6} {'of 1F1B':>8} | {'memory':>6} {'paper':>5}")
    for r in rows:
        share = r["bubble_slots"] / r["1f1b_bubble_slots"]
        print(f"{r['schedule']:>8} {r['p']:>3} | {r['bubble_slots']:6.0f} {share:8.3f} | "
              f"{r['memory_microbatches']:6.1f} {r['paper_memory']:5d}")


def build_times(repeat: int) -> list[dict]:
    rows = []
    for p, m in ((8, 64), (16, 128), (32, 256)):
        costs = PassCosts(10.4, 10.25, 7.7, 0.46, weight_memory("28.3B"))
        for name, chunks in (("zb", 1), ("zbv", 2)):
            cpu, wall = [], []
            for _ in range(repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                build_plan(name, p, m, chunks, max_in_flight=2 * p * chunks, costs=costs)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            rows.append({"schedule": name, "p": p, "m": m, "chunks": chunks, "budget": 2 * p * chunks,
                         "cpu_s": min(cpu), "wall_s": min(wall), "cpu_runs": cpu, "wall_runs": wall})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="builds per size for the build times (best reported)")
    parser.add_argument("--json", default=None, help="write here instead of benchmarks/results/zero_bubble_costs.json")
    args = parser.parse_args(argv)
    paper = paper_rows()
    print_paper(paper)
    controllable = controllable_rows()
    print_controllable(controllable)
    times = build_times(max(1, args.repeat))
    print("\nbuild time of cost-aware plans (28.3B's costs, budget 2p activations; best of "
          f"{args.repeat}; CPU time of this process, wall beside)")
    for r in times:
        print(f"  {r['schedule']:>3} p={r['p']:>2} m={r['m']:>3}: {r['cpu_s']:.2f} s cpu, {r['wall_s']:.2f} s wall")
    met = all(r["at_or_below_1p"] and r["at_or_below_2p"] for r in paper)
    print(f"\ngoal (at or below the paper's ZB-1p / ZB-2p on every setting): {'met' if met else 'MISSED'}")
    path = write_json("zero_bubble_costs", {"paper_settings": paper, "controllable": controllable,
                                            "build_times": times, "goal_met": met}, args.json)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
