"""Bring your own model: ``engine.split_model`` + ``engine.finalize_model_grads`` on a batch-first, Hugging Face style
GPT-2 (``tests/examples/byom_example.py``: own block signature returning a tuple, tied embedding and head).

* in one process: chunk parameter names are the model's; the chunks of every placement (looped, interleaved, V)
  chained by hand reproduce the unsplit model's logits and gradients; tied weights are marked only when the first
  and the last stage are on different ranks; bad input gets errors naming the numbers / paths;
* on 2 gloo ranks: 1F1B and interleaved 1F1B (variable sequence lengths, output deallocation) train for several
  optimizer steps with losses, gradients and final weights equal to the unsplit model in one process, and the
  merged chunk state dicts load into the unsplit model; without ``finalize_model_grads_func`` the schedule warns
  once; a batch-first stage output under ``variable_seq_lengths`` names ``[s, b, h]``.
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import ModelParallelConfig, finalize_model_grads, looped_stages, split_model, v_stages
from engine.runtime.executor import _Runner
from tests.examples.byom_example import TinyGPT2, embed, split_gpt2
from tests.helpers.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[2]
STEPS, M, B = 3, 4, 2
LENGTHS = (8, 6, 8, 5)  # sequence length of microbatch m (variable_seq_lengths); fixed runs use 8


def _config(pp: int = 2, vp=None, **kw) -> ModelParallelConfig:
    return ModelParallelConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                               pipeline_dtype=torch.float32, hidden_size=16, **kw)


def _model(kind: str = "tiny") -> nn.Module:
    torch.manual_seed(0)
    if kind == "tiny":
        return TinyGPT2()
    import transformers  # noqa: PLC0415 - optional
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=4, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).float()


def _data(step: int, variable: bool) -> list:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for m in range(M):
        ids = torch.randint(0, 64, (B, (LENGTHS[m] if variable else 8) + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


# ---- in one process ---------------------------------------------------------------------------------------------

PLACEMENTS = {"1f1b": (lambda r: looped_stages(r, 2), None), "interleaved": (lambda r: looped_stages(r, 2, 2), 2),
              "v": (lambda r: v_stages(r, 2), None)}


def _all_chunks(model, placement: str, layout=None) -> list:
    """The chunks of both ranks of a 2-rank pipeline, in stage order (``layout``: uneven stages)."""
    stages_of, vp = PLACEMENTS[placement]
    if layout is None:
        chunks = [c for r in range(2) for c in split_gpt2(model, _config(2, vp), stages_of(r))]
    else:
        chunks = [c for r in range(2) for c in split_model(
            model, layers="transformer.h", stages=stages_of(r), config=_config(2, vp), batch_first=True,
            first=["transformer.wte", "transformer.wpe", "transformer.drop"], last=["transformer.ln_f", "lm_head"],
            embed=embed, layout=layout)]
    return sorted(chunks, key=lambda c: c.stage)


def test_chunk_state_dict_keys_are_the_unsplit_models():
    model = _model()
    full = model.state_dict()
    for placement in PLACEMENTS:
        merged = {}
        for chunk in _all_chunks(model, placement):
            for key, value in chunk.state_dict().items():
                assert key in full and value.data_ptr() == full[key].data_ptr(), (placement, key)
                merged[key] = value
        assert set(merged) == set(full), placement


UNEVEN = [("1f1b", "Et*3|tL", [3, 1]), ("1f1b", [1, 3], [1, 3]), ("interleaved", "E|t*2|t|tL", [0, 2, 1, 1]),
          ("interleaved", [2, 1, 1, 0], [2, 1, 1, 0]), ("v", "Et|t|t*2|L", [1, 1, 2, 0]),
          ("v", [0, 1, 2, 1], [0, 1, 2, 1])]


@pytest.mark.parametrize("placement,layout,counts", [(p, None, None) for p in PLACEMENTS] + UNEVEN)
def test_chained_chunks_equal_the_unsplit_model(placement, layout, counts):
    """Equal and uneven stages (a layout string or per-stage counts) under every placement."""
    ref, model = _model(), _model()
    ids, labels = _data(0, False)[0]
    expected = ref(ids)
    F.cross_entropy(expected.flatten(0, 1), labels.flatten()).backward()
    x = None
    chunks = _all_chunks(model, placement, layout)
    if counts is not None:
        assert [len(c.body_layers) for c in chunks] == counts
    for chunk in chunks:
        if not chunk.is_first:
            chunk.set_input_tensor([x])
        x = chunk(ids)
        if not chunk.is_last:
            assert x.shape == (8, B, 16) and x.is_contiguous()  # the pipeline's [s, b, h]...
            assert x._base is None  # ...owning its storage, as output deallocation needs
    torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-6)
    F.cross_entropy(x.flatten(0, 1), labels.flatten()).backward()
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_tied_weights_marked_only_across_ranks():
    for placement, marked in (("1f1b", True), ("interleaved", True), ("v", False)):
        stages_of, vp = PLACEMENTS[placement]
        for rank in range(2):
            model = _model()  # one model per rank, as on real ranks (the marks live on the Parameter)
            chunks = split_gpt2(model, _config(2, vp), stages_of(rank))
            tied = [n for c in chunks for n in c.tied_weights]
            w = model.transformer.wte.weight
            if not marked:  # V: rank 0 holds stages 0 and 3, one Parameter in two chunks, nothing to sync
                assert tied == [] and not getattr(w, "shared_embedding", False), (placement, rank)
                continue
            assert tied == (["transformer.wte.weight"] if rank == 0 else ["lm_head.weight"]), (placement, rank)
            assert w.shared_embedding and w.shared_embedding_copy == (rank == 1)


def test_uneven_split_names_the_numbers():
    with pytest.raises(ValueError) as err:
        split_gpt2(TinyGPT2(layers=3), _config(2), looped_stages(0, 2))
    msg = str(err.value)
    assert "3 layers ('transformer.h')" in msg and "num_stages=2" in msg and "pipeline_model_parallel_size=2" in msg
    with pytest.raises(ValueError, match="6 layers .* num_stages=4 .* 2 model chunk"):
        split_gpt2(TinyGPT2(layers=6), _config(2, 2), looped_stages(0, 2, 2))


def test_bad_layouts_are_named():
    """A layout split_model cannot use: errors name the argument, the value and the fix."""
    cases = [(3, "Et*3|tL", None, r"layout='Et\*3\|tL' places 4 decoder layers \(t\) but len\(transformer.h\)=3"),
             (4, "Et|t|t|tL", None, r"lists 4 stages but pipeline_model_parallel_size=2 x chunks per rank=1 runs 2: "
                                   r".* or set chunks per rank=2"),
             (4, [2, 0, 1, 1], 2, r"stage 1 holds no layer"),
             (4, "tE|ttL", None, r"has E elsewhere")]
    for layers, layout, vp, message in cases:
        with pytest.raises(ValueError, match=message):
            split_model(TinyGPT2(layers=layers), layers="transformer.h", stages=looped_stages(0, 2, vp or 1),
                        config=_config(2, vp), first=["transformer.wte", "transformer.wpe", "transformer.drop"],
                        last=["transformer.ln_f", "lm_head"], layout=layout)


def test_bad_paths_and_stages_are_named():
    model = TinyGPT2()
    with pytest.raises(ValueError, match=r"layers='transformer\.blocks' names no submodule .*\['transformer', "
                                         r"'lm_head'\]"):
        split_model(model, layers="transformer.blocks", stages=[0], config=_config(2))
    with pytest.raises(TypeError, match="layers='transformer.ln_f' is a LayerNorm"):
        split_model(model, layers="transformer.ln_f", stages=[0], config=_config(2))
    with pytest.raises(ValueError, match=r"parameters \['transformer.ln_f.weight', 'transformer.ln_f.bias'\] "
                                         r"belong to no stage.*last="):
        split_model(model, layers="transformer.h", stages=[0], config=_config(2), first=["transformer.wte",
                                                                                         "transformer.wpe"])
    with pytest.raises(ValueError, match=r"stages=\[0, 2\] must be distinct virtual stage indices in \[0, "
                                         r"num_stages=2\)"):
        split_model(model, layers="transformer.h", stages=[0, 2], config=_config(2), num_stages=2)


def test_weight_shared_by_middle_stages_is_rejected():
    model = TinyGPT2()
    model.transformer.h[2].c_proj.weight = model.transformer.h[1].c_proj.weight
    with pytest.raises(ValueError, match=r"used by virtual stages \[1, 2\]; only a weight shared by the first and "
                                         r"the last stage"):
        split_gpt2(model, _config(4), looped_stages(0, 4))


def test_sequential_model_with_first_and_last_entries():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 10))
    chunks = [split_model(model, layers="", first=["0"], last=["5"], stages=[r], config=_config(2))[0]
              for r in range(2)]
    assert [list(c.state_dict()) for c in chunks] == [["0.weight", "1.weight", "1.bias"],
                                                      ["3.weight", "3.bias", "5.weight", "5.bias"]]
    ids = torch.tensor([[1, 2, 3]])  # no batch_first: the embedding's [b=1, s=3, h] passes as is
    x = chunks[0](ids)
    chunks[1].set_input_tensor(x)
    torch.testing.assert_close(chunks[1](ids), model(ids))


def test_finalize_without_groups_scales_by_tokens_and_ignores_duplicates():
    model = TinyGPT2()
    chunks = split_gpt2(model, _config(2), v_stages(0, 2))  # stages 0 and 3: the tied weight is in both chunks
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    held = list(nn.ModuleList(chunks).named_parameters())
    before = {n: p.grad.clone() for n, p in held}
    finalize_model_grads(chunks, torch.tensor(4, dtype=torch.int))
    for n, p in held:  # the tied weight is scaled once, not once per use
        torch.testing.assert_close(p.grad, before[n] / 4, msg=n)


def _train_one_chunk(chunk, config, calls: int) -> list[int]:
    from engine.schedules import forward_backward_no_pipelining
    counts = []
    for _ in range(calls):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            forward_backward_no_pipelining(
                forward_step_func=lambda it, m: (m(torch.zeros(1, 4, dtype=torch.long)),
                                                 lambda out: (out.float().mean(), {})),
                data_iterator=None, model=chunk, num_microbatches=1, seq_length=4, micro_batch_size=1)
        counts.append(sum("finalize_model_grads_func is None" in str(w.message) for w in seen))
    return counts


def test_marked_weights_without_finalize_warn_once():
    config = _config(1)
    (chunk,) = split_gpt2(TinyGPT2(), config, [0])
    assert _train_one_chunk(chunk, config, 2) == [0, 0]  # one rank holds both ends: nothing to sync
    (chunk,) = split_gpt2(TinyGPT2(), config, [0])
    chunk.transformer.wte.weight.shared_embedding = True  # a model marking its shared weight itself
    assert _train_one_chunk(chunk, config, 2) == [1, 0]
    (chunk,) = split_gpt2(TinyGPT2(), config, [0])
    chunk.transformer.wte.weight.shared_embedding = True
    config.finalize_model_grads_func = finalize_model_grads
    assert _train_one_chunk(chunk, config, 1) == [0]


def test_batch_first_negotiated_shape_names_the_layout():
    runner = SimpleNamespace(config=_config(2), ctx=SimpleNamespace(micro_batch_size=2), p=SimpleNamespace(rank=0))
    with pytest.raises(RuntimeError) as err:
        _Runner._check_negotiated(runner, (2, 8, 16), "F0.0 produced")
    msg = str(err.value)
    assert "looks batch-first [b, s, h]" in msg and "micro_batch_size=2" in msg and "is [s, b, h]" in msg
    _Runner._check_negotiated(runner, (8, 2, 16), "F0.0 produced")  # [s, b, h]: fine
    _Runner._check_negotiated(runner, (2, 2, 16), "F0.0 produced")  # b == s: cannot be told apart


def test_interleaving_error_names_vp_none():
    from engine.schedules import forward_backward_pipelining_with_interleaving
    (chunk,) = split_gpt2(TinyGPT2(), _config(1), [0])
    with pytest.raises(TypeError, match=r"set virtual_pipeline_model_parallel_size=None \(any value but None, even "
                                        r"1, selects interleaving\)"):
        forward_backward_pipelining_with_interleaving(forward_step_func=None, data_iterator=None, model=chunk,
                                                      num_microbatches=2, seq_length=8, micro_batch_size=2)


# ---- on 2 gloo ranks ----------------------------------------------------------------------------------------------

def _loss_2(labels, logits):
    loss = F.cross_entropy(_logits(logits).flatten(0, 1).float(), labels.flatten())
    return loss, {"lm loss": loss.detach().clone()}  # a copy: the schedule divides the loss tensor in place


def _loss_3(labels, logits):
    loss = F.cross_entropy(_logits(logits).flatten(0, 1).float(), labels.flatten(), reduction="sum")
    n = torch.tensor(labels.numel(), dtype=torch.int)
    return loss, n, {"lm loss": loss.detach() / n}


def _step_func(three_tuple: bool):
    from functools import partial
    loss = _loss_3 if three_tuple else _loss_2

    def forward_step(data_iterator, model):
        ids, labels = next(data_iterator)
        return model(ids), partial(loss, labels)
    return forward_step


def _run(rank: int, case: dict) -> dict:
    """Train ``case["steps"]`` steps on this rank; per-step losses (last rank), final grads and state."""
    from engine.runtime.p2p import P2PCommunicator
    from engine.runtime.process_groups import build_process_groups
    from engine.schedules import get_forward_backward_func
    vp, variable = case["vp"], case["variable"]
    pgc = build_process_groups(2, vp, timeout=datetime.timedelta(seconds=case.get("pg_timeout", 30)))
    config = _config(2, vp, variable_seq_lengths=variable, deallocate_pipeline_outputs=True,
                     finalize_model_grads_func=finalize_model_grads if case["finalize"] else None)
    model = _model(case["model"])
    chunks = split_gpt2(model, config, looped_stages(rank, 2, vp or 1))
    optimizer = torch.optim.SGD(nn.ModuleList(chunks).parameters(), lr=0.1, momentum=0.9)
    schedule = get_forward_backward_func(2, vp)
    out = {"losses": [], "warnings": []}
    for step in range(case["steps"]):
        optimizer.zero_grad()
        data = _data(step, variable)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            losses = schedule(forward_step_func=_step_func(case["three_tuple"]),
                              data_iterator=[iter(data) for _ in chunks] if vp else iter(data),
                              model=chunks if vp else chunks[0], num_microbatches=M, seq_length=8,
                              micro_batch_size=B, p2p_communicator=P2PCommunicator(pgc.pp, config),
                              pg_collection=pgc)
        out["warnings"].append(sum("finalize_model_grads_func is None" in str(w.message) for w in seen))
        out["losses"].append([float(x["lm loss"]) for x in losses])
        out["grads"] = {n: p.grad.numpy().copy() for c in chunks for n, p in c.named_parameters(remove_duplicate=False)}
        optimizer.step()
    out["state"] = {k: v.numpy().copy() for c in chunks for k, v in c.state_dict().items()}  # numpy: pickled by value
    pgc.destroy()
    return out


def _batch_first_case(rank: int) -> str:
    """A stage that sends [b, s, h] under variable_seq_lengths (split without batch_first)."""
    from engine.runtime.p2p import P2PCommunicator
    from engine.runtime.process_groups import build_process_groups
    from engine.schedules import forward_backward_pipelining_without_interleaving
    pgc = build_process_groups(2, timeout=datetime.timedelta(seconds=3))
    config = _config(2, variable_seq_lengths=True, finalize_model_grads_func=finalize_model_grads)
    (chunk,) = split_model(_model(), layers="transformer.h", stages=[rank], config=config, embed=embed,
                           first=["transformer.wte", "transformer.wpe", "transformer.drop"],
                           last=["transformer.ln_f", "lm_head"])  # batch_first=False: [b, s, h] goes out as is
    try:
        forward_backward_pipelining_without_interleaving(
            forward_step_func=_step_func(False), data_iterator=iter(_data(0, False)), model=chunk,
            num_microbatches=M, seq_length=8, micro_batch_size=B, p2p_communicator=P2PCommunicator(pgc.pp, config),
            pg_collection=pgc)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _job(rank: int, world: int, cases: list) -> list:
    return [_batch_first_case(rank) if case == "batch_first" else _run(rank, case) for case in cases]


def _reference(case: dict) -> dict:
    """The unsplit model in this process, same data, loss normalisation and optimizer."""
    model = _model(case["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"losses": []}
    for step in range(case["steps"]):
        optimizer.zero_grad()
        losses = []
        for ids, labels in _data(step, case["variable"]):
            loss = F.cross_entropy(_logits(model(ids)).flatten(0, 1), labels.flatten())
            (loss / M).backward()
            losses.append(float(loss.detach()))
        out["losses"].append(losses)
        out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        optimizer.step()
    out["model"] = model
    return out


def _max_diffs(got: dict, want: dict) -> tuple[float, float]:
    """(max abs diff, max relative diff = |got - want|_inf / |want|_inf) over the named tensors of ``got``."""
    abs_diff = max(float((got[n] - want[n]).abs().max()) for n in got)
    rel_diff = max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)) for n in got)
    return abs_diff, rel_diff


def _check_equal(case: dict, ranks: list, ref: dict) -> dict:
    losses = ranks[1]["losses"]
    assert ranks[0]["losses"] == [[]] * case["steps"]
    loss_diff = max(abs(a - b) for got, want in zip(losses, ref["losses"]) for a, b in zip(got, want))
    assert [len(x) for x in losses] == [M] * case["steps"] and loss_diff < 1e-5, (losses, ref["losses"])
    grads = {n: torch.from_numpy(g) for r in ranks for n, g in r["grads"].items()}
    assert set(grads) == set(ref["grads"])  # both names of the tied weight: wte on rank 0, lm_head on rank 1
    grad_abs, grad_rel = _max_diffs(grads, ref["grads"])
    assert grad_rel < 1e-4, (grad_abs, grad_rel)
    unsplit = _model(case["model"])
    merged = {k: torch.from_numpy(v) for r in ranks for k, v in r["state"].items()}
    unsplit.load_state_dict(merged, strict=True)  # the chunks' names are a checkpoint of the unsplit model
    want = dict(ref["model"].state_dict())
    weight_abs, weight_rel = _max_diffs(dict(unsplit.state_dict()), want)
    assert weight_rel < 1e-4, (weight_abs, weight_rel)
    return {"loss_abs": loss_diff, "grad_abs": grad_abs, "grad_rel": grad_rel, "weight_abs": weight_abs,
            "weight_rel": weight_rel}


CASES = {
    "1f1b": dict(vp=None, variable=False, three_tuple=False, finalize=True, steps=STEPS, model="tiny"),
    "interleaved": dict(vp=2, variable=True, three_tuple=True, finalize=True, steps=STEPS, model="tiny"),
}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_split_model_trains_like_the_unsplit_model_on_two_ranks():
    no_finalize = dict(CASES["1f1b"], finalize=False, steps=2)
    results = run_ranks(_job, 2, [CASES["1f1b"], CASES["interleaved"], no_finalize, "batch_first"], timeout=110)
    for i, name in enumerate(CASES):
        figures = _check_equal(CASES[name], [r[i] for r in results], _reference(CASES[name]))
        print(name, figures)
    # without finalize_model_grads_func: one warning on the first step, on both ranks holding the tied weight...
    assert [r[2]["warnings"] for r in results] == [[1, 0], [1, 0]]
    # ...and the tied weight's gradient is really wrong (each stage only has its own part of it)
    ref = _reference(dict(no_finalize, steps=1))
    first = torch.from_numpy(results[0][2]["grads"]["transformer.wte.weight"])
    assert (first - ref["grads"]["transformer.wte.weight"]).abs().max() > 1e-3
    # a batch-first output under variable_seq_lengths: the sender names the layout and the fix
    sender = results[0][3]
    assert "looks batch-first [b, s, h] (dimension 0 is micro_batch_size=2)" in sender and "[s, b, h]" in sender
    assert results[1][3] != "ok"  # the receiver stops too (its peer failed)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gpt2_lm_head_model_from_transformers():
    pytest.importorskip("transformers", reason="optional dependency transformers is not installed")
    case = dict(CASES["1f1b"], model="gpt2", variable=True)
    results = run_ranks(_job, 2, [case], timeout=110)
    _check_equal(case, [r[0] for r in results], _reference(case))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_example_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "tests/examples/byom_example.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in proc.stdout.splitlines() if "loss" in line]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.2, proc.stdout  # it learns to count
