"""Lowering: from a :class:`~engine.plan.build.Plan` to each rank's program, in small pure passes.

The executor (:mod:`engine.runtime.executor`) runs a :class:`RankProgram`; the validator
(:func:`engine.plan.validate.validate_programs`) checks the very same programs for deadlock freedom.  The passes:

1. :func:`incoming` -- the rank's remote incoming messages, grouped by sender, each link in the sender's order
   (:meth:`Plan.link_order`), and which step consumes each;
2. :func:`receive_schedule` -- the receives posted at each exchange point: per link in sender order, every message
   consumed by the next ``prefetch`` steps (a receiver that posts in the sender's order matches one to one even on a
   transport that ignores tags);
3. :func:`reap_points` -- where each send handle is waited: the first step at which the receiver has *provably*
   posted the matching receive (the step consuming a message the receiver sent after posting it);
4. :func:`local_handovers` -- messages between two stages on the same rank (V placement) become local slots, with
   no P2P at all;
5. :func:`hook_events` -- the grad / param sync hook events, by the rule the plan's schedule entry names
   (:mod:`engine.plan.hooks`);
6. :func:`compile_rank` -- assembles the :class:`Step` list the executor indexes.

An exchange point is the moment after a step (or the start, index -1): the step's send and the receives posted
there go out together, in Megatron's batched order or its even/odd order by rank parity.  A compound cell
(:class:`~engine.plan.types.Compound`, e.g. DualPipeV's overlapped forward and backward) lowers to its parts as
consecutive steps, each with its own receive and send: a part's output goes out as soon as that part is done, which
never waits longer than sending all of the cell's outputs after its last part (the validator checks these programs
as the executor runs them).

With ``overlap=True`` the cells that can overlap (:func:`overlap_cells`: one forward and one backward, with or
without that backward's ``W``) run as one unit, the way DualPipe runs them: every input of the cell is waited (and
every send the cell's parts reap) before its first part starts, and the parts' sends and receive postings go out,
in part order, after its last part.  The passes account for it: a receive consumed inside a cell is posted before
the cell (the prefetch window is widened to whole cells) and a send posted by a cell is reaped after it.
Cells change no step's index, and ordering the exchange points by step index still orders them in time (a cell's
exchange points all happen at its end, in part order), so the reap rule is unchanged.  Pure: no torch.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .hooks import DISABLE, ENABLE, HookEvent, last_backward_hooks, last_weight_hooks
from .registry import find_schedule
from .types import Message, Op, Plan, looped_placement

__all__ = ["TAG_ACT", "TAG_GRAD", "TAG_ACT_SHAPE", "TAG_GRAD_SHAPE", "Recv", "Step", "RankProgram",
           "exchange_order", "incoming", "receive_schedule", "reap_points", "local_handovers", "hook_events",
           "overlap_cells", "cell_ends", "compile_rank", "program_for", "HookEvent", "ENABLE", "DISABLE"]


TAG_ACT, TAG_GRAD, TAG_ACT_SHAPE, TAG_GRAD_SHAPE = 1, 2, 3, 4
"""P2P tags: activations, gradients, and the shape messages that precede them with negotiated shapes."""
_TAGS = {"act": (TAG_ACT, TAG_ACT_SHAPE), "grad": (TAG_GRAD, TAG_GRAD_SHAPE)}

# posting order of an exchange point's ops: key = (is_send, kind) -> rank within the exchange point
_BATCHED_ORDER = {(True, "grad"): 0, (False, "act"): 1, (True, "act"): 2, (False, "grad"): 3}  # Megatron batched
_EVEN_ORDER = {(True, "act"): 0, (False, "act"): 1, (True, "grad"): 2, (False, "grad"): 3}
_ODD_ORDER = {(False, "act"): 0, (True, "act"): 1, (False, "grad"): 2, (True, "grad"): 3}


def exchange_order(batched: bool, rank: int) -> dict:
    """Posting order of an exchange point's ops: Megatron's batched order, else its even/odd order by rank parity."""
    return _BATCHED_ORDER if batched else (_EVEN_ORDER if rank % 2 == 0 else _ODD_ORDER)


@dataclass(slots=True)
class Recv:
    """One incoming message of a rank, in the sender's order on its link."""

    kind: str          # "act" (an activation, stage s -> s+1) or "grad" (a gradient, s+1 -> s)
    peer: int          # sender's pipeline rank
    tag: int
    shape_tag: int
    label: str         # "recv act F2.0": the message and the action that consumes it
    consumer: int      # index of the step that consumes it
    message: Message = None


