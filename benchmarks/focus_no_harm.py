"""#28's no-harm, hit-rate, ceiling and cost table from eval runs (``kvedit eval litm`` output).

For each ``results.json`` given (a run with ``none`` and ``auto`` on the same examples, and
optionally ``gold_only``), per gold position: how many examples, the accuracy of ``none`` and
``auto``, how many questions ``auto`` lost (right under ``none``, wrong under ``auto``) and won,
and ``auto``'s hit rate (the gold document among the chosen; an abstention is a miss). Then
the verdict of #28's targets:

* no harm: with at least 100 examples at a position, ``auto >= none - 0.02`` there; with fewer,
  no more than one question lost there;
* ceiling (when the run has ``gold_only``): mean ``auto >= gold_only - 0.03``;

Cost is not here: a run's ``seconds`` depend on what else the machine ran, and ``--reuse`` takes
``none``'s from another run; ``benchmarks.focus_cost`` times both on one idle machine.

Usage::

    python -m benchmarks.focus_no_harm runs/litm-focus-nq10-seed0/results.json ... \\
        [--out runs/focus-no-harm.md]

Reads only the files; prints the markdown table (and writes it with ``--out``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import parser, read_run, write_file

NO_HARM_MARGIN = 0.02
"""``auto`` may fall this far below ``none`` at a position with :data:`LARGE` examples."""
LARGE = 100
"""From this many examples at a position, the margin rule applies; below, the count rule."""
MOST_LOST = 1
"""With fewer than :data:`LARGE` examples at a position, at most this many questions lost."""
CEILING_MARGIN = 0.03
"""Mean ``auto`` may fall this far below ``gold_only``."""


@dataclass(frozen=True)
class Position:
    """One gold position of one run."""

    gold_index: int
    n: int
    none: float
    auto: float
    lost: int
    won: int
    hit: float | None

    @property
    def harmless(self) -> bool:
        if self.n >= LARGE:
            return self.auto >= self.none - NO_HARM_MARGIN - 1e-12
        return self.lost <= MOST_LOST


def by_method(results: dict) -> dict[str, dict[str, dict]]:
    """``method -> id -> record``."""
    out: dict[str, dict[str, dict]] = {}
    for record in results["examples"]:
        out.setdefault(record["method"], {})[record["id"]] = record
    return out


def positions(results: dict) -> list[Position]:
    """One :class:`Position` per gold position, on the examples both methods answered.

    Raises:
        SystemExit: the run has no ``none`` or no ``auto`` records."""
    records = by_method(results)
    if "none" not in records or "auto" not in records:
        raise SystemExit(f"needs none and auto records, found {sorted(records)}")
    none, auto = records["none"], records["auto"]
    ids = [i for i in none if i in auto]
    out = []
    for gold in sorted({int(none[i]["gold_index"]) for i in ids}):
        here = [i for i in ids if int(none[i]["gold_index"]) == gold]
        right_none = [bool(none[i]["correct"]) for i in here]
        right_auto = [bool(auto[i]["correct"]) for i in here]
        chosen = [auto[i].get("chosen") for i in here]
        hit = (
            statistics.fmean(float(gold in c) for c in chosen)
            if all(c is not None for c in chosen)
            else None
        )
        out.append(
            Position(
                gold_index=gold,
                n=len(here),
                none=statistics.fmean(right_none),
                auto=statistics.fmean(right_auto),
                lost=sum(a and not b for a, b in zip(right_none, right_auto, strict=True)),
                won=sum(b and not a for a, b in zip(right_none, right_auto, strict=True)),
                hit=hit,
            )
        )
    return out


def table(paths: Sequence[Path]) -> str:
    lines = [
        "| run | gold position | n | none | auto | lost | won | hit | no harm |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = ["", "| run | none | auto | gold_only | ceiling |", "|---|---|---|---|---|"]
    for path in paths:
        results = read_run(path)
        name = path.parent.name
        rows = positions(results)
        for p in rows:
            hit = "n/a" if p.hit is None else f"{p.hit:.2f}"
            verdict = "yes" if p.harmless else "**no**"
            lines.append(
                f"| {name} | {p.gold_index} | {p.n} | {p.none:.3f} | {p.auto:.3f} | {p.lost} "
                f"| {p.won} | {hit} | {verdict} |"
            )
        records = by_method(results)
        n = sum(p.n for p in rows)
        none = sum(p.none * p.n for p in rows) / n
        auto = sum(p.auto * p.n for p in rows) / n
        if "gold_only" in records:
            ids = [i for i in records["none"] if i in records["auto"]]
            gold = statistics.fmean(bool(records["gold_only"][i]["correct"]) for i in ids)
            ceiling = "yes" if auto >= gold - CEILING_MARGIN - 1e-12 else "**no**"
            gold_text = f"{gold:.3f}"
        else:
            gold_text, ceiling = "not run", "n/a"
        summary.append(f"| {name} | {none:.3f} | {auto:.3f} | {gold_text} | {ceiling} |")
    return "\n".join(lines + summary) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("results", nargs="+", type=Path, help="results.json files")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    text = table(args.results)
    print(text, end="")
    if args.out is not None:
        write_file(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
