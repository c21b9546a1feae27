"""What a run leaves for its user: metrics.jsonl and loss.png, the FLOPs estimate, sampling from checkpoints of any
pipeline layout, safetensors export, the byte-level BPE and llm.c token files."""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.training.config import ConfigError, load_config
from tests.helpers.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def tiny(run_dir, **extra) -> dict:
    """A 4-layer GPT small enough for a few steps on loaded CPUs."""
    return {"model.num_layers": 4, "model.hidden_size": 32, "model.num_attention_heads": 2,
            "model.seq_length": 16, "data.max_bytes": 200_000, "training.micro_batch_size": 2,
            "training.num_microbatches": 4, "training.steps": STEPS, "training.eval_interval": 2,
            "optimizer.warmup_steps": 1, "logging.progress_bar": False, "logging.run_dir": str(run_dir), **extra}


def _train(rank, world, overrides) -> tuple[dict, list[int]]:
    """Train; returns this rank's final weights under the checkpoint's layout-independent names and 12 tokens
    sampled through the pipeline (``Trainer.sample``, seed 5)."""
    from engine import Trainer
    with Trainer(load_config(None, overrides)) as trainer:
        trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.canonical.state_dict().items()}
        return weights, trainer.sample(12, seed=5)


def _train_layouts(rank, world, runs: dict) -> dict:
    return {name: _train(rank, world, overrides)[1] for name, overrides in runs.items()}


@pytest.fixture(scope="module")
def pp1(tmp_path_factory):
    """``(run_dir, final weights, pipeline sample)`` of the tiny model trained 4 steps with pp=1 in this process."""
    run_dir = tmp_path_factory.mktemp("layouts") / "pp1"
    return (run_dir, *_train(0, 1, tiny(run_dir)))


@pytest.fixture(scope="module")
def runs(pp1):
    """The same model trained with pp=1 (this process), pp=2 and pp=2 x vp=2 (one 2-rank job): run folders."""
    root = pp1[0].parent
    layouts = {"pp2": {"parallel.pipeline": 2}, "pp2_vp2": {"parallel.pipeline": 2, "parallel.virtual": 2}}
    samples = run_ranks(_train_layouts, 2, {name: tiny(root / name, **extra) for name, extra in layouts.items()},
                        timeout=110)
    assert samples[0] == samples[1]  # Trainer.sample returns the same ids on every rank
    return {"pp1": pp1[0], **{name: root / name for name in layouts}}, samples[0]


# ---- metrics.jsonl and loss.png -------------------------------------------------------------------------------
_STEP_LINE = re.compile(r"step (\d+)/\d+ \| loss ([\d.]+) \| grad norm ([\d.]+) \| lr ([\d.e+-]+) \| (\d+) tokens/s "
                        r"\| ([\d.e+-]+) TFLOP/s")
_VAL_LINE = re.compile(r"step (\d+)/\d+ \| val loss ([\d.]+)")


def test_metrics_jsonl_matches_the_log(pp1):
    from engine.training.metrics import model_flops_per_token, read_metrics
    run = pp1[0]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "val_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["step"] for r in evals] == [0, 2, 4]
    log = (run / "train.log").read_text()
    logged = {int(m[1]): m for m in _STEP_LINE.finditer(log)}
    config = load_config(run / "config.yaml", check=False)
    tokens = config.global_batch_size * config.model.seq_length
    flops = model_flops_per_token(config.model, config.ffn_hidden_size)
    for r in steps:
        m = logged[r["step"]]
        assert f"{r['loss']:.4f}" == m[2] and f"{r['grad_norm']:.3f}" == m[3] and f"{r['lr']:.3e}" == m[4]
        assert f"{r['tokens_per_s']:.0f}" == m[5] and f"{r['tflops']:.3g}" == m[6]
        assert r["tokens_seen"] == r["step"] * tokens
        assert r["tflops"] == pytest.approx(flops * r["tokens_per_s"] / 1e12)
        assert r["step_time_s"] > 0
    assert {int(m[1]): m[2] for m in _VAL_LINE.finditer(log)} == {r["step"]: f"{r['val_loss']:.4f}" for r in evals}
    assert read_metrics(run / "metrics.jsonl") == lines


