"""The one atomic writer behind every file kvedit writes.

A file is written under a temporary name in its own directory, flushed to disk (``fsync``),
renamed onto its final name (``os.replace``, atomic on POSIX), and the directory is flushed
too, so that a reader sees the old file or the complete new one, never a part, and the rename
survives a power cut. On any failure, the temporary file is removed before the error is raised.

Temporary names all look like ``.NAME.kvedit-tmp-<16 hex digits>`` (:func:`is_temp_name`), so
what a killed writer leaves behind is recognisable and safe to delete:
:class:`~kvedit.KVStore` removes such leftovers when it opens. When the data is produced by a
callback that writes a file itself (``atomic_write(path, lambda tmp: save_file(..., tmp))``),
the temporary name is a *directory* holding the callback's file, so whatever the callback's own
library leaves next to its output (safetensors writes ``.tmpXXXXXX`` beside the file and renames
it) stays inside kvedit's temporary directory and goes away with it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from .errors import InvalidInputError, InvalidTypeError, StorageError

STALE_TEMP_SECONDS = 3600.0
"""A temporary file older than this is a leftover whoever wrote it (no write takes an hour)."""

TEMP_MARKER = ".kvedit-tmp-"
"""What every temporary name kvedit writes contains (after a leading dot and the final name)."""

Data = bytes | bytearray | memoryview | str
Writer = Callable[[str], object]

__all__ = [
    "TEMP_MARKER",
    "atomic_directory",
    "atomic_write",
    "check_path",
    "is_temp_name",
    "remove_temp",
    "sweep_leftovers",
    "temp_name",
]


def temp_name(path: str | os.PathLike) -> Path:
    """A fresh temporary path next to ``path``: ``.NAME.kvedit-tmp-<pid>-<16 hex digits>``
    (the writer's process id lets :func:`sweep_leftovers` tell a dead writer's leftover)."""
    path = Path(path)
    return path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(8)}")


def _writer_alive(name: str) -> bool | None:
    """Whether the process that made temporary name ``name`` is alive on this machine (None:
    the name records no process id)."""
    tail = name.rpartition(TEMP_MARKER)[2]
    pid, sep, _ = tail.partition("-")
    if not sep or not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def sweep_leftovers(path: str | os.PathLike, stale_seconds: float = STALE_TEMP_SECONDS) -> int:
    """Remove what killed writers of ``path`` left next to it (``.NAME.kvedit-tmp-*``): those
    whose writer is no longer alive and that are over a minute old (a writer on another machine
    sharing the folder has a process id that means nothing here), and any older than
    ``stale_seconds``. Returns how many were removed; never raises."""
    path = Path(path)
    prefix = f".{path.name}{TEMP_MARKER}"
    removed = 0
    now = time.time()
    try:
        names = [n for n in os.listdir(path.parent or ".") if n.startswith(prefix)]
    except OSError:
        return 0
    for name in names:
        leftover = path.with_name(name)
        try:
            age = now - leftover.lstat().st_mtime
        except OSError:
            continue
        if age > stale_seconds or (age > 60 and _writer_alive(name) is False):
            remove_temp(leftover)
            removed += 1
    return removed


def is_temp_name(name: str) -> bool:
    """Whether a file name (not a path) is a temporary name made by :func:`temp_name`."""
    return name.startswith(".") and TEMP_MARKER in name


def check_path(path: object, what: str = "path") -> Path:
    """``path`` as a :class:`~pathlib.Path` that a file can be written to, or a clear error.

    Raises:
        InvalidTypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        InvalidInputError: ``path`` is empty, ends with a separator, or is an existing directory.
    """
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidTypeError(f"{what} must be a str or os.PathLike, not {type(path).__name__}")
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise InvalidInputError(f"{what} is empty: give a file name to write to")
    out = Path(text)
    if text.endswith(("/", os.sep)) or out.name in ("", ".", "..") or out.is_dir():
        raise InvalidInputError(f"{what} {text!r} is a directory, not a file name")
    return out


def _storage_error(path: Path, error: OSError) -> StorageError:
    """A StorageError saying which file could not be written, with the error's errno."""
    if error.errno is None:
        return StorageError(f"cannot write {path}: {error}")
    return StorageError(error.errno, f"cannot write {path}: {error.strerror}")


def _fsync_dir(folder: Path) -> None:
    """Flush a directory's entries (the rename) to disk, where the platform allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory: nothing more to do
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temp(path: Path) -> None:
    """Remove a temporary file or directory, whatever is there; never raises."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _parent(path: Path) -> Path:
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:
        raise InvalidInputError(f"cannot write {path}: {parent} is a file, not a directory") from e
    except OSError as e:
        raise _storage_error(path, e) from e
    return parent


def _write_bytes(tmp: Path, data: Data | Iterable[bytes]) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    with os.fdopen(fd, "wb") as f:
        if isinstance(data, str):
            f.write(data.encode("utf-8"))
        elif isinstance(data, (bytes, bytearray, memoryview)):
            f.write(data)
        else:
            for chunk in data:
                f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: str | os.PathLike, data: Data | Iterable[bytes] | Writer) -> Path:
    """Write ``data`` to ``path`` atomically and durably; returns ``path`` as a Path.

    Args:
        path: the file to write (its directory is created if missing).
        data: ``bytes`` (or a buffer), ``str`` (written as UTF-8), an iterable of ``bytes``
            chunks, or a callable ``write(tmp_path)`` that writes the whole file at
            ``tmp_path`` itself (it runs inside a temporary directory of kvedit's).

    Raises:
        InvalidInputError: ``path`` is empty or a directory (:func:`check_path`).
        StorageError: the file could not be written (an ``OSError`` too: disk full, permission
            denied...), also when a ``write`` callback raised the ``OSError``; other errors of
            a callback propagate unchanged. Either way no temporary file is left and an
            existing file at ``path`` is untouched.
    """
    path = check_path(path)
    parent = _parent(path)
    tmp = temp_name(path)
    try:
        if callable(data):
            tmp.mkdir()
            inner = tmp / path.name
            data(str(inner))
            if not inner.is_file():
                raise StorageError(f"cannot write {path}: the writer produced no file")
            _fsync_file(inner)
            os.replace(inner, path)
        else:
            _write_bytes(tmp, data)
            os.replace(tmp, path)
    except OSError as e:
        remove_temp(tmp)
        if isinstance(e, StorageError):
            raise
        raise _storage_error(path, e) from e
    except BaseException:
        remove_temp(tmp)
        raise
    remove_temp(tmp)  # the (now empty, or holding a callback's leftovers) temporary directory
    _fsync_dir(parent)
    return path


def atomic_directory(path: str | os.PathLike, fill: Callable[[Path], object]) -> Path:
    """Create the directory ``path`` atomically: ``fill(tmp_dir)`` writes its files into a
    temporary directory next to it, which is flushed and renamed onto ``path``.

    If ``path`` appeared meanwhile (another process won the race), the temporary directory is
    removed and the existing one kept. On any failure nothing is left behind.
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InvalidInputError(f"not a directory path: {path!r}")
    path = Path(path)
    parent = _parent(path)
    tmp = temp_name(path)
    try:
        tmp.mkdir()
        fill(tmp)
        for root, _, files in os.walk(tmp):
            for name in files:
                _fsync_file(Path(root) / name)
        try:
            os.replace(tmp, path)
        except OSError:
            if not path.is_dir():
                raise
    except OSError as e:
        remove_temp(tmp)
        raise _storage_error(path, e) from e
    except BaseException:
        remove_temp(tmp)
        raise
    remove_temp(tmp)
    _fsync_dir(parent)
    return path
