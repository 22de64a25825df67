"""Which do-no-harm rule keeps focus's gains and drops its losses? (#28, tuning seeds only.)

Reads answers files of ``benchmarks/focus_gate.py --variants`` (each example's answer unedited,
with focus's edit, and with the edit left off the layers where the chosen passage already has
the largest share) and rebuilds their examples. Prints, per gold position, the accuracy and the
questions won / lost against the unedited answer of:

- ``auto``: focus's edit as it is;
- ``nolead``: no bias on the layers where the chosen passage already leads;
- ``skip-lead``: no edit where the chosen passage leads on most layers;
- ``support>=t``: no edit where at least ``t`` of the unedited answer's content words are in
  the chosen passage (``benchmarks/focus_support_check.py``; t = 0.5, 0.75, 1);
- ``nolead+support>=0.75``: both;
- ``telling>=t``: ``support>=t`` without the words found in more than half of the other
  passages (:func:`kvedit.focusing.guard.answer_support` with ``others``, the library's rule since
  §8 of ``reports/focus-tuning/README.md``; t = 0.4, 0.5, 0.6, 0.75; ``--shared`` sets
  "more than half", :data:`kvedit.focusing.guard.COMMON_SHARE`).

Every rule reads the question, the passages, the model's attention and its own answers, never
the gold label (which only scores them here).

Usage::

    python benchmarks/focus_harm_check.py runs/gate-nq10-s1.jsonl --task nq --seed 1 \\
        --n-docs 10 --positions 9,0 --trials 100
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable, Sequence

from focus_support_check import support

from kvedit.evals.litm import build_examples
from kvedit.focusing.guard import COMMON_SHARE, answer_support, evidence_and_others

Rule = Callable[[dict, object], bool]
"""Whether a rule answers with the edit (``True``) or unedited (``False``)."""


def _edit_ok(record: dict, variant: str) -> bool:
    return bool(record["none_ok"] if not record["chosen"] else record[f"{variant}_ok"])


def _supported(record: dict, example, threshold: float = 0.75) -> bool:
    passage = example.documents[record["chosen"][0]]
    return support(record["none"], passage, example.question) >= threshold


def _told(record: dict, example, threshold: float, shared: float) -> bool:
    evidence, others = evidence_and_others(example.documents, record["chosen"])
    share = answer_support(record["none"], evidence, example.question, others, shared)
    return share >= threshold


def rules(shared: float = COMMON_SHARE) -> dict[str, Rule]:
    """The rules compared, by name; ``shared`` is the ``telling`` rules' share (``--shared``)."""
    return {
        "auto": lambda r, ex: _edit_ok(r, "edit"),
        "nolead": lambda r, ex: _edit_ok(r, "nolead"),
        "skip-lead": lambda r, ex: (
            r["none_ok"]
            if r["chosen"] and sum(r["leads"]) > len(r["leads"]) / 2
            else _edit_ok(r, "edit")
        ),
        **{
            f"support>={t}": lambda r, ex, t=t: (
                r["none_ok"] if r["chosen"] and _supported(r, ex, t) else _edit_ok(r, "edit")
            )
            for t in (0.5, 0.75, 1.0)
        },
        "nolead+support>=0.75": lambda r, ex: (
            r["none_ok"] if r["chosen"] and _supported(r, ex) else _edit_ok(r, "nolead")
        ),
        **{
            f"telling>={t}": lambda r, ex, t=t: (
                r["none_ok"] if r["chosen"] and _told(r, ex, t, shared) else _edit_ok(r, "edit")
            )
            for t in (0.4, 0.5, 0.6, 0.75)
        },
    }


RULES = rules()
"""The rules at the default share (:data:`kvedit.focusing.guard.COMMON_SHARE`)."""


def table(records: Sequence[dict], examples: dict, shared: float = COMMON_SHARE) -> str:
    by: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by[r["gold_index"]].append(r)
    positions = sorted(by)
    lines = [
        f"{'rule':<16}"
        + "".join(f"  pos {p:<3} acc won/lost" for p in positions)
        + "   mean  lost",
        f"{'none':<16}"
        + "".join(
            f"  {sum(r['none_ok'] for r in by[p]) / len(by[p]):>11.3f}      " for p in positions
        ),
    ]
    for name, rule in rules(shared).items():
        cells, accs, lost_all = [], [], 0
        for p in positions:
            ok = [bool(rule(r, examples[r["id"]])) for r in by[p]]
            won = sum(o and not r["none_ok"] for o, r in zip(ok, by[p], strict=True))
            lost = sum(r["none_ok"] and not o for o, r in zip(ok, by[p], strict=True))
            lost_all += lost
            accs.append(sum(ok) / len(ok))
            cells.append(f"  {accs[-1]:>11.3f} {won:>2}/{lost:<2} ")
        lines.append(f"{name:<16}" + "".join(cells) + f"  {sum(accs) / len(accs):.3f}  {lost_all}")
    counts = " ".join(f"{p}: {len(by[p])}" for p in positions)
    return "\n".join(lines) + f"\n(examples per position: {counts})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("answers", help="a jsonl of benchmarks/focus_gate.py --variants")
    parser.add_argument("--task", default="nq")
    parser.add_argument("--data", default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--n-docs", type=int, default=None)
    parser.add_argument("--positions", default=None)
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument(
        "--shared", type=float, default=COMMON_SHARE, help="the telling rules' shared share"
    )
    args = parser.parse_args(argv)
    positions = None if args.positions is None else [int(x) for x in args.positions.split(",")]
    examples = {
        ex.id: ex
        for ex in build_examples(
            args.task, args.data, args.n_docs, positions, args.trials, args.seed, None
        )
    }
    with open(args.answers) as f:
        records = [json.loads(line) for line in f if line.strip()]
    missing = [r["id"] for r in records if r["id"] not in examples]
    if missing:
        parser.error(f"{len(missing)} answers name no example of these flags (first: {missing[0]})")
    print(table(records, examples, args.shared))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
