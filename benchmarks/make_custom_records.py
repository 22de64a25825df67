"""Write a custom lost-in-the-middle dataset the suite has never seen, for ``--data``.

Another record template, other names (first + last), another number size and other list sizes
than the built-in ``records`` task, so ``auto`` is checked on wording it was not tuned on::

    python -m benchmarks.make_custom_records --out runs/lockers.jsonl
    kvedit eval litm --data runs/lockers.jsonl --methods none,auto,oracle,repeat
    python -m benchmarks.make_custom_records --kind containers --seed 11 --trials 10 \
        --out runs/containers-seed11.jsonl
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from benchmarks.common import RUNS, parser
from kvedit.evals.tasks import Example, write_jsonl

FIRST = [
    "Ines",
    "Tobias",
    "Mirela",
    "Kwame",
    "Signe",
    "Rafael",
    "Yuki",
    "Lars",
    "Amara",
    "Dmitri",
    "Beatriz",
    "Oskar",
    "Priya",
    "Matteo",
    "Zofia",
    "Emeka",
    "Hana",
    "Joaquin",
    "Leilani",
    "Soren",
    "Ayesha",
    "Bruno",
    "Chiara",
    "Farid",
    "Greta",
    "Hugo",
    "Ilse",
    "Jonas",
    "Kira",
    "Luca",
]
LAST = [
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Takahashi",
    "Novak",
    "Haddad",
    "Ferreira",
    "Kowalski",
    "Brandt",
    "Castillo",
    "Petrov",
    "Nakamura",
    "Osei",
    "Rossi",
    "Svensson",
    "Yilmaz",
]


def lockers(n_records: int, positions: list[int], trials: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    examples = []
    for t in range(trials):
        people = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], n_records)
        codes = rng.sample(range(10000, 99999), n_records)
        docs = [f"Locker assignment: {p} was given locker code {c}." for p, c in zip(people, codes)]
        order = list(range(n_records))
        for pos in positions:
            target = t % n_records  # which person is asked about, moved to position `pos`
            idx = order[:target] + order[target + 1 :]
            idx.insert(pos, target)
            shown = [docs[i] for i in idx]
            examples.append(
                Example(
                    id=f"lockers-n{n_records}-s{seed}-t{t}-p{pos}",
                    instruction="Here is the locker list of the gym. Use it to answer.",
                    documents=tuple(shown),
                    separator="\n",
                    question=f"Which locker code does {people[target]} have?",
                    answers=(str(codes[target]),),
                    gold_index=pos,
                    metric="first_number",
                )
            )
    return examples


CITIES = [
    "Lisbon",
    "Nairobi",
    "Osaka",
    "Quito",
    "Tallinn",
    "Valparaiso",
    "Windhoek",
    "Yerevan",
    "Zagreb",
    "Accra",
    "Bergen",
    "Cusco",
    "Dakar",
    "Esbjerg",
    "Fukuoka",
    "Gdansk",
    "Hobart",
    "Izmir",
    "Jaipur",
    "Kigali",
    "Leipzig",
    "Mombasa",
    "Nantes",
    "Oulu",
    "Porto",
    "Recife",
    "Salta",
    "Tromso",
    "Utrecht",
    "Varna",
    "Wellington",
    "Xiamen",
    "Yokohama",
    "Zurich",
    "Antwerp",
    "Bilbao",
    "Chennai",
    "Durban",
    "Eindhoven",
    "Florence",
]


def containers(n_records: int, positions: list[int], trials: int, seed: int) -> list[Example]:
    """Another kind of record: shipping containers keyed by destination city (no person's
    name), seven-digit numbers, one per line."""
    rng = random.Random(seed)
    examples = []
    for t in range(trials):
        cities = rng.sample(CITIES, n_records)
        numbers = rng.sample(range(1_000_000, 9_999_999), n_records)
        docs = [f"Shipment to {c}: container number {n}." for c, n in zip(cities, numbers)]
        target = t % n_records
        for pos in positions:
            idx = [i for i in range(n_records) if i != target]
            idx.insert(pos, target)
            examples.append(
                Example(
                    id=f"containers-n{n_records}-s{seed}-t{t}-p{pos}",
                    instruction="This is the harbour's shipping manifest. Use it to answer.",
                    documents=tuple(docs[i] for i in idx),
                    separator="\n",
                    question=f"What is the container number of the shipment to {cities[target]}?",
                    answers=(str(numbers[target]),),
                    gold_index=pos,
                    metric="first_number",
                )
            )
    return examples


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--out", default=str(RUNS / "lockers.jsonl"), help="the JSONL file to write")
    p.add_argument("--trials", type=int, default=20, help="questions per list size and position")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--kind",
        default="lockers",
        choices=["lockers", "containers"],
        help="lockers: 15 and 25 people's locker codes; containers: 20 shipments by city",
    )
    args = p.parse_args(argv)
    if args.kind == "containers":
        examples = containers(20, [0, 5, 10, 15, 19], args.trials, args.seed)
    else:
        examples = lockers(15, [0, 4, 7, 11, 14], args.trials, args.seed)
        examples += lockers(25, [0, 6, 12, 18, 24], args.trials, args.seed + 1)
    write_jsonl(examples, args.out)
    print(f"wrote {len(examples)} examples to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