def _has_color(image: np.ndarray, hex_color: str) -> int:
    rgb = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < 0.02).sum())


def test_loss_png_has_both_curves(pp1, tmp_path):
    import matplotlib.image
    from engine.training.metrics import TRAIN_COLOR, VAL_COLOR, plot_losses, read_metrics
    png = pp1[0] / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert _has_color(image, TRAIN_COLOR) > 100 and _has_color(image, VAL_COLOR) > 100
    # without validation lines there is no validation curve (so the check above sees the curve, not the legend)
    records = [r for r in read_metrics(pp1[0] / "metrics.jsonl") if "loss" in r]
    plot_losses(records, tmp_path / "train_only.png")
    assert _has_color(matplotlib.image.imread(tmp_path / "train_only.png"), VAL_COLOR) == 0


def test_metrics_resume_drops_lines_after_the_checkpoint(tmp_path):
    from engine.training.metrics import MetricsLog, read_metrics
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(6)))
    log = MetricsLog(tmp_path, resume_step=3)
    log.write({"step": 4, "loss": 0.5})
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == \
        [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 0.5)]
    MetricsLog(tmp_path).close()  # a fresh run starts an empty file
    assert read_metrics(tmp_path / "metrics.jsonl") == []


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="optional dependency tensorboard is not installed (pip install -e '.[tensorboard]')")
def test_tensorboard_events(tmp_path):
    from engine.training.metrics import MetricsLog
    log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 1, "loss": 2.0})
    log.close()
    assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_needs_the_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else object())
    with pytest.raises(ConfigError, match=r"logging.tensorboard=true needs the tensorboard package.*\[tensorboard\]"):
        load_config(None, {"logging.tensorboard": True})


# ---- FLOPs ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_flops_parameter_count_is_the_models_matmul_parameters(tied):
    from engine.training.config import ModelConfig
    from engine.training.metrics import flops_parameter_count, model_flops_per_token
    from engine.training.models.chunk import build_model_chunks
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=300,
                      tie_embeddings=tied)
    (chunk,) = build_model_chunks(cfg, 64, 1, 0, 1, 0)
    total = sum(p.numel() for p in chunk.parameters())
    lookups = chunk.embedding.pos.weight.numel() + (0 if tied else chunk.embedding.word.weight.numel())
    assert flops_parameter_count(cfg, 64) == total - lookups
    assert model_flops_per_token(cfg, 64) == 6 * (total - lookups) + 12 * 2 * 2 * 8 * 8


def test_gpt2_preset_flops():
    """GPT-2 124M (nanoGPT's estimate_mfu): N = 124M less the position embedding; ~0.87 GFLOP per token."""
    from engine.training.metrics import flops_parameter_count, model_flops_per_token
    config = load_config(ROOT / "configs" / "gpt2_124m.yaml")
    assert config.model.vocab_size % 64 == 0
    n = flops_parameter_count(config.model, config.ffn_hidden_size)
    assert 123e6 < n < 125e6
    assert model_flops_per_token(config.model, config.ffn_hidden_size) == 6 * n + 12 * 12 * 12 * 64 * 1024


# ---- sampling and export --------------------------------------------------------------------------------------
def test_sampling_is_seeded(pp1):
    from engine.training.generate import generate, load_model, model_state_dict
    loaded = load_model(pp1[0])
    state = model_state_dict(loaded.model)
    assert state.keys() == pp1[1].keys() and all(torch.equal(state[k], pp1[1][k]) for k in state)  # as trained
    prompt = loaded.tokenizer.encode("def ")
    first = generate(loaded.model, prompt, 24, 0.8, 50, seed=7)
    assert len(first) == 24 and generate(loaded.model, prompt, 24, 0.8, 50, seed=7) == first
    assert generate(loaded.model, prompt, 24, 0.8, 50, seed=8) != first
    # the in-training sampler (forward-only pipeline schedule, right-padded window) draws the same tokens
    assert generate(loaded.model, loaded.tokenizer.encode("\n"), 12, 0.8, 50, seed=5) == pp1[2]
    greedy = generate(loaded.model, prompt, 8, 0.0, None, seed=1)
    assert greedy == generate(loaded.model, prompt, 8, 0.0, None, seed=2)  # temperature 0: argmax, seed unused


