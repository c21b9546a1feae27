"""``parallel.shard: optimizer`` (ZeRO-1) and ``full`` (FSDP2) with expert parallelism, against an independent
single-process reference.

One 4-rank job of the ``llama_moe`` recipe (tests/moe/test_moe_recipe.py's tiny model, its sizes and data):

* **A**: pipeline 1 x data 4, ``parallel.expert=2``, ``shard: optimizer`` -- dense parameters sharded over the 4
  data-parallel ranks, routed experts over the 2 expert-data-parallel ranks holding them -- :data:`STEPS` steps with
  a grad clip small enough to act on every step (:data:`CLIP`) and weight decay, saving after step 2;
* **B**: A's step-2 checkpoint resumed at ``parallel.expert=1``, ``shard: none`` (every rank every expert, whole
  AdamW state) for step 3;
* **C**: the same checkpoint resumed at pipeline 2 x data 2, ``parallel.expert=2``, ``shard: optimizer`` (experts
  not replicated: an expert-data-parallel group of one) for step 3;
* **D**: the same checkpoint resumed at pipeline 1 x data 4, ``parallel.expert=2``, ``shard: full`` (FSDP2: dense
  parameters sharded over the 4 data-parallel ranks, each MoE layer's experts a unit of their own over the 2
  expert-data-parallel ranks) for step 3;
* **E**: the same checkpoint resumed at pipeline 2 x data 2, ``parallel.expert=2``, ``shard: full`` under DualPipeV
  with the all-to-alls overlapped in its cells (FSDP2's hooks inside interleaved microbatches) for step 3.

The reference (in this process) takes A's recorded parameters of each step, computes the objective and its
gradients with :func:`tests.moe.test_moe_recipe.reference_objective` (plain autograd, no trainer or ``engine.moe``
code), the global norm over every parameter once (``torch.nn.utils.get_total_norm``), the clip
(``g * min(1, clip / (norm + 1e-6))``) and ``torch.optim.AdamW`` (its moments carried over the steps).  Checked:
A's loss and grad norm every step, and its parameters after every update, equal the reference's; B to E start
from bitwise A's step-3 parameters and give A's step-3 loss, norm and updated parameters.  Tolerance (fp32): losses
relative 1e-6, grad norms relative 1e-5, parameters 1e-5 relative to each tensor's largest element beyond an
absolute 1e-4 of the learning rate (:func:`param_error`): the reduce-scatter sums in another order than the
reference's autograd, and AdamW's update ``lr g / (|g| + eps)`` magnifies the rounding of a near-zero gradient
element up to ``lr / eps`` times (measured: 4e-7 absolute on one of 192 elements of a small expert weight at step 1;
a wrongly reduced or counted expert gradient moves parameters by up to the learning rate, 1e-2).
"""
from __future__ import annotations

import pytest
import torch

from engine.training.config import load_config
from tests.helpers.distributed import run_ranks
from tests.moe.test_moe_recipe import MODEL, MOE, PRESET, _params, _steps, overrides, reference_objective
from tests.training.test_trainer_reference import global_batch, max_rel_error, recorded_leaves

STEPS, CLIP, LR, DECAY = 3, 0.05, 1e-2, 0.1
MOE_LAYERS, MOE_EXPERT_ELEMENTS = MODEL["num_layers"], MODEL["hidden_size"] * MOE["ffn_hidden_size"]
TOL, ABS, LOSS_TOL, NORM_TOL = 1e-5, 1e-4 * LR, 1e-6, 1e-5
LAYOUTS = {  # name -> (pipeline, data, expert, shard, schedule)
    "A": (1, 4, 2, "optimizer", "1f1b"), "B": (1, 4, 1, "none", "1f1b"), "C": (2, 2, 2, "optimizer", "1f1b"),
    "D": (1, 4, 2, "full", "1f1b"), "E": (2, 2, 2, "full", "dualpipev")}


def _config(run_dir, name: str):
    pipeline, data, expert, shard, schedule = LAYOUTS[name]
    cells = schedule == "dualpipev"
    return load_config(PRESET, overrides(run_dir, **{
        "parallel.pipeline": pipeline, "parallel.virtual": 2 if cells else 1, "parallel.schedule": schedule,
        "parallel.data": data, "parallel.expert": expert, "parallel.shard": shard,
        "parallel.overlap_moe_expert_parallel_comm": cells,
        "training.num_microbatches": 8 // data, "training.steps": STEPS, "optimizer.grad_clip": CLIP,
        "optimizer.lr": LR, "optimizer.min_lr": LR, "optimizer.weight_decay": DECAY}))


