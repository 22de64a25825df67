"""Would "no edit where the chosen passage already leads" do no harm? (#28, tuning seeds only.)

Joins the tuning files of ``reports/focus-tuning/``: each example's per-layer attention shares
(``shares-*.safetensors``, from ``benchmarks/focus_scoring.py``) and its answers with and
without focus's edit (``guard-*.jsonl``, from ``benchmarks/focus_gate.py``). A passage
*leads* when it holds the largest mean share (over layers) of the question's attention among
the passages, before any edit. Prints, per gold position, how often the gold passage leads,
and, for the examples where focus chose the gold passage, the answers' outcome split by
whether it led: what the rule "skip the edit when the chosen passage leads" would keep and
lose.

Usage::

    python benchmarks/focus_lead_check.py reports/focus-tuning/shares-nq-s1.safetensors \\
        reports/focus-tuning/guard-nq-s1.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence

from safetensors import safe_open


def lead_table(shares_path: str, answers_path: str) -> tuple[Counter, Counter]:
    """``(leads per (gold, led), outcomes per (gold, led, none_ok, edit_ok))``."""
    with safe_open(shares_path, "pt") as f:
        rows = json.loads(f.metadata()["rows"])
        led = {}
        for k, row in enumerate(rows):
            mean = f.get_tensor(f"{k}.real").mean(0)  # [passages], over layers
            led[row["id"]] = (row["gold"], int(mean.argmax()) == row["gold"])
    answers = {}
    with open(answers_path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                answers[record["id"]] = record
    leads: Counter = Counter()
    outcomes: Counter = Counter()
    for example, (gold, leading) in led.items():
        leads[(gold, leading)] += 1
        record = answers.get(example)
        if record is not None and record["chosen"] == [gold]:
            outcomes[(gold, leading, record["none_ok"], record["edit_ok"])] += 1
    return leads, outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shares", help="shares-*.safetensors (benchmarks/focus_scoring.py)")
    parser.add_argument("answers", help="guard-*.jsonl (benchmarks/focus_gate.py)")
    args = parser.parse_args(argv)
    leads, outcomes = lead_table(args.shares, args.answers)
    print("gold position | gold leads | gold does not lead")
    for gold in sorted({g for g, _ in leads}):
        print(f"{gold} | {leads[(gold, True)]} | {leads[(gold, False)]}")
    print("\ngold position | gold led | right without the edit | right with it | examples")
    for key in sorted(outcomes):
        gold, leading, none_ok, edit_ok = key
        print(f"{gold} | {leading} | {none_ok} | {edit_ok} | {outcomes[key]}")
    helped = sum(n for (_, lead, a, b), n in outcomes.items() if lead and b and not a)
    harmed = sum(n for (_, lead, a, b), n in outcomes.items() if lead and a and not b)
    print(f"\nwhere the gold passage led, the edit helped {helped} and harmed {harmed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
