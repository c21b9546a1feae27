"""The memory estimate (:mod:`engine.training.memory`) against exact counts, and the check that refuses a run before
any rank starts (issue 36: ``hidden_size: 16384`` with 64 layers ran 52 s until the OOM killer ended a rank).

* parameters, gradients and AdamW state per pipeline rank: exactly the bytes of the modules built for the rank's
  stages (looped and V placement, tied and untied, gpt2 and llama) after a real ``torch.optim.AdamW`` step;
* one microbatch's activations per stage: the bytes autograd saves, measured with saved-tensor hooks (distinct
  storages, parameters and buffers left out), and a pending ``W``'s bytes: ``WeightGradWork.held_bytes``;
* the check refuses a model larger than the machine in the launcher (no rank is started), accepts every preset,
  and ``training.check_memory: false`` skips it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

import tests.training.models.tiny_family  # noqa: F401 - registers model.family: tiny_relu2
from engine.training.config import ConfigError, load_config
from engine.training.memory import (RANK_OVERHEAD_BYTES, activation_bytes, check_memory, estimate, pending_w_bytes,
                                    stage_parameters)

from engine.training.models import get_family

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"model.num_layers": 4, "model.hidden_size": 32, "model.num_attention_heads": 4, "model.seq_length": 16,
         "model.vocab_size": 300, "training.micro_batch_size": 3, "training.num_microbatches": 4,
         "data.max_bytes": 100_000}
HUGE = ["model.hidden_size=16384", "model.num_layers=64", "model.num_attention_heads=128"]
GIB = 1 << 30


def _config(**extra):
    return load_config(None, {**SMALL, "logging.run_dir": "runs/test-memory", **extra}, check=False)


def _rank_params(config, rank):
    """The unique parameters of pipeline rank ``rank``'s model chunks, built as the trainer builds them."""
    from engine.training.models.chunk import build_model_chunks
    plan = config.resolve_schedule().plan(config.training.num_microbatches)
    p = config.parallel
    chunks = build_model_chunks(config.model, config.ffn_hidden_size, p.pipeline, rank, p.virtual, 0,
                                stages=plan.stages_of(rank))
    return chunks, list({id(q): q for c in chunks for q in c.parameters()}.values())


LAYOUTS = [dict(), {"model.tie_embeddings": False}, {"parallel.pipeline": 2, "parallel.virtual": 2},
           {"parallel.pipeline": 2, "parallel.virtual": 2, "parallel.schedule": "zbv"},  # V placement: both ends share the embedding
           {"model.family": "llama", "model.num_query_groups": 2, "parallel.pipeline": 2},
           {"model.family": "llama", "model.tie_embeddings": False, "model.ffn_hidden_size": 88},
           {"model.family": "tiny_relu2", "parallel.pipeline": 2},  # registered in a test module, no ``memory``
           {"model.family": "llama", "model.num_layers": 6, "parallel.pipeline": 3,
            "model.pipeline_layout": "Et|t*3|t*2L"},  # uneven: each stage's own layers
           {"model.family": "llama_moe", "model.num_layers": 6, "parallel.pipeline": 3,
            "model.pipeline_layout": "Et*2|t*3|tL", "model.moe": {"num_experts": 4, "top_k": 2, "first_dense_layers": 1,
                                                                 "ffn_hidden_size": 24, "shared_experts": 1}}]


@pytest.mark.parametrize("extra", LAYOUTS, ids=lambda e: ",".join(f"{k.split('.')[1]}={v}" for k, v in e.items()
                                                                  if k != "model.moe"))
def test_parameters_gradients_and_adamw_state_are_exact(extra):
    config = _config(**extra)
    est = estimate(config)
    for rank, mine in enumerate(est.ranks):
        chunks, params = _rank_params(config, rank)
        for c in chunks:  # per stage: the chunk's own parameters
            assert stage_parameters(config, c.stage) == (sum(q.numel() for q in c.parameters()),
                                                         len(list(c.parameters()))), c.stage
        for q in params:
            q.grad = torch.ones_like(q)
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        optimizer.step()
        state = sum(t.nbytes for s in optimizer.state.values() for t in s.values())
        assert (mine.parameters, mine.gradients, mine.optimizer) == (
            sum(q.nbytes for q in params), sum(q.grad.nbytes for q in params), state), rank


