"""Whole training runs on gloo ranks: the same losses for every pipeline / data-parallel layout, tied embedding
copies bitwise equal after every step, bitwise-exact checkpoint resume, clear errors for corrupt checkpoints."""
from __future__ import annotations

import hashlib

import pytest
import torch

from engine.training.config import load_config
from tests.helpers.distributed import run_ranks

STEPS = 20


def tiny(**parallel) -> dict:
    """A tiny GPT on 200 kB of the standard library: fast enough for 20 steps on 4 CPU ranks."""
    return {"model.num_layers": 4, "model.hidden_size": 32, "model.num_attention_heads": 2,
            "model.seq_length": 16, "data.max_bytes": 200_000, "training.micro_batch_size": 2,
            "training.num_microbatches": 4 // parallel.get("data", 1), "training.steps": STEPS,
            "training.eval_interval": 0, "optimizer.lr": 1e-2, "optimizer.min_lr": 1e-3,
            "optimizer.warmup_steps": 3, "logging.progress_bar": False, "logging.level": "WARNING",
            **{f"parallel.{k}": v for k, v in parallel.items()}}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _tied_weights(trainer) -> list[str]:
    out = []
    for chunk in trainer.model:
        if chunk.embedding is not None:
            out.append(("first", _digest(chunk.embedding.word.weight)))
        if chunk.head is not None:
            out.append(("last", _digest(chunk.head.word.weight)))
    return out


def _train(rank, world, overrides, run_dir, steps=STEPS):
    from engine import Trainer
    config = load_config(None, {**overrides, "logging.run_dir": str(run_dir)})
    losses, tied = [], []
    with Trainer(config) as trainer:
        reads_data = trainer.batches is not None
        for _ in range(steps):
            losses.append(trainer.train_step()["loss"])
            tied.append(_tied_weights(trainer))
    return losses, tied, reads_data


def _train_layouts(rank, world, layouts, run_dir):
    """Several layouts of the same world size, one after the other in one job (saves process start-up)."""
    return {name: _train(rank, world, tiny(**layout), f"{run_dir}/{name}") for name, layout in layouts.items()}


