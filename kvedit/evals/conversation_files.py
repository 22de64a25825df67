"""Conversations from files (``kvedit eval memory --conversations FILE``): a documented JSON
format for dialogs between people held over days, with questions about them, read into the
memory suite's :class:`~kvedit.evals.tasks.memory_schema.Conversation`.

The format (``docs/evals.md``, "Conversations from files"; the shipped example:
``kvedit/evals/data/example_conversation.json``)::

    {"conversations": [              # or one conversation object alone
      {"id": "ana-ben",              # optional (default: FILE's stem and the 1-based index)
       "speakers": ["Ana", "Ben"],   # the names the turns may use, in this order
       "system": "...",              # optional: the memory's system message
       "sessions": [
         {"date": "2024-03-02",      # every session is dated (free text, one line)
          "turns": [
            {"id": "D1:1",           # optional (default "D<session>:<turn>", 1-based)
             "speaker": "Ana", "text": "...",
             "date": "2024-03-02"}]}],   # optional: the turn's own date (else the session's)
       "questions": [
         {"question": "...", "answers": ["..."],     # one or more gold answers
          "evidence": ["D1:1"],                      # optional: the turns that hold the answer
          "category": "single-hop"}]}]}              # optional

Each turn becomes one memory message ``"[DATE] SPEAKER: TEXT"``. :data:`SPEAKER_MODES`:
``"user"`` (the default) makes every turn a user message (two people talking are both the
user's side, the assistant being the one asked afterwards); ``"alternate"`` makes the first
speaker's turns user messages and the second's assistant messages (a third speaker is
refused). The questions are asked after the last turn, each over the same memory
(``remember=False``). A question's bucket is the third of the turns its oldest evidence turn
sits in, and its age in turns the turns after that one (None without evidence).

A malformed file is refused with :class:`~kvedit.errors.InvalidExampleError` naming the file,
the line of the offending value (or of the object lacking it) and the field, before any model
loads; the limits (:data:`LIMITS`) are named in their errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvedit.errors import InvalidExampleError
from kvedit.evals.conversation_json import line_of, read_located
from kvedit.evals.tasks.memory_schema import Conversation, Probe, bucket_of

__all__ = [
    "FILE_TASK",
    "LIMITS",
    "SPEAKER_MODES",
    "DatedConversation",
    "Question",
    "Turn",
    "load_conversations",
    "read_conversations",
    "to_memory",
]

FILE_TASK = "conversations"
"""The task name a run on a conversation file records (``results.json``'s ``task``)."""

SPEAKER_MODES = ("user", "alternate")
"""How turns become memory messages (module docstring)."""

LIMITS = {
    "file_bytes": 16 * 2**20,
    "conversations": 100,
    "turns": 5_000,
    "turn_chars": 20_000,
    "sessions": 1_000,
    "questions": 1_000,
    "answers": 100,
    "evidence": 100,
    "speakers": 16,
    "name_chars": 100,
    "question_chars": 2_000,
}
"""The largest file (bytes); the most conversations per file, turns, sessions and questions
per conversation, answers and evidence ids per question, speakers; the most characters of a turn's text, of a name (speaker, id, date, category) and of a
question or an answer."""

_KEYS = {
    "file": ({"conversations"}, set()),
    "conversation": ({"speakers", "sessions", "questions"}, {"id", "system"}),
    "session": ({"date", "turns"}, set()),
    "turn": ({"speaker", "text"}, {"id", "date"}),
    "question": ({"question", "answers"}, {"evidence", "category"}),
}
"""Each object's required and optional keys."""


@dataclass(frozen=True)
class Turn:
    """One turn: its ``id``, ``speaker``, ``text``, ``date`` (its own or its session's) and the
    index of its ``session``."""

    id: str
    speaker: str
    text: str
    date: str
    session: int


@dataclass(frozen=True)
class Question:
    """A question, its gold ``answers``, the ``evidence`` turn ids and its ``category``."""

    question: str
    answers: tuple[str, ...]
    evidence: tuple[str, ...] = ()
    category: str | None = None


@dataclass(frozen=True)
class DatedConversation:
    """One conversation of a file: its turns in order, across its sessions."""

    id: str
    speakers: tuple[str, ...]
    system: str | None
    turns: tuple[Turn, ...]
    questions: tuple[Question, ...]


class _Reader:
    """Checks the parsed file, each error naming the file, the line and the field."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.source = path, text

    def fail(self, node: object, child: str | int | None, field: str, problem: str):
        line = line_of(self.source, node, child)
        where = f"{self.path}:{line}" if line is not None else str(self.path)
        return InvalidExampleError(f"{where}: {field}: {problem}")

    def obj(self, node: object, kind: str, field: str, parent=None, key=None) -> dict:
        if not isinstance(node, dict):
            raise self.fail(parent, key, field, f"a {kind} must be a JSON object")
        required, optional = _KEYS[kind]
        for k in node:
            if k not in required | optional:
                known = ", ".join(sorted(required | optional))
                raise self.fail(node, k, f"{field}.{k}", f"unknown key (a {kind} has {known})")
        for k in sorted(required - set(node)):
            raise self.fail(node, None, f"{field}.{k}", f"missing (a {kind} needs it)")
        return node

    def array(self, node: dict, key: str, field: str, limit: str, empty: bool = False) -> list:
        value = node[key]
        if not isinstance(value, list):
            raise self.fail(node, key, field, "must be a JSON array")
        if not value and not empty:
            raise self.fail(node, key, field, "must not be empty")
        if len(value) > LIMITS[limit]:
            raise self.fail(node, key, field, f"{len(value):,} items, over the limit of "
                            f"{LIMITS[limit]:,} {limit}")  # fmt: skip
        return value

    def text(self, node, key, field: str, limit: str, line: bool = True) -> str:
        value = node[key]
        if not isinstance(value, str) or not value.strip():
            raise self.fail(node, key, field, "must be a non-empty text")
        if len(value) > LIMITS[limit]:
            raise self.fail(node, key, field, f"{len(value):,} characters, over the limit of "
                            f"{LIMITS[limit]:,} ({limit})")  # fmt: skip
        if line and any(c in value for c in "\n\r\t\x00"):
            raise self.fail(node, key, field, "must be one line (no newline, tab or NUL)")
        return value.strip() if line else value

    def texts(self, node, key, field, limit, most: str) -> tuple[str, ...]:
        items = self.array(node, key, field, most, empty=key == "evidence")
        return tuple(self.text(items, k, f"{field}[{k}]", limit) for k in range(len(items)))

    def conversation(self, node: object, field: str, default_id: str, parent, key):
        node = self.obj(node, "conversation", field, parent, key)
        cid = self.text(node, "id", f"{field}.id", "name_chars") if "id" in node else default_id
        speakers = self.texts(node, "speakers", f"{field}.speakers", "name_chars", "speakers")
        if len(set(speakers)) != len(speakers):
            raise self.fail(node, "speakers", f"{field}.speakers", "a name is given twice")
        system = None
        if "system" in node:
            system = self.text(node, "system", f"{field}.system", "turn_chars", line=False)
        turns = self.sessions(node, field, speakers)
        questions = self.questions(node, field, {t.id for t in turns})
        return DatedConversation(cid, speakers, system, tuple(turns), tuple(questions))

    def sessions(self, node: dict, field: str, speakers: tuple[str, ...]) -> list[Turn]:
        sessions = self.array(node, "sessions", f"{field}.sessions", "sessions")
        turns: list[Turn] = []
        for s, session in enumerate(sessions):
            where = f"{field}.sessions[{s}]"
            session = self.obj(session, "session", where, sessions, s)
            date = self.text(session, "date", f"{where}.date", "name_chars")
            items = self.array(session, "turns", f"{where}.turns", "turns")
            for t, turn in enumerate(items):
                at = f"{where}.turns[{t}]"
                turn = self.obj(turn, "turn", at, items, t)
                tid = f"D{s + 1}:{t + 1}"
                if "id" in turn:
                    tid = self.text(turn, "id", f"{at}.id", "name_chars")
                if any(tid == u.id for u in turns):
                    raise self.fail(turn, "id" if "id" in turn else None, f"{at}.id",
                                    f"{tid!r} is another turn's id")  # fmt: skip
                speaker = self.text(turn, "speaker", f"{at}.speaker", "name_chars")
                if speaker not in speakers:
                    raise self.fail(turn, "speaker", f"{at}.speaker", f"{speaker!r} is not one "
                                    f"of the speakers ({', '.join(speakers)})")  # fmt: skip
                text = self.text(turn, "text", f"{at}.text", "turn_chars", line=False)
                own = (
                    self.text(turn, "date", f"{at}.date", "name_chars") if "date" in turn else date
                )
                turns.append(Turn(tid, speaker, text, own, s))
                if len(turns) > LIMITS["turns"]:
                    raise self.fail(items, t, at, f"over the limit of {LIMITS['turns']:,} turns "
                                    "in a conversation")  # fmt: skip
        return turns

    def questions(self, node: dict, field: str, ids: set[str]) -> list[Question]:
        items = self.array(node, "questions", f"{field}.questions", "questions")
        out = []
        for q, item in enumerate(items):
            at = f"{field}.questions[{q}]"
            item = self.obj(item, "question", at, items, q)
            text = self.text(item, "question", f"{at}.question", "question_chars", line=False)
            answers = self.texts(item, "answers", f"{at}.answers", "question_chars", "answers")
            evidence: tuple[str, ...] = ()
            if "evidence" in item:
                evidence = self.texts(item, "evidence", f"{at}.evidence", "name_chars", "evidence")
                for k, tid in enumerate(evidence):
                    if tid not in ids:
                        raise self.fail(item["evidence"], k, f"{at}.evidence[{k}]",
                                        f"{tid!r} is no turn's id")  # fmt: skip
            category = None
            if "category" in item:
                category = self.text(item, "category", f"{at}.category", "name_chars")
            out.append(Question(text, answers, evidence, category))
        return out


def read_conversations(path: str | Path) -> list[DatedConversation]:
    """The conversations of the file at ``path`` (the format: module docstring).

    Raises:
        InvalidExampleError: naming the file, the line and the field: a file missing, too
            large, not UTF-8 or not JSON, a key unknown or missing, a value of the wrong kind,
            empty or over its limit (:data:`LIMITS`), a speaker not listed, an id given twice,
            evidence naming no turn.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > LIMITS["file_bytes"]:
            raise InvalidExampleError(f"{path}: {size:,} bytes, over the limit of "
                                      f"{LIMITS['file_bytes']:,} (file_bytes)")  # fmt: skip
        data = path.read_bytes()
    except OSError as e:
        raise InvalidExampleError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InvalidExampleError(f"{path}:{line}: not UTF-8 text") from None
    root = read_located(path, text)
    reader = _Reader(path, text)
    if isinstance(root, dict) and "sessions" in root:
        return [reader.conversation(root, "conversation", f"{path.stem}-1", None, None)]
    root = reader.obj(root, "file", "file")
    items = reader.array(root, "conversations", "conversations", "conversations")
    out = [
        reader.conversation(c, f"conversations[{k}]", f"{path.stem}-{k + 1}", items, k)
        for k, c in enumerate(items)
    ]
    for k, conv in enumerate(out):
        if any(c.id == conv.id for c in out[:k]):
            raise reader.fail(items[k], "id" if "id" in items[k] else None,
                              f"conversations[{k}].id", f"{conv.id!r} is another conversation's "
                              "id")  # fmt: skip
    return out


def to_memory(conversation: DatedConversation, speakers: str = "user") -> Conversation:
    """``conversation`` as the memory suite's :class:`Conversation` (module docstring: each
    turn one message ``"[DATE] SPEAKER: TEXT"``, its role by ``speakers``).

    Raises:
        InvalidExampleError: ``speakers`` not one of :data:`SPEAKER_MODES`, or ``"alternate"``
            for a conversation with more than two speakers.
    """
    if speakers not in SPEAKER_MODES:
        raise InvalidExampleError(f"--speakers {speakers!r}: one of {', '.join(SPEAKER_MODES)}")
    if speakers == "alternate" and len(conversation.speakers) > 2:
        raise InvalidExampleError(
            f"--speakers alternate: conversation {conversation.id!r} has "
            f"{len(conversation.speakers)} speakers ({', '.join(conversation.speakers)}); "
            "alternate takes two (the first the user, the second the assistant): use --speakers user"
        )
    roles = {name: "user" for name in conversation.speakers}
    if speakers == "alternate" and len(conversation.speakers) == 2:
        roles[conversation.speakers[1]] = "assistant"
    head = [] if conversation.system is None else [("system", conversation.system)]
    messages = head + [
        (roles[t.speaker], f"[{t.date}] {t.speaker}: {t.text}") for t in conversation.turns
    ]
    index = {t.id: k for k, t in enumerate(conversation.turns)}
    n = len(conversation.turns)
    probes = []
    for q in conversation.questions:
        oldest = min((index[e] for e in q.evidence), default=None)
        probes.append(
            Probe(
                question=q.question,
                answers=q.answers,
                bucket=None if oldest is None else bucket_of(oldest, n),
                where=None if oldest is None else oldest + len(head),
                category=q.category,
                evidence=q.evidence,
                age_turns=None if oldest is None else n - 1 - oldest,
            )
        )
    return Conversation(conversation.id, tuple(messages), tuple(probes), remember=False)


def load_conversations(path: str | Path, speakers: str = "user") -> list[Conversation]:
    """The file's conversations as the memory suite's (:func:`read_conversations`, then
    :func:`to_memory` with ``speakers``)."""
    if speakers not in SPEAKER_MODES:
        raise InvalidExampleError(f"--speakers {speakers!r}: one of {', '.join(SPEAKER_MODES)}")
    return [to_memory(c, speakers) for c in read_conversations(path)]
