"""Process groups of a pipeline x data x tensor parallel job, in one explicit object.

:class:`ProcessGroupCollection` plays the role of Megatron-Core's ``ProcessGroupCollection``: the schedules and the
P2P communicator take it as ``pg_collection`` and read ``pp``, ``dp``, ``tp``, ``cp``, ``embd``, ... from it.
:func:`build_process_groups` creates one on every rank; ``engine.parallel_state`` keeps one in a module global for
Megatron-style callers; :func:`device_mesh` wraps the same groups in a torch ``DeviceMesh`` (dims ``pp``, ``dp``,
``tp``) for DTensor users, so both see one rank map.

Rank layout (Megatron-Core's default order ``"tp-cp-ep-dp-pp"`` with context = expert parallel size 1): the
tensor-parallel index varies fastest, then the data-parallel index, then the pipeline stage, so global rank
``g = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank`` where ``dp_size = world_size // (pp * tp)`` -- the
``DeviceMesh`` of shape ``(pp, dp, tp)`` over ``arange(world_size)``.  Hence

* tensor-parallel groups are contiguous blocks of ``tp`` ranks;
* pipeline groups are strided by ``dp * tp``: ``{o, o + dp*tp, ...}`` for each offset ``o in 0..dp*tp-1``
  (listed in stage order), so adjacent stages of one pipeline hold the same tensor-parallel rank;
* data-parallel groups are strided by ``tp`` inside one stage's block of ``dp * tp`` ranks;
* the model-parallel group (tensor x pipeline) of a data-parallel replica is the union of its pipelines;
* the embedding group of a pipeline is its first and last rank (one rank when ``pp == 1``) -- one per
  tensor-parallel rank; the position-embedding group is the pipeline's first rank;
* context-parallel groups hold one rank each; ``tp_cp`` is ``tp`` and ``dp_cp`` is ``dp``.

Expert layers (mixture of experts) have a layout of their own, Megatron-Core's *expert* rank generator
(``megatron/core/parallel_state.py``: ``initialize_model_parallel``): the same order over expert-tensor
(``etp``, default ``tp``), expert (``ep``), expert-data (``edp = world_size // (etp * ep * pp)``) and pipeline
sizes, so ``g = ((pp_rank * edp + edp_rank) * ep + ep_rank) * etp + etp_rank``.  Its groups: expert-parallel
``ep`` (the ranks that shard one layer's experts and exchange tokens by all-to-all), expert-tensor ``expt_tp``,
expert-tensor x expert ``tp_ep``, expert-tensor x expert x pipeline ``tp_ep_pp`` and expert-data-parallel
``expt_dp`` (the replicas of the same experts: expert gradients are reduced over it).  The pipeline groups of both
generators are the same.  Example, world 8, pp 2, tp 1, ep 2 (edp 2): expert groups ``[0, 1]``, ``[2, 3]``,
``[4, 5]``, ``[6, 7]``; expert-data-parallel groups ``[0, 2]``, ``[1, 3]``, ``[4, 6]``, ``[5, 7]`` -- the expert
groups are carved out of the data-parallel ranks of a stage (``dp = 4``, ``edp = dp * tp / (ep * etp)``).

Example, world 8, pp 2, tp 2 (dp 2): tensor groups ``[0, 1]``, ``[2, 3]``, ``[4, 5]``, ``[6, 7]``; pipelines
``[0, 4]``, ``[1, 5]``, ``[2, 6]``, ``[3, 7]``; data-parallel groups ``[0, 2]``, ``[1, 3]``, ``[4, 6]``, ``[5, 7]``;
model-parallel groups ``[0, 1, 4, 5]`` and ``[2, 3, 6, 7]``.  With tp 1 this is ``g = pp_rank * dp + dp_rank``.

Group objects are ``torch.distributed.ProcessGroup``; a rank that belongs to no group of a kind (e.g. a middle
pipeline stage for ``embd``) gets ``None``.  To keep the number of ``new_group`` calls small, the groups that are
identical by construction share one object (``dp_cp is dp``; ``tp_cp is tp``; any two kinds whose rank lists are
equal, e.g. with tp 1 ``mp is pp`` and ``tp``, ``cp``, ``tp_cp`` and ``pos_embd`` are this rank's one-rank group;
with ep 1 and etp = tp the expert groups are the dense ones: ``ep`` one rank, ``expt_tp is tp``, ``expt_dp is dp``).  Without ``torch.distributed`` initialised, a
one-rank job (world 1, pp 1) gets a collection whose groups are all ``None``; :func:`group_rank` /
:func:`group_size` treat ``None`` as rank 0 of size 1, like Megatron's stage predicates (``megatron/core/parallel_state.py``).

On gloo the pipeline groups' I/O thread runs at a lower priority (``engine.runtime.gloo_io``; ``gloo_io_nice``).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from . import gloo_io

__all__ = ["ORDER", "RankLayout", "ProcessGroupCollection", "orthogonal_groups", "rank_layout", "build_process_groups",
           "group_rank", "group_size", "validate_parallel_sizes", "device_mesh", "expert_data_mesh"]

ProcessGroup = dist.ProcessGroup


def group_rank(group: Optional[ProcessGroup]) -> int:
    """This process's rank in ``group``; 0 when ``group`` is None or torch.distributed is not initialised."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return group.rank()


