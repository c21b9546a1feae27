"""Rank-side harness for the multi-process schedule tests: run many schedule calls in one spawned job.

A *case* is a dict of settings (see :data:`DEFAULTS`); :func:`job` runs a list of cases on every rank of a gloo job
(one pipeline group of all ranks, or ``pp`` smaller than the world for several pipelines) and returns, per case, a
result dict per rank: the error raised (if any), the largest relative gradient error against the single-process
reference, the stored losses' error, the recorded compute order and hook events, the plan's order, etc.
Spawning costs seconds, so the tests group many cases into one job.
"""
from __future__ import annotations

import contextlib
import random
import time

import torch

from engine.model_parallel_config import ModelParallelConfig
from engine.plan import build_plan
from engine.runtime.process_groups import build_process_groups
from engine import schedules
from tests.helpers import models as tm

DEFAULTS = dict(pp=None, chunks=None, M=4, G=None, batch=True, overlap=False, dealloc=False, forward_only=False,
                mode=2, per_token=False, grad_scale=None, repeats=1, seq=4, mbs=2, hidden=8, kind="linear",
                layers=1, variable=False, seqs=None, zero_mb=None, moe=False, collect=False, first_val_step=None,
                ckpt=None, hooks=False, sleep=0.0, dtype="float32", tokens=None, sequence=None, explicit=True,
                M_by_rank=None, seed=0, func=None, seq_by_dp=None, warmup_flush=False, plant=None, schedule=None,
                max_in_flight=None, output="plain", csv=None, costs=None)
# ``plant`` (negative controls, tests/runtime/test_harness_controls.py): "grad_scale" gives the schedule a grad_scale_func of
# x * 2 that the reference does not apply; "no_M" multiplies each microbatch's loss by M, cancelling the schedule's
# division by M (a loss without / M).  Both must make the case fail the equivalence check.
# ``costs``: the notation of the PassCosts a ``zb`` / ``zbv`` plan is built for (the cost-aware builder).
# ``csv``: for a ``"torch:<class>"`` schedule, the CSV torch writes at the case's M, filled in by the parent before
# it spawns (:func:`with_torch_csvs`), so the ranks need not import torch.distributed.pipelining.


def case(**kw) -> dict:
    """A case: :data:`DEFAULTS` updated with ``kw`` (unknown keys are a ``KeyError``)."""
    unknown = set(kw) - set(DEFAULTS)
    if unknown:
        raise KeyError(f"unknown case keys {unknown}")
    return {**DEFAULTS, **kw}


class _Recorder:
    """no_sync / grad_sync / param_sync / finalize hooks that append Megatron-trace-style events to ``log``."""

    def __init__(self, log, chunks):
        self.log, self.active = log, False
        self.tokens = None
        self.chunk_of = {id(next(c.parameters())): c.chunk for c in chunks}

    @contextlib.contextmanager
    def no_sync(self):
        self.log.append("no_sync enter")
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.log.append("no_sync exit")

    def _chunk(self, params):
        return self.chunk_of[id(next(iter(params)))]

    def grad_sync(self, params):
        self.log.append(f"grad_sync_func(params_c{self._chunk(params)})")

    def param_sync(self, params):
        self.log.append(f"param_sync_func(params_c{self._chunk(params)})")

    def finalize(self, models, num_tokens, pg_collection=None, force_all_reduce=False):
        self.tokens = None if num_tokens is None else int(num_tokens)
        self.log.append(f"finalize_model_grads_func(num_model_chunks={len(models)}, num_tokens="
                        f"{None if num_tokens is None else int(num_tokens)})")


