"""The record wordings of :mod:`benchmarks.focus_scale`: a context of ``n`` one-line records
after an instruction, the question that asks each record, and how an answer is read.

- ``secret`` (focus was tuned on it): "<First Last>'s secret number is <4 digits>." (every name
  once);
- ``doors`` (held out: never tuned on): "The access code for the <colour> <material> door is
  <4 digits>.", each door a distinct pair from a grid of colours by materials, so each of the
  question's telling words is shared by several lines and only the gold holds both;
- ``moves`` (held out): "In <year> <First Last> moved to <city>.", each person on several lines
  (each a different year and city) and each year on many, every (person, year) pair once;
- ``lessons`` and ``visits`` (tuning wordings of the same two shapes, added to tune the rule
  for such questions, :func:`kvedit.focusing.scoring.sole_holder`, without the held-out ones):
  "The <instrument> teacher in <town> charges <number> dollars an hour." (instruments by towns,
  as doors) and "In <month> <First Last> visited <country>." (people on several lines, each
  month on many, as moves).
"""

from __future__ import annotations

import math
import random
import re

from benchmarks.make_custom_records import FIRST, LAST
from kvedit.errors import InvalidInputError

INSTRUCTION = "Read the records and answer the question."
WORDINGS = ("secret", "doors", "moves", "lessons", "visits")
"""The record wordings: ``secret``, ``lessons`` and ``visits`` are tuned on, ``doors`` and
``moves`` are held out."""
HELD_OUT = ("doors", "moves")
"""The wordings no rule of focus was tuned on."""
COLOURS = [
    "red", "blue", "green", "yellow", "orange", "purple", "pink", "brown", "black", "white",
    "grey", "teal", "navy", "maroon", "olive", "lime", "cyan", "magenta", "beige", "ivory",
    "amber", "crimson", "indigo", "violet", "rust", "coral", "tan", "scarlet", "jade", "plum",
]  # fmt: skip
MATERIALS = ["oak", "maple", "pine", "steel", "iron", "glass", "brass", "walnut", "cedar", "copper"]
CITIES = [
    "Porto", "Lyon", "Oslo", "Vienna", "Prague", "Dublin", "Lisbon", "Madrid", "Berlin", "Munich",
    "Zurich", "Geneva", "Milan", "Turin", "Naples", "Athens", "Krakow", "Warsaw", "Budapest",
    "Helsinki", "Stockholm", "Copenhagen", "Hamburg", "Seville", "Valencia", "Bilbao", "Bordeaux",
    "Marseille", "Nantes", "Antwerp", "Rotterdam", "Utrecht", "Bergen", "Tallinn", "Riga",
    "Vilnius", "Sofia", "Zagreb", "Ljubljana", "Bratislava",
]  # fmt: skip
YEARS = list(range(1980, 2025))
MOVES_PER_PERSON = 4
"""``moves``: the lines (years, cities) of one person."""
LINES_PER_YEAR = 10
"""``moves``: about how many lines share a year (at least ``MOVES_PER_PERSON`` years)."""


INSTRUMENTS = [
    "piano",
    "violin",
    "guitar",
    "cello",
    "flute",
    "drums",
    "harp",
    "trumpet",
    "banjo",
    "oboe",
]
TOWNS = [
    "Ashford", "Brampton", "Carlow", "Dunmore", "Elmstead", "Fairview", "Glenrock", "Hartwell",
    "Ivybridge", "Kingsley", "Larkfield", "Millbrook", "Northam", "Oakhurst", "Pinewood",
    "Queensbury", "Redhill", "Stanton", "Thornbury", "Upton", "Westcott", "Yarmouth", "Ambleside",
    "Bexley", "Crawley", "Didcot", "Epsom", "Frome", "Goring", "Hexham",
]  # fmt: skip
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
]  # fmt: skip
COUNTRIES = [
    "Peru", "Chile", "Kenya", "Nepal", "Japan", "Egypt", "Ghana", "Cuba", "Fiji", "Iran", "Iraq",
    "Laos", "Mali", "Oman", "Chad", "Togo", "Niger", "Malta", "Spain", "Italy",
]  # fmt: skip