def group_size(group: Optional[ProcessGroup]) -> int:
    """The number of ranks in ``group``; 1 when ``group`` is None or torch.distributed is not initialised."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return group.size()


ORDER = ("tp", "cp", "ep", "dp", "pp")
"""Megatron-Core's default rank order ``"tp-cp-ep-dp-pp"``: the first dimension varies fastest with the global rank."""


def orthogonal_groups(sizes: dict, kinds: str) -> tuple[tuple[int, ...], ...]:
    """The rank groups of ``kinds`` (e.g. ``"tp-pp"``) for a job of dimensions ``sizes`` (``{"tp": 2, "pp": 2,
    ...}``; a missing dimension has size 1) laid out in :data:`ORDER` (pure).

    Global rank ``g = sum_i coord_i * stride_i`` with strides the running products of the sizes in :data:`ORDER`.
    A group holds the ranks that differ only in the coordinates of ``kinds``, listed with the first of those
    varying fastest; the groups are listed with the other coordinates' index (fastest first) -- the enumeration of
    Megatron-Core's ``RankGenerator.get_ranks`` (``megatron/core/parallel_state.py``)."""
    wanted = kinds.split("-")
    dims = [(d, sizes.get(d, 1)) for d in ORDER]
    strides, at = {}, 1
    for d, n in dims:
        strides[d] = at
        at *= n
    inside = [(strides[d], n) for d, n in dims if d in wanted]
    outside = [(strides[d], n) for d, n in dims if d not in wanted]

    def offsets(axes):
        out = [0]
        for stride, n in axes:
            out = [o + k * stride for k in range(n) for o in out]
        return out

    members = offsets(inside)
    return tuple(tuple(base + m for m in members) for base in offsets(outside))


