"""Token data: the corpus, the deterministic train / validation split and the microbatches of each step.

Sources (``data.source``):

* ``stdlib`` (default, needs no download): the ``.py`` files of this Python's standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``), concatenated as bytes in a fixed order (a
  folder's files sorted by name, then its sub-folders sorted by name, depth first).
* ``text``: the files in ``data.paths`` (folders are walked the same way, keeping ``data.suffixes``), in the given
  order; bytes.
* ``bin``: pre-tokenized tokens -- a folder with ``train.bin`` and ``val.bin``, or one ``.bin`` file whose last
  ``val_fraction`` becomes the validation split.  Two layouts, told apart by the first 4 bytes: llm.c's (a header
  of 256 int32: magic 20240520, version 1 = uint16 tokens or 2 = uint32 tokens, token count; then the tokens) and
  nanoGPT's (raw uint16 tokens, no header).  A header with another llm.c-style magic or an unknown version is
  refused (:func:`read_bin`).  Read with ``np.memmap`` (no copy).

Tokenizers (``data.tokenizer``, text sources): ``bytes`` (the byte arrays above) or ``bpe``: a byte-level BPE
trained on the training split (:mod:`engine.training.data.tokenizer`), saved with both tokenized splits (llm.c files)
in a cache folder keyed by the data and settings (:func:`bpe_cache`) and reused by later runs.

Byte corpora are split in blocks of ``data.split_block_bytes``: every ``k``-th block (``k = round(1 /
val_fraction)``) is validation, the rest training -- same distribution, fixed for a given corpus.

Sample order: the training sequences of step ``t`` start at offsets drawn from a generator seeded by
``(seed, t)`` -- a pure function of the step, identical on every rank, no communication, exact on resume.  The
``global_batch = dp x M x b`` offsets of a step are split in data-parallel rank order, then by microbatch.
Validation uses fixed, evenly spaced windows.  Only the first stage reads tokens and only the last reads labels.

Checks (:func:`check_data`, run by ``pipecast train`` before any rank starts, and again by :func:`load_corpus` in
every rank that reads data): the files exist and are not empty, each split holds at least ``model.seq_length + 2``
tokens, a ``.bin`` file is a whole number of tokens after its header, and every token id is below
``model.vocab_size``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from ..config import ConfigError, DataConfig

if TYPE_CHECKING:  # torch is imported where tensors are made, so that check_data stays cheap for the launcher
    import torch

__all__ = ["Corpus", "load_corpus", "check_data", "stdlib_files", "Batches", "read_text_files", "max_token_id",
           "read_bin", "write_llmc_bin", "bpe_cache", "default_cache_dir", "LLMC_MAGIC"]

log = logging.getLogger("pipecast." + __name__.rsplit(".", 1)[-1])

BIN_DTYPE = np.uint16  # nanoGPT's token files: little-endian uint16, 2 bytes per token
LLMC_MAGIC = 20240520  # llm.c token files: int32[256] header [magic, version, token count, 0...]
LLMC_HEADER_BYTES = 256 * 4
LLMC_DTYPES = {1: np.uint16, 2: np.uint32}  # header version -> token dtype
_BPE_CACHE_FORMAT = 1  # bump when the cache layout or the tokenizer settings change
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_MAX_CHUNK = 1 << 24  # tokens per np.max call when scanning a .bin file for its largest token id (32 MiB)


@dataclass
class Corpus:
    """Token arrays (``uint8`` bytes or ``uint16`` tokens, 1-D) of the two splits.  ``max_token``: the largest
    token id of both splits once computed (:meth:`largest_token`)."""

    train: np.ndarray
    val: np.ndarray
    description: str
    max_token: int | None = None
    tokenizer: object | None = None  # ByteTokenizer / BPETokenizer; None for .bin token files

    @property
    def vocab_needed(self) -> int:
        """Ids the token dtype can hold: 256 for bytes, 2**16 for uint16, 2**32 for uint32."""
        return 1 << (8 * self.train.dtype.itemsize)

    def largest_token(self) -> int:
        """The largest token id of both splits (one chunked pass over the arrays, cached)."""
        if self.max_token is None:
            self.max_token = max(max_token_id(self.train), max_token_id(self.val))
        return self.max_token


def max_token_id(tokens: np.ndarray, chunk: int = _MAX_CHUNK) -> int:
    """Largest value of a 1-D token array (``-1`` if empty), read in chunks of ``chunk`` tokens so that a memmap is
    streamed through once without a full-size temporary.  Cost: one read of the file and a vectorised max."""
    best = -1
    for start in range(0, len(tokens), chunk):
        best = max(best, int(tokens[start:start + chunk].max()))
    return best


# ---- files ----------------------------------------------------------------------------------------------------
def _walk(root: Path, keep) -> Iterator[Path]:
    """Files under ``root`` in a fixed depth-first order: a folder's files (sorted), then its sub-folders (sorted).
    ``site-packages``, ``dist-packages`` and ``__pycache__`` folders are not entered."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            path = Path(folder) / name
            if keep(path):
                yield path


