"""The recipe's settings for fitting a large model -- ``model.recompute``, ``model.precision: bf16``,
``model.pipeline_layout`` -- end to end through the trainer, against single-process pp1 runs.

A tiny GPT (untied head, no dropout: every parameter lives on one rank, so each parameter's gradient is the sum,
in microbatch order, of the same per-microbatch gradients in every layout) trains :data:`STEPS` steps; before each
optimizer step every rank records its gradients under the canonical names (under bf16: the fp32 master gradients).

* pp1 in this process: fp32 without recomputation is the reference (the trainer's pp1 against plain autograd:
  ``tests/training/test_trainer_reference.py``);
  ``full`` and ``selective`` recomputation give the same gradients bit for bit; bf16 is within :data:`BF16_TOL` of
  the fp32 gradients (first step) and losses; a bf16 run saved after step 1 and resumed by a fresh trainer continues exactly (the checkpoint
  holds the fp32 master weights).
* One spawned 2-rank job (:data:`RUNS`): recomputation (full, selective, partial by microbatch) with uneven layouts
  under 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV (the split-backward and V-placement ones included) gives
  the pp1 fp32 gradients bit for bit, every stage holding the layout's layers and every block (or attention core)
  marked; bf16 under 1F1B, interleaved 1F1B and ZB-H1 gives the pp1 bf16 gradients bit for bit (the same fp32
  accumulation order), bf16 under FSDP2 (``data: 2``) is within :data:`FSDP_TOL` of pp1 bf16, under ZeRO-1 its
  losses within 1e-6;
  tensor parallelism (``tensor: 2``) with full recomputation and sequence parallelism is within :data:`TP_TOL` of
  pp1 fp32, with bf16 and selective recomputation within :data:`BF16_TOL`.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.training.test_trainer_reference import max_rel_error

STEPS = 2
BF16_TOL = 0.02
"""bf16 against fp32, the first step's gradients (the same weights): max |diff| / max |ref| of each gradient (bf16
keeps 8 significant bits, 2^-9 relative per rounding, a few dozen roundings deep).  After an AdamW step the weights
themselves differ (AdamW's first update is about ``lr * sign(grad)``), so later steps compare losses only."""
TP_TOL = 5e-5
"""fp32 under ``parallel.tensor: 2`` against pp1: the row-parallel projections' partial sums add in another order
(as in ``tests/training/parallel/test_parallel_combinations.py``)."""
FSDP_TOL = 1e-5
"""bf16 under FSDP2 against bf16 on one rank: the same per-microbatch bf16 gradients, summed in fp32 in another
order (each replica's two microbatches, then the reduce-scatter's average)."""
MODEL = {"num_layers": 6, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 8, "tie_embeddings": False,
         "dropout": 0.0}

# name -> (parallel.* overrides, model.* overrides); all run in one spawned 2-rank job
RUNS = {
    "1f1b_full": ({"pipeline": 2, "schedule": "1f1b"}, {"recompute": "full", "pipeline_layout": "Et*2|t*4L"}),
    "interleaved_selective": ({"pipeline": 2, "virtual": 2}, {"recompute": "selective",
                                                               "pipeline_layout": "Et|t*2|t*2|tL"}),
    "zb_h1_partial": ({"pipeline": 2, "schedule": "zb_h1"}, {"recompute": "full", "recompute_kept_microbatches": 1,
                                                             "pipeline_layout": "Et*4|t*2L"}),
    "zbv_selective": ({"pipeline": 2, "virtual": 2, "schedule": "zbv"}, {"recompute": "selective",
                                                                         "pipeline_layout": "E|t*2|t*3|tL"}),
    "dualpipev_full": ({"pipeline": 2, "virtual": 2, "schedule": "dualpipev"}, {"recompute": "full",
                                                                                "pipeline_layout": "Et*2|t|t*2|tL"}),
    "bf16_1f1b": ({"pipeline": 2, "schedule": "1f1b"}, {"precision": "bf16"}),
    "bf16_interleaved": ({"pipeline": 2, "virtual": 2}, {"precision": "bf16", "pipeline_layout": "Et|t*2|t*2|tL"}),
    "bf16_zb_h1_full": ({"pipeline": 2, "schedule": "zb_h1"}, {"precision": "bf16", "recompute": "full"}),
    "bf16_fsdp": ({"data": 2, "shard": "full"}, {"precision": "bf16"}),
    "bf16_zero1": ({"data": 2, "shard": "optimizer"}, {"precision": "bf16"}),
    "bf16_tp2_selective": ({"tensor": 2}, {"precision": "bf16", "recompute": "selective"}),
    "tp2_sp_full": ({"tensor": 2, "sequence_parallel": True}, {"recompute": "full"}),
}


def overrides(parallel: dict, model: dict, run_dir, steps: int = STEPS) -> dict:
    data = parallel.get("data", 1)
    return {**{f"model.{k}": v for k, v in {**MODEL, **model}.items()}, "data.max_bytes": 50_000,
            "training.micro_batch_size": 2, "training.num_microbatches": 4 // data, "training.steps": steps,
            "training.eval_interval": 0, "optimizer.grad_clip": 0.0, "optimizer.lr": 1e-2,
            "optimizer.warmup_steps": 0, "checkpoint.interval": 0, "checkpoint.save_at_end": False,
            "logging.progress_bar": False, "logging.level": "WARNING", "logging.run_dir": str(run_dir),
            **{f"parallel.{k}": v for k, v in parallel.items()}}


def _numpy(t):
    """A numpy copy of ``t`` (a ``DTensor`` gathered whole: collective over its mesh)."""
    if t is None:
        return None
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().float().cpu().numpy().copy()


def train(parallel: dict, model: dict, run_dir, resume_after: int = 0) -> dict:
    """:data:`STEPS` steps; per step ``{name: grad}`` and the loss, and per stage its decoder layers and the
    classes of its recomputed modules.  ``resume_after``: save after that many steps and run the rest in a fresh
    trainer loading the checkpoint (``saved_dtypes``: the dtypes of the model tensors it saved)."""
    from engine import Trainer, load_config
    from engine.runtime.recompute import recomputed_modules
    config = load_config(None, overrides(parallel, model, run_dir))
    out: dict = {"grads": [], "losses": [], "received": []}
    for first, last in ((0, resume_after), (resume_after, STEPS)) if resume_after else ((0, STEPS),):
        with Trainer(config) as trainer:
            for chunk in trainer.model:  # the bytes of each activation a stage receives from the one before
                chunk.set_input_tensor = _recording(chunk.set_input_tensor, out["received"])
            if first:
                trainer.load(out["saved"])
            trainer.optimizer.register_step_pre_hook(lambda *_, t=trainer: out["grads"].append(
                {n: _numpy(p.grad) for n, p in t.canonical.named_parameters()}))
            out["losses"] += [trainer.train_step()["loss"] for _ in range(first, last)]
            if last < STEPS:
                out["saved"] = trainer.save()
                out["saved_dtypes"] = {str(v.dtype) for v in trainer.state_dict()["model"].values()}
            out["stages"] = {c.stage: (len(c.layers), sorted({type(m).__name__ for m in recomputed_modules(c)}))
                             for c in trainer.model}
    return out


def _recording(set_input_tensor, received: list):
    def record(tensor):
        t = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
        if t is not None:
            received.append((str(t.dtype), t.untyped_storage().nbytes()))
        return set_input_tensor(tensor)
    return record


def _job(rank: int, world: int, run_dir: str) -> dict:
    return {name: train(p, m, f"{run_dir}/{name}") for name, (p, m) in RUNS.items()}


def merged(per_rank: list, name: str) -> dict:
    """The run's gradients of every rank in one dict per step, its loss (the last stage's), its stages."""
    grads = [{} for _ in range(STEPS)]
    stages: dict = {}
    for r in per_rank:
        for step, g in enumerate(r[name]["grads"]):
            for n, v in g.items():
                assert n not in grads[step] or (grads[step][n] == v).all(), f"{name}: replicas differ on {n}"
                grads[step][n] = v
        stages.update(r[name]["stages"])
    return {"grads": grads, "stages": stages}


def assert_equal_grads(got: list, want: list, where: str, tol: float = 0.0) -> float:
    worst = 0.0
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"{where} step {step}: other parameters"
        for n in w:
            assert g[n] is not None, f"{where} step {step}: {n} has no gradient"
            err = max_rel_error(torch.from_numpy(g[n]), torch.from_numpy(w[n]))
            assert err <= tol, f"{where} step {step}: {n} differs by {err:.3g} (relative; allowed {tol})"
            worst = max(worst, err)
    return worst


@pytest.fixture(scope="module")
def pp1(tmp_path_factory) -> dict:
    runs = {"fp32": {}, "full": {"recompute": "full"}, "selective": {"recompute": "selective"},
            "bf16": {"precision": "bf16"}, "bf16_resumed": {"precision": "bf16"}}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks run: another thread count may split a matmul's sums otherwise
    try:
        return {name: train({"pipeline": 1}, m, tmp_path_factory.mktemp(name), resume_after=int("resumed" in name))
                for name, m in runs.items()}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> list:
    return run_ranks(_job, 2, str(tmp_path_factory.mktemp("pp2")), timeout=200)


@pytest.mark.timeout(300)
def test_pp1_recompute_changes_no_bit(pp1):
    assert pp1["fp32"]["stages"] == {0: (6, [])}
    for name, core in (("full", "Block"), ("selective", "CoreAttention")):
        assert pp1[name]["stages"] == {0: (6, [core])}, name
        assert_equal_grads(pp1[name]["grads"], pp1["fp32"]["grads"], f"pp1 {name}")
        assert pp1[name]["losses"] == pp1["fp32"]["losses"], name


@pytest.mark.timeout(300)
def test_bf16_within_tolerance_of_fp32(pp1):
    worst = assert_equal_grads(pp1["bf16"]["grads"][:1], pp1["fp32"]["grads"][:1], "pp1 bf16 vs fp32", BF16_TOL)
    assert worst > 0, "bf16 gave the fp32 gradients exactly: the model did not run in bf16"
    for got, want in zip(pp1["bf16"]["losses"], pp1["fp32"]["losses"]):
        assert got == pytest.approx(want, rel=1e-3)
    print(f"bf16 vs fp32: largest relative gradient difference {worst:.3g} (tolerance {BF16_TOL})")


@pytest.mark.timeout(300)
def test_bf16_resume_is_exact(pp1):
    """Saved after step 1 and resumed by a fresh trainer: step 2's gradients and loss equal the straight run's bit
    for bit (the fp32 master weights and AdamW state came back, and the bf16 weights were copied from them)."""
    resumed, straight = pp1["bf16_resumed"], pp1["bf16"]
    assert resumed["saved_dtypes"] == {"torch.float32"}, resumed["saved_dtypes"]
    assert_equal_grads(resumed["grads"], straight["grads"], "bf16 resumed after step 1")
    assert resumed["losses"] == straight["losses"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith(("bf16", "tp2"))])
