"""One executor for every plan: runs one pipeline rank's actions with ``forward_step`` / ``backward_step``.

The schedule functions of ``engine.schedules`` (and anyone with a :class:`~engine.plan.Plan`) hand it a plan; the
executor derives everything else from the plan's actions:

* **Communication** (``Plan.input_message`` / ``output_message`` / ``link_order``).  A send is posted non-blocking
  right after the action that produced the tensor and never waits for the receiver.  Its handle is waited (and the
  sent storage released) at the first later step where the receiver has provably posted the matching receive -- the
  step consuming a message the receiver sent after posting it (gloo offers no completion poll); in evaluation, where
  nothing flows back, ``2*P*C`` steps later; else at the end of the step.  Receives are posted in the *sender's*
  order on every link (``Plan.link_order(src, dst)``), so they match one to one even on a transport that ignores
  tags -- also with ``P = 2`` and interleaving, where activations and gradients share one pair of ranks (public bug
  B02) -- and each is waited just before the action that consumes it.  Each message kind also has its own tag
  (``engine.runtime.p2p``).  This is the communication model of the plan validator: a plan it accepts cannot deadlock here.
* Receives are posted ``prefetch`` actions ahead (:func:`default_prefetch`): with ``config.overlap_p2p_comm`` the
  receives of the next :data:`OVERLAP_PREFETCH` actions are kept posted (prefetched, waited right before use);
  otherwise those of the next action on NCCL (Megatron's lock-step pairing) and of the next three on gloo (gloo
  transfers a message only once its receive is posted).  The ops of one exchange point (the send of an action plus
  the receives posted after it) go out in Megatron's batched order with ``config.batch_p2p_comm`` (one
  ``batch_isend_irecv`` group on NCCL; gloo has no groups), otherwise in Megatron's even/odd order.
* Negotiated shapes (``variable_seq_lengths``): each message is preceded by a shape message; the shape receives
  follow the rules above, the data receive is posted (in the sender's order) once its shape has been read.
* ``deallocate_pipeline_outputs``: a sent output is shrunk right after its send is posted (the send holds an alias
  of its storage until it is waited), and its backward runs through ``custom_backward``.
* Partial activation checkpointing by microbatch (``checkpoint_activations_microbatch = (k mod (W+1)) >= K`` for
  forward step ``k``, spec 3.1), ``is_first_microbatch`` (microbatch 0 of each model chunk, through
  ``check_first_val_step``), ``current_microbatch`` (-> ``set_current_microbatch``).
* Grad / param sync hooks at Megatron-Core's points (spec 1.9, 1.17, 3.3, 3.8): ``no_sync_func`` entered at the
  start; left before the last forward (no pipelining), before the last backward (1F1B; with ``grad_sync_func`` only
  on pipeline rank 0, the others call ``grad_sync_func`` at the end), around the last backward of each model chunk
  or each ``grad_sync_func`` call timed by ``k - r`` (interleaved); ``param_sync_func`` for chunks 0 and 1 at the
  start and chunk ``c >= 2`` at forward step ``k`` when step ``k + r`` is the first microbatch of chunk ``c - 1``;
  ``finalize_model_grads_func(models, total_num_tokens or None, pg_collection=..., force_all_reduce=...)`` at the end
  of a training step.
* Spans to a tracer (``engine.runtime.tracing``): ``"compute"`` around each action (label ``"F c1 mb3"``), ``"p2p"`` around
  each receive wait (``"recv act c0 mb2"``) and send wait (``"wait send"``), ``"sync"`` around hooks.

Per-rank communication schedules are compiled once per (plan, rank, prefetch) and cached (:func:`compile_rank`,
:func:`program_for`); the per-action path does list indexing only.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .p2p import TAG_ACT, TAG_ACT_SHAPE, TAG_GRAD, TAG_GRAD_SHAPE, decode_shape, encode_shape
from ..plan import Message, Op, Plan, build_plan
from .step import (ChunkHooks, backward_step, check_first_val_step, deallocate_output_tensor, run_forward,
                   sendable_output)
from .tracing import current_tracer

__all__ = ["OVERLAP_PREFETCH", "GLOO_PREFETCH", "NCCL_PREFETCH", "default_prefetch", "RankProgram", "Step", "Recv",
           "compile_rank", "program_for", "cached_program", "ExecutionContext", "execute"]

OVERLAP_PREFETCH = 3
"""Actions ahead whose receives are kept posted with ``overlap_p2p_comm``."""
GLOO_PREFETCH = 3
"""Without ``overlap_p2p_comm`` on gloo: receives of the next three actions are posted.  gloo moves a message only
once its receive is posted (measured here: an 8 MiB message posted late costs ~10 ms of transfer on the critical
path, posted early ~0.03 ms), so posting early lets the transfer run during the current action.  Three rather than
two: in interleaved 1F1B a wrap-around message is sent well before its consumer is the next action
(``benchmarks/p2p_stalls.py``, P=2, V=2, M=8 on 2 cores: median step 112 vs 119 ms unpinned, 117-132 vs 138-143 ms
pinned; 1F1B 105 vs 107 ms)."""
NCCL_PREFETCH = 1
"""Without ``overlap_p2p_comm`` on NCCL: only the next action's receives, grouped with the current send -- the
pairing of Megatron's lock-step exchanges (a receive posted earlier would hold the pair's stream)."""


def default_prefetch(config, communicator) -> int:
    """Actions ahead whose receives the executor posts, for ``config`` on ``communicator``'s transport."""
    if config.overlap_p2p_comm:
        return OVERLAP_PREFETCH
    return NCCL_PREFETCH if getattr(communicator, "grouped", False) else GLOO_PREFETCH

