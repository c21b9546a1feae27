"""A decoder-only transformer of one model family (``model.family``, :mod:`engine.training.models`) split layer-wise
into pipeline model chunks.

The model has ``L`` transformer blocks; with ``P`` pipeline ranks and ``V`` model chunks per rank it is cut into
``P*V`` virtual pipeline stages of ``L/(P*V)`` consecutive blocks, or of the counts ``model.pipeline_layout`` gives
each stage (a lighter first and last stage for a vocabulary-heavy model, :mod:`engine.plan.layout`).  Megatron's order (``parallel_state``): model chunk
``c`` on pipeline rank ``r`` is virtual stage ``c*P + r``.  The family's embedding lives in the first stage (rank
0, chunk 0), the final norm, the output head and the loss in the last (rank ``P-1``, chunk ``V-1``).

With ``model.tie_embeddings`` input and output embeddings are tied.  With one pipeline rank both stages are one module sharing one
``Parameter``; otherwise the last stage holds a copy, initialised bitwise equal from the same seeded generator and
kept equal by summing the two gradients over the embedding group before the optimizer step (both copies carry
``param.shared_embedding = True``, see ``engine.finalize``).  The copy is also marked
``param.shared_embedding_copy = True`` so global grad norms count the tied weight once.

Every parameter is initialised from a generator seeded by ``(seed, global layer index)``, so the full model is
bitwise the same whatever the pipeline layout -- the basis of the pp=1 / pp=2 / pp=2 x vp=2 / pp=4 equivalence.

Shapes: tokens / labels ``[b, s]`` (int64); activations between stages ``[s, b, h]`` (Megatron's layout);
the last stage returns the per-token loss ``[b, s]`` (fp32, nats) when given labels, else logits ``[s, b, V]``.
"""
from __future__ import annotations

import logging
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ...plan.layout import parse_layout
from ..config import ModelConfig
from .registry import FamilySpec, get_family

__all__ = ["ModelChunk", "stage_layers", "build_model_chunks", "chunk_stage", "canonical_module", "family_parts",
           "block_part", "layer_block", "canonical_names", "canonical_shapes"]

log = logging.getLogger("pipecast." + __name__.rsplit(".", 1)[-1])

_EMBEDDING_STREAM = 0  # generator stream of the word / position embedding; block i uses stream i + 1
_HEAD_STREAM = -1  # an untied output head


def _generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + stream)


def chunk_stage(pp_rank: int, chunk: int, pp_size: int) -> int:
    """Virtual pipeline stage of model chunk ``chunk`` on pipeline rank ``pp_rank`` (``chunk*P + rank``)."""
    return chunk * pp_size + pp_rank


def stage_layers(num_layers: int, num_stages: int, stage: int, layout: str | None = None) -> range:
    """Global indices of the transformer blocks of virtual stage ``stage``: consecutive, as the pipeline layout
    ``layout`` (``model.pipeline_layout``, checked by the config: :mod:`engine.plan.layout`) places them, or equal
    slices when it is None."""
    if layout:
        return parse_layout(layout).layers(stage)
    per = num_layers // num_stages
    return range(stage * per, (stage + 1) * per)


