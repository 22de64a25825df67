"""The ``facts`` task of the memory suite: facts the user states in a long conversation, asked
for at the end.

Each conversation (:func:`facts_examples`) is ``n_messages`` messages after a system message:
user and assistant in turns. ``n_facts`` of the user messages state a fact ("My locker code is
4821."), the assistant restating it ("Noted: your locker code is 4821."); the others are unrelated chat with its replies
(:data:`CHAT`). The facts are spread evenly over the thirds of the conversation (the buckets
``early``, ``middle``, ``late``: :func:`~kvedit.evals.tasks.memory_schema.bucket_of` of the
message's pair), each in a seeded, distinct pair. Then each fact is asked for, in a seeded
order, with ``remember=False``: every question meets the same memory, so the questions are
independent and only the fact's age differs.

Fact kinds (:data:`KINDS`): codes (4 digits), names (a surname), dates (a month and a day),
licence plates (letters and digits), cities and pets' names; each kind has several subjects
(the locker, the bike lock, ...), and a conversation never asks two facts with the same
subject. Every gold answer occurs in the conversation's text only in its own pair, once in the
statement and once in the acknowledgement (normalized as the metric normalizes,
:func:`kvedit.evals.metrics.normalize_answer`): a value that would occur elsewhere is drawn
again.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvedit.errors import InvalidInputError
from kvedit.evals.metrics import normalize_answer
from kvedit.evals.tasks.memory_schema import BUCKETS, Conversation, Probe, bucket_of
from kvedit.evals.tasks.registry import register_memory_task

__all__ = ["CHAT", "FACTS_SYSTEM", "KINDS", "MAX_MESSAGES", "MIN_MESSAGES", "facts_examples"]

MIN_MESSAGES = 40
MAX_MESSAGES = 200
"""The conversation lengths the task makes (messages after the system message)."""

FACTS_SYSTEM = "You are a helpful assistant. Remember what the user tells you."

_SURNAMES = [
    "Okafor",
    "Lindqvist",
    "Marchetti",
    "Haddad",
    "Nakamura",
    "Brennan",
    "Kowalski",
    "Alvarez",
    "Petrov",
    "Mbeki",
    "Fitzgerald",
    "Castellano",
    "Drummond",
    "Oyelaran",
    "Vasquez",
    "Thorburn",
    "Achterberg",
    "Quintero",
]
_CITIES = [
    "Valparaiso",
    "Tromso",
    "Antofagasta",
    "Bratislava",
    "Ljubljana",
    "Cartagena",
    "Hobart",
    "Tbilisi",
    "Windhoek",
    "Reykjavik",
    "Asuncion",
    "Podgorica",
    "Kaunas",
    "Mombasa",
    "Trondheim",
    "Cuenca",
]
_PETS = [
    "Biscuit",
    "Pepper",
    "Waffles",
    "Juniper",
    "Noodle",
    "Marzipan",
    "Tofu",
    "Pickles",
    "Clementine",
    "Sprocket",
    "Dumpling",
    "Saffron",
    "Bramble",
    "Pistachio",
]
_MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
_LETTERS = "BCDFGHJKLMNPRSTVWXZ"


def _code(rng: random.Random) -> str:
    return str(rng.randrange(1000, 10000))


def _plate(rng: random.Random) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(2)) + "-" + str(rng.randrange(100, 1000))


def _date(rng: random.Random) -> str:
    return f"{rng.choice(_MONTHS)} {rng.randrange(10, 29)}"


KINDS: dict[str, tuple[Callable[[random.Random], str], tuple[tuple[str, str, str], ...]]] = {
    "code": (
        _code,
        (
            (
                "locker",
                "My locker code is {v}.",
                "What is my locker code?",
                "Noted: your locker code is {v}.",
            ),
            (
                "bike",
                "The code of my bike lock is {v}.",
                "What is the code of my bike lock?",
                "Noted: the code of your bike lock is {v}.",
            ),
            (
                "gate",
                "The gate code at my building is {v}.",
                "What is the gate code?",
                "Noted: the gate code at your building is {v}.",
            ),
            (
                "alarm",
                "My alarm code is {v}.",
                "What is my alarm code?",
                "Noted: your alarm code is {v}.",
            ),
        ),
    ),
    "name": (
        lambda rng: rng.choice(_SURNAMES),
        (
            (
                "dentist",
                "My new dentist is Dr. {v}.",
                "What is my dentist's name?",
                "Noted: your new dentist is Dr. {v}.",
            ),
            (
                "landlord",
                "My landlord's surname is {v}.",
                "What is my landlord's surname?",
                "Noted: your landlord's surname is {v}.",
            ),
            (
                "manager",
                "My manager is called Ms. {v}.",
                "What is my manager called?",
                "Noted: your manager is called Ms. {v}.",
            ),
        ),
    ),
    "date": (
        _date,
        (
            (
                "wedding",
                "My sister's wedding is on {v}.",
                "When is my sister's wedding?",
                "Noted: your sister's wedding is on {v}.",
            ),
            (
                "exam",
                "My driving exam is on {v}.",
                "When is my driving exam?",
                "Noted: your driving exam is on {v}.",
            ),
            (
                "flight",
                "My flight home is on {v}.",
                "When is my flight home?",
                "Noted: your flight home is on {v}.",
            ),
        ),
    ),
    "plate": (
        _plate,
        (
            (
                "car",
                "My car's licence plate is {v}.",
                "What is my car's licence plate?",
                "Noted: your car's licence plate is {v}.",
            ),
            (
                "van",
                "The licence plate of our van is {v}.",
                "What is our van's licence plate?",
                "Noted: the licence plate of your van is {v}.",
            ),
        ),
    ),
    "city": (
        lambda rng: rng.choice(_CITIES),
        (
            (
                "born",
                "I was born in {v}.",
                "In which city was I born?",
                "Noted: you were born in {v}.",
            ),
            (
                "moving",
                "Next year I am moving to {v}.",
                "Which city am I moving to?",
                "Noted: next year you are moving to {v}.",
            ),
        ),
    ),
    "pet": (
        lambda rng: rng.choice(_PETS),
        (
            (
                "cat",
                "My cat is named {v}.",
                "What is my cat's name?",
                "Noted: your cat is named {v}.",
            ),
            (
                "dog",
                "Our dog is called {v}.",
                "What is our dog called?",
                "Noted: your dog is called {v}.",
            ),
        ),
    ),
}
"""Fact kind -> (value generator, subjects: (subject, statement, question, acknowledgement)).
The assistant restates each fact: a bare "Noted." after every fact leads a small model to
answer "Noted." again instead of the fact (SmolLM2-135M did so on 118 of 270 questions)."""

ASK = "Earlier I told you this. {q} Answer in a few words."

CHAT: tuple[tuple[str, str], ...] = (
    ("How do I keep basil alive indoors?", "Give it bright light and water when the soil dries."),
    ("Any tips for a rainy weekend?", "Board games, a long book, or a slow stew all help."),
    ("What makes bread rise?", "Yeast eats sugars and releases gas that the dough traps."),
    ("Is tea better than coffee?", "Both are fine; tea has less caffeine per cup."),
    ("How should I store onions?", "Somewhere cool, dry and dark, away from potatoes."),
    ("Why is the sky blue?", "Air scatters short blue wavelengths more than red ones."),
    ("Can you suggest a stretch for my back?", "Try a slow cat and cow stretch on all fours."),
    ("What is a good warm up before running?", "Walk briskly, then add leg swings and skips."),
    ("How do I clean a cast iron pan?", "Hot water and a brush, then dry and oil it lightly."),
    ("What should I read next?", "A short story collection is a nice change of pace."),
    ("Why do cats purr?", "Mostly contentment, though they also purr to soothe themselves."),
    ("How can I sleep better?", "Keep a steady bedtime and dim the screens in the evening."),
    ("Is it worth learning to knit?", "Yes, it is calming and the tools are cheap."),
    ("How do I stop procrastinating?", "Start with a tiny step and set a short timer."),
    ("What goes well with lentils?", "Cumin, garlic, lemon and a handful of greens."),
    ("Should I water plants in the morning?", "Yes, mornings let leaves dry before night."),
    ("How do rainbows form?", "Sunlight bends and reflects inside raindrops."),
    ("Any ideas for a quick lunch?", "A wrap with hummus, greens and roasted vegetables."),
    ("What is a good habit to start?", "A short walk after dinner is easy to keep up."),
    ("How do I make rice fluffy?", "Rinse it, use less water, and let it rest covered."),
    ("Why do leaves change colour?", "Chlorophyll fades and other pigments show through."),
    ("What helps with a stiff neck?", "Gentle heat and slow turns of the head."),
    ("How do I fold a fitted sheet?", "Tuck the corners into each other, then fold flat."),
    ("Is walking good exercise?", "Yes, brisk walking is good for the heart."),
)
"""Unrelated chat: (user, assistant) pairs, free of digits and of every fact value."""


def _statement_pairs(n_pairs: int, n_facts: int, rng: random.Random) -> list[int]:
    """The pairs that state a fact: ``n_facts / 3`` distinct pairs in each third."""
    per = n_facts // 3
    chosen: list[int] = []
    for bucket in BUCKETS:
        pool = [p for p in range(n_pairs) if bucket_of(p, n_pairs) == bucket]
        if len(pool) < per:
            raise InvalidInputError(
                f"{n_facts} facts do not fit in {2 * n_pairs} messages ({len(pool)} pairs in "
                f"the {bucket} third, {per} needed)"
            )
        chosen += sorted(rng.sample(pool, per))
    return chosen


def _conversation(
    index: int, seed: int, n_messages: int, n_facts: int, attempts: int = 100
) -> Conversation:
    rng = random.Random(f"facts-{seed}-{index}")
    n_pairs = n_messages // 2
    subjects = [(kind, s) for kind, (_, subs) in KINDS.items() for s in subs]
    for _ in range(attempts):
        facts = rng.sample(subjects, n_facts)
        values = [KINDS[kind][0](rng) for kind, _ in facts]
        pairs = _statement_pairs(n_pairs, n_facts, rng)
        messages: list[tuple[str, str]] = [("system", FACTS_SYSTEM)]
        where = {}
        chat = list(CHAT)
        rng.shuffle(chat)
        for p in range(n_pairs):
            if p in pairs:
                k = pairs.index(p)
                where[k] = p
                _, statement, _, echo = facts[k][1]
                messages += [
                    ("user", statement.format(v=values[k])),
                    ("assistant", echo.format(v=values[k])),
                ]
            else:
                messages += list(zip(("user", "assistant"), chat[p % len(chat)]))
        text = f" {normalize_answer(' '.join(c for _, c in messages))} "
        if all(text.count(f" {normalize_answer(v)} ") == 2 for v in values):
            break
    else:
        raise InvalidInputError(f"could not draw {n_facts} distinct fact values")
    order = list(range(n_facts))
    rng.shuffle(order)
    probes = tuple(
        Probe(
            question=ASK.format(q=facts[k][1][2]),
            answers=(values[k],),
            bucket=bucket_of(where[k], n_pairs),
            where=2 * where[k] + 1,  # the message index, the system message being 0
        )
        for k in order
    )
    return Conversation(f"facts-s{seed}-e{index}", tuple(messages), probes, remember=False)


@register_memory_task(
    "facts",
    size="n_messages",
    questions="n_facts",
    help={
        "size": "messages after the system message (even, 40-200; default 60)",
        "questions": "facts stated, default 6",
    },
)
def facts_examples(
    n_examples: int = 10, seed: int = 0, n_messages: int = 60, n_facts: int = 6
) -> list[Conversation]:
    """``n_examples`` conversations of ``n_messages`` messages (after the system message),
    each stating ``n_facts`` facts (a multiple of 3: as many per third) and asking for them.
    Deterministic in its arguments; ids ``facts-s{seed}-e{i}``.

    Raises:
        InvalidInputError: ``n_messages`` odd or outside [:data:`MIN_MESSAGES`,
            :data:`MAX_MESSAGES`], ``n_facts`` not a positive multiple of 3 or more than the
            subjects (:data:`KINDS`) or the pairs of a third, ``n_examples`` below 1.
    """
    if not isinstance(n_examples, int) or n_examples < 1:
        raise InvalidInputError(f"n_examples must be at least 1, not {n_examples!r}")
    if (
        not isinstance(n_messages, int)
        or n_messages % 2
        or not MIN_MESSAGES <= n_messages <= MAX_MESSAGES
    ):
        raise InvalidInputError(
            f"n_messages must be an even number in [{MIN_MESSAGES}, {MAX_MESSAGES}], "
            f"not {n_messages!r}"
        )
    n_subjects = sum(len(subs) for _, subs in KINDS.values())
    if not isinstance(n_facts, int) or n_facts < 3 or n_facts % 3 or n_facts > n_subjects:
        raise InvalidInputError(
            f"n_facts must be a multiple of 3 in [3, {n_subjects}] (as many per third; "
            f"{n_subjects} subjects), not {n_facts!r}"
        )
    return [_conversation(i, seed, n_messages, n_facts) for i in range(n_examples)]