@dataclass(slots=True)
class Step:
    """One action of a rank with everything the executor needs precomputed."""

    op: Op
    forward: bool
    chunk: int
    microbatch: int
    label: str
    index: int            # F: forward step k on this rank; B / W: backward / weight step index
    slot: int             # forward step index whose saved tensors B and W consume (= index for forwards)
    recv: int             # index into RankProgram.recvs or -1
    send_peer: int        # pipeline rank the output goes to, or -1
    send_kind: str
    first_stage: bool     # this chunk holds the model input
    last_stage: bool      # this chunk computes the loss
    posts: tuple          # receives to post at the exchange point after this step
    send_order: int       # position of the send among the exchange point's ops (batched / even-odd)
    send_id: int = -1     # index of this step's send among the rank's sends
    reap: tuple = ()      # sends whose handles are waited at this step (their receive is known to be posted)
    local_in: int = -1    # local hand-over slot this step consumes (stage on the same rank), or -1
    local_out: int = -1   # local hand-over slot this step fills, or -1


@dataclass(frozen=True)
class RankProgram:
    """A rank's compiled plan: steps, incoming messages, receive postings, sync-hook events."""

    plan: Plan
    rank: int
    prefetch: int
    steps: tuple
    recvs: tuple
    initial_posts: tuple
    num_forwards: int
    warmup: int
    num_sends: int = 0
    num_local: int = 0
    cells: tuple = ()  # (start, stop) step spans run as overlapped cells (compile_rank(..., overlap=True))
    hook_cache: dict = field(default_factory=dict, compare=False, repr=False)  # (grad?, param?) -> hook events

    def hooks(self, has_grad_sync: bool, has_param_sync: bool):
        """:func:`hook_events` of this rank, cached per hook combination."""
        key = (has_grad_sync, has_param_sync)
        events = self.hook_cache.get(key)
        if events is None:
            events = self.hook_cache[key] = hook_events(self.plan, self.rank, *key)
        return events

    def grid(self, mark: int | None = None) -> str:
        """The program as a text grid, one line per step (what it receives, sends, posts and waits);
        ``mark`` flags one step with ``>>`` (the executor's errors show the failing step so)."""
        lines = [f"pipeline rank {self.rank} program ({self.plan.schedule}, prefetch {self.prefetch}); "
                 f"start: post {_recv_names(self, self.initial_posts)}"]
        starts = {a: b for a, b in self.cells}
        for i, st in enumerate(self.steps):
            parts = [f"{'>>' if i == mark else '  '} {i:4d} {st.label:<12}"]
            if i in starts:
                parts.append(f"cell of steps {i}..{starts[i] - 1}: wait all inputs, run overlapped, then send")
            if st.recv >= 0:
                parts.append(f"wait {self.recvs[st.recv].label} from r{self.recvs[st.recv].peer}")
            if st.local_in >= 0:
                parts.append(f"take local #{st.local_in}")
            if st.reap:
                parts.append(f"wait sends {list(st.reap)}")
            if st.send_peer >= 0:
                parts.append(f"send {st.send_kind} #{st.send_id} to r{st.send_peer}")
            if st.local_out >= 0:
                parts.append(f"hand over local #{st.local_out}")
            if st.posts:
                parts.append(f"post {_recv_names(self, st.posts)}")
            lines.append(" | ".join(parts))
        return "\n".join(lines)


def _recv_names(program: RankProgram, posts) -> str:
    return "[" + ", ".join(program.recvs[r].label for r in posts) + "]"


