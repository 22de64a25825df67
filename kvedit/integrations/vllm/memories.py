"""The memory files of ``kvedit serve``'s chat conversations (``ROOT/memories``) and their
published stock files (``ROOT``): found, checked, read, stored, pruned and swept.

Used by :class:`~kvedit.integrations.vllm.conversations.Conversations` (the module doc there
says what a memory is). Every memory is checked before any of its K/V is used:

* its seal and kind (a memory this installation served), and that its token ids are the ones
  its name addresses (``<n>-<ids key>-<digest>``: a file copied over another of the same length
  is refused, naming the file and the mismatch);
* its stock file (what the connector loads) present and intact (its seal, per file version).

A request that names no memory is served from the longest intact memory of its messages: when
the latest memory of a conversation is damaged (bad seal, its stock file missing or damaged),
its parent (kept beside it) serves, and :class:`Found` says which memory was passed over and
why. Leftovers in ``ROOT/memories`` (a killed writer's temporary file or folder) are swept
(:func:`~kvedit.integrations.vllm.turns.sweep_folder`).

**Hot memories stay in RAM.** A memory read or stored is kept (a bounded LRU of
:data:`HOT_BYTES`), keyed by its file's identity (path, size, ``mtime_ns``, ...): a turn's memory is
read and checked once, when first met, and served from RAM after; a file changed on disk (another
server, a copy over it) has another identity, so it is read and checked again. A stock file is
verified once per version, and the one a commit writes is known verified (its ids are the ones
written). :attr:`MemoryFiles.reads` counts the files read whole (``memory``, ``stock``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from ...atomic import STALE_TEMP_SECONDS
from ...errors import InvalidInputError, KVEditError, StorageError
from ...memory.held import Scores
from ...states.files.read import read_attached
from ...states.files.write import save_file_version
from ...states.state import KVState
from . import files
from .publishing import publish_stock
from .servable import realize
from .stock import StockCache
from .turns import sweep_folder

__all__ = ["HOT_BYTES", "MEMORIES", "Found", "MemoryFiles", "Unwritten"]

MEMORIES = "memories"
"""The folder under the publish root that holds the conversations' memories."""

ATTACHMENT = "kvedit-served-memory"
"""The ``kind`` of a served memory's attachment (its header says which memory it follows)."""

HOT_BYTES = 256 << 20
"""The bytes of memories a server keeps in RAM after use (least recently used go first): a few
dozen conversations' next turns at 8 MiB a memory without a read, while the server's own RAM
stays far below the model's."""
_SWEEP_SECONDS = 10.0  # the memories' folder is swept at most this often
_VERIFIED = 64  # stock file versions whose verification is remembered


@dataclass
class Memory:
    """A memory as read: its state, its entry scores and its attachment."""

    state: KVState
    scores: Scores | None
    meta: dict = field(default_factory=dict)
    digest: str = ""  # its file's name's digest (the stock file's)


@dataclass(frozen=True)
class Unwritten:
    """A memory made and checked (its stock form realised: a state vLLM cannot serve is
    refused then), not yet written (:meth:`MemoryFiles.write`)."""

    digest: str
    memory: Memory
    stock: StockCache


@dataclass(frozen=True)
class Found:
    """The memory that serves a request: its file, the tokens it holds, its digest, its stock
    slot ids, and ``fallback`` (``{"from": digest, "why": reason}``) when a longer memory of the
    same messages was damaged and passed over (None otherwise)."""

    path: Path
    held: int
    digest: str
    slots: list[int]
    fallback: dict | None = None


