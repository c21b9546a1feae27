"""Megatron-Core ``parallel_state`` compatibility facade over one :class:`ProcessGroupCollection`.

Ported code keeps calling ``initialize_model_parallel(...)``, ``get_pipeline_model_parallel_rank()``, ... ; pipecast
itself passes the collection explicitly (``pg_collection=``) and only reads this module when a caller did not.
The whole state is one module-level collection plus the virtual-pipeline rank and the test overrides
(``set_pipeline_model_parallel_world_size`` and friends, as in Megatron).

Before ``initialize_model_parallel`` (or after ``destroy_model_parallel``) the rank / size getters answer like a
single process: rank 0, world size 1, virtual pipeline size None -- the same convention Megatron's stage predicates
use when torch.distributed is not initialised (``megatron/core/parallel_state.py``) -- and ``get_pg_collection()`` returns a collection
of ``None`` groups.  The group getters raise ``RuntimeError`` unless called with ``check_initialized=False``.
"""
from __future__ import annotations

import datetime
from typing import Optional

from .runtime.process_groups import ProcessGroupCollection, build_process_groups, group_rank, group_size

__all__ = [
    "initialize_model_parallel", "destroy_model_parallel", "model_parallel_is_initialized", "get_pg_collection",
    "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size",
    "set_pipeline_model_parallel_rank", "set_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_first_rank", "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank", "get_pipeline_model_parallel_prev_rank",
    "get_virtual_pipeline_model_parallel_rank", "set_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size", "set_virtual_pipeline_model_parallel_world_size",
    "is_pipeline_first_stage", "is_pipeline_last_stage",
    "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
    "get_embedding_group", "get_position_embedding_group", "get_model_parallel_group",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_src_rank", "set_tensor_model_parallel_rank", "set_tensor_model_parallel_world_size",
    "get_tensor_and_context_parallel_group", "get_tensor_and_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size", "get_model_parallel_world_size", "get_model_parallel_rank",
    "get_data_parallel_src_rank", "get_device_mesh", "get_context_parallel_group", "get_context_parallel_rank", "get_context_parallel_world_size",
    "get_expert_model_parallel_group", "get_expert_model_parallel_rank", "get_expert_model_parallel_world_size",
    "set_expert_model_parallel_rank", "set_expert_model_parallel_world_size", "get_expert_model_parallel_src_rank",
    "get_expert_tensor_parallel_group", "get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size",
    "set_expert_tensor_parallel_rank", "set_expert_tensor_parallel_world_size",
    "get_expert_tensor_and_model_parallel_group", "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size", "get_expert_tensor_model_pipeline_parallel_group",
    "get_expert_data_parallel_group", "get_expert_data_parallel_rank", "get_expert_data_parallel_world_size",
    "get_data_modulo_expert_parallel_group",
]

_UNSET = object()


class _State:
    pg: Optional[ProcessGroupCollection] = None
    vp_rank: Optional[int] = None
    vp_world_size = _UNSET  # override (Megatron's set_virtual_pipeline_model_parallel_world_size)
    pp_world_size: Optional[int] = None  # override
    pp_rank: Optional[int] = None  # override
    tp_world_size: Optional[int] = None  # override (Megatron's set_tensor_model_parallel_world_size)
    tp_rank: Optional[int] = None  # override
    ep_world_size: Optional[int] = None  # override (Megatron's set_expert_model_parallel_world_size)
    ep_rank: Optional[int] = None  # override
    etp_world_size: Optional[int] = None  # override (Megatron's set_expert_tensor_parallel_world_size)
    etp_rank: Optional[int] = None  # override
    mesh = None  # the DeviceMesh of get_device_mesh, built on first use