# layouts grouped by world size: one spawned job per world size
LAYOUTS = {2: {"pp2": dict(pipeline=2), "pp2_vp2": dict(pipeline=2, virtual=2),
               "pp2_zbh1": dict(pipeline=2, schedule="zb_h1"), "pp2_zbv": dict(pipeline=2, virtual=2, schedule="zbv"),
               "pp2_zb_budget": dict(pipeline=2, virtual=2, schedule="zb", max_in_flight=3)},
           4: {"pp4": dict(pipeline=4), "pp2_dp2": dict(pipeline=2, data=2),
               "pp4_zbh1": dict(pipeline=4, schedule="zb_h1")}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """pp=1 in this process (one-rank gloo group)."""
    return _train(0, 1, tiny(), tmp_path_factory.mktemp("pp1"))[0]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_losses_equal_across_layouts(world, reference, tmp_path):
    """20 steps with pp=2, pp=2 x vp=2, ZB-H1, ZB-V and the budgeted zb plan (world 2) and pp=4, pp=2 x dp=2, ZB-H1 (world 4) give the
    pp=1 losses (ZB-V: first and last stage on rank 0, tied copies summed there)."""
    assert reference[-1] < reference[0] - 0.5  # it learns
    results = run_ranks(_train_layouts, world, LAYOUTS[world], tmp_path, timeout=140)
    for name in LAYOUTS[world]:
        per_rank = [r[name] for r in results]
        for losses, _, _ in per_rank:  # every rank reports the same (broadcast) loss
            assert losses == per_rank[0][0]
        diff = max(abs(a - b) for a, b in zip(reference, per_rank[0][0]))
        assert diff <= 1e-4, f"{name}: max |loss - pp1 loss| = {diff:.3g}"
        # the first and last stage copies of the tied embedding are bitwise equal after every step
        for step in range(STEPS):
            entries = [kv for _, tied, _ in per_rank for kv in tied[step]]
            assert {role for role, _ in entries} == {"first", "last"}
            assert len({digest for _, digest in entries}) == 1, f"{name}: tied copies differ after step {step + 1}"
    if world == 4:  # only the first and last pipeline stage read data
        assert [r["pp4"][2] for r in results] == [True, False, False, True]


def _resume(rank, world, overrides, run_dir):
    from engine import Trainer
    from engine.training.checkpoint.dcp import CheckpointError
    # dropout on: the resumed run must also restore each rank's RNG state to match bitwise
    base = {**overrides, "logging.run_dir": str(run_dir), "training.steps": 6, "model.dropout": 0.1}
    config = load_config(None, base)
    with Trainer(config) as straight:
        straight_steps = [straight.train_step() for _ in range(6)]
        straight_losses = [m["loss"] for m in straight_steps]
        straight_lrs = [m["lr"] for m in straight_steps]
        straight_weights = {k: _digest(v) for k, v in straight.canonical.state_dict().items()}
    with Trainer(config) as first:
        first.train(steps=2)
        older = first.save()
        first.train(steps=1)
        path = first.save()
    with Trainer(load_config(None, {**base, "checkpoint.load_step": 2})) as named:
        assert named.load() == older and named.step == 2  # checkpoint.load_step picks it over the newer one
        from_named = named.train_step()["loss"]
    with Trainer(config) as second:
        assert second.load() == path and second.step == 3
        lr = {"after_load": [g["lr"] for g in second.optimizer.param_groups],
              "scheduler": second.lr_scheduler.get_last_lr(), "straight": straight_lrs}
        resumed_steps = [second.train_step() for _ in range(3)]
        resumed_losses = [m["loss"] for m in resumed_steps]
        lr["resumed"] = [m["lr"] for m in resumed_steps]
        resumed_weights = {k: _digest(v) for k, v in second.canonical.state_dict().items()}
        second.save(run_dir / "reshard")  # for the layout-change test in the parent (pp=1)
        val_loss = second.evaluate()
    # a truncated checkpoint is a clear error on every rank, not a hang
    torch.distributed.barrier()
    if rank == 0:
        for f in sorted(path.glob("*.distcp")):
            f.write_bytes(f.read_bytes()[:100])
    torch.distributed.barrier()
    with Trainer(config) as third:
        try:
            third.load(path)
            error = None
        except CheckpointError as exc:
            error = str(exc)
        assert third.load() == older and third.step == 2  # --resume: the newest intact one, on every rank
        fallback = third.train_step()["loss"]
    resumed_losses = {"named": from_named, "fallback": fallback, "tail": resumed_losses}
    return straight_losses, resumed_losses, straight_weights == resumed_weights, lr, error, val_loss


@pytest.mark.timeout(120)
def test_checkpoint_resume_is_bitwise(tmp_path):
    results = run_ranks(_resume, 2, tiny(pipeline=2, virtual=2), tmp_path, timeout=100)
    for straight, resumed, same_weights, lr, error, _ in results:
        assert resumed["tail"] == straight[3:], "resumed losses differ from the straight run"
        assert same_weights, "resumed weights differ from the straight run"
        # the LR schedule resumes at step 3: every param group, the scheduler and each resumed step
        assert lr["after_load"] == [lr["straight"][3]] * 2 == lr["scheduler"], lr
        assert lr["resumed"] == lr["straight"][3:], lr
        # a truncated checkpoint: refused in one line naming the file; --resume falls back to step 2, as does
        # checkpoint.load_step=2 beside the intact step 3: both continue the straight run bitwise
        assert error is not None and "\n" not in error and "is broken: " in error and "is truncated (100 of" in error
        assert resumed["named"] == resumed["fallback"] == straight[2], resumed
    assert (tmp_path / "config.yaml").is_file()
    # checkpoint names do not depend on the layout: the pp=2 x vp=2 checkpoint loads into pp=1 (this process)
    from engine import Trainer
    config = load_config(None, {**tiny(), "logging.run_dir": str(tmp_path / "pp1"), "model.dropout": 0.1})
    with Trainer(config) as trainer:
        trainer.load(tmp_path / "reshard" / "step_00000006")
        assert trainer.step == 6
        assert abs(trainer.evaluate() - results[0][5]) < 1e-5


def _resume_across_schedules(rank, world, run_dir):
    """3 steps with one schedule, saved; 3 more after loading into the other; and the straight 6-step runs."""
    from engine import Trainer
    layouts = {"1f1b": tiny(pipeline=2), "zbv": tiny(pipeline=2, virtual=2, schedule="zbv")}
    out = {}
    for first, second in (("zbv", "1f1b"), ("1f1b", "zbv")):
        base = {"training.steps": 6, "logging.run_dir": f"{run_dir}/{first}_{second}"}
        with Trainer(load_config(None, {**layouts[first], **base})) as a:
            head = [a.train_step()["loss"] for _ in range(3)]
            path = a.save()
        with Trainer(load_config(None, {**layouts[second], **base, "logging.run_dir": f"{run_dir}/{second}_b"})) as b:
            b.load(path)
            tail = [b.train_step()["loss"] for _ in range(3)]
        with Trainer(load_config(None, {**layouts[first], **base, "logging.run_dir": f"{run_dir}/{first}_s"})) as s:
            straight = [s.train_step()["loss"] for _ in range(6)]
        out[(first, second)] = (head + tail, straight)
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_zbv_checkpoint_resumes_as_1f1b_and_back(tmp_path):
    """Parameter names do not depend on the placement: a ZB-V run (first and last stage on rank 0) resumes with
    1F1B and a 1F1B run with ZB-V, continuing the straight run's losses."""
    results = run_ranks(_resume_across_schedules, 2, tmp_path, timeout=170)
    for (first, second), (resumed, straight) in results[0].items():
        diff = max(abs(a - b) for a, b in zip(resumed, straight))
        assert diff <= 1e-4, f"{first} -> {second}: resumed losses differ from the straight run by {diff:.3g}"


def _zbv_with_samples(rank, world, run_dir):
    from engine import Trainer
    config = load_config(None, {**tiny(pipeline=2, virtual=2, schedule="zbv"), "training.steps": 2,
                                "training.eval_interval": 1, "logging.sample_every_eval": 3,
                                "logging.run_dir": str(run_dir)})
    with Trainer(config) as trainer:
        history = trainer.train()
    return [h["loss"] for h in history], trainer.val_history


@pytest.mark.timeout(120)
def test_zbv_training_evaluates_and_samples_with_other_microbatch_counts(tmp_path):
    """Evaluation and in-training sampling run the split schedule with other microbatch counts than the training
    plan's (sampling: one microbatch per pipeline rank), so the schedule builds the matching twin of the plan."""
    results = run_ranks(_zbv_with_samples, 2, tmp_path, timeout=110)
    losses, val = results[0]
    assert len(losses) == 2 and len(val) >= 2 and results[0] == results[1]
