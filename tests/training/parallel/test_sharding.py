"""``parallel.shard: optimizer`` (ZeRO-1, engine.training.parallel.zero1) and ``parallel.shard: full`` (FSDP2,
engine.training.parallel.fsdp) against a single-process pp1 run.

One spawned 4-rank job (pp2 x dp2, shared by the tests through a module fixture) runs, for each of
``optimizer`` and ``full``, 1F1B (saving at step 2), ZB-H1 (split backward: W passes deferred) and a run resumed
from a pp1 checkpoint -- 3 steps each with grad clipping and weight decay on -- plus ``full`` under interleaved
1F1B (virtual 2) and, for each, the 1F1B run's step-2 checkpoint resumed at pp2 x dp2 (bitwise the straight run's
last loss; the save gathered no tensor: ``CommDebugMode``).  (``shard: none`` at pp2 x dp2 is checked against autograd in test_trainer_reference.)  A
single-process pp1 run (same global batch, ``shard: none``) gives the reference losses, gradient norms and
parameters, and resumes from each sharded checkpoint.

Tolerance: the sharded runs reduce-scatter where ``none`` all-reduces and sum the tied embedding after the
data-parallel average (ZeRO-1: before it; Megatron averages first), and the pp1 run accumulates the whole global
batch in one process: the results differ by float rounding only (fp32: relative 1e-5 on parameters, 1e-5
absolute on losses and gradient norms; measured about 3e-6 relative on parameters).
"""
from __future__ import annotations

import pytest
import torch

from engine.training.config import ConfigError, load_config, validate
from tests.helpers.distributed import tensor_gathers, run_ranks

MODEL = dict(num_layers=4, hidden_size=16, num_attention_heads=2, seq_length=8)
STEPS, CUT, GLOBAL_MICROBATCHES = 3, 2, 4
TOL = 1e-5


def overrides(run_dir: str, pipeline: int, data: int, **parallel) -> list[str]:
    values = {**{f"model.{k}": v for k, v in MODEL.items()}, "data.max_bytes": 40_000,
              "parallel.pipeline": pipeline, "parallel.data": data, "training.micro_batch_size": 2,
              "training.num_microbatches": GLOBAL_MICROBATCHES // data, "training.steps": STEPS,
              "training.eval_interval": 0, "optimizer.lr": 1e-2, "optimizer.warmup_steps": 0,
              "optimizer.grad_clip": 0.05, "optimizer.weight_decay": 0.1, "checkpoint.interval": 0,
              "checkpoint.save_at_end": False, "logging.progress_bar": False, "logging.level": "WARNING",
              "logging.run_dir": run_dir, **{f"parallel.{k}": v for k, v in parallel.items()}}
    return [f"{k}={v}" for k, v in values.items()]


def _run(config, steps: int, load=None, save_at=None, evaluate=False) -> dict:
    """Train to ``steps`` (optionally resuming from ``load``, saving at ``save_at``, evaluating once mid-run)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from engine import Trainer
    from engine.training.parallel.fsdp import full_parameters
    with Trainer(config) as trainer:
        if load is not None:
            trainer.load(load)
        out = {"losses": [], "norms": []}
        while trainer.step < steps:
            m = trainer.train_step()
            out["losses"].append(m["loss"])
            out["norms"].append(m["grad_norm"])
            if save_at == trainer.step:
                with CommDebugMode() as comm:  # a DTensor gathered whole for the save would count here
                    out["saved"] = str(trainer.save())
                out["save_gathers"] = tensor_gathers(comm)
            if evaluate and trainer.step == 1:  # forward-only: shard full must reshard after it
                out["val_loss"] = trainer.evaluate()
                out["sharded_after_eval"] = [isinstance(p, DTensor) for p in trainer.canonical.parameters()]
        out["params"] = {n: p.numpy().copy() for n, p in full_parameters(trainer.canonical).items()}
        out["state_bytes"] = trainer.optimizer.state_bytes() if trainer.parallelism.shard == "optimizer" else _local_bytes(
            t for s in trainer.optimizer.state.values() for t in s.values())
        out["param_bytes"] = _local_bytes({id(p): p for c in trainer.model for p in c.parameters()}.values())
        out["full_param_bytes"] = sum(v.nbytes for v in out["params"].values())
    return out


def _local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor counts its local shard only)."""
    from engine.training.parallel.dtensor import local
    return sum(local(t).numel() * local(t).element_size() for t in tensors if torch.is_tensor(t))


