"""Measurements of ``pipecast tune`` on the ranks (:func:`measure_run`) and the cost model built from them
(:func:`cost_model`); the method is described in :mod:`engine.training.tune.tuner`."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import sys
import time

from ...plan.candidates import Candidate, CostModel, LayoutCosts

__all__ = ["measure_runs", "probe_memory", "ping_pong", "cost_model", "model_from_record",
           "step_noise", "step_times"]


# ---- on the ranks -------------------------------------------------------------------------------------------------
def measure_runs(cfgs: list, steps: int, warmup: int, record: bool = True, together: bool = True,
                 labels: list[str] | None = None) -> list[dict]:
    """Train ``warmup`` + ``steps`` steps of each config on this rank, every step started by a barrier over the
    world; returns one result per config (:func:`_result`).

    ``together``: all trainers are built first and stepped round-robin, in an order shuffled per round (the same
    on every rank), so load from outside falls on every config alike; else one trainer at a time (for models too
    large to hold several copies).  The first result also carries ``"transfer_ms"`` (:func:`ping_pong`).
    """
    labels = labels or [str(i) for i in range(len(cfgs))]
    if not together:
        return [r for i, cfg in enumerate(cfgs) for r in _measure_together([cfg], steps, warmup, record,
                                                                            [labels[i]], latency=i == 0)]
    return _measure_together(cfgs, steps, warmup, record, labels, latency=True)


def _measure_together(cfgs, steps: int, warmup: int, record: bool, labels, latency: bool) -> list[dict]:
    import random


    from ...profiling import TimelineRecorder
    from ..trainer import Trainer
    with contextlib.ExitStack() as stack:
        trainers = [stack.enter_context(Trainer(cfg)) for cfg in cfgs]
        bar = stack.enter_context(_progress(len(cfgs) * (warmup + steps), ", ".join(labels)))
        recs = [TimelineRecorder(tr.pp_rank, "cuda" if tr.device.type == "cuda" else "cpu", enabled=record)
                for tr in trainers]
        for tr, rec in zip(trainers, recs):
            for _ in range(warmup):
                _step(tr, None, -1)
                bar.update(1)
            rec.anchor(tr.pg.pp)
        ms: list[list[float]] = [[] for _ in trainers]
        order, rng = list(range(len(trainers))), random.Random(0)
        for k in range(steps):
            rng.shuffle(order)
            for i in order:
                ms[i].append(_step(trainers[i], recs[i] if record else None, k))
                bar.update(1)
        out = [_result(tr, rec, times, record) for tr, rec, times in zip(trainers, recs, ms)]
        if latency:
            out[0]["transfer_ms"] = ping_pong(trainers[0])
        return out


@contextlib.contextmanager
def _progress(total: int, what: str):
    """A tqdm bar over the steps on global rank 0 when stderr is a terminal (else one line naming ``what``)."""
    import torch.distributed as dist
    from tqdm import tqdm
    first = dist.get_rank() == 0
    if first and not sys.stderr.isatty():
        print(f"  measuring {what}", file=sys.stderr, flush=True)
    with tqdm(total=total, desc=f"measuring {what}", unit="step", disable=not (first and sys.stderr.isatty()),
              leave=False) as bar:
        yield bar


def _result(tr, rec, ms: list[float], record: bool) -> dict:
    """``{"pp_rank", "dp_rank", "step_ms"}`` (this rank's time per recorded step, ms) plus, with ``record``,
    ``"spans"`` (the recorder's spans as tuples) and ``"memory"`` (:func:`probe_memory`)."""
    out = {"pp_rank": tr.pp_rank, "dp_rank": tr.dp_rank, "step_ms": ms}
    if record:
        out["spans"] = [(s.category, s.label, s.start_ns, s.end_ns, s.step, s.depth) for s in rec.spans()]
        out["memory"] = probe_memory(tr)
    return out


def _step(tr, rec, index: int) -> float:
    import torch.distributed as dist

    from ...runtime.tracing import use_tracer
    dist.barrier()
    t0 = time.perf_counter()
    with (rec.step(index) if rec is not None else contextlib.nullcontext()), use_tracer(rec):
        tr.train_step()
    return (time.perf_counter() - t0) * 1e3


def probe_memory(tr) -> list[dict]:
    """Per model chunk of this rank: ``{"stage", "activation_bytes", "pending_w_bytes", "static_bytes",
    "tied_bytes"}``.

    One microbatch runs forward through the chunk alone (a non-first stage: random input of
    :func:`message_shape`; the first: the first training microbatch's tokens / labels) with ``torch.autograd.graph.saved_tensors_hooks`` counting the
    distinct storages autograd saves that are not parameters; for split-backward plans under the layer-level
    deferral, followed by ``B`` (:func:`~engine.runtime.split_backward.backward_input_step`) and the bytes its
    pending ``W`` holds; the ``W`` is dropped, not run, and gradients are cleared afterwards (data-parallel sync
    off).  ``static_bytes``: the chunk's parameters, gradients and optimizer state (under ``model.precision: bf16``
    the bf16 parameters and their fp32 masters with theirs); ``tied_bytes``: that of a tied word embedding on the
    first stage (0 otherwise).
    """
    from ...runtime.storage import local_bytes
    batch = next(iter(tr.batches.train(0, True, True))) if tr.batches is not None else {}
    out = []
    for index, chunk in enumerate(tr.model):
        state = tr.parallelism.state_chunks[index]  # bf16: the fp32 masters the optimizer steps, beside the chunk's
        static = _static_bytes(tr, state.parameters()) + (
            sum(local_bytes(p) for p in chunk.parameters()) if state is not chunk else 0)
        tied = _static_bytes(tr, [state.embedding.word.weight]) if (
            chunk.is_first and tr.config.model.tie_embeddings) else 0
        with tr.parallelism.grad_sync.no_sync():
            act, held = _probe_chunk(tr, chunk, batch)
        out.append({"stage": tr.plan.stage(tr.pp_rank, index), "activation_bytes": act, "pending_w_bytes": held,
                    "static_bytes": static, "tied_bytes": tied})
    tr.optimizer.zero_grad(set_to_none=True)
    return out


def _static_bytes(tr, params) -> int:
    """This rank's bytes of ``params``, their gradients and optimizer state (a DTensor's local shard)."""
    import torch

    from ...runtime.storage import local_bytes
    total = 0
    for p in params:
        total += local_bytes(p) + local_bytes(p.grad if p.grad is not None else p)
        total += sum(local_bytes(t) for t in tr.optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor))
    return total


def _probe_chunk(tr, chunk, batch: dict) -> tuple[int, int]:
    import torch

    from ...runtime.split_backward import backward_input_step, weight_grad_deferral
    from ...runtime.storage import storage_sizes
    x = None if chunk.is_first else torch.randn(message_shape(tr), device=tr.device, requires_grad=True)
    chunk.set_input_tensor(x)
    params = {ptr for p in chunk.parameters() for ptr in storage_sizes(p)}
    saved: dict[int, int] = {}

    def pack(t):
        saved.update((ptr, n) for ptr, n in storage_sizes(t).items() if ptr not in params)
        return t

    split = tr.plan.splits_backward
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (
            weight_grad_deferral() if split else contextlib.nullcontext()):
        y = chunk(batch.get("tokens"), batch.get("labels"))
    if not split:
        return sum(saved.values()), 0
    loss, grad = (y.float().mean(), None) if chunk.is_last else (y, torch.ones_like(y))
    config = dataclasses.replace(tr.mp_config, deallocate_pipeline_outputs=False)  # the output was not sent
    _, work = backward_input_step(x, loss, grad, config)
    return sum(saved.values()), work.held_bytes()


def message_shape(tr) -> tuple:
    """The ``[s, b, h]`` activation a stage receives (``[s/T, b, h]`` under sequence parallelism)."""
    from ...runtime.step import get_tensor_shapes
    (shape,) = get_tensor_shapes(seq_length=tr.config.model.seq_length, decoder_seq_length=None,
                                 micro_batch_size=tr.config.training.micro_batch_size, config=tr.mp_config,
                                 tp_group=tr.pg.tp, cp_group=None)
    return shape


def ping_pong(tr, rounds: int = 25, skip: int = 5) -> float | None:
    """Half the median round trip (ms) of one activation (:func:`message_shape`) between pipeline ranks 0 and 1 of the first
    data-parallel replica (``None`` on other ranks and with one pipeline rank)."""
    import torch
    import torch.distributed as dist
    if tr.pp_size < 2 or tr.dp_rank != 0 or tr.pp_rank > 1:
        return None
    dtype = tr.mp_config.pipeline_dtype or torch.float32
    t = torch.zeros(message_shape(tr), dtype=dtype, device=tr.device)
    peer = dist.get_global_rank(tr.pg.pp, 1 - tr.pp_rank)
    trips = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for op in ((dist.send, dist.recv) if tr.pp_rank == 0 else (dist.recv, dist.send)):
            op(t, peer)
        if tr.device.type == "cuda":
            torch.cuda.synchronize()
        trips.append(time.perf_counter() - t0)
    return statistics.median(trips[skip:]) / 2 * 1e3


# ---- in the launcher ----------------------------------------------------------------------------------------------
def cost_model(config, variants: list[Candidate], per_rank: list[list[dict]]) -> tuple[CostModel, dict]:
    """The :class:`CostModel` from :func:`measure_run` results (``per_rank[global rank][variant]``, the first
    data-parallel replica's ranks are used) and the JSON-ready ``measured`` record."""
    from ...plan.candidates import predict
    P, M = config.parallel.pipeline, config.training.num_microbatches
    transfer = next((r[0]["transfer_ms"] for r in per_rank if r[0].get("transfer_ms") is not None), 0.0)
    tied = max(m["tied_bytes"] for r in per_rank for m in r[0]["memory"])
    layouts, record = {}, {}
    for i, c in enumerate(variants):
        runs = sorted((r[i] for r in per_rank if r[i]["dp_rank"] == 0), key=lambda x: x["pp_rank"])
        lc = layout_costs(c.plan(P, M), runs)
        measured = statistics.median(step_times([[r] for r in runs], 0))
        simulated = predict(c, CostModel({c.layout: lc}, transfer, tied), P, M).simulated_ms
        lc = dataclasses.replace(lc, calibration=measured / simulated if simulated > 0 else 1.0)
        layouts.setdefault(c.layout, lc)
        record[c.label] = {"virtual": c.virtual, "splits_backward": c.splits_backward, **dataclasses.asdict(lc),
                           "step_ms": measured, "simulated_ms": simulated}
    noise = step_noise([step_times(per_rank, i) for i in range(len(variants))])
    overlap = config.parallel.overlap_moe_expert_parallel_comm  # measured without it, simulated with it
    return CostModel(layouts, transfer, tied, overlap), {"layouts": record, "transfer_ms": transfer,
                                                         "tied_bytes": tied, **noise}


def step_noise(series: list[list[float]]) -> dict:
    """How far apart two measured medians of equal schedules may fall by chance: ``{"step_noise"}`` the relative
    standard deviation of one step (each series divided by its median, pooled), and ``{"noise_gain"}`` the
    standard error of the relative difference of two medians of ``n`` steps, ``sqrt(2) * 1.2533 * sd / sqrt(n)``
    (the median's standard error is about 1.2533 times the mean's for a normal sample)."""
    rel = [x / statistics.median(xs) for xs in series if xs for x in xs]
    n = min((len(xs) for xs in series if xs), default=0)
    sd = statistics.stdev(rel) if len(rel) > 1 else 0.0
    return {"step_noise": sd, "noise_gain": math.sqrt(2) * 1.2533 * sd / math.sqrt(n) if n else 0.0}


def model_from_record(path, config) -> tuple[CostModel, dict]:
    """The :class:`CostModel` of an earlier tune result file (its ``measured`` record), checked to be of
    ``config``'s model, pipeline and batch (``ConfigError`` otherwise)."""
    from ..config import ConfigError
    from .result import check_tuned_for, read_result
    result = read_result(path)
    check_tuned_for(result["tuned_for"], config, f"--measured {path}")
    record = result["measured"]
    names = [f.name for f in dataclasses.fields(LayoutCosts)]
    try:
        layouts = {(e["virtual"], e["splits_backward"]): LayoutCosts(**{k: tuple(e[k]) if isinstance(e[k], list)
                                                                        else e[k] for k in names if k in e})
                   for e in record["layouts"].values()}
        model = CostModel(layouts, float(record["transfer_ms"]), int(record["tied_bytes"]),
                          config.parallel.overlap_moe_expert_parallel_comm)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"--measured {path}: its 'measured' record is incomplete ({type(exc).__name__}: {exc}); "
                          f"re-run `pipecast tune CONFIG` without --measured") from None
    if not layouts:
        raise ConfigError(f"--measured {path}: it measured no layout; re-run `pipecast tune CONFIG` without --measured")
    return model, record