def stdlib_files() -> Iterator[Path]:
    """The standard library's ``.py`` files (without ``site-packages`` / ``__pycache__``) in a fixed order."""
    return _walk(Path(sysconfig.get_paths()["stdlib"]), lambda f: f.suffix == ".py")


def _expand(paths: list[str], suffixes: list[str]) -> list[Path]:
    """The files of ``data.paths`` (folders walked, keeping ``suffixes``).

    Raises:
        ConfigError: a path that does not exist."""
    out: list[Path] = []
    for i, raw in enumerate(paths):
        p = Path(raw)
        if p.is_dir():
            out.extend(_walk(p, lambda f: f.suffix in suffixes))
        elif p.exists():
            out.append(p)
        else:
            raise ConfigError(f"data.paths[{i}]={raw!r} does not exist; point data.paths at text files or folders "
                              f"(relative paths start from {os.getcwd()})")
    return out


def _text_files(cfg: DataConfig) -> list[Path]:
    files = list(stdlib_files()) if cfg.source == "stdlib" else _expand(cfg.paths, cfg.suffixes)
    if not files:
        where = "the standard library" if cfg.source == "stdlib" else f"data.paths={cfg.paths}"
        raise ConfigError(f"no input files found in {where} (data.suffixes={cfg.suffixes}); point data.paths at "
                          f"text files or folders, or add their suffix to data.suffixes")
    return files


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


def _text_size(files: list[Path], max_bytes: int | None) -> int:
    """The length :func:`read_text_files` will return, from the file sizes (no read)."""
    total = 0
    for f in files:
        total += f.stat().st_size
        if max_bytes is not None and total >= max_bytes:
            return max_bytes
    return total


