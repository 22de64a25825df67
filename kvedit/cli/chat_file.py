"""The memory file of ``kvedit chat``: checked before the model loads, held by one chat at a
time, opened (or started), and saved elsewhere on ``/save PATH``.

One chat per file: a chat holds ``FILE.lock`` beside its memory file (a
:class:`~kvedit.store.lock.WriterLock`: an ``flock`` the kernel releases when the chat dies,
the file naming its process) from before the model loads until it ends, so that a second chat
on the same file is refused at once, told which process holds it, instead of both saving over
each other. A ``--memory`` that is a symbolic link is the file it leads to: the lock, the checks
and the saves are that file's (the link stays a link, :func:`kvedit.atomic.final_path`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..atomic import final_path, sweep_stale
from ..cache import is_headwise
from ..errors import (
    CacheMismatchError,
    CorruptCacheError,
    InvalidInputError,
    KVEditError,
    UnsupportedModelError,
)
from ..memory.smallest import NEVER_HOLDS
from ..store.lock import WriterLock
from .status import UsageError, message

LOCK_SUFFIX = ".lock"
"""What a memory file's lock file adds to its name (``chat.kv.lock``)."""

__all__ = ["LOCK_SUFFIX", "check_memory_path", "lock_memory", "open_memory", "save_copy", "target"]


def _named(option: str | None, path: Path) -> str:
    return f"{option} {path}: " if option else ""


def target(path: Path, option: str | None = "--memory") -> Path:
    """The file a chat on ``path`` reads and writes: ``path``, or where a link at ``path``
    leads, absolute (two names of one file are one target). ``option`` names ``path`` in
    errors (None: not named)."""
    try:
        return Path(os.path.abspath(final_path(Path(os.path.abspath(path)))))
    except InvalidInputError as e:
        raise UsageError(f"{_named(option, path)}{message(e)}") from None