def test_recompute_and_layouts_under_every_schedule_give_pp1_bits(pp1, pp2, name):
    run = merged(pp2, name)
    _, model = RUNS[name]
    counts = [len(stage.strip("EL")) for stage in _stages(model["pipeline_layout"])]
    core = {"full": ["Block"], "selective": ["CoreAttention"]}[model["recompute"]]
    assert run["stages"] == {s: (c, core if c else []) for s, c in enumerate(counts)}, run["stages"]
    assert_equal_grads(run["grads"], pp1["fp32"]["grads"], name)


def _stages(layout: str) -> list[str]:
    from engine.plan.layout import parse_layout
    return list(parse_layout(layout).stages)


@pytest.mark.timeout(300)
def test_bf16_under_schedules_and_fsdp(pp1, pp2):
    for name in ("bf16_1f1b", "bf16_interleaved", "bf16_zb_h1_full"):
        assert_equal_grads(merged(pp2, name)["grads"], pp1["bf16"]["grads"], name)
    # the messages between stages are bf16: half the bytes of fp32's (the same [s, b, h] per microbatch)
    bf16, fp32 = pp2[1]["bf16_1f1b"]["received"], pp2[1]["1f1b_full"]["received"]
    assert len(bf16) == len(fp32) == STEPS * 4 and {d for d, _ in bf16} == {"torch.bfloat16"}, bf16
    assert 2 * sum(n for _, n in bf16) == sum(n for _, n in fp32), (bf16, fp32)
    fsdp = merged(pp2, "bf16_fsdp")["grads"]
    worst = assert_equal_grads(fsdp, pp1["bf16"]["grads"], "bf16 FSDP2 vs bf16 pp1", FSDP_TOL)
    print(f"bf16 FSDP2 vs bf16 on one rank: largest relative gradient difference {worst:.3g}")
    for r in pp2:  # ZeRO-1: each replica's .grad is its own until the reduce-scatter; the losses tell the update
        assert r["bf16_zero1"]["losses"] == pytest.approx(pp1["bf16"]["losses"], rel=1e-6, abs=0)


@pytest.mark.timeout(300)
def test_tensor_parallel_with_recompute_and_bf16(pp1, pp2):
    """``parallel.tensor: 2``: full recomputation with sequence parallelism within :data:`TP_TOL` of the pp1 fp32
    gradients (tensor parallelism sums in another order); bf16 with selective recomputation within
    :data:`BF16_TOL` of them (first step) -- every block's attention core marked on both ranks."""
    tp = merged(pp2, "tp2_sp_full")
    assert tp["stages"] == {0: (6, ["Block"])}
    worst = assert_equal_grads(tp["grads"], pp1["fp32"]["grads"], "tp2 sp full", TP_TOL)
    bf16 = merged(pp2, "bf16_tp2_selective")
    assert bf16["stages"] == {0: (6, ["CoreAttention"])}
    worst_bf16 = assert_equal_grads(bf16["grads"][:1], pp1["fp32"]["grads"][:1], "tp2 bf16 selective", BF16_TOL)
    print(f"tensor 2: largest relative gradient difference fp32 {worst:.3g}, bf16 {worst_bf16:.3g}")
