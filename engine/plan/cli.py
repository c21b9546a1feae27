"""``pipecast schedule``: print a schedule's per-rank action grid and its simulated bubble; optionally plot / save.

Example::

    pipecast schedule --pp 4 --vp 2 --microbatches 8 --plot out.png --json out.json

The schedule follows Megatron's choice (``get_forward_backward_func``): ``--vp 1`` (default) gives 1F1B, or no
pipelining with ``--pp 1``; ``--vp >= 2`` gives interleaved 1F1B (``--schedule interleaved`` also forces it for
``--vp 1``, as Megatron does for ``virtual_pipeline_model_parallel_size=1``).  ``--schedule zb_h1 | zbv | zb``
select the split-backward schedules (``zbv`` implies ``--vp 2``; ``zb`` and ``zbv`` take ``--max-in-flight`` and
``--max-pending-w``), ``v_half`` / ``v_min`` the controllable-memory V schedules.  Costs are per model chunk; with
``--weight-time W > 0`` the backward time is the input-gradient pass ``B`` and ``W`` the weight-gradient pass, so
unsplit schedules cost ``B + W`` per backward (``W = 0``, the default: one backward of ``--backward-time``).
``--cost-aware`` builds the plan for those same costs (``zb`` / ``zbv``: :mod:`engine.plan.cost_aware`), with
``--weight-memory`` the memory of a pending ``W`` as a fraction of an activation::

    pipecast schedule --schedule zb --pp 8 -m 24 --max-in-flight 16 --cost-aware --forward-time 18.522 \
        --backward-time 18.086 --weight-time 9.337 --transfer-time 0.601 --weight-memory 0.366

For a mixture-of-experts model, ``--a2a-time A`` is the expert all-to-all time of one chunk forward (dispatch and
combine; a backward exchanges as much), waited by each action, and ``--overlap-moe`` runs the forward-backward cells
overlapped (DualPipeV's cells; Megatron's combined 1F1B for interleaved and no pipelining,
``overlap_moe_expert_parallel_comm``), hiding each side's all-to-all behind the other's compute
(:mod:`engine.plan.simulate`) -- so schedules can be ranked for an MoE model from its costs.

Limits, checked before any work (exit status 2, naming the option): ``--pp`` at most :data:`MAX_PP` = 16384
(validation and simulation cost grows with the ranks; 16384 ranks take ~5 s), ``P * C * M`` (forwards per step,
all ranks)
at most :data:`MAX_FORWARDS` = 2**20 -- the plan, its validation and the simulation hold every action as a Python
object (about 0.5 KB each; 2**20 forwards take ~7 s and ~0.6 GB) -- and at most :data:`MAX_PLOT_FORWARDS` = 2**16
with ``--plot`` (one bar per action; larger charts take minutes and cannot be read).  The action grid and the
per-rank lines are printed only up to :data:`GRID_MAX_RANKS` ranks and :data:`GRID_MAX_COLUMNS` actions per rank;
beyond that a summary is printed (``--grid`` prints them anyway, ``--json`` writes every rank's actions).
``--plot`` / ``--json`` must name a file in an existing, writable folder.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import sys
from pathlib import Path

from .build import Plan, build_plan
from .pass_costs import PassCosts
from .registry import auto_schedule, find_schedule, get_schedule, schedule_names, virtual_or_none
from .simulate import Simulation, simulate
from .validate import max_buffered_messages, validate_plan

__all__ = ["add_arguments", "run", "MAX_PP", "MAX_FORWARDS", "MAX_PLOT_FORWARDS", "GRID_MAX_RANKS", "GRID_MAX_COLUMNS"]

MAX_PP = 16384
MAX_FORWARDS = 2 ** 20
MAX_PLOT_FORWARDS = 2 ** 16
GRID_MAX_RANKS = 64
GRID_MAX_COLUMNS = 256


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _time(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be a finite number >= 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``schedule`` options on ``parser``."""
    parser.add_argument("--pp", type=_positive_int, default=None, help="pipeline ranks P (default 4)")
    parser.add_argument("--vp", type=_positive_int, default=None,
                        help="model chunks per rank (virtual pipeline size; default 1, or the count the "
                             "schedule takes, e.g. 2 with --schedule zbv); "
                             ">= 2 selects interleaved 1F1B")
    parser.add_argument("--microbatches", "-m", type=_positive_int, default=None, help="microbatches M (default 8)")
    parser.add_argument("--group-size", type=_positive_int, default=None,
                        help="microbatch_group_size_per_vp_stage G for interleaved 1F1B (default P)")
    parser.add_argument("--schedule", choices=("auto",) + schedule_names(), default="auto",
                        help="schedule (the registered ones); 'auto' picks it from --pp/--vp like Megatron")
    parser.add_argument("--forward-only", action="store_true", help="evaluation plan (forwards only)")
    parser.add_argument("--forward-time", type=_time, default=1.0, help="cost of one chunk forward (default 1)")
    parser.add_argument("--backward-time", type=_time, default=2.0, help="cost of one chunk backward (default 2)")
    parser.add_argument("--weight-time", type=_time, default=0.0,
                        help="cost of one weight-gradient pass W; then --backward-time is the input-gradient pass "
                             "and unsplit schedules cost B+W per backward (default 0: no split)")
    parser.add_argument("--transfer-time", type=_time, default=0.0, help="latency of every message (default 0)")
    parser.add_argument("--a2a-time", type=_time, default=0.0,
                        help="MoE: expert all-to-all time of one chunk forward (and of one backward; default 0)")
    parser.add_argument("--overlap-moe", action="store_true",
                        help="MoE: overlapped forward-backward cells (overlap_moe_expert_parallel_comm): DualPipeV's "
                             "cells, Megatron's combined 1F1B for interleaved / no pipelining")
    parser.add_argument("--max-in-flight", type=_positive_int, default=None,
                        help="--schedule zb / zbv: per-rank limit on activations held (default C*(P-r), 1F1B's, for "
                             "zb; 2*P for zbv); with --cost-aware it counts pending W by --weight-memory too")
    parser.add_argument("--max-pending-w", type=_positive_int, default=None,
                        help="--schedule zb / zbv: per-rank limit on pending weight-gradient passes (default: "
                             "--max-in-flight; with --cost-aware and --weight-memory > 0 none)")
    parser.add_argument("--cost-aware", action="store_true",
                        help="--schedule zb / zbv: build the plan for --forward-time, --backward-time, --weight-time "
                             "and --transfer-time (the order with the shortest simulated step within the limits)")
    parser.add_argument("--weight-memory", type=_time, default=0.0,
                        help="with --cost-aware: memory a pending W holds, as a fraction of one activation "
                             "(default 0: pending W counted apart, by --max-pending-w)")
    parser.add_argument("--from-csv", type=Path, default=None, metavar="FILE.csv",
                        help="read the plan from torch.distributed.pipelining's compute-only CSV (rows = ranks, "
                             "actions like 0F3, 1I0, 0W2, 1B0; DualPipeV's (0F3;3B1)OVERLAP_F_B runs its parts in "
                             "order, REDUCE_GRAD is dropped) instead of building one; it is validated first")
    parser.add_argument("--csv", type=Path, default=None, metavar="OUT.csv",
                        help="write the plan as a compute-only CSV in torch's action grammar")
    parser.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="draw a Gantt chart")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="write plan and timeline")
    parser.add_argument("--grid", action="store_true",
                        help=f"print the action grid and per-rank lines at any size (default: only up to "
                             f"{GRID_MAX_RANKS} ranks and {GRID_MAX_COLUMNS} actions per rank)")
    parser.set_defaults(_parser=parser)


