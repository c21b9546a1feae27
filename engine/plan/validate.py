"""Plan validation: data flow, ordering and deadlock freedom of a :class:`~engine.plan.Plan` over all ranks.

Checks, in this order (the first violation raises :class:`PlanError` naming the rank, the action and why):

0. the compounds (:attr:`Plan.compounds`) are sorted, disjoint spans of two actions or more of each rank's list;
1. every action is an :class:`~engine.plan.Action` of the plan (``0 <= chunk < C``, ``0 <= microbatch < M``);
2. each ``(op, chunk, microbatch)`` runs at most once per rank, and every ``(chunk, microbatch)`` of the rank's
   ``C`` chunks runs exactly once per op: ``F`` always, ``B`` unless the plan is forward-only (then never), ``W``
   either never or for every ``(chunk, microbatch)``;
3. every backward runs after its forward, every weight-gradient pass after its backward (same rank);
4. every received message is produced by the right action: :meth:`Plan.input_message` of the consumer equals
   :meth:`Plan.output_message` of exactly one action kind of the producer rank (same microbatch), and every sent
   message has exactly one consumer;
5. no deadlock under the runtime's communication model: a send is posted (non-blocking) right after the action that
   produces it and never waits for the receiver; a receiver posts its receives in the sender's link order
   (:meth:`Plan.link_order`, so FIFO matching on a link always pairs the right tensors) and waits for a message
   just before the action that consumes it.  The plan is deadlock-free iff executing every rank's actions in order,
   each waiting only for its input message to have been produced, completes -- i.e. the graph of program-order and
   message edges is acyclic.

Messages are derived per ``(rank, op, chunk)``: the validator asks the plan for the messages of microbatch 0 and
carries the microbatch through (a message of microbatch ``m`` connects actions of microbatch ``m``), which holds
for every plan whose communication follows its virtual-stage topology; the last microbatch's messages are checked
against that rule, and a plan that breaks it is refused rather than misjudged.

Cost: linear in the number of actions (the deadlock check is one event-driven pass over the ranks: a rank runs
until it needs a message that is not produced yet, and is resumed when the producer passes that action);
``benchmarks/plan_scale.py`` times it for P=64, C=8, M=1024 (1M actions).  The dependency graph and the
execution order are cached on the plan, so :func:`engine.plan.simulate.simulate` reuses them.
"""
from __future__ import annotations

from .graph import PlanError, PlanGraph, deadlock_free_segments, memory_levels, plan_graph
from .lowering import cell_ends, compile_rank
from .simulate import max_buffered_messages
from .types import Plan

__all__ = ["PlanError", "PlanGraph", "plan_graph", "deadlock_free_segments", "validate_plan", "check_compounds", "max_buffered_messages",
           "memory_levels", "validate_programs"]


def validate_plan(plan: Plan) -> PlanGraph:
    """Validate ``plan`` over all ranks (all checks of the module doc); returns its :class:`PlanGraph`.

    Raises:
        PlanError: (a ``ValueError``) naming the first violating rank and action and why.
    """
    check_compounds(plan)
    graph = plan_graph(plan)
    deadlock_free_segments(plan)
    return graph


def check_compounds(plan: Plan) -> None:
    """Check 0 of the module doc: each rank's compound spans are sorted, disjoint and span two actions or more.

    Raises:
        PlanError: naming the rank, the first action of the bad span and why.
    """
    if plan.compounds is None:
        return
    if len(plan.compounds) != plan.pp_size:
        raise PlanError(None, None, None, f"compounds lists {len(plan.compounds)} ranks; the plan has "
                        f"{plan.pp_size} (one tuple of spans per rank)")
    for rank, spans in enumerate(plan.compounds):
        n, at = len(plan.actions[rank]), 0
        for span in spans:
            start, stop = span
            action = plan.actions[rank][start] if 0 <= start < n else None
            if not (at <= start and start + 2 <= stop <= n):
                raise PlanError(rank, start, action, f"compound span {tuple(span)} is not a span of two actions or "
                                f"more after the previous span (ends at {at}) within the rank's {n} actions")
            at = stop


