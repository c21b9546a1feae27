"""``pipecast tune CONFIG [--section.key=value ...] [--memory-budget-gib X] [--steps N] [--json PATH] [--verify]``:
pick the schedule from measured costs and a memory budget.

1. **Measure.**  On the config's real ranks (the launcher of ``pipecast train``; nothing is checkpointed, the
   trainers write into a temporary folder), for every layout the candidates use -- virtual size ``v`` with the
   full backward and with the split one (B / W) -- a few training steps run with the timeline recorder
   (``--warmup`` unrecorded steps first, every step started by a barrier; the layouts' trainers are built together
   and stepped round-robin in a shuffled order, so outside load falls on all alike; ``--one-at-a-time`` builds
   one at a time instead).  From them: per stage the cost of
   ``F``, ``B`` and ``W`` (median over the recorded actions), the runtime's time per action outside
   compute and communication waits, and the step's time outside the schedule; after the steps, per stage, the
   bytes one microbatch's forward saves for the backward, the bytes its pending ``W`` holds after ``B``
   (:meth:`engine.runtime.split_backward.WeightGradWork.held_bytes`) and the parameter, gradient and optimizer
   state bytes.  The message latency is a ping-pong of one ``[s, b, h]`` activation between the first two pipeline
   ranks (half the median round trip).
2. **Predict.**  Every candidate of :func:`engine.plan.candidates.candidates` that is also a valid config is
   simulated with those costs (:func:`engine.plan.candidates.predict`), scaled by its layout's calibration: the
   measured over the simulated step of the schedule measured for that layout (what the simulator leaves out and
   a layout's schedules share, e.g. more ranks than cores); those whose peak memory on some rank is
   over ``--memory-budget-gib`` are marked as not fitting.  Beside the even split, each candidate is also ranked
   with a few uneven ``model.pipeline_layout`` values (:func:`layout_candidates`: the embedding's and the head's
   stages a layer lighter), its stage costs moved from the even measurement.  When none fits, each candidate is predicted again with
   ``model.recompute: selective`` and ``full`` (:func:`recompute_predictions`: the estimate's activation bytes,
   one more forward in ``B``), so that the budget may pick recomputation.  A ranked table is printed with the ``--parallel.*``
   overrides of the recommendation, and the config's own schedule is named in it.  The recommendation
   (:func:`choose`) is the top of the table, or the config's own schedule when the top is predicted less than
   ``--min-gain`` faster (default: the measured step noise, :func:`.tune_model.step_noise`).
   Candidates of schedules that take costs (``zb`` at each budget, ``zbv``) are also built for the measured costs
   (:func:`engine.plan.candidates.cost_aware_candidates`: per ``(rank, chunk)`` ``F``, ``B``, ``W`` and the
   pending-``W`` / activation bytes, the message latency), labelled ``cost-aware``; the config carries such a
   plan's costs in ``parallel.schedule_costs``.  With ``parallel.overlap_moe_expert_parallel_comm`` (a MoE model),
   interleaved candidates are also ranked as Megatron's combined 1F1B (:func:`engine.plan.candidates.
   overlap_candidates`, labelled ``overlap``: cells hiding the all-to-all, simulated with the measured all-to-all
   time), beside DualPipeV, whose cells exist either way.
3. **Verify** (``--verify``): the best ``--verify-top`` candidates, the config's own schedule, and the best
   cost-aware and the best hand-made split-backward shape (ZB-H1, ZB-V, V-Half, V-Min: no budget, no costs) run ``--steps`` steps each (no recorder;
   round-robin as above); predicted and measured step time (median over steps of the slowest rank) are printed.

The result goes to ``RUN_DIR/tune.json`` (what ``parallel.schedule: tuned`` reads, :mod:`.tune_result`) and to
``--json PATH``.  Under ``torchrun`` every process joins the job (as with ``pipecast train``) and global rank 0
prints and writes, then a `pipecast train` command that trains with the recommendation from where the run folder is
(:func:`train_hint`).  Exit status: 0, 1 (a rank failed), 2 (bad config / data / arguments, a result file that
cannot be written, or no candidate fits `--memory-budget-gib`: the message names the budget and the smallest peak;
the measurements are written anyway), 130 (interrupted), 143 (SIGTERM; nothing written).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ...plan.candidates import (Candidate, CostModel, candidates, cost_aware_candidates, overlap_candidates,
                                predict, rank_predictions, virtual_sizes)
from ...plan.pass_costs import PassCosts
from ...plan.registry import get_schedule
from ..config import ConfigError, TrainConfig, load_config, parse_override_args, validate
from .measure import cost_model, model_from_record, step_times
from .result import resolve_tuned, tune_path, tuned_for, tuned_overlap

MAX_STEPS = 100_000  # --steps + --warmup per measured layout

__all__ = ["add_arguments", "run", "MAX_STEPS", "config_candidate", "variant_config", "measurement_variants", "tune_worker",
           "verify_worker"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (e.g. configs/default.yaml)")
    parser.add_argument("--memory-budget-gib", type=float, default=None,
                        help="per-rank memory budget (GiB): parameters, gradients, optimizer state, activations and "
                             "pending W; candidates over it are marked as not fitting")
    parser.add_argument("--steps", type=int, default=10, help="recorded steps per measured layout (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="unrecorded steps before them (default 2)")
    parser.add_argument("--virtual", type=str, default=None,
                        help="comma-separated virtual sizes to consider (default: every size that divides the layers)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the result to PATH")
    parser.add_argument("--measured", metavar="TUNE_JSON", default=None,
                        help="rank with the measurements of an earlier result of this config (e.g. RUN_DIR/tune.json)"
                             " instead of measuring (another --memory-budget-gib, no rank started)")
    parser.add_argument("--verify", action="store_true",
                        help="then run the best candidates and the config's own schedule and print predicted vs "
                             "measured step time")
    parser.add_argument("--verify-top", type=int, default=3, help="how many of the best to verify (default 3)")
    parser.add_argument("--min-gain", type=float, default=None, metavar="PCT",
                        help="recommend another schedule than the config's own only if it is predicted at least PCT%% "
                             "faster (default: the measurement's noise, the standard error of the difference of two "
                             "measured medians)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="build one trainer at a time (for models too large for several copies per rank); by "
                             "default all measured layouts are built at once and stepped round-robin")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("Override any config field with --section.key=value, as for `pipecast train`. The best "
                     "schedule is saved in RUN_DIR/tune.json; `--parallel.schedule=tuned` (or `parallel.schedule: "
                     "tuned` in the YAML) trains with it.")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``pipecast tune``; returns the exit status."""
    from ...runtime.spawn import Interrupted, RankError, Terminated
    try:
        config, cands, own = _prepare(args)
    except (ConfigError, TypeError, ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with _job(config) as coordinator:
            with contextlib.nullcontext() if coordinator else contextlib.redirect_stdout(io.StringIO()):
                result = _tune(args, config, cands, own)
    except ConfigError as exc:  # --measured: a file that is not a tune result of this config
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RankError as exc:
        from ..launch import print_rank_error
        print_rank_error(exc)
        return 1
    except Terminated as exc:  # SIGTERM: nothing to save (a tune writes its result only at the end)
        print(f"error: {exc}; no tune result was written", file=sys.stderr)
        return 143
    except KeyboardInterrupt as exc:
        print(str(exc) if isinstance(exc, Interrupted) else "interrupted", file=sys.stderr)
        return 130
    if not coordinator:
        return 0
    return _report(args, config, result)


def _report(args, config: TrainConfig, result: dict) -> int:
    """Write the result (``RUN_DIR/tune.json``, ``--json``) and say how to train with it: 0; 2 when a file cannot
    be written or no candidate fits ``--memory-budget-gib`` (the measurements are written anyway, for
    ``--measured`` with another budget)."""
    from ..files import WriteError, write_atomically
    text = json.dumps(result, indent=1) + "\n"
    try:
        for path, option in ((tune_path(config), "logging.run_dir"), (args.json, "--json")):
            if path is not None:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                write_atomically([(Path(path), lambda p: p.write_text(text))], option)
    except (WriteError, OSError) as exc:  # OSError: the run folder cannot be created
        print(f"error: {exc}", file=sys.stderr)
        return 2
    wrote = f"wrote {tune_path(config)}" + (f" and {args.json}" if args.json else "")
    if result["best"] is None:
        need = min(result["candidates"], key=lambda c: max(c["peak_memory_bytes"]))
        peak = max(need["peak_memory_bytes"])
        print(f"{wrote}\nerror: no schedule fits --memory-budget-gib={args.memory_budget_gib:g}: the smallest "
              f"predicted peak is {peak / 2**30:.4g} GiB ({peak / 2**20:.1f} MiB) per rank, {need['label']}; raise "
              f"--memory-budget-gib to at least {math.ceil(peak / 2**30 * 1e4) / 1e4:g} (re-rank without measuring: "
              f"--measured {tune_path(config)}) or make the model, micro_batch_size or seq_length smaller",
              file=sys.stderr)
        return 2
    print(f"{wrote}; {train_hint(args, config, result['best'])}")
    return 0


_TUNED_KEYS = tuple(f"parallel.{f}" for f in ("schedule", "virtual", "microbatch_group_size_per_vp_stage",
                                              "max_in_flight", "schedule_costs"))


def train_hint(args, config: TrainConfig, best: dict) -> str:
    """A ``pipecast train`` command that trains with the recommendation ``best`` from where the run folder is:

    * no checkpoint in ``checkpoint.dir``: ``--parallel.schedule=tuned`` (reads ``RUN_DIR/tune.json``);
    * an unfinished run (latest checkpoint before ``training.steps``): the same with ``--resume`` -- a fresh run
      there is refused (:func:`.config.check_fresh_run`), and checkpoints do not depend on the pipeline layout;
    * a recommendation that sets ``model.*`` too (``model.recompute``): its arguments, all of them;
    * a finished run: a new run folder (``RUN_DIR-tuned``, numbered if taken) with the recommendation's own
      ``--parallel.*`` values, as that folder has no ``tune.json``.
    """
    import shlex

    from ..checkpoint.dcp import latest_checkpoint
    overrides = [o for o in parse_override_args(list(getattr(args, "extra", []) or []))
                 if not o.startswith(tuple(k + "=" for k in _TUNED_KEYS))]
    base = ["pipecast", "train", str(args.config), *(f"--{o}" for o in overrides)]
    if any(a.startswith("--model.") for a in best["arguments"]):  # model.recompute: `tuned` sets parallel.* only
        return "train with it: " + shlex.join(base + best["arguments"])
    latest = latest_checkpoint(config.checkpoint_dir)
    if latest is None:
        return "train with it: " + shlex.join(base + ["--parallel.schedule=tuned"])
    step = int(latest.name.rpartition("_")[2])
    if step < config.training.steps:
        return (f"continue the run in {config.logging.run_dir} (checkpoint of step {step}) with it: "
                + shlex.join(base + ["--parallel.schedule=tuned", "--resume"]))
    run_dir = Path(config.logging.run_dir)
    fresh = next(d for d in (run_dir.with_name(f"{run_dir.name}-tuned{i or ''}") for i in range(1000))
                 if not d.exists())
    moved = [f"--checkpoint.dir={fresh / 'checkpoints'}"] if config.checkpoint.dir else []
    base = [a for a in base if not a.startswith(("--logging.run_dir=", "--checkpoint.dir="))]
    return (f"{run_dir} holds a finished run (step {step} of training.steps={config.training.steps}); train a new "
            f"run with it: " + shlex.join(base + [f"--logging.run_dir={fresh}", *moved, *best["arguments"]]))


@contextlib.contextmanager
def _job(config: TrainConfig):
    """Yields whether this process prints and writes the result: always for local ranks (spawned per measurement);
    under torchrun the process group is created here (NCCL on CUDA, gloo on CPU) and global rank 0 reports."""
    from ..launch import _backend, under_torchrun
    if not under_torchrun():
        yield True
        return
    import datetime

    import torch.distributed as dist

    from ...runtime.spawn import teardown
    dist.init_process_group(_backend(config), timeout=datetime.timedelta(seconds=config.parallel.timeout_s))
    ok = False
    try:
        yield dist.get_rank() == 0
        ok = True
    finally:
        teardown(ok)


def _prepare(args) -> tuple[TrainConfig, list[Candidate], Candidate]:
    """Load and check the config, the arguments and the data; the candidates that are valid configs."""
    for name in ("steps", "warmup", "verify_top"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} is too small; use a positive number")
    if args.memory_budget_gib is not None and not 0 < args.memory_budget_gib < float("inf"):
        raise ConfigError(f"--memory-budget-gib={args.memory_budget_gib} must be a number > 0 (GiB per rank)")
    if args.min_gain is not None and not 0 <= args.min_gain < 100:
        raise ConfigError(f"--min-gain={args.min_gain} must be a percentage in [0, 100); 0 recommends the top of "
                          f"the table whatever its margin")
    if args.steps + args.warmup > MAX_STEPS:  # checked here: the ranks would refuse training.steps after starting
        raise ConfigError(f"--steps {args.steps} + --warmup {args.warmup} is more than {MAX_STEPS:,} steps per "
                          f"measured layout; a few (the default 10 + 2) give the medians")
    if args.json is not None and (Path(args.json).is_dir() or not Path(args.json).parent.is_dir()):
        raise ConfigError(f"--json {args.json}: " + ("is a folder; give a file path" if Path(args.json).is_dir() else
                                                     "its folder does not exist; create it or give another path"))
    if args.json is not None:  # a probe file, before measuring (not after): permissions, read-only disks, /proc
        from ..outputs import _writable_folder
        _writable_folder(f"--json {args.json}: its folder", str(Path(args.json).parent))
    if args.measured is not None and not Path(args.measured).is_file():
        raise ConfigError(f"--measured {args.measured}: no such file; give a tune result (RUN_DIR/tune.json of an "
                          f"earlier `pipecast tune`)")
    config = _own_config(load_config(args.config, parse_override_args(list(getattr(args, "extra", []) or [])),
                                     check=False))
    from ...runtime import gloo_io
    from ..config import validate_world_size
    from ..data.corpus import check_data
    from ..outputs import check_outputs
    from ..launch import under_torchrun
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else config.world_size
    config = validate_world_size(config, world)
    check_data(config)
    from ..checkpoint.init_from import check_init_weights
    check_init_weights(config)
    check_outputs(config)
    gloo_io.check_environment()
    own = config_candidate(config)
    sizes = _virtual_sizes(args.virtual, config)
    cands = [c for c in candidates(config.parallel.pipeline, config.model.num_layers,
                                   config.training.num_microbatches)
             if c.virtual in sizes and _valid(config, c)]
    if own not in cands:
        cands.append(own)
    return config, cands + layout_candidates(config, cands), own


def layout_candidates(config: TrainConfig, cands: list[Candidate]) -> list[Candidate]:
    """Each candidate again with each of :func:`engine.plan.layout.lighter_ends` as ``model.pipeline_layout``
    (ranked beside the even split; predicted from the even measurement of the candidate's ``(v, split)`` by
    :func:`engine.plan.candidates.relayout`), those that are valid configs; none when the config sets its own
    layout (its measurement is not the even one)."""
    from ...plan.layout import lighter_ends
    if config.model.pipeline_layout:
        return []
    out = []
    for c in cands:
        for layout in lighter_ends(config.model.num_layers, config.parallel.pipeline * c.virtual):
            moved = dataclasses.replace(c, pipeline_layout=str(layout))
            if _valid(config, moved):
                out.append(moved)
    return out


def _own_config(config: TrainConfig) -> TrainConfig:
    """The config to tune, validated: ``parallel.schedule: tuned`` stands for the recommendation of the run
    folder's tune result when there is a valid one, else for ``auto`` (said in one line)."""
    if config.parallel.schedule == "tuned":
        try:
            config = resolve_tuned(config)
        except ConfigError as exc:
            print(f"note: {exc}; tuning with parallel.schedule=auto as the config's own schedule", file=sys.stderr)
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                config.parallel, schedule="auto", max_in_flight=None, microbatch_group_size_per_vp_stage=None,
                schedule_costs=None))
    validate(config)
    return config


