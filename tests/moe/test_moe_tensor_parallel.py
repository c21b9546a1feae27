"""``model.moe`` with ``parallel.tensor: 2`` (expert-tensor size 1) against the recipe's independent reference.

One 4-rank job trains :data:`STEPS` steps of each layout in :data:`LAYOUTS` -- pp1 x tp2 (data 2) and pp2 x tp2 with
and without sequence parallelism, and pp1 x tp2 x expert 2 with it (the expert groups are the tensor-parallel pairs:
Megatron-Core's expert rank generator with expert-tensor size 1), under 1F1B, ZB-H1 and DualPipeV with overlapped
cells (at expert 2 the all-to-alls overlap the other microbatch) -- with the load-balancing loss on
(``aux_loss_coeff`` 0.01), so the router's gradient carries it. Before each optimizer step every rank gathers its
full parameters and gradients (``DTensor.full_tensor``; a gradient still ``Partial`` is kept as the rank's unreduced
part, so a missed tensor-parallel sum shows). Checked on every rank and step, against
:func:`tests.moe.test_moe_recipe.reference` (a Llama forward with mixtures of experts written from the recorded
parameters alone, plain autograd): the loss, the grad norm (experts and the replicated router counted once), the
router's tokens per expert and load-balancing loss in the metrics, and every gradient (fp32, relative 1e-5:
``test_moe_recipe.TOL``); the parameters every holder recorded are bitwise equal (tensor-parallel ranks stay in
step); the expert groups are the tensor-parallel pairs at expert 2, one rank otherwise, and the expert-data-parallel
group holds the tensor-parallel peers that share the experts. pp2 x tp2 with sequence parallelism runs ZB-H1 (split
backward: the router's DTensor weight gradient in W).
"""
from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks
from tests.moe.test_moe_recipe import (
    GLOBAL_MICROBATCHES, MODEL, PRESET, check_against_reference, overrides, reference_objective)
from tests.training.parallel.test_tensor_parallel import _full
from tests.training.test_trainer_reference import global_batch, recorded_leaves, recorded_step

WORLD, STEPS = 4, 2
LAYOUTS = {  # name -> parallel section (default 1F1B; parallel.data = 4 / (pipeline x tensor))
    "tp2": dict(pipeline=1, tensor=2),
    "tp2_sp_ep2": dict(pipeline=1, tensor=2, sequence_parallel=True, expert=2),
    "pp2_tp2": dict(pipeline=2, tensor=2),
    "pp2_tp2_sp_zb_h1": dict(pipeline=2, tensor=2, sequence_parallel=True, schedule="zb_h1"),
    "pp2_tp2_dualpipev": dict(pipeline=2, virtual=2, tensor=2, schedule="dualpipev",
                              overlap_moe_expert_parallel_comm=True),
    "tp2_sp_ep2_dualpipev": dict(pipeline=1, virtual=2, tensor=2, sequence_parallel=True, expert=2,
                                 schedule="dualpipev", overlap_moe_expert_parallel_comm=True),
}


def _config(parallel: dict, run_dir):
    from engine.training.config import load_config
    data = WORLD // (parallel["pipeline"] * parallel["tensor"])
    more = {"parallel.virtual": 1, "parallel.schedule": "1f1b", "parallel.expert": 1, "parallel.data": data,
            "parallel.overlap_moe_expert_parallel_comm": False, "training.steps": STEPS,
            "training.num_microbatches": GLOBAL_MICROBATCHES // data} | {f"parallel.{k}": v for k, v in parallel.items()}
    return load_config(PRESET, overrides(run_dir, **more))


def _train(parallel: dict, run_dir) -> list:
    """Per step: the full parameters and gradients before the update, the inputs, metrics and router metrics."""
    from engine import Trainer
    steps: list = []
    with Trainer(_config(parallel, run_dir)) as trainer:
        def hook(optimizer, args, kwargs):  # full_tensor: collective over tp, in the same order on every rank
            named = trainer.canonical.named_parameters(remove_duplicate=False)
            steps.append({"params": {n: (_full(p), _full(p.grad)) for n, p in named}})
        trainer.optimizer.register_step_pre_hook(hook)
        for _ in range(STEPS):
            recorded_step(trainer, steps)
            steps[-1]["router"] = trainer.router_metrics.collect()
        pg = trainer.pg
        steps[0]["groups"] = {"tp": pg.tp_ranks, "ep": pg.ep_ranks, "expt_dp": pg.expt_dp_ranks}
    return steps


def _job(rank, world, run_dir) -> dict:
    return {name: _train(parallel, f"{run_dir}/{name}") for name, parallel in LAYOUTS.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    return run_ranks(_job, WORLD, tmp_path_factory.mktemp("moe_tp"), timeout=400)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", LAYOUTS)
def test_moe_with_tensor_parallel_equals_the_reference(ranks, name):
    per_rank = [r[name] for r in ranks]
    print(f"{name}: largest relative gradient error {check_against_reference(per_rank, name):.3g}")
    for r, steps in enumerate(per_rank):  # expert-tensor size 1: the experts' replicas include the tp ranks
        groups = steps[0]["groups"]
        ep = groups["tp"] if LAYOUTS[name].get("expert", 1) > 1 else (r,)
        assert groups["ep"] == ep and set(groups["tp"]) - set(ep) <= set(groups["expt_dp"]), (name, r, groups)
    for step in range(STEPS):
        objective, ce, _ = reference_objective(recorded_leaves(per_rank, step), *global_batch(per_rank, step))
        aux = (objective - ce).item() / MODEL["num_layers"]  # per layer and microbatch
        assert all(s[step]["router"]["moe_aux_loss"] == pytest.approx(aux, rel=1e-5) for s in per_rank), name
        first: dict = {}
        for r, steps in enumerate(per_rank):
            for pname, (value, _) in steps[step]["params"].items():
                want = first.setdefault(pname, value)
                assert (value == want).all(), f"{name} step {step} rank {r}: {pname} differs between its holders"
