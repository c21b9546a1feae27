"""Split your own model into this rank's pipeline model chunks, keeping the model's parameter names.

A model whose body is a list of layers (``transformer.h`` of a GPT-2, or an ``nn.Sequential``) plus first-stage
modules (embeddings) and last-stage modules (final norm, head) is cut into ``num_stages`` virtual pipeline stages of
consecutive layers: equal numbers, or the per-stage counts of a pipeline layout (``layout="Et*3|t*4|t*4|t*3L"`` or
``layout=[3, 4, 4, 3]``, :mod:`engine.plan.layout`: a lighter first and last stage).  :func:`split_model` builds the chunks of the stages one rank holds, in chunk
order; the placement is a plain sequence of stage indices (:func:`looped_stages` for 1F1B / interleaved 1F1B,
:func:`v_stages` for the V placement of ZB-V / DualPipeV).

Each chunk (:class:`PipelineChunk`) follows the per-stage contract of the schedules: ``.config``,
``set_input_tensor`` (a tensor or a one-element list), activations ``[s, b, h]`` in ``config.pipeline_dtype``
between stages.  With ``batch_first=True`` the layers see ``[b, s, h]`` (a Hugging Face style model runs
unchanged) while the pipeline still sends ``[s, b, h]``.

Parameter names stay those of the original model: a chunk holds the original modules (not copies) under their
original dotted paths, so ``chunk.state_dict()`` keys are the unsplit model's keys and the merged state dicts of all
chunks load into the unsplit model.

Tied weights: a parameter used by the first and the last stage (a word embedding tied to the output head) is
summed over the embedding group by :func:`engine.finalize.finalize_model_grads` when those two stages are on
different ranks; the chunks then mark it ``shared_embedding = True`` (Megatron's attribute; the last stage's copy
also ``shared_embedding_copy = True``, so a global grad norm counts it once).  When one rank holds both stages (the V
placement) the two chunks share one ``Parameter`` whose gradient accumulates locally and nothing is marked.  Every
rank must build the model identically (same seed) so the two copies start equal.  Parameters shared by any other
pair of stages are rejected.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from .plan.layout import PipelineLayout, resolve_layout

__all__ = ["PipelineChunk", "split_model", "looped_stages", "v_stages"]


def _check_rank(pp_rank: int, pp_size: int) -> None:
    for name, value in (("pp_rank", pp_rank), ("pp_size", pp_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} must be an int")
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, pp_size) with pp_size={pp_size} >= 1")


def looped_stages(pp_rank: int, pp_size: int, num_chunks: int = 1) -> list[int]:
    """Megatron's looped placement: chunk ``c`` of pipeline rank ``r`` is virtual stage ``c*P + r``
    (``num_chunks=1``: 1F1B; ``num_chunks = virtual_pipeline_model_parallel_size``: interleaved 1F1B)."""
    _check_rank(pp_rank, pp_size)
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks!r} must be an int >= 1 (model chunks per rank)")
    return [c * pp_size + pp_rank for c in range(num_chunks)]


def v_stages(pp_rank: int, pp_size: int) -> list[int]:
    """The V placement (ZB-V, DualPipeV): rank ``r`` holds stages ``r`` and ``2P-1-r`` of ``2P``, so rank 0 holds
    the first and the last stage."""
    _check_rank(pp_rank, pp_size)
    return [pp_rank, 2 * pp_size - 1 - pp_rank]


class _LayerSlice(nn.Module):
    """Consecutive layers of a layer list, registered under their global index (``"4"``, ``"5"``), so state-dict
    keys match the original ``ModuleList`` / ``Sequential``; iterating yields the layers in order."""

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


def _default_embed(chunk: "PipelineChunk", *inputs, **kwargs):
    """Apply the first-stage modules in order to the first input (no modules: the input is the hidden state)."""
    if not inputs:
        raise ValueError(f"model chunk of stage {chunk.stage} is the first stage and needs the model input; call "
                         "it as model(inputs, ...) in forward_step_func")
    x = inputs[0]
    for module in chunk.first_modules:
        x = module(x)
    return x


def _default_head(chunk: "PipelineChunk", hidden, *inputs, **kwargs):
    """Apply the last-stage modules in order to the hidden state."""
    for module in chunk.last_modules:
        hidden = module(hidden)
    return hidden


def _default_block(layer: nn.Module, hidden):
    """Call a layer; a layer returning a tuple or list (Hugging Face blocks) gives its first element."""
    out = layer(hidden)
    return out[0] if isinstance(out, (tuple, list)) else out


class PipelineChunk(nn.Module):
    """One model chunk (virtual pipeline stage) of a model split by :func:`split_model`.

    Attributes:
        config: the ``ModelParallelConfig`` the schedules read.
        stage, num_stages, is_first, is_last: position in the pipeline; ``vp_stage``: index in this rank's chunks.
        body_layers: this chunk's body layers in order (a plain list; the modules are registered under their names).
        first_modules / last_modules: the first- / last-stage modules this chunk holds (empty elsewhere).
        tied_weights: names of the parameters finalize sums over the embedding group (see the module docstring).

    ``forward(*inputs, **kwargs)``: the first stage computes ``embed(chunk, *inputs, **kwargs)``, other stages
    start from the tensor given to ``set_input_tensor`` (``[s, b, h]``); then ``block(layer, hidden)`` per layer;
    the last stage returns ``head(chunk, hidden, *inputs, **kwargs)`` (e.g. logits), every other stage the hidden
    state ``[s, b, h]`` in ``config.pipeline_dtype``.  With ``batch_first`` the embedding, the layers and the head
    see ``[b, s, h]``.
    """

    def __init__(self, *, config, stage: int, num_stages: int, vp_stage: int, batch_first: bool,
                 embed: Callable, head: Callable, block: Callable):
        super().__init__()
        self.config = config
        self.stage, self.num_stages, self.vp_stage = stage, num_stages, vp_stage
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.batch_first = batch_first
        self._embed, self._head, self._block = embed, head, block
        self.body_layers: list = []
        self.first_modules: list = []
        self.last_modules: list = []
        self.tied_weights: tuple = ()
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, input_tensor) -> None:
        """Store the activation from the previous stage (``[s, b, h]``; a one-element list is accepted)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"model chunk of stage {self.stage} takes one input tensor [s, b, h], got a list of "
                                 f"{len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def _input(self, inputs, kwargs):
        if self.is_first:
            return self._embed(self, *inputs, **kwargs)  # [b, s, h] with batch_first, else [s, b, h]
        if self.input_tensor is None:
            raise RuntimeError(f"model chunk of stage {self.stage} has no input tensor; the schedule must call "
                               "set_input_tensor before forward")
        x = self.input_tensor  # [s, b, h] from the pipeline
        return x.transpose(0, 1) if self.batch_first else x  # [b, s, h] view: gradients flow back as [s, b, h]

    def forward(self, *inputs, **kwargs):
        x = self._input(inputs, kwargs)
        for layer in self.body_layers:
            x = self._block(layer, x)
        if self.is_last:
            return self._head(self, x, *inputs, **kwargs)
        if self.batch_first:
            x = x.transpose(0, 1)  # [b, s, h] -> [s, b, h]
        dtype = getattr(self.config, "pipeline_dtype", None)
        if dtype is not None:
            x = x.to(dtype)
        x = x.contiguous()  # a layer fed the transposed input may return [b, s, h] laid out as [s, b, h]: a view
        return x if x._base is None else x.clone()  # owns its storage (deallocate_pipeline_outputs frees it)