def _virtual_sizes(text: str | None, config: TrainConfig) -> list[int]:
    valid = virtual_sizes(config.parallel.pipeline, config.model.num_layers)
    if text is None:
        return valid
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(v not in valid for v in sizes):
        raise ConfigError(f"--virtual={text!r} is invalid: give comma-separated sizes from {valid} (those that split "
                          f"model.num_layers={config.model.num_layers} into parallel.pipeline x virtual equal chunks)")
    return sizes


def _valid(config: TrainConfig, c: Candidate) -> bool:
    try:
        validate(variant_config(config, c, Path("."), config.training.steps))
    except (ConfigError, ValueError, RuntimeError, TypeError):
        return False
    return True


def config_candidate(config: TrainConfig) -> Candidate:
    """The config's own schedule as a :class:`Candidate`."""
    p, name = config.parallel, config.schedule_name
    group = p.microbatch_group_size_per_vp_stage if "group_size" in get_schedule(name).options else None
    costs = None if p.schedule_costs is None else PassCosts.parse(p.schedule_costs)
    own = Candidate(name, p.virtual, None if group == p.pipeline else group, p.max_in_flight, costs=costs)
    if p.overlap_moe_expert_parallel_comm:  # interleaved with it: the combined 1F1B plan the run builds
        own = next(iter(overlap_candidates([own], p.pipeline, config.training.num_microbatches)), own)
    return own


