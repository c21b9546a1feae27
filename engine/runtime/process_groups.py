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

Example, world 8, pp 2, tp 2 (dp 2): tensor groups ``[0, 1]``, ``[2, 3]``, ``[4, 5]``, ``[6, 7]``; pipelines
``[0, 4]``, ``[1, 5]``, ``[2, 6]``, ``[3, 7]``; data-parallel groups ``[0, 2]``, ``[1, 3]``, ``[4, 6]``, ``[5, 7]``;
model-parallel groups ``[0, 1, 4, 5]`` and ``[2, 3, 6, 7]``.  With tp 1 this is ``g = pp_rank * dp + dp_rank``.

Group objects are ``torch.distributed.ProcessGroup``; a rank that belongs to no group of a kind (e.g. a middle
pipeline stage for ``embd``) gets ``None``.  To keep the number of ``new_group`` calls small, the groups that are
identical by construction share one object (``dp_cp is dp``; ``tp_cp is tp``; with tp 1 ``mp is pp`` and ``tp``,
``cp``, ``tp_cp`` and ``pos_embd`` are this rank's one-rank group).  Without ``torch.distributed`` initialised, a
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

__all__ = ["RankLayout", "ProcessGroupCollection", "rank_layout", "build_process_groups", "group_rank",
           "group_size", "validate_parallel_sizes", "device_mesh"]

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


@dataclass(frozen=True)
class RankLayout:
    """Which global ranks form each group (pure data, no process groups).  See the module docstring.

    Groups of one kind are listed in a fixed order: pipelines and embedding groups by offset
    ``dp_rank * tp + tp_rank``; data-parallel groups by ``pp_rank * tp + tp_rank``; tensor groups by
    ``pp_rank * dp + dp_rank``; model-parallel groups by ``dp_rank``.
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

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of global ``rank`` (its index in the ``(pp, dp, tp)`` mesh)."""
        rest, tp_rank = divmod(rank, self.tensor_model_parallel_size)
        pp_rank, dp_rank = divmod(rest, self.data_parallel_size)
        return pp_rank, dp_rank, tp_rank

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
                            expert_model_parallel_size=1) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the setting, its value and the fix if pipecast cannot build
    process groups for these sizes (context / expert parallelism are refused; the world must be a multiple of
    ``pp * tp``).  ``world_size=None`` skips the divisibility check.  Pure: every rank gets the same answer before
    any collective."""
    for name, value in (("pipeline_model_parallel_size", pipeline_model_parallel_size),
                        ("world_size", 1 if world_size is None else world_size),
                        ("tensor_model_parallel_size", tensor_model_parallel_size),
                        ("context_parallel_size", context_parallel_size),
                        ("expert_model_parallel_size", expert_model_parallel_size)):
        _check_int(name, value)
    vp = virtual_pipeline_model_parallel_size
    if vp is not None and (isinstance(vp, bool) or not isinstance(vp, int) or vp < 1):
        raise ValueError(f"virtual_pipeline_model_parallel_size must be None or an int >= 1, got {vp!r}; "
                         "pass the number of model chunks per pipeline rank, or None")
    for name, value in (("context_parallel_size", context_parallel_size),
                        ("expert_model_parallel_size", expert_model_parallel_size)):
        if value != 1:
            raise ValueError(f"{name}={value} is not supported by pipecast (pipeline x data x tensor parallel "
                             f"only); set {name}=1")
    model_parallel = pipeline_model_parallel_size * tensor_model_parallel_size
    if world_size is not None and world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not divisible by pipeline_model_parallel_size x "
                         f"tensor_model_parallel_size = {pipeline_model_parallel_size} x "
                         f"{tensor_model_parallel_size}; the data-parallel size is world_size // (pp * tp), so "
                         f"choose sizes whose product divides {world_size} or change the number of processes")


def rank_layout(pipeline_model_parallel_size: int, world_size: int,
                tensor_model_parallel_size: int = 1) -> RankLayout:
    """The group membership of a ``world_size`` job with ``pipeline_model_parallel_size`` stages and
    ``tensor_model_parallel_size`` tensor-parallel ranks per stage (pure; Megatron's order ``tp-cp-ep-dp-pp``).

    Raises ``ValueError`` / ``TypeError`` as :func:`validate_parallel_sizes`.
    """
    validate_parallel_sizes(pipeline_model_parallel_size, None, world_size,
                            tensor_model_parallel_size=tensor_model_parallel_size)
    pp, tp = pipeline_model_parallel_size, tensor_model_parallel_size
    dp = world_size // (pp * tp)

    def g(s: int, d: int, t: int) -> int:
        return (s * dp + d) * tp + t

    pipelines = tuple(tuple(g(s, d, t) for s in range(pp)) for d in range(dp) for t in range(tp))
    data_parallel = tuple(tuple(g(s, d, t) for d in range(dp)) for s in range(pp) for t in range(tp))
    tensor = tuple(tuple(g(s, d, t) for t in range(tp)) for s in range(pp) for d in range(dp))
    model = tuple(tuple(g(s, d, t) for s in range(pp) for t in range(tp)) for d in range(dp))
    embedding = tuple((p[0], p[-1]) if pp > 1 else (p[0],) for p in pipelines)
    position = tuple((p[0],) for p in pipelines)
    return RankLayout(world_size, pp, dp, pipelines, data_parallel, embedding, position, tp, tensor, model)


@dataclass(frozen=True)
class ProcessGroupCollection:
    """The process groups one rank uses, plus the layout facts the runtime needs.

    Attributes named like Megatron-Core's ``ProcessGroupCollection``: ``tp``, ``pp``, ``mp``, ``embd``,
    ``pos_embd``, ``cp``, ``tp_cp``, ``dp``, ``dp_cp`` (``ProcessGroup`` or ``None``, see the module docstring).
    ``pp_ranks`` are the global ranks of this rank's pipeline in stage order (``pp_ranks[i]`` runs stage ``i``);
    ``dp_ranks`` this stage's data-parallel replicas; ``tp_ranks`` this rank's tensor-parallel group in
    tensor-rank order; ``embd_ranks`` the embedding group (empty if this rank is not in one).
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
                         tensor_model_parallel_size: int = 1,
                         backend: Optional[str] = None,
                         timeout: Optional[datetime.timedelta] = None,
                         gloo_io_nice: Optional[int] | str = "default") -> ProcessGroupCollection:
    """Create this rank's :class:`ProcessGroupCollection` for ``world = pp * dp * tp`` (context parallel 1).

    Every rank of the default group must call this with the same arguments: each group is created with
    ``torch.distributed.new_group`` by every rank, in one fixed order (pipeline groups, data-parallel groups,
    embedding groups, then with tp > 1 tensor and model-parallel groups, then one-rank groups).  ``world_size`` /
    ``rank`` default to the default group's; if given they must match it.  ``backend`` / ``timeout`` go to
    ``new_group`` (default: the default group's).
    ``gloo_io_nice``: nice value for the gloo I/O thread of this rank's pipeline group (``engine.runtime.gloo_io``;
    ``"default"``: ``PIPECAST_GLOO_IO_NICE`` or 19; None: leave it at the process's priority).

    Without torch.distributed initialised only ``world_size`` 1 with pipeline and tensor size 1 is accepted; the
    result then holds ``None`` groups.

    Raises ``TypeError`` / ``ValueError`` (bad or unsupported sizes, world size not divisible by ``pp * tp``,
    a ``gloo_io_nice`` that is not None, ``"default"`` or an integer 0..19,
    ``world_size`` / ``rank`` not matching torch.distributed) and ``RuntimeError`` (pipelining or tensor
    parallelism without torch.distributed), all before any group is created.
    """
    nice = gloo_io.resolve_nice(gloo_io_nice)
    initialized, world_size, rank = _resolve_world(world_size, rank)
    tp_size = tensor_model_parallel_size
    validate_parallel_sizes(pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, None,
                            tensor_model_parallel_size=tp_size)
    if not initialized:
        if world_size != 1 or pipeline_model_parallel_size != 1 or tp_size != 1:
            raise RuntimeError(f"torch.distributed is not initialised but world_size={world_size}, "
                               f"pipeline_model_parallel_size={pipeline_model_parallel_size}, "
                               f"tensor_model_parallel_size={tp_size}; call torch.distributed.init_process_group "
                               "first (e.g. launch with torchrun)")
        return ProcessGroupCollection(virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size)
    validate_parallel_sizes(pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, world_size,
                            tensor_model_parallel_size=tp_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside the world of size {world_size}")

    layout = rank_layout(pipeline_model_parallel_size, world_size, tp_size)
    kwargs = {"backend": backend}
    if timeout is not None:
        kwargs["timeout"] = timeout

    def mine(groups: tuple[tuple[int, ...], ...]):
        """Create every group of one kind (on every rank, same order); return (this rank's group, its ranks)."""
        found, ranks = None, ()
        for members in groups:
            g = dist.new_group(list(members), **kwargs)
            if rank in members:
                found, ranks = g, members
        return found, ranks

    gloo = "gloo" in str(backend or dist.get_backend())  # only gloo groups have the I/O thread to renice
    with gloo_io.lowered_io_priority(nice if pipeline_model_parallel_size > 1 and gloo else None, expected=1):
        pp, pp_ranks = mine(layout.pipeline_groups)
    dp, dp_ranks = mine(layout.data_parallel_groups)
    embd, embd_ranks = mine(layout.embedding_groups)
    tp, tp_ranks = mine(layout.tensor_groups) if tp_size > 1 else (None, (rank,))
    mp, _ = mine(layout.model_parallel_groups) if tp_size > 1 else (pp, ())
    single, _ = mine(tuple((r,) for r in range(world_size)))
    tp = single if tp is None else tp
    on_first_stage = rank in layout.pipeline_group_of(rank)[:1]
    owned = (pp, dp, embd, single) + ((tp, mp) if tp_size > 1 else ())
    return ProcessGroupCollection(
        pp=pp, dp=dp, tp=tp, cp=single, tp_cp=tp, mp=mp, dp_cp=dp, embd=embd,
        pos_embd=single if on_first_stage else None, pp_ranks=pp_ranks, dp_ranks=dp_ranks, embd_ranks=embd_ranks,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size, rank=rank,
        world_size=world_size, tp_ranks=tp_ranks, _owned=tuple(g for g in owned if g is not None))