def _job(rank: int, world: int, run_dir: str, pp1_checkpoint: str) -> dict:
    def config(shard, case, precision="fp32", **parallel):
        return load_config(None, overrides(f"{run_dir}/{shard}_{case}", 2, 2, shard=shard, **parallel)
                           + [f"model.precision={precision}"])
    out = {shard: {"1f1b": _run(config(shard, "1f1b"), STEPS, save_at=CUT, evaluate=True),
                   "zb_h1": _run(config(shard, "zb_h1", schedule="zb_h1"), STEPS),
                   "from_pp1": _run(config(shard, "from_pp1"), STEPS, load=pp1_checkpoint)}
           for shard in ("optimizer", "full")}
    out["full"]["interleaved"] = _run(config("full", "interleaved", schedule="interleaved", virtual=2), STEPS)
    for shard in ("optimizer", "full"):  # the sharded checkpoint resumed at its own layout
        out[shard]["resumed"] = _run(config(shard, "resumed"), STEPS, load=out[shard]["1f1b"]["saved"])
    for schedule in ("1f1b", "zb_h1"):
        out["full"][f"bf16_{schedule}"] = _run(config("full", f"bf16_{schedule}", "bf16", schedule=schedule), 2)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The pp1 reference and the 4-rank job's per-rank results (one spawn for the module; its hang guard, 300 s,
    stays below the tests' 400 s timeout, which also covers this setup)."""
    tmp = tmp_path_factory.mktemp("sharding")
    pp1 = _run(load_config(None, overrides(str(tmp / "pp1"), 1, 1)), STEPS, save_at=CUT, evaluate=True)
    return tmp, pp1, run_ranks(_job, 4, str(tmp), pp1["saved"], timeout=300)


def _close(a: dict, b: dict) -> float:
    worst = 0.0
    for name, ref in b.items():
        diff = abs(torch.from_numpy(a[name]) - torch.from_numpy(ref)).max().item()
        worst = max(worst, diff / max(abs(torch.from_numpy(ref)).max().item(), 1e-12))
    return worst


def _check_against_pp1(results: list, pp1: dict, shard: str, cases) -> None:
    """Every case of ``shard``: final parameters (gathered from data-parallel rank 0 of each pipeline rank), the
    per-step losses and gradient norms (pipeline rank 1 holds the loss) against the pp1 run."""
    for case in cases:
        params = {**results[0][shard][case]["params"], **results[2][shard][case]["params"]}
        assert set(params) == set(pp1["params"]), case
        print(f"{shard} {case}: parameters max |diff| / max |ref| vs pp1 = {_close(params, pp1['params']):.2e}")
        assert _close(params, pp1["params"]) < TOL, (shard, case)
        loss_rank = results[2][shard][case]
        for key in ("losses", "norms"):
            worst = max(abs(x - y) for x, y in zip(loss_rank[key], pp1[key][-len(loss_rank[key]):]))
            print(f"{shard} {case}: {key} max |diff| = {worst:.2e}")
            assert worst < TOL, (shard, case, key)
    assert abs(results[2][shard]["1f1b"]["val_loss"] - pp1["val_loss"]) < TOL  # evaluation mid-run
    for a, b in ((0, 1), (2, 3)):  # data-parallel replicas hold the same full weights after the step
        for name, value in results[a][shard]["1f1b"]["params"].items():
            assert (value == results[b][shard]["1f1b"]["params"][name]).all(), name


def _check_resumes(tmp, results: list, pp1: dict, shard: str) -> None:
    """The save of ``shard`` gathered no tensor (each rank wrote its own pieces / shards); resumed at pp2 x dp2
    its next losses are bitwise the straight run's; then :func:`_check_resume_at_pp1`."""
    assert [r[shard]["1f1b"]["save_gathers"] for r in results] == [0] * 4
    straight, resumed = results[2][shard]["1f1b"]["losses"], results[2][shard]["resumed"]["losses"]
    assert resumed == straight[CUT:], (shard, resumed, straight)
    _check_resume_at_pp1(tmp, results, pp1, shard)


def _check_resume_at_pp1(tmp, results: list, pp1: dict, shard: str) -> None:
    """The pp2 x dp2 checkpoint of ``shard`` resumes in one process (pp1, shard none) with the straight run's last
    loss and final parameters."""
    resumed = _run(load_config(None, overrides(str(tmp / f"resumed_{shard}"), 1, 1)), STEPS,
                   load=results[0][shard]["1f1b"]["saved"])
    assert abs(resumed["losses"][0] - pp1["losses"][-1]) < TOL
    assert _close(resumed["params"], pp1["params"]) < TOL


@pytest.mark.timeout(400)  # the first test to run also spawns the module's 4-rank job
def test_zero1_matches_pp1_and_resumes_across_layouts(runs):
    tmp, pp1, results = runs
    _check_against_pp1(results, pp1, "optimizer", ("1f1b", "zb_h1", "from_pp1"))
    # optimizer state: each data-parallel rank holds the two AdamW moments of its half (plus a step per piece)
    for rank in range(4):
        n_params = sum(v.size for v in results[rank]["optimizer"]["1f1b"]["params"].values())
        assert 2 * 4 * n_params / 2 <= results[rank]["optimizer"]["1f1b"]["state_bytes"] < 0.55 * 2 * 4 * n_params
    _check_resumes(tmp, results, pp1, "optimizer")