_state = _State()
_SINGLE = ProcessGroupCollection()


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              pipeline_model_parallel_comm_backend: Optional[str] = None, use_sharp: bool = False,
                              context_parallel_size: int = 1, hierarchical_context_parallel_sizes=None,
                              expert_model_parallel_size: int = 1, num_distributed_optimizer_instances: int = 1,
                              expert_tensor_parallel_size: Optional[int] = None,
                              nccl_communicator_config_path: Optional[str] = None,
                              distributed_timeout_minutes: int = 30, order: str = "tp-cp-ep-dp-pp",
                              create_gloo_process_groups: bool = True, high_priority_stream_groups=None,
                              sharp_enabled_group=None) -> None:
    """Build the process groups (Megatron-Core signature); the data-parallel size is ``world_size // (pp * tp)``.

    Supported: any tensor-parallel size dividing ``world_size // pp`` (Megatron's rank order ``tp-cp-ep-dp-pp``:
    the tensor-parallel rank varies fastest); expert groups of ``expert_model_parallel_size`` ranks of
    ``expert_tensor_parallel_size`` (default: the tensor-parallel size) each, laid out by Megatron's expert rank
    generator (the expert-data-parallel size is ``world_size // (etp * ep * pp)``, which must divide evenly, as
    Megatron requires); context parallel size 1, one distributed-optimizer instance, the default ``order``; ``use_sharp``, ``nccl_communicator_config_path``, ``create_gloo_process_groups``,
    ``high_priority_stream_groups``, ``sharp_enabled_group`` are accepted and have no effect.
    ``pipeline_model_parallel_comm_backend`` is the backend of the pipeline groups (default: the world's).
    Rank layout: see ``engine.runtime.process_groups``.  With ``virtual_pipeline_model_parallel_size`` set, the virtual
    pipeline rank starts at 0.

    Every rank must call it with the same arguments.  Raises ``RuntimeError`` if already initialised (call
    ``destroy_model_parallel`` first) or if pipelining is asked without torch.distributed, ``ValueError`` /
    ``TypeError`` for unsupported or inconsistent sizes; all checks run before any group is created.
    """
    if _state.pg is not None:
        raise RuntimeError("initialize_model_parallel: model parallel state is already initialised; call "
                           "engine.parallel_state.destroy_model_parallel() first")
    unsupported = {"context_parallel_size": (context_parallel_size, 1),
                   "num_distributed_optimizer_instances": (num_distributed_optimizer_instances, 1),
                   "hierarchical_context_parallel_sizes": (hierarchical_context_parallel_sizes, None),
                   "order": (order, "tp-cp-ep-dp-pp")}
    for name, (value, supported) in unsupported.items():
        if value != supported:
            raise ValueError(f"initialize_model_parallel: {name}={value!r} is not supported by pipecast "
                             f"(pipeline x data x tensor x expert parallel only); use {name}={supported!r}")
    pg = build_process_groups(pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
                              tensor_model_parallel_size=tensor_model_parallel_size,
                              expert_model_parallel_size=expert_model_parallel_size,
                              expert_tensor_parallel_size=expert_tensor_parallel_size,
                              backend=pipeline_model_parallel_comm_backend,
                              timeout=datetime.timedelta(minutes=distributed_timeout_minutes))
    _state.pg = pg
    _state.vp_rank = 0 if virtual_pipeline_model_parallel_size is not None else None


def destroy_model_parallel() -> None:
    """Forget the process groups (and destroy the ones pipecast created) and reset every override."""
    pg, _state.pg = _state.pg, None
    _state.vp_rank = None
    _state.vp_world_size = _UNSET
    _state.pp_world_size = None
    _state.pp_rank = None
    _state.tp_world_size = None
    _state.tp_rank = None
    _state.ep_world_size = _state.ep_rank = _state.etp_world_size = _state.etp_rank = None
    _state.mesh = None
    if pg is not None:
        pg.destroy()


def model_parallel_is_initialized() -> bool:
    """True between ``initialize_model_parallel`` and ``destroy_model_parallel``."""
    return _state.pg is not None


def get_pg_collection() -> ProcessGroupCollection:
    """The collection built by ``initialize_model_parallel``; a one-rank collection (``None`` groups) before."""
    return _state.pg if _state.pg is not None else _SINGLE