# ---- splits ---------------------------------------------------------------------------------------------------
def _split_layout(n: int, val_fraction: float, block: int) -> tuple[int, int, int]:
    """``(k, block, n_blocks)`` of the block split of ``n`` bytes: every ``k``-th of ``n_blocks`` blocks is
    validation."""
    k = max(2, round(1 / val_fraction))
    block = max(1, min(block, n // (4 * k)))  # small corpora: at least 4 validation blocks
    return k, block, n // block


def _split_sizes(n: int, val_fraction: float, block: int) -> tuple[int, int]:
    """Train and validation lengths of :func:`_block_split` of ``n`` bytes."""
    k, block, n_blocks = _split_layout(n, val_fraction, block)
    n_val = n_blocks // k
    return n - n_val * block, n_val * block


def _block_split(tokens: np.ndarray, val_fraction: float, block: int) -> tuple[np.ndarray, np.ndarray]:
    k, block, n_blocks = _split_layout(len(tokens), val_fraction, block)
    body = tokens[: n_blocks * block].reshape(n_blocks, block)
    is_val = (np.arange(n_blocks) % k) == k - 1
    train = np.concatenate([body[~is_val].reshape(-1), tokens[n_blocks * block:]])
    return train, body[is_val].reshape(-1).copy()


def _check_split_lengths(n_train: int, n_val: int, seq_length: int, cfg: DataConfig) -> None:
    """Each split must hold one sample (``seq_length`` inputs + the next token) plus one start offset."""
    where = "the standard library" if cfg.source == "stdlib" else f"data.paths={cfg.paths}"
    for name, n in (("train", n_train), ("validation", n_val)):
        if n < seq_length + 2:
            raise ConfigError(
                f"model.seq_length={seq_length}: the {name} split of {where} has {n} tokens, fewer than "
                f"model.seq_length + 2 = {seq_length + 2} (one sample); use more data"
                f"{'' if cfg.max_bytes is None else f' (data.max_bytes={cfg.max_bytes} caps it)'}, a shorter "
                f"model.seq_length{' or a larger data.val_fraction' if name == 'validation' else ''}")


# ---- .bin token files (nanoGPT raw uint16, llm.c headered) ---------------------------------------------------
def _looks_like_header(first: np.ndarray) -> bool:
    """An int32 header of an llm.c-style file: a date-like magic (2020..2030) and a small version number."""
    return 20200101 <= int(first[0]) <= 20301231 and 0 <= int(first[1]) < 64


def read_bin(path: Path, where: str = "data.paths[0]") -> np.ndarray:
    """The tokens of one ``.bin`` file as a read-only memmap: llm.c's layout (``int32[256]`` header, magic
    20240520, version 1 -> uint16 / 2 -> uint32, then the token count of tokens) or nanoGPT's raw uint16.

    Raises:
        ConfigError: naming the file and what it found: an empty file, a header of another kind (other magic or
            version), a token count that does not match the file size, a raw file of an odd number of bytes, or
            a text file (its first 64 KiB UTF-8 text) given as token ids (naming ``data.source=text``).
    """
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"{where}: {path} is empty; write the tokens there (llm.c or nanoGPT layout) or point "
                          f"data.paths at another corpus")
    first = np.fromfile(path, dtype="<i4", count=3) if size >= 12 else np.zeros(3, "<i4")
    if int(first[0]) == LLMC_MAGIC:
        version, count = int(first[1]), int(first[2])
        if version not in LLMC_DTYPES:
            raise ConfigError(f"{where}: {path} has an llm.c header (magic {LLMC_MAGIC}) of version {version}; "
                              f"pipecast reads version 1 (uint16 tokens) and 2 (uint32 tokens): re-export the file "
                              f"in one of those")
        dtype = np.dtype(LLMC_DTYPES[version])
        expected = LLMC_HEADER_BYTES + count * dtype.itemsize
        if size != expected:
            raise ConfigError(f"{where}: {path} has an llm.c header (version {version}) announcing {count:,} "
                              f"{dtype.name} tokens = {expected:,} bytes, but the file has {size:,} bytes; it is "
                              f"truncated or was written wrongly -- re-export it")
        return np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))
    if size >= 12 and _looks_like_header(first):
        raise ConfigError(f"{where}: {path} starts with a header of magic {int(first[0])} version {int(first[1])}, "
                          f"not an llm.c token file (magic {LLMC_MAGIC}, version 1 or 2) nor raw uint16 tokens; "
                          f"point data.paths at token files (e.g. llm.c's *_train.bin / *_val.bin)")
    text = _text_sample(path)
    if text is not None:
        raise ConfigError(f"{where}: {path} is a text file (its first bytes read {text!r}), not token ids: "
                          f"data.source='bin' reads token files (llm.c's headered or nanoGPT's raw uint16), and read "
                          f"as uint16 this text gives ids up to {_text_token_max(path):,}; for a text corpus set "
                          f"data.source=text (bytes, or data.tokenizer=bpe), or point data.paths at the .bin token "
                          f"files")
    if size % np.dtype(BIN_DTYPE).itemsize:
        raise ConfigError(f"{where}: {path} has {size} bytes, not a whole number of tokens: without an llm.c "
                          f"header data.source='bin' reads raw uint16 token ids (2 bytes each, little-endian, "
                          f"nanoGPT's np.array(ids, dtype=np.uint16).tofile(path)); the file is truncated or not "
                          f"in that layout -- re-export it, or use data.source='text' for raw bytes")
    return np.memmap(path, dtype=BIN_DTYPE, mode="r")


_TEXT_SAMPLE = 1 << 16  # bytes looked at to tell a text file from raw uint16 token ids


def _text_sample(path: Path) -> str | None:
    """The first characters of ``path`` when its first 64 KiB are UTF-8 text (at most 0.1% control bytes other than
    tab / newline / carriage return / form feed), else None.  Raw uint16 token ids are not: every id below 8192
    (GPT-2's most common tokens) has a high byte below 0x20."""
    with open(path, "rb") as fh:
        head = fh.read(_TEXT_SAMPLE)
    try:
        decoded = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not only a character cut at the sample's end
            return None
        decoded = head[:exc.start].decode("utf-8")
    control = sum(1 for c in decoded if ord(c) < 32 and c not in "\t\n\r\f")
    if not decoded or control > len(decoded) // 1000:
        return None
    return " ".join(decoded[:40].split())


