"""File locks: the store's write lock, and the one-writer lock of a file that names its holder.

:class:`StoreLock` is the store's write lock, ``root/.lock``, held by every writer (put, evict,
pin, recovery). It is a :class:`filelock.FileLock` (an ``fcntl.flock`` on POSIX, released by the
kernel when its holder dies, so a killed writer never leaves the store locked): exclusive across
processes and across threads (each thread takes it through its own file descriptor), and
re-entrant within a thread. A writer that cannot take it within ``timeout`` seconds gets
:class:`~kvedit.errors.StoreLockTimeout` (``timeout=0``: one try). The lock file stays in place
when released. A ``StoreLock`` inherited by a forked child takes a lock of its own there.

:class:`WriterLock` is one writer's claim on a file or folder for as long as it works on it
(``kvedit chat`` on its ``--memory``, ``kvedit eval memory`` on its ``--out``): an
``fcntl.flock`` on a lock file (``chat.kv.lock``, ``out/.lock``) that is never waited for, and
whose file records the holder (process id, host, since when), so that the one refused can be
told who holds it (:class:`Holder`). The kernel releases it when its holder dies, so a lock file
left by a killed process does not block: the next writer takes it and writes itself in. A
released lock's file is removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import filelock

from ..errors import InvalidInputError, StorageError, StoreLockTimeout, StoreUnavailableError

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: filelock's lock, the holder not recorded
    fcntl = None

LOCK_NAME = ".lock"
"""The lock file's name in the store's directory."""
POLL_SECONDS = 0.005
"""How often a waiting writer tries the lock again."""

__all__ = ["LOCK_NAME", "POLL_SECONDS", "Holder", "StoreLock", "WriterLock"]


class StoreLock:
    """The write lock of the store whose directory is ``root``.

    Args:
        root: the store's directory; the lock file is ``root/.lock``.
        timeout: seconds a writer waits for another holder (finite, ``>= 0``).
    """

    def __init__(self, root: Path, timeout: float) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self.timeout = timeout
        self._by_pid: dict[int, filelock.BaseFileLock] = {}

    def _lock(self) -> filelock.BaseFileLock:
        """This process's lock (filelock refuses to use one made before a fork)."""
        pid = os.getpid()
        lock = self._by_pid.get(pid)
        if lock is None:
            lock = self._by_pid.setdefault(
                pid,
                filelock.FileLock(
                    self.path,
                    timeout=self.timeout,
                    mode=0o644,
                    thread_local=True,  # one descriptor per thread: threads exclude each other
                    poll_interval=POLL_SECONDS,
                    fallback_to_soft=False,  # a lock file left by a dead writer must not block
                    preserve_lock_file=True,
                ),
            )
        return lock

    @property
    def held(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._lock().is_locked

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the lock for the ``with`` block (re-entrant within a thread).

        Raises:
            StoreLockTimeout: another holder kept it for more than ``timeout`` seconds.
            StoreUnavailableError: the lock file cannot be opened or locked (an ``OSError``).
        """
        lock = self._lock()
        try:
            lock.acquire()
        except filelock.Timeout:
            raise StoreLockTimeout(
                f"{self.root}: another writer held the store lock for more than "
                f"{self.timeout}s (lock file {self.path})"
            ) from None
        except OSError as e:
            raise StoreUnavailableError(
                f"{self.root}: cannot open the store's lock file: {e.strerror or e}"
            ) from e
        try:
            yield
        finally:
            lock.release()


@dataclass(frozen=True)
class Holder:
    """Who holds a :class:`WriterLock`, as its lock file records it (each field None where the
    file does not say: a holder that has not written itself in yet, or another program)."""

    pid: int | None = None
    host: str | None = None
    since: float | None = None
    what: str | None = None

    @classmethod
    def from_text(cls, text: str) -> Holder:
        try:
            data = json.loads(text)
        except ValueError:
            return cls()
        if not isinstance(data, dict):
            return cls()

        def field(key: str, kind: type | tuple[type, ...]):
            value = data.get(key)
            return value if isinstance(value, kind) and not isinstance(value, bool) else None

        return cls(
            field("pid", int), field("host", str), field("since", (int, float)), field("what", str)
        )

    def __str__(self) -> str:
        if self.pid is None:
            return "another process (its lock file names no process)"
        who = f"{self.what or 'process'} {self.pid}"
        if self.host is not None and self.host != socket.gethostname():
            who += f" on {self.host}"
        if self.since is not None:
            who += f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}"
        return who


class WriterLock:
    """An exclusive lock on the lock file ``path``, taken without waiting (module docstring).

    Args:
        path: the lock file (made when taken, removed when released).
        what: who takes it, written in the lock file (``"kvedit chat"``).

    ``acquire()`` returns None once it holds the lock, or the :class:`Holder` that does
    (``wait(seconds)``: tried again meanwhile); ``release()`` lets it go. ``with lock:`` is ``acquire`` (raising
    :class:`~kvedit.errors.InvalidInputError` naming the holder) and ``release``.
    """

    def __init__(self, path: str | os.PathLike, what: str = "process") -> None:
        self.path = Path(path)
        self.what = what
        self._fd: int | None = None
        self._soft: filelock.BaseFileLock | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None or self._soft is not None

    def acquire(self) -> Holder | None:
        """Take the lock: None, or the :class:`Holder` that has it (nothing is then changed).

        Raises:
            StorageError: the lock file cannot be made or locked (a folder that is not
                writable, a file system without locks).
        """
        if self.held:
            return None
        if fcntl is None:  # pragma: no cover - Windows
            return self._acquire_soft()
        while True:
            fd = self._open(os.O_CREAT)
            try:
                taken = self._lock(fd)
            except BaseException:
                os.close(fd)
                raise
            if not taken:
                holder = _read_holder(fd)
                os.close(fd)
                return holder
            if _same_file(fd, self.path):
                break
            os.close(fd)  # released and removed between the open and the lock: take the new one
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "what": self.what,
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
        except OSError as e:
            os.close(fd)
            raise _lock_error(self.path, e) from e
        self._fd = fd
        return None

    def wait(self, seconds: float, poll: float = 0.01) -> Holder | None:
        """:meth:`acquire`, tried again every ``poll`` seconds for up to ``seconds`` while
        another holds the lock (a writer that holds it for a moment: a save): None once
        taken, else the :class:`Holder` that kept it."""
        deadline = time.monotonic() + seconds
        while True:
            holder = self.acquire()
            if holder is None or time.monotonic() >= deadline:
                return holder
            time.sleep(poll)

    def holder(self) -> Holder | None:
        """Who holds the lock now (None: nobody, or this object), without taking it or making
        the lock file."""
        if self.held or fcntl is None:
            return None
        try:
            fd = self._open(0)
        except StorageError:
            return None
        try:
            if self._lock(fd):
                fcntl.flock(fd, fcntl.LOCK_UN)
                return None
            return _read_holder(fd)
        finally:
            os.close(fd)

    def release(self) -> None:
        """Let the lock go (its file removed first); a lock not held: nothing to do."""
        if self._soft is not None:  # pragma: no cover - Windows
            self._soft.release()
            self._soft = None
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            if _same_file(fd, self.path):
                self.path.unlink()  # while held: a process that opened it finds it gone
        os.close(fd)  # releases the flock

    def __enter__(self) -> WriterLock:
        holder = self.acquire()
        if holder is not None:
            raise InvalidInputError(f"{self.path}: held by {holder}")
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _open(self, create: int) -> int:
        flags = os.O_RDWR | create | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            return os.open(self.path, flags, 0o644)
        except OSError as e:
            raise _lock_error(self.path, e) from e

    def _lock(self, fd: int) -> bool:
        """Whether the flock on ``fd`` was taken (False: another holds it); ``fd`` is left
        open either way."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise _lock_error(self.path, e) from e
        return True

    def _acquire_soft(self) -> Holder | None:  # pragma: no cover - Windows
        lock = filelock.FileLock(self.path, timeout=0, thread_local=False)
        try:
            lock.acquire()
        except filelock.Timeout:
            return Holder()
        self._soft = lock
        return None


def _read_holder(fd: int) -> Holder:
    try:
        return Holder.from_text(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
    except OSError:
        return Holder()


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lock_error(path: Path, error: OSError) -> StorageError:
    why = error.strerror or str(error)
    if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        why += " (this file system does not lock files)"
    return StorageError(f"cannot lock {path}: {why}")
