"""What a run writes for people to read: ``metrics.jsonl``, ``loss.png``, optional TensorBoard, and the model FLOPs
estimate behind the TFLOP/s and MFU numbers.

``RUN_DIR/metrics.jsonl`` holds one JSON object per line, flushed as it is written:

* a training step: ``step``, ``loss`` (nats per token), ``lr``, ``grad_norm``, ``tokens_per_s``, ``tokens_seen``,
  ``step_time_s``, ``tflops`` (achieved model TFLOP/s of the whole job) and, on CUDA, ``max_memory_gib``,
  ``reserved_memory_gib`` and ``mfu`` (fraction of ``logging.peak_tflops`` x number of GPUs);
* an evaluation: ``step``, ``val_loss``.

With ``model.moe`` a logged training step also has the routers' statistics of that step (:class:`RouterMetrics`):
``moe_aux_loss`` (the load-balancing loss per MoE layer and forward, unscaled, averaged), ``moe_load_imbalance``
(over the MoE layers the largest ``max / mean`` of the token slots per expert: 1 is perfect balance) and
``moe_tokens_per_expert`` (``{layer: [token slots of each expert]}``, summed over the data-parallel ranks).

``RUN_DIR/loss.png`` (train and validation loss against step) is redrawn at each evaluation and at the end; it is
written to a temporary file and renamed, so a reader never sees half a PNG.

A file the operating system refuses to write (a full disk) stops the run with one
:class:`~engine.training.files.WriteError` naming it; a drawing that fails for another reason is logged once.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from .config import ModelConfig
from .files import WriteError, write_atomically, writing

__all__ = ["MetricsLog", "RouterMetrics", "model_flops_per_token", "flops_parameter_count", "known_peak_tflops",
           "plot_losses", "read_metrics", "TRAIN_COLOR", "VAL_COLOR"]

log = logging.getLogger("pipecast." + __name__.rsplit(".", 1)[-1])

TRAIN_COLOR = "#1f77b4"  # the loss curve in loss.png
VAL_COLOR = "#d62728"  # the validation points in loss.png

# dense bf16 peak TFLOP/s (no sparsity) of GPUs by a substring of torch.cuda.get_device_name(); vendor data sheets
_BF16_PEAK_TFLOPS = (("H200", 989.0), ("H100 SXM", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0),
                     ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0), ("L4", 121.0), ("V100", 125.0))


def flops_parameter_count(cfg: ModelConfig, ffn_hidden_size: int) -> int:
    """``N`` of the FLOPs estimate: the parameters that take part in a matrix multiply per token -- every
    transformer block (counted on the modules ``cfg``'s family builds: projections, norms, biases), the final norm
    and the output head ``[V, h]`` (the tied word embedding counts once, as the head); of a MoE layer's routed
    experts the ``top_k`` a token goes through.  Not counted: the input
    embedding (a lookup, no multiply; also a learned position table).  nanoGPT's
    ``get_num_params(non_embedding=True)`` counts the same.
    """
    from ..moe import is_expert_parameter
    from .models.chunk import block_part, family_parts  # torch: built on the meta device
    parts = family_parts(cfg, ffn_hidden_size)
    count = {name: sum(p.numel() for p in module.parameters()) for name, module in parts.items()}
    if "moe_block" in parts:  # a token goes through top_k of the routed experts
        routed = sum(p.numel() for p in parts["moe_block"].parameters() if is_expert_parameter(p))
        count["moe_block"] -= routed - routed * cfg.moe.top_k // cfg.moe.num_experts
    blocks = sum(count[block_part(cfg, i)] for i in range(cfg.num_layers))
    return blocks + count["final_norm"] + cfg.vocab_size * cfg.hidden_size


def model_flops_per_token(cfg: ModelConfig, ffn_hidden_size: int) -> float:
    """Training FLOPs per token, forward + backward: ``6 N + 12 L H Q T`` (PaLM, appendix B; nanoGPT's
    ``estimate_mfu``) with ``N`` from :func:`flops_parameter_count`, ``L`` layers, ``H`` heads, ``Q`` the head size
    and ``T`` the sequence length (the attention score and value products, causal mask not discounted)."""
    n = flops_parameter_count(cfg, ffn_hidden_size)
    q = cfg.hidden_size // cfg.num_attention_heads
    return 6.0 * n + 12.0 * cfg.num_layers * cfg.num_attention_heads * q * cfg.seq_length


def known_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak TFLOP/s of a GPU named ``device_name`` (``torch.cuda.get_device_name()``), or None."""
    for key, peak in _BF16_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The JSON objects of a ``metrics.jsonl`` file (a last line cut off by a crash is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def plot_losses(records: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """Draw train loss (line) and validation loss (points + line) against step into the PNG ``path`` (written to
    a hidden temporary and renamed, :func:`~engine.training.files.write_atomically`).  ``records``: metrics lines
    as in ``metrics.jsonl``.  Raises :class:`~engine.training.files.WriteError` when the file cannot be written."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), color=TRAIN_COLOR, linewidth=1.2, label="train loss")
    if val:
        ax.plot(*zip(*val), color=VAL_COLOR, marker="o", linewidth=1.5, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    write_atomically([(Path(path), lambda p: fig.savefig(p, format="png"))], "logging.run_dir")


class MetricsLog:
    """``metrics.jsonl``, ``loss.png`` and (``tensorboard=True``) TensorBoard event files of one run, written by the
    rank that owns the loss.

    Args:
        run_dir: the run folder. resume_step: None for a fresh run (the files start empty); else the step a
            resumed run continues from: lines of later steps (written after that checkpoint by a run that then
            stopped) are dropped, so the file and the plot cover each step once.
        tensorboard: also write ``RUN_DIR/tensorboard`` events (needs the ``tensorboard`` package).
    """

    def __init__(self, run_dir: str | os.PathLike, resume_step: int | None = None, tensorboard: bool = False,
                 title: str = ""):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path, self.png, self.title = self.run_dir / "metrics.jsonl", self.run_dir / "loss.png", title
        self.records: list[dict] = []
        self._plot_failed = False
        if resume_step is not None and self.path.is_file():
            self.records = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with writing(self.path):
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            os.replace(tmp, self.path)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        """Append one metrics line (non-finite floats are written as null) and flush it."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.records.append(clean)
        with writing(self.path):
            self._file.write(json.dumps(clean) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, clean["step"])
            self._tb.flush()

    def plot(self) -> None:
        """Redraw ``loss.png`` from every line so far.  A write the operating system refuses raises
        :class:`~engine.training.files.WriteError`; any other drawing failure is logged once, never fatal."""
        if self._plot_failed:
            return
        try:
            plot_losses(self.records, self.png, self.title)
        except WriteError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plot must never end a training run
            self._plot_failed = True
            log.warning("could not draw %s: %s: %s (no further attempts in this run)", self.png,
                        type(exc).__name__, exc)

    def close(self) -> None:
        with writing(self.path):
            self._file.close()
        if self._tb is not None:
            self._tb.close()


class RouterMetrics:
    """The mixture-of-experts routers' statistics of one training step, for the log (module doc).

    ``canonical``: this rank's layout-independent view of its model chunks
    (:func:`engine.training.models.chunk.canonical_module`; its routers are ``layers.<i>.*.router``);
    ``num_layers`` / ``num_experts`` / ``device``: the model's.  :meth:`reset` before each step's schedule (no
    host read); :meth:`collect` at a logged step only: one all-reduce of a ``[L, E + 2]`` table over every rank,
    then one host read.
    """

    def __init__(self, canonical, num_layers: int, num_experts: int, device):
        from ..moe import routers
        self.routers = [(int(name.split(".")[1]), r) for name, r in routers(canonical)]
        self.shape, self.device = (num_layers, num_experts + 2), device

    def reset(self) -> None:
        """Clear every router's counters (local)."""
        for _, router in self.routers:
            router.reset_stats()

    def collect(self) -> dict:
        """Collective over the default group: ``{"moe_aux_loss", "moe_load_imbalance", "moe_tokens_per_expert"}``
        of the forwards since :meth:`reset`, the same on every rank."""
        import torch
        import torch.distributed as dist
        table = torch.zeros(self.shape, dtype=torch.float64, device=self.device)  # [L, tokens per expert, aux, n]
        for layer, router in self.routers:
            stats = router.stats()
            table[layer, :-2] = stats.tokens_per_expert.to(table)
            table[layer, -2] = stats.aux_loss.to(table)
            table[layer, -1] = stats.forwards
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table)
        rows = {i: row for i, row in enumerate(table.cpu().tolist()) if row[-1] > 0}  # the host read
        tokens = {str(i): [int(x) for x in row[:-2]] for i, row in rows.items()}
        imbalance = max((max(t) / (sum(t) / len(t)) for t in tokens.values() if sum(t)), default=1.0)
        aux = sum(row[-2] / row[-1] for row in rows.values()) / max(1, len(rows))
        return {"moe_aux_loss": aux, "moe_load_imbalance": imbalance, "moe_tokens_per_expert": tokens}