@dataclass(frozen=True)
class RankLayout:
    """Which global ranks form each group (pure data, no process groups).  See the module docstring.

    Groups of one kind are listed in a fixed order: pipelines and embedding groups by offset
    ``dp_rank * tp + tp_rank``; data-parallel groups by ``pp_rank * tp + tp_rank``; tensor groups by
    ``pp_rank * dp + dp_rank``; model-parallel groups by ``dp_rank``; the expert kinds by the expert generator's
    other coordinates (:func:`orthogonal_groups`).
    """

    world_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    pipeline_groups: tuple[tuple[int, ...], ...]
    data_parallel_groups: tuple[tuple[int, ...], ...]
    embedding_groups: tuple[tuple[int, ...], ...]
    position_embedding_groups: tuple[tuple[int, ...], ...]
    tensor_model_parallel_size: int = 1
    tensor_groups: tuple[tuple[int, ...], ...] = ()
    model_parallel_groups: tuple[tuple[int, ...], ...] = ()
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    expert_data_parallel_size: int = 1
    expert_groups: tuple[tuple[int, ...], ...] = ()
    expert_tensor_groups: tuple[tuple[int, ...], ...] = ()
    expert_tensor_and_model_groups: tuple[tuple[int, ...], ...] = ()
    expert_tensor_model_pipeline_groups: tuple[tuple[int, ...], ...] = ()
    expert_data_parallel_groups: tuple[tuple[int, ...], ...] = ()

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of global ``rank`` (its index in the ``(pp, dp, tp)`` mesh)."""
        rest, tp_rank = divmod(rank, self.tensor_model_parallel_size)
        pp_rank, dp_rank = divmod(rest, self.data_parallel_size)
        return pp_rank, dp_rank, tp_rank

    def expert_coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """``(pp_rank, edp_rank, ep_rank, etp_rank)`` of global ``rank`` in the expert generator's mesh."""
        rest, etp_rank = divmod(rank, self.expert_tensor_parallel_size)
        rest, ep_rank = divmod(rest, self.expert_model_parallel_size)
        pp_rank, edp_rank = divmod(rest, self.expert_data_parallel_size)
        return pp_rank, edp_rank, ep_rank, etp_rank

    def group_of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of ``kind`` (a field name, e.g. ``"expert_groups"``) that holds global ``rank``.

        Raises ``ValueError`` for a rank outside the layout."""
        for group in getattr(self, kind):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is outside this layout of {self.world_size} ranks")

    def pipeline_group_of(self, rank: int) -> tuple[int, ...]:
        return self.pipeline_groups[rank % (self.data_parallel_size * self.tensor_model_parallel_size)]

    def data_parallel_group_of(self, rank: int) -> tuple[int, ...]:
        pp_rank, _, tp_rank = self.coordinates(rank)
        return self.data_parallel_groups[pp_rank * self.tensor_model_parallel_size + tp_rank]

    def tensor_group_of(self, rank: int) -> tuple[int, ...]:
        return self.tensor_groups[rank // self.tensor_model_parallel_size]

    def model_parallel_group_of(self, rank: int) -> tuple[int, ...]:
        return self.model_parallel_groups[self.coordinates(rank)[1]]


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def validate_parallel_sizes(pipeline_model_parallel_size, virtual_pipeline_model_parallel_size=None,
                            world_size=1, *, tensor_model_parallel_size=1, context_parallel_size=1,
                            expert_model_parallel_size=1, expert_tensor_parallel_size=None) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the setting, its value and the fix if pipecast cannot build
    process groups for these sizes: context parallelism is refused; the world must be a multiple of ``pp * tp``
    and, as Megatron-Core requires, of ``etp * ep * pp`` (``expert_tensor_parallel_size`` None means ``tp``).
    ``world_size=None`` skips the divisibility checks.  Pure: every rank gets the same answer before any
    collective."""
    etp = tensor_model_parallel_size if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    for name, value in (("pipeline_model_parallel_size", pipeline_model_parallel_size),
                        ("world_size", 1 if world_size is None else world_size),
                        ("tensor_model_parallel_size", tensor_model_parallel_size),
                        ("context_parallel_size", context_parallel_size),
                        ("expert_model_parallel_size", expert_model_parallel_size),
                        ("expert_tensor_parallel_size", etp)):
        _check_int(name, value)
    vp = virtual_pipeline_model_parallel_size
    if vp is not None and (isinstance(vp, bool) or not isinstance(vp, int) or vp < 1):
        raise ValueError(f"virtual_pipeline_model_parallel_size must be None or an int >= 1, got {vp!r}; "
                         "pass the number of model chunks per pipeline rank, or None")
    if context_parallel_size != 1:
        raise ValueError(f"context_parallel_size={context_parallel_size} is not supported by pipecast (pipeline x "
                         "data x tensor x expert parallel only); set context_parallel_size=1")
    model_parallel = pipeline_model_parallel_size * tensor_model_parallel_size
    if world_size is not None and world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not divisible by pipeline_model_parallel_size x "
                         f"tensor_model_parallel_size = {pipeline_model_parallel_size} x "
                         f"{tensor_model_parallel_size}; the data-parallel size is world_size // (pp * tp), so "
                         f"choose sizes whose product divides {world_size} or change the number of processes")
    expert = etp * expert_model_parallel_size * pipeline_model_parallel_size
    if world_size is not None and world_size % expert:
        raise ValueError(f"world size {world_size} is not divisible by expert_tensor_parallel_size x "
                         f"expert_model_parallel_size x pipeline_model_parallel_size = {etp} x "
                         f"{expert_model_parallel_size} x {pipeline_model_parallel_size} (Megatron-Core's expert "
                         "layout takes the expert ranks from the data-parallel ranks of a stage); choose an "
                         f"expert_model_parallel_size whose product with the others divides {world_size}")