# -- the compiled programs ---------------------------------------------------------------------------------------
def validate_programs(plan: Plan, prefetch: int = 1, batched: bool = True, overlap: bool = False) -> tuple:
    """Check the per-rank programs the executor runs (:func:`engine.plan.lowering.compile_rank`) for deadlock
    freedom, exactly as they post and wait; returns them.

    Model (the executor's on gloo): a rank runs its steps in order; before a step it waits its receive, which
    needs the sender to have posted the send (the sender finished the producing step), and the sends the program
    reaps there, which need the receiver to have posted the matching receive (the receiver finished the step
    after which it posts it; initial posts are made at the start); after the step it posts its send and the
    receives of that exchange point.  At the end every open send is waited.  Also checks that every receive is
    posted before it is waited.  With ``overlap`` an overlapped cell is one unit (:mod:`engine.plan.lowering`):
    its first step waits for everything its steps wait for, and its sends and postings count from its last step.

    Raises:
        PlanError: the plan is invalid (:func:`validate_plan`), or a program waits for something that never
            happens; the message names the rank, step and what it waits for, followed by that rank's program grid
            with the step marked.
    """
    validate_plan(plan)
    programs = tuple(compile_rank(plan, r, prefetch, batched, overlap) for r in range(plan.pp_size))
    ends = [cell_ends(plan, r, overlap) for r in range(plan.pp_size)]
    needs = [_program_needs(plan, programs, r, ends) for r in range(plan.pp_size)]
    done = [0] * plan.pp_size
    changed = True
    while changed:
        changed = False
        for r, program in enumerate(programs):
            n = len(program.steps)
            while done[r] < n and all(done[q] > j for q, j in needs[r][done[r]]):
                done[r] += 1
                changed = True
    for r, program in enumerate(programs):
        if done[r] < len(program.steps):
            raise _program_deadlock(plan, programs, needs, done, r)
    return programs


def _program_needs(plan: Plan, programs, rank: int, ends) -> list[list[tuple[int, int]]]:
    """Per step of ``rank``: the ``(rank q, step j)`` pairs that must have finished first (``j = -1``: the start);
    a step inside an overlapped cell hands its needs to the cell's first step (``ends``: :func:`cell_ends`)."""
    program = programs[rank]
    posted_at = {}  # message -> (rank, exchange point (-1: start) where its receiver posts the receive, its end)
    produced_at = {}  # message -> (rank, end of the step that sends it)
    for q, prog in enumerate(programs):
        for r in prog.initial_posts:
            posted_at[prog.recvs[r].message] = (q, -1, -1)
        for e, st in enumerate(prog.steps):
            for r in st.posts:
                posted_at[prog.recvs[r].message] = (q, e, ends[q][e])
            if st.send_peer >= 0:
                produced_at[plan.output_message(q, plan.actions[q][e])] = (q, ends[q][e])
    sent = [plan.output_message(rank, plan.actions[rank][i]) for i, st in enumerate(program.steps)
            if st.send_peer >= 0]
    needs, first = [], 0
    for i, st in enumerate(program.steps):
        first = first if i > 0 and ends[rank][i - 1] >= i else i  # the step the cell holding i starts at
        need = []
        if st.recv >= 0:
            m = program.recvs[st.recv].message
            if posted_at.get(m, (rank, i, i))[1] >= first:
                raise PlanError(rank, i, plan.actions[rank][i], f"waits for {m} before posting its receive "
                                                                f"(lowering bug)\n{program.grid(mark=i)}")
            need.append(produced_at[m])
        need += [posted_at[sent[sid]][::2] for sid in st.reap]
        needs.append([])
        needs[first] += [(q, j) for q, j in need if j >= 0 or q != rank]
    return needs


def _program_deadlock(plan: Plan, programs, needs, done, rank: int) -> PlanError:
    i = done[rank]
    waits = [f"rank {q} step {j} ({plan.actions[q][j] if j >= 0 else 'start'})" for q, j in needs[rank][i]
             if done[q] <= j]
    return PlanError(rank, i, plan.actions[rank][i], f"deadlock in the compiled program: step {i} waits for "
                                                     f"{', '.join(waits)}, which never finishes\n"
                                                     f"{programs[rank].grid(mark=i)}")
