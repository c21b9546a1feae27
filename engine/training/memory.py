"""Each rank's memory, estimated from the config before any rank starts, and the check that refuses a run that
cannot fit (``training.check_memory``).

Per pipeline rank, in bytes (:func:`estimate`; every data-parallel and tensor-parallel rank of a pipeline rank holds
the same):

* **parameters, gradients, optimizer state**: the stage's parameters (:func:`stage_parameters`, counted on the
  family's modules built on the meta device; the layers its tensor-parallel plan shards ``1/T``), fp32, each with
  an fp32 gradient and AdamW's two moments plus one step scalar per parameter tensor; under ``model.precision:
  bf16`` a bf16 copy of each parameter beside its fp32 master (:mod:`engine.training.parallel.precision`; the bf16
  gradients are added into the fp32 ones as autograd writes them: transient).  ``parallel.shard: optimizer``
  (ZeRO-1, data > 1) keeps ``1/D`` of the moments and a ``1/D`` reduce-scattered gradient shard; ``full`` (FSDP2)
  keeps ``1/D`` of everything between steps and gathers each chunk's parameters (bf16 ones under bf16) and fp32
  gradients whole for the step (counted: the peak is in the step); under ``parallel.expert: E`` both keep
  ``1/(D/E)`` of the routed experts' (sharded over their expert-data-parallel ranks).
* **activations**: the plan's peak over its action order of the bytes held by in-flight microbatches -- ``F`` adds
  one microbatch's saved activations of the stage (:func:`activation_bytes`), ``B`` releases them and, under a
  split backward, adds what its pending ``W`` holds (:func:`pending_w_bytes`), ``W`` releases that -- computed by
  :func:`engine.plan.candidates.peak_memory_bytes`, the tuner's memory model, on a :class:`LayoutCosts` built from
  the model's shape instead of measured (:func:`layout_bytes`).  Elements are 2 bytes under ``bf16``, 4 under
  fp32; the attention's log-sum-exp and the loss's log-probabilities are fp32 either way.  ``model.recompute``:
  ``full`` keeps each block's input ``[s, b, h]`` (``h`` per token) instead of the block's tensors,
  ``selective`` drops what the attention core alone saves (the log-sum-exp; with dropout the scores,
  probabilities and mask); the recomputed forward's tensors live only inside one backward (Korthikanti et al.,
  2022, arXiv:2205.05198, sec. 5); ``model.recompute_kept_microbatches: N``: a rank's forwards ``i`` with ``i mod
  (warmup + 1) < N`` keep theirs (:func:`_partial_peak`).  Stages hold the layers ``model.pipeline_layout`` gives them.
* **working**: one microbatch's transients beyond what it saves -- the backward's gradient of the largest layer
  tensors, and on the loss stage the ``[s, b, V]`` logits and their gradient.
* **graphs** (``cuda_graphs.enabled``, roughly): each captured ``(chunk, microbatch)`` graph's static input and
  output ``[s, b, h]``.

:func:`check_memory` compares the sum over this machine's ranks with the host's available memory (``MemAvailable``
of ``/proc/meminfo``; on CPU the ranks' tensors live there, each rank also needs about :data:`RANK_OVERHEAD_BYTES`
for the interpreter and torch) and, on CUDA, the heaviest rank with its device's memory.  The estimate is a floor
plus a margin's worth of transients, not a bound: allocator fragmentation, communication buffers and checkpoint
saves come on top.  The formulas' counts are checked against the modules' parameters and against saved-tensor hooks
(tests/training/test_memory.py); ``benchmarks/memory.py --estimate`` prints predicted against measured bytes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..plan.candidates import LayoutCosts, peak_memory_bytes
from ..plan.graph import memory_levels
from .config import ConfigError, TrainConfig

__all__ = ["RankMemory", "Estimate", "stage_parameters", "stage_expert_parameters", "activation_bytes",
           "pending_w_bytes", "layout_bytes", "estimate", "check_memory", "host_available_bytes",
           "RANK_OVERHEAD_BYTES"]

RANK_OVERHEAD_BYTES = 512 << 20
"""Host memory of one rank besides its tensors: the interpreter, torch and its libraries, gloo buffers, the data
batches (a round figure above what a CPU rank of the default config holds before its first step)."""

_GIB = float(1 << 30)


def _gib(n: float) -> str:
    x = n / _GIB
    return f"{x:,.0f} GiB" if x >= 100 else f"{x:.1f} GiB" if x >= 1 else f"{x:.3g} GiB"


@dataclass(frozen=True)
class RankMemory:
    """The estimate for one pipeline rank (bytes); ``in_flight``: the plan's peak number of in-flight microbatches
    on this rank; ``per_microbatch``: the largest :func:`activation_bytes` of its stages."""

    pipeline_rank: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    working: int
    graphs: int
    in_flight: int
    per_microbatch: int

    @property
    def total(self) -> int:
        """Bytes of every part on this rank."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.working + self.graphs

    def parts(self) -> str:
        """``parameters 1.2 GiB + gradients ... `` for messages."""
        flight = f"{self.in_flight} microbatch{'es' if self.in_flight != 1 else ''} in flight"
        return " + ".join(f"{name} {_gib(getattr(self, name))}" for name in
                          ("parameters", "gradients", "optimizer", "activations", "working", "graphs")
                          if getattr(self, name)) + (
            f" (activations: {flight}, up to {_gib(self.per_microbatch)} each)" if self.activations else "")