def rank_layout(pipeline_model_parallel_size: int, world_size: int, tensor_model_parallel_size: int = 1, *,
                expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None) -> RankLayout:
    """The group membership of a ``world_size`` job with ``pipeline_model_parallel_size`` stages,
    ``tensor_model_parallel_size`` tensor-parallel ranks per stage and, for expert layers,
    ``expert_model_parallel_size`` expert ranks of ``expert_tensor_parallel_size`` (default: the tensor-parallel
    size) each (pure; Megatron's order ``tp-cp-ep-dp-pp`` for both its dense and its expert generator).

    Raises ``ValueError`` / ``TypeError`` as :func:`validate_parallel_sizes`.
    """
    validate_parallel_sizes(pipeline_model_parallel_size, None, world_size,
                            tensor_model_parallel_size=tensor_model_parallel_size,
                            expert_model_parallel_size=expert_model_parallel_size,
                            expert_tensor_parallel_size=expert_tensor_parallel_size)
    pp, tp, ep = pipeline_model_parallel_size, tensor_model_parallel_size, expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    dp, edp = world_size // (pp * tp), world_size // (pp * ep * etp)
    dense = {"tp": tp, "dp": dp, "pp": pp}
    expert = {"tp": etp, "ep": ep, "dp": edp, "pp": pp}
    pipelines = orthogonal_groups(dense, "pp")
    embedding = tuple((p[0], p[-1]) if pp > 1 else (p[0],) for p in pipelines)
    return RankLayout(
        world_size, pp, dp, pipelines, orthogonal_groups(dense, "dp"), embedding, tuple((p[0],) for p in pipelines),
        tp, orthogonal_groups(dense, "tp"), orthogonal_groups(dense, "tp-pp"), ep, etp, edp,
        orthogonal_groups(expert, "ep"), orthogonal_groups(expert, "tp"), orthogonal_groups(expert, "tp-ep"),
        orthogonal_groups(expert, "tp-ep-pp"), orthogonal_groups(expert, "dp"))