def _saved_and_held(config, stage):
    """One microbatch's forward through ``stage`` alone: distinct storages autograd saves (parameters and buffers
    left out), then ``B`` under the layer-level deferral and the bytes its pending ``W`` holds."""
    from engine.model_parallel_config import ModelParallelConfig
    from engine.runtime.split_backward import backward_input_step, weight_grad_deferral
    from engine.training.models.chunk import ModelChunk
    m, b = config.model, config.training.micro_batch_size
    mp = ModelParallelConfig(pipeline_dtype=torch.float32, hidden_size=m.hidden_size)
    chunk = ModelChunk(m, config.ffn_hidden_size, stage, config.parallel.pipeline * config.parallel.virtual, 0, mp)
    dtype = torch.bfloat16 if m.precision == "bf16" else torch.float32
    chunk.to(dtype)
    if m.recompute != "none":
        from engine.runtime.recompute import apply_recompute
        core = get_family(m.family).attention_core
        apply_recompute([b if m.recompute == "full" else b.get_submodule(core) for b in chunk.layers])
    skip = {t.untyped_storage().data_ptr() for t in [*chunk.parameters(), *chunk.buffers()]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = None if chunk.is_first else torch.randn(m.seq_length, b, m.hidden_size, dtype=dtype, requires_grad=True)
    chunk.set_input_tensor(x)
    tokens = torch.randint(0, m.vocab_size, (b, m.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), weight_grad_deferral():
        y = chunk(tokens, tokens if chunk.is_last else None)
    loss, grad = (y.float().mean(), None) if chunk.is_last else (y, torch.ones_like(y))
    _, work = backward_input_step(x, loss, grad, mp)
    return sum(saved.values()), work.held_bytes()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_and_pending_w_bytes_match_what_autograd_holds(family, dropout):
    """Per stage (first: embedding, middle, last: norm, head and loss) of a 4-stage, 8-layer model."""
    extra = {"model.num_query_groups": 2, "model.ffn_hidden_size": 88} if family == "llama" else {}
    config = _config(**{"model.family": family, "model.dropout": dropout, "model.num_layers": 8,
                        "parallel.pipeline": 4, **extra})
    for stage in (0, 1, 3):
        saved, held = _saved_and_held(config, stage)
        predicted = activation_bytes(config, stage)
        assert abs(predicted - saved) <= 0.01 * saved, (stage, predicted, saved)
        if not dropout:  # the deferral's held bytes do not depend on dropout (its masks are autograd's)
            predicted = pending_w_bytes(config, stage)
            assert abs(predicted - held) <= 0.03 * held, (stage, predicted, held)


MOE = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 24}
MOE_CASES = {"softmax": ({}, {}), "sigmoid,shared": ({"router": "sigmoid", "shared_experts": 1}, {}),
             "k3,plain,no-aux": ({"top_k": 3, "normalize_top_k": False, "aux_loss_coeff": 0.0}, {}),
             "dense-first,bf16": ({"first_dense_layers": 1}, {"model.precision": "bf16"}),
             "every-2nd,selective": ({"layer_freq": 2}, {"model.recompute": "selective"})}


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_activation_and_pending_w_bytes_match_what_autograd_holds(case):
    """A MoE model's stages (router scores and probabilities, int64 routing indices, dispatched rows, expert
    outputs, each expert's SwiGLU; dense layers counted as dense): within 1% of what autograd saves and of what
    a pending ``W`` holds, at either precision."""
    moe, extra = MOE_CASES[case]
    config = _config(**{"model.family": "llama_moe", "model.num_layers": 8, "parallel.pipeline": 4,
                        "model.num_query_groups": 2, "model.ffn_hidden_size": 88, "model.moe": {**MOE, **moe}, **extra})
    for stage in (0, 1, 3):
        saved, held = _saved_and_held(config, stage)
        assert abs(activation_bytes(config, stage) - saved) <= 0.01 * saved, (stage, activation_bytes(config, stage),
                                                                              saved)
        assert abs(pending_w_bytes(config, stage) - held) <= 0.01 * held, (stage, pending_w_bytes(config, stage), held)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("precision,recompute", [("bf16", "none"), ("fp32", "selective"), ("fp32", "full"),
                                                 ("bf16", "selective"), ("bf16", "full")])
def test_precision_recompute_and_layout_in_the_activation_bytes(family, precision, recompute):
    """``model.precision`` / ``model.recompute`` as the trainer applies them (bf16 chunks; each block or its
    attention core recomputed), stages of an uneven ``model.pipeline_layout``: within 1% of what autograd saves; and
    bf16's parameters are a bf16 copy beside the fp32 masters (gradients and AdamW state unchanged)."""
    extra = {"model.num_query_groups": 2} if family == "llama" else {}
    config = _config(**{"model.family": family, "model.precision": precision, "model.recompute": recompute,
                        "model.num_layers": 6, "parallel.pipeline": 3, "model.pipeline_layout": "Et|t*3|t*2L",
                        **extra})
    for stage in (0, 1, 2):
        saved, _ = _saved_and_held(config, stage)
        predicted = activation_bytes(config, stage)
        # 1%, or gpt2's [s] int64 position indices (not counted) where full recomputation leaves little else
        assert abs(predicted - saved) <= max(0.01 * saved, 8 * config.model.seq_length), (stage, predicted, saved)
    fp32 = estimate(_config(**{"model.family": family, "model.num_layers": 6, "parallel.pipeline": 3,
                               "model.pipeline_layout": "Et|t*3|t*2L", **extra}))
    for mine, ref in zip(estimate(config).ranks, fp32.ranks):
        assert mine.parameters == (ref.parameters * 3 // 2 if precision == "bf16" else ref.parameters)
        assert (mine.gradients, mine.optimizer) == (ref.gradients, ref.optimizer)


def test_a_family_without_memory_counts_gets_the_generic_block_estimate():
    """A registered family that gives no ``memory`` (tests/training/models/tiny_family.py: RMSNorm, separate q / k /
    v, squared-ReLU MLP) is estimated as a generic pre-norm attention + MLP block: within 15% of what autograd
    saves, and of what a pending W holds."""
    config = _config(**{"model.family": "tiny_relu2", "model.num_layers": 8, "parallel.pipeline": 4})
    for stage in (0, 1, 3):
        saved, held = _saved_and_held(config, stage)
        assert abs(activation_bytes(config, stage) / saved - 1) <= 0.15, (stage, activation_bytes(config, stage), saved)
        assert abs(pending_w_bytes(config, stage) / held - 1) <= 0.15, (stage, pending_w_bytes(config, stage), held)


def test_activations_are_the_plans_in_flight_microbatches_times_one_microbatch():
    """1F1B on 4 ranks, 8 microbatches: rank r holds min(P - r, M) microbatches at its peak (Narayanan et al.)."""
    config = _config(**{"parallel.pipeline": 4, "training.num_microbatches": 8})
    for r, mine in enumerate(estimate(config).ranks):
        assert mine.in_flight == 4 - r
        assert mine.activations == (4 - r) * activation_bytes(config, r)


def _launch(monkeypatch, capsys, tmp_path, overrides: list[str]) -> tuple[int, str, list]:
    """``pipecast train configs/default.yaml OVERRIDES`` in this process; starting ranks is recorded, not done."""
    from engine.training import launch
    started = []
    monkeypatch.setattr(launch, "run_spawned", lambda *a: started.append(a) or 0)
    args = argparse.Namespace(config=str(ROOT / "configs/default.yaml"), resume=False, timeline=None, nvtx=False,
                              extra=[f"--logging.run_dir={tmp_path / 'run'}", "--data.max_bytes=100000",
                                     *(f"--{o}" for o in overrides)])
    capsys.readouterr()
    code = launch.run(args)
    return code, capsys.readouterr().err, started


def test_a_model_larger_than_the_machine_is_refused_before_any_rank_starts(monkeypatch, capsys, tmp_path):
    code, err, started = _launch(monkeypatch, capsys, tmp_path, HUGE)
    assert code == 2 and not started, err
    assert err.count("\n") == 1 and err.startswith("error: this run needs an estimated 3,203 GiB of host memory"), err
    for part in ("parameters 384 GiB", "gradients 384 GiB", "optimizer 768 GiB", "activations 80.0 GiB",
                 "5 microbatches in flight", "model.num_layers, now 64", "parallel.pipeline, now 2",
                 "training.micro_batch_size (now 8)", "--training.check_memory=false"):
        assert part in err, (part, err)
    code, err, started = _launch(monkeypatch, capsys, tmp_path, HUGE + ["training.check_memory=false"])
    assert code == 0 and len(started) == 1, err  # the escape hatch: the ranks would start


def test_the_host_and_the_device_budgets():
    config = _config(**{"parallel.pipeline": 2})
    est = check_memory(config, device_type="cpu", host_bytes=1 << 40)
    need = est.total + 2 * RANK_OVERHEAD_BYTES
    assert check_memory(config, device_type="cpu", host_bytes=need) == est
    with pytest.raises(ConfigError, match="of host memory for 2 local ranks"):
        check_memory(config, device_type="cpu", host_bytes=need - 1)
    heavy = est.heaviest.total  # CUDA: the tensors live on the device, the host holds the ranks' overhead
    assert check_memory(config, device_type="cuda", host_bytes=2 * RANK_OVERHEAD_BYTES, device_bytes=heavy)
    with pytest.raises(ConfigError, match="of GPU memory per rank but .* is on the device: the heaviest rank"):
        check_memory(config, device_type="cuda", host_bytes=1 << 40, device_bytes=heavy - 1)
    one_node = check_memory(config, device_type="cpu", local_ranks=1, host_bytes=heavy + RANK_OVERHEAD_BYTES)
    assert one_node == est  # a torchrun node with one of the two ranks: counted as the heaviest


def test_every_preset_fits_a_16_gib_host_or_an_80_gib_gpu():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = load_config(path, check=False)
        device = "cuda" if config.parallel.device == "cuda" else "cpu"
        est = check_memory(config, device_type=device, host_bytes=16 * GIB, device_bytes=80 * GIB)
        assert est is not None and est.heaviest.total > 0, path.name


@pytest.mark.cuda
def test_the_gpu_budget_is_read_from_the_device():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = load_config(ROOT / "configs/gpu_cuda_graphs.yaml", ["parallel.pipeline=1", "parallel.virtual=1",
                                                                 "parallel.schedule=1f1b"], check=False)
    for own in (0, None):  # torchrun: this process's free memory; the local spawner: the device's total
        assert check_memory(config, device_type="cuda", own_device=own, host_bytes=1 << 50) is not None
        with pytest.raises(ConfigError, match="GPU memory per rank"):
            check_memory(load_config(None, HUGE, check=False), device_type="cuda", own_device=own,
                         host_bytes=1 << 50)


def test_partial_recomputation_keeps_the_first_microbatches_whole():
    """``model.recompute_kept_microbatches: N``: N of a rank's in-flight microbatches at its peak hold a whole
    microbatch's activations, the rest the recomputed ones'; N at or above the in-flight count is no recomputation."""
    base = {"parallel.pipeline": 4, "model.num_layers": 8, "training.num_microbatches": 8}
    none, full = (estimate(_config(**base, **{"model.recompute": r})) for r in ("none", "full"))
    for kept in (1, 2, 8):
        partial = estimate(_config(**base, **{"model.recompute": "full", "model.recompute_kept_microbatches": kept}))
        for n, f, p in zip(none.ranks, full.ranks, partial.ranks):
            k = min(kept, f.in_flight)
            assert p.activations == f.activations + k * (n.per_microbatch - f.per_microbatch), (kept, p.pipeline_rank)
            assert (p.activations == n.activations) == (kept >= f.in_flight)
    # interleaved (pipeline 2 x virtual 2, 4 microbatches): the flag goes by the rank's forward index, so rank 1's
    # three in-flight forwards at its peak (indices 0-2, window 3) keep 2; none of the measured bytes differ
    # (benchmarks/memory.py --fit: rank 1 holds what no recomputation holds)
    default = {"parallel.pipeline": 2, "parallel.virtual": 2, "training.num_microbatches": 4}
    none = estimate(_config(**default))
    partial = estimate(_config(**default, **{"model.recompute": "full", "model.recompute_kept_microbatches": 2}))
    full = estimate(_config(**default, **{"model.recompute": "full"}))
    assert full.ranks[0].activations < partial.ranks[0].activations < none.ranks[0].activations
    assert partial.ranks[1].activations == none.ranks[1].activations
