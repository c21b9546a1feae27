"""Process groups, the ``parallel_state`` facade and ``ModelParallelConfig``.

One 4-rank gloo job (spawned once per module) runs every multi-process scenario in sequence -- world 4 with
pp 2 (dp 2), world 4 with pp 4 and VP 2, rejected sizes, an initialise/destroy cycle -- and returns what each rank
observed; the tests below assert on those observations.  Group membership is checked with real all-reduces.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.model_parallel_config import ModelParallelConfig
from engine.runtime.process_groups import build_process_groups, rank_layout

try:
    from tests.helpers.distributed import run_ranks
except ImportError:  # tests/ itself on sys.path (pytest's default "prepend" import mode)
    from distributed import run_ranks

WORLD = 4


def _members(group) -> int:
    """Sum of the global ranks in ``group`` (an all-reduce: proves the group is real and who is in it)."""
    if group is None:
        return -1
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t, group=group)
    return int(t.item())


def _observe():
    pg = ps.get_pg_collection()
    return {
        "pp_rank": ps.get_pipeline_model_parallel_rank(), "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size(),
        "pp_ranks": pg.pp_ranks, "dp_ranks": pg.dp_ranks, "embd_ranks": pg.embd_ranks,
        "first": ps.is_pipeline_first_stage(), "last": ps.is_pipeline_last_stage(),
        "next": ps.get_pipeline_model_parallel_next_rank(), "prev": ps.get_pipeline_model_parallel_prev_rank(),
        "pp_sum": _members(ps.get_pipeline_model_parallel_group()),
        "dp_sum": _members(ps.get_data_parallel_group()),
        "dp_cp_sum": _members(ps.get_data_parallel_group(with_context_parallel=True)),
        "embd_sum": _members(ps.get_embedding_group()),
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "cp": (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        "tp_sum": _members(ps.get_tensor_model_parallel_group()),
        "vp": (ps.get_virtual_pipeline_model_parallel_rank(), ps.get_virtual_pipeline_model_parallel_world_size()),
    }


def _observe_tp():
    pg, mesh = ps.get_pg_collection(), ps.get_device_mesh("cpu")
    return {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
               ps.get_tensor_model_parallel_src_rank()),
        "tp_cp": (ps.get_tensor_and_context_parallel_rank(), ps.get_tensor_and_context_parallel_world_size()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(), pg.pp_ranks),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), pg.dp_ranks,
               ps.get_data_parallel_src_rank()),
        "mp": (ps.get_model_parallel_rank(), ps.get_model_parallel_world_size()),
        "embd_ranks": pg.embd_ranks, "next": ps.get_pipeline_model_parallel_next_rank(),
        "sums": {name: _members(group) for name, group in (
            ("tp", ps.get_tensor_model_parallel_group()), ("tp_cp", ps.get_tensor_and_context_parallel_group()),
            ("pp", ps.get_pipeline_model_parallel_group()), ("dp", ps.get_data_parallel_group()),
            ("mp", ps.get_model_parallel_group()), ("embd", ps.get_embedding_group()))},
        "mesh": (mesh.mesh_dim_names, tuple(mesh.mesh.shape), mesh.mesh.tolist()),
        "mesh_sums": {d: _members(mesh.get_group(d)) for d in ("pp", "dp", "tp")},
        "mesh_is_pg": (mesh.get_group("tp") is pg.tp, mesh.get_group("pp") is pg.pp, mesh.get_group("dp") is pg.dp),
    }


def _observe_ep():
    """Every expert getter, and each expert group's members (an all-reduce of the global ranks)."""
    pg = ps.get_pg_collection()
    return {
        "ep": (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
               ps.get_expert_model_parallel_src_rank(), pg.ep_ranks),
        "etp": (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(), pg.expt_tp_ranks),
        "tp_ep": (ps.get_expert_tensor_and_model_parallel_rank(),
                  ps.get_expert_tensor_and_model_parallel_world_size(), pg.tp_ep_ranks),
        "edp": (ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size(), pg.expt_dp_ranks),
        "sums": {name: _members(group) for name, group in (
            ("ep", ps.get_expert_model_parallel_group()), ("etp", ps.get_expert_tensor_parallel_group()),
            ("tp_ep", ps.get_expert_tensor_and_model_parallel_group()),
            ("tp_ep_pp", ps.get_expert_tensor_model_pipeline_parallel_group()),
            ("edp", ps.get_expert_data_parallel_group()), ("dp", ps.get_data_parallel_group()),
            ("pp", ps.get_pipeline_model_parallel_group()))},
        "partial": _error(lambda: ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)),
    }


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