@dataclass(frozen=True)
class Estimate:
    """Per pipeline rank :class:`RankMemory`; ``replicas`` ranks (data x tensor) hold each."""

    ranks: tuple[RankMemory, ...]
    replicas: int

    @property
    def heaviest(self) -> RankMemory:
        """The pipeline rank with the largest total (what must fit)."""
        return max(self.ranks, key=lambda r: r.total)

    @property
    def total(self) -> int:
        """Every rank of the job together."""
        return self.replicas * sum(r.total for r in self.ranks)


def _generic(cfg, ffn_hidden_size: int) -> dict:
    """The counts of a pre-norm block with one LayerNorm-style norm per half, fused ``qkv`` attention and a
    two-projection MLP (Korthikanti et al. 2022, arXiv:2205.05198, section 4, without dropout masks): the estimate
    of a registered family that gives no ``memory`` (keys: :mod:`engine.training.models.registry`)."""
    h, f, a = cfg.hidden_size, ffn_hidden_size, cfg.num_attention_heads
    return {"residual": 2 * h + 4, "gathered": 2 * h, "sharded": 4 * h + a + 2 * f, "core": a, "fp32_sharded": a,
            "embedding": 0,
            "final_norm": 2 * h + 2, "w_replicated": 8 * h, "w_sharded": 4 * h + 2 * f, "w_embedding": h,
            "w_final_norm": 2 * h}


def _counts(config: TrainConfig, moe: bool = False) -> dict:
    """Per token: what a block saves and a pending ``W`` holds (the family's ``memory``, else :func:`_generic`):
    a MoE block's with ``moe``, else a dense block's (the family's counts for the model without ``model.moe``)."""
    from .models import get_family
    spec = get_family(config.model.family)
    model = config.model if moe or config.model.moe is None else dataclasses.replace(config.model, moe=None)
    return (spec.memory or _generic)(model, config.ffn_hidden_size)


def _block_counts(config: TrainConfig, stage: int) -> list[dict]:
    """The counts (:func:`_counts`) of each decoder layer of virtual stage ``stage``, dense or MoE."""
    from .models.chunk import block_part
    kinds = [block_part(config.model, i) == "moe_block" for i in config.layout.layers(stage)]
    counts = {moe: _counts(config, moe) for moe in set(kinds)}
    return [counts[moe] for moe in kinds]


def _num_stages(config: TrainConfig) -> int:
    return config.parallel.pipeline * config.parallel.virtual


