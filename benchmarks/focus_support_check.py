"""Would "no edit where the unedited answer already comes from the chosen passage" do no harm?
(#28, tuning seeds only.)

Reads an answers file of ``benchmarks/focus_gate.py`` (``guard-*.jsonl``: each example's
answer with and without focus's edit, and the passage focus chose) and rebuilds its examples.
The unedited answer is *supported* by the chosen passage when at least ``--threshold`` of its
content words (lower-cased words that are not in the question and not stop words) occur in
that passage: the model already reads the passage the edit would raise. Prints, per
threshold, the accuracy of focus's edit, of the rule "answer unedited where supported", how
often the rule keeps the unedited answer, and the examples where it changes the outcome. The
rule uses the question, the passages and the model's own answer, never the gold label.

Usage::

    python benchmarks/focus_support_check.py reports/focus-tuning/guard-nq-s1.jsonl \\
        --task nq --seed 1 --trials 100
    python benchmarks/focus_support_check.py reports/focus-tuning/guard-lockers-s3.jsonl \\
        --data reports/focus-tuning/lockers-seed3-t5.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from kvedit.evals.litm import build_examples
from kvedit.focusing.guard import answer_support


def support(answer: str, passage: str, question: str) -> float:
    """:func:`kvedit.focusing.guard.answer_support` of ``answer`` in one passage."""
    return answer_support(answer, [passage], question)


def check(records: Sequence[dict], examples: dict, threshold: float) -> dict:
    """Accuracy of the edit and of the rule at ``threshold`` over ``records`` whose example is
    known; abstentions (nothing chosen) answer unedited under both."""
    n = edit = rule = kept = 0
    changed = []
    for r in records:
        example = examples.get(r["id"])
        if example is None:
            continue
        n += 1
        if not r["chosen"]:
            edit += r["none_ok"]
            rule += r["none_ok"]
            continue
        passage = example.documents[r["chosen"][0]]
        unedited = support(r["none"], passage, example.question) >= threshold
        kept += unedited
        edit += r["edit_ok"]
        rule += r["none_ok"] if unedited else r["edit_ok"]
        if unedited and r["none_ok"] != r["edit_ok"]:
            changed.append(f"{r['id']} ({'won' if r['none_ok'] else 'lost'})")
    return {"n": n, "edit": edit, "rule": rule, "kept": kept, "changed": changed}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("answers", help="a guard-*.jsonl of benchmarks/focus_gate.py")
    parser.add_argument("--task", default="records")
    parser.add_argument("--data", default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--thresholds", default="0.5,0.75,1")
    args = parser.parse_args(argv)
    with open(args.answers) as f:
        records = [json.loads(line) for line in f if line.strip()]
    built = build_examples(args.task, args.data, None, None, args.trials, args.seed, None)
    examples = {e.id: e for e in built}
    print("| threshold | examples | edit right | rule right | unedited kept | outcome changed |")
    print("|---|---|---|---|---|---|")
    for threshold in (float(t) for t in args.thresholds.split(",")):
        c = check(records, examples, threshold)
        changed = ", ".join(c["changed"]) or "none"
        print(f"| {threshold:g} | {c['n']} | {c['edit']} | {c['rule']} | {c['kept']} | {changed} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
