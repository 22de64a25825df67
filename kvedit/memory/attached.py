"""A memory file's attachment, read strictly: :func:`parse_attachment` (and
:func:`check_fields`, the same checks without the tokenizer).

:meth:`kvedit.Memory.save` writes the conversation in the state file's header (its
``attachment``: the prompt format, the messages, their :class:`~kvedit.memory.records.Turn`
records, the forgetting rounds and the budget's keywords). The seal covers it, but a file
resealed without this installation's key (history ``unknown``, loadable explicitly) can claim
anything there: turns spanning a million tokens (then nothing can be forgotten), a role
``bot``, a turn whose content is not its message's, a round of the wrong type that breaks
:meth:`~kvedit.Memory.explain` later. So every field is checked at load, against its type and
against the rendering of the file's messages, and anything else is a
:class:`~kvedit.errors.CorruptCacheError` naming the file and the field:

- ``kind`` and ``version`` (:data:`ATTACHMENT_VERSION`; another version is refused), no
  unknown field;
- ``prompt``: a registered prompt format; ``messages``: at most
  :data:`~kvedit.memory.records.MAX_MESSAGES`, each exactly ``role`` (one of
  :data:`~kvedit.memory.rendering.ROLES`) and a non-empty ``content``; rendered again, they
  must give the state's token ids;
- ``turns``: one per message, its ``index``, ``role`` and ``content`` the message's, ``start``
  and ``end`` the rendering's message boundaries, ``source`` one of
  :data:`~kvedit.memory.records.SOURCES`, the counts non-negative ints of at most its tokens;
- ``rounds``: ``at_message`` a message's index (in order), ``before >= after >= 0`` entries,
  ``before`` at most the tokens held then, ``seconds`` finite and non-negative, ``policy`` a
  string;
- ``budget``: the ``Memory`` keywords it keeps (:data:`BUDGET_KEYWORDS`, older names among
  them: ``recent`` for ``exact_messages``, ``per_head`` and ``per_layer`` for ``keep``), each of
  its type and range; ``forget`` a policy's name (one not registered here is refused at load
  unless ``forget=`` replaces it: :func:`kvedit.memory.files.merged_keywords`);
- ``scores``: the arrival policy that scored the entries (a name) and the layers whose
  scores the file holds (checked against the state's global layers by
  :func:`kvedit.memory.files.read_memory`).

The boundaries are found by rendering every prefix of the conversation again (what building it
did, message after message: quadratic in the messages for a chat template) for a file this
installation did not seal; a sealed file (its MAC verifies: :meth:`kvedit.Memory.save` wrote
it) has its turns checked to tile the state's tokens in order instead.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from .. import checks
from ..cache.packed import BITS
from ..errors import CorruptCacheError, InvalidInputError, KVEditError
from ..spans import as_span_list
from .budget import span_from_json
from .budget_checks import checked_layer_floor
from .forgetting import Round
from .keeping import KEEPS
from .records import MAX_MESSAGES, SOURCES, Turn
from .rendering import RENDERERS, ROLES, Message, Rendering, lone_surrogate, renderer_for
from .repositioning import REPOSITIONS

__all__ = [
    "ATTACHMENT_KIND",
    "ATTACHMENT_VERSION",
    "BUDGET_KEYWORDS",
    "Attachment",
    "Fields",
    "check_fields",
    "parse_attachment",
]

ATTACHMENT_KIND = "kvedit.memory"
"""What a memory file's header attachment says it is."""

ATTACHMENT_VERSION = 1
"""The attachment version :meth:`kvedit.Memory.save` writes and :func:`parse_attachment` reads."""

BUDGET_KEYWORDS = (
    "max_tokens",
    "max_bytes",
    "forget",
    "exact_messages",
    "recent",
    "recent_tokens",
    "keep",
    "per_head",
    "per_layer",
    "protect",
    "quantize",
    "reposition",
    "layer_floor",
)
"""The ``Memory`` keywords a memory file keeps (``recent``, ``per_head`` and ``per_layer``: the
older names of ``exact_messages`` and ``keep``, read in files written before)."""

_FIELDS = {"kind", "version", "prompt", "messages", "turns", "rounds", "budget", "scores"}
_REQUIRED = {"kind", "version", "prompt", "messages", "turns"}
_TURN_FIELDS = {f.name for f in dataclasses.fields(Turn)}
_TURN_REQUIRED = {"index", "role", "content", "start", "end", "source", "computed"}
_ROUND_FIELDS = {f.name for f in dataclasses.fields(Round)}