# posting order of an exchange point's ops: key = (is_send, kind) -> rank within the exchange point
_BATCHED_ORDER = {(True, "grad"): 0, (False, "act"): 1, (True, "act"): 2, (False, "grad"): 3}  # Megatron batched
_EVEN_ORDER = {(True, "act"): 0, (False, "act"): 1, (True, "grad"): 2, (False, "grad"): 3}
_ODD_ORDER = {(False, "act"): 0, (True, "act"): 1, (False, "grad"): 2, (True, "grad"): 3}


def _exchange_order(batched: bool, rank: int) -> dict:
    """Posting order of an exchange point's ops: Megatron's batched order, else its even/odd order by rank parity."""
    return _BATCHED_ORDER if batched else (_EVEN_ORDER if rank % 2 == 0 else _ODD_ORDER)


@dataclass(slots=True)
class Recv:
    """One incoming message of a rank, in the sender's order on its link."""

    kind: str          # "act" or "grad"
    peer: int          # sender's pipeline rank
    tag: int
    shape_tag: int
    label: str         # "recv act c0 mb2" (destination chunk and microbatch)
    consumer: int      # index of the step that consumes it
    message: Message = None


@dataclass(slots=True)
class Step:
    """One action of a rank with everything the executor needs precomputed."""

    forward: bool
    chunk: int
    microbatch: int
    label: str
    index: int            # forward: forward step k on this rank; backward: backward step index
    slot: int             # forward step index whose saved tensors a backward consumes (= index for forwards)
    recv: int             # index into RankProgram.recvs or -1
    send_peer: int        # pipeline rank the output goes to, or -1
    send_kind: str
    first_stage: bool     # this chunk holds the model input
    last_stage: bool      # this chunk computes the loss
    posts: tuple          # receives to post at the exchange point after this step
    send_order: int       # position of the send among the exchange point's ops (batched / even-odd)
    send_id: int = -1     # index of this step's send among the rank's sends
    reap: tuple = ()      # sends whose handles are waited at this step (their receive is known to be posted)


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
    hook_cache: dict = field(default_factory=dict, compare=False, repr=False)  # (grad?, param?) -> hook events


def _consumer_map(plan: Plan, rank: int):
    """The rank's incoming messages: ``(recvs, step_recv, links)`` -- the :class:`Recv` records grouped by sending
    rank, each link in the sender's order; the recv index each step consumes (-1: none); per sender, its recv
    indices in order.  Raises ``ValueError`` when messages do not pair up."""
    acts = plan.actions[rank]
    wanted = {}
    for i, a in enumerate(acts):
        m = plan.input_message(rank, a)
        if m is not None:
            if m in wanted:
                raise ValueError(f"plan is invalid: rank {rank} consumes {m} twice (actions {wanted[m]} and {i})")
            wanted[m] = i
    sources = sorted({m.src for m in wanted})
    recvs, step_recv = [], [-1] * len(acts)
    links = {}
    for src in sources:
        order = plan.link_order(src, rank)
        idx = []
        for m in order:
            if m not in wanted:
                raise ValueError(f"plan is invalid: rank {src} sends {m} but rank {rank} never consumes it")
            consumer = wanted.pop(m)
            kind = m.kind
            recvs.append(Recv(kind, src, TAG_ACT if kind == "act" else TAG_GRAD,
                              TAG_ACT_SHAPE if kind == "act" else TAG_GRAD_SHAPE,
                              f"recv {kind} c{m.dst_chunk} mb{m.microbatch}", consumer, m))
            step_recv[consumer] = len(recvs) - 1
            idx.append(len(recvs) - 1)
        links[src] = idx
    if wanted:
        m = next(iter(wanted))
        raise ValueError(f"plan is invalid: rank {rank} waits for {m} but rank {m.src} never sends it")
    return recvs, step_recv, links