class OutputHead(nn.Module):
    """Final-stage copy of the tied word embedding: ``[s, b, h] -> [s, b, V]`` logits (``x @ word.weight.T``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    @property
    def weight(self) -> nn.Parameter:
        return self.word.weight


def layer_block(family: FamilySpec, cfg: ModelConfig, ffn_hidden_size: int, index: int) -> nn.Module:
    """The block of global layer ``index``: the family's ``moe_block`` where ``model.moe`` makes it a MoE layer,
    else its ``block``."""
    if cfg.moe is not None and cfg.moe.is_moe_layer(index):
        return family.moe_block(cfg, index)
    return family.block(cfg, ffn_hidden_size)


def _te_block(cfg: ModelConfig, ffn_hidden_size: int, index: int) -> nn.Module | None:
    """A Transformer Engine ``TransformerLayer`` (``[s, b, h]``, causal) or None when TE is not importable."""
    try:
        import transformer_engine.pytorch as te  # noqa: PLC0415 - optional dependency
    except Exception as exc:  # noqa: BLE001 - any import failure means: use plain torch
        log.info("model.transformer_engine=true but Transformer Engine is not importable (%s); using torch layers",
                 exc)
        return None
    return te.TransformerLayer(cfg.hidden_size, ffn_hidden_size, cfg.num_attention_heads,
                               layernorm_epsilon=cfg.norm_epsilon, hidden_dropout=cfg.dropout,
                               attention_dropout=cfg.dropout, self_attn_mask_type="causal",
                               layer_number=index + 1, device="cuda")


class ModelChunk(nn.Module):
    """One model chunk (virtual pipeline stage) of a model of ``cfg.family``, with the Megatron chunk protocol.

    Attributes:
        config: the ``ModelParallelConfig`` the schedules read (``get_model_config(chunk)``).
        family: the family's :class:`~engine.training.models.registry.FamilySpec`.
        stage, layer_ids, is_first, is_last: position in the pipeline.

    ``set_input_tensor(t)`` stores the activation received from the previous stage (``[s, b, h]``; a one-element
    list is accepted as Megatron passes one).  ``forward(tokens, labels)``: the first stage embeds ``tokens``
    ``[b, s]``, other stages start from the stored input; the last stage returns the per-token loss ``[b, s]``
    when ``labels`` is given (logits ``[s, b, V]`` otherwise); every other stage returns ``[s, b, h]``.
    """

    @property
    def decoder(self) -> "ModelChunk":
        """Megatron's ``model.decoder``: ``set_current_microbatch`` reaches ``decoder.layers`` (this chunk's blocks)."""
        return self

    def __init__(self, cfg: ModelConfig, ffn_hidden_size: int, stage: int, num_stages: int, seed: int,
                 mp_config=None, use_te: bool = False):
        super().__init__()
        self.config = mp_config
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.tied = cfg.tie_embeddings
        self.seq_length = cfg.seq_length  # the longest context (sampling windows to it)
        self.layer_ids = stage_layers(cfg.num_layers, num_stages, stage, cfg.pipeline_layout)
        self.input_tensor: torch.Tensor | None = None
        family = self.family = get_family(cfg.family)
        self.embedding = family.embedding(cfg) if self.is_first else None
        blocks = []
        for index in self.layer_ids:
            block = _te_block(cfg, ffn_hidden_size, index) if use_te else None
            if block is None:
                block = layer_block(family, cfg, ffn_hidden_size, index)
                block.reset_parameters(cfg.init_std, cfg.num_layers, _generator(seed, index + 1))
            blocks.append(block)
        self.layers = nn.ModuleList(blocks)
        self.final_norm = family.final_norm(cfg) if self.is_last else None
        if self.is_first:
            self._init_embedding(self.embedding.word, getattr(self.embedding, "pos", None), cfg,
                                 _generator(seed, _EMBEDDING_STREAM))
        # the output head: the embedding itself when this one chunk holds both ends, else the last stage's own
        # weight -- a bitwise copy of the word embedding when tied (same generator stream), independent otherwise
        self.head: OutputHead | None = None
        if self.is_last and not (self.is_first and self.tied):
            self.head = OutputHead(cfg)
            stream = _EMBEDDING_STREAM if self.tied else _HEAD_STREAM
            self._init_embedding(self.head.word, None, cfg, _generator(seed, stream))
            if self.tied:
                self.head.word.weight.shared_embedding_copy = True
        if self.tied and num_stages > 1:  # two copies: finalize sums their gradients (engine.finalize)
            for weight in ((self.embedding.word.weight if self.is_first else None),
                           (self.head.word.weight if self.head is not None else None)):
                if weight is not None:
                    weight.shared_embedding = True

    @staticmethod
    @torch.no_grad()
    def _init_embedding(word: nn.Embedding, pos: nn.Embedding | None, cfg: ModelConfig, g: torch.Generator) -> None:
        word.weight.copy_(torch.randn(word.weight.shape, generator=g) * cfg.init_std)
        if pos is not None:
            pos.weight.copy_(torch.randn(pos.weight.shape, generator=g) * cfg.init_std)

    def output_weight(self) -> torch.Tensor:
        """The ``[V, h]`` weight of the output head (the tied word embedding, or the last stage's copy)."""
        return self.head.weight if self.head is not None else self.embedding.word.weight

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"ModelChunk takes one input tensor [s, b, h], got a list of {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            if tokens is None:
                raise ValueError(f"model chunk of stage {self.stage} is the first stage and needs tokens [b, s]")
            x = self.embedding(tokens)
        else:
            if self.input_tensor is None:
                raise RuntimeError(f"model chunk of stage {self.stage} has no input tensor; the schedule must call "
                                   f"set_input_tensor before forward")
            x = self.input_tensor
        for layer in self.layers:
            x = layer(x)
        if not self.is_last:
            dtype = getattr(self.config, "pipeline_dtype", None)
            return x if dtype is None else x.to(dtype)  # autocast (e.g. TE layers) may hand back bf16
        weight = self.output_weight()
        if isinstance(weight, DTensor):  # vocabulary-sharded (parallel.tensor > 1)
            from ..parallel.tensor_parallel import vocab_parallel_logits
            logits = vocab_parallel_logits(self.final_norm(x), weight)
        else:
            logits = F.linear(self.final_norm(x), weight)  # [s, b, V]
        if labels is None:
            return logits
        s, b, v = logits.shape
        loss = F.cross_entropy(logits.float().reshape(s * b, v), labels.t().reshape(s * b), reduction="none")
        return loss.view(s, b).t()  # [b, s]


def build_model_chunks(cfg: ModelConfig, ffn_hidden_size: int, pp_size: int, pp_rank: int, vp_size: int,
                       seed: int, mp_config=None, device: torch.device | str = "cpu",
                       stages: Sequence[int] | None = None) -> list[ModelChunk]:
    """The ``vp_size`` model chunks of pipeline rank ``pp_rank``: chunk ``c`` is virtual stage ``stages[c]``
    (the plan's placement, :meth:`engine.plan.build.Plan.stages_of`; default the looped ``c*P + r``).

    With ``tie_embeddings`` and a single stage holding both ends (``pp_size == vp_size == 1``) the output head
    shares the embedding's ``Parameter``; otherwise the last stage gets its own bitwise-equal copy.
    """
    num_stages = pp_size * vp_size
    use_te = cfg.transformer_engine and torch.device(device).type == "cuda"
    if cfg.transformer_engine and not use_te:
        log.info("model.transformer_engine=true needs CUDA; using torch layers on %s", device)
    if stages is None:
        stages = [chunk_stage(pp_rank, c, pp_size) for c in range(vp_size)]
    chunks = [ModelChunk(cfg, ffn_hidden_size, stage, num_stages, seed, mp_config, use_te=use_te).to(device)
              for stage in stages]
    _share_tied_ends(chunks)
    return chunks


def _share_tied_ends(chunks: list[ModelChunk]) -> None:
    """One rank holding the first and the last stage (V placement): the head uses the embedding's ``Parameter``
    itself (one weight, one gradient: no copy to keep in sync, counted once in norms and the optimizer)."""
    first = next((c for c in chunks if c.is_first), None)
    last = next((c for c in chunks if c.is_last), None)
    if first is None or last is None or first is last or not last.tied or last.head is None:
        return
    last.head.word.weight = first.embedding.word.weight


def canonical_module(chunks: Iterable[ModelChunk]) -> nn.Module:
    """A container whose parameter names do not depend on the pipeline layout.

    ``layers.<global index>.*``, ``embedding.word.weight`` (also the last stage's tied copy: the two are bitwise
    equal, so a checkpoint stores one tensor), ``embedding.pos.weight`` (a learned position embedding), ``final_norm.*``,
    ``output_head.word.weight`` (untied).  Used for checkpoints,
    so a run can be resumed with another pipeline layout.
    """
    root = nn.Module()
    root.layers = nn.ModuleDict()
    for chunk in chunks:
        for index, layer in zip(chunk.layer_ids, chunk.layers):
            root.layers[str(index)] = layer
        if chunk.is_first:
            root.embedding = chunk.embedding
        if chunk.is_last:
            root.final_norm = chunk.final_norm
            if chunk.head is not None:
                if chunk.tied and not hasattr(root, "embedding"):
                    root.embedding = chunk.head  # holds .word: the first stage's name for the tied weight
                elif not chunk.tied:
                    root.output_head = chunk.head
    return root


def family_parts(cfg: ModelConfig, ffn_hidden_size: int) -> dict[str, nn.Module]:
    """One ``embedding``, one ``block`` and one ``final_norm`` of ``cfg``'s family on the meta device (parameter
    names and shapes, no memory, no initialisation); with ``model.moe`` also one ``moe_block`` (all experts)."""
    family: FamilySpec = get_family(cfg.family)
    with torch.device("meta"):
        parts = {"embedding": family.embedding(cfg), "block": family.block(cfg, ffn_hidden_size),
                 "final_norm": family.final_norm(cfg)}
        if cfg.moe is not None:
            parts["moe_block"] = family.moe_block(cfg, cfg.moe.first_dense_layers)
        return parts


def block_part(cfg: ModelConfig, index: int) -> str:
    """The :func:`family_parts` key of global layer ``index``'s block (``"moe_block"`` or ``"block"``)."""
    return "moe_block" if cfg.moe is not None and cfg.moe.is_moe_layer(index) else "block"


def canonical_names(cfg: ModelConfig, ffn_hidden_size: int) -> list[str]:
    """Every parameter name of :func:`canonical_module` for the whole model of ``cfg`` (the untied head included
    when untied), without building it."""
    return list(canonical_shapes(cfg, ffn_hidden_size))


def canonical_shapes(cfg: ModelConfig, ffn_hidden_size: int) -> dict[str, tuple[int, ...]]:
    """:func:`canonical_names` -> each parameter's shape (the untied head: the word embedding's ``[V, h]``), from
    the family's parts on the meta device."""
    parts = family_parts(cfg, ffn_hidden_size)
    shapes = {f"embedding.{n}": tuple(p.shape) for n, p in parts["embedding"].named_parameters()}
    shapes |= {f"layers.{i}.{n}": tuple(p.shape) for i in range(cfg.num_layers)
               for n, p in parts[block_part(cfg, i)].named_parameters()}
    shapes |= {f"final_norm.{n}": tuple(p.shape) for n, p in parts["final_norm"].named_parameters()}
    if not cfg.tie_embeddings:
        shapes["output_head.word.weight"] = shapes["embedding.word.weight"]
    return shapes
