"""GPT chunks (Megatron's layer order, layout-independent initialisation, tied copies) and the data pipeline
(deterministic split, same samples whatever the data-parallel layout, nanoGPT .bin files).  Single process."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.training.config import ConfigError, DataConfig, ModelConfig
from engine.training.data.corpus import Batches, Corpus, load_corpus, stdlib_files
from engine.training.models.chunk import build_model_chunks, canonical_module

CFG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16)


def _all_stages(pp: int, vp: int):
    """Every chunk of a pp x vp layout, in virtual-stage order (built as the ranks would build them)."""
    per_rank = [build_model_chunks(CFG, 4 * CFG.hidden_size, pp, r, vp, seed=7) for r in range(pp)]
    stages = {chunk.stage: chunk for chunks in per_rank for chunk in chunks}
    return [stages[s] for s in range(pp * vp)], per_rank


def _run(stages, tokens, labels):
    x = None
    for chunk in stages:
        chunk.set_input_tensor(x)
        x = chunk(tokens if chunk.is_first else None, labels if chunk.is_last else None)
    return x


@pytest.mark.parametrize("pp,vp", [(2, 1), (2, 2), (4, 1)])
def test_any_layout_is_the_same_model(pp, vp):
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (3, 16))
    labels = torch.randint(0, 256, (3, 16))
    ref_stages, _ = _all_stages(1, 1)
    stages, per_rank = _all_stages(pp, vp)
    # Megatron's order: chunk c on rank r holds virtual stage c*pp + r
    for r, chunks in enumerate(per_rank):
        assert [chunk.stage for chunk in chunks] == [c * pp + r for c in range(vp)]
        per = CFG.num_layers // (pp * vp)
        assert [list(chunk.layer_ids) for chunk in chunks] == [
            list(range((c * pp + r) * per, (c * pp + r + 1) * per)) for c in range(vp)]
    ref = _run(ref_stages, tokens, labels)
    out = _run(stages, tokens, labels)
    assert ref.shape == (3, 16) and torch.equal(ref, out)
    # the tied copy on the last stage starts bitwise equal to the first stage's embedding
    assert torch.equal(stages[0].embedding.word.weight, stages[-1].head.word.weight)
    assert stages[-1].head.word.weight.shared_embedding_copy
    # one stage holding both ends shares one Parameter
    assert ref_stages[0].head is None and ref_stages[0].output_weight() is ref_stages[0].embedding.word.weight


def test_canonical_names_do_not_depend_on_layout():
    ref_names = set(canonical_module(_all_stages(1, 1)[1][0]).state_dict())
    _, per_rank = _all_stages(2, 2)
    names = [set(canonical_module(chunks).state_dict()) for chunks in per_rank]
    assert names[0] | names[1] == ref_names
    assert "embedding.word.weight" in names[0] and "embedding.word.weight" in names[1]  # the tied pair
    assert "layers.2.qkv.weight" in names[0] and "layers.3.qkv.weight" in names[1]


def test_middle_stage_needs_input():
    stages, _ = _all_stages(4, 1)
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        stages[1]()
    with pytest.raises(ValueError, match="tokens"):
        stages[0]()


def _corpus(n=20000) -> Corpus:
    rng = np.random.default_rng(0)
    return Corpus(rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, 3000, dtype=np.uint8), "random")


def test_same_global_batch_for_any_data_parallel_layout():
    corpus = _corpus()
    one = list(Batches(corpus, 16, 2, 4, 0, 1, seed=3, vocab_size=256).train(5, True, True))
    two = [list(Batches(corpus, 16, 2, 2, d, 2, seed=3, vocab_size=256).train(5, True, True)) for d in range(2)]
    flat = two[0] + two[1]
    assert len(one) == len(flat) == 4
    for a, b in zip(one, flat):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])
        assert torch.equal(a["tokens"][:, 1:], a["labels"][:, :-1])  # labels are the next tokens
    other_step = list(Batches(corpus, 16, 2, 4, 0, 1, seed=3, vocab_size=256).train(6, True, False))
    assert not torch.equal(other_step[0]["tokens"], one[0]["tokens"]) and other_step[0]["labels"] is None
    # validation windows are fixed
    b = Batches(corpus, 16, 2, 4, 0, 1, seed=3, vocab_size=256)
    v1, v2 = list(b.val(1, 2, 4, True, True)), list(b.val(1, 2, 4, True, True))
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(v1, v2))


def test_stdlib_corpus_is_deterministic_and_split():
    files = list(stdlib_files())
    assert len(files) > 100 and all(f.suffix == ".py" for f in files) and files == list(stdlib_files())
    cfg = DataConfig(max_bytes=2_000_000)
    a, b = load_corpus(cfg, 64, 256), load_corpus(cfg, 64, 256)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert len(a.train) + len(a.val) == 2_000_000
    assert 0.04 < len(a.val) / 2_000_000 < 0.06  # val_fraction 0.05, in 4 KiB blocks


def test_text_and_bin_sources(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world " * 2000)
    (tmp_path / "docs" / "skip.bin").write_bytes(b"\0" * 10)
    text = load_corpus(DataConfig(source="text", paths=[str(tmp_path / "docs")]), 32, 256)
    assert len(text.train) + len(text.val) == 24000
    tokens = np.arange(30000, dtype=np.uint16) % 1000
    (tmp_path / "nano").mkdir()
    tokens[:25000].tofile(tmp_path / "nano" / "train.bin")
    tokens[25000:].tofile(tmp_path / "nano" / "val.bin")
    corpus = load_corpus(DataConfig(source="bin", paths=[str(tmp_path / "nano")]), 32, 1000)
    assert corpus.train.dtype == np.uint16 and len(corpus.train) == 25000 and len(corpus.val) == 5000
    mb = next(Batches(corpus, 32, 2, 1, 0, 1, 0, 1000).train(0, True, True))
    assert mb["tokens"].dtype == torch.int64 and int(mb["tokens"].max()) < 1000
    with pytest.raises(ValueError, match="model.vocab_size=10"):
        next(Batches(corpus, 32, 2, 1, 0, 1, 0, 10).train(0, True, True))
    with pytest.raises(ConfigError, match="train.bin"):
        load_corpus(DataConfig(source="bin", paths=[str(tmp_path / "docs")]), 32, 1000)


@pytest.mark.parametrize("text", ["pipeline stage microbatch bubble.\n" * 400, "Straße, 東京 und Größe\n" * 300])
def test_a_text_file_given_as_token_ids_names_what_it_is_and_the_fix(tmp_path, text):
    """Issue 26: ``data.source: bin`` with a text file read ASCII pairs as uint16 ids and asked for
    ``model.vocab_size >= 32116``; it must say the file is text and to use ``data.source=text``."""
    from engine.training.data.corpus import read_bin
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_corpus(DataConfig(source="bin", paths=[str(path)]), vocab_size=256, seq_length=16)
    message = str(info.value)
    assert f"{path} is a text file (its first bytes read '{' '.join(text[:40].split())[:20]}" in message, message
    assert "data.source=text" in message and "vocab_size" not in message, message
    # real token files are not mistaken for text: ids below 8192 have a control byte as their high byte
    ids = np.random.default_rng(0).integers(0, 50257, 4000).astype(np.uint16)
    ids.tofile(tmp_path / "tokens.bin")
    assert np.array_equal(read_bin(tmp_path / "tokens.bin"), ids)
    small = np.arange(300, dtype=np.uint16) % 256
    small.tofile(tmp_path / "bytes.bin")
    assert np.array_equal(read_bin(tmp_path / "bytes.bin"), small)