def compile_rank(plan: Plan, rank: int, prefetch: int = 1, batched: bool = True) -> RankProgram:
    """Compile ``plan`` for pipeline rank ``rank``.

    ``prefetch``: how many actions ahead receives are posted (>= 1).  ``batched``: Megatron's batched op order at
    an exchange point (else even/odd order by rank parity).

    Raises:
        ValueError: ``rank`` outside the plan, ``prefetch < 1``, or a plan whose messages do not pair up (a rank
            consumes a message nobody sends, or a sent message is never consumed).
    """
    if not 0 <= rank < plan.pp_size:
        raise ValueError(f"rank={rank} is outside the plan's pipeline of {plan.pp_size} ranks")
    if prefetch < 1:
        raise ValueError(f"prefetch={prefetch}: receives must be posted at least one action ahead")
    acts = plan.actions[rank]
    recvs, step_recv, posts_at = _receive_schedule(plan, rank, prefetch, batched)
    order_of = _exchange_order(batched, rank)
    reap_at = _reap_points(plan, rank, prefetch, batched, recvs)

    fwd_slot, steps = {}, []
    n_fwd = n_bwd = n_send = 0
    reaps = [[] for _ in acts]
    for i, a in enumerate(acts):
        out = plan.output_message(rank, a)
        forward = a.op is Op.FORWARD
        if a.op is Op.WEIGHT:
            raise ValueError(f"plan has a W (weight-gradient) action {a} on rank {rank}; the executor runs F and B "
                             "actions only")
        if forward:
            index = slot = n_fwd
            fwd_slot[(a.chunk, a.microbatch)] = n_fwd
            n_fwd += 1
        else:
            index = n_bwd
            n_bwd += 1
            slot = fwd_slot.get((a.chunk, a.microbatch), -1)
            if slot < 0:
                raise ValueError(f"plan is invalid: rank {rank} runs {a} before the forward of the same microbatch")
        kind = "" if out is None else out.kind
        send_id = -1
        if out is not None:
            send_id, n_send = n_send, n_send + 1
            j = reap_at.get(out)
            if j is None and plan.forward_only and plan.schedule in ("1f1b", "interleaved"):
                # nothing flows back in evaluation: every rank runs the schedule table in order, so the receiver
                # reaches this message without any later action of ours; waiting it 2*P*C steps later is safe
                # and keeps at most that many sent outputs alive
                j = i + 2 * plan.num_stages
            if j is not None and max(j, i + 1) < len(acts):  # else: waited at the end of the step
                reaps[max(j, i + 1)].append(send_id)
        steps.append(Step(forward, a.chunk, a.microbatch, a.label, index, slot, step_recv[i],
                          -1 if out is None else out.dst, kind, plan.is_first_stage(rank, a.chunk),
                          plan.is_last_stage(rank, a.chunk), posts_at[i + 1],
                          order_of[(True, kind)] if kind else 0, send_id))
    for st, r in zip(steps, reaps):
        st.reap = tuple(r)
    return RankProgram(plan, rank, prefetch, tuple(steps), tuple(recvs), posts_at[0], n_fwd, plan.warmup[rank],
                       n_send)