def _group(name: str, check_initialized: bool):
    if _state.pg is None:
        if check_initialized:
            raise RuntimeError(f"the {name} group is not initialised; call "
                               "engine.parallel_state.initialize_model_parallel() first")
        return None
    return getattr(_state.pg, name)


# ---- pipeline ---------------------------------------------------------------------------------------------------

def get_pipeline_model_parallel_group(check_initialized: bool = True):
    """The pipeline group of this rank (``torch.distributed.ProcessGroup``)."""
    return _group("pp", check_initialized)


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages (1 before initialisation)."""
    if _state.pp_world_size is not None:
        return _state.pp_world_size
    return group_size(get_pg_collection().pp)


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage (0 before initialisation)."""
    if _state.pp_rank is not None:
        return _state.pp_rank
    return group_rank(get_pg_collection().pp)


def set_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the pipeline size the getters report (Megatron test helper); None removes the override."""
    _state.pp_world_size = world_size


def set_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the pipeline rank the getters report (Megatron test helper); None removes the override."""
    _state.pp_rank = rank


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of this pipeline's first stage."""
    return get_pg_collection().pp_ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of this pipeline's last stage."""
    return get_pg_collection().pp_ranks[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wraps from the last stage to the first)."""
    ranks = get_pg_collection().pp_ranks
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (wraps from the first stage to the last)."""
    ranks = get_pg_collection().pp_ranks
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    """The current virtual pipeline stage (model chunk); 0 after initialisation with VP set, else None."""
    return _state.vp_rank


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Set the current virtual pipeline stage (Megatron API)."""
    _state.vp_rank = rank


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    """Model chunks per pipeline rank (``virtual_pipeline_model_parallel_size``); None when not interleaved."""
    if _state.vp_world_size is not _UNSET:
        return _state.vp_world_size
    return get_pg_collection().virtual_pipeline_model_parallel_size


def set_virtual_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the virtual pipeline size the getters report (Megatron test helper)."""
    _state.vp_world_size = world_size


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on pipeline rank 0; with ``ignore_virtual=False`` and a virtual pipeline, also needs ``vp_stage == 0``.

    Raises ``ValueError`` if ``ignore_virtual=False``, virtual pipelining is on and ``vp_stage`` is None.
    """
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        if vp_stage is None:
            raise ValueError("is_pipeline_first_stage(ignore_virtual=False) with virtual pipelining needs vp_stage "
                             "(the model chunk index); pass vp_stage=")
        if vp_stage != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the last pipeline rank; with ``ignore_virtual=False`` and a virtual pipeline, also needs
    ``vp_stage == virtual_pipeline_model_parallel_size - 1``.

    Raises ``ValueError`` if ``ignore_virtual=False``, virtual pipelining is on and ``vp_stage`` is None.
    """
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None:
        if vp_stage is None:
            raise ValueError("is_pipeline_last_stage(ignore_virtual=False) with virtual pipelining needs vp_stage "
                             "(the model chunk index); pass vp_stage=")
        if vp_stage != vp_size - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# ---- data parallel ----------------------------------------------------------------------------------------------

def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False,
                            check_initialized: bool = True):
    """The data-parallel group of this rank (with context parallel size 1, ``dp_cp`` is the same group)."""
    if partial_data_parallel:
        raise ValueError("get_data_parallel_group(partial_data_parallel=True) is not supported by pipecast "
                         "(one distributed-optimizer instance); pass partial_data_parallel=False")
    return _group("dp_cp" if with_context_parallel else "dp", check_initialized)


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """Number of data-parallel replicas (1 before initialisation)."""
    return group_size(get_data_parallel_group(with_context_parallel, partial_data_parallel, check_initialized=False))


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """This rank's data-parallel index (0 before initialisation)."""
    return group_rank(get_data_parallel_group(with_context_parallel, partial_data_parallel, check_initialized=False))


# ---- embedding, model, tensor and context parallel --------------------------------------------------------------