@dataclass(frozen=True)
class ProcessGroupCollection:
    """The process groups one rank uses, plus the layout facts the runtime needs.

    Attributes named like Megatron-Core's ``ProcessGroupCollection``: ``tp``, ``pp``, ``mp``, ``embd``,
    ``pos_embd``, ``cp``, ``tp_cp``, ``dp``, ``dp_cp`` and the expert kinds ``ep``, ``expt_tp``, ``tp_ep``,
    ``tp_ep_pp``, ``expt_dp`` (``ProcessGroup`` or ``None``, see the module docstring).
    ``pp_ranks`` are the global ranks of this rank's pipeline in stage order (``pp_ranks[i]`` runs stage ``i``);
    ``dp_ranks`` this stage's data-parallel replicas; ``tp_ranks`` this rank's tensor-parallel group in
    tensor-rank order; ``embd_ranks`` the embedding group (empty if this rank is not in one); ``ep_ranks``,
    ``expt_tp_ranks``, ``tp_ep_ranks``, ``expt_dp_ranks`` this rank's expert groups in group-rank order.
    """

    pp: Optional[ProcessGroup] = None
    dp: Optional[ProcessGroup] = None
    tp: Optional[ProcessGroup] = None
    cp: Optional[ProcessGroup] = None
    tp_cp: Optional[ProcessGroup] = None
    mp: Optional[ProcessGroup] = None
    dp_cp: Optional[ProcessGroup] = None
    embd: Optional[ProcessGroup] = None
    pos_embd: Optional[ProcessGroup] = None
    pp_ranks: tuple[int, ...] = (0,)
    dp_ranks: tuple[int, ...] = (0,)
    embd_ranks: tuple[int, ...] = (0,)
    virtual_pipeline_model_parallel_size: Optional[int] = None
    rank: int = 0
    world_size: int = 1
    tp_ranks: tuple[int, ...] = (0,)
    ep: Optional[ProcessGroup] = None
    expt_tp: Optional[ProcessGroup] = None
    tp_ep: Optional[ProcessGroup] = None
    tp_ep_pp: Optional[ProcessGroup] = None
    expt_dp: Optional[ProcessGroup] = None
    ep_ranks: tuple[int, ...] = (0,)
    expt_tp_ranks: tuple[int, ...] = (0,)
    tp_ep_ranks: tuple[int, ...] = (0,)
    expt_dp_ranks: tuple[int, ...] = (0,)
    _owned: tuple = field(default=(), repr=False, compare=False)  # distinct groups this object created

    @property
    def pipeline_model_parallel_size(self) -> int:
        return len(self.pp_ranks)

    @property
    def pipeline_model_parallel_rank(self) -> int:
        return self.pp_ranks.index(self.rank)

    @property
    def data_parallel_size(self) -> int:
        return len(self.dp_ranks)

    @property
    def data_parallel_rank(self) -> int:
        return self.dp_ranks.index(self.rank)

    @property
    def tensor_model_parallel_size(self) -> int:
        return len(self.tp_ranks)

    @property
    def tensor_model_parallel_rank(self) -> int:
        return self.tp_ranks.index(self.rank)

    @property
    def expert_model_parallel_size(self) -> int:
        return len(self.ep_ranks)

    @property
    def expert_model_parallel_rank(self) -> int:
        return self.ep_ranks.index(self.rank)

    @property
    def expert_data_parallel_size(self) -> int:
        return len(self.expt_dp_ranks)

    @property
    def expert_data_parallel_rank(self) -> int:
        return self.expt_dp_ranks.index(self.rank)

    def destroy(self) -> None:
        """Destroy the process groups this collection created (local call; the default group is untouched)."""
        if dist.is_available() and dist.is_initialized():
            for g in self._owned:
                dist.destroy_process_group(g)