class _Bad(Exception):
    """A field of the attachment that is not what :meth:`Memory.save` writes: ``field`` and
    what is wrong with it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")


@dataclasses.dataclass(frozen=True)
class Attachment:
    """A memory file's attachment, checked: the ``prompt`` format, the ``messages``, their
    ``turns``, the forgetting ``rounds``, the messages' ``rendering`` (its ids are the
    state's) and the ``Memory`` ``keywords`` of its budget (empty for a file that has none)."""

    prompt: str
    messages: list[Message]
    turns: list[Turn]
    rounds: list[Round]
    rendering: Rendering
    keywords: dict
    scores: dict | None = None


@dataclasses.dataclass(frozen=True)
class Fields:
    """A memory file's attachment fields, checked without the tokenizer
    (:func:`check_fields`): the ``prompt`` format, the ``messages``, their ``turns``, the
    forgetting ``rounds``, the ``Memory`` ``keywords`` of its budget (empty for a file that has
    none) and the ``scores`` field (None: none)."""

    prompt: str
    messages: list[Message]
    turns: list[Turn]
    rounds: list[Round]
    keywords: dict
    scores: dict | None = None


def _int(field: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(field, f"is {value!r}, not an int")
    if value < minimum or (maximum is not None and value > maximum):
        top = "" if maximum is None else f" and at most {maximum}"
        raise _Bad(field, f"is {value}, not at least {minimum}{top}")
    return value


def _list(field: str, value) -> list:
    if not isinstance(value, list):
        raise _Bad(field, f"is {checks.describe(value)}, not a list")
    return value


def _keys(field: str, value, allowed: set, required: set) -> dict:
    if not isinstance(value, dict):
        raise _Bad(field, f"is {checks.describe(value)}, not an object")
    if not set(value) <= allowed or not required <= set(value):
        odd = sorted(set(value) - allowed) or sorted(required - set(value))
        raise _Bad(field, f"has the fields {sorted(value)} ({odd} unexpected or missing)")
    return value


def _messages(value) -> list[Message]:
    items = _list("messages", value)
    if len(items) > MAX_MESSAGES:
        raise _Bad("messages", f"hold {len(items)}, more than a memory holds ({MAX_MESSAGES})")
    out = []
    for i, item in enumerate(items):
        m = _keys(f"messages[{i}]", item, {"role", "content"}, {"role", "content"})
        if m["role"] not in ROLES:
            raise _Bad(f"messages[{i}].role", f"is {m['role']!r}, not one of {list(ROLES)}")
        content = m["content"]
        if not isinstance(content, str) or not content or lone_surrogate(content) is not None:
            raise _Bad(f"messages[{i}].content", f"is {checks.describe(content)}, not a text")
        out.append(Message.from_json(m))
    return out


def _turn(i: int, value, message: Message, start: int, end: int) -> Turn:
    field = f"turns[{i}]"
    t = _keys(field, value, _TURN_FIELDS, _TURN_REQUIRED)
    if _int(f"{field}.index", t["index"]) != i:
        raise _Bad(f"{field}.index", f"is {t['index']}, not {i}")
    if t["role"] != message.role or t["content"] != message.content:
        raise _Bad(field, f"does not hold message {i}'s role and content (role {t['role']!r})")
    for key, bound in (("start", start), ("end", end)):
        if _int(f"{field}.{key}", t[key]) != bound:
            raise _Bad(
                f"{field}.{key}", f"is {t[key]}, not the rendering's message boundary {bound}"
            )
    if t["source"] not in SOURCES:
        raise _Bad(f"{field}.source", f"is {t['source']!r}, not one of {list(SOURCES)}")
    for key in ("computed", "kept", "recomputed"):
        _int(f"{field}.{key}", t.get(key, 0), maximum=end - start)
    _int(f"{field}.nbytes", t.get("nbytes", 0), maximum=2**62)
    if not isinstance(t.get("note", ""), str):
        raise _Bad(f"{field}.note", f"is {checks.describe(t['note'])}, not a text")
    return Turn.from_json(t)


def _round(i: int, value, bounds: Sequence[int], last: int) -> Round:
    field = f"rounds[{i}]"
    r = _keys(field, value, _ROUND_FIELDS, _ROUND_FIELDS)
    at = _int(f"{field}.at_message", r["at_message"], minimum=last, maximum=len(bounds) - 2)
    if not isinstance(r["policy"], str) or not r["policy"]:
        raise _Bad(f"{field}.policy", f"is {checks.describe(r['policy'])}, not a policy name")
    before = _int(f"{field}.before", r["before"], maximum=bounds[at + 1])  # ran after it
    _int(f"{field}.after", r["after"], maximum=before)
    seconds = r["seconds"]
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        raise _Bad(f"{field}.seconds", f"is {seconds!r}, not a finite number of seconds")
    return Round.from_json(r)


def _span(field: str, item):
    """A span written by :func:`kvedit.memory.budget.span_to_json`, checked."""
    if isinstance(item, dict) and set(item) == {"text"} and isinstance(item["text"], str):
        return span_from_json(item)
    if (
        isinstance(item, dict)
        and set(item) == {"pattern", "flags"}
        and isinstance(item["pattern"], str)
    ):
        _int(f"{field}.flags", item["flags"])
        try:
            return span_from_json(item)
        except (re.error, ValueError, OverflowError) as e:
            raise _Bad(field, f"is not a pattern ({e})") from None
    if isinstance(item, dict) and set(item) == {"chars"}:
        chars = _list(f"{field}.chars", item["chars"])
        if len(chars) == 2:
            _int(f"{field}.chars", chars[0])
            _int(f"{field}.chars", chars[1])
            return span_from_json(item)
    raise _Bad(field, f"is {checks.describe(item)}, not a span")


def _budget(value) -> dict:
    """The budget keywords of a file (:func:`kvedit.memory.files.budget_keywords`), each of its
    type and range."""
    if value is None:
        return {}
    kw = dict(_keys("budget", value, set(BUDGET_KEYWORDS), set()))
    for key in ("max_tokens", "max_bytes"):
        if kw.get(key) is not None:
            _int(f"budget.{key}", kw[key], minimum=1)
    if kw.get("max_tokens") is not None and kw.get("max_bytes") is not None:
        raise _Bad("budget", "gives both max_tokens and max_bytes")
    for key in ("exact_messages", "recent", "recent_tokens"):
        if key in kw:
            _int(f"budget.{key}", kw[key])
    if "reposition" in kw and kw["reposition"] not in REPOSITIONS:
        raise _Bad("budget.reposition", f"is {kw['reposition']!r}, not one of {list(REPOSITIONS)}")
    if "layer_floor" in kw:
        try:
            checked_layer_floor(kw["layer_floor"], "budget.layer_floor")
        except InvalidInputError:
            said = checks.describe(kw["layer_floor"])
            raise _Bad("budget.layer_floor", f"is {said}, not a number in [0, 1)") from None
    if "keep" in kw and kw["keep"] not in KEEPS:
        raise _Bad("budget.keep", f"is {kw['keep']!r}, not one of {list(KEEPS)}")
    for key in ("per_head", "per_layer"):
        if kw.get(key) is not None and not isinstance(kw[key], bool):
            raise _Bad(f"budget.{key}", f"is {kw[key]!r}, not a bool or null")
    if kw.get("quantize") is not None and (
        isinstance(kw["quantize"], bool) or kw["quantize"] not in BITS
    ):
        raise _Bad("budget.quantize", f"is {kw['quantize']!r}, not one of {list(BITS)} or null")
    if "forget" in kw and (not isinstance(kw["forget"], str) or not kw["forget"]):
        raise _Bad("budget.forget", f"is {checks.describe(kw['forget'])}, not a policy's name")
    if "protect" in kw:
        items = _list("budget.protect", kw["protect"])
        spans = [_span(f"budget.protect[{i}]", s) for i, s in enumerate(items)]
        try:
            as_span_list(spans)
        except KVEditError as e:
            raise _Bad("budget.protect", f"is not a list of spans ({e})") from None
        kw["protect"] = spans
    return kw


def _tiled(turns: list, n_tokens: int) -> list[int]:
    """Each message's first token, then the end, from the turns' own boundaries: they must
    tile the ``n_tokens`` in order (what a sealed file's turns are checked to do)."""
    bounds = [0]
    for i, t in enumerate(turns):
        start = t.get("start") if isinstance(t, dict) else None
        if start != bounds[-1]:
            where = f"where turns[{i - 1}] ends" if i else "the first token"
            raise _Bad(f"turns[{i}].start", f"is {start!r}, not {where} ({bounds[-1]})")
        bounds.append(_int(f"turns[{i}].end", t.get("end"), minimum=bounds[-1] + 1))
    if bounds[-1] != n_tokens:
        raise _Bad("turns", f"end at token {bounds[-1]}, not at the file's {n_tokens} tokens")
    return bounds


def _rendered(renderer, messages: list[Message], full: Rendering) -> list[int]:
    """Each message's first token, then the end: the rendering's message boundaries, found by
    rendering every prefix again (module docstring)."""
    bounds, held = [0], None
    for i in range(1, len(messages)):
        held = renderer.render(messages[:i], after=held)
        if full.ids[: len(held.ids)] != held.ids:
            raise _Bad("messages", f"do not render append-only: message {i} rewrites earlier ids")
        bounds.append(len(held.ids))
    return [*bounds, len(full.ids)]


def _memory(attachment, path) -> None:
    """Refuses an attachment that is not a memory's."""
    if not isinstance(attachment, dict) or attachment.get("kind") != ATTACHMENT_KIND:
        raise CorruptCacheError(f"{path}: a state file, not a memory (Memory.save writes one)")


def _head(attachment: dict) -> tuple[dict, list[Message], list]:
    """The attachment's fields, version, prompt format and messages checked, and its turns
    (still unchecked), one per message."""
    a = _keys("attachment", attachment, _FIELDS, _REQUIRED)
    if _int("version", a["version"]) != ATTACHMENT_VERSION:
        raise _Bad("version", f"{a['version']} is not supported (this kvedit reads 1)")
    if a["prompt"] not in RENDERERS:
        raise _Bad("prompt", f"is {a['prompt']!r}, not one of {sorted(RENDERERS)}")
    messages = _messages(a["messages"])
    turns = _list("turns", a["turns"])
    if len(turns) != len(messages):
        raise _Bad("turns", f"are {len(turns)} for {len(messages)} messages")
    return a, messages, turns


def _rest(a: dict, messages: list[Message], turns: list, bounds: list[int]) -> Fields:
    """The turns at the message ``bounds``, the rounds, the budget and the scores, checked."""
    parsed = [
        _turn(i, t, m, bounds[i], bounds[i + 1])
        for i, (t, m) in enumerate(zip(turns, messages, strict=True))
    ]
    rounds, last = [], 0
    for i, r in enumerate(_list("rounds", a.get("rounds", []))):
        rounds.append(_round(i, r, bounds, last))
        last = rounds[-1].at_message
    keywords = _budget(a.get("budget"))
    return Fields(a["prompt"], messages, parsed, rounds, keywords, _scores(a.get("scores")))


def check_fields(attachment, path, n_tokens: int) -> Fields:
    """The :class:`Fields` of a memory file at ``path`` whose state holds ``n_tokens`` tokens,
    checked as :func:`parse_attachment` checks them without the tokenizer: the messages are
    not rendered again, the turns must tile the ``n_tokens`` in order instead (what a load
    checks of a file this installation sealed).

    Raises:
        CorruptCacheError: not a memory file, or a field that is not what
            :meth:`kvedit.Memory.save` writes (naming the file and the field).
    """
    _memory(attachment, path)
    try:
        a, messages, turns = _head(attachment)
        return _rest(a, messages, turns, _tiled(turns, n_tokens))
    except _Bad as e:
        raise CorruptCacheError(f"{path}: the memory's {e}") from None


def parse_attachment(
    attachment, path, token_ids: list[int], tokenizer, trusted: bool
) -> Attachment:
    """The :class:`Attachment` of a memory file at ``path`` whose state holds ``token_ids``
    (module docstring); ``trusted``: this installation sealed the file.

    Raises:
        CorruptCacheError: not a memory file, or a field that is not what
            :meth:`kvedit.Memory.save` writes (naming the file and the field).
    """
    _memory(attachment, path)
    try:
        a, messages, turns = _head(attachment)
        renderer = renderer_for(a["prompt"], tokenizer)
        try:  # an empty memory holds no token, not even the BOS its rendering opens with
            full = renderer.render(messages)
        except KVEditError as e:
            raise _Bad("messages", f"do not render ({e})") from None
        if (full.ids if messages else []) != token_ids:
            raise CorruptCacheError(
                f"{path}: the memory's {len(messages)} messages do not render to its "
                f"{len(token_ids)} tokens"
            )
        if not messages:
            bounds = [0]
        elif trusted:
            bounds = _tiled(turns, len(full.ids))
        else:
            bounds = _rendered(renderer, messages, full)
        f = _rest(a, messages, turns, bounds)
    except _Bad as e:
        raise CorruptCacheError(f"{path}: the memory's {e}") from None
    return Attachment(f.prompt, f.messages, f.turns, f.rounds, full, f.keywords, f.scores)


def _scores(value) -> dict | None:
    """The ``scores`` field: the arrival policy that scored the entries and the layers whose
    scores the file holds (``attached.scores.{layer}``), or None."""
    if value is None:
        return None
    kw = _keys("scores", value, {"policy", "layers", "key"}, {"policy", "layers"})
    if not isinstance(kw["policy"], str) or not kw["policy"]:
        raise _Bad("scores.policy", f"is {checks.describe(kw['policy'])}, not a policy's name")
    key = kw.get("key")
    if key is not None and (not isinstance(key, str) or not key):
        raise _Bad("scores.key", f"is {checks.describe(key)}, not a scorer's key")
    layers = [
        _int(f"scores.layers[{i}]", x) for i, x in enumerate(_list("scores.layers", kw["layers"]))
    ]
    out = {"policy": kw["policy"], "layers": layers}
    return out if key is None else {**out, "key": key}
