"""Tokenizers of a run: ``bytes`` (one token per UTF-8 byte) and ``bpe`` (a byte-level BPE trained with Hugging
Face ``tokenizers`` on the training split).  Both encode ``str -> list[int]`` and decode ``list[int] -> str``;
every text a Python ``str`` can hold as UTF-8 encodes (byte-level: no unknown tokens), and decoding the
encoding gives the text back.

Errors: :class:`TokenizerError` (a ``ValueError``) for text that is not valid Unicode (e.g. lone surrogates from an
undecodable command line) and for unreadable ``tokenizer.json`` files, naming the input and the fix.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

__all__ = ["TokenizerError", "ByteTokenizer", "BPETokenizer", "train_bpe", "load_tokenizer"]


class TokenizerError(ValueError):
    """Text the tokenizer cannot encode, or a tokenizer file that cannot be read."""


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TokenizerError(f"{what} {text!r} is not valid Unicode text (character {exc.start}: "
                             f"{text[exc.start]!r} has no UTF-8 encoding); pass UTF-8 text") from None


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255)."""

    kind = "bytes"
    vocab_size = 256

    def encode(self, text: str, what: str = "text") -> list[int]:
        return list(_utf8(text, what))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes to text; ids >= 256 (a model vocabulary padded past the bytes) and invalid UTF-8 become U+FFFD."""
        out = bytearray()
        for i in ids:
            out += bytes((i,)) if 0 <= i < 256 else "\ufffd".encode()
        return out.decode("utf-8", errors="replace")


class BPETokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with a byte-level BPE model (GPT-2's pre-tokenizer regex, byte-level
    decoder, no normalizer, no special tokens), so that ``decode(encode(t)) == t`` for every text ``t``."""

    kind = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "BPETokenizer":
        """Raises: TokenizerError naming the file when it is missing or not a tokenizer."""
        from tokenizers import Tokenizer
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions
            raise TokenizerError(f"cannot read tokenizer file {str(path)!r} ({type(exc).__name__}: {exc}); delete "
                                 f"it (and its cache folder) so that it is trained again") from None

    def to_str(self) -> str:
        """The ``tokenizer.json`` text."""
        return self._tok.to_str()

    def save(self, path: str | os.PathLike) -> None:
        self._tok.save(str(path))

    def encode(self, text: str, what: str = "text") -> list[int]:
        _utf8(text, what)  # the tokenizer (Rust) takes valid Unicode only
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids beyond the tokenizer's vocabulary (a padded model vocabulary) are dropped."""
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (its 256 byte tokens included) on ``texts``
    (fewer when the text has fewer merges to offer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok)


def load_tokenizer(kind: str, path: str | os.PathLike | None = None):
    """``bytes`` -> :class:`ByteTokenizer`; ``bpe`` -> :class:`BPETokenizer` from ``path`` (a ``tokenizer.json``)."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "bpe":
        if path is None or not Path(path).is_file():
            raise TokenizerError(f"the BPE tokenizer file {str(path)!r} is missing; it is written into every "
                                 f"checkpoint of a data.tokenizer=bpe run")
        return BPETokenizer.from_file(path)
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; use 'bytes' or 'bpe'")
