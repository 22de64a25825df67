"""A :class:`kvedit.Memory`'s file methods, :meth:`~MemoryFileMethods.save` and
:meth:`~MemoryFileMethods.load` (the file format: :mod:`kvedit.memory.files`), apart from the
conversation they save (:mod:`kvedit.memory.conversation`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Self

from .. import checks
from .files import (
    budget_keywords,
    check_as_file,
    file_key,
    held_from_file,
    load_keywords,
    merged_keywords,
    read_memory,
    write_memory,
)
from .held import check_model
from .smallest import check_holds, file_head_tokens

__all__ = ["MemoryFileMethods"]


class MemoryFileMethods:
    """What :class:`kvedit.Memory` does with its file (it holds ``_held``, ``_files``,
    ``budget``, ``exact_messages``, ``quantize`` and ``prompt``)."""

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the memory to one state file (the cache, sealed, with the messages in its
        header), atomically; returns the path. The whole file is written each time (46 KB per
        token on SmolLM2 in float32): save on demand (``kvedit chat`` saves on exit), not
        every turn.

        A file this memory loaded from or saved to is written again only while it is still
        the version it read or wrote last: one another writer saved meanwhile (a second chat
        on the same file) is refused, unless ``overwrite``.

        Raises:
            StateAlteredError: the memory's tensors were written in place
                (``mem.state.layers[i].values.mul_(...)``): its file would claim a cache it
                does not hold.
            FileChangedError: ``path`` changed since this memory loaded or saved it.
            InvalidInputError: a bad ``path``; StorageError: it cannot be written.
        """
        overwrite = checks.flag("overwrite", overwrite)
        self._state.check_unaltered("saving the memory")
        path = checks.path(path)
        key = file_key(path)
        keywords = budget_keywords(self.budget, self.exact_messages, self.quantize)
        known = None if overwrite else self._files.get(key)
        saved = write_memory(path, self._held, self.prompt, keywords, self.budget, known)
        self._files[key] = saved.version
        return saved.path

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        model,
        tokenizer,
        *,
        max_positions: int | None = None,
        **keywords,
    ) -> Self:
        """A memory saved with :meth:`save`, for ``model`` and ``tokenizer``.

        The messages are rendered again and must give the file's token ids exactly; every
        other field is checked against them (:mod:`kvedit.memory.attached`). The file keeps
        what was forgotten (its state), the rounds, and the budget and quantizing it was saved
        with, which hold from here on; a keyword given here (``max_tokens=``, ``max_bytes=``,
        ``forget=``, ``keep=``, ``exact_messages=``, ``protect=``, ``quantize=``,
        ``layer_floor=``, as for
        :class:`Memory`; their older names too)
        replaces the file's (``max_tokens=None``: no budget). ``prompt=`` and ``system=`` may
        be given only as the file's (a loaded memory keeps its messages and format).

        Raises:
            InvalidTypeError: an unknown keyword (before any work).
            InvalidInputError: no file at ``path``; a ``prompt=`` or ``system=`` that is not
                the file's; a budget the memory can never hold; the file's policy not
                registered here (without ``forget=``).
            CacheMismatchError: the file was made by another model or tokenizer.
            CorruptCacheError: not a memory file, damaged, a field that is not what
                :meth:`save` writes, or messages that do not render to its tokens.
        """
        check_model(model, tokenizer)
        given = load_keywords(keywords)
        prompt, system = given.pop("prompt", None), given.pop("system", None)
        found = read_memory(checks.path(path), model, tokenizer, max_positions)
        check_as_file(found, prompt, system)
        merged = merged_keywords(found.attachment.keywords, given)
        memory = cls(
            model, tokenizer, prompt=found.attachment.prompt, max_positions=max_positions, **merged
        )
        head = file_head_tokens(found.attachment)
        check_holds(memory.budget, memory.state, system_tokens=head, quantize=memory.quantize)
        memory._held = held_from_file(found, memory.budget)
        memory._files[file_key(path)] = found.version
        return memory