# ---- pass 1: incoming messages -------------------------------------------------------------------------------------
def incoming(plan: Plan, rank: int):
    """``(recvs, step_recv, links)``: the rank's remote incoming messages as :class:`Recv` records grouped by sending
    rank (each link in the sender's order), the recv index each step consumes (-1: none), and per sender its recv
    indices in order.  Local hand-overs (sender == receiver) are left to :func:`local_handovers`.

    Raises:
        ValueError: messages do not pair up (consumed twice, never sent, or sent and never consumed).
    """
    wanted = {}
    for i, a in enumerate(plan.actions[rank]):
        m = plan.input_message(rank, a)
        if m is not None and m.src != rank:
            if m in wanted:
                raise ValueError(f"plan is invalid: rank {rank} consumes {m} twice (actions {wanted[m]} and {i})")
            wanted[m] = i
    recvs, step_recv, links = [], [-1] * len(plan.actions[rank]), {}
    for src in sorted({m.src for m in wanted}):
        links[src] = []
        for m in plan.link_order(src, rank):
            if m not in wanted:
                raise ValueError(f"plan is invalid: rank {src} sends {m} but rank {rank} never consumes it")
            consumer = wanted.pop(m)
            tag, shape_tag = _TAGS[m.kind]
            recvs.append(Recv(m.kind, src, tag, shape_tag, f"recv {m.kind} {plan.actions[rank][consumer]}",
                              consumer, m))
            step_recv[consumer] = len(recvs) - 1
            links[src].append(len(recvs) - 1)
    if wanted:
        m = next(iter(wanted))
        raise ValueError(f"plan is invalid: rank {rank} waits for {m} but rank {m.src} never sends it")
    return recvs, step_recv, links


# ---- pass 2: receive postings ---------------------------------------------------------------------------------------
def receive_schedule(plan: Plan, rank: int, prefetch: int, batched: bool, overlap: bool = False):
    """``(recvs, step_recv, posts_at)``: :func:`incoming` plus the receives posted at each exchange point
    (``posts_at[e + 1]``: after step ``e``; ``e = -1`` is the start): per link in sender order, every message
    consumed by steps ``e+1 .. e+prefetch``, widened to the end of an overlapped cell (``overlap``) that the window
    reaches into."""
    recvs, step_recv, links = incoming(plan, rank)
    n = len(plan.actions[rank])
    ends = cell_ends(plan, rank, overlap)
    order_of = exchange_order(batched, rank)
    position = {r: (src, pos) for src, idx in links.items() for pos, r in enumerate(idx)}
    next_unposted = {src: 0 for src in links}
    posts_at = []
    for e in range(-1, n):
        batch = []
        stop = min(e + 1 + prefetch, n)
        for j in range(e + 1, ends[stop - 1] + 1 if stop > e + 1 else stop):
            if step_recv[j] < 0:
                continue
            src, pos = position[step_recv[j]]
            while next_unposted[src] <= pos:
                batch.append(links[src][next_unposted[src]])
                next_unposted[src] += 1
        if plan.pp_size > 2:  # each neighbour sends one kind: sorting by kind keeps every link's order
            batch.sort(key=lambda r: order_of[(False, recvs[r].kind)])
        posts_at.append(tuple(batch))
    return recvs, step_recv, posts_at