def _config(c, world_pp):
    dtype = getattr(torch, c["dtype"])
    cfg = ModelParallelConfig(pipeline_model_parallel_size=world_pp,
                              virtual_pipeline_model_parallel_size=c["chunks"], pipeline_dtype=dtype,
                              hidden_size=c["hidden"], batch_p2p_comm=c["batch"], overlap_p2p_comm=c["overlap"],
                              deallocate_pipeline_outputs=c["dealloc"], microbatch_group_size_per_vp_stage=c["G"],
                              variable_seq_lengths=c["variable"], calculate_per_token_loss=c["per_token"],
                              overlap_p2p_comm_warmup_flush=c["warmup_flush"],
                              num_microbatches_with_partial_activation_checkpoints=c["ckpt"],
                              num_moe_experts=2 if c["moe"] else None, params_dtype=dtype)
    if c["grad_scale"] is not None:
        cfg.grad_scale_func = lambda t, s=c["grad_scale"]: t * s
    if c["plant"] == "grad_scale":
        cfg.grad_scale_func = lambda t: t * 2.0
    return cfg


def _plant_loss(forward_step_func, c: dict):
    """``forward_step_func`` whose loss function returns ``M x`` the loss when ``c["plant"] == "no_M"``."""
    if c["plant"] != "no_M":
        return forward_step_func

    def planted(data_iterator, model, *args):
        out, loss_func = forward_step_func(data_iterator, model, *args)

        def scaled(output, non_loss_data=False):
            got = loss_func(output, non_loss_data)
            return got if non_loss_data else (got[0] * c["M"], *got[1:])
        return out, scaled

    return planted


class _TraceLog(list):
    """The compute log in the Megatron traces' notation: "F m<mb> c<c>[ first][ ckpt=..][ last_stage]",
    "B m<mb> c<c>[ grad_sync_enabled]", hook events in between."""

    def __init__(self):
        super().__init__()
        self.rec = None

    def append(self, entry):
        if entry[0] == "B" and "." in entry:
            mb, c = entry[1:].split(".")
            entry = f"B m{mb} c{c}" + ("" if self.rec.active else " grad_sync_enabled")
        super().append(entry)

    def action_labels(self):
        out = []
        for e in self:
            if e.startswith(("F m", "B m")):
                op, mb, c = e.split()[:3]
                out.append(f"{op}{mb[1:]}.{c[1:]}")
        return out