def get_embedding_group(check_initialized: bool = True):
    """First + last rank of this pipeline (tied embeddings); None on ranks in neither position."""
    return _group("embd", check_initialized)


def get_position_embedding_group(check_initialized: bool = True):
    """The first rank of this pipeline; None elsewhere."""
    return _group("pos_embd", check_initialized)


def get_model_parallel_group(check_initialized: bool = True):
    """Tensor x pipeline group of this data-parallel replica (the pipeline group when tensor parallel size is 1)."""
    return _group("mp", check_initialized)


def get_model_parallel_world_size() -> int:
    """Ranks in the tensor x pipeline group (1 before initialisation)."""
    return group_size(get_pg_collection().mp)


def get_model_parallel_rank() -> int:
    """This rank's index in the tensor x pipeline group (0 before initialisation)."""
    return group_rank(get_pg_collection().mp)


def get_tensor_model_parallel_group(check_initialized: bool = True):
    """The tensor-parallel group of this rank: ``tensor_model_parallel_size`` consecutive global ranks."""
    return _group("tp", check_initialized)


def get_tensor_model_parallel_world_size() -> int:
    """Tensor-parallel size (1 before initialisation)."""
    if _state.tp_world_size is not None:
        return _state.tp_world_size
    return group_size(get_pg_collection().tp)


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group (0 before initialisation)."""
    if _state.tp_rank is not None:
        return _state.tp_rank
    return group_rank(get_pg_collection().tp)


def set_tensor_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the tensor-parallel size the getters report (Megatron test helper); None removes the override."""
    _state.tp_world_size = world_size


def set_tensor_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the tensor-parallel rank the getters report (Megatron test helper); None removes the override."""
    _state.tp_rank = rank


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 of this rank's group (Megatron: ``(rank // tp) * tp``)."""
    return get_pg_collection().tp_ranks[0]


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    """Tensor x context group; equals the tensor-parallel group (context parallel size 1)."""
    return _group("tp_cp", check_initialized)


def get_tensor_and_context_parallel_world_size() -> int:
    """Tensor x context size; the tensor-parallel size (context parallel size 1)."""
    return group_size(get_pg_collection().tp_cp)


def get_tensor_and_context_parallel_rank() -> int:
    """This rank's index in the tensor x context group."""
    return group_rank(get_pg_collection().tp_cp)


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of data-parallel rank 0 of this rank's data-parallel group."""
    del with_context_parallel  # context parallel size 1: dp_cp is dp
    return get_pg_collection().dp_ranks[0]


def get_device_mesh(device_type: str | None = None):
    """The torch ``DeviceMesh`` (dims ``"pp"``, ``"dp"``, ``"tp"``) over the groups of
    ``initialize_model_parallel`` (``engine.runtime.process_groups.device_mesh``), built on first use.
    ``device_type`` defaults to ``"cuda"`` when CUDA is available, else ``"cpu"``.  Raises ``RuntimeError`` before
    initialisation."""
    if _state.pg is None:
        raise RuntimeError("get_device_mesh: call engine.parallel_state.initialize_model_parallel() first")
    if _state.mesh is None or (device_type is not None and _state.mesh.device_type != device_type):
        import torch
        from .runtime.process_groups import device_mesh
        kind = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        _state.mesh = device_mesh(_state.pg, kind)
    return _state.mesh


def get_context_parallel_group(check_initialized: bool = True):
    """This rank alone (context parallel size 1)."""
    return _group("cp", check_initialized)


def get_context_parallel_world_size() -> int:
    """Always 1 in pipecast."""
    return group_size(get_pg_collection().cp)


def get_context_parallel_rank() -> int:
    """Always 0 in pipecast."""
    return group_rank(get_pg_collection().cp)


# ---- expert parallel (Megatron-Core's expert layout: engine.runtime.process_groups) -----------------------------

def get_expert_model_parallel_group(check_initialized: bool = True):
    """The expert-parallel group of this rank: the ranks that shard one layer's experts (token all-to-all)."""
    return _group("ep", check_initialized)