def layout_costs(plan, runs: list[dict]) -> LayoutCosts:
    """Per-stage costs of one measured run (``runs`` per pipeline rank) of ``plan``."""
    from ...profiling.costs import action_overhead_ms, median_action_ms
    from ...profiling.timeline import Span
    rank_spans = [[Span(*t) for t in r["spans"]] for r in runs]
    costs = median_action_ms(rank_spans)
    where = [plan.stage_location(s) for s in range(plan.num_stages)]
    a2a = a2a_per_action_ms(rank_spans)
    a2a_ms = tuple(a2a.get(("F", r, c), 0.0) for r, c in where) if a2a else ()
    per_stage = {op: tuple(max(0.0, costs.get((op, r, c), 0.0) - (a2a_ms[i] if a2a_ms and op != "W" else 0.0))
                           for i, (r, c) in enumerate(where)) for op in "FBW"}
    mem = {m["stage"]: m for r in runs for m in r["memory"]}
    pick = {k: tuple(int(mem[s][k]) for s in range(plan.num_stages))
            for k in ("activation_bytes", "pending_w_bytes", "static_bytes")}
    return LayoutCosts(per_stage["F"], per_stage["B"], per_stage["W"], **pick,
                       action_overhead_ms=action_overhead_ms(rank_spans),
                       step_overhead_ms=_step_overhead_ms(runs, rank_spans), a2a_ms=a2a_ms)