def device_mesh(pg: ProcessGroupCollection, device_type: str = "cpu"):
    """A torch ``DeviceMesh`` of shape ``(pp, dp, tp)`` (dims named ``"pp"``, ``"dp"``, ``"tp"``) over the groups
    of ``pg`` itself (``DeviceMesh.from_group``: no new communicator), so ``mesh["tp"]`` is ``pg.tp``.  Local call.

    Raises ``RuntimeError`` without torch.distributed (a one-rank collection of ``None`` groups).
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    if pg.pp is None or pg.dp is None or pg.tp is None:
        raise RuntimeError("device_mesh needs process groups; initialise torch.distributed and call "
                           "build_process_groups first")
    pp, dp, tp = pg.pipeline_model_parallel_size, pg.data_parallel_size, pg.tensor_model_parallel_size
    mesh = torch.arange(pg.world_size, dtype=torch.int).reshape(pp, dp, tp)
    return DeviceMesh.from_group([pg.pp, pg.dp, pg.tp], device_type, mesh=mesh, mesh_dim_names=("pp", "dp", "tp"))


def expert_data_mesh(pg: ProcessGroupCollection, device_type: str = "cpu"):
    """A 1-D torch ``DeviceMesh`` (dim ``"expt_dp"``) over ``pg.expt_dp``, the expert-data-parallel group (the ranks
    holding the same experts), itself (``DeviceMesh.from_group``: no new communicator).  Local call.

    Raises ``RuntimeError`` without torch.distributed (a one-rank collection of ``None`` groups).
    """
    from torch.distributed.device_mesh import DeviceMesh
    if pg.expt_dp is None:
        raise RuntimeError("expert_data_mesh needs process groups; initialise torch.distributed and call "
                           "build_process_groups first")
    return DeviceMesh.from_group(pg.expt_dp, device_type, mesh=list(pg.expt_dp_ranks), mesh_dim_names=("expt_dp",))


def _resolve_world(world_size, rank) -> tuple[bool, int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        actual_world, actual_rank = dist.get_world_size(), dist.get_rank()
        if world_size is not None and world_size != actual_world:
            raise ValueError(f"world_size={world_size} does not match torch.distributed's world size "
                             f"{actual_world}; pass world_size=None")
        if rank is not None and rank != actual_rank:
            raise ValueError(f"rank={rank} does not match torch.distributed's rank {actual_rank}; pass rank=None")
        return True, actual_world, actual_rank
    return False, 1 if world_size is None else world_size, 0 if rank is None else rank


def build_process_groups(pipeline_model_parallel_size: int, virtual_pipeline_model_parallel_size: Optional[int] = None,
                         world_size: Optional[int] = None, rank: Optional[int] = None, *,
                         tensor_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                         expert_tensor_parallel_size: Optional[int] = None,
                         backend: Optional[str] = None,
                         timeout: Optional[datetime.timedelta] = None,
                         gloo_io_nice: Optional[int] | str = "default") -> ProcessGroupCollection:
    """Create this rank's :class:`ProcessGroupCollection` for ``world = pp * dp * tp`` (context parallel 1), with
    the expert groups of ``expert_model_parallel_size`` x ``expert_tensor_parallel_size`` (default: the
    tensor-parallel size; module docstring).

    Every rank of the default group must call this with the same arguments: each group is created with
    ``torch.distributed.new_group`` by every rank, in one fixed order (pipeline groups, data-parallel groups,
    embedding groups, tensor and model-parallel groups, one-rank groups, then the expert kinds), a kind whose rank
    lists equal an earlier kind's reusing its groups.  ``world_size`` / ``rank`` default to the default group's;
    if given they must match it.  ``backend`` / ``timeout`` go to ``new_group`` (default: the default group's).
    ``gloo_io_nice``: nice value for the gloo I/O thread of this rank's pipeline group (``engine.runtime.gloo_io``;
    ``"default"``: ``PIPECAST_GLOO_IO_NICE`` or 19; None: leave it at the process's priority).

    Without torch.distributed initialised only ``world_size`` 1 with every size 1 is accepted; the result then
    holds ``None`` groups.

    Raises ``TypeError`` / ``ValueError`` (bad or unsupported sizes, world size not divisible by ``pp * tp`` or
    ``etp * ep * pp``, a ``gloo_io_nice`` that is not None, ``"default"`` or an integer 0..19,
    ``world_size`` / ``rank`` not matching torch.distributed) and ``RuntimeError`` (pipelining, tensor or expert
    parallelism without torch.distributed), all before any group is created.
    """
    nice = gloo_io.resolve_nice(gloo_io_nice)
    initialized, world_size, rank = _resolve_world(world_size, rank)
    sizes = dict(tensor_model_parallel_size=tensor_model_parallel_size,
                 expert_model_parallel_size=expert_model_parallel_size,
                 expert_tensor_parallel_size=expert_tensor_parallel_size)
    validate_parallel_sizes(pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, None, **sizes)
    if not initialized:
        parallel = {"pipeline_model_parallel_size": pipeline_model_parallel_size,
                    **{k: v for k, v in sizes.items() if v is not None}}
        if world_size != 1 or any(v != 1 for v in parallel.values()):
            raise RuntimeError(f"torch.distributed is not initialised but world_size={world_size}, "
                               + ", ".join(f"{k}={v}" for k, v in parallel.items())
                               + "; call torch.distributed.init_process_group first (e.g. launch with torchrun)")
        return ProcessGroupCollection(virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size)
    validate_parallel_sizes(pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, world_size, **sizes)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside the world of size {world_size}")
    layout = rank_layout(pipeline_model_parallel_size, world_size, **sizes)
    kwargs = {"backend": backend}
    if timeout is not None:
        kwargs["timeout"] = timeout
    make = _GroupMaker(rank, kwargs)
    gloo = "gloo" in str(backend or dist.get_backend())  # only gloo groups have the I/O thread to renice
    with gloo_io.lowered_io_priority(nice if pipeline_model_parallel_size > 1 and gloo else None, expected=1):
        pp, pp_ranks = make(layout.pipeline_groups)
    dp, dp_ranks = make(layout.data_parallel_groups)
    embd, embd_ranks = make(layout.embedding_groups)
    tp, tp_ranks = make(layout.tensor_groups)
    mp, _ = make(layout.model_parallel_groups)
    single, _ = make(tuple((r,) for r in range(world_size)))
    ep, ep_ranks = make(layout.expert_groups)
    expt_tp, expt_tp_ranks = make(layout.expert_tensor_groups)
    tp_ep, tp_ep_ranks = make(layout.expert_tensor_and_model_groups)
    tp_ep_pp, _ = make(layout.expert_tensor_model_pipeline_groups)
    expt_dp, expt_dp_ranks = make(layout.expert_data_parallel_groups)
    on_first_stage = rank in layout.pipeline_group_of(rank)[:1]
    return ProcessGroupCollection(
        pp=pp, dp=dp, tp=tp, cp=single, tp_cp=tp, mp=mp, dp_cp=dp, embd=embd,
        pos_embd=single if on_first_stage else None, pp_ranks=pp_ranks, dp_ranks=dp_ranks, embd_ranks=embd_ranks,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size, rank=rank,
        world_size=world_size, tp_ranks=tp_ranks, ep=ep, expt_tp=expt_tp, tp_ep=tp_ep, tp_ep_pp=tp_ep_pp,
        expt_dp=expt_dp, ep_ranks=ep_ranks, expt_tp_ranks=expt_tp_ranks, tp_ep_ranks=tp_ep_ranks,
        expt_dp_ranks=expt_dp_ranks, _owned=make.owned())


class _GroupMaker:
    """Creates every group of one kind (on every rank, in the same order) and returns this rank's; a kind whose
    rank lists equal an earlier kind's reuses those groups (no ``new_group`` call: the decision depends on the
    layout only, so every rank makes it alike)."""

    def __init__(self, rank: int, kwargs: dict) -> None:
        self.rank, self.kwargs, self.made = rank, kwargs, {}

    def __call__(self, groups: tuple[tuple[int, ...], ...]):
        hit = self.made.get(groups)
        if hit is None:
            found, ranks = None, ()
            for members in groups:
                g = dist.new_group(list(members), **self.kwargs)
                if self.rank in members:
                    found, ranks = g, members
            hit = self.made[groups] = (found, ranks)
        return hit

    def owned(self) -> tuple:
        return tuple(g for g, _ in self.made.values() if g is not None)
