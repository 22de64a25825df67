"""How a conversation becomes token ids: the renderers of :class:`kvedit.Memory`, by name.

A renderer turns the messages into a :class:`Rendering` (ids, text, each token's character
range, where each message's content lies) and gives the ids that open an assistant answer (the
generation prompt). Two are registered (:data:`RENDERERS`):

- ``"chat"`` (:class:`ChatRenderer`): the tokenizer's own chat template, rendered to text and
  tokenized as a whole without added special tokens (a template that writes the BOS token
  itself does not get a second one). This is what
  ``tokenizer.apply_chat_template(messages, tokenize=True)`` gives.
- ``"plain"`` (:class:`PlainRenderer`), for a base model: the BOS token when the tokenizer adds
  one, then per message its label (``"User:"``), a space and the content, and a blank line::

      System: You are terse.

      User: My locker code is 4821.

      Assistant: Noted.

  Each of the three parts is tokenized on its own and the ids concatenated, so a message's
  boundaries can never merge into one token with its neighbours (a text-level rendering would
  let ``"...4821."`` and the blank line after it tokenize differently once the next message
  follows). The generation prompt is the label ``"Assistant:"``; a base model must be stopped
  before it writes the next label (:data:`PLAIN_STOPS`).

A renderer is exact when its rendering of a conversation starts with the ids of the same
conversation less its last message (append-only); :class:`kvedit.Memory` checks that every
turn and refuses a template that rewrites earlier text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from jinja2 import TemplateError as JinjaError

from ..errors import InvalidInputError, TemplateError, UnsupportedModelError
from ..registry import Registry
from ..spans import zero_width_specials

__all__ = [
    "LABELS",
    "PLAIN_STOPS",
    "RENDERERS",
    "ROLES",
    "ChatRenderer",
    "Message",
    "PlainRenderer",
    "Renderer",
    "Rendering",
    "check_append_only",
    "check_readable",
    "common_prefix",
    "lone_surrogate",
    "renderer_for",
]

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have."""

LABELS = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
"""Each role's label in the ``"plain"`` format."""

PLAIN_STOPS = tuple(f"\n{label}:" for label in LABELS.values())
"""Where an answer in the ``"plain"`` format ends: a base model goes on writing the next
message (``"\\nUser: ..."``) after its answer."""


@dataclass(frozen=True)
class Message:
    """One message of a conversation: its ``role`` (one of :data:`ROLES`) and ``content``."""

    role: str
    content: str

    def to_json(self) -> dict[str, str]:
        """``{"role", "content"}``: the message as a memory file's ``messages`` hold it and a
        chat template reads it."""
        return {"role": self.role, "content": self.content}

    as_dict = to_json  # the name benchmarks/memory_speed.py still calls it by

    @classmethod
    def from_json(cls, data: Mapping) -> Message:
        """The message :meth:`to_json` wrote (not checked: a file's messages are checked
        first, :mod:`kvedit.memory.attached`)."""
        return cls(data["role"], data["content"])


@dataclass(frozen=True)
class Rendering:
    """A conversation as the model reads it.

    Attributes:
        ids: the token ids.
        text: the rendered text.
        offsets: ``[len(ids), 2]`` each token's character range in ``text`` (special tokens:
            zero width, so spans never select them).
        contents: per message, the character range of its content in ``text`` (``None``
            where the template does not hold the content verbatim).
        generation_prompt: whether it ends with the opening of an assistant answer.
    """

    ids: list[int]
    text: str
    offsets: torch.Tensor
    contents: list[tuple[int, int] | None]
    generation_prompt: bool = False


