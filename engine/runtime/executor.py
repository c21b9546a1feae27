"""One executor for every plan: runs one pipeline rank's actions with ``forward_step`` / ``backward_step``.

The schedule functions of ``engine.schedules`` (and anyone with a :class:`~engine.plan.Plan`) hand it a plan; the
executor derives everything else from the plan's actions:

* **Communication** (``Plan.input_message`` / ``output_message`` / ``link_order``).  A send is posted non-blocking
  right after the action that produced the tensor and never waits for the receiver.  Its handle is waited (and the
  sent storage released) at the first later step where the receiver has provably posted the matching receive -- the
  step consuming a message the receiver sent after posting it (gloo offers no completion poll); in evaluation, where
  nothing flows back, ``2*P*C`` steps later; else at the end of the step.  Receives are posted in the *sender's*
  order on every link (``Plan.link_order(src, dst)``), so they match one to one even on a transport that ignores
  tags -- also with ``P = 2`` and interleaving, where activations and gradients share one pair of ranks (NVIDIA/Megatron-LM#750)
  -- and each is waited just before the action that consumes it.  Each message kind also has its own tag
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
  forward step ``k``, as Megatron's interleaved schedule; modules marked by ``engine.runtime.recompute`` follow it),
  ``is_first_microbatch`` (microbatch 0 of each model chunk, through
  ``check_first_val_step``), ``current_microbatch`` (-> ``set_current_microbatch``).
* Grad / param sync hooks at Megatron-Core's points (``megatron/core/pipeline_parallel/schedules.py``): ``no_sync_func`` entered at the
  start; left before the last forward (no pipelining), before the last backward (1F1B; with ``grad_sync_func`` only
  on pipeline rank 0, the others call ``grad_sync_func`` at the end), around the last backward of each model chunk
  or each ``grad_sync_func`` call timed by ``k - r`` (interleaved); ``param_sync_func`` for chunks 0 and 1 at the
  start and chunk ``c >= 2`` at forward step ``k`` when step ``k + r`` is the first microbatch of chunk ``c - 1``;
  ``finalize_model_grads_func(models, total_num_tokens or None, pg_collection=..., force_all_reduce=...)`` at the end
  of a training step.
* Spans to a tracer (``engine.runtime.tracing``): ``"compute"`` around each action (label ``"F3.1"``), ``"p2p"`` around
  each receive wait (``"recv act F2.0"``) and send wait (``"wait send"``), ``"sync"`` around hooks.

Per-rank programs come from the plan layer's lowering (:mod:`engine.plan.lowering`: ``compile_rank``,
``program_for``, cached), the same programs the validator checks; the per-action path does list indexing only.
A failing step adds the rank's program grid, with that step marked, as a note to the exception.

Overlapped cells (a program compiled with ``overlap=True``, :attr:`RankProgram.cells`: DualPipeV's ``F+B+W`` cells,
Megatron's combined-1F1B ``F+B`` cells under ``config.overlap_moe_expert_parallel_comm``): the cell waits all its
inputs (and does its reaps) first, runs its forward on this thread and its backward (then its ``W``) on a helper
thread taking turns at the model's overlap points (:class:`engine.runtime.overlap.Cell`: one microbatch's expert
all-to-all is in flight while the other computes), then sends and posts for its parts in order; the hooks of its
steps run before / after the whole cell.  Each turn is a ``"compute"`` span of its action.

Split-backward plans (``W`` actions): ``B`` runs the input-gradient pass
(``engine.runtime.split_backward.backward_input_step``) and keeps what ``W`` needs per (chunk, microbatch); ``W``
computes and accumulates the weight gradients.  Local hand-overs (two stages on one rank, V placement) pass the
output as a fresh leaf (``detach().requires_grad_()``, as a receive would) and the gradient back, with no P2P.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..plan.build import Op
from ..plan.lowering import ENABLE, TAG_ACT, TAG_ACT_SHAPE, TAG_GRAD, TAG_GRAD_SHAPE, RankProgram, exchange_order
from .overlap import Cell
from .p2p import decode_shape, encode_shape
from .step import (ChunkCall, ChunkHooks, ForwardCall, backward_step, check_first_val_step, deallocate_output_tensor,
                   run_forward, sendable_grad, sendable_output)
from .tracing import current_tracer

__all__ = ["OVERLAP_PREFETCH", "GLOO_PREFETCH", "NCCL_PREFETCH", "default_prefetch", "ExecutionContext", "execute"]

OVERLAP_PREFETCH = 3
"""Actions ahead whose receives are kept posted with ``overlap_p2p_comm``."""
GLOO_PREFETCH = 3
"""Without ``overlap_p2p_comm`` on gloo: receives of the next three actions are posted.  gloo moves a message only
once its receive is posted, so posting early lets the transfer run during the current action; three rather than
two because in interleaved 1F1B a wrap-around message is sent well before its consumer is the next action.  The
measurements behind the choice: ``benchmarks/investigations/p2p_stalls.py`` (results in ``benchmarks/README.md``)."""
NCCL_PREFETCH = 1
"""Without ``overlap_p2p_comm`` on NCCL: only the next action's receives, grouped with the current send -- the
pairing of Megatron's lock-step exchanges (a receive posted earlier would hold the pair's stream)."""


def default_prefetch(config, communicator) -> int:
    """Actions ahead whose receives the executor posts, for ``config`` on ``communicator``'s transport."""
    if config.overlap_p2p_comm:
        return OVERLAP_PREFETCH
    return NCCL_PREFETCH if getattr(communicator, "grouped", False) else GLOO_PREFETCH

