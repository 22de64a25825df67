"""The store's write lock: ``root/.lock``, held by every writer (put, evict, pin, recovery).

It is a :class:`filelock.FileLock` (an ``fcntl.flock`` on POSIX, released by the kernel when
its holder dies, so a killed writer never leaves the store locked): exclusive across processes
and across threads (each thread takes it through its own file descriptor), and re-entrant
within a thread. A writer that cannot take it within ``timeout`` seconds gets
:class:`~kvedit.errors.StoreLockTimeout` (``timeout=0``: one try). The lock file stays in place
when released. A ``StoreLock`` inherited by a forked child takes a lock of its own there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import filelock

from ..errors import StoreLockTimeout, StoreUnavailableError

LOCK_NAME = ".lock"
"""The lock file's name in the store's directory."""
POLL_SECONDS = 0.005
"""How often a waiting writer tries the lock again."""

__all__ = ["LOCK_NAME", "POLL_SECONDS", "StoreLock"]


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