def param_error(got, want: torch.Tensor) -> float:
    """The largest elementwise ``|got - want|`` beyond :data:`ABS`, relative to ``want``'s largest element."""
    excess = ((torch.as_tensor(got) - want).abs() - ABS).clamp_min(0).max()
    return (excess / want.abs().max().clamp_min(1e-30)).item()


def _shards(trainer) -> list:
    """``(experts, shard group size)`` of each ZeRO-1 buffer of this rank; under FSDP2 of each parameter."""
    from torch.distributed.tensor import DTensor
    if trainer.parallelism.shard == "full":
        return sorted({(getattr(p, "expert_parallel", False), p.device_mesh.size() if isinstance(p, DTensor) else 1)
                       for p in trainer.canonical.parameters()})
    return [(s.experts, s.size) for s in getattr(trainer.parallelism.grad_sync, "shards", [])]


def _full(trainer) -> dict:
    """``{name: full parameter}`` (numpy; FSDP2's shards gathered: collective)."""
    from engine.training.parallel.fsdp import full_parameters
    return {n: p.numpy().copy() for n, p in full_parameters(trainer.canonical).items()}


def _job(rank: int, world: int, run_dir: str) -> dict:
    from engine import Trainer
    out = {}
    with Trainer(_config(run_dir, "A")) as trainer:
        out["A"] = _steps(trainer, 2)
        checkpoint = trainer.save()
        _steps(trainer, 1, out["A"])
        out["A_final"], out["A_shards"] = _params(trainer), _shards(trainer)
        out["A_state_bytes"], out["A_saved"] = trainer.optimizer.state_bytes(), str(trainer.save())
    for name in ("B", "C", "D", "E"):
        with Trainer(_config(run_dir, name)) as trainer:
            trainer.load(checkpoint)
            start = _full(trainer)
            m = trainer.train_step()
            out[name] = {"start": start, "loss": m["loss"], "grad_norm": m["grad_norm"], "final": _full(trainer),
                         "shards": _shards(trainer)}
            if name == "D":
                out["D_saved"] = str(trainer.save(f"{run_dir}/D"))
    return out


