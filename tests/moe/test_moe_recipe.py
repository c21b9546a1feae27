"""The ``llama_moe`` recipe (``model.moe``, ``parallel.expert``) against an independent reference, and its refusals.

The reference -- :func:`reference_objective`, written here from the recorded parameters alone (no trainer, model or
``engine.moe`` code; the attention pieces are tests/training/models/test_llama_reference.py's) -- is a Llama forward
whose MLPs are mixtures of experts: a softmax router, the top-k probabilities renormalised, each chosen expert's
SwiGLU weighted and summed, and the Switch Transformer load-balancing loss ``coeff * E / (k T^2) * sum_e (sum_t
p_te) c_e`` per microbatch and layer.  Its objective is the global mean token cross-entropy plus every
microbatch's load-balancing losses over the number of microbatches (the pipeline's loss scale ``1 / M`` and the
data-parallel mean; Megatron-Core's ``MoEAuxLossAutoScaler`` contract), backpropagated with plain autograd.

Runs: pp1 in this process, and one 4-rank job of ``configs/moe_pp2_ep2.yaml`` (pipeline 2 x data 2, expert 2,
DualPipeV with overlapped cells; sizes shrunk by overrides) that trains :data:`STEPS` steps, saves a checkpoint
after step 2 and resumes it at ``parallel.expert=1`` for step 3.  Checked: every gradient on every rank equals the
reference's (fp32, relative :data:`TOL`), the reported loss the reference cross-entropy; the router statistics in
the metrics count ``T k`` token slots per layer; the resumed run at another E starts from bitwise the saved
parameters and its step-3 gradients and updated parameters equal the E=2 run's.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.training.config import ConfigError, load_config, validate_world_size
from tests.helpers.distributed import run_ranks
from tests.training.models.test_llama_reference import _rms, attention_residual
from tests.training.test_trainer_reference import (
    _array, _record_grads, global_batch, max_rel_error, recorded_leaves, recorded_step)

PRESET = Path(__file__).resolve().parents[2] / "configs" / "moe_pp2_ep2.yaml"
STEPS = 3  # the 4-rank run; the pp1 run does 2
TOL = 1e-5  # fp32, relative to the largest reference gradient of each tensor
THETA = 10000.0
MODEL = dict(num_layers=4, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
             seq_length=8, rope_theta=THETA)
MOE = dict(num_experts=4, top_k=2, ffn_hidden_size=12, aux_loss_coeff=0.01)
MBS, GLOBAL_MICROBATCHES = 2, 8


def overrides(run_dir, **more) -> dict:
    return {**{f"model.{k}": v for k, v in MODEL.items()}, **{f"model.moe.{k}": v for k, v in MOE.items()},
            "data.max_bytes": 50_000, "training.micro_batch_size": MBS, "training.num_microbatches": 4,
            "training.eval_interval": 0, "optimizer.grad_clip": 0.0, "optimizer.lr": 1e-2,
            "optimizer.warmup_steps": 0, "logging.progress_bar": False, "logging.level": "WARNING",
            "logging.run_dir": str(run_dir), "checkpoint.interval": 0, **more}


# ---- rank side ----------------------------------------------------------------------------------------------------

def _steps(trainer, count: int, steps: list | None = None) -> list:
    """Train ``count`` steps recording per step (appended to ``steps``, a new list when None) the parameters and
    grads (before the update), the inputs and the metrics."""
    if steps is None:
        steps = []
        _record_grads(trainer, steps)
    for _ in range(count):
        recorded_step(trainer, steps)
        steps[-1]["router"] = trainer.router_metrics.collect()
    return steps


def _params(trainer) -> dict:
    return {n: _array(p) for n, p in trainer.canonical.named_parameters()}


def train_pp1(run_dir) -> list:
    from engine import Trainer
    config = load_config(PRESET, overrides(run_dir, **{"parallel.pipeline": 1, "parallel.virtual": 1,
                                                      "parallel.schedule": "1f1b", "parallel.data": 1,
                                                      "parallel.expert": 1, "training.steps": 2,
                                                      "parallel.overlap_moe_expert_parallel_comm": False,
                                                      "training.num_microbatches": GLOBAL_MICROBATCHES}))
    with Trainer(config) as trainer:
        return _steps(trainer, 2)


def _job(rank, world, run_dir) -> dict:
    """The preset at E=2 for :data:`STEPS` steps (checkpoint after step 2); then step 3 again from that checkpoint
    at E=1."""
    from engine import Trainer
    out = {}
    with Trainer(load_config(PRESET, overrides(run_dir, **{"training.steps": STEPS}))) as trainer:
        out["ep2"] = _steps(trainer, 2)
        trainer.save()
        _steps(trainer, 1, out["ep2"])
        out["ep2_final"] = _params(trainer)
    resume = overrides(run_dir, **{"training.steps": STEPS, "parallel.expert": 1})
    with Trainer(load_config(PRESET, resume)) as trainer:
        trainer.load()
        out["ep1_step3"] = _steps(trainer, 1)
        out["ep1_final"] = _params(trainer)
        out["ep1_holds"] = sum(".moe.experts." in n for n in out["ep1_final"])
    out["ep2_holds"] = sum(".moe.experts." in n for n in out["ep2_final"])
    return out


# ---- the independent reference ------------------------------------------------------------------------------------

def _experts(y, p, i):
    """``(out [n, h], aux, tokens per expert)`` of layer ``i``'s mixture of experts on the tokens ``y`` ``[n, h]``
    of one microbatch."""
    def w(name):
        return p[f"layers.{i}.moe.{name}"]
    E, k = MOE["num_experts"], MOE["top_k"]
    scores = (y @ w("router.linear.weight").t()).softmax(-1)  # [n, E]
    chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # [n, k]
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(y)
    for e in range(E):
        gate, up = y @ w(f"experts.{e}.gate_proj.weight").t(), y @ w(f"experts.{e}.up_proj.weight").t()
        hidden = (F.silu(gate) * up) @ w(f"experts.{e}.down_proj.weight").t()
        out = out + (weights * (chosen == e)).sum(-1, keepdim=True) * hidden
    counts = torch.stack([(chosen == e).sum() for e in range(E)]).to(y.dtype)
    T = y.shape[0]
    aux = MOE["aux_loss_coeff"] * E / (k * T * T) * (scores.sum(0) * counts).sum()
    return out, aux, counts


def reference_objective(p: dict, tokens, labels):
    """``(objective, cross-entropy, tokens per expert [L, E])`` on ``tokens`` / ``labels`` ``[N, s]`` taken as
    microbatches of :data:`MBS` sequences."""
    x = p["embedding.word.weight"][tokens]  # [N, s, h]
    n, s, h = x.shape
    aux, per_expert = 0.0, []
    for i in range(MODEL["num_layers"]):
        x = attention_residual(x, p, i, MODEL, THETA)
        y = _rms(x, p[f"layers.{i}.post_attention_layernorm.weight"]).reshape(n // MBS, MBS * s, h)
        parts = [_experts(mb, p, i) for mb in y]
        x = x + torch.stack([o for o, _, _ in parts]).reshape(n, s, h)
        aux = aux + sum(a for _, a, _ in parts) / len(parts)
        per_expert.append(sum(c for _, _, c in parts))
    logits = _rms(x, p["final_norm.weight"]) @ p["output_head.word.weight"].t()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return ce + aux, ce, torch.stack(per_expert)


def reference(per_rank: list, step: int):
    """``(cross-entropy, {name: grad}, tokens per expert)`` at ``step`` from the parameters the ranks recorded."""
    leaves = recorded_leaves(per_rank, step)
    tokens, labels = global_batch(per_rank, step)
    objective, ce, counts = reference_objective(leaves, tokens, labels)
    return ce.item(), dict(zip(leaves, torch.autograd.grad(objective, list(leaves.values())))), counts


def check_against_reference(per_rank: list, name: str) -> float:
    worst = 0.0
    for step in range(len(per_rank[0])):
        ce, grads, counts = reference(per_rank, step)
        assert len(grads) == _param_count(), f"{name}: the ranks hold {len(grads)} parameters"
        for steps in per_rank:
            r = steps[step]
            where = f"{name} step {step} pp_rank {r['pp_rank']} dp_rank {r['dp_rank']}"
            assert r["loss"] == pytest.approx(ce, rel=1e-6), where
            assert r["grad_norm"] == pytest.approx(torch.nn.utils.get_total_norm(list(grads.values())).item(),
                                                   rel=1e-5), where  # experts' squares summed over the group
            assert r["router"]["moe_tokens_per_expert"] == {str(i): counts[i].long().tolist()
                                                            for i in range(MODEL["num_layers"])}, where
            for pname, (_, grad) in r["params"].items():
                err = max_rel_error(torch.from_numpy(grad), grads[pname])
                assert err <= TOL, f"{where}: {pname} gradient differs from the reference by {err:.3g} (relative)"
                worst = max(worst, err)
    return worst


def _param_count() -> int:
    per_layer = 4 + 2 + 1 + 3 * MOE["num_experts"]  # attention, norms, router, experts
    return MODEL["num_layers"] * per_layer + 3  # embedding, final norm, output head


# ---- fixtures and tests -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pp1(tmp_path_factory) -> list:
    return [train_pp1(tmp_path_factory.mktemp("pp1"))]


@pytest.fixture(scope="module")
def ep_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ep")


@pytest.fixture(scope="module")
def ranks(ep_dir) -> list:
    return run_ranks(_job, 4, ep_dir, timeout=300)


@pytest.mark.timeout(300)
def test_pp1_moe_equals_the_reference(pp1):
    print(f"pp1: largest relative gradient error {check_against_reference(pp1, 'pp1'):.3g}")


@pytest.mark.timeout(300)
def test_pp2_ep2_recipe_equals_the_reference_and_pp1(ranks, pp1):
    per_rank = [r["ep2"] for r in ranks]
    print(f"pp2 x ep2: largest relative gradient error {check_against_reference(per_rank, 'pp2xep2'):.3g}")
    assert [r["ep2_holds"] for r in ranks] == [3 * 2 * 2] * 4  # 2 layers x 2 of 4 experts x 3 weights per rank
    for step in range(2):  # the same global batch, loss as the single-process run
        assert torch.equal(global_batch(per_rank, step)[0], global_batch(pp1, step)[0])
        assert per_rank[0][step]["loss"] == pytest.approx(pp1[0][step]["loss"], rel=1e-6)


@pytest.mark.timeout(300)
def test_resume_at_another_expert_parallel_size(ranks):
    assert [r["ep1_holds"] for r in ranks] == [3 * 2 * 4] * 4  # E=1: every rank holds all 4 experts
    saved = {n: v for r in ranks for n, (v, _) in r["ep2"][2]["params"].items()}  # step 3's start = the checkpoint
    for r in ranks:
        start = r["ep1_step3"][0]
        for name, (value, grad) in start["params"].items():
            assert (value == saved[name]).all(), f"{name}: not the saved parameter after resume at E=1"
            want = next(q["ep2"][2]["params"][name][1] for q in ranks if name in q["ep2"][2]["params"])
            assert max_rel_error(torch.from_numpy(grad), torch.from_numpy(want)) <= TOL, name
        assert start["loss"] == pytest.approx(r["ep2"][2]["loss"], rel=1e-6)
        final2 = {n: v for q in ranks for n, v in q["ep2_final"].items()}
        for name, value in r["ep1_final"].items():  # AdamW moments restored: the same update
            assert max_rel_error(torch.from_numpy(value), torch.from_numpy(final2[name])) <= TOL, name


# ---- refusals before any rank starts ------------------------------------------------------------------------------

BAD = [  # (overrides on the preset, world size or None, words the message must hold)
    ({"parallel.expert": 3}, None, ["parallel.expert=3", "model.moe.num_experts=4", "divisor"]),
    ({"parallel.data": 4, "parallel.expert": 4, "model.moe.num_experts": 8, "parallel.pipeline": 1,
      "parallel.virtual": 1, "parallel.schedule": "1f1b", "parallel.overlap_moe_expert_parallel_comm": False},
     None, []),  # valid: E=4 of data 4
    ({"parallel.data": None, "parallel.expert": 4, "model.moe.num_experts": 8}, 4,
     ["parallel.expert=4", "data-parallel size 2"]),
    ({"parallel.data": 3}, None, ["parallel.expert=2", "parallel.data=3", "divisor"]),
    ({"model.moe.top_k": 5}, None, ["model.moe.top_k=5", "model.moe.num_experts=4", "lower"]),
    ({"model.family": "gpt2"}, None, ["model.moe", "model.family=gpt2", "llama_moe"]),
    ({"model.moe": None, "model.family": "llama"}, None, ["parallel.expert=2", "model.moe is not set"]),
    ({"parallel.data": 1, "parallel.tensor": 2, "parallel.expert": 1}, 4, []),  # valid: tests/moe/test_moe_tensor_parallel.py
    ({"parallel.pipeline": 1, "parallel.virtual": 1, "parallel.schedule": "1f1b", "parallel.tensor": 2,
      "parallel.sequence_parallel": True, "parallel.overlap_moe_expert_parallel_comm": False}, 4, []),  # valid: ep 2
    ({"parallel.tensor": 2}, None, ["parallel.expert=2", "parallel.tensor=2", "sequence_parallel=true"]),
    ({"parallel.data": 1, "parallel.tensor": 2, "parallel.expert": 1, "model.moe.capacity_factor": 1.5}, None,
     ["model.moe.capacity_factor=1.5", "parallel.tensor=2", "capacity_factor=null"]),
    ({"parallel.data": 1, "parallel.tensor": 2, "parallel.expert": 1, "model.seq_length": 63}, None,
     ["parallel.tensor=2", "model.seq_length=63", "multiple of 2"]),
    ({"parallel.shard": "optimizer"}, None, []),  # valid: ZeRO-1 and FSDP2 shard the experts over expert-data
    ({"parallel.shard": "full"}, None, []),  # parallel ranks (tests/moe/test_moe_sharding.py)
    ({"cuda_graphs.enabled": True}, None, ["cuda_graphs.enabled=true", "enabled=false"]),
    ({"parallel.schedule": "1f1b", "parallel.virtual": 1}, None,
     ["overlap_moe_expert_parallel_comm=true", "parallel.schedule=1f1b", "dualpipev"]),
    ({"model.family": "llama_moe", "model.moe": None, "parallel.expert": 1,
      "parallel.overlap_moe_expert_parallel_comm": False}, None, ["model.family=llama_moe", "model.moe"]),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_settings_are_refused_before_any_rank_starts(case):
    more, world, words = BAD[case]
    if not words:
        validate_world_size(load_config(PRESET, more), world or 4)  # the valid neighbour loads
        return
    with pytest.raises(ConfigError) as err:
        config = load_config(PRESET, more)
        if world is not None:
            validate_world_size(config, world)
    for word in words:
        assert word in str(err.value), str(err.value)


# ---- Hugging Face out and in --------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_hugging_face_export_gives_the_same_greedy_text_and_init_from_reads_it_back(ranks, ep_dir, tmp_path):
    """The E=2 run's step-2 checkpoint as a Mixtral folder: ``transformers`` loads it (its per-expert tensors) and
    gives pipecast's logits and greedy text; ``model.init_from`` starts a run from bitwise those weights."""
    transformers = pytest.importorskip("transformers", reason="optional dependency transformers (dev extra)")
    from engine import Trainer
    from engine.training.export import export_checkpoint, export_hf, load_exported
    from engine.training.generate import generate, load_model
    export_hf(ep_dir / "checkpoints" / "step_00000002", tmp_path / "hf")
    export_checkpoint(ep_dir / "checkpoints" / "step_00000002", tmp_path / "moe.safetensors")  # pipecast's names
    tensors, info = load_exported(tmp_path / "moe.safetensors")
    assert info["model"]["moe"]["num_experts"] == MOE["num_experts"] and any(".moe.experts." in n for n in tensors)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ours = load_model(ep_dir / "checkpoints" / "step_00000002").model
    tokens = torch.tensor([[ord(c) for c in "def f(x)"], [ord(c) for c in "return y"]])  # [b, s]
    with torch.no_grad():
        want = hf(tokens).logits  # [b, s, V]
        got = ours(tokens).transpose(0, 1)  # [s, b, V] -> [b, s, V]
    diff = (got - want).abs().max().item()
    print(f"Mixtral export: logits max |diff| {diff:.3g}")
    assert diff <= 1e-5 * want.abs().max().item()
    prompt = [ord(c) for c in "def"]
    text = generate(ours, prompt, MODEL["seq_length"] - len(prompt), temperature=0)
    assert hf.generate(torch.tensor([prompt]), max_new_tokens=len(text), do_sample=False)[0, 3:].tolist() == text
    saved = {n: v for r in ranks for n, (v, _) in r["ep2"][2]["params"].items()}
    more = {"parallel.pipeline": 1, "parallel.virtual": 1,
            "parallel.schedule": "1f1b", "parallel.data": 1, "parallel.expert": 1, "training.steps": 1,
            "parallel.overlap_moe_expert_parallel_comm": False}
    plain = {k: v for k, v in overrides(tmp_path / "init", **more).items() if not k.startswith("model.")}
    config = load_config(None, plain | {"model.init_from": str(tmp_path / "hf"),  # the architecture: config.json
                                        "model.seq_length": MODEL["seq_length"]})
    moe = config.model.moe
    assert config.model.family == "llama_moe" and (moe.num_experts, moe.top_k) == (MOE["num_experts"], MOE["top_k"])
    with Trainer(config) as trainer:
        for name, p in trainer.canonical.named_parameters():
            assert torch.equal(p.detach(), torch.from_numpy(saved[name])), name
    with pytest.raises(ConfigError, match=r"model.moe.top_k=1 disagrees .*config.json \(top_k = 2\)"):
        load_config(None, plain | {"model.init_from": str(tmp_path / "hf"), "model.seq_length": 8,
                                   "model.moe.top_k": 1})