def run_case(rank: int, pgc, c: dict) -> dict:
    """Run case ``c`` on this rank in the pipeline of ``pgc``; compare with the reference computed here."""
    pp, pp_rank = pgc.pipeline_model_parallel_size, pgc.pipeline_model_parallel_rank
    C = c["chunks"] or 1
    cfg = _config(c, pp)
    log = _TraceLog()
    stages = None
    if c["schedule"]:  # pipecast's own schedules: the plan's placement decides the stages of this rank
        stages = _named_plan(c, pp, c["M"], C, False).stages_of(pp_rank)
    chunks, _ = tm.build_chunks(cfg, pp, pp_rank, C, hidden=c["hidden"], layers_per_stage=c["layers"],
                                kind=c["kind"], dtype=getattr(torch, c["dtype"]), seed=c["seed"], log=log,
                                stages=stages, output=c["output"])
    rec = _Recorder(log, chunks)
    log.rec = rec
    cfg.no_sync_func = rec.no_sync
    cfg.finalize_model_grads_func = rec.finalize
    if c["hooks"]:
        cfg.grad_sync_func, cfg.param_sync_func = rec.grad_sync, rec.param_sync
    for ch in chunks:  # record is_first_microbatch like the Megatron traces ("first")
        ch.first_flag = False
        ch.set_is_first_microbatch = (lambda ch=ch: setattr(ch, "first_flag", True))
    sleep = None
    if c["sleep"]:
        rnd = random.Random(rank * 7919 + c["M"])
        sleep = lambda mb: time.sleep(rnd.random() * c["sleep"])  # noqa: E731
    fsf = _plant_loss(tm.make_forward_step(c["mode"], sleep), c)

    def forward_step_func(data_iterator, model, checkpoint_activations_microbatch=None):
        out, loss = fsf(data_iterator, model, checkpoint_activations_microbatch)
        mb = model.seen[-1][0]
        flags = f"F m{mb} c{model.chunk}" + (" first" if model.first_flag else "")
        if checkpoint_activations_microbatch is not None:
            flags += f" ckpt={checkpoint_activations_microbatch}"
        if model.is_last:
            flags += " last_stage"
        model.first_flag = False
        log[-1] = flags
        return out, loss

    steps = c["sequence"] or [(c["forward_only"], c["M"], c["seq"])]
    probe = schedules.P2PCommunicator(pgc.pp, cfg)
    result = {"rank": rank, "pp_rank": pp_rank, "error": None, "grad_err": 0.0, "loss_err": 0.0,
              "calls": [], "next_rank": probe.next_rank, "prev_rank": probe.prev_rank,
              "pp_ranks": list(pgc.pp_ranks)}
    if c["schedule"]:
        func = _with_schedule(c, pp)
    elif c["func"]:
        func = getattr(schedules, c["func"])
    elif c["explicit"]:
        func = schedules.get_forward_backward_func(pp, c["chunks"])
    else:
        func = schedules.get_forward_backward_func()  # sizes from engine.parallel_state
    schedule = c["schedule"] or {"forward_backward_no_pipelining": "no_pipelining",
                                 "forward_backward_pipelining_without_interleaving": "1f1b",
                                 "forward_backward_pipelining_with_interleaving": "interleaved"}[func.__name__]
    comm = schedules.P2PCommunicator(pgc.pp, cfg) if c["explicit"] else None
    accumulated = None
    for fo, M, seq in steps:
        if c["M_by_rank"] is not None:
            M = c["M_by_rank"][pp_rank]
        if c["seq_by_dp"] is not None:
            seq = c["seq_by_dp"][pgc.data_parallel_rank]
        data = tm.make_data(M, seq, c["mbs"], c["hidden"], seed=M * 31 + seq, zero_mb=c["zero_mb"], seqs=c["seqs"],
                            dtype=getattr(torch, c["dtype"]), tokens=c["tokens"])
        before = {k: (w.clone(), b.clone()) for k, (w, b) in tm.chunk_grads(chunks, c["layers"]).items()
                  if w is not None}
        log.clear()
        try:
            for _ in range(c["repeats"] if not fo else 1):
                store = func(forward_step_func=forward_step_func, data_iterator=tm.iterators(data, C),
                             model=chunks if c["chunks"] else chunks[0], num_microbatches=M, seq_length=seq,
                             micro_batch_size=c["mbs"], forward_only=fo, collect_non_loss_data=c["collect"],
                             first_val_step=c["first_val_step"], p2p_communicator=comm,
                             pg_collection=pgc if c["explicit"] else None)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            result["error"] = (type(exc).__name__, str(exc))
            return result
        call = {"forward_only": fo, "M": M, "store_len": len(store), "order": log.action_labels(), "events": list(log),
                "plan_order": _plan_order(c, schedule, pp, M, C, fo, pp_rank),
                "seen_ok": all(mb == cur for ch in chunks for mb, cur, _ in ch.seen),
                "input_dtypes": sorted({str(d) for ch in chunks for d in ch.input_dtypes}),
                "inputs_alive": _alive_inputs(chunks),
                "tokens": rec.tokens, "collected": store if c["collect"] else None,
                "received": sorted(r for ch in chunks for r in ch.received)}
        call["sent_numels"] = sorted({n for ch in chunks for n in ch.sent_numels})
        call["bases_alive_at_forward"] = max((n for ch in chunks for n in ch.alive_at_forward), default=0)
        call["hook_calls"] = sum(len(ch.hook_calls) for ch in chunks)
        losses, ref = tm.reference(None, pp, C, data, hidden=c["hidden"], layers_per_stage=c["layers"],
                                   kind=c["kind"], mode=c["mode"], per_token=c["per_token"],
                                   grad_scale=c["grad_scale"] or 1.0, repeats=c["repeats"],
                                   dtype=getattr(torch, c["dtype"]), seed=c["seed"])
        if not c["collect"] and store:
            call["loss_err"] = max(abs(s["loss"].item() - l.item()) / max(abs(l.item()), 1e-6)
                                   for s, l in zip(store, losses))
            call["store_mbs"] = [s["mb"] for s in store]
            call["losses"] = [s["loss"].item() for s in store]
        got = tm.chunk_grads(chunks, c["layers"])
        if fo:
            after = {k: (w.clone(), b.clone()) for k, (w, b) in got.items() if w is not None}
            call["grads_unchanged"] = (before.keys() == after.keys() and
                                       all(torch.equal(before[k][i], after[k][i]) for k in before for i in (0, 1)))
        else:
            if accumulated is None:
                accumulated = {k: ref[k] for k in got}
            else:
                accumulated = {k: (accumulated[k][0] + ref[k][0], accumulated[k][1] + ref[k][1]) for k in got}
            call["grad_err"] = tm.max_rel_error(got, accumulated)
        for ch in chunks:
            for kept in (ch.bases, ch.alive_at_forward, ch.hook_calls):
                kept.clear()
            ch.seen.clear()
            ch.input_dtypes.clear()
            ch.sent.clear()
            ch.inputs.clear()
            ch.received.clear()
        result["calls"].append(call)
    result["grad_err"] = max((k.get("grad_err", 0.0) for k in result["calls"]), default=0.0)
    result["loss_err"] = max((k.get("loss_err", 0.0) for k in result["calls"]), default=0.0)
    return result