def variant_config(config: TrainConfig, c: Candidate, folder: Path, steps: int,
                   overlap: bool | None = None) -> TrainConfig:
    """``config`` with candidate ``c``'s schedule, training ``steps`` steps into ``folder``, with no evaluation,
    checkpoint, samples, TensorBoard, profiler or progress bar.  ``parallel.overlap_moe_expert_parallel_comm``:
    ``overlap`` (None: the config's), kept only where ``c``'s plan has forward-backward cells (``c.overlap``, or
    :func:`.result.tuned_overlap`: the run is the plan the tuner simulated)."""
    r = dataclasses.replace
    fields: dict = {"parallel": {}, "model": {}}
    for key, value in c.overrides().items():
        section, _, name = key.partition(".")
        fields[section][name] = value
    overlap = config.parallel.overlap_moe_expert_parallel_comm if overlap is None else overlap
    fields["parallel"]["overlap_moe_expert_parallel_comm"] = overlap and (c.overlap or tuned_overlap(
        config, c.schedule, c.virtual, c.group_size, c.max_in_flight))
    return r(config, parallel=r(config.parallel, **fields["parallel"]), model=r(config.model, **fields["model"]),
             training=r(config.training, steps=steps, eval_interval=0),
             checkpoint=r(config.checkpoint, dir=str(folder / "checkpoints"), interval=0, save_at_end=False),
             logging=r(config.logging, run_dir=str(folder), progress_bar=False, tensorboard=False,
                       sample_every_eval=0, level="WARNING"),
             profile=r(config.profile, enabled=False))


