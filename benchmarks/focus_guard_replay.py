"""Replay focus's support guard on an eval run that answered ``none`` and unguarded ``auto``.

:class:`kvedit.focusing.guard.SupportGuard` chooses between two answers the run already holds: the
unedited one (``none``'s prediction: the same greedy decode of the same state) and the edited
one (``auto``'s, made with ``guard=none``, or by kvedit before the guard). It keeps the
unedited answer where at least ``--support`` of its telling words (not in the question, not
shared by most other documents: :func:`kvedit.focusing.guard.answer_support`) occur in the document
``auto`` chose (the record's ``chosen``). Where the model, the scoring and the
edit are unchanged (SmolLM2: no sliding-window layers), this gives the guarded ``auto``'s
answers exactly, without decoding again; ``--check FILE`` compares them with a real guarded
run's records and fails on any difference.

Prints, per gold position, ``none``, unguarded ``auto`` and the replay (accuracy, questions won
and lost against ``none``). ``--out DIR`` writes ``DIR/results.json`` in the eval's shape (the
source's records with each ``auto`` record replaced by its replay, marked ``"replayed"``), so
``benchmarks/focus_no_harm.py`` reads it like a run.

A source whose ``auto`` was guarded by session 13's rule (``--source-guard 0.75``) replays
too where every verdict that changes goes from the edit to the unedited answer.

Usage::

    python benchmarks/focus_guard_replay.py reports/focus-report-seeds/nq10-seed0/results.json \\
        --task nq --seed 0 --trials 100
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from kvedit.evals.litm import build_examples
from kvedit.focusing.guard import SUPPORT_THRESHOLD, answer_support, evidence_and_others


def replay(
    results: dict, examples: dict, support: float, source_guard: float | None = None
) -> list[dict]:
    """The guarded ``auto`` record of every example with a ``none`` and an ``auto`` record.

    ``source_guard``: the source's ``auto`` was itself guarded by the rule before shared words
    were left out (:func:`answer_support` without ``others``) at this threshold, so where that
    rule kept the unedited answer the record holds ``none``'s answer, not the edit's; an
    example whose replay needs the edited answer there is refused."""
    none = {r["id"]: r for r in results["examples"] if r["method"] == "none"}
    out = []
    for r in results["examples"]:
        if r["method"] != "auto" or r["id"] not in none:
            continue
        ex = examples[r["id"]]
        digest = r.get("example")
        if digest is not None and digest != ex.digest():
            raise SystemExit(f"{r['id']}: the record answers another example (check the flags)")
        unedited = none[r["id"]]
        chosen = r.get("chosen", [])
        share = None
        keep_unedited = False
        if chosen:
            evidence, others = evidence_and_others(ex.documents, chosen)
            share = answer_support(unedited["prediction"], evidence, ex.question, others)
            keep_unedited = share >= support
        if chosen and source_guard is not None:
            old = answer_support(unedited["prediction"], evidence, ex.question) >= source_guard
            if old and r["prediction"] != unedited["prediction"]:
                raise SystemExit(f"{r['id']}: the source's guard kept no unedited answer here")
            if old and not keep_unedited:
                raise SystemExit(
                    f"{r['id']}: the replay needs the edited answer, which the source's guard "
                    "did not decode (run auto for real)"
                )
        source = unedited if keep_unedited else r
        out.append(
            {
                "id": r["id"],
                "method": "auto",
                "replayed": True,
                "gold_index": r["gold_index"],
                "prediction": source["prediction"],
                "correct": source["correct"],
                "none_correct": unedited["correct"],
                "auto_correct": r["correct"],
                "chosen": chosen,
                "support": share,
                "kept": not keep_unedited,
            }
        )
    return out


def summary(records: Sequence[dict]) -> dict:
    by: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by[r["gold_index"]].append(r)
    out = {}
    for p in sorted(by):
        rs = by[p]
        n = len(rs)

        def won_lost(key: str, rs=rs) -> tuple[int, int]:
            won = sum(r[key] and not r["none_correct"] for r in rs)
            return won, sum(r["none_correct"] and not r[key] for r in rs)

        out[str(p)] = {
            "n": n,
            "none": sum(r["none_correct"] for r in rs) / n,
            "auto": sum(r["auto_correct"] for r in rs) / n,
            "guarded": sum(r["correct"] for r in rs) / n,
            "auto_won_lost": won_lost("auto_correct"),
            "guarded_won_lost": won_lost("correct"),
            "unedited_kept": sum(not r["kept"] for r in rs),
        }
    return out


def check(replayed: Sequence[dict], path: str) -> int:
    """The number of examples a real guarded run answered otherwise (printed)."""
    real = {
        r["id"]: r for r in json.loads(Path(path).read_text())["examples"] if r["method"] == "auto"
    }
    differ = [
        r["id"]
        for r in replayed
        if r["id"] in real and real[r["id"]]["prediction"] != r["prediction"]
    ]
    compared = sum(r["id"] in real for r in replayed)
    print(f"check: {compared} examples compared with {path}, {len(differ)} differ {differ[:5]}")
    return len(differ)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a results.json with none and unguarded auto")
    parser.add_argument("--task", default="nq")
    parser.add_argument("--data", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-docs", type=int, default=None)
    parser.add_argument("--positions", default=None)
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--support", type=float, default=SUPPORT_THRESHOLD)
    parser.add_argument(
        "--source-guard",
        type=float,
        default=None,
        help="the source's auto ran with the support guard before shared words were left out, "
        "at this threshold (0.75: session 13's runs)",
    )
    parser.add_argument("--check", default=None, help="a guarded run's results.json")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    positions = None if args.positions is None else [int(x) for x in args.positions.split(",")]
    built = build_examples(args.task, args.data, args.n_docs, positions, args.trials, args.seed)
    examples = {ex.id: ex for ex in built}
    results = json.loads(Path(args.results).read_text())
    records = replay(results, examples, args.support, args.source_guard)
    table = summary(records)
    print(
        f"{'pos':>4} {'n':>4} {'none':>6} {'auto':>6} {'w/l':>7} {'guarded':>8} {'w/l':>7} kept-unedited"
    )
    for p, row in table.items():
        aw, al = row["auto_won_lost"]
        gw, gl = row["guarded_won_lost"]
        print(
            f"{p:>4} {row['n']:>4} {row['none']:>6.3f} {row['auto']:>6.3f} {aw:>3}/{al:<3} "
            f"{row['guarded']:>8.3f} {gw:>3}/{gl:<3} {row['unedited_kept']}"
        )
    means = {k: sum(r[k] for r in table.values()) / len(table) for k in ("none", "auto", "guarded")}
    print("mean", " ".join(f"{k} {v:.3f}" for k, v in means.items()))
    if args.out:
        kept = [r for r in results["examples"] if r["method"] != "auto"]
        extra = {**results.get("extra", {}), "replayed_from": args.results}
        extra["replay"] = {"support": args.support, "by_position": table, "mean": means}
        if args.source_guard is not None:
            extra["replay"]["source_guard"] = args.source_guard
        out = {k: v for k, v in results.items() if k not in ("examples", "extra", "methods")}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / "results.json"
        path.write_text(json.dumps({**out, "examples": kept + records, "extra": extra}, indent=1))
    if args.check and check(records, args.check):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
