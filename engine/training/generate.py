"""A trained model in one process: load a checkpoint of any pipeline layout, sample text from it.

Checkpoints store parameters under layout-independent names (:func:`engine.training.models.chunk.canonical_module`), so a
checkpoint written by ``pp x vp`` ranks loads into the one model chunk of ``pp = vp = 1``.  The model settings and
the tokenizer come from the checkpoint's ``pipecast.json`` (and its ``tokenizer.json`` for BPE runs).

Generation is plain autoregressive decoding without a KV cache: every new token runs the model over the last
``model.seq_length`` tokens (cost per token = one forward of the window).  Sampling: logits / temperature, the
``top_k`` largest kept, one draw from a ``torch.Generator`` seeded with ``seed`` -- the same seed and checkpoint
give the same tokens.  ``temperature = 0`` is greedy (argmax).
"""
from __future__ import annotations

import dataclasses
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .checkpoint.dcp import (CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, read_checkpoint_meta,
                             verify_checkpoint)
from .checkpoint.integrity import MANIFEST_FILE, refusal, step_of
from .config import ConfigError, ModelConfig, MoEConfig
from .models.chunk import ModelChunk, build_model_chunks, canonical_module
from .data.tokenizer import TokenizerError, load_tokenizer

__all__ = ["LoadedModel", "resolve_checkpoint", "load_model", "sample_token", "generate", "model_state_dict",
           "encode_prompt", "decode", "TextStream"]


@dataclass
class LoadedModel:
    """One model chunk holding the whole GPT (``model``), its settings, the run's tokenizer (None for ``.bin``
    token ids) and the checkpoint it came from."""

    model: ModelChunk
    config: ModelConfig
    tokenizer: object | None
    checkpoint: Path
    step: int


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder (``step_XXXXXXXX``, or any folder with ``.metadata`` or ``manifest.json`` inside), or
    the newest checkpoint of a run folder (:func:`load_model` verifies it and refuses it when broken).

    A run folder is read where it is, never through the ``logging.run_dir`` written in its ``config.yaml`` (that
    path is relative to where ``pipecast train`` ran, so for a copied or moved folder it names another
    run): its ``checkpoints/``, else the config's ``checkpoint.dir`` taken relative to this folder when it lay
    inside the run folder, else that ``checkpoint.dir`` as written when it lay outside (the only copy of that run's
    checkpoints), else the folder itself.

    Raises:
        CheckpointError: naming the path and what it holds instead.
    """
    p = Path(path)
    if (p / ".metadata").is_file() or (p / MANIFEST_FILE).is_file() or (re.fullmatch(r"step_\d{8}", p.name)
                                                                       and p.is_dir()):
        return p
    if not p.exists():
        raise CheckpointError(f"{str(p)!r} does not exist; pass a run folder (logging.run_dir) or a checkpoint "
                              f"folder such as RUN_DIR/checkpoints/step_00000200")
    candidates = [p / "checkpoints", *_configured_checkpoint_dirs(p), p]
    for folder in candidates:
        found = latest_checkpoint(folder) if folder.is_dir() else None
        if found is not None:
            return found
    raise CheckpointError(f"{str(p)!r} is neither a checkpoint (a folder with .metadata) nor a run folder with a "
                          f"complete checkpoint (in {str(p / 'checkpoints')!r} or its config.yaml's checkpoint.dir);"
                          f" train first, or pass the checkpoint folder itself")


def _configured_checkpoint_dirs(run: Path) -> list[Path]:
    """The ``checkpoint.dir`` of ``run/config.yaml`` (if it sets one), rebased onto ``run`` when it lay inside the
    run folder the config names; ``[]`` without a readable config or an explicit ``checkpoint.dir``."""
    if not (run / "config.yaml").is_file():
        return []
    from .config import load_config
    try:
        cfg = load_config(run / "config.yaml", check=False)
    except (ConfigError, TypeError, ValueError):
        return []
    if not cfg.checkpoint.dir:
        return []
    configured, run_dir = Path(cfg.checkpoint.dir), Path(cfg.logging.run_dir)
    try:
        return [run / configured.relative_to(run_dir)]
    except ValueError:  # outside the run folder: that is where the checkpoints are
        return [configured]


def _model_config(meta: dict, path: Path) -> ModelConfig:
    saved = meta.get("model_config") or meta.get("model")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {str(path)!r} has no model settings in its pipecast.json; it was not "
                              f"written by pipecast train (or by an older version): sample or export needs them")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in saved.items() if k in fields})
    if isinstance(cfg.moe, dict):  # JSON: the model.moe section as a mapping
        cfg = dataclasses.replace(cfg, moe=MoEConfig(**cfg.moe))
    return dataclasses.replace(cfg, ffn_hidden_size=saved.get("ffn_hidden_size") or cfg.ffn_hidden_size,
                               dropout=0.0, transformer_engine=False)


def _tokenizer(meta: dict, path: Path, cfg: ModelConfig):
    info = meta.get("tokenizer") or {"kind": "bytes" if cfg.vocab_size >= 256 else "none"}
    if info.get("kind") == "none":
        return None
    try:
        return load_tokenizer(info["kind"], path / info["file"] if "file" in info else None)
    except TokenizerError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: {exc}") from None


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """Load the model of checkpoint (or run folder) ``path`` into one process (no process group needed).

    Raises:
        CheckpointError: no checkpoint there, a broken one (a file missing, truncated or failing its checksum:
            :func:`engine.training.checkpoint.dcp.verify_checkpoint`), unreadable metadata / tensors, or a missing
            tokenizer file; the message names the path and the fix.
    """
    ckpt = resolve_checkpoint(path)
    problem = verify_checkpoint(ckpt)
    if problem is not None:
        older = [p for p in list_checkpoints(ckpt.parent) if step_of(p) < step_of(ckpt)] \
            if re.fullmatch(r"step_\d{8}", ckpt.name) else []
        hint = f" such as {str(older[-1])!r}" if older else ""
        raise CheckpointError(refusal(ckpt, problem, f"pass an older checkpoint folder{hint}, or delete this one"))
    meta = read_checkpoint_meta(ckpt) or {}
    cfg = _model_config(meta, ckpt)
    ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
    (chunk,) = build_model_chunks(cfg, ffn, 1, 0, 1, int(meta.get("seed", 0)), None, "cpu")
    state = {"model": canonical_module([chunk]).state_dict()}
    with warnings.catch_warnings():  # DCP warns that it loads without a process group: that is the intent here
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        load_checkpoint(state, ckpt, verify=False)  # in place, into the chunk's parameters
    chunk.eval()
    return LoadedModel(chunk.to(device), cfg, _tokenizer(meta, ckpt, cfg), ckpt, int(meta.get("step", 0)))


def model_state_dict(model: ModelChunk) -> dict[str, torch.Tensor]:
    """Layout-independent parameter names -> tensors of a one-chunk model (the tied embedding once)."""
    return dict(canonical_module([model]).state_dict())


def sample_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """One token id from ``logits`` ``[V]`` (fp32, CPU): greedy when ``temperature == 0``, else a draw from
    softmax(logits / temperature) restricted to the ``top_k`` largest logits (all when None)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.double()
    logits = (logits - logits.max()) / temperature  # shifted first: a tiny temperature gives -inf, never inf - inf
    if top_k is not None and top_k < logits.numel():
        cutoff = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