class MemoryFiles:
    """The memories under ``root/memories`` and their stock files under ``root``."""

    def __init__(self, root: Path, model, tokenizer, *, hot_bytes: int = HOT_BYTES) -> None:
        self.root, self.folder = root, root / MEMORIES
        self.model, self.tokenizer = model, tokenizer
        self.index = files.PublishedIndex(self.folder)
        self.published = files.PublishedIndex(self.root)  # the memories' stock files
        self.hot_bytes = hot_bytes
        self.reads: Counter[str] = Counter()  # files read whole: "memory", "stock"
        self._ram: OrderedDict[tuple, Memory] = OrderedDict()  # by file identity: _identity
        self._ram_bytes = 0
        self._verified: OrderedDict[tuple, list[int]] = OrderedDict()
        self._deferred: dict[str, _Deferred] = {}  # by turn: made, written after the response
        self._lock = threading.Lock()
        self._swept = 0.0
        self.check_folder()

    def check_folder(self) -> None:
        """Make ``ROOT/memories`` if it is missing; refuse one that is not a folder.

        Raises:
            StorageError: it is a file, a broken link, or cannot be made.
        """
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError as e:
            raise StorageError(
                f"{self.folder} is not a folder: kvedit serve keeps the conversations' "
                "memories there; remove it or serve another --root"
            ) from e
        except OSError as e:
            raise StorageError(f"cannot make {self.folder}: {e}") from e

    def sweep(self) -> int:
        """Remove what killed writers left in the memories' folder (at most every
        ``_SWEEP_SECONDS``); returns how many entries went."""
        now = time.monotonic()
        if now - self._swept < _SWEEP_SECONDS:
            return 0
        self._swept = now
        return sweep_folder(self.folder, STALE_TEMP_SECONDS, everything=False)

    # ------------------------------------------------------------------ finding

    def find(self, ids: list[int], digest: str | None) -> Found | None:
        """The memory that serves a prompt of ``ids``: the one named by ``digest``, else the
        longest intact memory whose ids start ``ids`` (the whole prompt excluded: vLLM
        computes at least one token); None for a new conversation.

        Raises:
            InvalidInputError: ``digest`` names no memory of these ids.
            KVEditError: the named memory is damaged (why, naming the file).
        """
        if digest is not None:
            got = self.index.find(ids[:-1], digest)
            if got is None:
                raise InvalidInputError(
                    f"no memory with digest {digest} under {self.folder} starts these messages"
                )
            return Found(got[0], got[1], digest, self._checked(got[0], ids))
        passed: dict | None = None
        for n, paths in self.index.prefixes(ids[:-1]):
            for name, path in paths.items():
                try:
                    return Found(path, n, name, self._checked(path, ids), passed)
                except (KVEditError, OSError) as e:
                    passed = passed or {"from": name, "why": str(e)}
        return None

    def _checked(self, path: Path, ids: list[int]) -> list[int]:
        """The stock slot ids of the memory in ``path``, after checking the memory (read) and
        its stock file (verified)."""
        self.load(path, ids)
        return self._slots(files.digest_of(path))

    def _slots(self, digest: str) -> list[int]:
        """The stock slot ids of memory ``digest`` (its published file's ids, the file's seal
        verified once per version)."""
        published = self.published.with_digest(digest)
        if not published:
            raise KVEditError(f"the memory {digest} has no published stock file under {self.root}")
        path = published[0][0]
        key = _identity(path)
        with self._lock:
            if key in self._verified:
                self._verified.move_to_end(key)
                return self._verified[key]
        self.reads["stock"] += 1
        slots = list(files.verify(path)["token_ids"])
        self._known_verified(key, slots)
        return slots

    def _known_verified(self, key: tuple, slots: list[int]) -> None:
        with self._lock:
            self._verified[key] = slots
            self._verified.move_to_end(key)
            while len(self._verified) > _VERIFIED:
                self._verified.popitem(last=False)

    # ------------------------------------------------------------------ reading

    def load(self, path: Path, ids: list[int] | None = None) -> Memory:
        """The memory in ``path``, checked: its seal and kind, its token ids the ones its name
        addresses and, with ``ids``, a prefix of them. Read and checked once per file version
        (kept in RAM after: :data:`HOT_BYTES`).

        Raises:
            KVEditError: a file that is not a memory served here, or whose ids are not its
                name's or do not start ``ids`` (naming the file and the mismatch).
            OSError: the file is gone.
        """
        key = _identity(path)
        with self._lock:
            memory = self._ram.get(key)
            if memory is not None:
                self._ram.move_to_end(key)
        if memory is None:
            memory = self._read(path, files.digest_of(path))
            self.remember(key, memory)
        held = memory.state.token_ids.tolist()
        if ids is not None and ids[: len(held)] != held:
            raise KVEditError(f"{path.name}: the memory's token ids do not start the request's")
        return memory

    def _read(self, path: Path, digest: str) -> Memory:
        self.reads["memory"] += 1
        found = read_attached(path, self.model, self.tokenizer)
        if not found.trusted or (found.attachment or {}).get("kind") != ATTACHMENT:
            raise KVEditError(f"{path} is not a memory this installation served")
        ids = found.state.token_ids.tolist()
        named = int(path.name.split("-", 1)[0])
        if len(ids) != named:
            raise KVEditError(
                f"{path}: the memory file holds {len(ids)} token ids, its name says {named} "
                "(a file copied over another?): not served"
            )
        if path.name != files.file_name(ids, digest):
            raise KVEditError(
                f"{path}: the memory file's {len(ids)} token ids are not the ones its name "
                f"addresses (ids key {files.ids_key(ids)}; a file copied over another?): "
                "not served"
            )
        if found.state.digest != digest:
            raise KVEditError(
                f"{path}: the memory file's digest is {found.state.digest}, its name's {digest} "
                "(a file copied over another?): not served"
            )
        tensors = found.tensors or {}
        scores = {
            int(k.split(".")[1]): t for k, t in tensors.items() if k.startswith("scores.")
        } or None
        return Memory(found.state, scores, found.attachment or {}, digest)

    def remember(self, key: tuple, memory: Memory) -> None:
        """Keep ``memory`` (the file of identity ``key``) in RAM, the least recently used
        going first past ``hot_bytes`` (the newest is kept whatever its size)."""
        with self._lock:
            old = self._ram.pop(key, None)
            self._ram_bytes -= old.state.nbytes if old is not None else 0
            self._ram[key] = memory
            self._ram_bytes += memory.state.nbytes
            while len(self._ram) > 1 and self._ram_bytes > self.hot_bytes:
                _, gone = self._ram.popitem(last=False)
                self._ram_bytes -= gone.state.nbytes

    def hot(self) -> list[str]:
        """The digests of the memories kept in RAM, least recently used first."""
        with self._lock:
            return [m.digest for m in self._ram.values()]

    # ------------------------------------------------------------------ writing

    def store(self, state: KVState, scores: Scores | None, parent: str | None) -> str:
        """:meth:`make` and :meth:`write` the memory of ``state``; returns its digest."""
        return self.write(self.make(state, scores, parent))

    def make(self, state: KVState, scores: Scores | None, parent: str | None) -> Unwritten:
        """The memory of ``state`` (``parent``: the digest of the memory it follows), its stock
        form realised (what vLLM serves; refused here when it cannot be), nothing written.

        Raises:
            InvalidInputError: a state a stock kernel cannot serve.
        """
        state.check_unaltered("publishing it")
        _, stock = realize(state)
        attachment = {"kind": ATTACHMENT, "parent": parent}
        digest = stock.digest or state.digest
        return Unwritten(digest, Memory(state, scores, attachment, digest), stock)

    def write(self, made: Unwritten) -> str:
        """Publish ``made``'s stock form and write the memory (both atomic; the memory last,
        so a memory found always has its stock file); returns its digest. Both are kept known
        (the memory in RAM, the stock file verified): the next turn reads neither.

        Two files, each written once: the stock form is what vLLM's worker (another process)
        loads by digest, in the layout it serves; the memory file is kvedit's form (positions,
        history, entry scores, parent), what a restarted server or another on the same root
        reads to fold the next turn, which the stock form does not carry."""
        ids, _, stock_path = publish_stock(made.stock, self.root)
        self._known_verified(_identity(stock_path), list(ids))
        memory = made.memory
        path = self.folder / files.file_name(memory.state.token_ids.tolist(), made.digest)
        scores = memory.scores
        attached = {} if scores is None else {f"scores.{i}": t for i, t in scores.items()}
        save_file_version(memory.state, path, attachment=memory.meta, attached=attached)
        self.remember(_identity(path), memory)
        return made.digest

    def defer(self, turn: str, made: Unwritten, served: str | None) -> None:
        """Keep ``made`` (turn ``turn``'s memory; ``served``: the memory that served it) to be
        written and its parent's parent pruned by :meth:`flush`."""
        with self._lock:
            self._deferred[turn] = _Deferred(made, served)

    def flush(self, turn: str | None = None, timeout: float = 60.0) -> None:
        """Write the deferred memories (turn ``turn``'s, or all) and prune; one another thread
        is writing is waited for (``timeout`` seconds). Never raises: a memory that cannot be
        written is logged, and its conversation is served from the last memory kept."""
        with self._lock:
            turns = list(self._deferred) if turn is None else [turn]
            items = [(t, self._deferred[t]) for t in turns if t in self._deferred]
            mine = [(t, d) for t, d in items if not d.claimed]
            for _, d in mine:
                d.claimed = True
        for t, d in items:
            if (t, d) not in mine:
                d.done.wait(timeout)
                continue
            try:
                self.write(d.made)
                self.prune(d.served)
            except (KVEditError, OSError) as e:
                _log.error("kvedit: turn %s's memory %s was not kept: %s", t, d.made.digest, e)
            finally:
                with self._lock:
                    self._deferred.pop(t, None)
                d.done.set()

    def prune(self, digest: str | None) -> None:
        """Remove the parent of memory ``digest`` (the one that served a turn just kept): a
        conversation keeps its last two memories, so a turn retried is still served from its
        memory, and the files do not grow with every turn."""
        if digest is None:
            return
        with self._lock:  # the commit has just loaded it
            served = next((m for m in self._ram.values() if m.digest == digest), None)
        old = served.meta.get("parent") if served is not None else None
        if not isinstance(old, str):
            return
        for index in (self.index, self.published):
            for path, _ in index.with_digest(old):
                path.unlink(missing_ok=True)
        with self._lock:
            for key in [k for k, m in self._ram.items() if m.digest == old]:
                self._ram_bytes -= self._ram.pop(key).state.nbytes


_log = logging.getLogger(__name__)


@dataclass
class _Deferred:
    made: Unwritten
    served: str | None
    claimed: bool = False
    done: threading.Event = field(default_factory=threading.Event)


def _identity(path: Path) -> tuple:
    """A file version's identity: its path, inode, size, ``mtime_ns`` and ``ctime_ns`` (a file
    replaced or written again has another; no user can set a ``ctime`` back).

    Raises:
        OSError: the file is gone.
    """
    st = path.stat()
    return (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