def grid(n: int, rows: list[str], columns: list[str], rng: random.Random) -> list[tuple[str, str]]:
    """``n`` distinct (row, column) pairs: ``min(len(columns), ceil(sqrt(n)))`` columns by
    ``ceil(n / columns)`` rows drawn from the lists, less a diagonal of the cells over ``n``
    (one per row and column), so every row and column word is on several pairs; shuffled."""
    m = min(len(columns), math.ceil(math.sqrt(n)))
    c = math.ceil(n / m)
    picked_rows, picked_columns = rng.sample(rows, c), rng.sample(columns, m)
    drop = {(i, i) for i in range(c * m - n)}  # c * m - n < m and <= c: one cell per row/column
    pairs = [
        (a, b)
        for i, a in enumerate(picked_rows)
        for j, b in enumerate(picked_columns)
        if (i, j) not in drop
    ]
    rng.shuffle(pairs)
    return pairs


def secret_records(n: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """``n`` records "<name>'s secret number is <number>.", their questions and answers."""
    rng = random.Random(f"focus-scale-{n}-{seed}")
    names = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], n)
    numbers = [str(x) for x in rng.sample(range(1000, 10000), n)]
    records = [f"{a}'s secret number is {b}." for a, b in zip(names, numbers, strict=True)]
    return records, [f"What is {a}'s secret number?" for a in names], numbers