def _scenarios(rank, world_size):
    out = {}
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    out["pp2"] = _observe()
    out["twice"] = _error(lambda: ps.initialize_model_parallel(pipeline_model_parallel_size=2))
    ps.destroy_model_parallel()
    out["after_destroy"] = (ps.model_parallel_is_initialized(), ps.get_pipeline_model_parallel_world_size(),
                            _error(ps.get_pipeline_model_parallel_group))

    ps.initialize_model_parallel(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    out["pp4"] = _observe()
    out["pp4_vp_preds"] = (ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0),
                           ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1),
                           ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0),
                           ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1),
                           _error(lambda: ps.is_pipeline_last_stage(ignore_virtual=False)))
    ps.destroy_model_parallel()

    for pp, tp in ((2, 2), (1, 2)):  # Megatron's order with tensor parallelism, and the DeviceMesh over it
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        out[f"pp{pp}_tp{tp}"] = _observe_tp()
        ps.destroy_model_parallel()

    for pp, tp, ep, etp in ((2, 1, 2, None), (1, 2, 2, 1)):  # Megatron's expert generator, taken from dp ranks
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        out[f"pp{pp}_tp{tp}_ep{ep}_etp{etp}"] = _observe_ep()
        ps.destroy_model_parallel()

    # rejected on every rank before any collective: the world still works afterwards and nothing is initialised
    out["errors"] = {
        "pp3": _error(lambda: ps.initialize_model_parallel(pipeline_model_parallel_size=3)),
        "pp0": _error(lambda: ps.initialize_model_parallel(pipeline_model_parallel_size=0)),
        "pp8": _error(lambda: ps.initialize_model_parallel(pipeline_model_parallel_size=8)),
        "tp3": _error(lambda: ps.initialize_model_parallel(tensor_model_parallel_size=3)),
        "pp2_tp4": _error(lambda: ps.initialize_model_parallel(tensor_model_parallel_size=4,
                                                               pipeline_model_parallel_size=2)),
        "cp2": _error(lambda: ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)),
        "ep3": _error(lambda: ps.initialize_model_parallel(expert_model_parallel_size=3)),
        "pp2_ep4": _error(lambda: ps.initialize_model_parallel(pipeline_model_parallel_size=2,
                                                               expert_model_parallel_size=4)),
        "vp0": _error(lambda: ps.initialize_model_parallel(pipeline_model_parallel_size=2,
                                                           virtual_pipeline_model_parallel_size=0)),
        "world": _error(lambda: build_process_groups(2, world_size=8)),
    }
    out["still_uninitialised"] = ps.model_parallel_is_initialized()
    out["world_sum"] = _members(dist.group.WORLD)

    # an explicit collection, no global state involved; then a cycle through the facade again
    pg = build_process_groups(1)
    out["explicit_pp1"] = (pg.pp_ranks, pg.dp_ranks, pg.embd_ranks, _members(pg.dp), _members(pg.embd))
    pg.destroy()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    out["cycle"] = _members(ps.get_pipeline_model_parallel_group())
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def observed():
    return run_ranks(_scenarios, WORLD, timeout=60)