def check_memory_path(path: Path) -> None:
    """Refuse, before the model loads, a --memory that could never be written."""
    file = target(path)
    if file.is_dir():
        raise UsageError(f"--memory {path}: is a directory, not a file")
    folder = file.parent
    if not folder.is_dir():
        raise UsageError(f"--memory {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"--memory {path}: the folder {folder} is not writable")


def lock_memory(path: Path, option: str | None = "--memory") -> WriterLock:
    """The lock of the memory file ``path``, taken; refused when another chat holds it.
    ``option`` names ``path`` in errors (None: not named).

    Raises:
        UsageError: another process holds it (naming it), or the lock cannot be taken.
    """
    file = target(path, option)
    lock = WriterLock(file.with_name(file.name + LOCK_SUFFIX), "kvedit chat")
    try:
        holder = lock.acquire()
    except OSError as e:  # kvedit's StorageError too: a folder or file system without locks
        raise UsageError(f"{_named(option, path)}{message(e)}") from None
    if holder is not None:
        raise UsageError(
            f"{_named(option, path)}another kvedit chat is using it ({holder}; lock file "
            f"{lock.path}); end that chat first, or give another file"
        )
    return lock


def save_copy(memory, path: Path) -> None:
    """``/save PATH``: write ``memory`` to ``path`` (not the chat's own file), holding that
    file's lock meanwhile so that a chat on it is not written over."""
    lock = lock_memory(path, None)
    try:
        memory.save(path)
    finally:
        lock.release()


def _options(budget: dict) -> str:
    """The options behind ``budget`` (``Memory``'s keywords, each named as its option; a size
    in bytes), for an error that names them."""
    given = []
    for keyword, value in budget.items():
        option = "--" + keyword.replace("_", "-")
        if keyword == "protect":
            given += [f"{option} {text!r}" for text in value]
        else:
            given.append(f"{option} {value}")
    return " ".join(given)


def _budget_refused(error: InvalidInputError) -> UsageError | None:
    """A budget the memory can never hold (:func:`kvedit.memory.smallest.check_holds`),
    refused in the chat's words (its options); None for another refusal."""
    said = message(error)
    if NEVER_HOLDS not in said:
        return None
    for keyword in ("max_bytes", "max_tokens", "recent_tokens"):
        option = "--" + keyword.replace("_", "-")
        said = said.replace(f"raise {keyword}", f"raise {option}")
        said = said.replace(f"lower {keyword}=", f"lower {option}").replace(
            f"{keyword}=", option + " "
        )
    return UsageError(said)


def open_memory(path: Path | None, model, tok, args, budget: dict):
    """The memory in ``path`` (checked against --system and --prompt), or a new one (always
    with ``path`` None: held in RAM only); with ``budget`` (``Memory``'s keywords) from here
    on. What killed saves of ``path`` left beside it is removed first
    (:func:`kvedit.atomic.sweep_stale`); a budget it can never hold is refused before any
    message runs."""
    if path is not None:
        sweep_stale(path)
    try:
        return _opened(path, model, tok, args, budget)
    except InvalidInputError as e:
        refused = _budget_refused(e)
        if refused is None:
            raise
        raise refused from None


def _load(path: Path, model, tok, args, budget: dict):
    """``Memory.load`` of the chat's file with ``budget``; a file it cannot use refused."""
    from ..memory.conversation import Memory

    try:
        return Memory.load(path, model, tok, max_positions=args.max_positions, **budget)
    except CacheMismatchError as e:
        made_by = _made_by(path)
        if made_by is None or made_by == args.model:
            raise UsageError(f"--memory {e}; the file is left as it is") from None
        raise UsageError(
            f"--memory {path}: a memory of the model {made_by!r}, not of {args.model!r} "
            f"(--model): give --model {made_by}, or another --memory file; the file is left as "
            "it is"
        ) from None
    except CorruptCacheError as e:
        raise UsageError(f"--memory {e}; the file is left as it is") from None
    except OSError as e:
        raise UsageError(f"--memory {path}: cannot read it: {e.strerror or e}") from None


def _made_by(path: Path) -> str | None:
    """The name of the model that made the memory file ``path`` (as its header records it),
    or None where it records none or cannot be read."""
    from ..states.files.read import read_state_file

    try:
        name = read_state_file(path).meta.get("model")
    except (OSError, KVEditError):
        return None
    return name if isinstance(name, str) and name else None


def _kept(path: Path, model, tok, args, budget: dict) -> dict:
    """``budget`` with ``--keep F`` as ``max_tokens``: round(F x the entries the memory in
    ``path`` holds per global layer now, on average), at least 1."""
    from ..memory.forgetting import global_entries

    entries = global_entries(_load(path, model, tok, args, {}).state)
    return {**budget, "max_tokens": max(1, round(args.keep * entries))}


def _opened(path: Path | None, model, tok, args, budget: dict):
    """:func:`open_memory`'s work."""
    from ..memory.conversation import Memory

    if getattr(args, "keep", None) is not None and path is not None and path.exists():
        budget = _kept(path, model, tok, args, budget)

    if budget:  # a budget the model cannot serve is a bad option, refused before the file
        try:
            Memory(model, tok, max_positions=args.max_positions, **budget)
        except (InvalidInputError, UnsupportedModelError) as e:
            # a budget too small is refused below, counting the memory's system message
            if NEVER_HOLDS not in message(e):
                raise UsageError(f"{_options(budget)}: {message(e)}") from None
    # focus reads one choice of entries per token: under --focus no KV head keeps its own
    focused = {"keep": "layer"} if args.focus else {}
    if path is None or not path.exists():
        return Memory(
            model,
            tok,
            system=args.system,
            prompt=args.prompt,
            max_positions=args.max_positions,
            **budget,
            **focused,
        )
    memory = _load(path, model, tok, args, budget)
    if args.focus and memory.budget is not None and memory.budget.per_head:
        if any(map(is_headwise, memory.state.layers)):
            raise UsageError(
                f"--focus: the memory {path} forgot per KV head (each head keeps its own "
                "entries), and focus reads the same entries on every head; leave --focus out, "
                "or give another --memory file"
            )
        memory = _load(path, model, tok, args, {**budget, **focused})  # nothing forgot per head
    if args.prompt is not None and args.prompt != memory.prompt:
        raise UsageError(
            f"--prompt {args.prompt}: the memory {path} uses the {memory.prompt!r} format; "
            "leave --prompt out, or give another --memory file"
        )
    if args.system is not None:
        messages = memory.messages
        held = messages[0].content if messages and messages[0].role == "system" else None
        if held != args.system:
            has = "no system message" if held is None else f"the system message {held!r}"
            raise UsageError(
                f"--system {args.system!r}: the memory {path} has {has}, and its messages are "
                "never rewritten; leave --system out, or give another --memory file"
            )
    return memory