# ---- pipecast tune: all-to-all costs, the overlap where a schedule has cells ---------------------------------------

def test_tune_takes_the_all_to_all_apart_and_keeps_the_overlap_only_where_cells_are():
    from engine.plan.candidates import Candidate
    from engine.profiling.timeline import Span
    from engine.training.config import validate
    from engine.training.tune.measure import a2a_per_action_ms
    from engine.training.tune.tuner import variant_config
    ms = 1_000_000
    spans = [Span("compute", "F0.0", 0, 100 * ms), Span("comm", "a2a dispatch", 10 * ms, 30 * ms, depth=1),
             Span("comm", "a2a combine", 50 * ms, 60 * ms, depth=1), Span("compute", "F1.0", 100 * ms, 150 * ms),
             Span("comm", "a2a dispatch", 110 * ms, 150 * ms, depth=1), Span("compute", "B0.0", 200 * ms, 300 * ms),
             Span("comm", "a2a dispatch backward", 290 * ms, 310 * ms, depth=1)]  # ends outside B0.0: not B's
    got = a2a_per_action_ms([spans, [Span("compute", "F0.0", 0, ms)]])
    assert got == {("F", 0, 0): pytest.approx(35.0), ("B", 0, 0): 0.0}  # median of 30 and 40; rank 1 has no comm
    config = load_config(PRESET)
    assert config.parallel.overlap_moe_expert_parallel_comm
    for schedule, virtual, overlap in (("dualpipev", 2, True), ("1f1b", 1, False), ("zbv", 2, False),
                                       ("interleaved", 2, False)):  # tune's interleaved plans have no cells
        variant = variant_config(config, Candidate(schedule, virtual), Path("run"), 3)
        assert variant.parallel.overlap_moe_expert_parallel_comm is overlap, schedule
        validate(variant)
        measured = variant_config(config, Candidate(schedule, virtual), Path("run"), 3, overlap=False)
        assert not measured.parallel.overlap_moe_expert_parallel_comm


