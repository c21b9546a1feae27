"""``engine.training.files``: all-or-nothing writes whose failure is one line naming the file and the operating
system's reason (issue 26: a read-only export hid the real error behind a second ``OSError`` on the ``.tmp``
file; safetensors reports a full disk as ``SafetensorError``)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from engine.training.files import WriteError, make_folder, os_error_of, write_atomically


def _enospc(path):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what write() on a full disk raises: no file name


def test_a_full_disk_names_the_file_and_the_reason_and_leaves_nothing(tmp_path):
    first, second = tmp_path / "m.safetensors", tmp_path / "m.config.json"
    with pytest.raises(WriteError) as info:
        write_atomically([(first, lambda p: p.write_text("tensors")), (second, _enospc)])
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"cannot write {str(second)!r}: No space left on device"), message
    assert f".{second.name}.tmp" in message and "free space there or choose another --out" in message, message
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert sorted(tmp_path.iterdir()) == []  # neither the first file nor any temporary


def test_a_read_only_folder_reports_the_first_error_not_the_cleanup(tmp_path, monkeypatch):
    """On a read-only file system the temporary's removal fails too; the error raised is the write's."""
    def read_only(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def unlink(self, missing_ok=False):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(WriteError, match=r"cannot write '.*m\.json': Read-only file system \(.*\.m\.json\.tmp\); "
                                         r"choose another --out \(a folder you can write\)"):
        write_atomically([(tmp_path / "m.json", read_only)])
    monkeypatch.setattr(Path, "mkdir", lambda self, **kw: read_only(self))
    with pytest.raises(WriteError, match=r"cannot create folder '.*hf': Read-only file system; choose another "
                                         r"--out"):
        make_folder(tmp_path / "hf")


def test_safetensors_errors_carry_their_errno(tmp_path):
    """safetensors' writer raises ``SafetensorError`` with Rust's ``(os error N)``: read back as that OSError."""
    from safetensors.torch import save_file
    target = tmp_path / "gone" / "m.safetensors"  # safetensors writes a temporary in the missing folder
    with pytest.raises(WriteError) as info:
        write_atomically([(target, lambda p: save_file({"w": torch.ones(2)}, str(p)))])
    assert info.value.errno == errno.ENOENT and "No such file or directory" in str(info.value), str(info.value)


def test_programming_errors_are_not_turned_into_write_errors(tmp_path):
    def bug(path):
        raise TypeError("a bug, not the disk")
    with pytest.raises(TypeError, match="a bug"):
        write_atomically([(tmp_path / "x", bug)])
    assert os_error_of(KeyError("k")) is None and os_error_of(RuntimeError("os error 28")) is None
    assert list(tmp_path.iterdir()) == []
