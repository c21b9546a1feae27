"""Token data: the corpus, the deterministic train / validation split and the microbatches of each step.

Sources (``data.source``):

* ``stdlib`` (default, needs no download): the ``.py`` files of this Python's standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``), concatenated as bytes in a fixed order (a
  folder's files sorted by name, then its sub-folders sorted by name, depth first).
* ``text``: the files in ``data.paths`` (folders are walked the same way, keeping ``data.suffixes``), in the given
  order; bytes.
* ``bin``: pre-tokenized uint16 tokens in nanoGPT's layout -- a folder with ``train.bin`` and ``val.bin``, or one
  ``.bin`` file whose last ``val_fraction`` becomes the validation split.  Read with ``np.memmap`` (no copy).

Byte corpora are split in blocks of ``data.split_block_bytes``: every ``k``-th block (``k = round(1 /
val_fraction)``) is validation, the rest training -- same distribution, fixed for a given corpus.

Sample order: the training sequences of step ``t`` start at offsets drawn from a generator seeded by
``(seed, t)`` -- a pure function of the step, identical on every rank, no communication, exact on resume.  The
``global_batch = dp x M x b`` offsets of a step are split in data-parallel rank order, then by microbatch.
Validation uses fixed, evenly spaced windows.  Only the first stage reads tokens and only the last reads labels.
"""
from __future__ import annotations

import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from .config import ConfigError, DataConfig

__all__ = ["Corpus", "load_corpus", "stdlib_files", "Batches", "read_text_files"]

log = logging.getLogger("pipecast." + __name__.rsplit(".", 1)[-1])


@dataclass
class Corpus:
    """Token arrays (``uint8`` bytes or ``uint16`` tokens, 1-D) of the two splits."""

    train: np.ndarray
    val: np.ndarray
    description: str

    @property
    def vocab_needed(self) -> int:
        return 256 if self.train.dtype == np.uint8 else 65536


def _walk(root: Path, keep) -> Iterator[Path]:
    """Files under ``root`` in a fixed depth-first order: a folder's files (sorted), then its sub-folders (sorted)."""
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            if keep(path):
                yield path


