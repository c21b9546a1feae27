"""The plan layer: schedules as data, pure Python (no torch).

* :mod:`engine.plan.types`: :class:`Plan` (per-rank actions), :class:`Action`, :class:`Op`, placements.
* :mod:`engine.plan.registry`: one :class:`ScheduleSpec` per schedule; :func:`register_schedule` adds one.
* :mod:`engine.plan.build`: :func:`build_plan` (looks the schedule up, runs its builder).
* :mod:`engine.plan.resolve`: :class:`ResolvedSchedule`, a schedule with its settings, giving cached plans.
* :mod:`engine.plan.megatron`, :mod:`engine.plan.zero_bubble`: the built-in builders.
* :mod:`engine.plan.table`: Megatron-Core's microbatch counts, schedule table and order.
* :mod:`engine.plan.graph`: a plan's dependency graph, execution order and memory walks; :class:`PlanError`.
* :mod:`engine.plan.validate`: data flow and deadlock freedom of a plan and of its compiled programs.
* :mod:`engine.plan.simulate`: makespan, bubble and memory of a plan under per-action costs.
* :mod:`engine.plan.lowering`, :mod:`engine.plan.hooks`: per-rank programs and sync-hook points.
* :mod:`engine.plan.candidates`: the schedules a tuner chooses from, predicted with measured costs (``pipecast tune``).
* :mod:`engine.plan.torch_csv`: torch.distributed.pipelining's action CSV in and out.
* :mod:`engine.plan.plotting`: the Gantt chart (matplotlib, imported on use).
* :mod:`engine.plan.cli`: ``pipecast schedule``.

Nothing here imports torch or the runtime; ``import engine.plan`` stays light (a test enforces it).
"""
from .build import MAX_PLAN_FORWARDS, build_plan, schedule_name
from .registry import ScheduleSpec, get_schedule, register_schedule, schedule_names
from .types import Action, Message, Op, Plan

__all__ = ["MAX_PLAN_FORWARDS", "Action", "Message", "Op", "Plan", "ScheduleSpec", "build_plan", "get_schedule",
           "register_schedule", "schedule_name", "schedule_names"]