@pytest.mark.timeout(90)
def test_pp2_layout(observed):
    # global rank = pp_rank * dp + dp_rank: pipelines {0, 2} and {1, 3}, data-parallel blocks {0, 1} and {2, 3}
    for rank, o in enumerate(observed):
        o = o["pp2"]
        pipeline = (rank % 2, rank % 2 + 2)
        assert (o["pp_rank"], o["pp_size"], o["dp_rank"], o["dp_size"]) == (rank // 2, 2, rank % 2, 2)
        assert o["pp_ranks"] == pipeline and o["dp_ranks"] == (rank // 2 * 2, rank // 2 * 2 + 1)
        assert o["embd_ranks"] == pipeline and o["embd_sum"] == sum(pipeline)
        assert o["pp_sum"] == sum(pipeline) and o["dp_sum"] == o["dp_cp_sum"] == sum(o["dp_ranks"])
        assert (o["first"], o["last"]) == (rank < 2, rank >= 2)
        assert o["next"] == o["prev"] == pipeline[1 - rank // 2]
        assert o["tp"] == o["cp"] == (0, 1) and o["tp_sum"] == rank
        assert o["vp"] == (None, None)


def _megatron_groups(world, pp, tp):
    """Megatron's order ``tp-cp-ep-dp-pp`` (tp fastest) written as a mesh: rank = index in arange(world) viewed as
    ``[pp, dp, tp]``; a group of one kind varies one mesh coordinate (two for model parallel: pp and tp)."""
    dp = world // (pp * tp)
    mesh = torch.arange(world).reshape(pp, dp, tp)
    groups = {"tp": [], "dp": [], "pp": [], "mp": []}
    for r in range(world):
        s, d, t = (int(i) for i in (mesh == r).nonzero()[0])
        groups["tp"].append(tuple(mesh[s, d, :].tolist()))
        groups["dp"].append(tuple(mesh[s, :, t].tolist()))
        groups["pp"].append(tuple(mesh[:, d, t].tolist()))
        groups["mp"].append(tuple(sorted(mesh[:, d, :].reshape(-1).tolist())))
    return mesh.tolist(), groups


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pp, tp", [(2, 2), (1, 2)])
def test_tensor_parallel_layout_follows_megatron_order(observed, pp, tp):
    mesh, groups = _megatron_groups(WORLD, pp, tp)
    dp = WORLD // (pp * tp)
    for rank, o in enumerate(observed):
        o = o[f"pp{pp}_tp{tp}"]
        tp_group, dp_group, pipeline = groups["tp"][rank], groups["dp"][rank], groups["pp"][rank]
        assert o["tp"] == (tp_group.index(rank), tp, tp_group[0]) and o["tp_cp"] == o["tp"][:2]
        assert o["pp"] == (pipeline.index(rank), pp, pipeline)
        assert o["dp"] == (dp_group.index(rank), dp, dp_group, dp_group[0])
        assert o["mp"] == (groups["mp"][rank].index(rank), pp * tp)
        # embedding group: first and last stage of this pipeline, i.e. of the same tensor-parallel rank
        assert o["embd_ranks"] == ((pipeline[0], pipeline[-1]) if pp > 1 else (pipeline[0],))
        assert o["next"] == pipeline[(pipeline.index(rank) + 1) % pp]
        assert o["sums"] == {"tp": sum(tp_group), "tp_cp": sum(tp_group), "pp": sum(pipeline), "dp": sum(dp_group),
                             "mp": sum(groups["mp"][rank]), "embd": sum(o["embd_ranks"])}
        assert o["mesh"] == (("pp", "dp", "tp"), (pp, dp, tp), mesh)
        assert o["mesh_sums"] == {"pp": sum(pipeline), "dp": sum(dp_group), "tp": sum(tp_group)}
        assert o["mesh_is_pg"] == (True, True, True)  # one rank map: the mesh wraps the collection's groups


@pytest.mark.parametrize("pp, tp, world", [(2, 2, 8), (1, 4, 8), (2, 1, 4), (2, 2, 4), (4, 2, 16)])
def test_rank_layout_with_tensor_parallel(pp, tp, world):
    _, groups = _megatron_groups(world, pp, tp)
    layout = rank_layout(pp, world, tp)
    for r in range(world):
        assert layout.tensor_group_of(r) == groups["tp"][r]
        assert layout.data_parallel_group_of(r) == groups["dp"][r]
        assert layout.pipeline_group_of(r) == groups["pp"][r]
        assert layout.model_parallel_group_of(r) == groups["mp"][r]
    for kind in ("tensor_groups", "data_parallel_groups", "pipeline_groups", "model_parallel_groups"):
        assert sorted(r for g in getattr(layout, kind) for r in g) == list(range(world))


def _megatron_expert_groups(world, pp, ep, etp):
    """Megatron's expert generator (order ``tp-cp-ep-dp-pp`` over etp, ep, edp, pp) written as a mesh: rank = index
    in arange(world) viewed as ``[pp, edp, ep, etp]``; each kind varies its own coordinates (etp fastest)."""
    edp = world // (pp * ep * etp)
    mesh = torch.arange(world).reshape(pp, edp, ep, etp)
    kinds = {"expert_groups": [], "expert_tensor_groups": [], "expert_tensor_and_model_groups": [],
             "expert_tensor_model_pipeline_groups": [], "expert_data_parallel_groups": []}
    for r in range(world):
        s, d, e, t = (int(i) for i in (mesh == r).nonzero()[0])
        kinds["expert_groups"].append(tuple(mesh[s, d, :, t].tolist()))
        kinds["expert_tensor_groups"].append(tuple(mesh[s, d, e, :].tolist()))
        kinds["expert_tensor_and_model_groups"].append(tuple(mesh[s, d].reshape(-1).tolist()))
        kinds["expert_tensor_model_pipeline_groups"].append(tuple(mesh[:, d].reshape(-1).tolist()))
        kinds["expert_data_parallel_groups"].append(tuple(mesh[s, :, e, t].tolist()))
    return kinds


EXPERT_LAYOUTS = [(world, pp, tp, ep, etp) for world, pp, tp in ((4, 1, 1), (8, 2, 1), (8, 2, 2), (16, 2, 2),
                                                                  (16, 4, 1), (8, 1, 4))
                  for ep in (1, 2, 4) for etp in (None, 1, 2)
                  if world % (pp * tp) == 0 and world % (pp * ep * (tp if etp is None else etp)) == 0]


@pytest.mark.parametrize("world, pp, tp, ep, etp", EXPERT_LAYOUTS)
def test_expert_layout_follows_megatron_expert_generator(world, pp, tp, ep, etp):
    layout = rank_layout(pp, world, tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    etp_size = tp if etp is None else etp
    ref = _megatron_expert_groups(world, pp, ep, etp_size)
    assert (layout.expert_model_parallel_size, layout.expert_tensor_parallel_size,
            layout.expert_data_parallel_size) == (ep, etp_size, world // (pp * ep * etp_size))
    for kind, per_rank in ref.items():
        for r in range(world):
            assert layout.group_of(kind, r) == per_rank[r], (kind, r)
        assert sorted(x for g in getattr(layout, kind) for x in g) == list(range(world)), kind  # a partition
    # Megatron asserts the pipelines of both generators agree; and with ep 1, etp = tp the expert kinds are the
    # dense ones (pipecast then creates no extra group)
    assert layout.expert_tensor_model_pipeline_groups == layout.model_parallel_groups or ep * etp_size != tp
    if ep == 1 and etp_size == tp:
        assert layout.expert_data_parallel_groups == layout.data_parallel_groups
        assert layout.expert_tensor_groups == layout.tensor_groups
    for r in range(world):
        s, _, _, _ = layout.expert_coordinates(r)
        assert s == layout.coordinates(r)[0]  # same pipeline stage in both layouts


@pytest.mark.parametrize("world, pp, tp, ep, etp", [(4, 1, 1, 3, None), (8, 2, 1, 8, None), (8, 1, 2, 4, 4),
                                                    (4, 2, 1, 4, 1)])
def test_expert_sizes_megatron_refuses(world, pp, tp, ep, etp):
    with pytest.raises(ValueError, match="expert_model_parallel_size") as err:
        rank_layout(pp, world, tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    assert "divisible" in str(err.value)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pp, tp, ep, etp", [(2, 1, 2, None), (1, 2, 2, 1)])
def test_expert_groups_on_ranks(observed, pp, tp, ep, etp):
    ref = _megatron_expert_groups(WORLD, pp, ep, tp if etp is None else etp)
    for rank, o in enumerate(observed):
        o = o[f"pp{pp}_tp{tp}_ep{ep}_etp{etp}"]
        ep_g, etp_g = ref["expert_groups"][rank], ref["expert_tensor_groups"][rank]
        tp_ep, edp = ref["expert_tensor_and_model_groups"][rank], ref["expert_data_parallel_groups"][rank]
        assert o["ep"] == (ep_g.index(rank), len(ep_g), ep_g[0], ep_g)
        assert o["etp"] == (etp_g.index(rank), len(etp_g), etp_g)
        assert o["tp_ep"] == (tp_ep.index(rank), len(tp_ep), tp_ep)
        assert o["edp"] == (edp.index(rank), len(edp), edp)
        sums = o["sums"]
        assert (sums["ep"], sums["etp"], sums["tp_ep"], sums["edp"]) == tuple(map(sum, (ep_g, etp_g, tp_ep, edp)))
        assert sums["tp_ep_pp"] == sum(ref["expert_tensor_model_pipeline_groups"][rank])
        assert o["partial"][0] == "ValueError" and "partial_expert_data_parallel" in o["partial"][1]
    if pp == 2:  # pp2 x ep2 on 4 ranks: the expert pair is the stage's data-parallel pair; no expert replicas
        assert [o[f"pp{pp}_tp{tp}_ep{ep}_etp{etp}"]["sums"]["ep"] for o in observed] == [1, 1, 5, 5]
        assert all(o["pp2_tp1_ep2_etpNone"]["edp"][1] == 1 for o in observed)


def test_expert_getters_before_initialisation():
    ps.destroy_model_parallel()
    assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (1, 0)
    assert (ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank()) == (1, 0)
    assert ps.get_expert_tensor_and_model_parallel_world_size() == 1
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_expert_model_parallel_group()
    assert ps.get_expert_data_parallel_group(check_initialized=False) is None
    ps.set_tensor_model_parallel_world_size(2)  # Megatron: the expert tensor size falls back to the tensor override
    ps.set_expert_model_parallel_world_size(4)
    ps.set_expert_model_parallel_rank(3)
    assert ps.get_expert_tensor_parallel_world_size() == 2
    assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (4, 3)
    ps.set_expert_tensor_parallel_world_size(1)
    assert ps.get_expert_tensor_parallel_world_size() == 1
    ps.destroy_model_parallel()
    assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()) == (1, 1)
    with pytest.warns(DeprecationWarning), pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_data_modulo_expert_parallel_group()


@pytest.mark.timeout(90)
def test_pp4_with_virtual_pipeline(observed):
    for rank, o in enumerate(observed):
        p = o["pp4"]
        assert (p["pp_rank"], p["pp_size"], p["dp_size"], p["dp_ranks"]) == (rank, 4, 1, (rank,))
        assert p["pp_ranks"] == (0, 1, 2, 3) and p["pp_sum"] == 6
        assert p["embd_ranks"] == ((0, 3) if rank in (0, 3) else ())
        assert p["embd_sum"] == (3 if rank in (0, 3) else -1)  # middle stages hold no embedding group
        assert (p["next"], p["prev"]) == ((rank + 1) % 4, (rank - 1) % 4)
        assert p["vp"] == (0, 2)
        first0, first1, last0, last1, err = o["pp4_vp_preds"]
        assert (first0, first1) == (rank == 0, False)
        assert (last0, last1) == (False, rank == 3)
        assert err[0] == "ValueError" and "vp_stage" in err[1]


@pytest.mark.timeout(90)
def test_invalid_sizes_rejected_on_every_rank_before_any_collective(observed):
    for o in observed:
        errors = o["errors"]
        assert errors["pp3"][0] == "ValueError" and "divisible" in errors["pp3"][1]
        assert errors["pp8"][0] == "ValueError" and "divisible" in errors["pp8"][1]
        assert errors["pp0"][0] == "ValueError" and "pipeline_model_parallel_size" in errors["pp0"][1]
        assert errors["tp3"][0] == "ValueError" and "tensor_model_parallel_size" in errors["tp3"][1]
        assert errors["pp2_tp4"][0] == "ValueError" and "divisible" in errors["pp2_tp4"][1]
        assert errors["cp2"][0] == "ValueError" and "not supported" in errors["cp2"][1]
        assert "context_parallel_size" in errors["cp2"][1]
        for name in ("ep3", "pp2_ep4"):  # Megatron: world_size % (etp * ep * pp) != 0
            assert errors[name][0] == "ValueError" and "expert_model_parallel_size" in errors[name][1]
            assert "divisible" in errors[name][1]
        assert errors["vp0"][0] == "ValueError"
        assert errors["world"][0] == "ValueError" and "world_size=8" in errors["world"][1]
        assert o["still_uninitialised"] is False and o["world_sum"] == 6  # no rank left inside a collective


@pytest.mark.timeout(90)
def test_initialize_destroy_cycle(observed):
    for rank, o in enumerate(observed):
        assert o["twice"][0] == "RuntimeError" and "destroy_model_parallel" in o["twice"][1]
        assert o["after_destroy"][:2] == (False, 1) and o["after_destroy"][2][0] == "RuntimeError"
        assert o["cycle"] == (0 + 2 if rank % 2 == 0 else 1 + 3)
        assert o["explicit_pp1"] == ((rank,), (0, 1, 2, 3), (rank,), 6, rank)


# ---- single process ----------------------------------------------------------------------------------------------

def test_single_process_defaults_without_torch_distributed():
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    assert ps.get_pipeline_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_world_size() == 1
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    assert ps.get_data_parallel_world_size() == 1 and ps.get_context_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_pipeline_model_parallel_group()
    ps.initialize_model_parallel()  # pp 1, no torch.distributed: a collection of None groups
    try:
        assert ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_group() is None
        assert ps.get_pg_collection().pp_ranks == (0,)
    finally:
        ps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    assert not ps.model_parallel_is_initialized()


def test_overrides_reset_by_destroy():
    ps.set_tensor_model_parallel_world_size(2)
    ps.set_tensor_model_parallel_rank(1)
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()) == (2, 1)
    ps.set_pipeline_model_parallel_world_size(4)
    ps.set_pipeline_model_parallel_rank(3)
    ps.set_virtual_pipeline_model_parallel_world_size(2)
    assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
    assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0)
    ps.destroy_model_parallel()
    assert ps.get_pipeline_model_parallel_world_size() == 1 and ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None


@pytest.mark.parametrize("pp, world", [(1, 1), (1, 4), (2, 4), (4, 4), (2, 8), (4, 8), (3, 12)])
def test_rank_layout_partitions(pp, world):
    layout = rank_layout(pp, world)
    dp = world // pp
    assert sorted(r for g in layout.pipeline_groups for r in g) == list(range(world))
    assert sorted(r for g in layout.data_parallel_groups for r in g) == list(range(world))
    for r in range(world):
        stage, replica = divmod(r, dp)
        assert layout.pipeline_group_of(r)[stage] == r and layout.pipeline_group_of(r) == tuple(
            replica + s * dp for s in range(pp))
        assert layout.data_parallel_group_of(r) == tuple(range(stage * dp, stage * dp + dp))
    for pipeline, embd in zip(layout.pipeline_groups, layout.embedding_groups):
        assert embd == ((pipeline[0], pipeline[-1]) if pp > 1 else (pipeline[0],))


# ---- ModelParallelConfig -----------------------------------------------------------------------------------------

def test_config_defaults_follow_megatron():
    c = ModelParallelConfig()
    assert (c.batch_p2p_comm, c.batch_p2p_sync, c.overlap_p2p_comm, c.deallocate_pipeline_outputs) == (
        True, True, False, False)
    assert c.microbatch_group_size_per_vp_stage == 1 and c.autocast_dtype == torch.float32
    assert c.pipeline_dtype is None and c.variable_seq_lengths is False and c.barrier_with_L1_time is True
    assert c.expert_tensor_parallel_size == 1 and c.calculate_per_token_loss is False
    c = ModelParallelConfig(pipeline_model_parallel_size=4, pipeline_dtype=torch.bfloat16,
                            params_dtype=torch.bfloat16, virtual_pipeline_model_parallel_size=2)
    assert c.microbatch_group_size_per_vp_stage == 4 and c.autocast_dtype == torch.bfloat16
    assert ModelParallelConfig(pipeline_model_parallel_size=4, pipeline_dtype=torch.float32,
                               microbatch_group_size_per_vp_stage=6).microbatch_group_size_per_vp_stage == 6


@pytest.mark.parametrize("kwargs, field", [
    ({"pipeline_model_parallel_size": 2}, "pipeline_dtype"),
    ({"sequence_parallel": True}, "sequence_parallel"),
    ({"overlap_p2p_comm_warmup_flush": True, "overlap_p2p_comm": True}, "overlap_p2p_comm_warmup_flush"),
    ({"defer_embedding_wgrad_compute": True}, "defer_embedding_wgrad_compute"),
    ({"pipeline_model_parallel_size": 0}, "pipeline_model_parallel_size"),
    ({"virtual_pipeline_model_parallel_size": 0}, "virtual_pipeline_model_parallel_size"),
    ({"num_microbatches_with_partial_activation_checkpoints": -1}, "partial_activation_checkpoints"),
    ({"cpu_offloading": True, "pipeline_model_parallel_size": 2, "pipeline_dtype": torch.float32},
     "cpu_offloading"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ModelParallelConfig(**kwargs)


def test_config_type_errors():
    with pytest.raises(TypeError, match="pipeline_model_parallel_size"):
        ModelParallelConfig(pipeline_model_parallel_size="2")
    from engine import ModelParallelConfig as Exported
    assert Exported is ModelParallelConfig
