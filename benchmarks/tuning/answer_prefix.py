"""How much a draft from the unedited answer could save the edited one's decode.

Where focus keeps an edit, the guard has decoded the unedited answer first; the edited answer
could be drafted from it (speculative decoding: the edited cache reads the unedited answer's
tokens in one pass and keeps the prefix its greedy choice agrees with, then decodes on). What
that saves is the prefix the two answers share. This reads a ``kvedit eval litm`` run of
``none`` and ``auto`` on the same examples (``none``'s answer is the guard's unedited one) and,
for every question where ``auto`` kept an edit, counts the tokens its answer shares with
``none``'s from the start: the decode steps a draft could skip, against the edited answer's
length.

Usage::

    python -m benchmarks.tuning.answer_prefix runs/nq10-seed0/results.json

Loads the run's model's tokenizer only; runs no model.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks.common import parser, read_run
from kvedit.memory.rendering import common_prefix
from kvedit.models import load_model


def prefixes(results: dict, tokenizer) -> list[tuple[int, int]]:
    """``(shared, edited length)`` in tokens for every question where ``auto`` kept an edit."""
    none = {r["example"]: r for r in results["examples"] if r["method"] == "none"}
    out = []
    for r in results["examples"]:
        if r["method"] != "auto" or not r.get("chosen") or not r.get("kept"):
            continue
        if r["example"] not in none:
            raise SystemExit(f"{r['id']}: the run has no `none` answer for it (run none,auto)")
        unedited = tokenizer.encode(none[r["example"]]["prediction"], add_special_tokens=False)
        edited = tokenizer.encode(r["prediction"], add_special_tokens=False)
        out.append((common_prefix(unedited, edited), len(edited)))
    return out


def summary(pairs: Sequence[tuple[int, int]]) -> str:
    if not pairs:
        return "no question where auto kept an edit"
    shared = [s for s, _ in pairs]
    total = sum(n for _, n in pairs)
    return (
        f"{len(pairs)} edits kept: shared prefix mean {statistics.mean(shared):.1f} tokens, "
        f"median {statistics.median(shared):g}, none in {shared.count(0)}; edited answers "
        f"mean {total / len(pairs):.1f} tokens; a draft skips at most {sum(shared) / total:.1%} "
        "of the edited decode's steps"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("results", help="a kvedit eval litm run's results.json (methods none,auto)")
    args = p.parse_args(argv)
    results = read_run(args.results)
    _, tokenizer = load_model(results["model"])
    print(summary(prefixes(results, tokenizer)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