def _reference_steps(per_rank: list) -> list:
    """Per step ``(cross-entropy, global norm, {name: parameter after the update})`` of the reference, each step
    from the parameters A recorded at its start."""
    leaves, o = recorded_leaves(per_rank, 0), _config("run", "A").optimizer
    decay = [p for p in leaves.values() if p.dim() >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": DECAY},
                                   {"params": [p for p in leaves.values() if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=LR, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    out = []
    for step in range(len(per_rank[0])):
        with torch.no_grad():
            for name, value in recorded_leaves(per_rank, step).items():
                leaves[name].copy_(value)
        tokens, labels = global_batch(per_rank, step)
        objective, ce, _ = reference_objective(leaves, tokens, labels)
        grads = torch.autograd.grad(objective, list(leaves.values()))
        norm = torch.nn.utils.get_total_norm(list(grads)).item()
        for p, g in zip(leaves.values(), grads):
            p.grad = g * min(1.0, CLIP / (norm + 1e-6))
        optimizer.step()
        out.append((ce.item(), norm, {n: p.detach().clone() for n, p in leaves.items()}))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    return run_ranks(_job, 4, str(tmp_path_factory.mktemp("moe_zero1")), timeout=300)


def _after(per_rank: list, step: int, final: dict) -> dict:
    """The parameters after step ``step``'s update: those recorded at the next step's start, or ``final``."""
    if step + 1 < len(per_rank[0]):
        return {n: v for steps in per_rank for n, (v, _) in steps[step + 1]["params"].items()}
    return final


@pytest.mark.timeout(300)
def test_zero1_with_experts_equals_the_reference_with_the_clip_acting(ranks):
    assert [r["A_shards"] for r in ranks] == [[(False, 4), (True, 2)]] * 4  # dense over dp 4, experts over 2
    per_rank = [r["A"] for r in ranks]
    final = {n: v for r in ranks for n, v in r["A_final"].items()}
    worst = 0.0
    for step, (ce, norm, params) in enumerate(_reference_steps(per_rank)):
        assert norm > 2 * CLIP, f"step {step}: grad norm {norm} does not exceed the clip {CLIP}"
        for r in per_rank:
            where = f"A step {step} dp_rank {r[step]['dp_rank']}"
            assert r[step]["loss"] == pytest.approx(ce, rel=LOSS_TOL), where
            assert r[step]["grad_norm"] == pytest.approx(norm, rel=NORM_TOL), where  # each expert shard once
        after = _after(per_rank, step, final)
        assert after.keys() == params.keys()
        for name, value in after.items():
            err = param_error(value, params[name])
            assert err <= TOL, f"A step {step}: {name} differs from the reference by {err:.3g} (relative)"
            worst = max(worst, (torch.from_numpy(value) - params[name]).abs().max().item())
    print(f"ZeRO-1 x expert 2: largest absolute parameter difference {worst:.3g}")


SHARDS = {"B": [], "C": [(False, 2), (True, 1)],  # C: each expert on one rank, its buffer's shard group that rank
          "D": [(False, 4), (True, 2)],  # D: dense parameters over dp 4, experts over their 2 expert-data ranks
          "E": [(False, 2), (True, 1)]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["B", "C", "D", "E"])
def test_a_sharded_expert_checkpoint_resumes_at_another_layout(ranks, name):
    """B: expert 1, ``shard: none``; C: pipeline 2 x data 2, expert 2, ``shard: optimizer``; D: expert 2,
    ``shard: full``; E: pipeline 2 x data 2, expert 2, ``shard: full`` under DualPipeV with overlapped cells."""
    assert [r[name]["shards"] for r in ranks] == [SHARDS[name]] * 4
    a_step3 = {n: v for r in ranks for n, (v, _) in r["A"][2]["params"].items()}
    a_final = {n: v for r in ranks for n, v in r["A_final"].items()}
    for r in ranks:
        got = r[name]
        assert got["loss"] == pytest.approx(r["A"][2]["loss"], rel=LOSS_TOL), name
        assert got["grad_norm"] == pytest.approx(r["A"][2]["grad_norm"], rel=NORM_TOL), name
        for pname, value in got["start"].items():
            assert (value == a_step3[pname]).all(), f"{name}: {pname} is not the saved parameter"
        for pname, value in got["final"].items():  # AdamW moments restored from A's shards: the same update
            err = param_error(value, torch.from_numpy(a_final[pname]))
            assert err <= TOL, f"{name}: {pname} after step 3 differs from A's by {err:.3g}"


@pytest.mark.timeout(300)
def test_the_memory_estimate_counts_the_experts_state_sharded_over_their_expert_data_ranks(ranks):
    """A's AdamW bytes per rank (moments of its pieces, a step scalar per piece) against
    :func:`engine.training.memory.estimate`'s: ``8 (dense / 4 + experts / 2)`` plus a step per tensor; they differ
    by the shards' rounding up (``8 x (1 + 1)`` bytes at most) and the steps of tensors this rank holds no piece of."""
    from engine.training.memory import estimate, stage_expert_parameters, stage_parameters
    config = _config("run", "A")
    elements, tensors = stage_parameters(config, 0)
    experts = stage_expert_parameters(config, 0)
    assert experts == MOE_LAYERS * 2 * 3 * MOE_EXPERT_ELEMENTS  # 2 of 4 experts, 3 weights each, per layer
    want = estimate(config).ranks[0].optimizer
    assert want == 8 * (elements - experts) // 4 + 8 * experts // 2 + 4 * tensors
    print(f"ZeRO-1 x expert 2 AdamW bytes per rank: {[r['A_state_bytes'] for r in ranks]} (estimate {want})")
    for r in ranks:
        assert abs(r["A_state_bytes"] - want) <= 4 * tensors + 16, (r["A_state_bytes"], want)


@pytest.mark.timeout(300)
def test_fsdp2_with_experts_saves_the_state_zero1_with_experts_saves(ranks, tmp_path):
    """A's (ZeRO-1) and D's (FSDP2) step-3 checkpoints, read whole in this process: the same tensors under the same
    names -- parameters and AdamW moments of every expert once, whichever ranks wrote their shards (relative 1e-5
    to each tensor's largest element)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    read = {}
    for name in ("A", "D"):
        dcp_to_torch_save(ranks[0][f"{name}_saved"], tmp_path / f"{name}.pt")
        saved = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        read[name] = {f"{part}.{k}": v for part in ("model", "optim") for k, v in saved[part].items()}
    assert read["A"].keys() == read["D"].keys()
    assert sum(".moe.experts." in k and k.endswith("exp_avg_sq") for k in read["A"]) == MOE_LAYERS * 4 * 3
    for key, want in read["A"].items():
        got = read["D"][key]
        if key.endswith(".step"):
            assert torch.equal(got, want), key
        else:
            assert max_rel_error(got, want) <= TOL, key