def _with_schedule(c, pp):
    """``forward_backward_pipelining_with_schedule`` for the case's named schedule (``max_in_flight`` / ``costs``: a
    budgeted / cost-aware plan built for each call)."""
    def func(**kw):
        schedule = c["schedule"]
        if c["max_in_flight"] is not None or c["costs"] is not None or schedule.startswith(("csv:", "torch:")):
            schedule = _named_plan(c, pp, kw["num_microbatches"], c["chunks"] or 1, kw["forward_only"])
        return schedules.forward_backward_pipelining_with_schedule(schedule=schedule, **kw)
    return func


def _named_plan(c, pp, M, C, forward_only):
    """The case's plan: a built-in schedule (``max_in_flight``: a budgeted ``zb`` plan), ``"csv:<name>"``: that
    schedule exported to torch's CSV and imported back (``engine.plan.torch_csv``), or ``"torch:<class>"``: the CSV
    torch's schedule class writes (``tests/helpers/torch_schedules.py``; training calls only), imported."""
    name = c["schedule"]
    kw = {k: c[k] for k in ("max_in_flight", "costs") if c[k] is not None}
    if name.startswith("torch:"):
        from engine.plan.torch_csv import plan_from_csv
        if forward_only:
            raise ValueError(f"{name}: torch's schedules are built with a loss; run training calls only")
        if c["csv"] is not None and M == c["M"]:
            return plan_from_csv(c["csv"], name=name)
        from tests.helpers.torch_schedules import torch_schedule_csv
        return plan_from_csv(torch_schedule_csv(name[6:], pp, M), name=name)
    if name.startswith("csv:"):
        from engine.plan.torch_csv import plan_from_csv, plan_to_csv
        return plan_from_csv(plan_to_csv(build_plan(name[4:], pp, M, C, forward_only=forward_only, **kw)))
    return build_plan(name, pp, M, C, c["G"] if name == "interleaved" else None, forward_only, **kw)


def _plan_order(c, schedule, pp, M, C, fo, pp_rank):
    """The order the chunks record for this rank's plan, per repeat: ``F`` and ``B`` as planned; with split
    backward the first stage has no input gradient, so its backward (recorded by the chunk's output node) runs in
    ``W`` (the generic split's whole backward) and its ``B`` records nothing."""
    plan = _named_plan({**c, "schedule": schedule}, pp, M, C, fo)
    order = []
    for a in plan.actions[pp_rank]:
        first = plan.is_first_stage(pp_rank, a.chunk)
        if a.op.value == "F" or (a.op.value == "B" and not (first and plan.splits_backward)):
            order.append(str(a))
        elif a.op.value == "W" and first:
            order.append(f"B{a.microbatch}.{a.chunk}")
    return order * (1 if fo else c["repeats"])


