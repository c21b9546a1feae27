"""``parallel.tensor: 2`` against the single-process trainer: losses and full gradients, both model families.

One spawned 4-rank gloo job runs every layout of :data:`LAYOUTS` (tp2 at pp1 = tp2 x dp2; pp2 x tp2 under 1F1B and
interleaved 1F1B; the llama family with grouped-query attention under pp2 x tp2; both families with
``parallel.sequence_parallel`` under pp2 x tp2, whose P2P messages are also counted, and gpt2 with it at tp2 x dp2;
split backward: gpt2 under ZB-V, llama under ZB-H1, each with and without sequence parallelism, their B and W
passes' collectives counted, :data:`SPLIT`; gpt2 under DualPipeV with sequence parallelism at tp2 x dp2, whose V
placement puts both ends of the tied embedding on one rank) for :data:`STEPS` steps
with grad clipping on (so the tensor-parallel grad norm is exercised); before every optimizer step each rank gathers
every gradient to its full tensor (``DTensor.full_tensor``) under the canonical (layout-free) names.  The reference
is the pp1 x tp1 trainer in this process on the same global batch.

Tolerance :data:`TOL` (max |diff| / max |ref|), not bitwise: the row-parallel layers sum the partial products of
the two tensor-parallel ranks in an all-reduce, a different summation order than the single ``[h, h]`` matmul,
and the vocabulary-parallel embedding's output is such a sum too; in fp32 that moves the last bits.

:func:`test_bad_tensor_parallel_configs_are_refused` checks the refusals (pure, before any process group): each
names ``parallel.tensor`` and the field it conflicts with.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from engine.training.config import load_config
from tests.helpers.distributed import tensor_gathers, run_ranks

STEPS = 2
TOL = 5e-5  # fp32, other reduction order; measured worst case 8.4e-6 (llama), printed by the test
GPT = dict(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=256)
LLAMA = dict(GPT, family="llama", num_query_groups=2)

LAYOUTS = {  # name -> (model, parallel overrides); every layout runs on 4 ranks
    "tp2_pp1": (GPT, dict(pipeline=1, tensor=2)),
    "pp2_tp2_1f1b": (GPT, dict(pipeline=2, tensor=2)),
    "pp2_tp2_interleaved": (GPT, dict(pipeline=2, virtual=2, tensor=2)),
    "llama_pp2_tp2_1f1b": (LLAMA, dict(pipeline=2, tensor=2)),
    "pp2_tp2_zbv": (GPT, dict(pipeline=2, virtual=2, tensor=2, schedule="zbv")),
    "llama_pp2_tp2_zb_h1": (LLAMA, dict(pipeline=2, tensor=2, schedule="zb_h1")),
    "tp2_pp1_sp": (GPT, dict(pipeline=1, tensor=2, sequence_parallel=True)),  # dp 2: overlapped grad reduce
    "pp2_tp2_sp_1f1b": (GPT, dict(pipeline=2, tensor=2, sequence_parallel=True)),
    "llama_pp2_tp2_sp_1f1b": (LLAMA, dict(pipeline=2, tensor=2, sequence_parallel=True)),
    "pp2_tp2_sp_zbv": (GPT, dict(pipeline=2, virtual=2, tensor=2, sequence_parallel=True, schedule="zbv")),
    "llama_pp2_tp2_sp_zb_h1": (LLAMA, dict(pipeline=2, tensor=2, sequence_parallel=True, schedule="zb_h1")),
    "tp2_pp1_sp_dualpipev": (GPT, dict(pipeline=1, virtual=2, tensor=2, sequence_parallel=True,  # dp 2, V placement
                                       schedule="dualpipev")),  # on one rank: a tied weight shared by two chunks
}
SPLIT = ("pp2_tp2_zbv", "llama_pp2_tp2_zb_h1", "pp2_tp2_sp_zbv", "llama_pp2_tp2_sp_zb_h1")  # dp 1: at dp 2 a
# chunk's last W also launches the overlapped data-parallel reduction (a collective by design)  # split backward: the B and W passes' collectives are counted
GLOBAL_MICROBATCHES = 4


def overrides(model: dict, parallel: dict, run_dir, world: int = 4) -> dict:
    data = world // (parallel.get("pipeline", 1) * parallel.get("tensor", 1))
    return {**{f"model.{k}": v for k, v in model.items()}, "data.max_bytes": 50_000,
            "training.micro_batch_size": 2, "training.num_microbatches": GLOBAL_MICROBATCHES // data,
            "training.steps": STEPS, "training.eval_interval": 0, "optimizer.grad_clip": 0.05,
            "optimizer.lr": 1e-2, "optimizer.warmup_steps": 0, "logging.progress_bar": False,
            "logging.level": "WARNING", "logging.run_dir": str(run_dir),
            **{f"parallel.{k}": v for k, v in parallel.items()}}


def _full(t):
    """The full gradient; a DTensor still ``Partial`` (a reduction the trainer missed, e.g. of a sequence-parallel
    norm) is returned as this rank's unreduced local part, so the comparison catches it."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        t = t.to_local() if any(p.is_partial() for p in t.placements) else t.full_tensor()
    return t.detach().cpu().numpy().copy()