def _receive_schedule(plan: Plan, rank: int, prefetch: int, batched: bool):
    """``(recvs, step_recv, posts_at)``: the rank's incoming messages (sender order per link), the message each step
    consumes, and the receives posted at each exchange point (``posts_at[e + 1]``: after step ``e``; ``e = -1`` is
    the start): per link in sender order, every message consumed by steps ``e+1 .. e+prefetch``."""
    acts = plan.actions[rank]
    recvs, step_recv, links = _consumer_map(plan, rank)
    order_of = _exchange_order(batched, rank)
    position = {}
    for src, idx in links.items():
        for pos, r in enumerate(idx):
            position[r] = (src, pos)
    next_unposted = {src: 0 for src in links}
    posts_at = []
    for e in range(-1, len(acts)):
        batch = []
        for j in range(e + 1, min(e + 1 + prefetch, len(acts))):
            r = step_recv[j]
            if r < 0:
                continue
            src, pos = position[r]
            while next_unposted[src] <= pos:
                batch.append(links[src][next_unposted[src]])
                next_unposted[src] += 1
        if plan.pp_size > 2:  # each neighbour sends one kind: sorting by kind keeps every link's order
            batch.sort(key=lambda r: order_of[(False, recvs[r].kind)])
        posts_at.append(tuple(batch))
    return recvs, step_recv, posts_at


def _reap_points(plan: Plan, rank: int, prefetch: int, batched: bool, recvs) -> dict:
    """For each message this rank sends: the first of its steps at which the receiver has *provably* posted the
    matching receive -- the step that consumes a message the receiver sent at or after the exchange point where it
    posted that receive.  Waiting the send handle there never waits for the receiver's progress (the model the
    plan validator assumes); sends without such a point are waited at the end of the step."""
    out = {}
    peers = {m.dst for a in plan.actions[rank] if (m := plan.output_message(rank, a)) is not None}
    for q in peers:
        q_recvs, _, q_posts = _receive_schedule(plan, q, prefetch, batched)
        posted = {q_recvs[r].message: e for e, batch in enumerate(q_posts, start=-1) for r in batch}
        # messages q -> rank: (exchange index of q's send, step of this rank that consumes it)
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


@functools.lru_cache(maxsize=256)
def cached_program(schedule: str, pp_size: int, num_microbatches: int, num_model_chunks: int, group_size,
                   forward_only: bool, rank: int, prefetch: int, batched: bool) -> RankProgram:
    """:func:`compile_rank` of ``build_plan(...)``, cached by the plan's parameters (no per-call plan scans)."""
    plan = build_plan(schedule, pp_size, num_microbatches, num_model_chunks, group_size, forward_only)
    return compile_rank(plan, rank, prefetch, batched)


_BY_PLAN: dict = {}


def program_for(plan: Plan, rank: int, prefetch: int = 1, batched: bool = True) -> RankProgram:
    """:func:`compile_rank` cached per plan object (keeps the last 64 plans)."""
    key = (id(plan), rank, prefetch, batched)
    hit = _BY_PLAN.get(key)
    if hit is not None and hit.plan is plan:
        return hit
    program = compile_rank(plan, rank, prefetch, batched)
    if len(_BY_PLAN) >= 64:
        _BY_PLAN.pop(next(iter(_BY_PLAN)))
    _BY_PLAN[key] = program
    return program


# ---- grad / param sync hooks --------------------------------------------------------------------------------------
# events: ("enable",) leave no_sync; ("disable",) enter no_sync; ("grad", c) grad_sync_func for chunk c (None:
# the whole model of a one-chunk rank); ("param", c) param_sync_func for chunk c.

def _events_for(plan: Plan, rank: int, has_grad_sync: bool, has_param_sync: bool):
    acts = plan.actions[rank]
    n = len(acts)
    before = [[] for _ in range(n)]
    after = [[] for _ in range(n)]
    start, end = [("disable",)], []
    last_m = plan.num_microbatches - 1
    fwd_idx = [i for i, a in enumerate(acts) if a.op is Op.FORWARD]
    bwd_idx = [i for i, a in enumerate(acts) if a.op is Op.BACKWARD]
    if plan.schedule == "no_pipelining":
        if fwd_idx:
            before[fwd_idx[-1]].append(("enable",))
        return start, before, after, end
    if plan.forward_only or not bwd_idx:
        return start, before, after, [("enable",)]
    if plan.schedule != "interleaved":
        if not has_grad_sync or rank == 0:
            before[bwd_idx[-1]].append(("enable",))
        else:
            end += [("enable",), ("grad", None)]
        return start, before, after, end
    # interleaved (spec 3.2, 3.3, 3.8)
    chunks, total = plan.num_model_chunks, len(fwd_idx)
    if has_param_sync:
        start += [("param", c) for c in range(min(2, chunks))]
        for k, i in enumerate(fwd_idx):
            j = k + rank
            if j < total and acts[fwd_idx[j]].microbatch == 0:
                c2 = acts[fwd_idx[j]].chunk + 1
                if 1 < c2 < chunks:
                    before[i].append(("param", c2))
    synced = set()
    for k, i in enumerate(bwd_idx):
        a = acts[i]
        if not has_grad_sync and a.microbatch == last_m:
            before[i].append(("enable",))
            after[i].append(("disable",))
        if has_grad_sync:
            j = k - rank
            if j >= 0 and acts[bwd_idx[j]].microbatch == last_m:
                c2 = acts[bwd_idx[j]].chunk
                after[i] += [("enable",), ("grad", c2), ("disable",)]
                synced.add(c2)
    end.append(("enable",))
    if has_grad_sync:
        end += [("grad", c) for c in range(chunks) if c not in synced]
    return start, before, after, end


