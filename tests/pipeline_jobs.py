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
from tests import models as tm

DEFAULTS = dict(pp=None, chunks=None, M=4, G=None, batch=True, overlap=False, dealloc=False, forward_only=False,
                mode=2, per_token=False, grad_scale=None, repeats=1, seq=4, mbs=2, hidden=8, kind="linear",
                layers=1, variable=False, seqs=None, zero_mb=None, moe=False, collect=False, first_val_step=None,
                ckpt=None, hooks=False, sleep=0.0, dtype="float32", tokens=None, sequence=None, explicit=True,
                M_by_rank=None, seed=0, func=None, seq_by_dp=None, output="plain")


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
                              num_microbatches_with_partial_activation_checkpoints=c["ckpt"],
                              num_moe_experts=2 if c["moe"] else None, params_dtype=dtype)
    if c["grad_scale"] is not None:
        cfg.grad_scale_func = lambda t, s=c["grad_scale"]: t * s
    return cfg


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

    def compute_order(self):
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
    chunks, _ = tm.build_chunks(cfg, pp, pp_rank, C, hidden=c["hidden"], layers_per_stage=c["layers"],
                                kind=c["kind"], dtype=getattr(torch, c["dtype"]), seed=c["seed"], log=log,
                                output=c["output"])
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
    fsf = tm.make_forward_step(c["mode"], sleep)

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
    if c["func"]:
        func = getattr(schedules, c["func"])
    elif c["explicit"]:
        func = schedules.get_forward_backward_func(pp, c["chunks"])
    else:
        func = schedules.get_forward_backward_func()  # sizes from engine.parallel_state
    schedule = {"forward_backward_no_pipelining": "no_pipelining",
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
        call = {"forward_only": fo, "M": M, "store_len": len(store), "order": log.compute_order(), "events": list(log),
                "plan_order": build_plan(schedule, pp, M, C, c["G"] if c["chunks"] else None,
                                         fo).compute_order(pp_rank) * (1 if fo else c["repeats"]),
                "seen_ok": all(mb == cur for ch in chunks for mb, cur, _ in ch.seen),
                "input_dtypes": sorted({str(d) for ch in chunks for d in ch.input_dtypes}),
                "inputs_alive": _alive_inputs(chunks),
                "tokens": rec.tokens, "collected": store if c["collect"] else None}
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
        result["calls"].append(call)
    result["grad_err"] = max((k.get("grad_err", 0.0) for k in result["calls"]), default=0.0)
    result["loss_err"] = max((k.get("loss_err", 0.0) for k in result["calls"]), default=0.0)
    return result


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


# ---- one job per world size for the whole pytest session ----------------------------------------------------------
_REGISTRY: dict = {}
_RESULTS: dict = {}


def register(world: int, entries: list) -> slice:
    """Add entries to the session's job of ``world`` ranks (call at import time); returns their slice."""
    lst = _REGISTRY.setdefault(world, [])
    start = len(lst)
    lst.extend(entries)
    return slice(start, len(lst))


def shared_results(world: int, timeout: float = 240) -> list:
    """Per entry, the tuple of per-rank results of the session's job of ``world`` ranks (run once, on first use)."""
    if world not in _RESULTS:
        from tests.distributed import run_ranks
        _RESULTS[world] = list(zip(*run_ranks(job, world, _REGISTRY[world], timeout=timeout)))
    return _RESULTS[world]


def custom_plans(rank: int, world: int) -> list:
    """The executor on plans no Megatron schedule produces (``engine.runtime.executor.execute`` directly): GPipe (all
    forwards, then all backwards), and GPipe whose last rank runs its backwards in reverse microbatch order -- so
    the previous rank receives the gradients in another order than it consumes them; plus Megatron's 1F1B and
    interleaved plans with the NCCL posting depth (receives one action ahead) run on gloo.  Returns, per plan, the
    largest relative gradient error against the reference and the recorded vs planned compute order."""
    from engine.runtime.executor import NCCL_PREFETCH, ExecutionContext, execute, program_for
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
    out = []
    for plan, prefetch in plans:
        C = plan.num_model_chunks
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
        out.append({"grad_err": tm.max_rel_error(tm.chunk_grads(chunks), ref), "order": order,
                    "plan_order": plan.compute_order(rank), "store_len": len(store)})
    return out
