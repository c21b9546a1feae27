"""DualPipeV's plan: torch 2.13's ScheduleDualPipeV order (compared cell by cell with torch's own order generator),
validated, simulated, and its invariants over a grid of pipeline sizes and microbatch counts."""
from __future__ import annotations

import pytest

from engine.plan import build_plan, get_schedule
from engine.plan.candidates import candidates
from engine.plan.simulate import simulate
from engine.plan.torch_csv import plan_from_csv, plan_to_csv
from engine.plan.types import Compound, Op
from engine.plan.validate import validate_plan, validate_programs
from graphs.order import capture_order

GRID = [(P, M) for P in (1, 2, 3, 4) for M in (2 * P, 2 * P + 1, 2 * P + 3)]


def _torch_orders(P: int, M: int) -> list[list[str]]:
    """Per rank, torch's ScheduleDualPipeV cells written in pipecast's notation: stage ``r`` is chunk 0 of rank
    ``r``, stage ``2P-1-r`` its chunk 1; ``I`` is ``B``, a full ``B`` is ``B`` then its ``W`` (two cells), an
    ``OVERLAP_F_B`` cell its sub-actions joined by ``+`` (one cell)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    from tests.helpers.torch_schedules import _StageStub
    stages = [_StageStub(s, 2 * P, P, 0) for s in (0, 2 * P - 1)]  # rank 0's stages; torch builds every rank's order
    order = torch_schedules.ScheduleDualPipeV(stages, M, loss_fn=lambda output, target: output).pipeline_order

    def parts(a, r):
        chunk = 0 if a.stage_index == r else 1
        assert a.stage_index == (r if chunk == 0 else 2 * P - 1 - r)
        kind = a.computation_type.value
        ops = {"F": "F", "I": "B", "W": "W", "B": "BW"}[kind]
        return [f"{op}{a.microbatch_index}.{chunk}" for op in ops]

    out = []
    for r in range(P):
        cells = []
        for a in order[r]:
            if a is None:
                continue
            if a.sub_actions is None:
                cells += parts(a, r)  # a full backward outside a compound is two cells, B then W
            else:
                cells.append("+".join(p for s in a.sub_actions for p in parts(s, r)))
        out.append(cells)
    return out


def test_plan_equals_torchs_dualpipev_order():
    for P, M in GRID:
        plan = build_plan("dualpipev", P, M, 2)
        want = _torch_orders(P, M)
        for r in range(P):
            assert plan.cell_labels(r) == want[r], (P, M, r)


@pytest.mark.parametrize("P,M", GRID)
def test_plan_validates_simulates_and_keeps_its_invariants(P, M):
    plan = build_plan("dualpipev", P, M, 2)
    validate_plan(plan)
    assert plan.stage_map == tuple((s, 0) if s < P else (2 * P - 1 - s, 1) for s in range(2 * P))
    assert plan.splits_backward and get_schedule("dualpipev").splits_backward
    for r in range(P):
        cells = plan.cells(r)
        compounds = [c for c in cells if isinstance(c, Compound)]
        # steady phase: every compound overlaps a forward of one chunk with a full backward of the other
        for c in compounds:
            f, b, w = c.parts
            assert (f.op, b.op, w.op) == (Op.FORWARD, Op.BACKWARD, Op.WEIGHT) and f.chunk != b.chunk, (P, M, r, c)
            assert (w.chunk, w.microbatch) == (b.chunk, b.microbatch)
        steady = M - 2 * P + r + 1
        assert len(compounds) == 2 * steady - (r == P - 1) + (P - 1 - r), (P, M, r)
        for chunk in (0, 1):  # F, B and W of a chunk each in microbatch order (gradients summed in that order)
            for op in Op:
                mbs = [a.microbatch for a in plan.actions[r] if a.op is op and a.chunk == chunk]
                assert mbs == list(range(M)), (P, M, r, op, chunk)
        assert capture_order(plan, r)  # CUDA-graph capture runs the compounds' parts in order
    sim = simulate(plan, forward_time=1.0, backward_time=1.0, weight_time=1.0)
    assert sim.makespan >= 3 * 2 * M  # each rank computes 2 chunks x M x (F + B + W)
    for prefetch in (1, 2):
        for batched in (True, False):
            validate_programs(plan, prefetch=prefetch, batched=batched)
    assert plan_from_csv(plan_to_csv(plan), name="dualpipev") == plan
    for m in (1, M):  # evaluation and sampling plans take any microbatch count
        fwd = build_plan("dualpipev", P, m, 2, forward_only=True)
        validate_plan(fwd)
        assert all(a.op is Op.FORWARD for acts in fwd.actions for a in acts) and fwd.compounds is None
        assert all(len(acts) == 2 * m for acts in fwd.actions)


def test_sizes_dualpipev_does_not_take_are_refused():
    with pytest.raises(ValueError, match=r"num_microbatches >= 2 \* pp_size = 8.*num_microbatches=7"):
        build_plan("dualpipev", 4, 7, 2)
    with pytest.raises(ValueError, match="two model chunks"):
        build_plan("dualpipev", 2, 4, 1)
    names = {c.schedule for c in candidates(2, 4, 4)}
    assert "dualpipev" in names
    assert "dualpipev" not in {c.schedule for c in candidates(2, 4, 3)}


def test_the_default_config_runs_dualpipev_with_sampling():
    # evaluation and sampling build one-microbatch forward-only plans: they must not need M >= 2P
    from engine.training.config import load_config
    config = load_config("configs/default.yaml", ["parallel.schedule=dualpipev"])
    assert config.logging.sample_every_eval > 0 and config.parallel.schedule == "dualpipev"