# ---- pass 3: where sends are waited ---------------------------------------------------------------------------------
def reap_points(plan: Plan, rank: int, prefetch: int, batched: bool, recvs, overlap: bool = False) -> dict:
    """For each message this rank sends: the first of its steps at which the receiver has *provably* posted the
    matching receive -- the step that consumes a message the receiver sent at or after the exchange point where it
    posted that receive.  Waiting the send handle there never waits for the receiver's progress; sends without
    such a point are waited at the end of the step (or, in evaluation, ``2*P*C`` steps later: see
    :func:`compile_rank`)."""
    out = {}
    peers = {m.dst for m in plan.sends(rank) if m.dst != rank}
    for q in peers:
        q_recvs, _, q_posts = receive_schedule(plan, q, prefetch, batched, overlap)
        posted = {q_recvs[r].message: e for e, batch in enumerate(q_posts, start=-1) for r in batch}
        sent_by_q = {}
        for j, a in enumerate(plan.actions[q]):
            m = plan.output_message(q, a)
            if m is not None and m.dst == rank:
                sent_by_q[m] = j
        pairs = sorted((sent_by_q[rec.message], rec.consumer) for rec in recvs if rec.peer == q)
        suffix_min, best = [0] * len(pairs), None
        for k in range(len(pairs) - 1, -1, -1):
            best = pairs[k][1] if best is None else min(best, pairs[k][1])
            suffix_min[k] = best
        keys = [e for e, _ in pairs]
        for m, e_post in posted.items():
            if m.src != rank:
                continue
            k = bisect.bisect_left(keys, e_post)
            if k < len(keys):
                out[m] = suffix_min[k]
    return out


# ---- pass 4: local hand-overs ---------------------------------------------------------------------------------------
def local_handovers(plan: Plan, rank: int) -> tuple[list[int], list[int], int]:
    """``(local_in, local_out, count)``: per step, the local slot it consumes / fills (-1: none), for messages
    between two stages on this rank (V placement: stage ``P-1`` to ``P`` on the last rank)."""
    acts = plan.actions[rank]
    slot_of, local_in, local_out = {}, [-1] * len(acts), [-1] * len(acts)
    for i, a in enumerate(acts):
        m = plan.output_message(rank, a)
        if m is not None and m.dst == rank:
            slot_of[m] = local_out[i] = len(slot_of)
    for i, a in enumerate(acts):
        m = plan.input_message(rank, a)
        if m is not None and m.src == rank:
            if m not in slot_of:
                raise ValueError(f"plan is invalid: rank {rank} runs {a}, which needs {m}, but no action of the "
                                 "rank produces it")
            local_in[i] = slot_of[m]
    return local_in, local_out, len(slot_of)


# ---- pass 5: grad / param sync hook events --------------------------------------------------------------------------
def hook_events(plan: Plan, rank: int, has_grad_sync: bool, has_param_sync: bool):
    """``(start, before, after, end)``: the hook events run at the start, before / after each step, and at the end,
    by the rule of the plan's schedule entry (:attr:`ScheduleSpec.hooks`, :mod:`engine.plan.hooks`); a plan of no
    registered schedule (e.g. imported from CSV) follows :func:`~engine.plan.hooks.last_weight_hooks` when it splits
    the backward, else :func:`~engine.plan.hooks.last_backward_hooks`."""
    spec = find_schedule(plan.schedule)
    rule = spec.hooks if spec is not None else (last_weight_hooks if plan.splits_backward else last_backward_hooks)
    return rule(plan, rank, has_grad_sync, has_param_sync)


# ---- overlapped cells -----------------------------------------------------------------------------------------------
def overlap_cells(plan: Plan, rank: int) -> tuple[tuple[int, int], ...]:
    """The rank's compound spans that run overlapped (:meth:`Plan.overlap_cells`)."""
    return plan.overlap_cells(rank)


def cell_ends(plan: Plan, rank: int, overlap: bool) -> list[int]:
    """Per step of ``rank``, the last step of the overlapped cell holding it (itself outside cells, or without
    ``overlap``): when its sends and receive postings go out."""
    ends = list(range(len(plan.actions[rank])))
    for start, stop in overlap_cells(plan, rank) if overlap else ():
        ends[start:stop] = [stop - 1] * (stop - start)
    return ends


