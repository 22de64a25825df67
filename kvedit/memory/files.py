"""A :class:`kvedit.Memory` in a file: one sealed state file (:mod:`kvedit.states.files`) whose
header carries the conversation as its ``attachment``: the prompt format, the messages, their
:class:`~kvedit.memory.records.Turn` records, the forgetting rounds (each record's ``to_json``),
the ``Memory`` keywords of its budget and quantizing (``budget``:
:data:`~kvedit.memory.attached.BUDGET_KEYWORDS`; a file written before they were kept has none)
and, under an arrival policy, which layers' entry scores it holds (``scores``; the scores
themselves are tensors beside the state's, ``scores.{layer}``). The seal covers it, and the
loader checks every field (:mod:`kvedit.memory.attached`): the messages rendered again must give
the file's ids.

A memory remembers the version of each file it loaded from or saved to (:func:`disk_version`:
device, inode, size and modification time), and a save to that file first checks that the file
is still that version (:func:`check_unchanged`): another writer's save in between (two chats on
one file, two processes that loaded it) is refused, not overwritten. The check and the write
hold the file's saving lock (:func:`saving_lock`), so that two saves of one loaded version
cannot both pass the check: at most one save per version read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from ..cache import is_headwise
from ..errors import (
    CorruptCacheError,
    FileChangedError,
    InvalidInputError,
    InvalidTypeError,
    StorageError,
)
from ..states.files.read import read_attached
from ..states.files.write import SavedFile, save_file_version
from ..states.state import KVState
from ..store.lock import WriterLock
from .attached import (
    ATTACHMENT_KIND,
    ATTACHMENT_VERSION,
    BUDGET_KEYWORDS,
    Attachment,
    parse_attachment,
)
from .budget import Budget
from .forgetting import Round, policies
from .held import Held, scored_from_scratch
from .keeping import keep_of
from .records import Turn
from .rendering import Message

__all__ = [
    "ATTACHMENT_KIND",
    "LOAD_KEYWORDS",
    "MemoryFile",
    "budget_keywords",
    "check_as_file",
    "check_unchanged",
    "saving_lock",
    "disk_version",
    "file_key",
    "held_from_file",
    "load_keywords",
    "memory_attachment",
    "merged_keywords",
    "read_memory",
    "score_tensors",
    "write_memory",
]

LOAD_KEYWORDS = ("max_positions", *BUDGET_KEYWORDS, "prompt", "system")
"""The keywords :meth:`kvedit.Memory.load` takes (``prompt`` and ``system`` only as the file's)."""


@dataclasses.dataclass(frozen=True)
class MemoryFile:
    """What a memory file holds: the ``state``, its checked ``attachment`` (the prompt format,
    the messages, their turns, the forgetting rounds, the rendering, the budget's keywords),
    the ``version`` of the file read (:func:`disk_version`), and the arrival ``scores`` it
    holds as tensors (``{layer: [batch, kv_heads, n]}``, None without)."""

    state: KVState
    attachment: Attachment
    version: tuple | None = None
    scores: dict | None = None

    @property
    def scored_by(self) -> str | None:
        """The arrival policy that made :attr:`scores` (None without scores)."""
        meta = self.attachment.scores
        return None if meta is None else meta["policy"]

    @property
    def scores_key(self) -> str | None:
        """The scorer's key (:meth:`kvedit.compress.Scorer.scores_key`: a learned fit's
        digest) under which :attr:`scores` were made; None without one (or a file before
        keys were kept)."""
        meta = self.attachment.scores
        return None if meta is None else meta.get("key")


def budget_keywords(budget: Budget | None, exact_messages: int, quantize: int | None) -> dict:
    """The ``Memory`` keywords that give a memory ``budget``, ``exact_messages`` and
    ``quantize`` again (JSON-ready: :meth:`Budget.to_json <kvedit.memory.budget.Budget.to_json>`,
    with ``quantize`` and ``exact_messages`` beside it, the latter as ``recent``, the field files
    have held it in since before the keyword was renamed: every kvedit reading memory files
    reads it)."""
    keywords: dict = {"max_tokens": None, "recent": exact_messages, "quantize": quantize}
    return keywords if budget is None else {**keywords, **budget.to_json()}


def memory_attachment(
    prompt: str,
    messages: Sequence[Message],
    turns: Sequence[Turn],
    rounds: Sequence[Round],
    keywords: dict | None = None,
    scores: Mapping[int, object] | None = None,
    scored_by: str | None = None,
    scores_key: str | None = None,
) -> dict:
    """The header attachment of a memory file (JSON-ready); ``keywords``: the
    :func:`budget_keywords` to keep (None: none); ``scores``: the layers whose entry scores
    (by the arrival policy ``scored_by``, under its ``scores_key``) the file holds as tensors
    (:func:`score_tensors`)."""
    out = {
        "kind": ATTACHMENT_KIND,
        "version": ATTACHMENT_VERSION,
        "prompt": prompt,
        "messages": [m.to_json() for m in messages],
        "turns": [t.to_json() for t in turns],
        "rounds": [r.to_json() for r in rounds],
        "budget": keywords,
    }
    if scores is not None:
        out["scores"] = {"policy": scored_by, "layers": sorted(int(i) for i in scores)}
        if scores_key is not None:
            out["scores"]["key"] = scores_key
    return out


def score_tensors(scores: Mapping[int, object] | None) -> dict:
    """The tensors a memory file holds its entry scores in (``scores.{layer}``)."""
    return {} if scores is None else {f"scores.{i}": t for i, t in scores.items()}


def _file_scores(a, found, path) -> dict | None:
    """The entry scores of a memory file, each ``[kv_heads, n]`` float32 of its layer's slots
    (``-inf`` on a headwise layer's padding), checked against its layers."""
    if a.scores is None:
        return None
    state, tensors, out = found.state, found.tensors or {}, {}
    if sorted(a.scores["layers"]) != sorted(state.counted_layers):
        raise CorruptCacheError(f"{path}: the memory's scores.layers are not its global layers")
    for i in a.scores["layers"]:
        t = tensors.get(f"scores.{i}")
        layer = state.layers[i]
        shape = (layer.kv_shape[1], len(layer))
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
            got = "none" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise CorruptCacheError(
                f"{path}: the memory's scores of layer {i} are {got}, not {shape} float32"
            )
        if bool(torch.isnan(t).any()) or bool(torch.isposinf(t).any()):
            raise CorruptCacheError(f"{path}: the memory's scores of layer {i} are not finite")
        out[i] = t
    return out


def read_memory(
    path: str | os.PathLike, model, tokenizer, max_positions: int | None = None
) -> MemoryFile:
    """A memory file, checked (:func:`kvedit.memory.attached.parse_attachment`): every field of
    its attachment, and the messages rendered again give the state's ids exactly.

    Raises:
        InvalidInputError: no file at ``path``.
        CacheMismatchError: the file was made by another model or tokenizer.
        CorruptCacheError: not a memory file, damaged, a field that is not what
            :meth:`kvedit.Memory.save` writes, or messages that do not render to its tokens.
    """
    if not os.path.exists(path):
        raise InvalidInputError(f"{path}: no such memory file (Memory.save writes one)")
    found = read_attached(path, model, tokenizer, max_positions=max_positions)
    state = found.state
    a = parse_attachment(
        found.attachment, path, state.token_ids.tolist(), tokenizer, trusted=found.trusted
    )
    version = None if found.version is None else tuple(found.version[:4])
    scores = _file_scores(a, found, path)
    return MemoryFile(state, a, version, scores)


def load_keywords(given: Mapping[str, object]) -> dict:
    """The keywords given to :meth:`kvedit.Memory.load`, refused before any work unless each is
    one of :data:`LOAD_KEYWORDS`.

    Raises:
        InvalidTypeError: an unknown keyword (a ``TypeError``, as Python's own).
    """
    unknown = sorted(set(given) - set(LOAD_KEYWORDS))
    if unknown:
        raise InvalidTypeError(
            f"Memory.load takes no keyword {', '.join(f'{k}=' for k in unknown)}; it takes "
            f"{', '.join(f'{k}=' for k in LOAD_KEYWORDS)}"
        )
    return dict(given)


def check_as_file(found: MemoryFile, prompt, system) -> None:
    """Refuse a ``prompt`` or ``system`` given to :meth:`kvedit.Memory.load` that is not the
    file's: a loaded memory keeps the file's messages and format (None: not given)."""
    held = found.attachment
    if prompt is not None and prompt != held.prompt:
        raise InvalidInputError(
            f"prompt={prompt!r}: the file's messages were rendered in the {held.prompt!r} "
            "format, and a loaded memory keeps it (leave prompt= out)"
        )
    if system is not None:
        first = held.messages[0] if held.messages else None
        said = first.content if first is not None and first.role == "system" else None
        if said != system:
            has = "no system message" if said is None else f"the system message {said!r}"
            raise InvalidInputError(
                f"system={system!r}: the file has {has}, and a loaded memory keeps the file's "
                "messages (leave system= out)"
            )


def file_key(path: str | os.PathLike) -> str:
    """The file a path names, for telling one memory file from another (links resolved)."""
    return os.path.realpath(os.fspath(path))


def disk_version(path: str | os.PathLike) -> tuple | None:
    """``(device, inode, size, mtime_ns)`` of the file at ``path`` (None: no file there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_unchanged(path: Path, known: tuple | None) -> None:
    """Refuse to save over ``path`` when it is no longer the version this memory loaded from
    or saved last (``known``; None: a file this memory never read nor wrote, not checked). A
    file since removed is no one's work: it is written again.

    Raises:
        FileChangedError: another writer replaced or changed the file meanwhile.
    """
    if known is None:
        return
    now = disk_version(path)
    if now is not None and now != known:
        raise FileChangedError(
            f"{path} changed since this memory loaded or saved it: another writer (a second "
            "chat on the same file?) saved it meanwhile, and saving now would overwrite its "
            "conversation; the file and the memory are unchanged (save(path, overwrite=True) "
            "replaces it anyway, or save to another path)"
        )


def write_memory(
    path: Path,
    held: Held,
    prompt: str,
    keywords: dict,
    budget: Budget | None,
    known: tuple | None,
) -> SavedFile:
    """Write what a memory holds (``held``) to ``path``: one sealed state file, its messages,
    turns, rounds and budget ``keywords`` in the header, an arrival policy's entry scores as
    attached tensors. Refused (:func:`check_unchanged`) when the file is no longer the version
    ``known`` (None: not checked). The check and the write hold the file's saving lock
    (:func:`saving_lock`): of two savers of one version, the second finds the first's file."""
    policy = None if budget is None else budget.policy
    key = None if held.scores is None or budget is None else budget.scorer.scores_key(held.state)
    attachment = memory_attachment(
        prompt, held.messages, held.turns, held.rounds, keywords, held.scores, policy, key
    )
    lock = saving_lock(path)
    try:
        check_unchanged(path, known)
        return save_file_version(
            held.state, path, attachment=attachment, attached=score_tensors(held.scores)
        )
    finally:
        lock.release()


SAVING_WAIT_SECONDS = 120.0
"""How long a save waits for another save of the same file (a save writes the whole file)."""


def saving_lock(path: str | os.PathLike) -> WriterLock:
    """The lock every :meth:`kvedit.Memory.save` of the file ``path`` (links resolved) holds
    while it checks the file's version and writes it: ``.NAME.kvedit-saving`` beside it,
    taken, waiting up to :data:`SAVING_WAIT_SECONDS` for another save.

    Raises:
        StorageError: another save held it all that time, or it cannot be taken.
    """
    file = Path(file_key(path))
    lock = WriterLock(file.with_name(f".{file.name}{SAVING_SUFFIX}"), "Memory.save")
    holder = lock.wait(SAVING_WAIT_SECONDS)
    if holder is not None:
        raise StorageError(
            f"{path}: another save of it ({holder}) held its lock {lock.path} for more than "
            f"{SAVING_WAIT_SECONDS:.0f}s; the memory is not saved"
        )
    return lock


SAVING_SUFFIX = ".kvedit-saving"
"""What a memory file's saving lock adds to its name (after a leading dot)."""


_BUDGET_ONLY = ("forget", "recent_tokens", "protect", "keep", "layer_floor", "reposition")
"""A file's keywords that mean nothing without its budget (dropped with ``max_tokens=None``)."""


def _newer(keywords: Mapping) -> dict:
    """``keywords`` with the older names mapped to the newer (``recent``: ``exact_messages``;
    ``per_head``, ``per_layer``: ``keep``, :func:`~kvedit.memory.keeping.keep_of`)."""
    out = dict(keywords)
    if "recent" in out and "exact_messages" not in out:
        out["exact_messages"] = out.pop("recent")
    head, layer = out.pop("per_head", None), out.pop("per_layer", None)
    if (head is not None or layer is not None) and "keep" not in out:
        out["keep"] = keep_of(None, head, layer)
    return out


def merged_keywords(kept: dict, given: dict) -> dict:
    """The ``Memory`` keywords of a loaded memory: the file's (``kept``), each replaced by one
    given to :meth:`kvedit.Memory.load` (older names read as the newer, :func:`_newer`); a size
    given one way (``max_tokens``/``max_bytes``) replaces the file's given the other; without a
    size, the file's forgetting keywords are dropped (nothing is forgotten).

    Raises:
        InvalidInputError: the file's policy is not registered here and no ``forget=`` replaces
            it (or the memory keeps no budget).
    """
    kept, given = _newer(kept), _newer(given)
    merged = {**kept, **given}
    for one, other in (("max_bytes", "max_tokens"), ("max_tokens", "max_bytes")):
        if one in given:
            merged.pop(other, None)
    if merged.get("max_tokens") is None and merged.get("max_bytes") is None:
        for key in _BUDGET_ONLY:
            if key not in given:
                merged.pop(key, None)
    policy = merged.get("forget")
    if "forget" not in given and policy is not None and policy not in policies():
        raise InvalidInputError(
            f"the memory file forgets with the policy {policy!r}, which is not registered in "
            f"this process (registered: {', '.join(policies())}): register it (import the "
            "module that defines it) before loading, or pass forget= another policy"
        )
    return merged


def _check_scores_key(found: MemoryFile, key: str | None) -> None:
    """Refuse a memory that forgot per KV head whose scores were made under another scorer
    key (another learned fit) than ``key``: they are not comparable, and its cache cannot be
    scored again (each head holds other tokens)."""
    made = found.scores_key  # None: a file from before keys were kept, taken as it was
    if made is not None and made != key and any(map(is_headwise, found.state.layers)):
        raise InvalidInputError(
            f"this memory's {found.scored_by} scores were made under the fit {made}, not the "
            f"one {found.scored_by} uses now ({key}), and a memory that forgot per KV head "
            "cannot be scored again: load it where the fit that made them is found, or with "
            "another forget= policy"
        )


def held_from_file(found: MemoryFile, budget: Budget | None) -> Held:
    """What a memory loaded from ``found`` holds under ``budget``: the file's state, messages,
    rendering and rounds, its turns marked ``loaded``, and an arrival policy's scores (the
    file's when that policy made them, else scored now, once).

    Raises:
        InvalidInputError: a memory that forgot per KV head under a policy that scores at each
            round (its scores of a slot would mix the tokens the heads hold there).
    """
    held = found.attachment
    turns = [replace(t, source="loaded", computed=0, kept=0) for t in held.turns]
    arrival = budget is not None and budget.scorer.arrival
    if budget is not None and not budget.per_head and any(map(is_headwise, found.state.layers)):
        raise InvalidInputError(
            f"this memory forgot per KV head (its layers hold other entries on each head), and "
            f"keep={budget.keep!r} (per_head=False) cannot undo that: load it with its file's "
            "keep='head', or with max_tokens=None (no budget)"
        )
    if budget is not None and not arrival and any(map(is_headwise, found.state.layers)):
        raise InvalidInputError(
            f"this memory forgot per KV head (its layers hold other entries on each head), "
            f"which only a policy that keeps each entry's score per head ranks (kvzip, "
            f"learned); forget={budget.policy!r} scores at each round: load it with its "
            "file's policy"
        )
    scores = found.scores
    key = budget.scorer.scores_key(found.state) if arrival else None
    if arrival and scores is not None and found.scored_by == budget.policy:
        _check_scores_key(found, key)
    other_fit = found.scores_key != key and not any(map(is_headwise, found.state.layers))
    if arrival and (scores is None or found.scored_by != budget.policy or other_fit):
        scores = scored_from_scratch(budget, found.state)  # another policy's or fit's: again
    return Held(
        found.state,
        tuple(held.messages),
        held.rendering,
        tuple(turns),
        tuple(held.rounds),
        scores if arrival else None,
    )
