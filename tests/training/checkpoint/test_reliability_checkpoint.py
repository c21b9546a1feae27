"""Checkpoints under failure, in one process (no process group: DCP's single-process mode):

* atomic save: a save that dies while writing leaves only a ``.tmp`` folder; the previous checkpoint stays the latest
  and loads bitwise; the next save of that step succeeds;
* corrupt / truncated / incomplete / foreign checkpoints raise ``CheckpointError`` with a message that names the
  folder and the fix -- never a hang, never garbage weights;
* untrusted files: a crafted ``.metadata`` pickle cannot run code, and a checkpoint cannot make the loader unpickle a
  stored object (only tensors are read, with ``weights_only=True``).
"""
from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from engine.training.checkpoint.dcp import (CheckpointError, checkpoint_keys, latest_checkpoint, list_checkpoints,
                                        load_checkpoint, save_checkpoint)

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


def _saved(tmp_path) -> Path:
    return save_checkpoint(_state(3), tmp_path, step=3)


@pytest.mark.parametrize("damage", ["truncate_data", "empty_data", "delete_data", "garbage_metadata",
                                    "truncate_metadata"])
def test_corrupt_checkpoint_is_a_clear_error(tmp_path, damage):
    path = _saved(tmp_path)
    data = sorted(path.glob("*.distcp"))[0]
    meta = path / ".metadata"
    if damage == "truncate_data":
        data.write_bytes(data.read_bytes()[:len(data.read_bytes()) // 2])
    elif damage == "empty_data":
        data.write_bytes(b"")
    elif damage == "delete_data":
        data.unlink()
    elif damage == "garbage_metadata":
        meta.write_bytes(os.urandom(300))
    else:
        meta.write_bytes(meta.read_bytes()[:40])
    target = _empty()
    with pytest.raises(CheckpointError) as info:
        if "metadata" in damage:
            checkpoint_keys(path)
        load_checkpoint(target, path)
    message = str(info.value)
    assert str(path) in message and ("delete it" in message or "older one" in message), message
    if "metadata" in damage:  # load_checkpoint on its own reports it too
        with pytest.raises(CheckpointError):
            load_checkpoint(_empty(), path)


def test_incomplete_and_foreign_checkpoints(tmp_path):
    path = _saved(tmp_path)
    (path / ".metadata").unlink()
    assert latest_checkpoint(tmp_path) is None  # never picked for --resume
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