def _schedule(args) -> str:
    """The schedule asked for (``auto``: Megatron's choice from ``--pp`` / ``--vp``); fills in ``args.vp``."""
    if args.vp is None:
        chunks = get_schedule(args.schedule).chunks if args.schedule != "auto" else None
        args.vp = chunks or 1
    if args.schedule != "auto":
        return args.schedule
    return auto_schedule(args.pp, virtual_or_none(args.vp))


def _costs(plan: Plan, args) -> dict:
    """Simulator costs: a split plan pays B and W separately; an unsplit one B + W per backward."""
    moe = dict(a2a_time=args.a2a_time, overlap=args.overlap_moe)
    if plan.splits_backward:
        return dict(forward_time=args.forward_time, backward_time=args.backward_time,
                    weight_time=args.weight_time, transfer_time=args.transfer_time, **moe)
    return dict(forward_time=args.forward_time, backward_time=args.backward_time + args.weight_time,
                transfer_time=args.transfer_time, **moe)


def _check_size(parser, args) -> None:
    """Exit 2 if the plan is too large to build (or to plot) in reasonable time and memory."""
    if args.pp > MAX_PP:
        parser.error(f"--pp {args.pp} is more than {MAX_PP} pipeline ranks: validating and simulating the plan costs "
                     f"time per rank and message (~5 s for {MAX_PP} ranks); use --pp <= {MAX_PP}")
    forwards = args.pp * args.vp * args.microbatches
    sizes = f"--pp {args.pp} x --vp {args.vp} x --microbatches {args.microbatches} = {forwards}"
    if forwards > MAX_FORWARDS:
        parser.error(f"{sizes} forwards per step is more than {MAX_FORWARDS} (2**20): the plan holds every action as "
                     "a Python object (2**20 forwards take ~7 s and ~0.6 GB to build and simulate); reduce --pp, "
                     "--vp or --microbatches")
    if args.plot is not None and forwards > MAX_PLOT_FORWARDS:
        parser.error(f"--plot {args.plot}: {sizes} forwards is more than {MAX_PLOT_FORWARDS} (2**16) bars to draw "
                     "(minutes, unreadable); plot a smaller schedule, or use --json for the full timeline")


