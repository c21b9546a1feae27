"""The trainer's ``cuda_graphs`` call site on gloo ranks: a pp=2 x vp=2 GPT run with emulated graphs gives bitwise
the eager losses and weights; on CPU ``backend: auto`` falls back to eager collectively with one reason.

``ModelChunk`` has no Megatron ``decoder``, so this also covers the runtime's per-chunk microbatch counter.  With
``parallel.tensor: 2`` (pp2 x tp2, 4 ranks) the graphed layers' tensor-parallel collectives run inside the emulated
graphs, in the same order on both ranks of a stage, bitwise eager's.  The
config schema does not list the test-only ``emulate`` backend: the test sets it on the trainer's config after
validation (the runtime is built lazily at the first step).
"""
from __future__ import annotations

import hashlib

import pytest

from tests.helpers.distributed import run_ranks

STEPS = 4


def _overrides(run_dir, **extra):
    return {"model.num_layers": 4, "model.hidden_size": 16, "model.num_attention_heads": 2, "model.seq_length": 8,
            "data.max_bytes": 50_000, "training.micro_batch_size": 2, "training.num_microbatches": 4,
            "training.steps": STEPS, "training.eval_interval": 0, "logging.progress_bar": False,
            "logging.level": "WARNING", "parallel.pipeline": 2, "parallel.virtual": 2,
            "logging.run_dir": str(run_dir), **extra}


def _digest(trainer) -> str:
    h = hashlib.sha256()
    for chunk in trainer.model:
        for p in chunk.parameters():
            h.update(p.detach().float().contiguous().numpy().tobytes())  # bf16 exactly in fp32
    return h.hexdigest()


VARIANTS = {"fp32": {}, "recompute": {"model.recompute": "full"}, "bf16": {"model.precision": "bf16"}}
"""Runs compared eager against emulated graphs (issue 34: recomputed forwards and bf16 chunks are captured too)."""


def _job(rank, world, run_dir):
    out = {}
    for variant, extra in VARIANTS.items():
        backends = (("eager", None), ("emulate", "emulate"), ("auto", "auto")) if variant == "fp32" else \
            (("eager", None), ("emulate", "emulate"))
        for name, backend in backends:
            out[variant, name] = _run(f"{run_dir}/{variant}-{name}", backend, extra)
    return out


def _run(run_dir, backend, extra) -> dict:
    from engine import Trainer
    from engine.training.config import load_config
    config = load_config(None, _overrides(run_dir, **extra))
    with Trainer(config) as trainer:
        if backend is not None:
            trainer.config.cuda_graphs.enabled = True
            trainer.config.cuda_graphs.backend = backend
            trainer.config.cuda_graphs.warmup_steps = 1
        losses, active = [], []
        for _ in range(STEPS):
            losses.append(trainer.train_step()["loss"])
            runtime = getattr(trainer, "_graphs", None)
            active.append(bool(runtime is not None and runtime.active))
        report = runtime.layers.report if backend is not None else None
        result = {"losses": losses, "digest": _digest(trainer), "active": active,
                  "backend": report.backend if report else None, "reason": report.reason if report else None,
                  "graphs": report.num_graphs if report else 0}
        if runtime is not None:
            runtime.close()
    return result


@pytest.mark.timeout(150)
def test_trainer_with_emulated_graphs_matches_eager(tmp_path):
    """fp32, ``model.recompute: full`` and ``model.precision: bf16``: emulated graphs give eager's losses and
    weights bitwise; on CPU ``auto`` falls back to eager."""
    results = run_ranks(_job, 2, tmp_path, timeout=140)
    for rank, res in enumerate(results):
        for variant in VARIANTS:
            eager, graphed = res[variant, "eager"], res[variant, "emulate"]
            assert graphed["backend"] == "emulate" and graphed["active"] == [False] + [True] * (STEPS - 1), variant
            assert graphed["graphs"] == 2 * 1 * 4, variant  # 2 chunks x 1 block x 4 microbatches
            assert graphed["losses"] == eager["losses"], (variant, rank)  # bitwise (floats from the same tensors)
            assert graphed["digest"] == eager["digest"], (variant, rank)
        auto, eager = res["fp32", "auto"], res["fp32", "eager"]
        assert auto["backend"] == "eager" and "no CUDA device" in auto["reason"] and not any(auto["active"])
        assert auto["losses"] == eager["losses"]
    assert results[0]["bf16", "eager"]["losses"] != results[0]["fp32", "eager"]["losses"]  # bf16 did run in bf16


SPLIT_CASES = (("zb_h1", 1, None, "none"), ("zbv", 2, None, "none"), ("zb", 2, 3, "none"), ("zbv", 2, None, "full"))
"""schedule, virtual, max_in_flight, model.recompute (a recomputed block's backward writes its parameters' .grad
itself: inside the ``B`` graph, into the gradient buffers)."""


