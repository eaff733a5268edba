"""Files written all or nothing, and durably: the file fsynced before its
rename, its directory after it."""

from __future__ import annotations

import os
import stat

import pytest

from tiered import files


@pytest.fixture
def synced(monkeypatch):
    """What os.fsync was called on, in order: ('file', path) or ('dir', path)."""
    calls: list[tuple[str, str]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        calls.append((kind, os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_write_atomically_fsyncs_the_file_then_its_directory(tmp_path, synced, monkeypatch):
    renamed: list[str] = []
    real_replace = os.replace

    def replace(source, target):
        renamed.append(f"after {len(synced)} fsync(s)")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "routing.yaml"
    files.write_atomically(target, "version: 1\n", mode=0o640)
    assert target.read_text() == "version: 1\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    (kind, written), directory = synced
    assert kind == "file" and os.path.dirname(written) == str(tmp_path)
    assert os.path.basename(written).startswith(".routing.yaml.")  # the temporary, before
    assert renamed == ["after 1 fsync(s)"]  # the rename, between the two
    assert directory == ("dir", str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["routing.yaml"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    target.write_text("old")

    def fail(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="Input/output error"):
        files.write_atomically(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