def measurement_variants(cands: list[Candidate], own: Candidate) -> list[Candidate]:
    """One schedule per layout ``(virtual, split)`` the candidates use: the config's own for its layout, else the
    first candidate of the layout (registry order) with its options at their defaults -- for the built-ins 1F1B /
    no pipelining (``v = 1``) or interleaved 1F1B with the full backward, ZB-H1 (``v = 1``), ZB-V (``v = 2``) or
    ``zb`` with the split one."""
    out = [own]
    for key in sorted({c.layout for c in cands} - {own.layout}):
        of_layout = [c for c in cands if c.layout == key]
        plain = [c for c in of_layout if c.group_size is None and c.max_in_flight is None and c.pipeline_layout is None]
        out.append(plain[0] if plain else Candidate(of_layout[0].schedule, of_layout[0].virtual))
    return out


def _everywhere(fn, config: TrainConfig, *args) -> list:
    """``fn(config, *args)`` on every rank; the per-rank results (in global rank order) on every rank.  Spawns the
    local ranks (:func:`.launch.launch_ranks`), or under torchrun runs here and gathers (every process runs the tune)."""
    from ..launch import launch_ranks, under_torchrun
    if not under_torchrun():
        return launch_ranks(fn, config, *args)
    import torch.distributed as dist
    mine = fn(config, *args)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def _tune(args, config: TrainConfig, cands: list[Candidate], own: Candidate) -> dict:
    t0 = time.perf_counter()
    model, measured = _measure(args, config, cands, own)
    cands = [c for c in cands if c.layout in model.layouts]
    if own not in cands:  # --measured of a result that did not measure this layout
        raise ConfigError(f"--measured {args.measured}: it has no measurement of the config's own layout (virtual="
                          f"{own.virtual}, {'split' if own.splits_backward else 'full'} backward); re-run without "
                          f"--measured")
    P, M = config.parallel.pipeline, config.training.num_microbatches
    cands = cands + [c for c in cost_aware_candidates(cands, model, P, M) if c not in cands and _valid(config, c)]
    if config.parallel.overlap_moe_expert_parallel_comm:  # combined 1F1B beside DualPipeV's cells
        cands = cands + [c for c in overlap_candidates(cands, P, M) if c not in cands and _valid(config, c)]
    budget = None if args.memory_budget_gib is None else args.memory_budget_gib * 2**30
    predictions = [predict(c, model, P, M) for c in cands]
    if budget is not None and not any(p.fits(budget) for p in predictions):
        predictions += recompute_predictions(config, model, cands)
    ranked = rank_predictions(predictions, budget)
    measured.setdefault("seconds", time.perf_counter() - t0)
    from .report import candidate_entry, print_table
    min_gain = measured.get("noise_gain", 0.0) if args.min_gain is None else args.min_gain / 100
    chosen = choose(ranked, own, budget, min_gain)
    print_table(ranked, own, budget, chosen, min_gain, "--min-gain" if args.min_gain is not None else "noise")
    entry = (lambda p: None if p is None else candidate_entry(p, budget))
    result = {"measured": measured, "candidates": [candidate_entry(p, budget) for p in ranked],
              "best": entry(chosen), "best_predicted": entry(chosen), "min_gain": min_gain,
              "config": entry(next(p for p in ranked if p.candidate == own)),
              "verified": [], "tuned_for": tuned_for(config), "memory_budget_gib": args.memory_budget_gib}
    if args.verify:
        result["verified"] = rows = _verify(args, config, ranked, own, measured)
        result["best"] = entry(verified_choice(ranked, rows, own, budget, min_gain,
                                               "--min-gain" if args.min_gain is not None else "noise"))
    return result


