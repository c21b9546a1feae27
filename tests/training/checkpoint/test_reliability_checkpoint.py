"""Checkpoints under failure, in one process (no process group: DCP's single-process mode):

* atomic save: a save that dies while writing leaves only a ``.tmp`` folder; the previous checkpoint stays the latest
  and loads bitwise; the next save of that step succeeds;
* broken checkpoints (a payload's bytes flipped, a file truncated, emptied or deleted, ``.metadata`` or the manifest
  deleted or garbled) are refused by every load in one line naming the folder, the file and what is wrong, before
  any tensor is read; a resume falls back to the newest intact checkpoint with a warning, ``checkpoint.load_step``
  picks one; broken folders count towards ``checkpoint.keep``; manifest-less checkpoints of earlier versions load
  with a warning; the manifest covers every file whatever DCP's layout;
* foreign checkpoints raise ``CheckpointError`` with a message that names the folder and the fix -- never a hang,
  never garbage weights;
* untrusted files: a crafted ``.metadata`` pickle cannot run code, and a checkpoint cannot make the loader unpickle a
  stored object (only tensors are read, with ``weights_only=True``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from engine.training.checkpoint.dcp import (CheckpointError, checkpoint_keys, checkpoint_to_load, latest_checkpoint,
                                            list_checkpoints, load_checkpoint, save_checkpoint)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "assuming the intent is to save in a single process"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
            "trainer": {"step": torch.tensor(seed, dtype=torch.int64)}}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "trainer": {"step": torch.tensor(0)}}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[s][k], b[s][k]) for s in a for k in a[s])


def test_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first = save_checkpoint(_state(1), tmp_path, step=1)
    import torch.distributed.checkpoint as dcp
    real_save = dcp.save

    def dying_save(state, checkpoint_id=None, storage_writer=None):
        # write part of the files, then "crash" (the rest of save_checkpoint never runs, as after a SIGKILL)
        (Path(checkpoint_id or storage_writer.path) / "__0_0.distcp").write_bytes(b"\x00" * 17)
        raise KeyboardInterrupt("simulated crash while writing")

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(_state(2), tmp_path, step=2)
    assert (tmp_path / ".step_00000002.tmp").is_dir()  # the partial write is only in the temporary folder
    assert list_checkpoints(tmp_path) == [first] and latest_checkpoint(tmp_path) == first
    loaded = _empty()
    load_checkpoint(loaded, latest_checkpoint(tmp_path))
    assert _equal(loaded, _state(1))

    monkeypatch.setattr(dcp, "save", real_save)
    third = save_checkpoint(_state(3), tmp_path, step=3)  # the next save also removes the stale temporary folder
    assert latest_checkpoint(tmp_path) == third and not (tmp_path / ".step_00000002.tmp").exists()
    loaded = _empty()
    load_checkpoint(loaded, third)
    assert _equal(loaded, _state(3))


def test_a_full_disk_on_a_later_save_names_the_cause_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
    """Issue 26: a real full disk fails a write inside ``torch.save`` (DCP's file format), whose zip writer turns
    the ``OSError`` into ``RuntimeError: ... unexpected pos``; the message showed ``CheckpointException
    ranks:dict_keys([0])``.  It must name ``No space left on device`` and the file, keep the earlier checkpoint
    loadable and remove the partial temporary folder."""
    import errno
    import io

    from torch.distributed.checkpoint import filesystem
    first = save_checkpoint(_state(1), tmp_path, step=1)
    real_create_stream = filesystem.FileSystem.create_stream

    class FullDisk(io.FileIO):  # a file on a full disk: the first 1000 bytes fit, then write(2) fails (no file name)
        def write(self, data):
            if self.tell() + len(memoryview(data).cast("B")) > 1000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    import contextlib

    @contextlib.contextmanager
    def full_disk(self, path, mode):
        if not str(path).endswith(".distcp") or "w" not in mode:
            with real_create_stream(self, path, mode) as stream:
                yield stream
            return
        with FullDisk(path, "wb") as stream:
            yield stream
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", full_disk)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(_state(2), tmp_path, step=2)
    message = str(info.value)
    assert "\n" not in message and "cannot save the checkpoint of step 2" in message, message
    assert "No space left on device: " in message and "__0_0.distcp" in message, message
    assert f"the previous checkpoint {str(first)!r} is intact" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no partial .step_00000002.tmp
    loaded = _empty()
    load_checkpoint(loaded, latest_checkpoint(tmp_path))
    assert _equal(loaded, _state(1))


def test_keep_removes_only_old_complete_checkpoints(tmp_path):
    for step in range(1, 5):
        save_checkpoint(_state(step), tmp_path, step=step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


def _saved(tmp_path, step: int = 3) -> Path:
    return save_checkpoint(_state(step), tmp_path, step=step, meta={"note": "test"})


def _flip(f: Path, at: float = 0.5) -> None:
    """Overwrite 8 bytes in the middle of ``f`` with their complement (the size stays: only a checksum sees it)."""
    data = bytearray(f.read_bytes())
    i = int(len(data) * at)
    data[i:i + 8] = bytes(255 - x for x in data[i:i + 8])
    f.write_bytes(bytes(data))


def _damage(path: Path, damage: str) -> str:
    """Damage checkpoint ``path``; returns what the refusal must say."""
    data, meta, manifest = sorted(path.glob("*.distcp"))[0], path / ".metadata", path / "manifest.json"
    if damage == "flip_data":
        _flip(data)
        return f"{data.name} fails its sha256 checksum"
    if damage == "truncate_data":
        size = data.stat().st_size
        data.write_bytes(data.read_bytes()[:size // 2])
        return f"{data.name} is truncated ({size // 2:,} of {size:,} bytes)"
    if damage == "empty_data":
        size = data.stat().st_size
        data.write_bytes(b"")
        return f"{data.name} is truncated (0 of {size:,} bytes)"
    if damage == "delete_data":
        data.unlink()
        return f"{data.name} is missing"
    if damage == "delete_metadata":
        meta.unlink()
        return ".metadata is missing"
    if damage == "garbage_metadata":
        meta.write_bytes(os.urandom(meta.stat().st_size))
        return ".metadata fails its sha256 checksum"
    if damage == "delete_manifest":
        manifest.unlink()
        return "manifest.json is missing (its pipecast.json says the save wrote one)"
    if damage == "garbage_manifest":
        manifest.write_text("{not json")
        return "manifest.json is unreadable"
    raise ValueError(damage)


DAMAGES = ["flip_data", "truncate_data", "empty_data", "delete_data", "delete_metadata", "garbage_metadata",
           "delete_manifest", "garbage_manifest"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_broken_checkpoint_is_refused_in_one_line_and_resume_falls_back(tmp_path, damage):
    """Issue 36: bytes flipped inside a ``.distcp`` file loaded silently; a missing ``.metadata`` was skipped
    silently; a truncated file stopped the job with a traceback.  Now every kind is refused by a load, in one line
    naming the checkpoint, the file and what is wrong -- before any tensor is read -- and a resume falls back to the
    newest intact checkpoint, naming the broken one in a warning."""
    older = _saved(tmp_path, step=2)
    path = _saved(tmp_path, step=3)
    said = _damage(path, damage)
    target = _empty()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(target, path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"checkpoint {str(path)!r} is broken: {said}"), message
    assert _equal(target, _empty()), "a broken checkpoint was (partly) loaded"
    chosen, skipped = checkpoint_to_load(tmp_path)
    assert chosen == older
    assert skipped == [f"checkpoint {path} is broken: {message.split(' is broken: ')[1].split('; ')[0]}; skipped it, "
                       f"resuming from {older}"]
    with pytest.raises(CheckpointError, match="is broken: " + re.escape(said)):
        checkpoint_to_load(tmp_path, step=3)  # checkpoint.load_step names it: refused, no fallback
    assert checkpoint_to_load(tmp_path, step=2) == (older, [])
    loaded = _empty()
    load_checkpoint(loaded, older)
    assert _equal(loaded, _state(2))


def test_the_manifest_covers_every_file_of_every_layout(tmp_path, monkeypatch):
    """The manifest lists every file of the folder with its size and SHA-256 (checked here with hashlib directly),
    whatever DCP's file layout: one file per rank, or one file per tensor (``single_file_per_rank=False``)."""
    from engine.training.checkpoint import dcp as ckpt_dcp
    real = ckpt_dcp._recording_writer

    def one_file_per_tensor(path):
        writer = real(path)
        writer.single_file_per_rank = False
        return writer
    for layout, patch in (("per rank", None), ("per tensor", one_file_per_tensor)):
        if patch is not None:
            monkeypatch.setattr(ckpt_dcp, "_recording_writer", patch)
        path = save_checkpoint(_state(5), tmp_path / layout.replace(" ", "_"), step=5,
                               extra_files={"tokenizer.json": "{}"})
        manifest = json.loads((path / "manifest.json").read_text())
        on_disk = {f.name for f in path.iterdir()} - {"manifest.json"}
        assert set(manifest["files"]) == on_disk, layout
        assert {".metadata", "pipecast.json", "tokenizer.json"} <= on_disk
        distcp = [n for n in on_disk if n.endswith(".distcp")]
        assert len(distcp) == (1 if patch is None else 3), (layout, distcp)  # w, b, step: one file each
        for name, entry in manifest["files"].items():
            blob = (path / name).read_bytes()
            assert entry == {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}, (layout, name)
        for name in distcp:  # every payload file is checked, not only the first
            copy = tmp_path / f"copy_{layout[-4:]}_{name}"
            shutil.copytree(path, copy)
            _flip(copy / name, at=0.9)
            with pytest.raises(CheckpointError, match=re.escape(f"{name} fails its sha256 checksum")):
                load_checkpoint(_empty(), copy)


def test_checkpoints_without_a_manifest_from_earlier_versions_load_with_a_warning(tmp_path, caplog):
    """A checkpoint written before checksums (no manifest, a pipecast.json that names none) still loads: it is
    marked unverified in a warning."""
    path = _saved(tmp_path)
    (path / "manifest.json").unlink()
    meta = json.loads((path / "pipecast.json").read_text())
    del meta["manifest"]
    (path / "pipecast.json").write_text(json.dumps(meta))
    loaded = _empty()
    with caplog.at_level(logging.WARNING, logger="pipecast"):
        load_checkpoint(loaded, path)
    assert _equal(loaded, _state(3))
    assert any("loading it unverified" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    (path / ".metadata").unlink()  # still: without DCP's index it is broken
    with pytest.raises(CheckpointError, match="has no .metadata"):
        load_checkpoint(_empty(), path)


def test_broken_checkpoints_count_towards_keep_and_are_removed_by_age(tmp_path):
    """Issue 36: a checkpoint without ``.metadata`` was neither removed nor counted.  Every ``step_*`` folder now
    counts towards ``checkpoint.keep`` and the oldest go first, broken or not; a fresh run refuses the folder."""
    from engine.training.config import ConfigError, check_fresh_run, load_config
    for step in (1, 2):
        save_checkpoint(_state(step), tmp_path, step=step, keep=2)
    (tmp_path / "step_00000002" / ".metadata").unlink()
    save_checkpoint(_state(3), tmp_path, step=3, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    save_checkpoint(_state(4), tmp_path, step=4, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    only_broken = tmp_path / "other"
    save_checkpoint(_state(1), only_broken, step=1)
    (only_broken / "step_00000001" / ".metadata").unlink()
    config = load_config(None, {"logging.run_dir": str(tmp_path / "run"), "checkpoint.dir": str(only_broken)})
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        check_fresh_run(config, resume=False)
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .*step_00000001, is broken: \.metadata"):
        checkpoint_to_load(only_broken)


def test_load_step_picks_a_checkpoint_and_names_the_ones_there(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(_state(step), tmp_path, step=step, keep=3)
    path, skipped = checkpoint_to_load(tmp_path, step=2)
    assert path.name == "step_00000002" and skipped == []
    with pytest.raises(CheckpointError, match=r"load_step=7: .* no checkpoint of step 7 \(its steps: 1, 2, 3\)"):
        checkpoint_to_load(tmp_path, step=7)
    assert checkpoint_to_load(tmp_path / "none") == (None, [])


def test_incomplete_and_foreign_checkpoints(tmp_path):
    path = _saved(tmp_path)
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        checkpoint_keys(path)
    other = save_checkpoint(_state(4), tmp_path / "other", step=4)
    foreign = {"model": {"w": torch.zeros(4, 3), "extra": torch.zeros(2)}, "trainer": {"step": torch.tensor(0)}}
    with pytest.raises(CheckpointError, match="another model"):
        load_checkpoint(foreign, other)
    wrong_shape = {"model": {"w": torch.zeros(5, 3), "b": torch.zeros(3)}, "trainer": {"step": torch.tensor(0)}}
    with pytest.raises(CheckpointError):
        load_checkpoint(wrong_shape, other)


class _RunsCode:
    """A pickle payload that would create ``marker`` when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_crafted_metadata_cannot_run_code(tmp_path):
    marker = tmp_path / "pwned"
    path = _saved(tmp_path / "ckpts")
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointError):
        checkpoint_keys(path)
    with pytest.raises(CheckpointError):
        load_checkpoint(_empty(), path)
    assert not marker.exists(), "loading a checkpoint executed code from its metadata"


def test_checkpoint_cannot_make_the_loader_unpickle_objects(tmp_path):
    """Metadata that declares a key as a pickled object (DCP ``BytesStorageMetadata``) would make DCP unpickle that
    file entry with ``weights_only=False``; such checkpoints are rejected."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    marker = tmp_path / "pwned"
    path = tmp_path / "evil"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": _RunsCode(marker)}}, checkpoint_id=str(path))  # stored as a pickled object
    assert any(isinstance(m, BytesStorageMetadata)
               for m in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.values())
    assert not marker.exists()
    with pytest.raises(CheckpointError):
        load_checkpoint({"model": {"w": torch.zeros(4, 3)}}, path)
    assert not marker.exists(), "loading a checkpoint unpickled a stored object"
