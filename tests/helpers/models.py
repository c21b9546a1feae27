"""A small deterministic model split into pipeline chunks, its data, and a single-process reference.

The model is a stack of ``L`` layers per virtual pipeline stage, each ``tanh(x @ W^T + b)`` (``kind="linear"``) or
the cheap elementwise ``tanh(x * w + b)`` (``kind="diag"``, for large activations), on ``[s, b, h]`` tensors.
Virtual stage ``s = chunk * P + rank`` holds global layers ``[s*L, (s+1)*L)``; all parameters come from one seeded
generator, so every rank can rebuild the whole model and compute the unpipelined reference itself.

Chunks implement ``set_input_tensor`` and carry ``.config``; the first stage reads the microbatch input from its
data item, the last stage's ``forward_step_func`` returns the loss function.  Each rank records its compute order
(``F<mb>.<chunk>`` when a chunk runs forward, ``B<mb>.<chunk>`` when its backward starts) in one shared list, and
what the schedule passed (``current_microbatch`` via the ``decoder.layers`` of the chunk, checkpoint flag, input).
"""
from __future__ import annotations

import weakref
from functools import partial

import torch
from torch import nn

__all__ = ["Chunk", "build_chunks", "make_data", "iterators", "make_forward_step", "reference", "chunk_grads",
           "max_rel_error", "zero_grads"]


def _params(num_layers: int, hidden: int, seed: int, kind: str):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_layers):
        if kind == "linear":
            w = torch.randn(hidden, hidden, generator=g) * (1.0 / hidden ** 0.5)
        else:
            w = 0.5 + torch.rand(hidden, generator=g)
        b = torch.randn(hidden, generator=g) * 0.1
        out.append((w, b))
    return out


def _layer(x, w, b, kind):
    return torch.tanh((x @ w.t() if kind == "linear" else x * w) + b)


def _received(kind: str, mb: int, t: torch.Tensor) -> tuple:
    """``(kind, microbatch, shape, bytes of the storage behind t)``: what a receiver allocated for a message."""
    return kind, mb, tuple(t.shape), t.untyped_storage().nbytes()


class _Tap(torch.autograd.Function):
    """Identity (a copy) whose backward records a label (the start of a chunk's backward) and, into ``sink``
    (a list, or None on the loss stage), the incoming output gradient as :func:`_received` describes it."""

    @staticmethod
    def forward(ctx, x, log, label, sink=None, mb=None):
        ctx.log, ctx.label, ctx.sink, ctx.mb = log, label, sink, mb
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.label)
        if ctx.sink is not None:
            ctx.sink.append(_received("grad", ctx.mb, grad))
        return grad, None, None, None, None


