"""What ``pipecast tune`` prints and writes: the ranked candidate table, the JSON entries, predicted vs measured."""
from __future__ import annotations

import shlex

from ...plan.candidates import Candidate, Prediction

__all__ = ["candidate_entry", "print_table", "print_verified"]

_MIB = 2**20


def candidate_entry(p: Prediction, budget_bytes: float | None) -> dict:
    """One candidate of the JSON result: ``{"schedule", "settings", "label", "predicted_ms", "simulated_ms", "bubble",
    "peak_memory_bytes", "peak_in_flight", "peak_pending_w", "fits", "arguments"}``."""
    c = p.candidate
    return {"schedule": c.schedule, "settings": c.overrides(), "label": c.label, "predicted_ms": p.predicted_ms,
            "simulated_ms": p.simulated_ms, "schedule_ms": p.schedule_ms, "bubble": p.bubble, "peak_memory_bytes": list(p.peak_memory_bytes),
            "peak_in_flight": list(p.peak_in_flight), "peak_pending_w": list(p.peak_pending_w),
            "fits": p.fits(budget_bytes), "arguments": c.arguments()}


def print_table(ranked: list[Prediction], own: Candidate, budget_bytes: float | None, chosen: Prediction | None,
                min_gain: float, gain_source: str = "noise") -> None:
    """The ranked table (fitting candidates first, then by predicted step time), the recommendation's overrides
    and where the config's own schedule stands."""
    print(f"{'#':>3}  {'schedule':<36} {'predicted ms':>12} {'bubble':>7}  {'peak MiB per rank':<24} fits")
    for i, p in enumerate(ranked, 1):
        mem = "/".join(f"{b / _MIB:.1f}" for b in p.peak_memory_bytes)
        mark = "  <- config" if p.candidate == own else ""
        print(f"{i:>3}  {p.candidate.label:<36} {p.predicted_ms:>12.1f} {100 * max(0.0, p.bubble):>6.1f}%  {mem:<24} "
              f"{'yes' if p.fits(budget_bytes) else 'no'}{mark}")
    top, mine = ranked[0], next(p for p in ranked if p.candidate == own)
    gain = 100 * (1 - top.predicted_ms / mine.predicted_ms)
    if chosen is None:
        print("best: none -- no candidate fits the memory budget")
    elif top is mine:
        print(f"best: the config's own schedule ({own.label}), predicted {mine.predicted_ms:.1f} ms per step")
    elif chosen is mine:
        print(f"best: the config's own schedule ({own.label}): the top, {top.candidate.label}, is predicted only "
              f"{gain:.1f}% faster, {margin_reason(min_gain, gain_source)}")
    else:
        versus = (f"{gain:.1f}% faster than" if gain >= 0 else
                  f"{-gain:.1f}% slower than, but fits the memory budget unlike,")
        print(f"best: {top.candidate.label}, predicted {top.predicted_ms:.1f} ms per step, {versus} the config's own "
              f"({own.label}, #{ranked.index(mine) + 1}); overrides: {shlex.join(top.candidate.arguments())}")


def margin_reason(min_gain: float, gain_source: str = "noise") -> str:
    """Why a gain does not change the recommendation: below ``min_gain`` (a fraction), the measured noise or the
    ``--min-gain`` the user gave."""
    if gain_source == "noise":
        return f"less than the measurement noise ({100 * min_gain:.1f}%; --min-gain sets another margin)"
    return f"less than --min-gain={100 * min_gain:g}%"


def print_verified(rows: list[dict], own_measuring_ms: float | None = None) -> None:
    """Predicted against measured step time of each verified candidate: the error, and the error of its ratio to
    the config's own schedule (free of a machine that runs slower or faster than while measuring); then how the
    config's own step compares between the two phases."""
    print(f"{'schedule':<36} {'predicted ms':>12} {'measured ms':>12} {'error':>7} {'ratio error':>12}")
    for r in rows:
        print(f"{r['label']:<36} {r['predicted_ms']:>12.1f} {r['measured_ms']:>12.1f} {100 * r['error']:>+6.1f}% "
              f"{100 * r['relative_error']:>+11.1f}%{'  <- config' if r['is_config'] else ''}")
    fastest = min(rows, key=lambda r: r["measured_ms"])
    mine = next(r for r in rows if r["is_config"])
    print("the config's own schedule measured fastest" if fastest is mine else
          f"measured fastest: {fastest['label']}, {100 * (1 - fastest['measured_ms'] / mine['measured_ms']):.1f}% "
          f"faster than the config's own ({mine['label']})")
    if own_measuring_ms:
        print(f"the config's own schedule: {own_measuring_ms:.1f} ms per step while measuring, "
              f"{mine['measured_ms']:.1f} ms while verifying ({100 * (mine['measured_ms'] / own_measuring_ms - 1):+.1f}%"
              f"; 'error' includes that change of the machine's speed, 'ratio error' -- of the ratio to the "
              f"config's own -- does not)")