def _alive_inputs(chunks) -> int:
    """Received inputs still alive after the step, once the test model drops its own references to outputs."""
    for ch in chunks:
        ch.sent_numels = sorted({o.numel() for o in ch.sent})
        ch.sent.clear()
    return sum(1 for ch in chunks for r in ch.inputs if r() is not None)


def job(rank: int, world: int, entries: list) -> list:
    """Run every entry on this rank and return one result per entry.

    An entry is a case dict (run in a pipeline of ``case["pp"]`` ranks, default the world, built with
    ``build_process_groups`` -- or through ``engine.parallel_state`` when ``explicit=False``) or a
    ``("module", "function")`` pair naming a rank function ``fn(rank, world)`` to call.  Groups are created in the
    order the entries need them, identically on every rank.
    """
    import importlib

    from engine import parallel_state as ps
    groups = {}
    out = []
    try:
        for e in entries:
            if isinstance(e, tuple):
                out.append(getattr(importlib.import_module(e[0]), e[1])(rank, world))
                continue
            key = (e["pp"] or world, e["explicit"])
            if key not in groups:
                if key[1]:
                    groups[key] = build_process_groups(key[0])
                else:
                    ps.initialize_model_parallel(pipeline_model_parallel_size=key[0])
                    groups[key] = ps.get_pg_collection()
            out.append(run_case(rank, groups[key], e))
    finally:
        ps.destroy_model_parallel()
    return out


# ---- Megatron trace vectors as cases ------------------------------------------------------------------------------
TRACE_TOL = 1e-5
_TRACE_EVENTS = ("F ", "B ", "no_sync", "grad_sync_func", "param_sync_func", "finalize")


def trace_cases(traces: list[dict], pp: int) -> list[tuple[dict, dict]]:
    """``(vector, case)`` for every trace vector (``megatron_vectors.vectors("trace:")``) of pipeline size ``pp``
    with at least one microbatch: the same schedule, M, G, P2P mode, deallocation, checkpointing, hooks and
    ``first_val_step``."""
    out = []
    for v in traces:
        a = v["args"]
        if a["pp_size"] != pp or a["num_microbatches"] < 1:
            continue
        chunks = a["vp_size"] if a["schedule"] == "interleaved" else None
        out.append((v, case(chunks=chunks, M=a["num_microbatches"],
                            G=a["microbatch_group_size_per_vp_stage"] if chunks else None,
                            forward_only=a["forward_only"], batch=a["batch_p2p_comm"], overlap=a["overlap_p2p_comm"],
                            warmup_flush=a["overlap_p2p_comm_warmup_flush"],
                            dealloc=a["deallocate_pipeline_outputs"],
                            ckpt=a["num_microbatches_with_partial_activation_checkpoints"],
                            hooks=a["grad_sync_func/param_sync_func given"], first_val_step=a["first_val_step"])))
    return out


def megatron_events(events: list[str]) -> list[str]:
    """The events of a Megatron trace the test model records (compute, no_sync, sync hooks, finalize)."""
    return [e for e in events if e.startswith(_TRACE_EVENTS)]


def label(c: dict) -> dict:
    """The settings of case ``c`` that differ from the defaults' off values (for failure messages)."""
    return {k: v for k, v in c.items() if v not in (None, False) and k not in ("hidden", "mbs", "seq", "kind",
                                                                               "dtype", "explicit", "seed")}