# ---- building the chunks ------------------------------------------------------------------------------------------

def _submodule(model: nn.Module, path: str, what: str) -> nn.Module:
    if path == "":
        return model
    try:
        return model.get_submodule(path)
    except AttributeError:
        children = [name for name, _ in model.named_children()]
        raise ValueError(f"{what}={path!r} names no submodule of {type(model).__name__} (its top-level modules: "
                         f"{children}); pass a dotted path such as 'transformer.h'") from None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _module_path(model: nn.Module, module: nn.Module, what: str) -> str:
    for name, m in model.named_modules(remove_duplicate=False):
        if m is module:
            return name
    raise ValueError(f"{what} ({type(module).__name__}) is not a submodule of the model; pass a dotted path")


def _body(model: nn.Module, layers, first: Sequence[str], last: Sequence[str]) -> tuple[str, list]:
    """``(layers path, [(dotted name, layer), ...])``: the children of the layer list not named in first / last."""
    path = layers if isinstance(layers, str) else _module_path(model, layers, "layers")
    container = _submodule(model, path, "layers")
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"layers={path!r} is a {type(container).__name__}; pass the path of an nn.ModuleList or "
                        "nn.Sequential holding the model's layers")
    named = set(first) | set(last)
    body = [(_join(path, n), m) for n, m in container.named_children() if _join(path, n) not in named]
    for name in named:
        for layer_name, _ in body:
            if name.startswith(layer_name + ".") or layer_name.startswith(name + "."):
                raise ValueError(f"first/last module {name!r} overlaps body layer {layer_name!r}; name modules "
                                 f"outside the layers or whole entries of {path!r}")
    if not body:
        raise ValueError(f"layers={path!r} holds no layers besides the first/last modules")
    return path, body


