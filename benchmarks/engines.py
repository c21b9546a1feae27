"""The engines under comparison, each as ``build(rank, world, workload, **options) -> Engine`` run inside a rank.

An :class:`Engine` has ``step()`` (one forward-backward pass over all microbatches, gradients zeroed after it,
returns this rank's microbatch losses or ``[]``), and ``tracer`` hooks where the engine supports them.

* ``single``: one process, the whole model, a plain loop over the microbatches (the speedup reference).
* ``pipecast``: ``engine.schedules.get_forward_backward_func()`` (Megatron-Core API), 1F1B or interleaved 1F1B.
* ``torch``: ``torch.distributed.pipelining`` with any of its schedule classes (looped placement for the
  multi-stage schedules, V placement for ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from benchmarks.common import Workload, batch, build_layers, microbatches_sbh, mse, stage_layers

V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@dataclass
class Engine:
    name: str
    step: Callable[[], list]
    modules: list = field(default_factory=list)


def _zero(modules):
    for m in modules:
        for p in m.parameters():
            p.grad = None


# ---------------------------------------------------------------------------------------------------------------
def build_single(rank: int, world: int, w: Workload, layers: int | None = None) -> Engine:
    """The whole model (or its first ``layers`` layers) in one process, microbatch after microbatch."""
    model = nn.Sequential(*build_layers(w)[:layers])
    mbs = microbatches_sbh(w)
    m = w.microbatches

    def step():
        losses = []
        for x, y in mbs:
            loss = mse(model(x), y)
            (loss / m).backward()
            losses.append(loss.detach())
        _zero([model])
        return losses

    return Engine("single", step, [model])


# ---------------------------------------------------------------------------------------------------------------
def torch_stage_indices(schedule: str, pp: int, chunks: int, rank: int) -> list[int]:
    """Virtual stages held by ``rank``: looped ``c*P + r``, or V-shaped ``[r, 2P-1-r]``."""
    if schedule in V_SCHEDULES:
        if chunks != 2:
            raise ValueError(f"{schedule} places exactly 2 stages per rank (V shape), got chunks={chunks}")
        return [rank, 2 * pp - 1 - rank]
    return [c * pp + rank for c in range(chunks)]


def build_torch(rank: int, world: int, w: Workload, schedule: str = "Schedule1F1B", chunks: int = 1) -> Engine:
    """torch.distributed.pipelining: ``PipelineStage`` per virtual stage and the named schedule class."""
    from torch.distributed.pipelining import PipelineStage, schedules
    w.validate(world, chunks)
    cls = getattr(schedules, schedule)
    n = world * chunks
    idx = torch_stage_indices(schedule, world, chunks, rank)
    mods = [stage_layers(w, world, chunks, k) for k in idx]
    stages = [PipelineStage(mod, k, n, torch.device("cpu")) for mod, k in zip(mods, idx)]
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    if single and chunks != 1:
        raise ValueError(f"{schedule} runs one stage per rank; use chunks=1")
    sched = cls(stages[0] if single else stages, w.microbatches, loss_fn=mse)
    x, y = batch(w)
    first, last = 0 in idx, (n - 1) in idx

    def step():
        losses = [] if last else None
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        _zero(mods)
        return [l.detach() for l in losses] if last else []

    return Engine(f"torch {schedule}", step, mods)


# ---------------------------------------------------------------------------------------------------------------
class _Chunk(nn.Module):
    """A pipecast model chunk: Megatron's ``set_input_tensor`` contract around some layers."""

    def __init__(self, layers: nn.Sequential, first: bool, config, stage: int = 0):
        super().__init__()
        self.layers, self.first, self.config, self.stage = layers, first, config, stage
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0] if isinstance(tensors, (list, tuple)) else tensors

    def forward(self, x):
        return self.layers(x if self.first else self.input_tensor)


def build_pipecast(rank: int, world: int, w: Workload, chunks: int = 1, deallocate: bool = True,
                   tracer=None, gloo_io_nice="default", schedule: str | None = None, **config_overrides) -> Engine:
    """pipecast through its Megatron-Core API (``get_forward_backward_func``): 1F1B (``chunks=1``), interleaved
    1F1B (``chunks>1``) or no pipelining (``world=1``); with ``schedule`` (``"zb_h1"``, ``"zbv"``, ``"zb"``) its
    split-backward plan through ``forward_backward_pipelining_with_schedule`` (stages placed by the plan).
    ``gloo_io_nice`` goes to ``build_process_groups`` (None: the pipeline group's gloo I/O thread keeps the
    process's priority)."""
    from engine.model_parallel_config import ModelParallelConfig
    from engine.runtime.process_groups import build_process_groups
    from engine.schedules import P2PCommunicator, get_forward_backward_func
    from engine.runtime.tracing import use_tracer
    w.validate(world, chunks)
    vp = chunks if chunks > 1 else None
    pgc = build_process_groups(world, vp, gloo_io_nice=gloo_io_nice)  # this engine's own groups, passed explicitly
    config = ModelParallelConfig(pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=vp,
                                 pipeline_dtype=torch.float32, hidden_size=w.hidden,
                                 deallocate_pipeline_outputs=deallocate, **config_overrides)
    comm = P2PCommunicator(pgc.pp, config) if world > 1 else None
    idx = [c * world + rank for c in range(chunks)]
    fb = get_forward_backward_func(world, vp)
    if schedule is not None:
        import functools
        from engine.plan import build_plan
        from engine.schedules import forward_backward_pipelining_with_schedule
        plan = build_plan(schedule, world, w.microbatches, chunks)
        idx = list(plan.stages_of(rank))
        fb = functools.partial(forward_backward_pipelining_with_schedule, schedule=plan)
    mods = [_Chunk(stage_layers(w, world, chunks, k), k == 0, config, k) for k in idx]
    mbs = microbatches_sbh(w)
    n_stages = world * chunks
    explicit = {"pg_collection": pgc} if comm is None else {"p2p_communicator": comm, "pg_collection": pgc}

    def forward_step(data_iterator, model):
        x, y = next(data_iterator)
        out = model(x)
        is_loss_stage = model.stage == n_stages - 1
        if not is_loss_stage:
            return out, None

        def loss_func(output):
            loss = mse(output, y)
            return loss, {"loss": loss.detach().clone()}  # the schedule divides loss by M in place
        return out, loss_func

    def step():
        iters = [iter(mbs) for _ in range(chunks)]
        with use_tracer(tracer):
            store = fb(forward_step_func=forward_step, data_iterator=iters if chunks > 1 else iters[0],
                       model=mods if chunks > 1 else mods[0], num_microbatches=w.microbatches,
                       seq_length=w.seq_length, micro_batch_size=w.micro_batch_size, forward_only=False,
                       **explicit)
        _zero(mods)
        return [d["loss"] for d in store]

    name = "pipecast " + (schedule or ("no_pipelining" if world == 1 else "interleaved" if chunks > 1 else "1f1b"))
    return Engine(name, step, mods)


BUILDERS = {"single": build_single, "torch": build_torch, "pipecast": build_pipecast}
