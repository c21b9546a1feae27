"""The one global-norm gradient clip (``engine.training.parallel.grad_norm.clip_grad_norm_``) over every form of
gradient a layout gives, on 4 gloo ranks (pipeline 2 x tensor 2), against the norm and the clipped gradients of
the full tensors computed here in float64.

Each pipeline stage holds six gradients (seeded per stage); the last stage's ``tied`` is a copy of the first
stage's (its value is the first stage's, left out of the norm, clipped all the same).  Every rank clips them in
three forms:

* ``dtensor``: tensor parallel -- ``Shard(0)``, ``_StridedShard(0, split_factor=3)`` (gpt2's fused qkv),
  ``Shard(1)`` and ``Replicate`` DTensors on the ``tp`` mesh beside plain replicated tensors;
* ``pieces``: ZeRO-1 -- the stage's gradients flattened into one buffer, padded, split over the tensor-parallel
  group as the shard group, each rank clipping the pieces of its half;
* ``plain``: whole replicated tensors (``shard: none``);

plus ``max_norm = 0`` (norm only, nothing scaled).  The norm is returned as a 0-dim fp32 tensor (no host read).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_ranks

SHAPES = {"w": (8, 4), "qkv": (6, 4), "row": (4, 6), "norm": (4,), "rep": (4,), "tied": (5, 4)}
MAX_NORM = 1.0


def _full(stage: int) -> dict[str, torch.Tensor]:
    """The full fp32 gradients of ``stage``; the last stage's ``tied`` equals the first stage's."""
    g = torch.Generator().manual_seed(100 + stage)
    grads = {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}
    if stage == 1:
        grads["tied"] = _full(0)["tied"]
    return grads


def _placements():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    return {"w": Shard(0), "qkv": _StridedShard(0, split_factor=3), "row": Shard(1), "rep": Replicate()}


def _dtensor_case(full, counted, pg, mesh) -> dict:
    from torch.distributed.tensor import distribute_tensor

    from engine.training.parallel.grad_norm import clip_grad_norm_
    placements = _placements()
    grads = {n: distribute_tensor(t.clone(), mesh, [placements[n]], src_data_rank=None) if n in placements
             else t.clone() for n, t in full.items()}
    norm = clip_grad_norm_(list(grads.values()), MAX_NORM, pipeline_group=pg.pp, counted=counted)
    return {"norm": norm, "grads": {n: (g.full_tensor() if n in placements else g).numpy() for n, g in grads.items()}}


def _pieces_case(full, counted, pg, tp_rank: int) -> dict:
    from engine.training.parallel.grad_norm import clip_grad_norm_
    flat = torch.cat([t.reshape(-1) for t in full.values()])
    size = -(-flat.numel() // 2)
    shard = torch.cat([flat, flat.new_zeros(2 * size - flat.numel())])[tp_rank * size:(tp_rank + 1) * size].clone()
    pieces, piece_counted, offset = [], [], 0
    for (name, t), c in zip(full.items(), counted):
        lo, hi = max(offset, tp_rank * size), min(offset + t.numel(), (tp_rank + 1) * size)
        if lo < hi:
            pieces.append(shard[lo - tp_rank * size:hi - tp_rank * size])
            piece_counted.append(c)
        offset += t.numel()
    norm = clip_grad_norm_(pieces, MAX_NORM, pipeline_group=pg.pp, counted=piece_counted, shard_group=pg.tp)
    return {"norm": norm, "shard": shard.numpy()}


def _job(rank: int, world: int) -> dict:
    from engine.runtime.process_groups import build_process_groups, device_mesh
    from engine.training.parallel.grad_norm import clip_grad_norm_
    pg = build_process_groups(2, tensor_model_parallel_size=2)
    stage, tp_rank = pg.pipeline_model_parallel_rank, pg.tensor_model_parallel_rank
    full = _full(stage)
    counted = [not (stage == 1 and name == "tied") for name in full]
    out = {"stage": stage, "tp_rank": tp_rank,
           "dtensor": _dtensor_case(full, counted, pg, device_mesh(pg)["tp"]),
           "pieces": _pieces_case(full, counted, pg, tp_rank)}
    # ZeRO-1-like pieces split so that the last stage's tp rank 1 holds only the tied copy (no counted piece): it
    # must still join the shard group's reduction (it skipped it, and the ranks hung / aborted)
    lopsided = [t.clone() for n, t in full.items() if (n == "tied") == (tp_rank == 1)]
    out["lopsided"] = {"norm": clip_grad_norm_(lopsided, MAX_NORM, pipeline_group=pg.pp, shard_group=pg.tp,
                                               counted=[c for n, c in zip(full, counted)
                                                        if (n == "tied") == (tp_rank == 1)])}
    plain = {n: t.clone() for n, t in full.items()}
    out["plain"] = {"norm": clip_grad_norm_(list(plain.values()), MAX_NORM, pipeline_group=pg.pp, counted=counted),
                    "grads": {n: g.numpy() for n, g in plain.items()}}
    untouched = {n: t.clone() for n, t in full.items()}
    out["no_clip"] = {"norm": clip_grad_norm_(list(untouched.values()), 0.0, pipeline_group=pg.pp, counted=counted),
                      "unchanged": all(torch.equal(untouched[n], full[n]) for n in full)}
    for case in ("dtensor", "pieces", "lopsided", "plain", "no_clip"):
        norm = out[case]["norm"]
        out[case]["norm"] = (float(norm), isinstance(norm, torch.Tensor) and norm.dim() == 0, norm.dtype)
    pg.destroy()
    return out


def _reference() -> tuple[float, dict]:
    """float64: the norm over both stages (the copy left out) and each stage's clipped gradients."""
    stages = {s: {n: t.double() for n, t in _full(s).items()} for s in (0, 1)}
    total = math.sqrt(sum(float((t ** 2).sum()) for s, grads in stages.items() for n, t in grads.items()
                          if not (s == 1 and n == "tied")))
    coef = min(1.0, MAX_NORM / (total + 1e-6))
    return total, {s: {n: (t * coef).numpy() for n, t in grads.items()} for s, grads in stages.items()}


@pytest.mark.timeout(240)
def test_one_clip_for_dtensor_sharded_and_plain_gradients():
    norm, clipped = _reference()
    assert norm > 2 * MAX_NORM  # the clip scales
    for r in run_ranks(_job, 4, timeout=200):
        where = f"stage {r['stage']} tp rank {r['tp_rank']}"
        for case in ("dtensor", "pieces", "lopsided", "plain", "no_clip"):
            value, is_tensor, dtype = r[case]["norm"]
            assert is_tensor and dtype == torch.float32, (where, case)
            assert value == pytest.approx(norm, rel=1e-6), (where, case)
        want = clipped[r["stage"]]
        for case in ("dtensor", "plain"):
            for name, got in r[case]["grads"].items():
                np.testing.assert_allclose(got, want[name], rtol=1e-6, atol=1e-7, err_msg=f"{where} {case} {name}")
        flat = np.concatenate([want[n].reshape(-1) for n in SHAPES])
        size = -(-flat.size // 2)
        mine = np.concatenate([flat, np.zeros(2 * size - flat.size)])[r["tp_rank"] * size:(r["tp_rank"] + 1) * size]
        np.testing.assert_allclose(r["pieces"]["shard"], mine, rtol=1e-6, atol=1e-7, err_msg=f"{where} pieces")
        assert r["no_clip"]["unchanged"], where
