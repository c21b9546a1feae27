"""The model-family registry: one :class:`FamilySpec` per value of ``model.family``, the one place a family is
described (as a schedule is one entry of :mod:`engine.plan.registry`).

Everything that depends on the family reads its entry: the config (``model.family``'s values, its ``--help`` line,
the family's checks, the architecture a ``model.init_from`` folder's ``config.json`` sets), the model chunks
(:mod:`.chunk`: embedding, blocks, final norm), tensor parallelism (the block's plan,
:mod:`engine.training.parallel.tensor_parallel`), the Hugging Face export and ``init_from`` (names and
``config.json``, :mod:`engine.training.checkpoint.hf`) and the FLOPs estimate (:mod:`engine.training.metrics`, from
the parameters of the modules the family builds).  A family defined outside the package is added with
:func:`register_family`; from then on YAML runs, ``pipecast train --help``, tensor parallelism, export and
``init_from`` know it in that process.  Ranks started by :func:`engine.training.launch_ranks` import the module of
the function they run, so a module that registers its family at import has it registered on every rank.

Pure: no torch (the config reads this registry before torch is imported).  A family's builders may import torch
when they are called: the built-in families keep their layers in a ``layers`` module for that reason.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the config imports this module
    from ..config import ModelConfig

__all__ = ["FamilySpec", "HuggingFace", "TP_STYLES", "register_family", "get_family", "family_names", "unsupported",
           "hf_value"]

TP_STYLES = ("colwise", "fused_qkv", "rowwise", "norm")
"""How a block's submodule is split over the tensor-parallel ranks (:attr:`FamilySpec.tensor_parallel`):
``colwise`` (output features sharded), ``fused_qkv`` (a ``[3h, h]`` projection whose ``q``, ``k`` and ``v`` row
blocks are each sharded), ``rowwise`` (input features sharded, the output all-reduced) and ``norm`` (replicated;
with ``parallel.sequence_parallel`` it runs on the rank's ``[s/T, b, h]`` sequence shard)."""


@dataclass(frozen=True)
class HuggingFace:
    """How a family's weights and ``config.json`` map onto a ``transformers`` model (export, ``model.init_from``).

    Attributes:
        model_type: ``config.json``'s ``model_type``.
        architectures: the ``architectures`` ``init_from`` accepts; export writes the first.
        prefix: the base model's name prefix (e.g. ``"model."``), absent from a bare base model's folder.
        rules: ``(pattern, name, transposed)`` per parameter: a pipecast name (layout-independent,
            :func:`~engine.training.models.chunk.canonical_module`; matched with ``re.fullmatch``) -> the Hugging
            Face name (a ``re.sub`` template); ``transposed``: stored as ``[in, out]``.
        config: ``config(cfg, ffn_hidden_size) -> dict``: the family's ``config.json`` keys (the common ones --
            architectures, vocabulary, tying, dtype -- are added by :func:`engine.training.checkpoint.hf.hf_config`).
        fields: ``fields(config_json) -> dict``: the ``model.*`` architecture fields a ``config.json`` sets (missing
            keys take ``transformers``' defaults; ``family`` is added by the caller).  Raises the ``ValueError`` of
            :func:`unsupported` for an option the family cannot reproduce.
    """

    model_type: str
    architectures: tuple[str, ...]
    prefix: str
    rules: tuple[tuple[str, str, bool], ...]
    config: Callable[[ModelConfig, int], dict]
    fields: Callable[[dict], dict]


@dataclass(frozen=True)
class FamilySpec:
    """One model family: the modules it builds and what the rest of the recipe must know about them.

    Attributes:
        name: the value of ``model.family`` (a word of letters, digits and ``_``).
        summary: one line for ``pipecast train --help``.
        embedding: ``embedding(cfg) -> nn.Module``, the first stage's ``[b, s]`` token ids -> ``[s, b, h]``; it
            holds the word embedding as ``.word`` (an ``nn.Embedding``, shared with a tied output head) and may hold
            a learned position embedding as ``.pos``.
        block: ``block(cfg, ffn_hidden_size) -> nn.Module``, ``[s, b, h] -> [s, b, h]``, with
            ``reset_parameters(std, num_layers, generator)``; under tensor parallelism it reads its local head
            count from the shapes.
        final_norm: ``final_norm(cfg) -> nn.Module``, the norm before the output head.
        tensor_parallel: the block's tensor-parallel plan: submodule name -> one of :data:`TP_STYLES`
            (``{}``: the family does not run with ``parallel.tensor > 1``).
        check: ``check(cfg) -> str | None``: why the ``model`` section does not fit the family (the message names
            the field, its value and the fix), or ``None``; the generic checks run first
            (:func:`engine.training.config.validate`).
        transformer_engine: Transformer Engine's ``TransformerLayer`` (LayerNorm, GELU MLP, biases) computes this
            family's block, so ``model.transformer_engine`` may replace it.
        hf: its Hugging Face names and ``config.json`` (``None``: no export to, and no ``init_from`` of, Hugging
            Face folders).
        memory: ``memory(cfg, ffn_hidden_size) -> dict``: per token of a microbatch, the elements one block saves
            for its backward and one pending ``W`` holds, for the memory estimate (:mod:`engine.training.memory`,
            which names the keys); ``None``: the estimate counts a generic pre-norm attention + MLP block.  The
            parameters are counted on the modules themselves.
        moe_block: ``moe_block(cfg, layer) -> nn.Module``: the block of global layer ``layer`` when ``model.moe``
            makes it a mixture-of-experts layer (:meth:`~engine.training.config.MoEConfig.is_moe_layer`), as
            ``block`` (``[s, b, h] -> [s, b, h]``, ``reset_parameters``) with an :class:`engine.moe.MoELayer`
            holding all of its experts (the parallelism keeps each rank's share, ``parallel.expert``); ``None``:
            the family cannot hold ``model.moe`` (refused).
        attention_core: the dotted name, inside a block, of its attention core module (scores, softmax, dropout
            and weighted sum of values, no parameters; e.g. :class:`~engine.training.models.attention.CoreAttention`):
            what ``model.recompute: selective`` recomputes (``None``: the block has none, selective is refused).
    """

    name: str
    summary: str
    embedding: Callable[[ModelConfig], Any]
    block: Callable[[ModelConfig, int], Any]
    final_norm: Callable[[ModelConfig], Any]
    tensor_parallel: Mapping[str, str] = field(default_factory=dict)
    check: Callable[[ModelConfig], str | None] | None = None
    transformer_engine: bool = False
    hf: HuggingFace | None = None
    memory: Callable[[ModelConfig, int], dict] | None = None
    moe_block: Callable[[ModelConfig, int], Any] | None = None
    attention_core: str | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_]+", self.name):
            raise ValueError(f"FamilySpec(name={self.name!r}): a family name is a word of letters, digits and '_' "
                             "(it is a YAML value)")
        unknown = {k: v for k, v in self.tensor_parallel.items() if v not in TP_STYLES}
        if unknown:
            raise ValueError(f"FamilySpec {self.name!r}: tensor_parallel styles {unknown} are unknown; use "
                             f"{', '.join(TP_STYLES)}")

    def __str__(self) -> str:
        return self.name