def check_traces(traces: list[tuple[dict, dict]], per_case: list) -> None:
    """Assert each rank ran its trace vector as Megatron did: compute order, hook events, returned entries and
    gradients (<= :data:`TRACE_TOL` against the reference), or raised the same exception type."""
    for (vector, c), ranks in zip(traces, per_case):
        for r in ranks:
            want = vector["result"]["per_rank"][str(r["pp_rank"])]
            name = f"{vector['function'].split('.')[-1]} {label(c)} rank {r['pp_rank']}"
            if want["result"]["status"] != "ok":
                assert r["error"] is not None, f"{name}: Megatron raised {want['result']['error']}, pipecast ran"
                assert r["error"][0] == want["result"]["error"], f"{name}: {r['error']}"
                continue
            assert r["error"] is None, f"{name}: {r['error']}"
            call = r["calls"][0]
            assert call["order"] == want["compute_order"], name
            assert call["events"] == megatron_events(want["events"]), name
            returned = want["result"]["returned"]
            assert call["store_len"] == len(returned), name
            if returned:
                assert call["store_mbs"] == [x["mb"] for x in returned], name
            assert call.get("grad_err", 0.0) <= TRACE_TOL, name


def check_equivalence(grid: list[dict], per_case: list, pp: int, tol: float) -> float:
    """Assert every case of ``grid`` ran on every rank and equals the reference: relative gradient and loss errors
    <= ``tol``, ``current_microbatch`` right, the loss stage returning M entries in microbatch order and the other
    ranks none, forward-only calls leaving gradients alone.  Returns the largest error seen."""
    worst = 0.0
    for c, ranks in zip(grid, per_case):
        for r in ranks:
            assert r["error"] is None, f"{label(c)} rank {r['rank']}: {r['error']}"
            for call in r["calls"]:
                where = f"{label(c)} rank {r['rank']} call {call['M']}/{call['forward_only']}"
                assert call.get("grad_err", 0.0) <= tol, where
                assert call.get("loss_err", 0.0) <= tol, where
                assert call["seen_ok"], f"{where}: current_microbatch differs from the microbatch"
                if r["pp_rank"] == pp - 1:
                    assert call["store_len"] == call["M"], where
                    assert call["store_mbs"] == list(range(call["M"])), where
                else:
                    assert call["store_len"] == 0, where
                if call["forward_only"]:
                    assert call["grads_unchanged"], f"{where}: forward-only changed gradients"
            worst = max(worst, r["grad_err"], r["loss_err"])
    return worst


# ---- one job per world size for the whole pytest session ----------------------------------------------------------
_REGISTRY: dict = {}
_RESULTS: dict = {}


def check_ranks(where: str, per_rank: list, tol: float) -> None:
    """Every rank of one case ran without error, matched the reference within ``tol`` and ran the plan's order."""
    for r in per_rank:
        assert r["error"] is None, f"{where}: rank {r['rank']} raised {r['error']}"
        assert r["grad_err"] <= tol, f"{where}: rank {r['rank']} gradient error {r['grad_err']:.2e}"
        assert r["loss_err"] <= tol, f"{where}: rank {r['rank']} loss error {r['loss_err']:.2e}"
        for call in r["calls"]:
            assert call["order"] == call["plan_order"], f"{where}: rank {r['rank']} order is not the plan's"


def register(world: int, entries: list) -> slice:
    """Add entries to the session's job of ``world`` ranks (call at import time); returns their slice."""
    lst = _REGISTRY.setdefault(world, [])
    start = len(lst)
    lst.extend(entries)
    return slice(start, len(lst))


def with_torch_csvs(entries: list, world: int) -> list:
    """``entries`` with each ``"torch:<class>"`` case's ``csv`` filled in (``tests/helpers/torch_schedules.py``, here in
    the parent: importing torch.distributed.pipelining costs each rank about a second)."""
    out = []
    for e in entries:
        if isinstance(e, dict) and (e["schedule"] or "").startswith("torch:") and e["csv"] is None:
            from tests.helpers.torch_schedules import torch_schedule_csv
            e = {**e, "csv": torch_schedule_csv(e["schedule"][6:], e["pp"] or world, e["M"])}
        out.append(e)
    return out


def shared_results(world: int, timeout: float = 240) -> list:
    """Per entry, the tuple of per-rank results of the session's job of ``world`` ranks (run once, on first use)."""
    if world not in _RESULTS:
        from tests.helpers.distributed import run_ranks
        entries = with_torch_csvs(_REGISTRY[world], world)
        _RESULTS[world] = list(zip(*run_ranks(job, world, entries, timeout=timeout)))
    return _RESULTS[world]