def train(model: dict, parallel: dict, run_dir, world: int = 4) -> dict:
    """Losses, grad norms and full gradients (per step, canonical names) of one layout on this rank, and the
    activation messages it sent (``act_bytes``; ``shapes``: of every activation / gradient message posted)."""
    from engine import Trainer
    from engine.runtime.p2p import TAG_ACT, TAG_GRAD, activation_bytes, record_messages
    config = load_config(None, overrides(model, parallel, run_dir, world))
    grads: list = []
    with Trainer(config) as trainer:
        def hook(optimizer, args, kwargs):  # collective over tp (full_tensor), same order on every rank
            grads.append({n: _full(p.grad) for n, p in trainer.canonical.named_parameters()})
        trainer.optimizer.register_step_pre_hook(hook)
        with record_messages() as records:
            metrics = [trainer.train_step() for _ in range(STEPS)]
    return {"loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics], "grads": grads,
            "act_bytes": activation_bytes(records),
            "shapes": sorted({r.shape for r in records if r.tag in (TAG_ACT, TAG_GRAD)})}


def resume_and_step(model: dict, parallel: dict, run_dir, checkpoint, world: int = 4,
                    save_to=None) -> dict:
    """Load ``checkpoint`` (written at another layout) into ``parallel``'s layout and train two steps (the second
    one's loss depends on the restored AdamW state); with ``save_to`` first train :data:`STEPS` steps from scratch
    and save there."""
    from torch.distributed.tensor.debug import CommDebugMode

    from engine import Trainer
    config = load_config(None, {**overrides(model, parallel, run_dir, world), "training.steps": STEPS + 2})
    out = {}
    with Trainer(config) as trainer:
        if save_to is None:
            trainer.load(checkpoint)
        else:
            for _ in range(STEPS):
                trainer.train_step()
            with CommDebugMode() as comm:  # a DTensor gathered whole for the save would count here
                trainer.save(save_to)
            out["save_gathers"] = tensor_gathers(comm)
        return {**out, "loss": [trainer.train_step()["loss"] for _ in range(2)]}


@contextlib.contextmanager
def counting_collectives(counts: dict):
    """Count the collectives each split-backward pass issues (``torch.distributed.tensor.debug.CommDebugMode``
    around every B -- ``backward_input_step`` -- and every W -- ``WeightGradWork.run``) into ``counts["B"]`` /
    ``counts["W"]``."""
    from torch.distributed.tensor.debug import CommDebugMode
    from engine.runtime import split_backward as sb

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            with CommDebugMode() as mode:
                result = fn(*args, **kwargs)
            counts[key] = counts.get(key, 0) + mode.get_total_counts()
            return result
        return wrapper
    b, w = sb.backward_input_step, sb.WeightGradWork.run
    sb.backward_input_step, sb.WeightGradWork.run = counted(b, "B"), counted(w, "W")
    try:
        yield counts
    finally:
        sb.backward_input_step, sb.WeightGradWork.run = b, w