def recompute_model(config: TrainConfig, model: CostModel, granularity: str) -> CostModel:
    """``model`` (measured at the config's ``model.recompute``) moved to ``model.recompute: granularity``: per
    layout and stage the activation bytes change by the estimate's difference
    (:func:`engine.training.memory.activation_bytes` at both settings, the layout's virtual size), and ``B`` gains
    the stage's ``F`` time when the stage recomputes and did not before (the recomputed forward runs inside ``B``;
    Korthikanti et al., 2022, arXiv:2205.05198: one extra forward for ``full``, the attention core's part of one for
    ``selective``, costed here as a whole forward: an upper bound)."""
    from ..memory import activation_bytes
    r = dataclasses.replace
    layouts = {}
    for (v, split), lc in model.layouts.items():
        at = r(config, parallel=r(config.parallel, virtual=v))
        new = r(at, model=r(at.model, recompute=granularity))
        stages = range(len(lc.activation_bytes))
        delta = [activation_bytes(new, s) - activation_bytes(at, s) for s in stages]
        extra = [lc.forward_ms[s] if config.model.recompute == "none" and at.layout.layer_counts[s] else 0.0
                 for s in stages]
        layouts[(v, split)] = r(lc, activation_bytes=tuple(max(a + d, 0) for a, d in zip(lc.activation_bytes, delta)),
                                backward_ms=tuple(b + e for b, e in zip(lc.backward_ms, extra)))
    return r(model, layouts=layouts)