@pytest.mark.timeout(400)  # the first test to run also spawns the module's 4-rank job
def test_fsdp_matches_pp1_split_backward_included_and_resumes_across_layouts(runs):
    """``shard: full``: 1F1B, ZB-H1 (W passes after FSDP's own post-backward point: the reduce-scatter must wait
    for them), interleaved and a resume from pp1 give pp1's losses, norms and weights; each rank holds half of its
    parameters and of their AdamW moments; the save gathers no DTensor; the checkpoint resumes at pp1, shard none."""
    tmp, pp1, results = runs
    _check_against_pp1(results, pp1, "full", ("1f1b", "zb_h1", "interleaved", "from_pp1"))
    assert all(all(r["full"]["1f1b"]["sharded_after_eval"]) for r in results)  # resharded after the forward-only run
    for rank in range(4):
        r = results[rank]["full"]["1f1b"]
        full = r["full_param_bytes"]  # this pipeline rank's parameters, unsharded
        assert full / 2 <= r["param_bytes"] < 0.55 * full, rank  # dim-0 rows split in two (torch.chunk)
        assert full <= r["state_bytes"] < 1.1 * full, rank  # two moments of half the parameters, plus steps
    _check_resumes(tmp, results, pp1, "full")
    # `pipecast export` of the step-2 checkpoint writes the unsharded model: pp1's step-2 weights
    from engine.training.export import export_checkpoint, load_exported
    exported = {}
    for name, path in (("full", results[0]["full"]["1f1b"]["saved"]), ("pp1", pp1["saved"])):
        export_checkpoint(path, tmp / f"export_{name}.safetensors")
        exported[name] = {k: v.numpy() for k, v in load_exported(tmp / f"export_{name}.safetensors")[0].items()}
    assert set(exported["full"]) == set(exported["pp1"])
    assert _close(exported["full"], exported["pp1"]) < TOL


@pytest.mark.timeout(400)  # the first test to run also spawns the module's 4-rank job
def test_fsdp_bf16_split_backward_accumulates_each_microbatch_in_fp32(runs):
    """``model.precision: bf16`` under ``shard: full`` (FSDP2's ``MixedPrecisionPolicy``): ZB-H1's W passes run
    after FSDP's post-backward point, yet its weights after two steps equal 1F1B's bit for bit -- each microbatch's
    bf16 weight gradient went into the fp32 accumulator as autograd wrote it (summed in bf16 first, they differ);
    and the run is bf16 (its losses are not the fp32 run's)."""
    _, _, results = runs
    for r in results:
        bf16 = {s: r["full"][f"bf16_{s}"] for s in ("1f1b", "zb_h1")}
        assert bf16["zb_h1"]["losses"] == bf16["1f1b"]["losses"]
        assert _close(bf16["zb_h1"]["params"], bf16["1f1b"]["params"]) == 0.0
        assert bf16["1f1b"]["losses"][:2] != r["full"]["1f1b"]["losses"][:2]


def test_shard_refusals_before_any_process_group():
    base = ["parallel.pipeline=2", "parallel.data=2", "model.num_layers=2"]
    with pytest.raises((ConfigError, ValueError, TypeError), match="parallel.shard"):
        validate(load_config(None, ["parallel.shard=zero3"]))
    for shard in ("optimizer", "full"):
        with pytest.raises(ConfigError, match=f"parallel.shard={shard} with parallel.tensor=2"):
            validate(load_config(None, [f"parallel.shard={shard}", "parallel.tensor=2", "parallel.pipeline=1",
                                        "model.num_layers=2"]))
    with pytest.raises(ConfigError, match="parallel.shard=full with cuda_graphs.enabled=true.*parallel.shard=optimizer"):
        validate(load_config(None, ["parallel.shard=full", "cuda_graphs.enabled=true", *base]))
    for pipeline in (2, 1):  # at pipeline 1 too: rank 0 holds both ends (issue 36: fully_shard refused it late)
        with pytest.raises(ConfigError, match="parallel.shard=full with parallel.schedule=zbv"):
            validate(load_config(None, ["parallel.shard=full", "parallel.schedule=zbv", "parallel.virtual=2",
                                        "model.num_layers=4", f"parallel.pipeline={pipeline}", "parallel.data=2"]))
    validate(load_config(None, ["parallel.shard=full", *base]))  # accepted
    validate(load_config(None, ["parallel.shard=full"]))  # data = 1: runs as none (test_fsdp_at_data_1_runs_as_none)
    validate(load_config(None, ["parallel.shard=full", "parallel.schedule=zbv", "parallel.virtual=2",
                                "model.tie_embeddings=false", "model.num_layers=4", "parallel.pipeline=2"]))


@pytest.mark.timeout(400)  # the first test to run also spawns the module's 4-rank job
def test_fsdp_at_data_1_runs_as_none(runs):
    """``shard: full`` with ``parallel.data=1``: one shard is the whole model, the run is ``shard: none``'s."""
    tmp, pp1, _ = runs
    out = _run(load_config(None, overrides(str(tmp / "full_dp1"), 1, 1, shard="full")), STEPS)
    assert out["losses"] == pp1["losses"] and _close(out["params"], pp1["params"]) == 0.0