def _split_job(rank, world, run_dir):
    """zb_h1 and zbv GPT runs, eager and with emulated F / B / W graphs (the trainer wires the W graphs into the
    split backward's W passes)."""
    from engine import Trainer
    from engine.training.config import load_config
    out = {}
    for schedule, virtual, limit, recompute in SPLIT_CASES:
        for backend in (None, "emulate"):
            extra = {"parallel.virtual": virtual, "parallel.schedule": schedule, "parallel.max_in_flight": limit,
                     "model.recompute": recompute}
            if backend is not None:
                extra.update({"cuda_graphs.enabled": True, "cuda_graphs.warmup_steps": 1})
            config = load_config(None, _overrides(f"{run_dir}/{schedule}-{recompute}-{backend}", **extra))
            with Trainer(config) as trainer:
                if backend is not None:
                    trainer.config.cuda_graphs.backend = backend  # test-only backend, set after validation
                losses, active = [], []
                for _ in range(STEPS):
                    losses.append(trainer.train_step()["loss"])
                    runtime = getattr(trainer, "_graphs", None)
                    active.append(bool(runtime is not None and runtime.active))
                report = runtime.layers.report if runtime is not None else None
                out[(schedule, recompute, backend)] = {"losses": losses, "digest": _digest(trainer), "active": active,
                                            "reason": report.reason if report else None,
                                            "order": report.order if report else None}
                if runtime is not None:
                    runtime.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_trainer_split_schedules_with_emulated_graphs_match_eager(tmp_path):
    from engine.plan import build_plan
    from graphs import capture_order
    results = run_ranks(_split_job, 2, tmp_path, timeout=190)
    for rank, res in enumerate(results):
        for schedule, virtual, limit, recompute in SPLIT_CASES:
            eager, graphed = res[(schedule, recompute, None)], res[(schedule, recompute, "emulate")]
            assert graphed["active"] == [False] + [True] * (STEPS - 1), (schedule, rank, graphed["reason"])
            plan = build_plan(schedule, 2, 4, virtual, max_in_flight=limit)  # the trainer's plan, W included
            assert graphed["order"] == capture_order(plan, rank)
            assert graphed["losses"] == eager["losses"], (schedule, recompute, rank)  # bitwise
            assert graphed["digest"] == eager["digest"], (schedule, recompute, rank)


TP_CASES = (("interleaved", 2), ("zbv", 2))  # schedule, virtual; pp2 x tp2 on 4 ranks


def _tensor_parallel_job(rank, world, run_dir):
    """pp2 x tp2 GPT runs (interleaved, and zbv with split backward), eager and with emulated graphs: the layers'
    tensor-parallel collectives (DTensor, gloo) run inside the captured passes, in plan order on both ranks of a
    stage."""
    from engine import Trainer
    from engine.training.config import load_config
    out = {}
    for schedule, virtual in TP_CASES:
        for backend in (None, "emulate"):
            extra = {"parallel.tensor": 2, "parallel.virtual": virtual, "parallel.schedule": schedule,
                     "model.num_attention_heads": 4, "model.vocab_size": 256}
            if backend is not None:
                extra.update({"cuda_graphs.enabled": True, "cuda_graphs.warmup_steps": 1})
            config = load_config(None, _overrides(f"{run_dir}/tp-{schedule}-{backend}", **extra))
            with Trainer(config) as trainer:
                if backend is not None:
                    trainer.config.cuda_graphs.backend = backend  # test-only backend, set after validation
                losses, active = [], []
                for _ in range(STEPS):
                    losses.append(trainer.train_step()["loss"])
                    runtime = getattr(trainer, "_graphs", None)
                    active.append(bool(runtime is not None and runtime.active))
                report = runtime.layers.report if runtime is not None else None
                out[(schedule, backend)] = {
                    "losses": losses, "active": active, "reason": report.reason if report else None,
                    "order": report.order if report else None, "pp_rank": trainer.pp_rank,
                    "local": hashlib.sha256(b"".join(
                        p.detach().to_local().contiguous().numpy().tobytes() if hasattr(p, "to_local") else
                        p.detach().contiguous().numpy().tobytes() for c in trainer.model for p in c.parameters())
                    ).hexdigest()}
                if runtime is not None:
                    runtime.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_chunks_with_emulated_graphs_match_eager(tmp_path):
    """``cuda_graphs.enabled`` with ``parallel.tensor: 2`` (issue 34): every rank's losses and local parameter
    shards after 4 steps are bitwise eager's, graphs active after the warmup step, and the two tensor-parallel ranks
    of a stage capture (and so replay, collectives included) in the same order."""
    results = run_ranks(_tensor_parallel_job, 4, tmp_path, timeout=290)
    for schedule, _ in TP_CASES:
        orders = {}
        for rank, res in enumerate(results):
            eager, graphed = res[(schedule, None)], res[(schedule, "emulate")]
            assert graphed["active"] == [False] + [True] * (STEPS - 1), (schedule, rank, graphed["reason"])
            assert graphed["losses"] == eager["losses"], (schedule, rank)
            assert graphed["local"] == eager["local"], (schedule, rank)
            orders.setdefault(graphed["pp_rank"], []).append(graphed["order"])
        assert all(len(o) == 2 and o[0] == o[1] for o in orders.values()), orders