def recompute_predictions(config: TrainConfig, model: CostModel, cands: list[Candidate]) -> list:
    """The predictions of ``cands`` with ``model.recompute: selective`` (for a family with an attention core) and
    ``full`` (:func:`recompute_model`; for a config that recomputes nothing): what ``--memory-budget-gib`` may pick
    when nothing else fits."""
    from ..models import get_family
    if config.model.recompute != "none":
        return []
    P, M = config.parallel.pipeline, config.training.num_microbatches
    out = []
    selective = get_family(config.model.family).attention_core is not None
    for granularity in ("selective", "full") if selective else ("full",):
        moved = recompute_model(config, model, granularity)
        out += [predict(dataclasses.replace(c, recompute=granularity), moved, P, M) for c in cands]
    return out


def _measure(args, config: TrainConfig, cands: list[Candidate], own: Candidate):
    """The cost model: from ``--measured``, or measured on the ranks."""
    if args.measured:
        return model_from_record(args.measured, config)
    variants = measurement_variants(cands, own)
    print(f"pipecast tune: {len(cands)} hand-made candidates (cost-aware plans, pipeline layouts and recomputation "
          f"join them from the measured costs); measuring {len(variants)} shapes (virtual size, split backward) on "
          f"{config.world_size} rank{'s' if config.world_size > 1 else ''} ({args.warmup} + {args.steps} steps "
          f"each)", flush=True)
    with tempfile.TemporaryDirectory(prefix="pipecast-tune-") as tmp:
        per_rank = _everywhere(tune_worker, config, variants, args.steps, args.warmup, _shared(tmp),
                               not args.one_at_a_time)
    return cost_model(config, variants, per_rank)


