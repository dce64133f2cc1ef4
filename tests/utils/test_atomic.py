"""Atomic writes: the usual file modes, errors that name the target, a set of files written as one."""

from __future__ import annotations

import os
import stat
import sys

import numpy as np
import pytest

from onnxtrain.ondevice import checkpoint as ckpt
from onnxtrain.utils.atomic import FileSetExistsError, atomic_file_set, write_bytes_atomic

posix_only = pytest.mark.skipif(sys.platform == "win32", reason="POSIX file modes")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@posix_only
def test_new_file_gets_0666_minus_umask(tmp_path, umask_022):
    write_bytes_atomic(b"x", tmp_path / "a.bin")
    assert _mode(tmp_path / "a.bin") == 0o644
    data = ckpt.CheckpointData(parameters={"w": np.ones(3, np.float32)}, requires_grad={"w": True})
    ckpt.save(data, tmp_path / "checkpoint")
    assert _mode(tmp_path / "checkpoint") == 0o644


@posix_only
def test_other_umask_is_followed(tmp_path):
    old = os.umask(0o077)
    try:
        write_bytes_atomic(b"x", tmp_path / "a.bin")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a.bin") == 0o600


@posix_only
def test_replaced_file_keeps_its_mode(tmp_path, umask_022):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    write_bytes_atomic(b"new", path)
    assert path.read_bytes() == b"new"
    assert _mode(path) == 0o640


def test_failed_write_names_the_target(tmp_path):
    (tmp_path / "file").write_bytes(b"")  # a file where the target's folder should be
    with pytest.raises(OSError) as info:
        write_bytes_atomic(b"x", tmp_path / "file" / "target.bin")
    assert info.value.filename == str(tmp_path / "file" / "target.bin")
    assert ".tmp" not in str(info.value)


def test_failed_write_inside_names_the_target_not_the_temporary_file(tmp_path):
    path = tmp_path / "target.bin"
    from onnxtrain.utils.atomic import atomic_path

    with pytest.raises(OSError) as info, atomic_path(path) as tmp:
        raise OSError(28, "No space left on device", str(tmp))  # what a full disk raises mid-write
    assert info.value.filename == str(path) and "target.bin" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_file_set_refuses_a_folder_holding_members(tmp_path):
    (tmp_path / "b").write_bytes(b"old")
    with pytest.raises(FileSetExistsError, match=r"already holds files \(b\).*overwrite=True"):
        with atomic_file_set(tmp_path, ["a", "b"]):
            pytest.fail("the body must not run")
    assert (tmp_path / "b").read_bytes() == b"old"


@posix_only
def test_file_set_replaces_the_whole_generation(tmp_path, umask_022):
    for name in ("a", "stale", "b"):
        (tmp_path / name).write_bytes(b"old")
    os.chmod(tmp_path / "b", 0o600)
    (tmp_path / "user.txt").write_bytes(b"mine")
    with atomic_file_set(tmp_path, ["a", "stale", "b"], overwrite=True) as staging:
        (staging / "a").write_bytes(b"new")
        (staging / "b").write_bytes(b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "user.txt"]  # no staging, no backup left
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == b"new"
    assert _mode(tmp_path / "b") == 0o600 and _mode(tmp_path / "a") == 0o644


def test_file_set_failure_midway_keeps_the_old_generation(tmp_path, monkeypatch):
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"old")
    real_replace = os.replace

    def failing_replace(src, dst):  # the second file of the new set cannot be moved in
        if str(dst) == str(tmp_path / "b") and ".new-" in str(src):
            raise OSError(5, "Input/output error", str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="b"):
        with atomic_file_set(tmp_path, ["a", "b"], overwrite=True) as staging:
            (staging / "a").write_bytes(b"new")
            (staging / "b").write_bytes(b"new")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == b"old"


def test_file_set_crash_midway_never_shows_a_mix(tmp_path, monkeypatch):
    """A crash (the process killed) during the swap: the folder shows only new files, the old set is kept."""
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"old")
    real_replace, calls = os.replace, []

    class Killed(BaseException):
        pass

    def dying_replace(src, dst):
        calls.append(dst)
        if str(dst) == str(tmp_path / "b") and ".new-" in str(src):
            raise Killed  # no clean-up runs after a kill; BaseException skips the roll-back below
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dying_replace)
    monkeypatch.setattr("shutil.rmtree", lambda *a, **k: None)  # a killed process deletes nothing
    with pytest.raises(Killed):
        with atomic_file_set(tmp_path, ["a", "b"], overwrite=True) as staging:
            (staging / "a").write_bytes(b"new")
            (staging / "b").write_bytes(b"new")
    monkeypatch.undo()
    visible = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert visible == {"a": b"new"}  # the checkpoint-like last member is missing: not loadable, not mixed
    backups = [p for p in tmp_path.iterdir() if p.is_dir() and ".old-" in p.name]
    assert len(backups) == 1 and {p.name: p.read_bytes() for p in backups[0].iterdir()} == {"a": b"old", "b": b"old"}