def stdlib_files() -> Iterator[Path]:
    """The standard library's ``.py`` files (without ``site-packages`` / ``__pycache__``) in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return _walk(root, lambda f: f.suffix == ".py" and not skip & set(f.relative_to(root).parts))


def _expand(paths: list[str], suffixes: list[str]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out.extend(_walk(p, lambda f: f.suffix in suffixes))
        else:
            out.append(p)
    return out


def read_text_files(files: Iterable[Path], max_bytes: int | None = None) -> tuple[np.ndarray, int]:
    """Concatenate files as bytes (``uint8``), stopping after ``max_bytes``; returns the bytes and the file count."""
    parts, total = [], 0
    for f in files:
        data = f.read_bytes()
        parts.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(parts)
    return np.frombuffer(blob[:max_bytes] if max_bytes else blob, dtype=np.uint8), len(parts)


def _block_split(tokens: np.ndarray, val_fraction: float, block: int) -> tuple[np.ndarray, np.ndarray]:
    k = max(2, round(1 / val_fraction))
    block = max(1, min(block, len(tokens) // (4 * k)))  # small corpora: at least 4 validation blocks
    n_blocks = len(tokens) // block
    body = tokens[: n_blocks * block].reshape(n_blocks, block)
    is_val = (np.arange(n_blocks) % k) == k - 1
    train = np.concatenate([body[~is_val].reshape(-1), tokens[n_blocks * block:]])
    return train, body[is_val].reshape(-1).copy()


def load_corpus(cfg: DataConfig, seq_length: int, vocab_size: int) -> Corpus:
    """Read the configured corpus and split it.

    Raises:
        ConfigError: no files, a split shorter than one sequence, or token ids beyond ``vocab_size``.
    """
    if cfg.source == "bin":
        corpus = _load_bin(cfg)
    else:
        files = stdlib_files() if cfg.source == "stdlib" else _expand(cfg.paths, cfg.suffixes)
        tokens, count = read_text_files(files, cfg.max_bytes)
        if not count:
            where = "the standard library" if cfg.source == "stdlib" else f"data.paths={cfg.paths}"
            raise ConfigError(f"no input files found in {where} (data.suffixes={cfg.suffixes}); point data.paths at "
                              f"text files or folders")
        train, val = _block_split(tokens, cfg.val_fraction, cfg.split_block_bytes)
        corpus = Corpus(train, val, f"{count} files ({cfg.source}), {len(tokens):,} bytes")
    for name, split in (("train", corpus.train), ("val", corpus.val)):
        if len(split) < seq_length + 2:
            raise ConfigError(f"the {name} split has {len(split)} tokens, fewer than model.seq_length + 2 = "
                              f"{seq_length + 2}; use more data, a shorter model.seq_length or another "
                              f"data.val_fraction")
    if corpus.train.dtype == np.uint8 and vocab_size < 256:
        raise ConfigError(f"model.vocab_size={vocab_size} cannot hold byte tokens; use model.vocab_size >= 256")
    return corpus


def _load_bin(cfg: DataConfig) -> Corpus:
    if len(cfg.paths) != 1:
        raise ConfigError(f"data.source='bin' takes one path (a folder with train.bin / val.bin or one .bin "
                          f"file), got data.paths={cfg.paths}")
    p = Path(cfg.paths[0])
    if p.is_dir():
        files = [p / "train.bin", p / "val.bin"]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"data.paths[0]={str(p)!r} lacks {', '.join(missing)} (nanoGPT layout)")
        train, val = (np.memmap(f, dtype=np.uint16, mode="r") for f in files)
    else:
        tokens = np.memmap(p, dtype=np.uint16, mode="r")
        cut = int(len(tokens) * (1 - cfg.val_fraction))
        train, val = tokens[:cut], tokens[cut:]
    return Corpus(train, val, f"uint16 tokens from {p}: {len(train):,} train, {len(val):,} val")


class Batches:
    """The microbatches of training steps and evaluations for one data-parallel rank.

    Args:
        corpus: the token splits.
        seq_length: ``s``; each sample holds ``s`` inputs and the ``s`` next tokens as labels.
        micro_batch_size: ``b``. num_microbatches: ``M`` (per data-parallel rank, per step).
        dp_rank, dp_size: this rank's data-parallel slice of the global batch.
        seed: sample-order seed.
        vocab_size: token ids must be below it (checked per microbatch: ``ValueError``).
    """

    def __init__(self, corpus: Corpus, seq_length: int, micro_batch_size: int, num_microbatches: int,
                 dp_rank: int, dp_size: int, seed: int, vocab_size: int, device: torch.device | str = "cpu"):
        self.corpus, self.s, self.b, self.m = corpus, seq_length, micro_batch_size, num_microbatches
        self.dp_rank, self.dp_size, self.seed, self.vocab = dp_rank, dp_size, seed, vocab_size
        self.device = torch.device(device)

    def train_offsets(self, step: int) -> np.ndarray:
        """Start offsets ``[dp x M x b]`` of the global batch of training step ``step`` (0-based)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = len(self.corpus.train) - self.s - 1
        return torch.randint(0, high, (self.dp_size * self.m * self.b,), generator=g).numpy()

    def val_offsets(self, iteration: int, num_iterations: int, num_microbatches: int) -> np.ndarray:
        """Validation windows ``[dp x M x b]`` of evaluation iteration ``iteration`` of ``num_iterations``: the
        ``num_iterations x dp x M x b`` windows of an evaluation are evenly spaced over the validation split and
        the same at every evaluation."""
        per = self.dp_size * num_microbatches * self.b
        high = len(self.corpus.val) - self.s - 1
        return np.linspace(0, high, per * num_iterations, dtype=np.int64)[iteration * per:(iteration + 1) * per]

    def _microbatches(self, tokens: np.ndarray, offsets: np.ndarray, num_microbatches: int, want_tokens: bool,
                      want_labels: bool) -> Iterator[dict]:
        per_rank = num_microbatches * self.b
        mine = offsets[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank].reshape(num_microbatches, self.b)
        window = np.arange(self.s + 1)
        for row in mine:
            sample = torch.from_numpy(tokens[row[:, None] + window].astype(np.int64))  # [b, s + 1]
            if self.vocab < self.corpus.vocab_needed and int(sample.max()) >= self.vocab:
                raise ValueError(f"token id {int(sample.max())} >= model.vocab_size={self.vocab}; set "
                                 f"model.vocab_size to the tokenizer's vocabulary size")
            yield {"tokens": sample[:, :-1].to(self.device) if want_tokens else None,
                   "labels": sample[:, 1:].to(self.device) if want_labels else None}

    def train(self, step: int, want_tokens: bool, want_labels: bool) -> Iterator[dict]:
        """The ``M`` microbatches ``{"tokens": [b, s] | None, "labels": [b, s] | None}`` of training step ``step``."""
        return self._microbatches(self.corpus.train, self.train_offsets(step), self.m, want_tokens, want_labels)

    def val(self, iteration: int, num_iterations: int, num_microbatches: int, want_tokens: bool,
            want_labels: bool) -> Iterator[dict]:
        """The microbatches of evaluation iteration ``iteration`` (the same windows at every evaluation)."""
        return self._microbatches(self.corpus.val, self.val_offsets(iteration, num_iterations, num_microbatches),
                                  num_microbatches, want_tokens, want_labels)