_REGISTRY: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec, *, replace: bool = False) -> FamilySpec:
    """Add ``spec`` to the registry (module doc); returns it.

    Registering again an entry of the same name whose block builder comes from the same module replaces it;
    ``replace=True`` replaces any entry.

    Raises:
        TypeError: ``spec`` is not a :class:`FamilySpec`.
        ValueError: another module registered that name.
    """
    if not isinstance(spec, FamilySpec):
        raise TypeError(f"register_family({spec!r}): pass a FamilySpec")
    old = _REGISTRY.get(spec.name)
    if old is not None and not replace and _origin(old) != _origin(spec):
        raise ValueError(f"model family {spec.name!r} is already registered (by {_origin(old)}); choose another "
                         "name or pass replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def _origin(spec: FamilySpec) -> str:
    return getattr(spec.block, "__module__", "?")


def get_family(name) -> FamilySpec:
    """The entry named ``name`` (a :class:`FamilySpec` is returned as is).

    Raises:
        ValueError: an unknown name; the message lists the registered ones.
    """
    if isinstance(name, FamilySpec):
        return name
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"model.family={name!r} is unknown; use one of {', '.join(family_names())}, or register "
                         "the family (engine.training.models.register_family) at import of the module the ranks run")
    return spec


def family_names() -> tuple[str, ...]:
    """The registered families, in registration order (built-ins first)."""
    return tuple(_REGISTRY)


def unsupported(key: str, value, why: str) -> ValueError:
    """The error :attr:`HuggingFace.fields` raises for a ``config.json`` option its family cannot reproduce."""
    return ValueError(f"{key}={value!r}, which pipecast's model cannot reproduce ({why}); use a checkpoint without "
                      f"it")


_KINDS = {int: "an integer", float: "a number", bool: "true or false", dict: "a JSON object"}


def hf_value(hf: dict, key: str, default, kind: type = int):
    """``hf[key]`` of a ``config.json`` (``default`` when absent or null), checked to be a ``kind`` (``int``;
    ``float``, which takes integers too; ``bool``; ``dict``): what :attr:`HuggingFace.fields` reads numbers with.

    Raises:
        ValueError: another type (a damaged or hand-edited file), naming the key and the value."""
    value = hf.get(key)
    if value is None:
        return default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is float and number:
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{key}={value!r}, not {_KINDS[kind]}; fix that value in the file (damaged or hand-edited?)")
    return value