class _GradSync:
    """Tracks the ``no_sync`` context and runs hook events."""

    def __init__(self, config, models, tracer):
        funcs = config.no_sync_func
        self.no_sync = [] if funcs is None else (list(funcs) if isinstance(funcs, (list, tuple)) else [funcs])
        self.grad_sync = config.grad_sync_func
        self.param_sync = config.param_sync_func
        self.models = models
        self.tracer = tracer
        self.stack: Optional[contextlib.ExitStack] = None

    @staticmethod
    def _pick(funcs, chunk):
        return funcs[chunk] if isinstance(funcs, (list, tuple)) else funcs

    def run(self, events) -> None:
        for ev in events:
            what = ev[0]
            if what == "disable":
                if self.stack is None:
                    self.stack = contextlib.ExitStack()
                    for f in self.no_sync:
                        self.stack.enter_context(f())
            elif what == "enable":
                if self.stack is not None:
                    stack, self.stack = self.stack, None
                    stack.close()
            elif what == "grad":
                c = ev[1]
                with self.tracer.span("sync", f"grad_sync c{0 if c is None else c}"):
                    params = self.models[0 if c is None else c].parameters()
                    self._pick(self.grad_sync, 0 if c is None else c)(params)
            else:  # param
                c = ev[1]
                with self.tracer.span("sync", f"param_sync c{c}"):
                    self._pick(self.param_sync, c)(self.models[c].parameters())

    def close(self) -> None:
        self.run((("enable",),))


# ---- execution ----------------------------------------------------------------------------------------------------

@dataclass
class ExecutionContext:
    """What one call of the executor runs with (built by the schedule functions).

    ``act_shape`` / ``grad_shape``: receive-buffer shapes (``[s, b, h]``) of activations and gradients, ignored when
    the communicator negotiates shapes.  ``vp_stages``: pass ``vp_stage=chunk`` to ``forward_step`` (interleaved).
    ``per_stage_last``: pass ``is_last_stage`` from the plan (pipelined); False passes Megatron's default True.
    ``chunk_hooks``: each model chunk's :class:`~engine.runtime.step.ChunkHooks` (resolved by the schedule function before
    its cross-rank agreement); None resolves them here.
    """

    forward_step_func: Callable
    data_iterators: Sequence[Any]
    models: Sequence[torch.nn.Module]
    config: Any
    communicator: Any
    num_microbatches: int
    act_shape: Optional[tuple] = None
    grad_shape: Optional[tuple] = None
    collect_non_loss_data: bool = False
    first_val_step: Optional[bool] = None
    cp_group_size: int = 1
    vp_stages: bool = False
    per_stage_last: bool = True
    checkpoint: bool = True
    pg_collection: Any = None
    force_all_reduce: bool = False
    finalize_models: Any = None
    before_finalize: Optional[Callable[[], None]] = None
    tracer: Any = None
    chunk_hooks: Optional[Sequence[ChunkHooks]] = None


def execute(program: RankProgram, ctx: ExecutionContext) -> list:
    """Run one step of ``program`` on this rank; return ``forward_data_store`` (the loss stage's reduced losses,
    one per microbatch in microbatch order; ``[]`` on every other rank).

    Raises whatever ``forward_step`` / ``backward_step`` / the hooks raise, and ``RuntimeError`` when an output does
    not match the receive shape / ``pipeline_dtype`` its receiver expects (it would otherwise hang or corrupt).
    """
    runner = _Runner(program, ctx)
    try:
        return runner.run()
    finally:
        runner.sync.close()