def _text_token_max(path: Path) -> int:
    """The largest uint16 id of the (even part of the) sample, read as nanoGPT's raw token file would be."""
    with open(path, "rb") as fh:
        head = fh.read(_TEXT_SAMPLE)
    return int(np.frombuffer(head[:len(head) // 2 * 2], dtype=BIN_DTYPE).max(initial=0))


def write_llmc_bin(path: Path, tokens: np.ndarray) -> None:
    """Write ``tokens`` as an llm.c token file (version 1 = uint16 when every id fits, else 2 = uint32)."""
    version = 1 if (len(tokens) == 0 or int(tokens.max()) < 1 << 16) else 2
    header = np.zeros(256, dtype="<i4")
    header[:3] = (LLMC_MAGIC, version, len(tokens))
    with open(path, "wb") as fh:
        fh.write(header.tobytes())
        fh.write(np.ascontiguousarray(tokens, dtype=LLMC_DTYPES[version]).tobytes())


def _bin_files(cfg: DataConfig) -> tuple[Path, list[Path]]:
    """``(path, files)``: the one ``data.paths`` entry and its token files (``train.bin``, ``val.bin`` of a folder,
    or the file itself)."""
    if len(cfg.paths) != 1:
        raise ConfigError(f"data.paths={cfg.paths}: data.source='bin' takes exactly one path (a folder with "
                          f"train.bin and val.bin, or one .bin file); set data.paths=[FOLDER] or [FILE.bin]")
    p = Path(cfg.paths[0])
    if p.is_dir():
        files = [p / "train.bin", p / "val.bin"]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"data.paths[0]={str(p)!r} has no {' and no '.join(missing)}; data.source='bin' "
                              f"reads a folder with train.bin and val.bin (nanoGPT layout) or one .bin file")
    elif p.is_file():
        files = [p]
    else:
        raise ConfigError(f"data.paths[0]={str(p)!r} does not exist; point it at a folder with train.bin and "
                          f"val.bin or at one .bin file (relative paths start from {os.getcwd()})")
    return p, files


def _bin_arrays(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray, Path]:
    p, files = _bin_files(cfg)
    arrays = [read_bin(f) for f in files]
    if len(arrays) == 2:
        train, val = arrays
        if train.dtype != val.dtype:
            raise ConfigError(f"data.paths[0]={str(p)!r}: train.bin holds {train.dtype.name} tokens but val.bin "
                              f"{val.dtype.name}; write both splits with the same token width")
    else:
        cut = int(len(arrays[0]) * (1 - cfg.val_fraction))
        train, val = arrays[0][:cut], arrays[0][cut:]
    return train, val, p


def _bin_description(train: np.ndarray, val: np.ndarray, p: Path) -> str:
    return f"{train.dtype.name} tokens from {p}: {len(train):,} train, {len(val):,} val"


def _check_vocab(corpus: Corpus, vocab_size: int, where: str) -> None:
    """Every token id must be an embedding row: ``max token < model.vocab_size`` (one pass over uint16 data)."""
    if corpus.train.dtype == np.uint8:
        if vocab_size < 256:
            raise ConfigError(f"model.vocab_size={vocab_size} cannot hold byte tokens (0..255) of data.source="
                              f"'{where}'; use model.vocab_size >= 256")
        return
    if vocab_size >= corpus.vocab_needed:
        return
    top = corpus.largest_token()
    if top >= vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is too small for {where}: it holds token id {top}; set "
                          f"model.vocab_size to the tokenizer's vocabulary size (at least {top + 1})")


# ---- byte-level BPE cache ------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pipecast`` (``~/.cache/pipecast`` when unset)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipecast"


def _bpe_key(cfg: DataConfig, files: list[Path], vocab_size: int) -> str:
    """A digest of everything the tokenizer and the tokenized splits depend on: the files (path, size,
    modification time), the byte cap, the split settings and the vocabulary size."""
    import tokenizers
    stamp = [(str(f.resolve()), st.st_size, st.st_mtime_ns) for f in files for st in (f.stat(),)]
    blob = json.dumps({"format": _BPE_CACHE_FORMAT, "tokenizers": tokenizers.__version__, "files": stamp,
                       "max_bytes": cfg.max_bytes, "val_fraction": cfg.val_fraction,
                       "split_block_bytes": cfg.split_block_bytes, "vocab_size": vocab_size})
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _text_pieces(data: np.ndarray, size: int = 1 << 16) -> list[str]:
    """A byte split as UTF-8 text in pieces of about ``size`` bytes (bytes that are not UTF-8, e.g. characters cut
    by the block split, become U+FFFD)."""
    text = data.tobytes().decode("utf-8", errors="replace")
    return [text[i:i + size] for i in range(0, len(text), size)]


def bpe_cache(cfg: DataConfig, vocab_size: int) -> Path:
    """The cache folder of the byte-level BPE of this data with ``vocab_size`` tokens: ``tokenizer.json``,
    ``train.bin`` / ``val.bin`` (llm.c token files) and ``info.json``; built on first use (tokenizer trained on the
    training split only) into a temporary folder renamed when complete, so concurrent builders and crashes
    never leave a half-written cache.  Folder: ``data.cache_dir`` (or :func:`default_cache_dir`)
    ``/bpe-<vocab>-<key>``."""
    from .tokenizer import train_bpe
    files = _text_files(cfg)
    root = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    final = root / f"bpe-{vocab_size}-{_bpe_key(cfg, files, vocab_size)}"
    if (final / "info.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tokens, count = read_text_files(files, cfg.max_bytes)
    train, val = _block_split(tokens, cfg.val_fraction, cfg.split_block_bytes)
    log.info("training a byte-level BPE of %d tokens on %s bytes of training text (cached in %s)", vocab_size,
             f"{len(train):,}", final)
    train_text, val_text = _text_pieces(train), _text_pieces(val)
    tok = train_bpe(train_text, vocab_size)
    tmp = Path(tempfile.mkdtemp(prefix=".bpe-", dir=root))
    try:
        for name, pieces in (("train", train_text), ("val", val_text)):
            ids = np.fromiter((i for row in tok.encode_batch(pieces) for i in row), dtype=np.uint32)
            write_llmc_bin(tmp / f"{name}.bin", ids)
        tok.save(tmp / "tokenizer.json")
        (tmp / "info.json").write_text(json.dumps({"vocab_size": tok.vocab_size, "files": count,
                                                   "bytes": len(tokens)}))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same cache first
            if not (final / "info.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _bpe_corpus(cfg: DataConfig, vocab_size: int) -> Corpus:
    """The cached BPE splits and tokenizer (built by :func:`bpe_cache` on first use).

    Raises:
        ConfigError: the tokenizer has more tokens than ``model.vocab_size``."""
    from .tokenizer import BPETokenizer
    folder = bpe_cache(cfg, vocab_size)
    tok = BPETokenizer.from_file(folder / "tokenizer.json")
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the vocabulary of the BPE tokenizer "
                          f"{folder / 'tokenizer.json'} ({tok.vocab_size} tokens); set model.vocab_size >= "
                          f"{tok.vocab_size} or delete that cache folder")
    info = json.loads((folder / "info.json").read_text())
    train, val = (read_bin(folder / f"{n}.bin", "data.cache_dir") for n in ("train", "val"))
    return Corpus(train, val, f"{info['files']} files ({cfg.source}), {info['bytes']:,} bytes -> {len(train):,} "
                              f"train + {len(val):,} val BPE tokens (vocabulary {tok.vocab_size}, {folder})",
                  tokenizer=tok)


def check_data(config) -> str:
    """Cheap checks of ``config.data`` against ``config.model`` before any rank starts (``pipecast train`` runs it
    in the launcher, and in every process under torchrun); returns a one-line description of the corpus.

    Checked: the files exist and are not empty; the train and validation splits each hold ``model.seq_length + 2``
    tokens (from the file sizes, nothing is read); a ``.bin`` file has a known header (:func:`read_bin`) and a
    whole number of tokens; every token id is below ``model.vocab_size``.  Cost: a walk and a ``stat`` per file
    (the default stdlib corpus, ~1,800 files: well under a second); for ``bin`` with a vocabulary below the token
    width also one pass over the tokens for the largest id (:func:`max_token_id`); with ``data.tokenizer=bpe`` the
    BPE cache is built here when missing (a one-off: tokenizer training and encoding of the corpus).

    Raises:
        ConfigError: naming the field (``data.paths``, ``model.seq_length``, ``model.vocab_size``), its value and
            the fix.
    """
    cfg, seq_length, vocab_size = config.data, config.model.seq_length, config.model.vocab_size
    if cfg.source == "bin" or cfg.tokenizer == "bpe":
        return load_corpus(cfg, seq_length, vocab_size).description
    files = _text_files(cfg)
    n = _text_size(files, cfg.max_bytes)
    if n == 0:
        raise ConfigError(f"data.paths={cfg.paths}: the {len(files)} input file(s) are empty; point data.paths at "
                          f"files with text in them")
    _check_split_lengths(*_split_sizes(n, cfg.val_fraction, cfg.split_block_bytes), seq_length, cfg)
    _check_vocab(Corpus(np.zeros(0, np.uint8), np.zeros(0, np.uint8), ""), vocab_size, cfg.source)
    return f"{len(files)} files ({cfg.source}), {n:,} bytes"


def load_corpus(cfg: DataConfig, seq_length: int, vocab_size: int) -> Corpus:
    """Read the configured corpus and split it (the checks of :func:`check_data`, on the data read).

    Raises:
        ConfigError: missing / empty / odd-sized / foreign-header files, a split shorter than one sequence, or
            token ids beyond ``vocab_size`` (the largest id is found once here, in one chunked pass over a
            ``.bin`` corpus).
    """
    from .tokenizer import ByteTokenizer
    if cfg.source == "bin":
        train, val, p = _bin_arrays(cfg)
        corpus = Corpus(train, val, _bin_description(train, val, p))
        where = f"data.paths[0]={str(p)!r}"
    elif cfg.tokenizer == "bpe":
        corpus, where = _bpe_corpus(cfg, vocab_size), "the BPE tokens"
    else:
        tokens, count = read_text_files(_text_files(cfg), cfg.max_bytes)
        if not len(tokens):
            raise ConfigError(f"data.paths={cfg.paths}: the {count} input file(s) are empty; point data.paths at "
                              f"files with text in them")
        train, val = _block_split(tokens, cfg.val_fraction, cfg.split_block_bytes)
        corpus = Corpus(train, val, f"{count} files ({cfg.source}), {len(tokens):,} bytes",
                        tokenizer=ByteTokenizer())
        where = cfg.source
    _check_split_lengths(len(corpus.train), len(corpus.val), seq_length, cfg)
    _check_vocab(corpus, vocab_size, where)
    return corpus


class Batches:
    """The microbatches of training steps and evaluations for one data-parallel rank.

    Args:
        corpus: the token splits.
        seq_length: ``s``; each sample holds ``s`` inputs and the ``s`` next tokens as labels.
        micro_batch_size: ``b``. num_microbatches: ``M`` (per data-parallel rank, per step).
        dp_rank, dp_size: this rank's data-parallel slice of the global batch.
        seed: sample-order seed.
        vocab_size: token ids must be below it (checked once here over both splits, cached on the corpus:
            ``ValueError``).
    """

    def __init__(self, corpus: Corpus, seq_length: int, micro_batch_size: int, num_microbatches: int,
                 dp_rank: int, dp_size: int, seed: int, vocab_size: int, device: torch.device | str = "cpu"):
        self.corpus, self.s, self.b, self.m = corpus, seq_length, micro_batch_size, num_microbatches
        self.dp_rank, self.dp_size, self.seed, self.vocab = dp_rank, dp_size, seed, vocab_size
        import torch
        self.device = torch.device(device)
        if vocab_size < corpus.vocab_needed and corpus.largest_token() >= vocab_size:
            raise ValueError(f"token id {corpus.largest_token()} >= model.vocab_size={vocab_size}; set "
                             f"model.vocab_size to the tokenizer's vocabulary size")

    def train_offsets(self, step: int) -> np.ndarray:
        """Start offsets ``[dp x M x b]`` of the global batch of training step ``step`` (0-based)."""
        import torch
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
        import torch
        per_rank = num_microbatches * self.b
        mine = offsets[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank].reshape(num_microbatches, self.b)
        window = np.arange(self.s + 1)
        cuda = self.device.type == "cuda"
        for row in mine:
            sample = torch.from_numpy(tokens[row[:, None] + window].astype(np.int64))  # [b, s + 1]
            if cuda:  # pinned + non_blocking: the copy queues on the stream instead of waiting for it
                sample = sample.pin_memory()
            sample = sample.to(self.device, non_blocking=True)
            yield {"tokens": sample[:, :-1] if want_tokens else None,
                   "labels": sample[:, 1:] if want_labels else None}

    def train(self, step: int, want_tokens: bool, want_labels: bool) -> Iterator[dict]:
        """The ``M`` microbatches ``{"tokens": [b, s] | None, "labels": [b, s] | None}`` of training step ``step``."""
        return self._microbatches(self.corpus.train, self.train_offsets(step), self.m, want_tokens, want_labels)

    def val(self, iteration: int, num_iterations: int, num_microbatches: int, want_tokens: bool,
            want_labels: bool) -> Iterator[dict]:
        """The microbatches of evaluation iteration ``iteration`` (the same windows at every evaluation)."""
        return self._microbatches(self.corpus.val, self.val_offsets(iteration, num_iterations, num_microbatches),
                                  num_microbatches, want_tokens, want_labels)