@torch.no_grad()
def generate(model: ModelChunk, prompt: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, seed: int = 1234, on_token: Callable[[int], None] | None = None) -> list[int]:
    """``max_new_tokens`` token ids following ``prompt`` (not included), from a one-chunk model; the context is
    the last ``seq_length`` tokens.  ``on_token(id)`` is called with each new token as it is sampled (to stream
    it, :class:`TextStream`).

    Raises:
        ValueError: an empty prompt."""
    if not prompt:
        raise ValueError("generate needs a prompt of at least one token")
    seq_length = model.seq_length
    device = model.output_weight().device
    generator = torch.Generator().manual_seed(seed)
    ids, new = list(prompt), []
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-seq_length:]], dtype=torch.int64, device=device)  # [1, s]
        logits = model(window)[-1, 0].float().cpu()  # [s, 1, V] -> [V] at the last position
        token = sample_token(logits, temperature, top_k, generator)
        ids.append(token)
        new.append(token)
        if on_token is not None:
            on_token(token)
    return new


class TextStream:
    """Write generated tokens to ``out`` as they come, as text: :func:`decode` of the tokens not yet written,
    held back while it ends in an unfinished character (U+FFFD: a multi-byte UTF-8 character split over tokens;
    at most :attr:`HOLD` tokens); :meth:`close` writes what is left.  The text written is :func:`decode` of all the
    tokens; ids of a run without a tokenizer are written space-separated."""

    HOLD = 8

    def __init__(self, tokenizer, out) -> None:
        self.tokenizer, self.out, self.pending = tokenizer, out, []

    def __call__(self, token: int) -> None:
        self.pending.append(token)
        text = self._text()
        if not text.endswith("\ufffd") or len(self.pending) >= self.HOLD:
            self._write(text)

    def close(self) -> None:
        if self.pending:
            self._write(self._text())

    def _text(self) -> str:
        return " " + decode(None, self.pending) if self.tokenizer is None else decode(self.tokenizer, self.pending)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        self.pending = []


def encode_prompt(tokenizer, text: str, vocab_size: int) -> list[int]:
    """The prompt's token ids (a newline when ``text`` is empty).

    Raises:
        TokenizerError: text that is not valid Unicode, or a run without a tokenizer (``.bin`` token files) and a
            prompt that is not a list of token ids such as ``"17 42 5"``.
    """
    if tokenizer is None:
        try:
            ids = [int(t) for t in text.split()] or [0]
        except ValueError:
            raise TokenizerError(f"--prompt {text!r}: this model was trained on .bin token ids and has no "
                                 f"tokenizer; pass token ids separated by spaces, e.g. --prompt '17 42 5'") from None
    else:
        ids = tokenizer.encode(text or "\n", what="--prompt")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise TokenizerError(f"--prompt {text!r} has token id {bad[0]}, outside the model's vocabulary "
                             f"[0, {vocab_size}); use ids below {vocab_size}")
    return ids


def decode(tokenizer, ids: list[int]) -> str:
    """Text of ``ids`` (space-separated ids for a run without a tokenizer)."""
    return " ".join(map(str, ids)) if tokenizer is None else tokenizer.decode(ids)