class _Runner:
    __slots__ = ("p", "ctx", "comm", "config", "tracer", "bufs", "works", "shape_works", "send_works", "sync",
                 "negotiate", "batched", "hooks", "order_of", "next_data", "late")

    def __init__(self, program: RankProgram, ctx: ExecutionContext):
        self.p = program
        self.ctx = ctx
        self.comm = ctx.communicator
        self.config = ctx.config
        self.tracer = ctx.tracer if ctx.tracer is not None else current_tracer()
        n = len(program.recvs)
        self.bufs = [None] * n
        self.works = [None] * n
        self.shape_works = [None] * n
        self.send_works = [None] * program.num_sends  # per send: its handles until reaped (or the end)
        self.late = []  # negotiated shapes: data-send handles waited at the end of the step
        self.next_data = {}  # negotiated shapes: per sender, the first recv whose data receive is not posted yet
        for r, rec in enumerate(program.recvs):
            self.next_data.setdefault(rec.peer, r)
        self.sync = _GradSync(ctx.config, ctx.models, self.tracer)
        self.negotiate = bool(n or any(s.send_peer >= 0 for s in program.steps)) and self.comm.negotiates_shapes
        self.batched = bool(ctx.config.batch_p2p_comm)
        self.order_of = _exchange_order(self.batched, program.rank)
        key = (ctx.config.grad_sync_func is not None, ctx.config.param_sync_func is not None)
        hooks = program.hook_cache.get(key)
        if hooks is None:
            hooks = program.hook_cache[key] = _events_for(program.plan, program.rank, *key)
        self.hooks = hooks

    # -- communication ----------------------------------------------------------------------------------------
    def _exchange(self, send: Optional[tuple], posts: tuple) -> None:
        """Post an exchange point: the send ``(tensor, step)`` (or None) and the receives ``posts``."""
        comm, recvs = self.comm, self.p.recvs
        ops, targets = [], []
        for r in posts:
            rec = recvs[r]
            if self.negotiate:
                buf = comm.new_shape_buffer()
                self.bufs[r] = buf
                ops.append((False, buf, rec.peer, rec.shape_tag))
            else:
                shape = self.ctx.act_shape if rec.kind == "act" else self.ctx.grad_shape
                buf = comm.new_buffer(shape)
                self.bufs[r] = buf
                ops.append((False, buf, rec.peer, rec.tag))
            targets.append(r)
        if send is not None:
            tensor, st = send
            peer, kind, order = st.send_peer, st.send_kind, st.send_order
            tag = TAG_ACT if kind == "act" else TAG_GRAD
            sends = []
            if self.negotiate:
                sends.append((True, encode_shape(tensor.shape, tensor.device), peer,
                              TAG_ACT_SHAPE if kind == "act" else TAG_GRAD_SHAPE))
            sends.append((True, tensor, peer, tag))
            # place the send by its exchange-point order among the receives (receives of a kind keep link order)
            order_of = self.order_of
            at = sum(1 for r in targets if order_of[(False, recvs[r].kind)] < order)
            ops[at:at] = sends
            targets[at:at] = [-1] * len(sends)
        if not ops:
            return
        works = comm.post(ops, self.batched)
        if send is not None:
            self.send_works[send[1].send_id] = [w for r, w in zip(targets, works) if r < 0]
        for r, w in zip(targets, works):
            if r < 0:
                continue
            if self.negotiate:
                self.shape_works[r] = w
            else:
                self.works[r] = w

    def _reap(self, send_ids, final: bool = False) -> None:
        """Wait the handles of sends whose receives are known to be posted (frees sent / deallocated storage).

        With negotiated shapes only the shape message's receive is posted ahead (the data receive follows once the
        shape is read), so before the end of the step only the shape send is waited; the data send is kept."""
        with self.tracer.span("p2p", "wait send"):
            works = self.send_works
            for sid in send_ids:
                handles = works[sid]
                if self.negotiate and not final:
                    handles[0].wait()
                    self.late.append(handles[1])
                else:
                    for w in handles:
                        w.wait()
                works[sid] = None

    def _take(self, r: int):
        """Wait for incoming message ``r`` and return its tensor.

        Raises ``RuntimeError`` naming the sending pipeline rank when the wait fails (it died, raised, or did not send
        within the pipeline group's timeout), and when a negotiated shape cannot be a pipeline message."""
        rec = self.p.recvs[r]
        try:
            with self.tracer.span("p2p", rec.label):
                if self.negotiate:
                    self._post_data_upto(rec.peer, r)
                self.works[r].wait()
                buf = self.bufs[r]
                self.works[r] = None
        except RuntimeError as exc:
            if "pipeline message" in str(exc):
                raise
            ranks = getattr(self.comm, "global_ranks", None)
            peer = f"pipeline rank {rec.peer}" + (f" (global rank {ranks[rec.peer]})" if ranks else "")
            if any(w in str(exc).lower() for w in ("timed out", "timeout")):
                why = (f"{peer} sent nothing within the pipeline group's timeout: it may be slow rather than dead "
                       "(a long step, evaluation or checkpoint on that stage, or an overloaded machine) -- if it is "
                       "healthy, raise the timeout (parallel.timeout_s in pipecast train, or the timeout of the "
                       "process groups); else it is stuck (see its error)")
            else:
                why = f"{peer} died, raised or is stuck (see its error)"
            raise RuntimeError(f"pipeline rank {self.p.rank}: {rec.label} from {peer} failed: {exc} -- {why}"
                               ) from exc
        self.bufs[r] = None
        return buf

    def _post_data_upto(self, peer: int, r: int) -> None:
        """Negotiated shapes: read the shapes and post the data receives of ``peer``'s messages up to ``r``, in the
        sender's order (recvs of one sender are contiguous and in link order)."""
        recvs, comm = self.p.recvs, self.comm
        k = self.next_data[peer]
        while k <= r:
            self.shape_works[k].wait()
            self.shape_works[k] = None
            shape = decode_shape(self.bufs[k])
            self._check_negotiated(shape, f"the shape handshake of {recvs[k].label} from pipeline rank {peer} "
                                          "announced")
            buf = comm.new_buffer(shape)
            self.bufs[k] = buf
            self.works[k] = comm.irecv(buf, peer, recvs[k].tag)
            k += 1
        self.next_data[peer] = k

    def _check_negotiated(self, shape: tuple, what: str) -> None:
        """``variable_seq_lengths``: a pipeline message is ``[s, b, hidden_size]``; the hidden size is the one
        dimension that cannot vary between microbatches (checked when ``config.hidden_size`` is set), so a wrong
        tensor is caught here instead of being received silently at its wrong size."""
        hidden = getattr(self.config, "hidden_size", 0) or 0
        if not shape or min(shape) < 0 or (hidden > 0 and shape[-1] != hidden):
            raise RuntimeError(f"{what} shape {tuple(shape)} on pipeline rank {self.p.rank}, but a pipeline message "
                               f"is [s, b, hidden_size={hidden or 'any'}] with variable_seq_lengths; the sending model "
                               "chunk must return [s, b, h] activations with h = config.hidden_size")

    def _check_send(self, tensor, st) -> None:
        if tensor is None and not st.forward:
            raise RuntimeError(f"{st.label} on pipeline rank {self.p.rank}: the gradient of the model chunk's input "
                               "is None because the chunk's output does not depend on its input (the tensor given "
                               "to set_input_tensor, which requires grad); use that tensor in forward, without "
                               ".detach() or torch.no_grad(), so the gradient can flow to the previous stage")
        if not isinstance(tensor, torch.Tensor):
            raise RuntimeError(f"{st.label} on pipeline rank {self.p.rank} produced {type(tensor).__name__}, not a "
                               "tensor; a model chunk that feeds the next stage must return one tensor [s, b, h]")
        dtype = self.config.pipeline_dtype
        if tensor.dtype != dtype:
            raise RuntimeError(f"{st.label} on pipeline rank {self.p.rank} produced a {tensor.dtype} "
                               f"{'activation' if st.forward else 'gradient'} but config.pipeline_dtype={dtype}; "
                               "the receiver would misread it: cast the chunk output or set pipeline_dtype")
        if self.negotiate:
            self._check_negotiated(tuple(tensor.shape), f"{st.label} produced")
        else:
            # an activation has this rank's output shape (= the shape its gradient comes back in), a gradient this
            # rank's input shape (= the activation receive shape)
            expected = self.ctx.grad_shape if st.forward else self.ctx.act_shape
            if tuple(tensor.shape) != tuple(expected):
                raise RuntimeError(f"{st.label} on pipeline rank {self.p.rank} produced shape "
                                   f"{tuple(tensor.shape)} but the receiving stage expects {tuple(expected)} "
                                   "(from seq_length, micro_batch_size, hidden_size); pass the right sizes or set "
                                   "config.variable_seq_lengths=True")

    # -- the step ---------------------------------------------------------------------------------------------------
    def run(self) -> list:
        p, ctx, config = self.p, self.ctx, self.config
        tracer = self.tracer
        start, before, after, end = self.hooks
        sync = self.sync
        sync.run(start)
        store: list = []
        forward_only = p.plan.forward_only
        training = not forward_only
        dealloc = bool(config.deallocate_pipeline_outputs) and training
        k_ckpt = config.num_microbatches_with_partial_activation_checkpoints if ctx.checkpoint else None
        window = p.warmup + 1
        per_token = bool(getattr(config, "calculate_per_token_loss", False))
        tokens = torch.zeros([], dtype=torch.int, device=self.comm.device) if per_token else None
        saved_in = [None] * p.num_forwards
        saved_out = [None] * p.num_forwards
        fsf, iters, models, M = ctx.forward_step_func, ctx.data_iterators, ctx.models, ctx.num_microbatches
        chunk_hooks = ctx.chunk_hooks if ctx.chunk_hooks is not None else [ChunkHooks(m) for m in models]
        cp, collect, fvs = ctx.cp_group_size, ctx.collect_non_loss_data, ctx.first_val_step
        vp, per_stage_last = ctx.vp_stages, ctx.per_stage_last
        exchange, take = self._exchange, self._take

        exchange(None, p.initial_posts)
        for i, st in enumerate(p.steps):
            if before[i]:
                sync.run(before[i])
            if st.forward:
                c = st.chunk
                x = take(st.recv) if st.recv >= 0 else None
                if st.reap:
                    self._reap(st.reap)
                ckpt = None if k_ckpt is None else (st.index % window) >= k_ckpt
                first_mb = check_first_val_step(fvs, forward_only, st.microbatch == 0)
                with tracer.span("compute", st.label):
                    y, n = run_forward(chunk_hooks[c], fsf, iters[c], models[c], M, x, store, config, cp, collect, ckpt,
                                       first_mb, st.microbatch, c if vp else None,
                                       st.last_stage if per_stage_last else True)
                if per_token and n is not None:
                    tokens += n
                send = None
                if st.send_peer >= 0:
                    self._check_send(y, st)
                    y = sendable_output(y, dealloc)  # contiguous; owns its storage when it will be freed
                    send = (y.detach() if dealloc else y, st)
                if send is not None or st.posts:
                    exchange(send, st.posts)
                if training:
                    if dealloc and st.send_peer >= 0:
                        deallocate_output_tensor(y, True)
                    saved_in[st.slot] = x
                    saved_out[st.slot] = y
            else:
                gy = take(st.recv) if st.recv >= 0 else None
                if st.reap:
                    self._reap(st.reap)
                slot = st.slot
                x, y = saved_in[slot], saved_out[slot]
                saved_in[slot] = saved_out[slot] = None
                with tracer.span("compute", st.label):
                    gx = backward_step(x, y, gy, config)
                send = None
                if st.send_peer >= 0:
                    self._check_send(gx, st)
                    send = (gx, st)
                if send is not None or st.posts:
                    exchange(send, st.posts)
            if after[i]:
                sync.run(after[i])

        left = [sid for sid, w in enumerate(self.send_works) if w is not None]
        if left:
            self._reap(left, final=True)
        for w in self.late:
            w.wait()
        self.late.clear()
        if any(w is not None for w in self.works) or any(w is not None for w in self.shape_works):
            raise RuntimeError(f"pipeline rank {p.rank}: receives left unconsumed at the end of the step (plan bug)")
        sync.run(end)
        if training and config.finalize_model_grads_func is not None:
            models_arg = ctx.finalize_models if ctx.finalize_models is not None else list(models)
            if ctx.before_finalize is not None:
                ctx.before_finalize()
            with tracer.span("sync", "finalize_model_grads"):
                config.finalize_model_grads_func(models_arg, tokens if per_token else None,
                                                 pg_collection=ctx.pg_collection,
                                                 force_all_reduce=ctx.force_all_reduce)
        return store