def _job(rank, world, layouts: dict, run_dir) -> dict:
    out = {}
    for name, (m, p) in layouts.items():
        counts: dict = {}
        with counting_collectives(counts) if name in SPLIT else contextlib.nullcontext():
            out[name] = train(m, p, f"{run_dir}/{name}")
        out[name]["collectives"] = counts
    tp = dict(pipeline=2, tensor=2)
    out["from_pp1"] = resume_and_step(GPT, tp, f"{run_dir}/from_pp1", f"{run_dir}/ckpt_pp1/step_{STEPS:08d}")
    out["to_pp1"] = resume_and_step(GPT, tp, f"{run_dir}/to_pp1", None, save_to=f"{run_dir}/ckpt_tp")
    out["tp_to_tp"] = resume_and_step(GPT, tp, f"{run_dir}/tp_to_tp", f"{run_dir}/ckpt_tp/step_{STEPS:08d}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("tp")
    # the pp1 x tp1 reference, with one more step after a checkpoint at step STEPS (resumed at pp2 x tp2)
    ref_step = resume_and_step(GPT, dict(pipeline=1), run_dir / "ref_ckpt", None, world=1,
                               save_to=run_dir / "ckpt_pp1")
    per_rank = run_ranks(_job, 4, LAYOUTS, run_dir, timeout=150)
    to_pp1 = resume_and_step(GPT, dict(pipeline=1), run_dir / "to_pp1", run_dir / "ckpt_tp" / f"step_{STEPS:08d}",
                             world=1)
    ref = {"gpt2": train(GPT, dict(pipeline=1), run_dir / "ref_gpt2", world=1),
           "llama": train(LLAMA, dict(pipeline=1), run_dir / "ref_llama", world=1)}
    from engine.training.generate import load_model, model_state_dict
    exports = {name: model_state_dict(load_model(run_dir / name / f"step_{STEPS:08d}").model)
               for name in ("ckpt_pp1", "ckpt_tp")}  # what pipecast export writes, read in one process
    return {"ranks": per_rank, "ref": ref, "ref_step": ref_step, "to_pp1": to_pp1, "exports": exports}


@pytest.mark.timeout(170)
def test_checkpoints_resume_across_tensor_layouts(runs):
    """pp1 -> pp2 x tp2 and pp2 x tp2 -> pp1: the two steps after the resume have the losses of the
    uninterrupted run (model and optimizer state restored)."""
    want = runs["ref_step"]["loss"]
    for rank, result in enumerate(runs["ranks"]):
        assert result["from_pp1"]["loss"] == pytest.approx(want, rel=TOL), f"pp1 -> pp2 x tp2, rank {rank}"
        assert result["to_pp1"]["loss"] == pytest.approx(want, rel=TOL), f"pp2 x tp2 uninterrupted, rank {rank}"
    assert runs["to_pp1"]["loss"] == pytest.approx(want, rel=TOL), "pp2 x tp2 -> pp1"


@pytest.mark.timeout(170)
def test_tensor_parallel_checkpoints_stay_sharded(runs):
    """The pp2 x tp2 save gathers no DTensor (each rank writes its shards, the fused qkv's row blocks included);
    resumed at pp2 x tp2 the next losses are bitwise the uninterrupted run's; its export equals pp1's."""
    for rank, result in enumerate(runs["ranks"]):
        assert result["to_pp1"]["save_gathers"] == 0, rank
        assert result["tp_to_tp"]["loss"] == result["to_pp1"]["loss"], rank
    pp1, tp = runs["exports"]["ckpt_pp1"], runs["exports"]["ckpt_tp"]
    assert set(pp1) == set(tp)
    for name, want in pp1.items():
        assert _rel(tp[name], want) <= TOL, name


def _rel(got, want) -> float:
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.timeout(170)
def test_tensor_parallel_matches_single_process(runs):
    worst = {}
    for name, (model, _) in LAYOUTS.items():
        ref = runs["ref"][model.get("family", "gpt2")]
        err = 0.0
        for rank, result in enumerate(runs["ranks"]):
            r = result[name]
            where = f"{name} rank {rank}"
            assert r["loss"] == pytest.approx(ref["loss"], rel=TOL), where
            assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL), where
            for step, (got, want) in enumerate(zip(r["grads"], ref["grads"])):
                # the rank holds a subset of the model (its stages); every name it holds must match
                assert got and set(got) <= set(want), where
                for n, g in got.items():
                    assert g.shape == want[n].shape, f"{where} step {step} {n}"
                    e = _rel(g, want[n])
                    assert e <= TOL, f"{where} step {step} {n}: rel. error {e:.2e} > {TOL}"
                    err = max(err, e)
        worst[name] = err
    print("worst relative gradient error per layout:", {k: f"{v:.1e}" for k, v in worst.items()})


@pytest.mark.timeout(170)
def test_split_backward_w_passes_issue_no_collective(runs):
    """ZB-V / ZB-H1 at pp2 x tp2: every tensor-parallel collective of the backward runs in B (the input-gradient
    all-reduces; counted, so the counter sees them), none in W (the weight gradients are local matmuls on the
    shards): a W pass can then never wait on a peer, whatever the schedule interleaves."""
    for name in SPLIT:
        for rank, result in enumerate(runs["ranks"]):
            counts = result[name]["collectives"]
            assert counts.get("B", 0) > 0, f"{name} rank {rank}: {counts}"
            assert counts.get("W", 0) == 0, f"{name} rank {rank}: W issued collectives {counts}"