def choose(ranked, own: Candidate, budget_bytes: float | None, min_gain: float):
    """The recommendation from the predictions: the top of ``ranked``, unless the config's own schedule fits and
    the top is predicted less than ``min_gain`` (a fraction) faster than it -- a gain the measurement cannot tell
    from noise; ``None`` when no candidate fits the budget."""
    mine = next(p for p in ranked if p.candidate == own)
    top = ranked[0]
    if not top.fits(budget_bytes):
        return None
    if mine.fits(budget_bytes) and mine.predicted_ms <= top.predicted_ms * (1 + min_gain):
        return mine
    return top


def verified_choice(ranked, rows: list[dict], own: Candidate, budget_bytes: float | None, min_gain: float,
                    gain_source: str = "noise"):
    """The recommendation after ``--verify``: the verified candidate that fits and measured fastest, unless the
    config's own measured within ``min_gain`` of it (then the line says so, and why); ``None`` when no verified
    candidate fits."""
    from .report import margin_reason
    by_label = {p.candidate.label: p for p in ranked}
    fitting = [r for r in rows if by_label[r["label"]].fits(budget_bytes)]
    if not fitting:
        return None
    fastest = min(fitting, key=lambda r: r["measured_ms"])
    mine = next((r for r in fitting if r["is_config"]), None)
    if mine is not None and mine is not fastest and mine["measured_ms"] <= fastest["measured_ms"] * (1 + min_gain):
        gain = 100 * (1 - fastest["measured_ms"] / mine["measured_ms"])
        print(f"recommendation after verifying: the config's own schedule, {mine['label']} (measured "
              f"{mine['measured_ms']:.1f} ms): the fastest measured, {fastest['label']} ({fastest['measured_ms']:.1f} "
              f"ms), is only {gain:.1f}% faster, {margin_reason(min_gain, gain_source)}")
        return by_label[mine["label"]]
    print(f"recommendation after verifying: {fastest['label']} (measured {fastest['measured_ms']:.1f} ms)")
    return by_label[fastest["label"]]


