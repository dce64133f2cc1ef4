"""Atomic file writes, standard library only (the torch-free on-device runtime uses them too).

A file is written to a temporary file beside it, fsynced and renamed over it, so a reader never sees half
a file. It gets the mode a plain ``open(path, "w")`` would give (0666 minus the umask), or, when it
replaces a file, that file's mode. An error names the file being written, never the temporary file.

:func:`atomic_file_set` writes several files as one generation (the on-device artifacts).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    with _UMASK_LOCK:  # the standard library cannot read the umask without setting it: set it back at once
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def mode_for(path: Path) -> int:
    """The mode of the file at ``path`` if there is one, else 0666 minus the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def error_naming(exc: OSError, path: Path, tmp: Path | str | None = None) -> OSError:
    """``exc`` again, naming ``path`` instead of the temporary file (or folder) it was raised for."""
    if exc.errno is None or (tmp is not None and exc.filename is not None and str(exc.filename) != str(tmp)):
        return exc
    return type(exc)(exc.errno, f"{exc.strerror} (writing {path})", str(path))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it over ``path``.

    A crash or an exception leaves ``path`` as it was: readers never see a half-written file. The new
    file gets the mode of the file it replaces, or 0666 minus the umask.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise error_naming(exc, path) from exc
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode_for(path))
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise error_naming(exc, path, tmp) from exc
        raise


def write_bytes_atomic(data: bytes, path: str | os.PathLike) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(data)


class FileSetExistsError(FileExistsError):
    """The folder already holds files of the set, and overwriting was not asked for."""


def existing_members(directory: str | os.PathLike, names: Sequence[str]) -> list[str]:
    """Which of ``names`` (and their ``.data`` external-data files) exist in ``directory``."""
    directory = Path(directory)
    return [n for name in names for n in (name, name + ".data") if (directory / n).exists()]


def refuse_existing(directory: str | os.PathLike, names: Sequence[str], what: str = "files",
                    hint: str = "pass overwrite=True") -> None:
    """Raise :class:`FileSetExistsError` if ``directory`` holds any of ``names``."""
    present = existing_members(directory, names)
    if present:
        raise FileSetExistsError(f"{directory} already holds {what} ({', '.join(present)}); "
                                 f"{hint} to replace them, or choose another folder")


@contextlib.contextmanager
def atomic_file_set(directory: str | os.PathLike, names: Sequence[str], *, overwrite: bool = False,
                    what: str = "files", hint: str = "pass overwrite=True") -> Iterator[Path]:
    """Write the files ``names`` in ``directory`` as one generation; yield the folder to write them in.

    The caller writes the new files into a staging folder inside ``directory``. On success, the files of
    the previous generation (every one of ``names`` that exists, and its ``.data`` file, also the ones the
    new generation does not write) are moved into a backup folder, the new files are moved into place in
    the order of ``names`` (so the last name, e.g. the checkpoint, appears last), and the backup is deleted.
    A replaced file's mode carries over. What a crash leaves: before the swap, the old set untouched; during
    it, only files of the new set in ``directory`` (the last name missing until the end) and the whole old
    set in the hidden ``.<first name>.old-*`` folder; never a mix of the two. Other files in ``directory``
    are left alone. Without ``overwrite``, a folder that holds any of ``names`` is refused before writing.
    """
    directory = Path(directory)
    if not overwrite:
        refuse_existing(directory, names, what, hint)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{names[0]}.new-", dir=directory))
    except OSError as exc:
        raise error_naming(exc, directory) from exc
    try:
        yield staging
        written = {p.name for p in staging.iterdir()}
        unknown = written - {n for name in names for n in (name, name + ".data")}
        if unknown:
            raise ValueError(f"files {sorted(unknown)} are not members of the set {list(names)}")
        order = [n for name in names for n in (name + ".data", name) if n in written]
        _swap(directory, staging, order, existing_members(directory, names))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap(directory: Path, staging: Path, order: list[str], old: list[str]) -> None:
    modes = {n: stat.S_IMODE(os.stat(directory / n).st_mode) for n in order if n in old}
    backup = Path(tempfile.mkdtemp(prefix=f".{order[-1]}.old-", dir=directory)) if old else None
    moved_old, moved_new, current = [], [], old[-1] if old else order[0]
    try:
        for current in reversed(old):  # the last member (the checkpoint) leaves first
            os.replace(directory / current, backup / current)
            moved_old.append(current)
        for current in order:
            if current in modes:
                os.chmod(staging / current, modes[current])
            os.replace(staging / current, directory / current)
            moved_new.append(current)
    except OSError as exc:  # put the old generation back
        for name in reversed(moved_new):
            with contextlib.suppress(OSError):
                os.replace(directory / name, staging / name)
        for name in reversed(moved_old):
            with contextlib.suppress(OSError):
                os.replace(backup / name, directory / name)
        raise error_naming(exc, directory / current) from exc
    finally:
        if backup is not None and len(moved_new) == len(order):
            shutil.rmtree(backup, ignore_errors=True)
        elif backup is not None and not os.listdir(backup):
            backup.rmdir()