def _stage_layers(num_layers: int, num_stages: int, path: str, config, per_rank: int, layout) -> list[range]:
    """Per virtual stage, the indices of its body layers: equal slices, or the counts of ``layout``."""
    pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    if layout is None:
        if num_layers % num_stages:
            raise ValueError(f"{num_layers} layers ({path!r}) do not split evenly into num_stages={num_stages} "
                             f"virtual pipeline stages (pipeline_model_parallel_size={pp}, {per_rank} model chunk(s) "
                             f"per rank); use a layer count divisible by {num_stages}, pass layout= with the layers "
                             "of each stage (e.g. layout=[3, 4, 4, 3]), or change pipeline_model_parallel_size / the "
                             "chunks per rank (virtual_pipeline_model_parallel_size) or num_stages")
        layout = PipelineLayout.even(num_layers, num_stages)
    else:
        looped = num_stages % pp == 0
        names = {"layout": "layout", "num_layers": f"len({path})", "virtual": "chunks per rank",
                 "pipeline": "pipeline_model_parallel_size" if looped else "num_stages"}
        layout = resolve_layout(layout, num_layers=num_layers, pp_size=pp if looped else num_stages,
                                virtual=num_stages // pp if looped else 1, names=names)
    return [layout.layers(s) for s in range(num_stages)]


def _stage_entries(first: list, body: list, last: list, ranges: list[range]) -> list[list]:
    """Per virtual stage, its ``(dotted name, module)`` entries: first-stage modules, layers, last-stage modules."""
    stages = [list(body[r.start:r.stop]) for r in ranges]
    stages[0] = first + stages[0]
    stages[-1] = stages[-1] + last
    return stages


def _tied_parameters(entries: list[list]) -> list[tuple[nn.Parameter, list[str]]]:
    """Parameters used by more than one stage: ``[(param, [names...])]`` for those used by exactly the first and
    the last stage (tied embedding and head); raises ``ValueError`` for any other sharing."""
    users: dict[int, tuple[nn.Parameter, set, list]] = {}
    for stage, stage_entries in enumerate(entries):
        for name, module in stage_entries:
            for pname, p in module.named_parameters(prefix=name, remove_duplicate=False):
                _, used_by, names = users.setdefault(id(p), (p, set(), []))
                used_by.add(stage)
                if pname not in names:
                    names.append(pname)
    ends = {0, len(entries) - 1}
    tied = []
    for p, used_by, names in users.values():
        if len(used_by) < 2:
            continue
        if used_by != ends:
            raise ValueError(f"parameter {names} is used by virtual stages {sorted(used_by)}; only a weight shared by "
                             f"the first and the last stage (0 and {len(entries) - 1}: a tied embedding and head) "
                             "can be kept in sync; untie it or move the modules that share it into one stage")
        tied.append((p, names))
    return tied


def _check_covered(model: nn.Module, entries: list[list]) -> None:
    """Every parameter of the model belongs to some stage (a forgotten head or norm is an error, not a silent
    omission)."""
    covered = {id(p) for stage_entries in entries for _, m in stage_entries for p in m.parameters()}
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise ValueError(f"parameters {missing[:4]}{' ...' if len(missing) > 4 else ''} belong to no stage: their "
                         "modules are neither body layers nor named in first= / last=; name them there (e.g. "
                         "last=['transformer.ln_f', 'lm_head']) or delete the unused modules before splitting")


def _attach(chunk: PipelineChunk, name: str, module: nn.Module, layers_path: str) -> None:
    """Register ``module`` on ``chunk`` under its original dotted ``name``, creating the containers on the way."""
    parts = name.split(".")
    if parts[0] not in chunk._modules and hasattr(chunk, parts[0]):
        raise ValueError(f"the model's module {name!r} would shadow PipelineChunk.{parts[0]}; rename that module "
                         "(or wrap the model in a container module)")
    node = chunk
    for depth in range(1, len(parts)):
        child = node._modules.get(parts[depth - 1])
        if child is None:
            child = _LayerSlice() if ".".join(parts[:depth]) == layers_path else nn.Module()
            node.add_module(parts[depth - 1], child)
        node = child
    node.add_module(parts[-1], module)


def _check_stages(stages, num_stages: int) -> list[int]:
    stages = list(stages)
    if not stages or any(isinstance(s, bool) or not isinstance(s, int) for s in stages):
        raise TypeError(f"stages={stages!r} must be a non-empty sequence of virtual stage indices (ints) in chunk "
                        "order, e.g. looped_stages(rank, P, V) or v_stages(rank, P)")
    if len(set(stages)) != len(stages) or not all(0 <= s < num_stages for s in stages):
        raise ValueError(f"stages={stages} must be distinct virtual stage indices in [0, num_stages={num_stages})")
    return stages


def split_model(model: nn.Module, *, layers, stages: Sequence[int], config, first: Iterable[str] = (),
                last: Iterable[str] = (), num_stages: Optional[int] = None, embed: Optional[Callable] = None,
                head: Optional[Callable] = None, block: Optional[Callable] = None,
                batch_first: bool = False, layout=None) -> list[PipelineChunk]:
    """This rank's model chunks of ``model``, one per entry of ``stages`` (virtual stage indices, chunk order).

    Args:
        model: the whole model, built identically on every rank (its modules are reused, not copied).
        layers: dotted path of the ``nn.ModuleList`` / ``nn.Sequential`` holding the body layers (``""``: the model
            itself), or that module; its children named in ``first`` / ``last`` are not body layers.
        stages: the virtual stages this rank holds, in chunk order (:func:`looped_stages`, :func:`v_stages`).
        config: the ``ModelParallelConfig`` each chunk carries as ``.config``.
        first / last: dotted paths of the first-stage (embeddings) / last-stage (final norm, head) modules.
        num_stages: total virtual stages; default ``config.pipeline_model_parallel_size * len(stages)``.
        embed: ``embed(chunk, *inputs, **kwargs) -> hidden`` on the first stage; default: the ``first`` modules in
            order on ``inputs[0]``.  Reach modules by their original paths (``chunk.transformer.wte``).
        head: ``head(chunk, hidden, *inputs, **kwargs) -> output`` on the last stage; default: the ``last`` modules
            in order.
        block: ``block(layer, hidden) -> hidden``; default ``layer(hidden)`` (first element of a tuple).
        batch_first: the model works on ``[b, s, h]``; the chunks transpose to and from the pipeline's ``[s, b, h]``.
        layout: the body layers of each virtual stage, in stage order: a pipeline layout string
            (``"Et*3|t*4|t*4|t*3L"``: ``t`` one body layer, ``E`` / ``L`` where the ``first`` / ``last`` modules go,
            which must be the first and the last stage; :mod:`engine.plan.layout`) or a list of per-stage layer
            counts (``[3, 4, 4, 3]``); default equal counts.

    Raises ``ValueError`` / ``TypeError`` for a path that names no module, stages out of range or repeated, a layer
    count not divisible by ``num_stages`` (without ``layout``), a layout that does not fit (its stage count, ``E``
    / ``L`` placement, an empty stage, its layer count: :func:`engine.plan.layout.resolve_layout`), parameters in no
    stage, and parameters shared by stages other than the first and the last.
    """
    first, last = list(first), list(last)
    if num_stages is None:
        num_stages = int(getattr(config, "pipeline_model_parallel_size", 1)) * len(list(stages))
    stages = _check_stages(stages, num_stages)
    layers_path, body = _body(model, layers, first, last)
    ranges = _stage_layers(len(body), num_stages, layers_path, config, len(stages), layout)
    ends = ([(n, _submodule(model, n, "first")) for n in first], [(n, _submodule(model, n, "last")) for n in last])
    entries = _stage_entries(ends[0], body, ends[1], ranges)
    _check_covered(model, entries)
    tied = _tied_parameters(entries)
    chunks = []
    for index, stage in enumerate(stages):
        chunk = PipelineChunk(config=config, stage=stage, num_stages=num_stages, vp_stage=index,
                              batch_first=batch_first, embed=embed or _default_embed, head=head or _default_head,
                              block=block or _default_block)
        for name, module in entries[stage]:
            _attach(chunk, name, module, layers_path)
        chunk.body_layers = [m for _, m in body[ranges[stage].start:ranges[stage].stop]]
        chunk.first_modules = [m for _, m in ends[0]] if chunk.is_first else []
        chunk.last_modules = [m for _, m in ends[1]] if chunk.is_last else []
        chunks.append(chunk)
    _mark_tied(chunks, tied, num_stages)
    return chunks


def _mark_tied(chunks: list[PipelineChunk], tied: list, num_stages: int) -> None:
    """Mark the tied parameters for the embedding-group sum when the first and last stage are on different ranks."""
    held = {c.stage for c in chunks}
    holds_first, holds_last = 0 in held, num_stages - 1 in held
    cross = not (holds_first and holds_last)
    for p, names in tied:
        if holds_first or holds_last:
            p.shared_embedding = cross
            p.shared_embedding_copy = cross and holds_last
    if not cross:
        return
    for chunk in chunks:
        own = {n for n, _ in chunk.named_parameters(remove_duplicate=False)}
        chunk.tied_weights = tuple(n for p, names in tied for n in names if n in own)