class Layer(nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.weight = nn.Parameter(w.clone())
        self.bias = nn.Parameter(b.clone())
        self.current_microbatch = None


class _Decoder(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class Chunk(nn.Module):
    """Virtual pipeline stage ``stage`` of ``num_stages``: ``layers_per_stage`` layers; records into ``log``."""

    def __init__(self, config, stage: int, num_stages: int, chunk: int, params, log: list, kind: str = "linear",
                 output: str = "plain"):
        super().__init__()
        self.output = output  # "plain" (owns its storage), "view" or "hooked" (see _not_owned)
        self.bases, self.alive_at_forward, self.hook_calls = [], [], []
        self.hooked = nn.Identity()
        self.hooked.register_full_backward_hook(lambda m, gin, gout: self.hook_calls.append(gout[0].shape))
        self.config = config
        self.stage, self.num_stages, self.chunk, self.kind = stage, num_stages, chunk, kind
        self.decoder = _Decoder([Layer(w, b) for w, b in params])
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.input_tensor = None
        self.log = log
        self.seen = []          # (microbatch, current_microbatch of the layers, checkpoint flag)
        self.input_dtypes = []  # dtype of every received input
        self.sent = []          # weak references to outputs sent downstream
        self.inputs = []        # weak references to received inputs
        self.received = []      # _received(...) of every activation and output gradient received from a neighbour

    def set_input_tensor(self, tensors):
        if not isinstance(tensors, list):
            raise AssertionError("set_input_tensor must get a list")
        self.input_tensor = tensors[0]

    def forward(self, item, checkpoint=None):
        mb = item["mb"]
        self.log.append(f"F{mb}.{self.chunk}")
        self.seen.append((mb, self.decoder.layers[0].current_microbatch, checkpoint))
        if self.is_first:
            x = item["x"]
        else:
            x = self.input_tensor
            if x is None:
                raise AssertionError(f"stage {self.stage} got no input for microbatch {mb}")
            self.input_dtypes.append(x.dtype)
            self.inputs.append(weakref.ref(x))
            self.received.append(_received("act", mb, x))
        for layer in self.decoder.layers:
            x = _layer(x, layer.weight, layer.bias, self.kind)
        out = _Tap.apply(x, self.log, f"B{mb}.{self.chunk}", None if self.is_last else self.received, mb)
        if self.output != "plain" and not self.is_last:
            return self._not_owned(out)
        if not self.is_last:
            self.sent.append(out)
        return out

    def _not_owned(self, out):
        """``out`` returned as a tensor that does not own its storage (``output="view"``: ``.view``; ``"hooked"``:
        through a submodule with a full backward hook); the storage owner is tracked by a weak reference only."""
        base = out * 1  # saved by no autograd node: alive only through the returned view
        self.bases.append(weakref.ref(base))
        self.alive_at_forward.append(sum(r() is not None for r in self.bases[:-1]))
        if self.output == "view":
            return base.view(base.shape)
        return self.hooked(base)


def build_chunks(config, pp_size: int, pp_rank: int, num_chunks: int, *, hidden: int = 8, layers_per_stage: int = 1,
                 seed: int = 0, kind: str = "linear", dtype=torch.float32, log=None, stages=None,
                 output: str = "plain"):
    """The model chunks of ``pp_rank`` (chunk ``c`` is virtual stage ``stages[c]``, default ``c*P + pp_rank``) and
    their shared compute log (``log``: a list to record into, default a new one); ``output``: see ``Chunk``."""
    num_stages = pp_size * num_chunks
    params = _params(num_stages * layers_per_stage, hidden, seed, kind)
    log = [] if log is None else log
    chunks = []
    for c in range(num_chunks):
        s = c * pp_size + pp_rank if stages is None else stages[c]
        chunk = Chunk(config, s, num_stages, c, params[s * layers_per_stage:(s + 1) * layers_per_stage], log, kind,
                      output)
        chunks.append(chunk.to(dtype))
    return chunks, log


def make_data(num_microbatches: int, seq: int, mbs: int, hidden: int, seed: int = 1, *, zero_mb=None,
              seqs=None, dtype=torch.float32, tokens=None):
    """Microbatch items ``{"mb", "x" [s, b, h], "target" [s, b, h], "tokens"}``; ``seqs`` gives per-microbatch
    sequence lengths; ``zero_mb`` makes one microbatch all zeros (input and target)."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for m in range(num_microbatches):
        s = seqs[m] if seqs is not None else seq
        x = torch.randn(s, mbs, hidden, generator=g)
        t = torch.randn(s, mbs, hidden, generator=g) * 0.5
        if zero_mb is not None and m == zero_mb:
            x, t = torch.zeros_like(x), torch.zeros_like(t)
        n = s * mbs if tokens is None else tokens[m]
        items.append({"mb": m, "x": x.to(dtype), "target": t.to(dtype), "tokens": n})
    return items


def iterators(data, num_chunks: int):
    """One iterator over the same microbatches per model chunk (every chunk reads its item for the microbatch id)."""
    return [iter(data) for _ in range(num_chunks)]


def _loss(item, mode, output, non_loss_data=False):
    if non_loss_data:
        return {"mb": item["mb"], "sum": output.detach().float().sum().item()}
    raw = ((output.float() - item["target"].float()) ** 2).sum()
    reduced = {"mb": item["mb"], "loss": raw.detach().clone()}
    if mode == 2:
        return raw, reduced
    return raw, item["tokens"], reduced


def make_forward_step(mode: int = 2, sleep=None):
    """``forward_step_func(data_iterator, model[, checkpoint])`` for :class:`Chunk` s; ``mode`` 2 or 3 selects the
    loss-function pattern (2-tuple / 3-tuple with the item's token count); ``sleep(mb)`` can inject delays."""

    def forward_step_func(data_iterator, model, checkpoint_activations_microbatch=None):
        item = next(data_iterator)
        if sleep is not None:
            sleep(item["mb"])
        out = model(item, checkpoint_activations_microbatch)
        return out, partial(_loss, item, mode)

    return forward_step_func


def reference(config_like, pp_size: int, num_chunks: int, data, *, hidden: int = 8, layers_per_stage: int = 1,
              seed: int = 0, kind: str = "linear", mode: int = 2, per_token: bool = False, grad_scale: float = 1.0,
              repeats: int = 1, dtype=torch.float32):
    """The unpipelined run of the same model: per-microbatch raw losses and the gradient of every global layer.

    Loss contract (Megatron's ``forward_step_calc_loss``): 2-tuple -> ``L / M``; 3-tuple -> ``L / max(n, 1) / M``, or ``L`` with ``per_token``.
    ``grad_scale`` multiplies the loss before backward (``grad_scale_func``); ``repeats`` accumulates that many
    identical calls.  Returns ``(losses, {layer: (dW, db)})``.
    """
    params = _params(pp_size * num_chunks * layers_per_stage, hidden, seed, kind)
    leaves = [(w.clone().to(dtype).requires_grad_(), b.clone().to(dtype).requires_grad_()) for w, b in params]
    M = len(data)
    losses = []
    for _ in range(repeats):
        total = 0.0
        losses = []
        for item in data:
            x = item["x"]
            for w, b in leaves:
                x = _layer(x, w, b, kind)
            raw = ((x.float() - item["target"].float()) ** 2).sum()
            losses.append(raw.detach().clone())
            if mode == 2:
                scaled = raw / M
            elif per_token:
                scaled = raw
            else:
                scaled = raw / max(float(item["tokens"]), 1.0) / M
            total = total + scaled * grad_scale
        total.backward()
    return losses, {i: (w.grad.clone(), b.grad.clone()) for i, (w, b) in enumerate(leaves)}


def chunk_grads(chunks, layers_per_stage: int = 1):
    """``{global layer: (dW, db)}`` of this rank's chunks."""
    out = {}
    for chunk in chunks:
        for j, layer in enumerate(chunk.decoder.layers):
            out[chunk.stage * layers_per_stage + j] = (layer.weight.grad, layer.bias.grad)
    return out


def zero_grads(chunks) -> None:
    for chunk in chunks:
        for p in chunk.parameters():
            p.grad = None
        chunk.seen.clear()
        chunk.input_dtypes.clear()
        chunk.sent.clear()
        chunk.inputs.clear()
        chunk.received.clear()


def max_rel_error(got: dict, ref: dict) -> float:
    """Largest ``max|got - ref| / max|ref|`` over the tensors of ``got`` (inf for a missing gradient)."""
    worst = 0.0
    for key, tensors in got.items():
        for g, r in zip(tensors, ref[key]):
            if g is None:
                return float("inf")
            scale = r.abs().max().item() or 1.0
            worst = max(worst, (g.float() - r.float()).abs().max().item() / scale)
    return worst