def test_tune_ranks_interleaved_also_as_combined_1f1b():
    """With the overlap, interleaved candidates are ranked with Megatron's combined-1F1B cells as well: the plan has
    them, the simulation hides part of the all-to-all (faster than the same setting without cells at the same
    costs), the run trains that plan, and ``parallel.schedule: tuned`` reads the setting back."""
    import dataclasses
    import json
    from engine.plan.candidates import CostModel, LayoutCosts, candidates, overlap_candidates, predict
    from engine.training.config import validate
    from engine.training.tune.result import resolve_tuned
    from engine.training.tune.tuner import config_candidate, variant_config
    config = load_config(PRESET)
    P, M = config.parallel.pipeline, config.training.num_microbatches
    cands = candidates(P, config.model.num_layers, M)
    over = overlap_candidates(cands, P, M)
    assert over and all(c.schedule == "interleaved" and c.overlap for c in over)
    best = over[0]
    plain = dataclasses.replace(best, overlap=False)
    assert best.plan(P, M).compounds and not plain.plan(P, M).compounds and "overlap" in best.label
    stages = P * best.virtual
    lc = LayoutCosts((2.0,) * stages, (4.0,) * stages, (0.0,) * stages, (1,) * stages, (0,) * stages,
                     (1,) * stages, a2a_ms=(1.0,) * stages)
    model = CostModel({best.layout: lc}, 0.1, 0, True)
    assert predict(best, model, P, M).predicted_ms < predict(plain, model, P, M).predicted_ms
    assert variant_config(config, best, Path("run"), 3).parallel.overlap_moe_expert_parallel_comm is True
    assert not variant_config(config, plain, Path("run"), 3).parallel.overlap_moe_expert_parallel_comm
    assert not variant_config(config, best, Path("run"), 3, overlap=False).parallel.overlap_moe_expert_parallel_comm
    mine = load_config(PRESET, {"parallel.schedule": best.schedule, "parallel.virtual": best.virtual})
    assert config_candidate(mine) == dataclasses.replace(best, group_size=None)  # the config's own: with its cells
    tuned = load_config(PRESET, {"parallel.schedule": "tuned"}, check=False)
    from engine.training.tune.result import tune_path, tuned_for
    path = tune_path(tuned)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"settings": best.overrides(), "label": best.label}
    path.write_text(json.dumps({"measured": {}, "best": entry, "tuned_for": tuned_for(tuned)}))
    try:
        run = resolve_tuned(tuned)
    finally:
        path.unlink()
    assert (run.parallel.schedule, run.parallel.overlap_moe_expert_parallel_comm) == ("interleaved", True)
    validate(run)


