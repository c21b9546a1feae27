"""Graphs inside the real pipeline: Megatron schedule functions + executor on gloo ranks, emulate backend.

One spawn per world size runs several cases and several training steps each.  Per case and rank, two copies of the
same model train side by side: eager, and with :class:`graphs.runtime.GraphRuntime` (backend ``emulate``,
``warmup_steps=1``: step 0 records, graphs from step 1 on).  Checked on the parent:

* the recorded passes of the executor equal the capture order (``capture_order``) and, for interleaved ranks,
  ``convert_schedule_table_to_order``;
* losses and parameter gradients of the graphed copy are bitwise equal to eager on every step;
* graphs were active from step 1 with per-(chunk, microbatch, layer) graphs;
* a change of the microbatch count triggers a recapture (one more recorded step), not a wrap-around.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks

H, S, MBS = 8, 4, 2


class Block(nn.Module):
    def __init__(self, g: torch.Generator):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H)
        with torch.no_grad():
            for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.current_microbatch = None

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class Chunk(nn.Module):
    """Megatron-style chunk: ``.decoder.layers`` (so ``set_current_microbatch`` reaches the layers)."""

    def __init__(self, config, stage: int, num_stages: int, layers: int, seed: int = 0):
        super().__init__()
        self.config = config
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.decoder = Decoder([Block(torch.Generator().manual_seed(seed * 1000 + stage * 10 + i))
                                for i in range(layers)])
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0] if isinstance(tensors, (list, tuple)) else tensors

    def forward(self, item):
        x = item["x"] if self.is_first else self.input_tensor
        for layer in self.decoder.layers:
            x = layer(x)
        return x


def _forward_step(data_iterator, model):
    item = next(data_iterator)

    def loss_func(output):
        loss = ((output.float() - item["target"]) ** 2).mean()
        return loss, {"loss": loss.detach().clone()}

    return model(item), loss_func


def _data(M: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + M)
    return [{"x": torch.randn(S, MBS, H, generator=g), "target": torch.randn(S, MBS, H, generator=g)}
            for _ in range(M)]


def _job(rank, world, cases):
    from graphs.backends import get_backend
    from engine import schedules
    from engine.model_parallel_config import ModelParallelConfig
    from engine.plan import build_plan
    from engine.runtime.process_groups import build_process_groups
    from engine.plan.table import convert_schedule_table_to_order, get_schedule_table, pp_rank_microbatches
    from graphs import capture_order
    from graphs.runtime import GraphRuntime

    pgc = build_process_groups(world)
    out = []
    for case in cases:
        C, G, Ms, layers = case["chunks"], case.get("G"), case["M"], case.get("layers", 2)
        schedule = "interleaved" if C > 1 else "1f1b"
        cfg = ModelParallelConfig(pipeline_model_parallel_size=world,
                                  virtual_pipeline_model_parallel_size=C if C > 1 else None,
                                  pipeline_dtype=torch.float32, hidden_size=H, microbatch_group_size_per_vp_stage=G,
                                  deallocate_pipeline_outputs=case.get("dealloc", False))
        comm = schedules.P2PCommunicator(pgc.pp, cfg)
        func = schedules.get_forward_backward_func(world, C if C > 1 else None)
        copies = {name: [Chunk(cfg, c * world + rank, world * C, layers) for c in range(C)]
                  for name in ("eager", "graphed")}
        runtime = GraphRuntime(copies["graphed"], schedule, world, rank, C, G, backend="emulate", warmup_steps=1)
        emulate_backend = get_backend("emulate")
        if case.get("fail_rank") == rank:  # a capture error on one rank only: every rank must fall back
            def boom(*args, **kwargs):  # the root error, then the one a failed capture_end() raises over it
                try:
                    raise RuntimeError("injected capture failure")
                except RuntimeError:  # the implicit context is what a failed capture_end() leaves
                    raise RuntimeError("operation failed due to a previous error during capture")  # noqa: B904
            emulate_backend.capture = boom  # an instance attribute over the method, removed below
        res = {"rank": rank, "case": case, "steps": [], "recorded": None}
        for step, M in enumerate(Ms):
            data = _data(M, step)
            step_out = {}
            for name, chunks in copies.items():
                if name == "graphed":
                    runtime.before_step(M)
                store = func(forward_step_func=_forward_step, data_iterator=[iter(data) for _ in range(C)],
                             model=chunks if C > 1 else chunks[0], num_microbatches=M, seq_length=S,
                             micro_batch_size=MBS, forward_only=False, p2p_communicator=comm, pg_collection=pgc)
                grads = [p.grad.clone() for ch in chunks for p in ch.parameters()]
                step_out[name] = ([s["loss"] for s in store], grads)
                with torch.no_grad():
                    for ch in chunks:
                        for p in ch.parameters():
                            p.add_(p.grad, alpha=-0.01)
                            p.grad = None
            (le, ge), (lg, gg) = step_out["eager"], step_out["graphed"]
            res["steps"].append({
                "M": M, "active": runtime.active,
                "graphs": runtime.layers.report.num_graphs if runtime.layers.report else 0,
                "finite": all(bool(torch.isfinite(x).all()) for x in [*le, *ge]),
                "losses_equal": len(le) == len(lg) and all(torch.equal(a, b) for a, b in zip(le, lg)),
                "grads_equal": all(torch.equal(a, b) for a, b in zip(ge, gg)),
                "at_boundary": runtime.layers.guard.at_step_boundary,
            })
            if runtime.last_recording is not None and res["recorded"] is None:
                plan = build_plan(schedule, world, M, C, G)
                rec = runtime.last_recording
                res["recorded"] = rec.chunk_order()
                res["capture_order"] = capture_order(plan, rank)
                res["passes_ok"] = rec.microbatch_passes() == [(a.op.value, a.chunk, a.microbatch)
                                                                for a in plan.actions[rank]]
                if C > 1:
                    w = pp_rank_microbatches(M, C, G or world, world, rank, C).num_warmup_microbatches
                    res["megatron_order"] = convert_schedule_table_to_order(w, C, get_schedule_table(M, C, G or world))
        res["backend"] = runtime.layers.report.backend
        res["reason"] = runtime.layers.report.reason
        vars(emulate_backend).pop("capture", None)
        runtime.close()
        out.append(res)
    return out


def _check(results, world):
    for per_rank in zip(*results):
        for res in per_rank:
            case = res["case"]
            steps = res["steps"]
            if case.get("fail_rank") is not None:  # collective fallback: eager everywhere, same numbers
                assert res["backend"] == "eager", res  # every rank: the failing rank and the root error
                assert res["reason"].startswith(f"rank {case['fail_rank']}: capture error: RuntimeError: injected "
                                                f"capture failure (then RuntimeError: operation failed"), res
                assert not any(s["active"] for s in steps)
                assert all(s["finite"] and s["losses_equal"] and s["grads_equal"] for s in steps)
                continue
            assert res["backend"] == "emulate", res
            assert res["recorded"] == res["capture_order"], (case, res["rank"])
            assert res["passes_ok"], (case, res["rank"])
            if case["chunks"] > 1:
                assert res["recorded"] == res["megatron_order"], (case, res["rank"])
            steps = res["steps"]
            assert not steps[0]["active"] and steps[1]["active"], steps
            for s in steps:
                assert s["finite"] and s["losses_equal"] and s["grads_equal"], (case, res["rank"], steps)
                assert s["at_boundary"]
            assert steps[1]["graphs"] == case["chunks"] * case.get("layers", 2) * case["M"][1]
            # a new microbatch count: one eager (recording) step, then graphs again, recaptured for the new count
            for prev, cur, nxt in zip(steps, steps[1:], steps[2:]):
                if cur["M"] != prev["M"]:
                    assert not cur["active"] and nxt["active"], steps
                    assert nxt["graphs"] == case["chunks"] * case.get("layers", 2) * cur["M"], steps


@pytest.mark.timeout(120)
def test_emulated_graphs_in_pipeline_pp2_vp2_bitwise_equal_eager():
    cases = [dict(chunks=2, G=2, M=[4, 4, 4, 6, 6]),
             dict(chunks=2, G=3, M=[5, 5, 5], layers=1, dealloc=True),
             dict(chunks=1, M=[3, 3, 3]), dict(chunks=2, G=2, M=[2, 2], layers=1, fail_rank=1)]
    _check(run_ranks(_job, 2, cases, timeout=110), 2)


@pytest.mark.timeout(150)
def test_emulated_graphs_in_pipeline_pp4_bitwise_equal_eager():
    cases = [dict(chunks=1, M=[4, 4, 4], layers=2), dict(chunks=2, G=4, M=[4, 4, 4], layers=1)]
    _check(run_ranks(_job, 4, cases, timeout=140), 4)