def lone_surrogate(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate (``"\\ud800"``: half of a UTF-16 pair, text no
    tokenizer can read, e.g. bytes decoded with ``errors="surrogateescape"``); None when it
    holds none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def check_readable(name: str, text: str) -> None:
    """Refuse a ``text`` holding a lone surrogate (:func:`lone_surrogate`), naming it ``name``:
    tokenizers raise a bare ``TypeError`` on it.

    Raises:
        InvalidInputError: naming the text and the character.
    """
    at = lone_surrogate(text)
    if at is not None:
        raise InvalidInputError(
            f"{name} holds a lone surrogate {text[at]!r} at character {at} (half of a UTF-16 "
            "pair, e.g. from bytes decoded with surrogateescape): not text a tokenizer can read"
        )


class Renderer:
    """Renders messages for one tokenizer. Subclasses define :meth:`render`."""

    name = ""
    stops: tuple[str, ...] = ()
    """Strings that end an answer (besides the model's EOS tokens)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def render(
        self,
        messages: Sequence[Message],
        generation_prompt: bool = False,
        after: Rendering | None = None,
    ) -> Rendering:
        """The ids of ``messages``; with ``generation_prompt``, followed by what opens an
        assistant answer. ``after``: a rendering of the first messages (without a generation
        prompt) the renderer may build on instead of tokenizing everything again; the result
        is the same ids."""
        raise NotImplementedError


def _usable(after: Rendering | None, messages: Sequence[Message]) -> bool:
    return (
        after is not None
        and not after.generation_prompt
        and 0 < len(after.contents) <= len(messages)
    )


def _zero_special(tokenizer, ids: Sequence[int], offsets: np.ndarray) -> torch.Tensor:
    out = torch.from_numpy(np.asarray(offsets, dtype=np.int64).reshape(-1, 2).copy())
    return zero_width_specials(tokenizer, ids, out)


class ChatRenderer(Renderer):
    """The tokenizer's chat template (``prompt="chat"``)."""

    name = "chat"

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise UnsupportedModelError(
                "the tokenizer has no chat template: use prompt='plain' (a base model's format)"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise UnsupportedModelError(
                "prompt='chat' needs a fast tokenizer (its character offsets place each message)"
            )
        super().__init__(tokenizer)

    def render(
        self,
        messages: Sequence[Message],
        generation_prompt: bool = False,
        after: Rendering | None = None,
    ) -> Rendering:
        """The template's text, tokenized as a whole. With ``after`` whose text the new text
        extends, only the text from ``after``'s last special token on is tokenized: a fast
        tokenizer splits its added (special) tokens out before anything else and tokenizes the
        text between them piece by piece, so the ids before that token cannot change."""
        if not messages and not generation_prompt:
            return Rendering([], "", torch.zeros(0, 2, dtype=torch.long), [])
        try:
            text = self.tokenizer.apply_chat_template(
                [m.to_json() for m in messages],
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except JinjaError as e:  # the template's own raise_exception, or a template bug
            raise TemplateError(
                f"the chat template refused the conversation ({type(e).__name__}: {e}); the "
                "memory is unchanged"
            ) from None
        k = self._last_special(after) if _usable(after, messages) else None
        if k is not None and text.startswith(after.text):
            cut = int(after.offsets[k, 0])
            tail, tail_offsets = self._tokenize(text[cut:])
            if tail[:1] == after.ids[k : k + 1]:
                ids = after.ids[:k] + tail
                offsets = torch.cat([after.offsets[:k], tail_offsets + cut])
                return Rendering(ids, text, offsets, _contents(text, messages), generation_prompt)
        ids, offsets = self._tokenize(text)
        return Rendering(ids, text, offsets, _contents(text, messages), generation_prompt)

    def _tokenize(self, text: str) -> tuple[list[int], torch.Tensor]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        return ids, _zero_special(self.tokenizer, ids, enc["offset_mapping"])

    def _last_special(self, after: Rendering) -> int | None:
        """The index of ``after``'s last special token (None without one)."""
        special = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        for k in range(len(after.ids) - 1, -1, -1):
            if after.ids[k] in special:
                return k
        return None


def _contents(text: str, messages: Sequence[Message]) -> list[tuple[int, int] | None]:
    """Each message's content range in ``text``, found in order (None where not verbatim)."""
    contents: list[tuple[int, int] | None] = []
    cursor = 0
    for m in messages:
        at = text.find(m.content, cursor) if m.content else -1
        if at < 0:
            contents.append(None)
            continue
        contents.append((at, at + len(m.content)))
        cursor = at + len(m.content)
    return contents


class PlainRenderer(Renderer):
    """The ``"plain"`` format for base models (module docstring)."""

    name = "plain"
    stops = PLAIN_STOPS

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        probe = tokenizer("x")["input_ids"]
        bos = getattr(tokenizer, "bos_token_id", None)
        self._bos = [int(bos)] if bos is not None and probe and probe[0] == bos else []
        self._bos_text = tokenizer.bos_token if self._bos else ""

    def _part(self, text: str) -> tuple[list[int], np.ndarray]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), np.asarray(enc["offset_mapping"], dtype=np.int64)

    def render(
        self,
        messages: Sequence[Message],
        generation_prompt: bool = False,
        after: Rendering | None = None,
    ) -> Rendering:
        """The parts' ids, concatenated; with ``after``, its ids and those of the messages
        after it (the same ids: each part is tokenized on its own)."""
        if _usable(after, messages):
            ids, text = list(after.ids), after.text
            offsets, contents = [after.offsets.numpy()], list(after.contents)
            new = messages[len(after.contents) :]
        else:
            ids, text = list(self._bos), self._bos_text
            offsets, contents = [np.zeros((len(ids), 2), dtype=np.int64)], []
            new = messages

        def put(part: str) -> None:
            nonlocal text
            part_ids, part_offsets = self._part(part)
            ids.extend(part_ids)
            offsets.append(part_offsets.reshape(-1, 2) + len(text))
            text += part

        for m in new:
            put(f"{LABELS[m.role]}:")
            contents.append((len(text) + 1, len(text) + 1 + len(m.content)))
            put(" " + m.content)
            put("\n\n")
        if generation_prompt:
            put(f"{LABELS['assistant']}:")
        offsets_all = _zero_special(self.tokenizer, ids, np.concatenate(offsets))
        return Rendering(ids, text, offsets_all, contents, generation_prompt)


RENDERERS: Registry[Callable[[object], Renderer]] = Registry("prompt format")
"""The prompt formats by name (``Memory(prompt=NAME)``; a :class:`kvedit.registry.Registry`):
``RENDERERS.register(name, cls)`` adds another."""
RENDERERS.register(ChatRenderer.name, ChatRenderer)
RENDERERS.register(PlainRenderer.name, PlainRenderer)


def renderer_for(prompt: str, tokenizer) -> Renderer:
    """The renderer registered as ``prompt`` for ``tokenizer``.

    Raises:
        InvalidInputError: no renderer of that name.
        UnsupportedModelError: ``"chat"`` for a tokenizer without a chat template.
    """
    if prompt not in RENDERERS:
        raise InvalidInputError(f"prompt must be one of {sorted(RENDERERS)}, not {prompt!r}")
    return RENDERERS[prompt](tokenizer)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_append_only(held: Rendering, new: Rendering, what: str, prompt: str, tokenizer) -> None:
    """Refuse ``new`` unless the ids (and text) of ``held`` are a prefix of it and it adds
    tokens (``what``: the message, question or answer being added).

    Raises:
        TemplateError: naming the prompt format, the token where the renderings part, and what
            each holds there.
    """
    n = len(held.ids)
    if new.ids[:n] != held.ids or not new.text.startswith(held.text):
        at = common_prefix(held.ids, new.ids)
        raise TemplateError(
            f"the {prompt!r} prompt format is not append-only here: with the {what} "
            f"added, the rendering differs from the {n} tokens already held at token {at} "
            f"(held {tokenizer.decode(held.ids[at : at + 8])!r}, now "
            f"{tokenizer.decode(new.ids[at : at + 8])!r}); the memory is unchanged"
        )
    if len(new.ids) == n:
        raise TemplateError(f"the {what} renders to no new tokens; the memory is unchanged")