def test_the_memory_estimate_counts_this_ranks_share_of_the_experts():
    """The preset's first stage (one MoE layer and the embedding), written out: attention ``4096 + 2048 + 2048 +
    4096``, two norms ``2 x 64``, the router ``4 x 64``, ``4 / E`` experts of ``3 x 64 x 96``, the word embedding
    ``256 x 64``."""
    from engine.training.memory import stage_parameters
    for expert, experts_here in ((2, 2), (1, 4)):
        config = load_config(PRESET, {"parallel.expert": expert})
        want = 12288 + 128 + 256 + experts_here * 3 * 64 * 96 + 256 * 64
        assert stage_parameters(config, 0) == (want, 4 + 2 + 1 + 3 * experts_here + 1), expert


def test_a_resume_may_change_the_expert_parallel_size_but_not_the_experts():
    from engine.training.checkpoint.resume import checkpoint_meta, resume_differences
    meta = checkpoint_meta(load_config(PRESET), 10)
    assert resume_differences(meta, load_config(PRESET, {"parallel.expert": 1})) == ([], [])
    refused, _ = resume_differences(meta, load_config(PRESET, {"model.moe.num_experts": 8}))
    assert len(refused) == 1 and "model.moe=" in refused[0] and "'num_experts': 8" in refused[0], refused


@pytest.mark.parametrize("key,value", [("shared_experts", 1), ("router", "sigmoid"), ("capacity_factor", 1.25),
                                       ("first_dense_layers", 1), ("normalize_top_k", False)])
def test_what_mixtral_cannot_express_is_refused_at_export(key, value, tmp_path):
    from engine.training.models import get_family
    config = load_config(PRESET, {f"model.moe.{key}": value})
    with pytest.raises(ValueError, match=rf"model.moe.{key}={re.escape(json.dumps(value))} cannot be exported as "
                       r"Hugging Face Mixtral"):  # YAML spellings (null, false), not Python's
        get_family("llama_moe").hf.config(config.model, config.ffn_hidden_size)
    from engine.training.checkpoint.hf import write_hf_folder  # refused before any tensor is renamed
    state = {"layers.1.moe.shared_experts.gate_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match=rf"model.moe.{key}=.* cannot be exported"):
        write_hf_folder(tmp_path / "hf", config.model, config.ffn_hidden_size, state)
    assert get_family("llama_moe").hf.config(load_config(PRESET).model, 172)["num_local_experts"] == 4