@pytest.mark.timeout(170)
def test_zb_h1_gives_the_1f1b_gradients_bitwise(runs):
    """llama at pp2 x tp2: ZB-H1 (split backward) and 1F1B give bitwise the same losses and gradients -- each W
    runs the same kernels on the same local operands as the unsplit backward, per chunk in microbatch order
    (engine.runtime.split_backward's exactness), and the B-side collectives see the same tensors."""
    for rank, result in enumerate(runs["ranks"]):
        for name in ("llama_pp2_tp2_zb_h1", "llama_pp2_tp2_sp_zb_h1"):
            split, plain = result[name], result[name.replace("zb_h1", "1f1b")]
            assert split["loss"] == plain["loss"], f"{name} rank {rank}"
            for step, (got, want) in enumerate(zip(split["grads"], plain["grads"])):
                assert set(got) == set(want), f"{name} rank {rank} step {step}"
                for n in got:
                    assert (got[n] == want[n]).all(), f"{name} rank {rank} step {step} {n}"


@pytest.mark.timeout(170)
def test_sequence_parallel_sends_one_over_t_of_the_bytes(runs):
    """pp2 x tp2: with sequence_parallel the stage boundary carries [s/2, b, h] (half the activation bytes of
    the replicated [s, b, h] that tp2 without it, and tp1, send); first-stage ranks send, the others do not."""
    s, b, h = GPT["seq_length"], 2, GPT["hidden_size"]
    full = STEPS * GLOBAL_MICROBATCHES * s * b * h * 4  # fp32 bytes of the activations stage 0 sends (dp = 1)
    for rank, result in enumerate(runs["ranks"]):
        first = rank < 2  # Megatron's rank order: tensor-parallel ranks of a stage are consecutive
        for name in ("pp2_tp2_1f1b", "llama_pp2_tp2_1f1b"):
            plain, sp = result[name], result[name.replace("tp2_", "tp2_sp_")]
            assert plain["shapes"] == [(s, b, h)] and sp["shapes"] == [(s // 2, b, h)], (name, rank)
            assert plain["act_bytes"] == (full if first else 0), (name, rank, plain["act_bytes"])
            assert 2 * sp["act_bytes"] == plain["act_bytes"], (name, rank, sp["act_bytes"])
    print(f"activation bytes sent per first-stage rank over {STEPS} steps: tp2 {full}, tp2 + sequence_parallel "
          f"{full // 2}")


BAD = [  # (overrides, words the message must contain)
    ({"model.num_attention_heads": 2, "model.hidden_size": 18, "parallel.tensor": 4}, ["parallel.tensor=4",
                                                                                       "model.num_attention_heads=2"]),
    ({"model.ffn_hidden_size": 30, "parallel.tensor": 4}, ["parallel.tensor=4", "model.ffn_hidden_size=30"]),
    ({"model.vocab_size": 257, "parallel.tensor": 2}, ["model.vocab_size=257", "258"]),
    ({"model.family": "llama", "model.num_query_groups": 1, "parallel.tensor": 2},
     ["model.num_query_groups=1"]),
    ({"parallel.tensor": 0}, ["parallel.tensor=0"]),
    ({"parallel.sequence_parallel": True}, ["parallel.sequence_parallel=true", "parallel.tensor=1"]),
    ({"parallel.sequence_parallel": True, "parallel.tensor": 4, "model.seq_length": 6},
     ["parallel.sequence_parallel=true", "model.seq_length=6"]),
]


@pytest.mark.parametrize("bad, words", BAD)
def test_bad_tensor_parallel_configs_are_refused(bad, words, tmp_path):
    from engine.training.config import ConfigError, validate
    base = overrides(GPT, dict(pipeline=1), tmp_path, world=1)
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, {**base, **bad}))
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_world_size_counts_tensor_ranks(tmp_path):
    from engine.training.config import ConfigError, validate_world_size
    config = load_config(None, overrides(GPT, dict(pipeline=2, tensor=2), tmp_path))
    assert validate_world_size(config, 8).parallel.data == 2
    assert validate_world_size(config, 8).world_size == 8
    with pytest.raises(ConfigError, match="parallel.pipeline x parallel.tensor"):
        validate_world_size(config, 6)