def get_expert_model_parallel_world_size() -> int:
    """Expert-parallel size (1 before initialisation; Megatron-Core answers 0 without torch.distributed)."""
    if _state.ep_world_size is not None:
        return _state.ep_world_size
    return group_size(get_pg_collection().ep)


def get_expert_model_parallel_rank() -> int:
    """This rank's index in its expert-parallel group (0 before initialisation)."""
    if _state.ep_rank is not None:
        return _state.ep_rank
    return group_rank(get_pg_collection().ep)


def set_expert_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the expert-parallel size the getters report (Megatron helper); None removes the override."""
    _state.ep_world_size = world_size


def set_expert_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the expert-parallel rank the getters report (Megatron helper); None removes the override."""
    _state.ep_rank = rank


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of expert-parallel rank 0 of this rank's expert-parallel group."""
    return get_pg_collection().ep_ranks[0]


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    """The expert-tensor-parallel group of this rank (splits each expert's tensors)."""
    return _group("expt_tp", check_initialized)


def get_expert_tensor_parallel_world_size() -> int:
    """Expert-tensor-parallel size (the tensor-parallel override, else 1, before initialisation)."""
    if _state.etp_world_size is not None:
        return _state.etp_world_size
    if _state.pg is None:  # Megatron falls back to the tensor-parallel override without the group
        return _state.tp_world_size if _state.tp_world_size is not None else 1
    return group_size(_state.pg.expt_tp)


def get_expert_tensor_parallel_rank() -> int:
    """This rank's index in its expert-tensor-parallel group (the tensor-parallel override, else 0, before
    initialisation)."""
    if _state.etp_rank is not None:
        return _state.etp_rank
    if _state.pg is None:
        return _state.tp_rank if _state.tp_rank is not None else 0
    return group_rank(_state.pg.expt_tp)


def set_expert_tensor_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the expert-tensor-parallel size the getters report (Megatron helper); None removes it."""
    _state.etp_world_size = world_size


def set_expert_tensor_parallel_rank(rank: Optional[int]) -> None:
    """Override the expert-tensor-parallel rank the getters report (Megatron helper); None removes it."""
    _state.etp_rank = rank


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    """The expert-tensor x expert-parallel group of this rank."""
    return _group("tp_ep", check_initialized)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Ranks in the expert-tensor x expert-parallel group (1 before initialisation)."""
    return group_size(get_pg_collection().tp_ep)


def get_expert_tensor_and_model_parallel_rank() -> int:
    """This rank's index in the expert-tensor x expert-parallel group (0 before initialisation)."""
    return group_rank(get_pg_collection().tp_ep)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True):
    """The expert-tensor x expert x pipeline group of this rank."""
    return _group("tp_ep_pp", check_initialized)


def get_expert_data_parallel_group(check_initialized: bool = True, partial_expert_data_parallel: bool = False):
    """The expert-data-parallel group of this rank: the replicas of this rank's experts (expert gradients are
    reduced over it).  ``partial_expert_data_parallel=True`` raises ``ValueError`` (one distributed-optimizer
    instance)."""
    if partial_expert_data_parallel:
        raise ValueError("get_expert_data_parallel_group(partial_expert_data_parallel=True) is not supported by "
                         "pipecast (one distributed-optimizer instance); pass partial_expert_data_parallel=False")
    return _group("expt_dp", check_initialized)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False):
    """Deprecated name of :func:`get_expert_data_parallel_group` (as in Megatron-Core; warns)."""
    import warnings
    warnings.warn("get_data_modulo_expert_parallel_group is deprecated, use get_expert_data_parallel_group",
                  DeprecationWarning, stacklevel=2)
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    """Expert-data-parallel size (1 before initialisation)."""
    return group_size(get_expert_data_parallel_group(False, partial_expert_data_parallel))


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    """This rank's index in its expert-data-parallel group (0 before initialisation)."""
    return group_rank(get_expert_data_parallel_group(False, partial_expert_data_parallel))