def a2a_per_action_ms(rank_spans) -> dict:
    """Median time (ms) of the ``"comm"`` spans (a MoE layer's expert all-to-alls, :func:`engine.runtime.overlap.
    exchange`) inside each ``(op, rank, chunk)``'s ``F`` / ``B`` compute spans of a run without the overlap; empty
    for a model without such collectives.  :func:`layout_costs` takes the forward's as the stage's ``a2a_ms`` (the
    simulator's all-to-all time of a forward and of a backward, :func:`engine.plan.simulate.simulate`) and
    subtracts it from the stage's ``F`` and ``B`` costs, which then hold compute only."""
    from ...profiling.costs import parse_action_label
    found: dict = {}
    for rank, spans in enumerate(rank_spans):
        comm = [s for s in spans if s.category == "comm"]
        for s in spans if comm else ():
            parsed = parse_action_label(s.label) if s.category == "compute" else None
            if parsed is not None and parsed[0] in "FB":
                inside = sum(c.duration_ns for c in comm if s.start_ns <= c.start_ns and c.end_ns <= s.end_ns)
                found.setdefault((parsed[0], rank, parsed[1]), []).append(inside / 1e6)
    return {k: statistics.median(v) for k, v in found.items()}


def _step_overhead_ms(runs, rank_spans) -> float:
    """Median over steps of (slowest rank's step time - the schedule's window over all ranks)."""
    from ...profiling.bubble import step_window, steps_of
    values = []
    for k, step in enumerate(steps_of(rank_spans)):
        lo, hi = step_window(rank_spans, step)
        values.append(max(r["step_ms"][k] for r in runs) - (hi - lo) / 1e6)
    return max(0.0, statistics.median(values)) if values else 0.0


def step_times(per_rank: list[list[dict]], index: int) -> list[float]:
    """Per recorded step of variant ``index``, the slowest rank's step time (ms)."""
    runs = [r[index]["step_ms"] for r in per_rank]
    return [max(ms[k] for ms in runs) for k in range(min(len(ms) for ms in runs))]