_NO_DEFERRAL = contextlib.nullcontext()


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
        """Run :class:`~engine.plan.lowering.HookEvent` s in order."""
        for ev in events:
            if ev.kind == "disable":
                if self.stack is None:
                    self.stack = contextlib.ExitStack()
                    for f in self.no_sync:
                        self.stack.enter_context(f())
            elif ev.kind == "enable":
                if self.stack is not None:
                    stack, self.stack = self.stack, None
                    stack.close()
            elif ev.kind == "grad":
                c = 0 if ev.chunk is None else ev.chunk
                with self.tracer.span("sync", f"grad_sync c{c}"):
                    self._pick(self.grad_sync, c)(self.models[c].parameters())
            else:  # param
                with self.tracer.span("sync", f"param_sync c{ev.chunk}"):
                    self._pick(self.param_sync, ev.chunk)(self.models[ev.chunk].parameters())

    def close(self) -> None:
        self.run((ENABLE,))


# ---- execution ----------------------------------------------------------------------------------------------------

@dataclass
class ExecutionContext:
    """What one call of the executor runs with (built by the schedule functions).

    ``act_shape`` / ``grad_shape``: receive-buffer shapes (``[s, b, h]``) of activations and gradients, ignored when
    the communicator negotiates shapes.  ``vp_stages``: pass ``vp_stage=chunk`` to ``forward_step`` (interleaved).
    ``per_stage_last``: pass ``is_last_stage`` from the plan (pipelined); False passes Megatron's default True.
    ``micro_batch_size``: the schedule's, to name a batch-first ``[b, s, h]`` output under negotiated shapes.
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
    micro_batch_size: Optional[int] = None
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
    except Exception as exc:
        _note_program(exc, program, runner.at)
        raise
    finally:
        runner.sync.close()


def _note_program(exc: BaseException, program: RankProgram, at: int) -> None:
    """Attach the rank's program grid with the failing step marked to ``exc`` (shown under its traceback)."""
    if hasattr(exc, "add_note") and len(program.steps) <= 512:
        exc.add_note(f"while running step {at} of this program:\n{program.grid(mark=at)}")


