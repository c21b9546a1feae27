"""Point-to-point communication between pipeline ranks: activations forward, gradients backward.

:class:`P2PCommunicator` has Megatron-Core's public surface (``P2PCommunicator(pp_group, config)``, ``recv_forward``,
``send_forward_recv_backward``, ..., ``megatron/core/pipeline_parallel/p2p_communication.py``) for code that drives the pipeline by hand, and the small
message API the executor (``engine.runtime.executor``) is built on: :meth:`P2PCommunicator.isend` /
:meth:`P2PCommunicator.irecv` (one non-blocking transfer to / from a pipeline rank, by its rank in the pipeline
group), :meth:`P2PCommunicator.post` (several transfers of one exchange point, batched or even/odd ordered) and the
receive-buffer / shape-message helpers.

Topology: ranks are addressed by their index in ``pp_group`` and mapped to global ranks with
``torch.distributed.get_process_group_ranks``, so every transfer -- data and shape handshake alike -- stays inside
the pipeline group, also for non-contiguous groups such as ``{0, 2}`` / ``{1, 3}`` (NVIDIA/Megatron-LM#620).  The neighbours
wrap around: the last rank's ``next`` is rank 0 and rank 0's ``prev`` is the last rank (virtual pipeline stages).

Message kinds travel on distinct tags (:data:`TAG_ACT`, :data:`TAG_GRAD` and their shape tags).  With ``P = 2`` the
previous and the next neighbour are the same rank, and Megatron's batched exchange can pair an activation send with
a gradient receive there (NVIDIA/Megatron-LM#750); on gloo the tags make that impossible, and the executor additionally
posts receives in the sender's order so matching is right on transports that ignore tags.

Transport notes (what is and is not verified):

* gloo (CPU): verified by the multi-process tests.  gloo has no grouped p2p, so ``batch_p2p_comm`` posts the ops of
  an exchange point one after the other, in Megatron's batched order (send-prev, recv-prev, send-next, recv-next);
  without it they are posted in Megatron's even/odd order.  A gloo send never reports completion before it is
  waited, so send handles are waited lazily by the caller.
* NCCL (CUDA): **not tested** (the development machine has no GPU; one GPU could not host two NCCL ranks anyway).
  Both directions of a rank pair share one NCCL stream, so an unmatched posted send can hold back a later receive on
  the same pair; therefore every exchange point's sends and receives are issued as one
  ``torch.distributed.batch_isend_irecv`` group on NCCL, whatever ``batch_p2p_comm`` says (its op order is kept).
  For Megatron's plans the exchange points of neighbouring ranks pair up much like Megatron's lock-step calls; this
  is argued, not run.  The data receive of a
  negotiated-shape message (``variable_seq_lengths``) is posted on its own after its shape arrived.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ..plan.lowering import TAG_ACT, TAG_ACT_SHAPE, TAG_GRAD, TAG_GRAD_SHAPE  # defined with the programs
from .process_groups import group_rank, group_size

__all__ = ["P2PCommunicator", "TAG_ACT", "TAG_GRAD", "TAG_ACT_SHAPE", "TAG_GRAD_SHAPE", "SHAPE_MESSAGE_LEN",
           "encode_shape", "decode_shape", "is_single_shape", "check_sendable", "MessageRecord", "record_messages",
           "activation_bytes"]

_MAX_DIMS = 8
SHAPE_MESSAGE_LEN = 1 + _MAX_DIMS
"""int64 elements of a shape message: ``[ndim, d0, d1, ..., 0-padding]`` (Megatron sends exactly 3 ints)."""


def encode_shape(shape: Sequence[int], device=None) -> torch.Tensor:
    """The int64 shape message ``[ndim, *shape, 0...]`` of length :data:`SHAPE_MESSAGE_LEN`.

    Raises:
        ValueError: more than 8 dimensions.
    """
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"tensor of shape {tuple(shape)} has {len(shape)} dimensions; pipeline messages with "
                         f"negotiated shapes support at most {_MAX_DIMS}")
    msg = [len(shape), *shape] + [0] * (_MAX_DIMS - len(shape))
    return torch.tensor(msg, dtype=torch.int64, device=device)


def decode_shape(message: torch.Tensor) -> tuple[int, ...]:
    """Inverse of :func:`encode_shape`."""
    values = message.tolist()
    return tuple(values[1:1 + values[0]])


@dataclass(frozen=True)
class MessageRecord:
    """One posted pipeline transfer seen by :func:`record_messages`: ``direction`` ``"send"`` or ``"recv"``,
    ``tag`` (:data:`TAG_ACT` activations, :data:`TAG_GRAD` input gradients, or a shape tag), ``shape`` (e.g.
    ``(s, b, h)``; ``(s / T, b, h)`` under ``sequence_parallel``), ``dtype`` and ``nbytes`` (bytes of the tensor)."""

    direction: str
    tag: int
    shape: tuple
    dtype: torch.dtype
    nbytes: int


_RECORDERS: list[list] = []


@contextlib.contextmanager
def record_messages() -> Iterator[list]:
    """Record every transfer this process posts through a :class:`P2PCommunicator` (``isend``, ``irecv``,
    ``post``; so every schedule and the executor) while the context is open.

    Yields a list that fills with one :class:`MessageRecord` per transfer, in posting order; nested contexts each
    get every record.  Local, no communication; the records are taken when a transfer is posted, not completed.
    """
    log: list = []
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        for i, entry in enumerate(_RECORDERS):
            if entry is log:
                del _RECORDERS[i]
                break


def activation_bytes(records: Sequence[MessageRecord], direction: str = "send") -> int:
    """Bytes of the activation messages (:data:`TAG_ACT`) among ``records`` going ``direction``."""
    return sum(r.nbytes for r in records if r.tag == TAG_ACT and r.direction == direction)


def _record(direction: str, tensor: torch.Tensor, tag: int) -> None:
    if _RECORDERS:
        rec = MessageRecord(direction, tag, tuple(tensor.shape), tensor.dtype,
                            tensor.numel() * tensor.element_size())
        for log in _RECORDERS:
            log.append(rec)


_KIND_OF_TAG = {TAG_ACT: "activation", TAG_GRAD: "input gradient", TAG_ACT_SHAPE: "activation shape message",
               TAG_GRAD_SHAPE: "gradient shape message"}


def check_sendable(tensor: torch.Tensor, tag: int) -> None:
    """Refuse a tensor P2P cannot send: gloo and NCCL send only contiguous tensors (gloo fails with "input tensor
    has to be contiguous" after the peers are already in step).  The schedules make every output and input gradient
    contiguous before posting it; this guards the message API for callers that drive it by hand.

    Raises:
        ValueError: ``tensor`` is not contiguous, naming its kind, shape and strides and the fix.
    """
    if not tensor.is_contiguous():
        kind = _KIND_OF_TAG.get(tag, f"tensor (tag {tag})")
        raise ValueError(f"pipeline send of a non-contiguous {kind}: shape {tuple(tensor.shape)}, strides "
                         f"{tuple(tensor.stride())} (a view, e.g. of a transpose); P2P sends only contiguous "
                         "tensors: send tensor.contiguous()")


def is_single_shape(shape) -> bool:
    """Megatron's convention: a ``torch.Size`` or a non-empty list/tuple of ints is one shape; else a list of shapes."""
    if isinstance(shape, torch.Size):
        return True
    return isinstance(shape, (list, tuple)) and len(shape) > 0 and all(isinstance(d, int) for d in shape)


class P2PCommunicator:
    """Sends and receives pipeline tensors inside one pipeline group (Megatron-Core ``P2PCommunicator``).

    Args:
        pp_group: the pipeline ``ProcessGroup`` (``None``: a single process, every call is a no-op).
        config: a ``ModelParallelConfig``; reads ``pipeline_dtype``, ``variable_seq_lengths``, ``mtp_standalone``,
            ``batch_p2p_comm``, ``virtual_pipeline_model_parallel_size``.

    Attributes: ``pp_group``, ``config``, ``virtual_pipeline_model_parallel_size``, ``rank`` / ``size`` (in the
    pipeline group), ``next_rank`` / ``prev_rank`` (global ranks, wrap-around), ``next`` / ``prev`` (group ranks),
    ``device`` (where receive buffers live: the current CUDA device on NCCL, else CPU), ``sent_bytes`` (bytes
    posted for sending so far, by message tag -- :data:`TAG_ACT` activations, :data:`TAG_GRAD` gradients, shape
    tags --; read by benchmarks, reset by assigning ``{}``); :func:`record_messages` records each transfer's shape,
    dtype and bytes.
    """

    def __init__(self, pp_group: Optional[dist.ProcessGroup], config):
        self.pp_group = pp_group
        self.config = config
        self.virtual_pipeline_model_parallel_size = getattr(config, "virtual_pipeline_model_parallel_size", None)
        self.rank = group_rank(pp_group)
        self.size = group_size(pp_group)
        distributed = pp_group is not None and dist.is_available() and dist.is_initialized()
        self.global_ranks = tuple(dist.get_process_group_ranks(pp_group)) if distributed else (0,)
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self.next_rank = self.global_ranks[self.next]
        self.prev_rank = self.global_ranks[self.prev]
        self.backend = dist.get_backend(pp_group) if distributed else None
        self.grouped = self.backend == "nccl"  # batch_isend_irecv forms a real group only on NCCL
        if self.backend == "nccl" and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.sent_bytes: dict[int, int] = {}

    def _count(self, tensor: torch.Tensor, tag: int) -> None:
        self.sent_bytes[tag] = self.sent_bytes.get(tag, 0) + tensor.numel() * tensor.element_size()
        _record("send", tensor, tag)

    # -- stage predicates (HEAD names) -------------------------------------------------------------------------
    @property
    def is_pp_first_stage(self) -> bool:
        return self.rank == 0

    @property
    def is_pp_last_stage(self) -> bool:
        return self.rank == self.size - 1

    @property
    def total_stages(self) -> int:
        return self.size

    @property
    def current_stage(self) -> int:
        return self.rank

    # -- message API (used by the executor) ---------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        """Post a non-blocking send of ``tensor`` to pipeline rank ``peer``; returns the handle (``.wait()``).

        Raises:
            ValueError: ``tensor`` is not contiguous (see :func:`check_sendable`)."""
        check_sendable(tensor, tag)
        self._count(tensor, tag)
        return self.pp_group.send([tensor], peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        """Post a non-blocking receive into ``tensor`` from pipeline rank ``peer``; returns the handle."""
        _record("recv", tensor, tag)
        return self.pp_group.recv([tensor], peer, tag)

    def post(self, ops: Sequence[tuple[bool, torch.Tensor, int, int]], batched: bool) -> list:
        """Post the transfers of one exchange point; ``ops`` are ``(is_send, tensor, peer, tag)`` already in posting
        order (``batched``: Megatron's batched order, else even/odd -- the caller orders them).  On NCCL they are
        issued as one ``batch_isend_irecv`` group whatever ``batched`` says; on gloo one by one.
        Returns one handle per op (in order).  Raises ``ValueError`` for a non-contiguous send, before anything is
        posted (:func:`check_sendable`)."""
        for is_send, tensor, _, tag in ops:
            if is_send:
                check_sendable(tensor, tag)
        for is_send, tensor, _, tag in ops:
            if is_send:
                self._count(tensor, tag)
            else:
                _record("recv", tensor, tag)
        if self.grouped and len(ops) > 1:  # NCCL: always one group (see the module docstring)
            group = self.pp_group
            p2p = [dist.P2POp(dist.isend if s else dist.irecv, t, self.global_ranks[p], group, tag)
                   for s, t, p, tag in ops]
            return dist.batch_isend_irecv(p2p)
        pg = self.pp_group
        return [pg.send([t], p, tag) if s else pg.recv([t], p, tag) for s, t, p, tag in ops]

    def new_buffer(self, shape: Sequence[int]) -> torch.Tensor:
        """An empty receive buffer: ``pipeline_dtype``, on :attr:`device`, ``requires_grad=True`` (Megatron: the
        stage's forward graph hangs off it and ``backward_step`` reads its ``.grad``).

        Raises:
            RuntimeError: ``config.pipeline_dtype`` is None (as Megatron).
        """
        dtype = self.config.pipeline_dtype
        if dtype is None:
            raise RuntimeError("config.pipeline_dtype is None but a pipeline receive is needed; set "
                               "ModelParallelConfig.pipeline_dtype (e.g. torch.float32 or torch.bfloat16)")
        return torch.empty(tuple(shape), dtype=dtype, device=self.device, requires_grad=True)

    def new_shape_buffer(self) -> torch.Tensor:
        return torch.empty(SHAPE_MESSAGE_LEN, dtype=torch.int64, device=self.device)

    @property
    def negotiates_shapes(self) -> bool:
        """Whether every message is preceded by a shape message (``variable_seq_lengths`` or ``mtp_standalone``)."""
        return bool(getattr(self.config, "variable_seq_lengths", False) or getattr(self.config, "mtp_standalone",
                                                                                 False))

    # -- Megatron's core exchange ---------------------------------------------------------------------------------
    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev: bool, recv_next: bool, tensor_shape,
                     wait_on_reqs: bool = True):
        """One exchange with both neighbours (Megatron's ``_communicate``); returns ``(from_prev, from_next, handles)``.

        ``handles`` is ``None`` when waited, else a dict keyed ``send_next``, ``recv_prev``, ``send_prev``,
        ``recv_next`` (only the ops posted).  Receive buffers are ``pipeline_dtype`` with ``requires_grad=True``.

        Raises:
            RuntimeError: a receive is requested but ``tensor_shape`` or ``config.pipeline_dtype`` is None.
        """
        if self.size == 1 or self.pp_group is None:
            return None, None, (None if wait_on_reqs else {})
        # Megatron's callers hand over whatever the chunk returned; a strided view (e.g. the gradient of a transposed
        # input) is sent as a contiguous copy, which the posted work keeps alive until it is waited
        tensor_send_next = None if tensor_send_next is None else tensor_send_next.contiguous()
        tensor_send_prev = None if tensor_send_prev is None else tensor_send_prev.contiguous()
        prev_shape = next_shape = tensor_shape
        if self.negotiates_shapes:
            prev_shape, next_shape = self._exchange_shapes(tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        if (recv_prev or recv_next) and tensor_shape is None and not self.negotiates_shapes:
            raise RuntimeError("tensor_shape must be given to receive a pipeline tensor; pass the [s, b, h] shape")
        from_prev = self.new_buffer(prev_shape) if recv_prev else None
        from_next = self.new_buffer(next_shape) if recv_next else None
        named = []  # (name, is_send, tensor, peer, tag) in Megatron's batched order
        if tensor_send_prev is not None:
            named.append(("send_prev", True, tensor_send_prev, self.prev, TAG_GRAD))
        if from_prev is not None:
            named.append(("recv_prev", False, from_prev, self.prev, TAG_ACT))
        if tensor_send_next is not None:
            named.append(("send_next", True, tensor_send_next, self.next, TAG_ACT))
        if from_next is not None:
            named.append(("recv_next", False, from_next, self.next, TAG_GRAD))
        batched = bool(self.config.batch_p2p_comm)
        if batched and not wait_on_reqs:
            raise RuntimeError("batch_p2p_comm=True cannot be overlapped (wait_on_reqs=False); set "
                               "batch_p2p_comm=False to use overlap_p2p_comm")
        if not batched:
            named = self.even_odd_order(named)
        works = self.post([op[1:] for op in named], batched)
        handles = {op[0]: w for op, w in zip(named, works)}
        if wait_on_reqs:
            for w in works:
                w.wait()
            handles = None
        return from_prev, from_next, handles

    def even_odd_order(self, named: list) -> list:
        """Megatron's unbatched order: even ranks send-next, recv-prev, send-prev, recv-next; odd ranks recv-prev,
        send-next, recv-next, send-prev -- one side of every pair starts with the matching receive."""
        even = ("send_next", "recv_prev", "send_prev", "recv_next")
        odd = ("recv_prev", "send_next", "recv_next", "send_prev")
        rank_order = even if self.rank % 2 == 0 else odd
        return sorted(named, key=lambda op: rank_order.index(op[0]))

    def _exchange_shapes(self, send_next, send_prev, recv_prev, recv_next):
        """The shape handshake of variable sequence lengths (Megatron's ``_communicate_shapes``), on the pipeline group and its own tags."""
        ops, got_prev, got_next = [], None, None
        if send_prev is not None:
            ops.append((True, encode_shape(send_prev.shape, self.device), self.prev, TAG_GRAD_SHAPE))
        if recv_prev:
            got_prev = self.new_shape_buffer()
            ops.append((False, got_prev, self.prev, TAG_ACT_SHAPE))
        if send_next is not None:
            ops.append((True, encode_shape(send_next.shape, self.device), self.next, TAG_ACT_SHAPE))
        if recv_next:
            got_next = self.new_shape_buffer()
            ops.append((False, got_next, self.next, TAG_GRAD_SHAPE))
        for w in self.post(ops, batched=True):
            w.wait()
        return (decode_shape(got_prev) if recv_prev else None, decode_shape(got_next) if recv_next else None)

    # -- Megatron's public methods (blocking unless overlap_p2p_comm=True) -----------------------------------------
    def _each(self, shapes, fn):
        if is_single_shape(shapes) or shapes is None:
            return fn(shapes)
        return [fn(s) for s in shapes]

    def recv_forward(self, tensor_shapes, is_first_stage: Optional[bool] = None):
        """Receive the activation from the previous rank (``None`` on the first stage)."""
        first = self.is_pp_first_stage if is_first_stage is None else is_first_stage
        return self._each(tensor_shapes, lambda s: None if first else self._communicate(
            tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False, tensor_shape=s)[0])

    def recv_backward(self, tensor_shapes, is_last_stage: Optional[bool] = None):
        """Receive the output gradient from the next rank (``None`` on the last stage)."""
        last = self.is_pp_last_stage if is_last_stage is None else is_last_stage
        return self._each(tensor_shapes, lambda s: None if last else self._communicate(
            tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=True, tensor_shape=s)[1])

    def send_forward(self, output_tensors, is_last_stage: Optional[bool] = None) -> None:
        """Send activation(s) to the next rank (no-op on the last stage)."""
        last = self.is_pp_last_stage if is_last_stage is None else is_last_stage
        if last:
            return
        for t in output_tensors if isinstance(output_tensors, (list, tuple)) else [output_tensors]:
            self._communicate(tensor_send_next=t, tensor_send_prev=None, recv_prev=False, recv_next=False,
                              tensor_shape=None)

    def send_backward(self, input_tensor_grads, is_first_stage: Optional[bool] = None) -> None:
        """Send input gradient(s) to the previous rank (no-op on the first stage)."""
        first = self.is_pp_first_stage if is_first_stage is None else is_first_stage
        if first:
            return
        for t in input_tensor_grads if isinstance(input_tensor_grads, (list, tuple)) else [input_tensor_grads]:
            self._communicate(tensor_send_next=None, tensor_send_prev=t, recv_prev=False, recv_next=False,
                              tensor_shape=None)

    def _paired(self, tensors, shapes, forward: bool):
        """Send to one side and receive from the same side, per shape (``forward``: activation out, gradient in)."""
        single = is_single_shape(shapes) or shapes is None
        pairs = zip([tensors] if single else list(tensors), [shapes] if single else list(shapes))
        if forward:
            out = [self._communicate(tensor_send_next=t, tensor_send_prev=None, recv_prev=False, recv_next=True,
                                     tensor_shape=s)[1] for t, s in pairs]
        else:
            out = [self._communicate(tensor_send_next=None, tensor_send_prev=t, recv_prev=True, recv_next=False,
                                     tensor_shape=s)[0] for t, s in pairs]
        return out[0] if single else out

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: Optional[bool] = None):
        """Send activation(s) to the next rank and receive the gradient(s) back (``None`` on the last stage)."""
        last = self.is_pp_last_stage if is_last_stage is None else is_last_stage
        if last:
            return None if is_single_shape(tensor_shapes) or tensor_shapes is None else [None] * len(tensor_shapes)
        return self._paired(output_tensors, tensor_shapes, forward=True)

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: Optional[bool] = None):
        """Send input gradient(s) to the previous rank and receive the next activation(s) (``None`` on the first
        stage)."""
        first = self.is_pp_first_stage if is_first_stage is None else is_first_stage
        if first:
            return None if is_single_shape(tensor_shapes) or tensor_shapes is None else [None] * len(tensor_shapes)
        return self._paired(input_tensor_grads, tensor_shapes, forward=False)

    def send_forward_recv_forward(self, output_tensor, recv_prev: bool, tensor_shape, overlap_p2p_comm: bool = False):
        """Send an activation to the next rank (if not None) and receive one from the previous rank if ``recv_prev``.

        With ``overlap_p2p_comm=True`` returns ``(tensor_or_None, handles)`` without waiting."""
        prev, _, handles = self._communicate(tensor_send_next=output_tensor, tensor_send_prev=None,
                                             recv_prev=recv_prev, recv_next=False, tensor_shape=tensor_shape,
                                             wait_on_reqs=not overlap_p2p_comm)
        return (prev, handles) if overlap_p2p_comm else prev

    def send_backward_recv_backward(self, input_tensor_grad, recv_next: bool, tensor_shape,
                                    overlap_p2p_comm: bool = False):
        """Send a gradient to the previous rank (if not None) and receive one from the next rank if ``recv_next``.

        With ``overlap_p2p_comm=True`` returns ``(tensor_or_None, handles)`` without waiting."""
        _, nxt, handles = self._communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                                            recv_prev=False, recv_next=recv_next, tensor_shape=tensor_shape,
                                            wait_on_reqs=not overlap_p2p_comm)
        return (nxt, handles) if overlap_p2p_comm else nxt

    def send_forward_backward_recv_forward_backward(self, output_tensor, input_tensor_grad, recv_prev: bool,
                                                    recv_next: bool, tensor_shape):
        """The 4-way exchange of a steady 1F1B step; always blocking.  Returns ``(from_prev, from_next)``."""
        prev, nxt, _ = self._communicate(tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad,
                                         recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape)
        return prev, nxt