def test_sample_options_out_of_range_are_one_error_line(pp1, capsys):
    """Issue 26 sweep: a seed past what torch takes raised a traceback (``Overflow when unpacking long long``), a
    huge --threads an error naming no option, a tiny temperature ``probability tensor contains inf`` (logits / T
    overflowed; shifted by the max first they give -inf, and the draw is the argmax)."""
    from engine.cli import main
    from engine.training.generate import generate, load_model
    for option, value, message in (("--seed", str(2**64), "--seed=18446744073709551616 must be in -2**63..2**64-1"),
                                   ("--threads", str(10**20), "--threads=100000000000000000000 must be in 1..1024"),
                                   ("--max-new-tokens", str(10**20), "is more than 1,000,000")):
        assert main(["sample", str(pp1[0]), option, value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    loaded = load_model(pp1[0])
    prompt = loaded.tokenizer.encode("def ")
    assert generate(loaded.model, prompt, 8, 1e-300, None, seed=3) == generate(loaded.model, prompt, 8, 0.0, None)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sampling_is_layout_independent(runs):
    from engine.training.generate import generate, load_model, model_state_dict
    runs, pipeline_samples = runs
    loaded = {name: load_model(path) for name, path in runs.items()}
    reference = model_state_dict(loaded["pp1"].model)
    for name, one in loaded.items():  # the three layouts trained the same model (within fp32 rounding)
        state = model_state_dict(one.model)
        assert state.keys() == reference.keys(), name
        diff = max(float((state[k] - reference[k]).abs().max()) for k in reference)
        assert diff < 1e-5, f"{name}: max |weight - pp1 weight| = {diff:.3g}"
    prompt = loaded["pp1"].tokenizer.encode("def ")
    samples = {name: generate(one.model, prompt, 24, 0.8, 50, seed=7) for name, one in loaded.items()}
    assert len(set(map(tuple, samples.values()))) == 1, samples
    newline = loaded["pp1"].tokenizer.encode("\n")
    for name, ids in pipeline_samples.items():  # sampled during training through the pp=2 (x vp=2) pipeline
        assert ids == generate(loaded[name].model, newline, 12, 0.8, 50, seed=5), name
    # the pipelined run's metrics.jsonl is written by its last stage: every step and evaluation once
    lines = [json.loads(line) for line in (runs["pp2_vp2"] / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "loss" in r) for r in lines] == [(0, False), (1, True), (2, True), (2, False), (3, True),
                                                         (4, True), (4, False)]


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``pipecast ARGS`` in this process (``engine.cli.main``; the e2e tests run the CLI as a subprocess): exit
    status, stdout, stderr."""
    from engine.cli import main
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sample_command(pp1, tmp_path, capsys, monkeypatch):
    import sys

    from engine.training import generate as gen
    from engine.training.generate import generate, load_model
    printed = []  # stdout's length at each sampled token: the text is printed as it comes (issue 36)
    real = gen.sample_token
    monkeypatch.setattr(gen, "sample_token", lambda *a, **k: printed.append(len(sys.stdout.getvalue())) or real(*a, **k))
    code, out, err = _cli(capsys, "sample", str(pp1[0]), "--prompt", "import ", "--max-new-tokens", "12", "--seed", "3")
    assert code == 0, err
    assert len(printed) == 12 and printed[-1] > printed[0] > 0, printed
    monkeypatch.setattr(gen, "sample_token", real)
    loaded = load_model(pp1[0])
    expected = generate(loaded.model, loaded.tokenizer.encode("import "), 12, 0.8, 50, seed=3)
    assert out == "import " + loaded.tokenizer.decode(expected) + "\n" and "sampled 12 tokens" in err
    code, _, err = _cli(capsys, "sample", str(tmp_path), "--max-new-tokens", "2")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert str(tmp_path) in err


def test_sample_streams_the_text_as_tokens_come():
    """Issue 36: ``pipecast sample`` printed nothing until the last token.  :class:`TextStream` writes each token's
    text when it is sampled, holding back only a character whose UTF-8 bytes are split over tokens; what it writes
    is the decoded text (ids of a run without a tokenizer: space-separated)."""
    import io

    from engine.training.data.tokenizer import ByteTokenizer
    from engine.training.generate import TextStream

    class Out(io.StringIO):
        writes: list = []

        def write(self, text):
            self.writes.append((self.fed, text))
            return super().write(text)
    text = "héllo wörld ✓ 😀 done"
    out = Out()
    stream = TextStream(ByteTokenizer(), out)
    for out.fed, byte in enumerate(text.encode(), 1):
        stream(byte)
    stream.close()
    assert out.getvalue() == text and not any("\ufffd" in t for _, t in out.writes)
    assert [fed for fed, _ in out.writes] == [len(text[:i + 1].encode()) for i in range(len(text))]  # per char
    ids = io.StringIO()
    stream = TextStream(None, ids)
    for token in (17, 42, 5):
        stream(token)
    stream.close()
    assert ids.getvalue() == " 17 42 5"


def test_prompt_the_tokenizer_cannot_encode(pp1):
    from engine.training.generate import encode_prompt, load_model
    from engine.training.data.tokenizer import TokenizerError
    loaded = load_model(pp1[0])
    with pytest.raises(TokenizerError, match=r"--prompt .* is not valid Unicode text"):
        encode_prompt(loaded.tokenizer, "abc\udcff", loaded.config.vocab_size)
    with pytest.raises(TokenizerError, match=r"token ids separated by spaces"):
        encode_prompt(None, "hello", 300)


def test_export_then_load_is_bitwise(pp1, tmp_path):
    from engine.training.export import export_checkpoint, load_exported
    state = pp1[1]
    out = tmp_path / "model.safetensors"
    written = export_checkpoint(pp1[0], out)
    assert out in written and (tmp_path / "model.config.json").is_file()
    tensors, info = load_exported(out)
    assert tensors.keys() == state.keys() and info["model"]["num_layers"] == 4
    assert all(torch.equal(tensors[k], state[k]) for k in state)
    export_checkpoint(pp1[0], tmp_path / "half.safetensors", "bf16")
    half, _ = load_exported(tmp_path / "half.safetensors")
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], state[k].bfloat16()) for k in state)


def test_export_replaces_only_when_asked_and_writes_plain_modes(pp1, tmp_path, capsys):
    """Issue 36: export into a folder with files in it overwrote silently and left stale files beside the new
    model; model.safetensors was 0600 beside a 0644 config.json.  Now an export over an earlier one (a folder with
    files, or the file and its sidecars) is one error line naming them and ``--overwrite``, nothing changed; with
    ``--overwrite`` the folder holds the new files only (a stale tokenizer sidecar is removed), and every file
    written has the mode a plain write gives: a new one 0o666 less the umask (here 0o027 -> 0o640), a replaced one
    (and the replaced folder) its own."""
    import stat
    hf, single = tmp_path / "hf", tmp_path / "m.safetensors"
    hf.mkdir()
    (hf / "old.bin").write_text("an earlier export")
    stale = tmp_path / "m.tokenizer.json"  # an earlier BPE export's sidecar; this run uses bytes
    for path in (single, stale):
        path.write_text("earlier")
    before = {p: p.read_bytes() for p in (hf / "old.bin", single, stale)}
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (hf, single)}
    mask = os.umask(0o027)
    try:
        for args, named in ((["--format", "hf", "--out", str(hf)], "(old.bin)"),
                            (["--out", str(single)], f"'{single}', '{stale}' already exist")):
            code, _, err = _cli(capsys, "export", str(pp1[0]), *args)
            assert code == 2 and err.count("\n") == 1 and named in err and "--overwrite" in err, err
        assert {p: p.read_bytes() for p in before} == before
        for args in (["--format", "hf", "--out", str(hf)], ["--out", str(single)]):
            assert _cli(capsys, "export", str(pp1[0]), *args, "--overwrite")[0] == 0
    finally:
        os.umask(mask)
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.config.json", "m.safetensors"]
    for path in (*hf.iterdir(), tmp_path / "m.config.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, path
    assert {p: stat.S_IMODE(p.stat().st_mode) for p in modes} == modes


def test_sample_and_export_read_the_folder_given_not_the_run_dir_in_its_config(pp1, tmp_path, capsys):
    """Issue 26: a copied run folder keeps its config.yaml, whose logging.run_dir names the original; after the
    original trains on, sample and export of the copy must read the copy's own checkpoint."""
    import shutil
    from engine import Trainer
    from engine.cli import main
    from engine.training.export import load_exported
    from engine.training.generate import resolve_checkpoint
    original, backup = tmp_path / "default", tmp_path / "backup"
    shutil.copytree(pp1[0], original)
    config_text = (original / "config.yaml").read_text().replace(str(pp1[0]), str(original))
    (original / "config.yaml").write_text(config_text)  # as if trained in that folder
    shutil.copytree(original, backup)
    with Trainer(load_config(None, tiny(original, **{"training.steps": STEPS + 2}))) as trainer:
        assert trainer.load() is not None
        trainer.train()
    assert resolve_checkpoint(original).name == f"step_{STEPS + 2:08d}"
    assert resolve_checkpoint(backup) == backup / "checkpoints" / f"step_{STEPS:08d}"
    assert main(["sample", str(backup), "--max-new-tokens", "2"]) == 0
    assert f"from {backup / 'checkpoints' / f'step_{STEPS:08d}'} (step {STEPS})" in capsys.readouterr().err
    assert main(["export", str(backup), "--out", str(tmp_path / "m.safetensors")]) == 0
    assert load_exported(tmp_path / "m.safetensors")[1]["checkpoint"] == str(backup / "checkpoints" /
                                                                               f"step_{STEPS:08d}")
    # an explicit checkpoint.dir inside the run folder is taken relative to the folder given
    moved = tmp_path / "moved"
    (moved / "ckpts").mkdir(parents=True)
    shutil.copytree(backup / "checkpoints" / f"step_{STEPS:08d}", moved / "ckpts" / f"step_{STEPS:08d}")
    (moved / "config.yaml").write_text(config_text.replace("checkpoint:\n  dir: null",
                                                                  f"checkpoint:\n  dir: {original / 'ckpts'}"))
    assert f"dir: {original / 'ckpts'}" in (moved / "config.yaml").read_text()
    (original / "ckpts").mkdir()
    shutil.copytree(original / "checkpoints" / f"step_{STEPS + 2:08d}", original / "ckpts" / f"step_{STEPS + 2:08d}")
    assert resolve_checkpoint(moved) == moved / "ckpts" / f"step_{STEPS:08d}"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_sample_and_export_refuse_a_broken_checkpoint(pp1, tmp_path, capsys, damage):
    """Issue 36: bytes flipped inside a ``.distcp`` file exported and sampled without a word.  A broken checkpoint,
    named or the newest of a run folder, is refused in one line naming the file; nothing is written."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(pp1[0] / "checkpoints", run / "checkpoints")
    broken = sorted((run / "checkpoints").glob("step_*"))[-1]
    payload = max(broken.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = payload.read_bytes()
    if damage == "flip":
        i = len(data) // 2
        payload.write_bytes(data[:i] + bytes(255 - x for x in data[i:i + 8]) + data[i + 8:])
        said = f"{payload.name} fails its sha256 checksum"
    else:
        payload.write_bytes(data[:100])
        said = f"{payload.name} is truncated (100 of {len(data):,} bytes)"
    out = tmp_path / "out"
    out.mkdir()
    for args in (("export", str(broken), "--out", str(out / "m.safetensors")),
                 ("export", str(run), "--format", "hf", "--out", str(out / "hf")),
                 ("sample", str(broken), "--max-new-tokens", "4"), ("sample", str(run), "--max-new-tokens", "4")):
        code, stdout, err = _cli(capsys, *args)
        assert code == 2 and err.count("\n") == 1 and not stdout, (args, err)
        assert err.startswith(f"error: checkpoint {str(broken)!r} is broken: {said}"), (args, err)
    assert not list(out.iterdir())


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_export_to_a_full_or_read_only_disk_is_one_error_line(pp1, tmp_path, monkeypatch, capsys, fmt):
    """Issue 26: export to a full disk / read-only folder raised a traceback (the read-only one a second OSError
    from removing the ``.tmp`` file).  Now: exit 2, one ``error:`` line with the reason, nothing left behind."""
    import errno
    from engine.cli import main
    out = tmp_path / ("m.safetensors" if fmt == "safetensors" else "hf")
    real_write = Path.write_text
    for code, removal_fails in ((errno.ENOSPC, False), (errno.EROFS, True)):
        def failing_write(self, *args, _code=code, **kwargs):  # the sidecar / config.json, after the weights
            if ".tmp" in str(self):  # a temporary file, or a file in the temporary folder (--format hf)
                raise OSError(_code, os.strerror(_code))
            return real_write(self, *args, **kwargs)

        def failing_unlink(self, missing_ok=False, _code=code):
            raise OSError(_code, os.strerror(_code), str(self))
        with monkeypatch.context() as patch:
            patch.setattr(Path, "write_text", failing_write)
            if removal_fails:
                patch.setattr(Path, "unlink", failing_unlink)
            assert main(["export", str(pp1[0]), "--out", str(out), "--format", fmt]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: cannot write "), err
        assert os.strerror(code) in err and f"{out.stem if fmt == 'hf' else 'm.config'}" in err, err
        if not removal_fails:  # (the patched unlink cannot remove the temporaries it was asked to)
            assert sorted(tmp_path.iterdir()) == [], sorted(tmp_path.iterdir())


def _full_disk(monkeypatch, name: str) -> None:
    """The disk is full for every file whose name ends in ``name``: opening it works, every write fails with
    ``OSError(ENOSPC)`` naming no file (as ``write(2)`` does); other files are written normally."""
    import builtins
    import errno
    import io
    real = io.open

    class Full(io.FileIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_open(file, mode="r", buffering=-1, encoding=None, *args, **kwargs):
        if not (isinstance(file, (str, os.PathLike)) and Path(file).name.endswith(name) and set(mode) & set("wax+")):
            return real(file, mode, buffering, encoding, *args, **kwargs)
        raw = Full(file, mode.replace("b", "").replace("t", ""))
        if "b" in mode:
            return raw if buffering == 0 else (io.BufferedRandom if "+" in mode else io.BufferedWriter)(raw)
        return io.TextIOWrapper(io.BufferedWriter(raw), encoding=encoding or "utf-8")
    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(io, "open", full_open)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,shown,status", [
    ("config.yaml", "config.yaml", 1), ("train.log", "train.log", 1), ("metrics.jsonl", "metrics.jsonl", 1),
    (".loss.png.tmp", "loss.png", 1), (".distcp", ".distcp", 2), ("timeline.json", "timeline.json", 1),
    (".pipecast.lock", ".pipecast.lock", 2),
])
def test_a_full_disk_while_training_is_one_error_line(tmp_path, monkeypatch, capsys, name, shown, status):
    """Issue 36: a full disk printed tracebacks (a checkpoint), ``--- Logging error ---`` per log line (train.log),
    a bare ``[Errno 28]`` (the run lock) or a warning per evaluation (loss.png).  Every file a run writes: one
    ``error:`` line naming it and the cause (and, but for the timeline, the fix), nothing else on stderr but the
    log; no traceback."""
    run_dir = tmp_path / "run"
    args = [f"--{k}={v}" for k, v in tiny(run_dir, **{"model.num_layers": 2, "training.steps": 2,
                                                      "checkpoint.interval": 2, "logging.level": "INFO"}).items()]
    _full_disk(monkeypatch, name)
    code, _, err = _cli(capsys, "train", "configs/default.yaml", "--parallel.pipeline=1", "--parallel.virtual=1",
                        "--logging.sample_every_eval=0", f"--timeline={tmp_path / 'timeline'}", *args)
    assert code == status, err
    assert "Traceback" not in err and "Logging error" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not re.match(r"\d\d:\d\d:\d\d ", ln)]  # not the log
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert shown in lines[0] and "No space left on device" in lines[0], err
    assert "free space" in lines[0] or name == "timeline.json", err


# ---- tokenizers and token files -------------------------------------------------------------------------------
def test_bpe_round_trips_and_is_cached(tmp_path):
    from engine.training.data.corpus import bpe_cache, load_corpus
    text = "".join(f"def function_{i}(x):\n    return x * {i} + 'héllo wörld ✓'\n\n" for i in range(3000))
    (tmp_path / "corpus.txt").write_text(text)
    config = load_config(None, {"data.source": "text", "data.paths": [str(tmp_path / "corpus.txt")],
                                "data.tokenizer": "bpe", "model.vocab_size": 320, "data.cache_dir": str(tmp_path / "c")})
    corpus = load_corpus(config.data, 16, 320)
    tok = corpus.tokenizer
    assert 256 < tok.vocab_size <= 320 and corpus.train.dtype == np.uint16 and int(corpus.train.max()) < 320
    for sample in ["def f(x):\n\treturn  x\n", "ünïcödé ✓ 😀", "", " leading and trailing  "]:
        assert tok.decode(tok.encode(sample)) == sample
    assert len(tok.encode(text[:2000])) < 2000 / 2  # merges learned
    folder = bpe_cache(config.data, 320)
    stamp = (folder / "train.bin").stat().st_mtime_ns
    assert bpe_cache(config.data, 320) == folder and (folder / "train.bin").stat().st_mtime_ns == stamp  # reused


def test_bpe_settings_are_checked():
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is too small for data.tokenizer='bpe'"):
        load_config(None, {"data.tokenizer": "bpe", "model.vocab_size": 256})
    from engine.training.config import validate
    config = load_config(None, {"data.tokenizer": "bpe", "data.source": "bin", "data.paths": ["."]}, check=False)
    with pytest.raises(ConfigError, match=r"data.tokenizer='bpe' does not apply to data.source='bin'"):
        validate(config)
    with pytest.raises(ConfigError, match=r"data.tokenizer='words' is not allowed; use one of 'bytes' \| 'bpe'"):
        load_config(None, {"data.tokenizer": "words"})


def _llmc(path: Path, tokens, version: int, magic: int = 20240520, count: int | None = None) -> Path:
    header = np.zeros(256, "<i4")
    header[:3] = (magic, version, len(tokens) if count is None else count)
    path.write_bytes(header.tobytes() + np.asarray(tokens, {1: np.uint16, 2: np.uint32}.get(version, np.uint16))
                     .tobytes())
    return path


def test_llmc_token_files(tmp_path):
    from engine.training.data.corpus import check_data, load_corpus, read_bin
    tokens16 = np.arange(5000) % 60000
    assert np.array_equal(read_bin(_llmc(tmp_path / "v1.bin", tokens16, 1)), tokens16)
    tokens32 = (np.arange(5000) * 17) % 100_000
    v2 = read_bin(_llmc(tmp_path / "v2.bin", tokens32, 2))
    assert v2.dtype == np.uint32 and np.array_equal(v2, tokens32) and int(v2.max()) > 65536
    folder = tmp_path / "llmc"
    folder.mkdir()
    _llmc(folder / "train.bin", tokens32, 2)
    _llmc(folder / "val.bin", tokens32[:500], 2)
    over = {"data.source": "bin", "data.paths": [str(folder)], "model.seq_length": 16}
    corpus = load_corpus(load_config(None, {**over, "model.vocab_size": 100_000}).data, 16, 100_000)
    assert len(corpus.train) == 5000 and len(corpus.val) == 500 and corpus.tokenizer is None
    with pytest.raises(ConfigError, match=r"model.vocab_size=65536 is too small .* token id 84983"):
        check_data(load_config(None, {**over, "model.vocab_size": 65536}))


@pytest.mark.parametrize("kind", ["foreign magic", "unknown version", "wrong count"])
def test_foreign_token_file_headers_are_refused(tmp_path, kind):
    from engine.training.data.corpus import read_bin
    path = tmp_path / "tokens.bin"
    if kind == "foreign magic":  # an llm.c model file, not tokens
        _llmc(path, np.arange(100), 3, magic=20240326)
        expect = r"starts with a header of magic 20240326 version 3, not an llm.c token file"
    elif kind == "unknown version":
        _llmc(path, np.arange(100), 7)
        expect = r"llm.c header \(magic 20240520\) of version 7; pipecast reads version 1 .* and 2"
    else:
        _llmc(path, np.arange(100), 1, count=150)
        expect = r"announcing 150 uint16 tokens = 1,324 bytes, but the file has 1,224 bytes"
    with pytest.raises(ConfigError, match=expect) as info:
        read_bin(path)
    assert str(path) in str(info.value)


# ---- discoverable config --------------------------------------------------------------------------------------
def test_every_config_field_is_documented_in_train_help(capsys):
    from engine.cli import main
    from engine.training.config.help import field_rows
    rows = field_rows()
    assert all(meaning for *_, meaning in rows), [name for name, *_, meaning in rows if not meaning]
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for name, kind, default, _ in rows:
        assert f"--{name} {kind} (built-in default {default})" in text
    assert "--data.tokenizer 'bytes' | 'bpe' (built-in default bytes)" in text and "--print-config" in text


def test_print_config_prints_the_resolved_yaml_and_exits(capsys, tmp_path):
    import yaml
    from engine.cli import main
    run_dir = tmp_path / "never_made"
    assert main(["train", "configs/default.yaml", "--print-config", "--training.steps=7",
                 f"--logging.run_dir={run_dir}"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["training"]["steps"] == 7 and printed["parallel"]["data"] == 1
    assert printed["parallel"]["virtual"] == 2 and not run_dir.exists()
    assert load_config(None, {f"{s}.{k}": v for s, sec in printed.items() for k, v in sec.items()}).training.steps == 7
    assert main(["train", "configs/default.yaml", "--print-config", "--data.tokenizer=words"]) == 2
    assert capsys.readouterr().err.startswith("error: data.tokenizer='words' is not allowed")


def test_bpe_run_keeps_its_tokenizer_with_the_checkpoint(tmp_path):
    """A data.tokenizer=bpe run saves tokenizer.json into each checkpoint; sample and export decode with it."""
    from engine.training.export import export_checkpoint
    from engine.training.generate import encode_prompt, load_model
    (tmp_path / "corpus.txt").write_text("".join(f"value_{i} = compute({i}, 'x')\n" for i in range(4000)))
    over = tiny(tmp_path / "run", **{"data.source": "text", "data.paths": [str(tmp_path / "corpus.txt")],
                                     "data.tokenizer": "bpe", "model.vocab_size": 384,
                                     "data.cache_dir": str(tmp_path / "cache"), "training.steps": 2})
    _train(0, 1, over)
    loaded = load_model(tmp_path / "run")
    assert loaded.tokenizer.kind == "bpe" and (loaded.checkpoint / "tokenizer.json").is_file()
    text = "value_7 = compute(7, 'x')\n"
    assert loaded.tokenizer.decode(encode_prompt(loaded.tokenizer, text, 384)) == text
    export_checkpoint(tmp_path / "run", tmp_path / "m.safetensors")
    assert (tmp_path / "m.tokenizer.json").read_text() == (loaded.checkpoint / "tokenizer.json").read_text()