def _module_parameters(config: TrainConfig) -> dict[str, tuple[int, int, int, int]]:
    """``{"block" | "moe_block" | "embedding" | "final_norm": (sharded, replicated, tensors, experts)}``: the parameter
    elements of one module as the family builds it (on the meta device), split by the family's tensor-parallel
    plan -- ``colwise`` and ``fused_qkv`` projections shard weight and bias, ``rowwise`` the weight; the word
    embedding is vocabulary-parallel; the rest is replicated; a MoE layer's routed experts are split over the
    ``parallel.expert`` ranks (each holds ``num_experts / E`` of them; counted in ``replicated`` and, again, in
    ``experts``)."""
    from ..moe import is_expert_parameter
    from .models import get_family
    from .models.chunk import family_parts
    plan = get_family(config.model.family).tensor_parallel
    out = {}
    for part, module in family_parts(config.model, config.ffn_hidden_size).items():
        sharded = replicated = tensors = expert = expert_tensors = 0
        for name, param in module.named_parameters():
            owner, _, leaf = name.rpartition(".")
            style = "colwise" if part == "embedding" and owner == "word" else plan.get(owner) if part == "block" \
                else None
            if is_expert_parameter(param):
                expert, expert_tensors = expert + param.numel(), expert_tensors + 1
            elif style in ("colwise", "fused_qkv") or (style == "rowwise" and leaf == "weight"):
                sharded, tensors = sharded + param.numel(), tensors + 1
            else:
                replicated, tensors = replicated + param.numel(), tensors + 1
        e = config.parallel.expert
        out[part] = (sharded, replicated + expert // e, tensors + expert_tensors // e, expert // e)
    return out


def stage_parameters(config: TrainConfig, stage: int) -> tuple[int, int]:
    """``(elements, tensors)`` of the parameters one tensor-parallel rank of virtual stage ``stage`` holds
    (sharded ``1/T``; routed experts ``1/E``): its blocks, the embedding on the first stage, the final norm and the output head ``[V, h]``
    on the last (with tied embeddings and one stage, the head is the embedding)."""
    sharded, replicated, tensors, _ = _stage_counts(config, stage)
    stages = _num_stages(config)
    if stage == stages - 1 and (stages > 1 or not config.model.tie_embeddings):
        sharded, tensors = sharded + config.model.vocab_size * config.model.hidden_size, tensors + 1
    return sharded // config.parallel.tensor + replicated, tensors


def stage_expert_parameters(config: TrainConfig, stage: int) -> int:
    """Elements of the routed experts one rank of virtual stage ``stage`` holds (``num_experts / E`` per MoE layer;
    part of :func:`stage_parameters`)."""
    return _stage_counts(config, stage)[3]


def _stage_counts(config: TrainConfig, stage: int) -> list[int]:
    """``(sharded, replicated, tensors, experts)`` of :func:`_module_parameters` summed over the modules of virtual
    stage ``stage``: its blocks, the embedding on the first stage, the final norm on the last (not the output
    head)."""
    from .models.chunk import block_part
    parts, stages = _module_parameters(config), _num_stages(config)
    counts = [0, 0, 0, 0]
    for index in config.layout.layers(stage):  # a dense or a MoE block each
        counts = [x + y for x, y in zip(counts, parts[block_part(config.model, index)])]
    held = (["embedding"] if stage == 0 else []) + (["final_norm"] if stage == stages - 1 else [])
    for part in held:
        counts = [x + y for x, y in zip(counts, parts[part])]
    return counts


def _element_bytes(config: TrainConfig, device_type: str = "cpu") -> int:
    """Bytes of an activation element (parameters and activations are bf16 under ``model.precision: bf16`` on
    every device)."""
    return 2 if config.model.precision == "bf16" else 4


def _tokens(config: TrainConfig) -> int:
    return config.model.seq_length * config.training.micro_batch_size


def activation_bytes(config: TrainConfig, stage: int, device_type: str = "cpu") -> int:
    """Bytes one microbatch's forward through virtual stage ``stage`` saves for its backward, on one
    tensor-parallel rank: its blocks' saved tensors (the family's ``memory`` counts per token: the residual part
    ``1/T`` under sequence parallelism, the sharded part ``1/T`` under tensor parallelism), on the first stage
    the token ids (int64) and the embedding's, on the last the final norm's, the ``[s, b, V]`` fp32
    log-probabilities and the labels (int64).  ``[s, b]`` tokens per microbatch."""
    c, m, tokens, el = _counts(config), config.model, _tokens(config), _element_bytes(config, device_type)
    per_token = sum(_block_bytes(config, layer, el) for layer in _block_counts(config, stage))
    if stage == 0:
        per_token += 8 + el * c["embedding"]
    if stage == _num_stages(config) - 1:
        per_token += el * c["final_norm"] + (4 - el) * c.get("fp32_final_norm", 0) + 4 * m.vocab_size + 8
    return int(per_token * tokens)


def _block_bytes(config: TrainConfig, c: dict, el: int) -> float:
    """Bytes one block saves per token on one tensor-parallel rank, with ``model.recompute`` (module doc); the
    family's ``fp32_residual`` / ``fp32_sharded`` elements (an fp32 norm's tensors, the attention's log-sum-exp;
    ``fp32_final_norm`` for the final norm) are fp32 at either precision; ``core``: what the attention core alone
    saves, dropped by ``selective``."""
    t, m = config.parallel.tensor, config.model
    sp = t if config.parallel.sequence_parallel else 1
    if m.recompute == "full":
        return el * m.hidden_size / sp
    kept = el * (c["residual"] / sp + c["gathered"] + c["sharded"] / t)
    kept += (4 - el) * (c.get("fp32_residual", 0) / sp + c.get("fp32_sharded", 0) / t)  # fp32 at either precision
    if m.recompute == "selective":
        kept -= (4 if not m.dropout else el) * c.get("core", 0) / t
    return kept


def pending_w_bytes(config: TrainConfig, stage: int, device_type: str = "cpu") -> int:
    """Bytes a pending ``W`` of one microbatch holds on virtual stage ``stage`` (split backward): each deferred
    projection's input and output gradient, each norm's (the family's ``w_*`` counts), the embedding's
    output gradient on the first stage, the final norm's and the output head's (its ``[s, b, V]`` gradient, in the
    chunk's dtype) on the last."""
    c, t, tokens = _counts(config), config.parallel.tensor, _tokens(config)
    el = _element_bytes(config, device_type)
    per_token = sum(el * (layer["w_replicated"] + layer["w_sharded"] / t) for layer in _block_counts(config, stage))
    if stage == 0:
        per_token += el * c["w_embedding"]
    if stage == _num_stages(config) - 1:
        per_token += el * (c["w_final_norm"] + config.model.hidden_size + config.model.vocab_size)
    return int(per_token * tokens)


def _static(config: TrainConfig, elements: int, tensors: int, experts: int = 0) -> tuple[int, int, int]:
    """``(parameters, gradients, optimizer)`` bytes of ``elements`` parameters in ``tensors`` tensors, ``experts``
    of the elements routed experts', under ``parallel.shard`` and ``model.precision`` (module docstring; the
    sharded forms keep ``1/D`` of the dense bytes and ``1/(D/E)`` of the experts', sharded over their
    expert-data-parallel ranks)."""
    p, d = config.parallel, config.data_parallel_size
    shard = p.shard if d > 1 else "none"
    moments, steps = 8 * elements, 4 * tensors
    compute = _element_bytes(config) * elements  # the parameters the chunks run: fp32, or bf16 beside fp32 masters
    dense, de = elements - experts, max(1, d // p.expert)

    def sharded(per_element: int) -> int:
        return per_element * dense // d + per_element * experts // de
    if shard == "full":
        return compute + sharded(4), 4 * elements + sharded(4), sharded(8) + steps
    masters = 4 * elements if compute != 4 * elements else 0
    if shard == "optimizer":
        return compute + masters, 4 * elements + sharded(4), sharded(8) + steps
    return compute + masters, 4 * elements, moments + steps


def layout_bytes(config: TrainConfig, device_type: str = "cpu") -> LayoutCosts:
    """The per-stage bytes of the tuner's :class:`~engine.plan.candidates.LayoutCosts` (times 0) from the model's
    shape: what :func:`engine.training.tune.measure.probe_memory` measures on a running trainer."""
    stages = range(_num_stages(config))
    static = tuple(sum(_static(config, *stage_parameters(config, s), stage_expert_parameters(config, s)))
                   for s in stages)
    zeros = tuple(0.0 for _ in stages)
    return LayoutCosts(zeros, zeros, zeros, tuple(activation_bytes(config, s, device_type) for s in stages),
                       tuple(pending_w_bytes(config, s, device_type) for s in stages), static)


def _working(config: TrainConfig, stages: list[int], device_type: str) -> int:
    m, tokens = config.model, _tokens(config)
    el, t = _element_bytes(config, device_type), config.parallel.tensor
    largest = max(3 * m.hidden_size, config.ffn_hidden_size) // t
    loss = 2 * 4 * m.vocab_size if _num_stages(config) - 1 in stages else 0
    return tokens * (2 * el * largest + loss)


def _partial_peak(config: TrainConfig, plan, rank: int, lc: LayoutCosts, device_type: str) -> int:
    """A rank's peak activation and pending-``W`` bytes under ``model.recompute_kept_microbatches: N``, walked over
    its action order as :func:`engine.plan.candidates.peak_memory_bytes` walks it: its ``i``-th forward keeps a
    whole microbatch's activations when ``i mod (warmup + 1) < N`` (Megatron's partial recomputation, as the
    executor flags each forward), a recomputed one's otherwise."""
    from ..plan.types import Op
    m = config.model
    whole = dataclasses.replace(config, model=dataclasses.replace(m, recompute="none"))
    window, kept = plan.warmup[rank] + 1, m.recompute_kept_microbatches
    held: dict = {}
    level = peak = forwards = 0
    for a in plan.actions[rank]:
        s = plan.stage(rank, a.chunk)
        pending = lc.pending_w_bytes[s] if plan.splits_backward else 0
        if a.op is Op.FORWARD:
            held[(a.chunk, a.microbatch)] = (activation_bytes(whole, s, device_type) if forwards % window < kept
                                             else lc.activation_bytes[s])
            level += held[(a.chunk, a.microbatch)]
            forwards += 1
        elif a.op is Op.BACKWARD:
            level += pending - held.pop((a.chunk, a.microbatch))
        else:
            level -= lc.pending_w_bytes[s]
        peak = max(peak, level)
    return peak


def estimate(config: TrainConfig, device_type: str = "cpu") -> Estimate:
    """The :class:`Estimate` of a validated ``config`` (``parallel.schedule`` resolved) on ``device_type``.
    Pure arithmetic over the training step's plan (:meth:`engine.plan.resolve.ResolvedSchedule.plan`)."""
    plan = config.resolve_schedule().plan(config.training.num_microbatches)
    lc = layout_bytes(config, device_type)
    activations = peak_memory_bytes(plan, dataclasses.replace(lc, static_bytes=(0,) * plan.num_stages))
    in_flight = [x for x, _ in memory_levels(plan)]
    if config.model.recompute != "none" and config.model.recompute_kept_microbatches:
        activations = [_partial_peak(config, plan, r, lc, device_type) for r in range(plan.pp_size)]
    ranks = []
    for rank in range(plan.pp_size):
        stages = list(plan.stages_of(rank))
        elements, tensors = (sum(x) for x in zip(*(stage_parameters(config, s) for s in stages)))
        if len(stages) > 1 and 0 in stages and plan.num_stages - 1 in stages and config.model.tie_embeddings:
            elements -= config.model.vocab_size * config.model.hidden_size // config.parallel.tensor
            tensors -= 1  # the V placement's two ends share the one embedding Parameter
        params, grads, optim = _static(config, elements, tensors, sum(stage_expert_parameters(config, s)
                                                                        for s in stages))
        graphs = (2 * _tokens(config) * config.model.hidden_size * _element_bytes(config, device_type) *
                  config.training.num_microbatches * len(stages)) if config.cuda_graphs.enabled else 0
        ranks.append(RankMemory(rank, params, grads, optim, activations[rank], _working(config, stages, device_type),
                                graphs, in_flight[rank], max(lc.activation_bytes[s] for s in stages)))
    return Estimate(tuple(ranks), config.data_parallel_size * config.parallel.tensor)


def host_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _device_type(config: TrainConfig) -> str:
    want = config.parallel.device
    if want != "auto":
        return want
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_budget(local_ranks: int, own_device: int | None) -> tuple[int, str]:
    """Bytes one rank may use on its GPU and where the figure comes from: with ``own_device`` (a torchrun
    process) that device's free memory (``torch.cuda.mem_get_info``: the context it creates is the one the rank
    then uses), else the smallest device's total memory shared by the local ranks placed on it (no CUDA context
    in the launcher)."""
    import torch
    if own_device is not None:
        free, _ = torch.cuda.mem_get_info(own_device)
        return free, f"free on cuda:{own_device}"
    count = torch.cuda.device_count()
    total = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
    per_device = -(-local_ranks // count)
    return total // per_device, f"the total of a {_gib(total)} GPU" + (f" shared by {per_device} ranks"
                                                                       if per_device > 1 else "")


def _fixes(config: TrainConfig, heavy: RankMemory) -> str:
    """What to change, the larger part of the heaviest rank first."""
    m, p, s = config.model, config.parallel, config.training
    static = [f"fewer layers (model.num_layers, now {m.num_layers}) or a smaller model.hidden_size (now "
              f"{m.hidden_size})", f"more pipeline stages (parallel.pipeline, now {p.pipeline})"]
    if config.data_parallel_size > 1 and p.shard != "full":
        static.append(f"parallel.shard=full (now {p.shard})")
    dynamic = [f"a smaller training.micro_batch_size (now {s.micro_batch_size})"]
    if config.cuda_graphs.enabled:
        dynamic.append("cuda_graphs.enabled=false")
    first, second = (static, dynamic) if heavy.parameters + heavy.gradients + heavy.optimizer >= \
        heavy.activations + heavy.working + heavy.graphs else (dynamic, static)
    return ", ".join(first + second)


def check_memory(config: TrainConfig, *, device_type: str | None = None, local_ranks: int | None = None,
                 own_device: int | None = None, host_bytes: int | None = None, device_bytes: int | None = None,
                 error: type[Exception] = ConfigError) -> Estimate | None:
    """Refuse a run of ``config`` (validated, schedule resolved) that cannot fit this machine, before any rank
    starts; returns the :class:`Estimate` (None when ``training.check_memory`` is off).

    ``local_ranks``: the ranks this machine runs (default: every rank, the local spawner; fewer -- a torchrun
    node -- each counted as the heaviest); ``own_device``: this process's GPU under torchrun.  On CPU the local
    ranks' tensors and :data:`RANK_OVERHEAD_BYTES` each must fit ``host_bytes`` (default
    :func:`host_available_bytes`); on CUDA the overhead must, and the heaviest rank must fit ``device_bytes``
    (default: :func:`_device_budget`).  Arithmetic only: milliseconds.

    Raises:
        error: one line naming the estimate, its parts on the heaviest rank, the memory available and what to
            change (or ``--training.check_memory=false`` to skip the check).
    """
    if not config.training.check_memory:
        return None
    device_type = device_type or _device_type(config)
    est = estimate(config, device_type)
    heavy = est.heaviest
    local = local_ranks or config.world_size
    tensors = (est.total if local >= config.world_size else local * heavy.total) if device_type == "cpu" else 0
    host = host_bytes if host_bytes is not None else host_available_bytes()
    need = tensors + local * RANK_OVERHEAD_BYTES
    where = None
    if host is not None and need > host:
        where = (need, host, f"host memory for {local} local ranks (each {_gib(RANK_OVERHEAD_BYTES)} besides its "
                             f"tensors)", "available (MemAvailable)")
    elif device_type == "cuda":
        budget, source = (device_bytes, "on the device") if device_bytes is not None else \
            _device_budget(local, own_device)
        if heavy.total > budget:
            where = (heavy.total, budget, "GPU memory per rank", source)
    if where is not None:
        need, have, what, source = where
        raise error(f"this run needs an estimated {_gib(need)} of {what} but {_gib(have)} is "
                    f"{source}: the heaviest rank (pipeline rank {heavy.pipeline_rank}) holds {heavy.parts()}; use "
                    f"{_fixes(config, heavy)}; or skip this check with --training.check_memory=false")
    return est
