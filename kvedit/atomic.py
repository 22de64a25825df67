"""The one atomic writer behind every file kvedit writes.

A file is written under a temporary name in its own directory, flushed to disk (``fsync``),
renamed onto its final name (``os.replace``, atomic on POSIX), and the directory is flushed
too, so that a reader sees the old file or the complete new one, never a part, and the rename
survives a power cut. On any failure, the temporary file is removed before the error is raised.
A path that is a symbolic link is written through: the file it leads to is replaced (the
temporary file made in that file's directory), and the link stays a link (:func:`final_path`).

Temporary names all look like ``.NAME.kvedit-tmp-<pid>@<host>-<16 hex digits>``
(:func:`is_temp_name`): the writer's process id, and a tag of the machine (and process-id
namespace) it ran on, so that what a killed writer left behind is recognisable and safe to
delete: :func:`sweep_stale` removes at once those of a process no longer running on this
machine, never a running one's; :class:`~kvedit.KVStore` removes such leftovers when it opens
and when it scans. When the data is produced by a callback that writes a file itself
(``atomic_write(path, lambda tmp: save_file(..., tmp))``), the temporary name is a *directory*
holding the callback's file, so whatever the callback's own library leaves next to its output
(safetensors writes ``.tmpXXXXXX`` beside the file and renames it) stays inside kvedit's
temporary directory and goes away with it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from .errors import InvalidInputError, InvalidTypeError, StorageError

STALE_TEMP_SECONDS = 3600.0
"""A temporary file older than this is a leftover whoever wrote it (no write takes an hour),
unless it names a writer still running on this machine."""

TEMP_MARKER = ".kvedit-tmp-"
"""What every temporary name kvedit writes contains (after a leading dot and the final name)."""

Data = bytes | bytearray | memoryview | str
Writer = Callable[[str], object]

__all__ = [
    "TEMP_MARKER",
    "atomic_directory",
    "atomic_write",
    "check_path",
    "final_path",
    "host_tag",
    "is_temp_name",
    "left_by_dead_writer",
    "remove_temp",
    "sweep_leftovers",
    "sweep_stale",
    "temp_name",
]

# the tail of a temporary name after TEMP_MARKER: pid, the host tag (kvedit 0.2.x wrote none)
_TAIL = re.compile(r"(\d+)(?:@([0-9a-f]{8}))?-[0-9a-f]{16}")
# a process that started this long after a leftover was last written did not write it
_START_SLACK_SECONDS = 2.0


def temp_name(path: str | os.PathLike) -> Path:
    """A fresh temporary path next to ``path``: ``.NAME.kvedit-tmp-<pid>@<host>-<16 hex>``
    (the writer's process id and :func:`host_tag` let :func:`sweep_stale` tell a dead writer's
    leftover)."""
    path = Path(path)
    tail = f"{os.getpid()}@{host_tag()}-{secrets.token_hex(8)}"
    return path.with_name(f".{path.name}{TEMP_MARKER}{tail}")


@functools.lru_cache(maxsize=1)
def host_tag() -> str:
    """8 hex digits naming this machine and its process-id namespace (a container has its
    own): a process id means something only where the tag is the same."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]


def _started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), where ``/proc`` says (Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _running(pid: int, since: float | None) -> bool:
    """Whether process ``pid`` runs on this machine and, with ``since``, may have been the
    writer of a file last written then (a process that started after it is another one, the
    id reused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        pass
    started = None if since is None else _started(pid)
    return started is None or started <= since + _START_SLACK_SECONDS


def _dead_writer(name: str, mtime: float, legacy_age: float | None) -> bool:
    """Whether the temporary ``name`` (last written at ``mtime``) is a leftover of a writer no
    longer running: one of this machine's (:func:`host_tag`); with ``legacy_age``, also one
    without a tag (kvedit 0.2.x) over a minute old, its process id taken as this machine's."""
    match = _TAIL.fullmatch(name.rpartition(TEMP_MARKER)[2])
    if match is None:
        return False
    pid, tag = int(match.group(1)), match.group(2)
    if tag is None:
        return legacy_age is not None and legacy_age > 60 and not _running(pid, None)
    return tag == host_tag() and not _running(pid, mtime)


def left_by_dead_writer(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a temporary file or directory (:func:`temp_name`) that a process of
    this machine, no longer running, was writing: safe to delete whatever else is going on."""
    path = Path(path)
    if not is_temp_name(path.name):
        return False
    try:
        mtime = path.lstat().st_mtime
    except OSError:
        return False
    return _dead_writer(path.name, mtime, None)


def sweep_stale(path: str | os.PathLike, stale_seconds: float = STALE_TEMP_SECONDS) -> int:
    """Remove what killed writers of ``path`` left next to it (``.NAME.kvedit-tmp-*``; for a
    symbolic link, next to the file it leads to, where the writes went).

    Removed: at once, a leftover of a process of this machine that no longer runs (or whose
    process id now belongs to a process started after it was written); never one of a
    running writer of this machine. A leftover of another machine sharing the folder (its
    process id means nothing here) or of a kvedit that wrote no machine tag goes once it is
    older than ``stale_seconds`` (an untagged one also when over a minute old and its process
    id runs nothing here). Returns how many were removed; never raises.
    """
    try:
        path = final_path(Path(path))
    except (InvalidInputError, OSError, RuntimeError):
        return 0
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
            mtime = leftover.lstat().st_mtime
        except OSError:
            continue
        age = now - mtime
        match = _TAIL.fullmatch(name.rpartition(TEMP_MARKER)[2])
        mine = match is not None and match.group(2) == host_tag()
        if _dead_writer(name, mtime, age) or (age > stale_seconds and not mine):
            remove_temp(leftover)
            removed += 1
    return removed


sweep_leftovers = sweep_stale
"""The former name of :func:`sweep_stale`."""


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


def final_path(path: Path) -> Path:
    """The file a write to ``path`` replaces: ``path`` itself, or for a symbolic link the file
    it leads to (through every link; it may not exist yet), so the link is kept.

    Raises:
        InvalidInputError: ``path`` is a link that loops.
    """
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path))
    if target.is_symlink():  # realpath stops where a loop begins
        raise InvalidInputError(f"cannot write {path}: it is a symbolic link that loops")
    return target


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
        path: the file to write (its directory is created if missing); a symbolic link is
            written through (:func:`final_path`): the file it leads to is replaced.
        data: ``bytes`` (or a buffer), ``str`` (written as UTF-8), an iterable of ``bytes``
            chunks, or a callable ``write(tmp_path)`` that writes the whole file at
            ``tmp_path`` itself (it runs inside a temporary directory of kvedit's).

    Raises:
        InvalidInputError: ``path`` is empty or a directory (:func:`check_path`), or a link
            that loops.
        StorageError: the file could not be written (an ``OSError`` too: disk full, permission
            denied...), also when a ``write`` callback raised the ``OSError``; other errors of
            a callback propagate unchanged. Either way no temporary file is left and an
            existing file at ``path`` is untouched.
    """
    path = check_path(path)
    target = final_path(path)
    parent = _parent(target)
    tmp = temp_name(target)
    try:
        if callable(data):
            tmp.mkdir()
            inner = tmp / target.name
            data(str(inner))
            if not inner.is_file():
                raise StorageError(f"cannot write {path}: the writer produced no file")
            _fsync_file(inner)
            os.replace(inner, target)
        else:
            _write_bytes(tmp, data)
            os.replace(tmp, target)
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
    given = Path(path)
    path = final_path(given)
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
    return given