def _verify(args, config: TrainConfig, ranked, own: Candidate, measured: dict) -> list[dict]:
    from .report import print_verified
    chosen = [p for p in ranked[:args.verify_top]]
    chosen += [p for p in ranked if p.candidate == own and p not in chosen]
    groups = ([p for p in ranked if p.candidate.costs is not None],  # the best cost-aware plan and, beside it,
              [p for p in ranked if p.candidate.splits_backward and p.candidate.costs is None  # the best hand-made
               and p.candidate.max_in_flight is None])                                      # split shape
    chosen += [group[0] for group in groups if group and group[0] not in chosen]
    print(f"verifying {len(chosen)} candidates ({args.warmup} + {args.steps} steps each)", flush=True)
    with tempfile.TemporaryDirectory(prefix="pipecast-tune-") as tmp:
        per_rank = _everywhere(verify_worker, config, [p.candidate for p in chosen], args.steps, args.warmup,
                               _shared(tmp), not args.one_at_a_time)
    rows = [{"settings": p.candidate.overrides(), "label": p.candidate.label, "predicted_ms": p.predicted_ms,
             "simulated_ms": p.simulated_ms,
             "measured_ms": statistics.median(step_times(per_rank, i)), "is_config": p.candidate == own}
            for i, p in enumerate(chosen)]
    mine = next(r for r in rows if r["is_config"])
    for r in rows:  # the error of the predicted ratio to the config's own: free of drift between the two phases
        r["error"] = r["predicted_ms"] / r["measured_ms"] - 1
        r["relative_error"] = (r["predicted_ms"] / mine["predicted_ms"]) / (r["measured_ms"] / mine["measured_ms"]) - 1
    print_verified(rows, measured.get("layouts", {}).get(own.label, {}).get("step_ms"))
    return rows


def _shared(folder: str) -> str:
    """The trainers' scratch folder: ``folder``, or under torchrun one path for every process (rank 0's)."""
    from ..launch import under_torchrun
    if not under_torchrun():
        return folder
    import torch.distributed as dist
    box = [folder]
    dist.broadcast_object_list(box, src=0)
    Path(box[0]).mkdir(parents=True, exist_ok=True)
    return box[0]


def tune_worker(config: TrainConfig, variants: list[Candidate], steps: int, warmup: int, folder: str,
                together: bool = True) -> list[dict]:
    """What every rank runs to measure: :func:`.tune_model.measure_runs` of the variants, recorded (without the
    MoE overlap: the all-to-all and compute costs are measured apart, and the overlap simulated)."""
    from .measure import measure_runs
    cfgs = [variant_config(config, c, Path(folder) / f"measure{i}", warmup + steps, overlap=False)
            for i, c in enumerate(variants)]
    return measure_runs(cfgs, steps, warmup, True, together, [c.label for c in variants])


def verify_worker(config: TrainConfig, cands: list[Candidate], steps: int, warmup: int, folder: str,
                  together: bool = True) -> list[dict]:
    """What every rank runs to verify: :func:`.tune_model.measure_runs` of the candidates, unrecorded."""
    from .measure import measure_runs
    cfgs = [variant_config(config, c, Path(folder) / f"verify{i}", warmup + steps) for i, c in enumerate(cands)]
    return measure_runs(cfgs, steps, warmup, False, together, [f"verify {c.label}" for c in cands])