def custom_plans(rank: int, world: int) -> list:
    """The executor on plans no Megatron schedule produces (``engine.runtime.executor.execute`` directly): GPipe (all
    forwards, then all backwards), and GPipe whose last rank runs its backwards in reverse microbatch order -- so
    the previous rank receives the gradients in another order than it consumes them; plus Megatron's 1F1B and
    interleaved plans with the NCCL posting depth (receives one action ahead) run on gloo.  Returns, per plan, the
    largest relative gradient error against the reference and the recorded vs planned compute order."""
    from engine.runtime.executor import NCCL_PREFETCH
    from engine.plan import Action, Op, Plan
    pgc = build_process_groups(world)
    M, plans = 4, []
    for reverse_last in (False, True):
        per_rank = []
        for r in range(world):
            backward_order = range(M - 1, -1, -1) if reverse_last and r == world - 1 else range(M)
            per_rank.append(tuple([Action(Op.FORWARD, 0, m) for m in range(M)]
                                  + [Action(Op.BACKWARD, 0, m) for m in backward_order]))
        plans.append((Plan("gpipe", world, 1, M, M, False, (M,) * world, tuple(per_rank)), 2))
    plans += [(build_plan("1f1b", world, M), NCCL_PREFETCH), (build_plan("interleaved", world, M, 2, world),
                                                               NCCL_PREFETCH)]
    return [_execute_plan(rank, world, pgc, plan, prefetch) for plan, prefetch in plans]


def _execute_plan(rank: int, world: int, pgc, plan, prefetch: int) -> dict:
    """Run ``plan`` with ``engine.runtime.executor.execute`` on this rank (the test model, output deallocation on);
    the largest relative gradient error against the reference, the recorded and planned compute orders."""
    from engine.plan.lowering import program_for
    from engine.runtime.executor import ExecutionContext, execute
    M, C = plan.num_microbatches, plan.num_model_chunks
    c = case(M=M, chunks=C if plan.schedule == "interleaved" else None, dealloc=True)
    cfg = _config(c, world)
    log = _TraceLog()
    chunks, _ = tm.build_chunks(cfg, world, rank, C, log=log)
    log.rec = _Recorder(log, chunks)
    data = tm.make_data(M, c["seq"], c["mbs"], c["hidden"])
    shape = (c["seq"], c["mbs"], c["hidden"])
    ctx = ExecutionContext(forward_step_func=tm.make_forward_step(2), data_iterators=tm.iterators(data, C),
                           models=chunks, config=cfg, communicator=schedules.P2PCommunicator(pgc.pp, cfg),
                           num_microbatches=M, act_shape=shape, grad_shape=shape, pg_collection=pgc,
                           vp_stages=C > 1)
    store = execute(program_for(plan, rank, prefetch), ctx)
    _, ref = tm.reference(None, world, C, data)
    order = [e if e[0] == "F" else f"B{e.split()[1][1:]}.{e.split()[2][1:]}" for e in log if e[0] in "FB"]
    return {"grad_err": tm.max_rel_error(tm.chunk_grads(chunks), ref), "order": order,
            "plan_order": plan.action_labels(rank), "store_len": len(store), "pp_rank": rank}


def swapped_backward_plan(rank: int, world: int) -> dict:
    """Negative control: Megatron's interleaved plan (``P = world``, VP 2, M 4, G 2) with rank 0's last two
    backwards swapped, run by the executor.  Returns :func:`_execute_plan`'s result (``order`` as run)."""
    import dataclasses
    plan = build_plan("interleaved", world, 4, 2, 2)
    actions = list(plan.actions)
    first = list(actions[0])
    first[-2], first[-1] = first[-1], first[-2]
    actions[0] = tuple(first)
    swapped = dataclasses.replace(plan, actions=tuple(actions))
    return _execute_plan(rank, world, build_process_groups(world), swapped, 1)