def door_records(n: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """``n`` records "The access code for the <colour> <material> door is <code>.", their
    questions and answers: the doors are a ``colours x materials`` :func:`grid` (materials
    ``min(10, ceil(sqrt(n)))``, colours ``ceil(n / materials)``) less a diagonal of
    ``colours * materials - n`` cells, so every colour and every material is on at least
    ``materials - 1`` and ``colours - 1`` lines, and each door is named once."""
    if not 1 <= n <= len(COLOURS) * len(MATERIALS):
        raise InvalidInputError(f"doors: 1 to {len(COLOURS) * len(MATERIALS)} records, not {n}")
    rng = random.Random(f"focus-scale-doors-{n}-{seed}")
    doors = [f"{a} {b}" for a, b in grid(n, COLOURS, MATERIALS, rng)]
    codes = [str(x) for x in rng.sample(range(1000, 10000), n)]
    records = [
        f"The access code for the {d} door is {x}." for d, x in zip(doors, codes, strict=True)
    ]
    return records, [f"What is the access code for the {d} door?" for d in doors], codes


def lesson_records(n: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """``n`` records "The <instrument> teacher in <town> charges <price> dollars an hour.",
    their questions and answers: the teachers a ``towns x instruments`` :func:`grid`, as
    :func:`door_records`'s doors."""
    if not 1 <= n <= len(TOWNS) * len(INSTRUMENTS):
        raise InvalidInputError(f"lessons: 1 to {len(TOWNS) * len(INSTRUMENTS)} records, not {n}")
    rng = random.Random(f"focus-scale-lessons-{n}-{seed}")
    pairs = grid(n, TOWNS, INSTRUMENTS, rng)
    prices = [str(x) for x in rng.sample(range(20, 1000), n)]
    records = [
        f"The {a} teacher in {t} charges {p} dollars an hour."
        for (t, a), p in zip(pairs, prices, strict=True)
    ]
    return records, [f"How much does the {a} teacher in {t} charge?" for t, a in pairs], prices


def move_records(n: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """``n`` records "In <year> <name> moved to <city>.", their questions and answers: ``n``
    lines dealt as evenly as they go to ``ceil(n / MOVES_PER_PERSON)`` people (so each person
    is on :data:`MOVES_PER_PERSON` lines, or one fewer), each line with its own year and city
    among the person's; years ``max(MOVES_PER_PERSON, n // LINES_PER_YEAR)``, dealt in turn so
    each is on about as many lines; every (person, year) pair once."""
    k = MOVES_PER_PERSON
    years = max(k, n // LINES_PER_YEAR)
    if n < 1 or years > len(YEARS):
        raise InvalidInputError(
            f"moves: 1 to {(len(YEARS) + 1) * LINES_PER_YEAR - 1} records, not {n}"
        )
    rng = random.Random(f"focus-scale-moves-{n}-{seed}")
    people = math.ceil(n / k)
    names = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], people)
    labels = rng.sample(YEARS, years)
    lines, t = [], 0
    for i, name in enumerate(names):
        cities = rng.sample(CITIES, k)
        for j in range(n // people + (i < n % people)):  # at most k <= years: distinct years
            lines.append((labels[t % years], name, cities[j]))
            t += 1
    rng.shuffle(lines)
    records = [f"In {y} {name} moved to {city}." for y, name, city in lines]
    questions = [f"Where did {name} move in {y}?" for y, name, _ in lines]
    return records, questions, [city for _, _, city in lines]


def visit_records(n: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """``n`` records "In <month> <name> visited <country>.", their questions and answers: each
    person on :data:`MOVES_PER_PERSON` lines (or one fewer), each with its own month and
    country, the months drawn for each person from ``max(MOVES_PER_PERSON, min(12, n // 5))``
    (so a month is on about 5 lines, 25 at 300, and now and then on one only); every
    (person, month) pair once."""
    k = MOVES_PER_PERSON
    if not 1 <= n <= 300:
        raise InvalidInputError(f"visits: 1 to 300 records, not {n}")
    rng = random.Random(f"focus-scale-visits-{n}-{seed}")
    people = math.ceil(n / k)
    names = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], people)
    months = MONTHS[: max(k, min(len(MONTHS), n // 5))]
    lines = []
    for i, name in enumerate(names):
        countries, when = rng.sample(COUNTRIES, k), rng.sample(months, k)
        lines += [(when[j], name, countries[j]) for j in range(n // people + (i < n % people))]
    rng.shuffle(lines)
    records = [f"In {m} {name} visited {c}." for m, name, c in lines]
    questions = [f"Which country did {name} visit in {m}?" for m, name, _ in lines]
    return records, questions, [c for _, _, c in lines]


def context_of(
    n: int, seed: int, wording: str = "secret"
) -> tuple[str, list[str], list[str], list[str]]:
    """A context of ``n`` records of ``wording`` (:data:`WORDINGS`): its text, the records, the
    question that asks each record and each record's answer."""
    makers = {
        "secret": secret_records,
        "doors": door_records,
        "moves": move_records,
        "lessons": lesson_records,
        "visits": visit_records,
    }
    if wording not in makers:
        raise InvalidInputError(f"wording must be one of {', '.join(WORDINGS)}, not {wording!r}")
    records, questions, answers = makers[wording](n, seed)
    return INSTRUCTION + "\n\n" + "\n".join(records), records, questions, answers


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


CITY = re.compile(r"\b(" + "|".join(CITIES) + r")\b")


def first_city(text: str) -> str | None:
    """The first of :data:`CITIES` that ``text`` names (``None`` if none)."""
    m = CITY.search(text)
    return m.group(0) if m else None


COUNTRY = re.compile(r"\b(" + "|".join(COUNTRIES) + r")\b")


def first_country(text: str) -> str | None:
    """The first of :data:`COUNTRIES` that ``text`` names (``None`` if none)."""
    m = COUNTRY.search(text)
    return m.group(0) if m else None


def answer_of(wording: str, text: str) -> str | None:
    """What an answer says, read the way ``wording``'s gold is checked: its first number; for
    ``moves`` the first city of :data:`CITIES` it names, for ``visits`` the first of
    :data:`COUNTRIES`."""
    if wording == "moves":
        return first_city(text)
    return first_country(text) if wording == "visits" else first_number(text)