# ---- pass 6: the program --------------------------------------------------------------------------------------------
def compile_rank(plan: Plan, rank: int, prefetch: int = 1, batched: bool = True, overlap: bool = False
                 ) -> RankProgram:
    """Compile ``plan`` for pipeline rank ``rank`` (passes 1-4 of the module doc).

    ``prefetch``: how many actions ahead receives are posted (>= 1).  ``batched``: Megatron's batched op order at
    an exchange point (else even/odd order by rank parity).  ``overlap``: run :func:`overlap_cells` as units
    (module doc; :attr:`RankProgram.cells`).

    Raises:
        ValueError: ``rank`` outside the plan, ``prefetch < 1``, or a plan whose messages do not pair up (a rank
            consumes a message nobody sends, or a sent message is never consumed), or a ``B`` / ``W`` before the
            forward of its microbatch.
    """
    if not 0 <= rank < plan.pp_size:
        raise ValueError(f"rank={rank} is outside the plan's pipeline of {plan.pp_size} ranks")
    if prefetch < 1:
        raise ValueError(f"prefetch={prefetch}: receives must be posted at least one action ahead")
    acts = plan.actions[rank]
    recvs, step_recv, posts_at = receive_schedule(plan, rank, prefetch, batched, overlap)
    local_in, local_out, num_local = local_handovers(plan, rank)
    order_of = exchange_order(batched, rank)
    reap_at = reap_points(plan, rank, prefetch, batched, recvs, overlap)
    ends = cell_ends(plan, rank, overlap)
    fwd_slot, counts, steps, reaps = {}, {Op.FORWARD: 0, Op.BACKWARD: 0, Op.WEIGHT: 0}, [], [[] for _ in acts]
    n_send = 0
    for i, a in enumerate(acts):
        out = plan.output_message(rank, a)
        if out is not None and out.dst == rank:
            out = None  # a local hand-over, not a send
        index = counts[a.op]
        counts[a.op] += 1
        if a.op is Op.FORWARD:
            fwd_slot[(a.chunk, a.microbatch)] = slot = index
        else:
            slot = fwd_slot.get((a.chunk, a.microbatch), -1)
            if slot < 0:
                raise ValueError(f"plan is invalid: rank {rank} runs {a} before the forward of the same microbatch")
        send_id = -1
        if out is not None:
            send_id, n_send = n_send, n_send + 1
            j = _reap_step(plan, reap_at.get(out), i)
            if j is not None and max(j, ends[i] + 1) < len(acts):  # else: waited at the end of the step
                reaps[max(j, ends[i] + 1)].append(send_id)
        kind = "" if out is None else out.kind
        steps.append(Step(a.op, a.op is Op.FORWARD, a.chunk, a.microbatch, a.label, index, slot, step_recv[i],
                          -1 if out is None else out.dst, kind, plan.is_first_stage(rank, a.chunk),
                          plan.is_last_stage(rank, a.chunk), posts_at[i + 1],
                          order_of[(True, kind)] if kind else 0, send_id, (), local_in[i], local_out[i]))
    for st, r in zip(steps, reaps):
        st.reap = tuple(r)
    return RankProgram(plan, rank, prefetch, tuple(steps), tuple(recvs), posts_at[0], counts[Op.FORWARD],
                       plan.warmup[rank], n_send, num_local, overlap_cells(plan, rank) if overlap else ())


def _reap_step(plan: Plan, reap: int | None, i: int) -> int | None:
    """Where a send posted after step ``i`` is waited: its reap point, or in evaluation -- where nothing flows
    back and every rank runs its forwards in order, so the receiver reaches the message without any later action
    of ours -- ``2*P*C`` steps later (keeps at most that many sent outputs alive; looped placement only: under
    the V placement messages flow back to the sender)."""
    if reap is None and plan.forward_only and plan.stage_map == looped_placement(plan.pp_size, plan.num_model_chunks):
        return i + 2 * plan.num_stages
    return reap


_BY_PLAN: dict = {}


def program_for(plan: Plan, rank: int, prefetch: int = 1, batched: bool = True, overlap: bool = False
                ) -> RankProgram:
    """:func:`compile_rank` cached per plan object (keeps the last 64 plans)."""
    key = (id(plan), rank, prefetch, batched, overlap)
    hit = _BY_PLAN.get(key)
    if hit is not None and hit.plan is plan:
        return hit
    program = compile_rank(plan, rank, prefetch, batched, overlap)
    if len(_BY_PLAN) >= 64:
        _BY_PLAN.pop(next(iter(_BY_PLAN)))
    _BY_PLAN[key] = program
    return program
