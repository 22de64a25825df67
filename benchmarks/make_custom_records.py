"""Write a custom lost-in-the-middle dataset the suite has never seen, for ``--data``.

Another record template, other names (first + last), another number size and other list sizes
than the built-in ``records`` task, so ``auto`` is checked on wording it was not tuned on::

    python benchmarks/make_custom_records.py --out runs/lockers.jsonl
    kvedit eval litm --data runs/lockers.jsonl --methods none,auto,oracle,repeat
"""

from __future__ import annotations

import argparse
import random

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/lockers.jsonl")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    examples = lockers(15, [0, 4, 7, 11, 14], args.trials, args.seed)
    examples += lockers(25, [0, 6, 12, 18, 24], args.trials, args.seed + 1)
    write_jsonl(examples, args.out)
    print(f"wrote {len(examples)} examples to {args.out}")


if __name__ == "__main__":
    main()
