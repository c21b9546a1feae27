"""The plan layer: schedules as data, pure Python (no torch).

* :mod:`engine.plan.table`: Megatron-Core's microbatch counts, schedule table and order (Megatron-Core 0.16.1).
* :mod:`engine.plan.build`: :class:`Plan` (per-rank actions) and :func:`build_plan`.
* :mod:`engine.plan.validate`: data flow and deadlock freedom of a plan; :class:`PlanError`.
* :mod:`engine.plan.simulate`: makespan, bubble and memory of a plan under per-action costs.
* :mod:`engine.plan.candidates`: the schedules a tuner chooses from, predicted with measured costs (``pipecast tune``).
* :mod:`engine.plan.torch_csv`: torch.distributed.pipelining's action CSV in and out.
* :mod:`engine.plan.plotting`: the Gantt chart (matplotlib, imported on use).
* :mod:`engine.plan.cli`: ``pipecast schedule``.

Nothing here imports torch or the runtime; ``import engine.plan`` stays light (a test enforces it).
"""
from .build import MAX_PLAN_FORWARDS, SCHEDULES, Action, Message, Op, Plan, build_plan, schedule_name

__all__ = ["MAX_PLAN_FORWARDS", "SCHEDULES", "Action", "Message", "Op", "Plan", "build_plan", "schedule_name"]