class _Runner:
    __slots__ = ("p", "ctx", "comm", "config", "tracer", "bufs", "works", "shape_works", "send_works", "sync",
                 "negotiate", "batched", "hooks", "order_of", "next_data", "late", "at", "store", "forward_only",
                 "dealloc", "k_ckpt", "window", "tokens", "saved_in", "saved_out", "local", "pending_w", "split",
                 "call", "chunks")

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
        self.order_of = exchange_order(self.batched, program.rank)
        self.hooks = program.hooks(ctx.config.grad_sync_func is not None, ctx.config.param_sync_func is not None)
        self._step_state(program, ctx)

    def _step_state(self, program: RankProgram, ctx: ExecutionContext) -> None:
        """What the steps share: saved activations, local hand-overs, pending weight-gradient passes, the call."""
        config = ctx.config
        self.at, self.store = -1, []
        self.forward_only = program.plan.forward_only
        self.dealloc = bool(config.deallocate_pipeline_outputs) and not self.forward_only
        self.k_ckpt = config.num_microbatches_with_partial_activation_checkpoints if ctx.checkpoint else None
        self.window = program.warmup + 1
        per_token = bool(getattr(config, "calculate_per_token_loss", False))
        self.tokens = torch.zeros([], dtype=torch.int, device=self.comm.device) if per_token else None
        self.saved_in = [None] * program.num_forwards
        self.saved_out = [None] * program.num_forwards
        self.local = {}
        self.split = program.plan.splits_backward and not self.forward_only
        self.pending_w = [None] * program.num_forwards if self.split else None
        self.call = ForwardCall(ctx.forward_step_func, ctx.num_microbatches, self.store, config, ctx.cp_group_size,
                                ctx.collect_non_loss_data)
        hooks = ctx.chunk_hooks if ctx.chunk_hooks is not None else [ChunkHooks(m) for m in ctx.models]
        self.chunks = [ChunkCall(h, it, m, c if ctx.vp_stages else None)
                       for c, (h, it, m) in enumerate(zip(hooks, ctx.data_iterators, ctx.models))]

    @staticmethod
    def _split_backward(x, y, gy, config):
        from .split_backward import backward_input_step  # only split-backward plans need it
        return backward_input_step(x, y, gy, config)

    @staticmethod
    def _deferral():
        """Forwards of split-backward plans run under layer-level weight-gradient deferral (``nn.Linear``,
        ``LayerNorm``, ``RMSNorm``, ``Embedding``); other parameters are split over the autograd graph."""
        from .split_backward import weight_grad_deferral
        return weight_grad_deferral()

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
        b = self.ctx.micro_batch_size
        if len(shape) == 3 and b and shape[0] == b != shape[1]:
            raise RuntimeError(f"{what} shape {tuple(shape)} on pipeline rank {self.p.rank}, which looks batch-first "
                               f"[b, s, h] (dimension 0 is micro_batch_size={b}); a pipeline message is [s, b, h]: "
                               "return output.transpose(0, 1).contiguous() and transpose the input back, or build "
                               "the chunks with engine.split_model(..., batch_first=True)")

    def _check_send(self, tensor, st, local: bool = False) -> None:
        """Refuse, before it is handed on, a tensor the receiving stage could not take: None / not a tensor, a dtype
        other than ``config.pipeline_dtype`` (also for a local hand-over under the V placement, so a model fails the
        same way under every placement), a shape other than the receive shape.  Layout is not checked: outputs and
        input gradients are made contiguous (``sendable_output`` / ``sendable_grad``)."""
        what = "activation (the model chunk's output)" if st.forward else "gradient of the model chunk's input"
        where = f"{st.label} on pipeline rank {self.p.rank} (model chunk {st.chunk}, microbatch {st.microbatch})"
        if tensor is None and not st.forward:
            raise RuntimeError(f"{where}: the gradient of the model chunk's input "
                               "is None because the chunk's output does not depend on its input (the tensor given "
                               "to set_input_tensor, which requires grad); use that tensor in forward, without "
                               ".detach() or torch.no_grad(), so the gradient can flow to the previous stage")
        if not isinstance(tensor, torch.Tensor):
            raise RuntimeError(f"{where} produced {type(tensor).__name__}, not a "
                               "tensor; a model chunk that feeds the next stage must return one tensor [s, b, h]")
        dtype = self.config.pipeline_dtype
        if tensor.dtype != dtype and (dtype is not None or not local):
            fix = ("cast the chunk output (e.g. return hidden.to(config.pipeline_dtype))" if st.forward else
                   "keep the tensor given to set_input_tensor in that dtype")
            raise RuntimeError(f"{where}: the {what} is {tensor.dtype} but config.pipeline_dtype={dtype}; "
                               f"the receiving stage would misread it: {fix}, or set pipeline_dtype={tensor.dtype}")
        if local:  # a hand-over between two stages of this rank: its shape is the receiver's by construction
            return
        if self.negotiate:
            self._check_negotiated(tuple(tensor.shape), f"{st.label} produced")
        else:
            # an activation has this rank's output shape (= the shape its gradient comes back in), a gradient this
            # rank's input shape (= the activation receive shape)
            expected = self.ctx.grad_shape if st.forward else self.ctx.act_shape
            if tuple(tensor.shape) != tuple(expected):
                raise RuntimeError(f"{where} produced shape "
                                   f"{tuple(tensor.shape)} but the receiving stage expects {tuple(expected)} "
                                   "(from seq_length, micro_batch_size, hidden_size); pass the right sizes or set "
                                   "config.variable_seq_lengths=True")

    # -- the step ---------------------------------------------------------------------------------------------------
    def run(self) -> list:
        """Run every step of the program (module doc); return the loss stage's reduced losses."""
        p, sync = self.p, self.sync
        start, before, after, end = self.hooks
        sync.run(start)
        self._exchange(None, p.initial_posts)
        forward, backward, weight = self._forward, self._backward, self._weight
        cell_at = [0] * len(p.steps)
        for a, b in p.cells:
            cell_at[a] = b
        i, n = 0, len(p.steps)
        while i < n:
            self.at = i
            if cell_at[i]:
                i = self._cell(i, cell_at[i])
                continue
            st = p.steps[i]
            if before[i]:
                sync.run(before[i])
            if st.forward:
                forward(st)
            elif st.op is Op.WEIGHT:
                weight(st)
            else:
                backward(st)
            if after[i]:
                sync.run(after[i])
            i += 1
        self.at = n
        self._drain()
        sync.run(end)
        self._finalize()
        return self.store

    def _input(self, st):
        """The step's incoming tensor (a receive, a local hand-over, or None); then the sends reaped there."""
        x = self._take(st.recv) if st.recv >= 0 else (self.local.pop(st.local_in) if st.local_in >= 0 else None)
        if st.reap:
            self._reap(st.reap)
        return x

    def _forward(self, st) -> None:
        x = self._input(st)
        with self.tracer.span("compute", st.label):
            y, n = self._compute_forward(st, x)
        self._emit_forward(st, x, y, n)

    def _compute_forward(self, st, x):
        ckpt = None if self.k_ckpt is None else (st.index % self.window) >= self.k_ckpt
        first_mb = check_first_val_step(self.ctx.first_val_step, self.forward_only, st.microbatch == 0)
        with self._deferral() if self.split else _NO_DEFERRAL:
            return run_forward(self.call, self.chunks[st.chunk], x, ckpt, first_mb, st.microbatch,
                               st.last_stage if self.ctx.per_stage_last else True)

    def _emit_forward(self, st, x, y, n) -> None:
        """After a forward: count tokens, hand the output on (send or local), post, keep what B needs."""
        if self.tokens is not None and n is not None:
            self.tokens += n
        send = None
        if st.send_peer >= 0:
            self._check_send(y, st)
            y = sendable_output(y, self.dealloc)  # contiguous; owns its storage when it will be freed
            send = (y.detach() if self.dealloc else y, st)
        elif st.local_out >= 0:  # the next stage is on this rank: hand over a fresh leaf, as a receive would
            self._check_send(y, st, local=True)
            y = sendable_output(y, self.dealloc)
            self.local[st.local_out] = y.detach().requires_grad_(not self.forward_only)
        if send is not None or st.posts:
            self._exchange(send, st.posts)
        if not self.forward_only:
            if self.dealloc and (st.send_peer >= 0 or st.local_out >= 0):  # the receiver (or hand-over) owns it
                deallocate_output_tensor(y, True)
            self.saved_in[st.slot] = x
            self.saved_out[st.slot] = y

    def _backward(self, st) -> None:
        gy = self._input(st)
        with self.tracer.span("compute", st.label):
            gx = self._compute_backward(st, gy)
        self._emit_backward(st, gx)

    def _compute_backward(self, st, gy):
        slot = st.slot
        x, y = self.saved_in[slot], self.saved_out[slot]
        self.saved_in[slot] = self.saved_out[slot] = None
        if self.split:
            gx, self.pending_w[slot] = self._split_backward(x, y, gy, self.config)
            return gx
        return backward_step(x, y, gy, self.config)

    def _emit_backward(self, st, gx) -> None:
        gx = sendable_grad(gx)  # a split B returns autograd's raw gradient: a view for a reshaping chunk
        send = None
        if st.send_peer >= 0:
            self._check_send(gx, st)
            send = (gx, st)
        elif st.local_out >= 0:
            self._check_send(gx, st, local=True)
            self.local[st.local_out] = gx
        if send is not None or st.posts:
            self._exchange(send, st.posts)

    def _weight(self, st) -> None:
        if st.reap:
            self._reap(st.reap)
        with self.tracer.span("compute", st.label):
            self._compute_weight(st)
        if st.posts:
            self._exchange(None, st.posts)

    def _compute_weight(self, st) -> None:
        work = self.pending_w[st.slot]
        self.pending_w[st.slot] = None
        work.run()

    def _cell(self, start: int, stop: int) -> int:
        """Run steps ``start..stop-1`` as one overlapped cell (module doc); returns ``stop``."""
        steps, (_, before, after, _) = self.p.steps[start:stop], self.hooks
        for i in range(start, stop):
            if before[i]:
                self.sync.run(before[i])
        inputs = [self._input(st) for st in steps]
        f = next(k for k, st in enumerate(steps) if st.forward)
        b = next(k for k, st in enumerate(steps) if st.op is Op.BACKWARD)
        w = [k for k, st in enumerate(steps) if st.op is Op.WEIGHT]

        def backward():
            gx = self._compute_backward(steps[b], inputs[b])
            for k in w:
                self._compute_weight(steps[k])
            return gx

        (y, n), gx = Cell((steps[f].label, steps[b].label), self.tracer).run(
            lambda: self._compute_forward(steps[f], inputs[f]), backward)
        for k, st in enumerate(steps):
            if k == f:
                self._emit_forward(st, inputs[k], y, n)
            elif k == b:
                self._emit_backward(st, gx)
            elif st.posts:
                self._exchange(None, st.posts)
            if after[start + k]:
                self.sync.run(after[start + k])
        return stop

    def _drain(self) -> None:
        """End of the step: wait every send still open; no receive may be left."""
        left = [sid for sid, w in enumerate(self.send_works) if w is not None]
        if left:
            self._reap(left, final=True)
        for w in self.late:
            w.wait()
        self.late.clear()
        if any(w is not None for w in self.works) or any(w is not None for w in self.shape_works):
            raise RuntimeError(f"pipeline rank {self.p.rank}: receives left unconsumed at the end of the step (plan "
                               "bug)")

    def _finalize(self) -> None:
        config, ctx = self.config, self.ctx
        if self.forward_only or config.finalize_model_grads_func is None:
            return
        models_arg = ctx.finalize_models if ctx.finalize_models is not None else list(ctx.models)
        if ctx.before_finalize is not None:
            ctx.before_finalize()
        with self.tracer.span("sync", "finalize_model_grads"):
            config.finalize_model_grads_func(models_arg, self.tokens, pg_collection=ctx.pg_collection,
                                             force_all_reduce=ctx.force_all_reduce)