def _check_output(parser, option: str, path, example: str) -> None:
    """Exit 2 unless ``path`` can be written: its folder exists and is writable, and it is not a folder."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        parser.error(f"{option} {path}: is a folder; name a file, e.g. {path / example}")
    if not folder.is_dir():
        parser.error(f"{option} {path}: folder {folder} does not exist; create it first or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{option} {path}: folder {folder} is not writable; choose another path")
    if path.exists() and not os.access(path, os.W_OK):
        parser.error(f"{option} {path}: the file exists and is not writable; remove it or choose another path")


def run(args) -> int:
    """Build, validate and simulate the plan; print grid and bubbles; write the plot / JSON if asked.

    Bad values (including sizes above the limits and output paths that cannot be written) exit with status 2 and a
    message naming the option (argparse's ``error``), before any work.
    """
    parser: argparse.ArgumentParser = args._parser
    given = {"--pp": args.pp, "--vp": args.vp, "--microbatches": args.microbatches}
    args.pp, args.microbatches = args.pp or 4, args.microbatches or 8
    schedule = _schedule(args)
    for option, value, name in (("--group-size", args.group_size, "group_size"),
                                ("--max-in-flight", args.max_in_flight, "max_in_flight"),
                                ("--max-pending-w", args.max_pending_w, "max_pending_w"),
                                ("--cost-aware", args.cost_aware or None, "costs")):
        if value is not None and name not in get_schedule(schedule).options:
            takers = " / ".join(n for n in schedule_names() if name in get_schedule(n).options)
            shown = option if value is True else f"{option} {value}"
            parser.error(f"{shown} only applies to {takers} (the schedule is {schedule}); "
                         + ("add --vp 2 (or more)" if name == "group_size" and args.schedule == "auto" else
                            f"use --schedule {takers}"))
    _check_size(parser, args)
    _check_output(parser, "--json", args.json, "plan.json")
    _check_output(parser, "--plot", args.plot, "plan.png")
    if args.plot is not None:
        from .plotting import check_plot_path
        try:
            check_plot_path(args.plot)
        except ValueError as exc:
            parser.error(f"--plot {args.plot}: {exc}")
    _check_output(parser, "--csv", args.csv, "plan.csv")
    plan = _plan_from_csv(parser, args, given) if args.from_csv is not None else _build(parser, args, schedule)
    _check_size(parser, args)  # again with the file's sizes (--from-csv)
    validate_plan(plan)
    sim = simulate(plan, **_costs(plan, args))
    buffered = max_buffered_messages(plan, sim)
    print(report(plan, sim, buffered, args))
    if args.json is not None:
        _write(parser, "--json", args.json, lambda p: p.write_text(json.dumps(to_json(plan, sim, buffered), indent=1)))
    if args.csv is not None:
        from .torch_csv import plan_to_csv
        _write(parser, "--csv", args.csv, lambda p: p.write_text(plan_to_csv(plan)))
    if args.plot is not None:
        from .plotting import plot_timeline
        group = f" G={plan.group_size}" if _takes_group(plan) else ""
        title = (f"{schedule} pp={plan.pp_size} vp={plan.num_model_chunks} m={plan.num_microbatches}{group}"
                 f"{' forward-only' if plan.forward_only else ''}: makespan "
                 f"{sim.makespan:g}, bubble {100 * sim.bubble_overall:.1f}% (bars: microbatch.chunk)")
        _write(parser, "--plot", args.plot, lambda p: plot_timeline(sim.bars(), p, title, bubbles=sim.bubble))
    return 0


def _write(parser, option: str, path: Path, write) -> None:
    """``write(path)``, then ``wrote PATH``; a write the operating system refuses (full or read-only disk, no
    permission) exits 2 naming the option, the path and the reason, and removes the partial file."""
    try:
        write(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        full = exc.errno == errno.ENOSPC
        parser.error(f"{option} {path}: cannot be written: {exc.strerror or exc}{where}; "
                     + ("free space there or choose another path" if full else "choose another path"))
    print(f"wrote {path}")


def _takes_group(plan: Plan) -> bool:
    spec = find_schedule(plan.schedule)
    return spec is not None and "group_size" in spec.options


def _build(parser, args, schedule) -> Plan:
    overlap = args.overlap_moe and "overlap_moe_expert_parallel_comm" in get_schedule(schedule).options
    try:
        plan = build_plan(schedule, args.pp, args.microbatches, args.vp, args.group_size, args.forward_only,
                          max_in_flight=args.max_in_flight, max_pending_w=args.max_pending_w, costs=_pass_costs(args),
                          overlap_moe_expert_parallel_comm=overlap or None)
    except (ValueError, RuntimeError) as exc:  # Megatron's validation errors: bad option values
        parser.error(f"{exc} (options --pp {args.pp} --vp {args.vp} --microbatches {args.microbatches}"
                     + (f" --group-size {args.group_size}" if args.group_size is not None else "") + ")")
    if args.overlap_moe and not plan.compounds:  # the same rule as parallel.overlap_moe_expert_parallel_comm
        parser.error(f"--overlap-moe: the {schedule} plan (--pp {args.pp} --vp {args.vp} --microbatches "
                     f"{args.microbatches}) has no forward-backward cells to overlap; use --schedule dualpipev or "
                     f"interleaved (--vp >= 2), or drop --overlap-moe")
    return plan


def _pass_costs(args) -> PassCosts | None:
    """``--cost-aware``: the simulation's costs as the builder's :class:`~engine.plan.pass_costs.PassCosts`."""
    if not args.cost_aware:
        return None
    return PassCosts(args.forward_time, args.backward_time, args.weight_time, args.transfer_time, args.weight_memory)


def _plan_from_csv(parser, args, given: dict) -> Plan:
    """``--from-csv``: the validated plan of the file, or exit 2 naming the file and the first bad action (or a
    size option given that disagrees with the file); sets ``args.pp`` / ``vp`` / ``microbatches`` from it."""
    from .torch_csv import plan_from_csv
    path = args.from_csv
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--from-csv {path}: cannot be read ({exc}); name a CSV file")
    try:
        plan = plan_from_csv(text, name=f"csv:{path.name}")
    except ValueError as exc:  # CsvScheduleError and PlanError
        parser.error(f"--from-csv {path}: {exc}")
    sizes = {"--pp": plan.pp_size, "--vp": plan.num_model_chunks, "--microbatches": plan.num_microbatches}
    for option, value in given.items():
        if value is not None and value != sizes[option]:
            parser.error(f"{option} {value} disagrees with --from-csv {path}, which has {sizes[option]}; drop "
                         f"{option} (the file sets it)")
    args.pp, args.vp, args.microbatches = plan.pp_size, plan.num_model_chunks, plan.num_microbatches
    return plan


def report(plan: Plan, sim: Simulation, buffered, args) -> str:
    """The text printed by ``pipecast schedule``: header, action grid, per-rank simulation figures."""
    mode = "forward-only" if plan.forward_only else "training"
    group = f" group_size={plan.group_size}" if _takes_group(plan) else ""
    columns = max((len(acts) for acts in plan.actions), default=0)
    full = getattr(args, "grid", False) or (plan.pp_size <= GRID_MAX_RANKS and columns <= GRID_MAX_COLUMNS)
    lines = [f"schedule {plan.schedule}: pp={plan.pp_size} vp={plan.num_model_chunks} "
             f"microbatches={plan.num_microbatches}{group} ({mode}); "
             f"action F/B/W<microbatch>.<chunk> (B = input gradient, W = weight gradient when split), "
             f"warmup = the plan's warmup forward steps"]
    if plan.placement is not None:
        lines.append("placement (stage: rank.chunk): " + " ".join(
            f"{s}:{r}.{c}" for s, (r, c) in enumerate(plan.stage_map)))
    if full:
        lines.append(plan.grid())
    else:
        lines.append(f"(action grid and per-rank lines omitted: {plan.pp_size} ranks x {columns} actions is more "
                     f"than {GRID_MAX_RANKS} ranks or {GRID_MAX_COLUMNS} actions per rank; add --grid to print "
                     "them, or --json OUT.json for every rank's actions and timeline)")
    weight = f", weight {args.weight_time:g}" if args.weight_time else ""
    built = (f"; the plan is built for these costs (weight_memory {args.weight_memory:g})"
             if getattr(args, "cost_aware", False) else "")
    a2a = getattr(args, "a2a_time", 0.0)
    moe = (f", all-to-all {a2a:g}" + (" (cells overlapped)" if getattr(args, "overlap_moe", False) else "")
           if a2a else "")
    lines += ["", f"simulated: forward {args.forward_time:g}, backward {args.backward_time:g}{weight}, transfer "
              f"{args.transfer_time:g}{moe} per model chunk{built}; bubble = idle / makespan, idle / compute = "
              "Megatron's (p-1)/(v*m)"]
    idle, bubble, of_ideal = sim.idle, sim.bubble, sim.bubble_of_ideal  # properties: compute once, not per rank

    def rank_line(rank: int) -> str:
        return (f"rank {rank}: busy {sim.busy[rank]:g}  idle {idle[rank]:g}  bubble {100 * bubble[rank]:.1f}%  "
                f"(idle / compute {100 * of_ideal[rank]:.1f}%)  peak in-flight activations {sim.peak_in_flight[rank]}  "
                + (f"peak pending W {sim.peak_pending_w[rank]}  " if plan.splits_backward else "")
                + f"peak buffered messages {buffered[rank]}")
    if full:
        lines += [rank_line(rank) for rank in range(plan.pp_size)]
    else:
        lo = min(range(plan.pp_size), key=bubble.__getitem__)
        hi = max(range(plan.pp_size), key=bubble.__getitem__)
        lines += [f"least bubble: {rank_line(lo)}", f"most bubble:  {rank_line(hi)}"]
    lines.append(f"makespan {sim.makespan:g}, overall bubble {100 * sim.bubble_overall:.1f}%")
    return "\n".join(lines)


def to_json(plan: Plan, sim: Simulation, buffered) -> dict:
    """Plan, per-rank timeline and figures as JSON-serialisable data."""
    return {
        "schedule": plan.schedule, "pp_size": plan.pp_size, "num_model_chunks": plan.num_model_chunks,
        "num_microbatches": plan.num_microbatches, "group_size": plan.group_size,
        "forward_only": plan.forward_only, "transfer_time": sim.transfer_time, "makespan": sim.makespan,
        "bubble_overall": sim.bubble_overall, "placement": [list(loc) for loc in plan.stage_map],
        "ranks": [{"rank": r, "warmup": plan.warmup[r], "actions": plan.action_labels(r), "start": sim.start[r],
                   "end": sim.end[r], "busy": sim.busy[r], "bubble": sim.bubble[r],
                   "bubble_of_ideal": sim.bubble_of_ideal[r], "peak_in_flight": sim.peak_in_flight[r],
                   "peak_pending_w": sim.peak_pending_w[r], "peak_buffered_messages": buffered[r]} for r in range(plan.pp_size)],
    }


if __name__ == "__main__":  # python -m engine.plan.cli ...
    _p = argparse.ArgumentParser(prog="pipecast schedule", description=__doc__)
    add_arguments(_p)
    sys.exit(run(_p.parse_args()))
