"""Where the support guard's verdict depends on how it tells the prompt's words from an answer's.

``kvedit.focusing.guard.SupportGuard`` leaves out of an answer's telling words the words the
prompt itself says outside its passages (its instruction, headers, chat template, question).
It once left out a fixed list instead, which held the NQ prompt's "document", "title",
"answer" and "question", and read only the question's words besides. This replays both on the
answers of ``kvedit eval litm`` runs (``none`` and ``auto`` with the support guard, on the same
examples): for every question ``auto`` edited, the support of ``none``'s answer (the guard's
unedited answer) in the chosen passages under each rule, and the questions where the two
verdicts differ. Where none differ, the run's ``auto`` is also what the list would have
answered.

Usage::

    python -m benchmarks.tuning.guard_words runs/nq10-seed0/results.json --task nq --seed 0 --trials 100
    python -m benchmarks.tuning.guard_words runs/lockers-seed7/results.json --data reports/litm/lockers-seed7.jsonl.gz

``--prefix-tokens 8,16`` also replays the guard on the first 8 (16) tokens of the unedited answer
only, under the prompt's own words, and counts the questions whose verdict that changes: how
far an unedited decode could be cut short before the guard decides.

A stopped run's ``partial.jsonl`` stands for its ``results.json`` (the records made so far).
The example options are the run's own (``kvedit eval litm``'s ``--task``, ``--data``,
``--n-docs``, ``--positions``, ``--trials``, ``--seed``); ``--model`` and ``--prompt`` are read
from the run. Loads the model's tokenizer only; runs no model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import markdown_table, parser, read_partial, read_run, write_file
from kvedit.cli.arguments import positions
from kvedit.evals.litm import build_examples, resolve_prompt
from kvedit.evals.methods.context import split_prompt
from kvedit.focusing.guard import SUPPORT_THRESHOLD, answer_support, evidence_and_others
from kvedit.focusing.passages import outside_passages
from kvedit.focusing.scoring import asking_text
from kvedit.models import load_model

LISTED = ("document", "title", "answer", "question")
"""The prompt words the guard's stop list held before it read the prompt itself."""


def read_records(path: Path) -> dict:
    """A run's ``results.json``, or a stopped run's ``partial.jsonl`` (its records so far, with
    the model and prompt of the ``partial.settings.json`` beside it) in the same shape."""
    if path.name != "partial.jsonl":
        return read_run(path)
    settings = read_run(path.with_name("partial.settings.json"))
    records = read_partial(path)
    extra = {"prompt": settings["prompt"]}
    return {"model": settings["model"], "extra": extra, "examples": records}


def replay(results: dict, examples, tokenizer, prompt: str, prefixes: Sequence[int] = ()) -> dict:
    """Both rules' support and verdict for every question ``auto`` edited in ``results``; with
    ``prefixes``, the prompt's-own-words verdict on the first ``k`` tokens of the unedited
    answer for each ``k`` (``kept_at``) and how many verdicts that changes
    (``prefix_differs``)."""
    by_digest = {ex.digest(): ex for ex in examples}
    none = {r["example"]: r for r in results["examples"] if r["method"] == "none"}
    rows = []
    for rec in results["examples"]:
        if rec["method"] != "auto" or not rec.get("chosen") or "support" not in rec:
            continue
        ex, unedited = by_digest[rec["example"]], none[rec["example"]]["prediction"]
        prefix, continuation, spans = split_prompt(tokenizer, ex, prompt)
        evidence, others = evidence_and_others([prefix[a:b] for a, b in spans], rec["chosen"])
        query = asking_text(continuation, tokenizer)  # the query focus defaults to
        outside = outside_passages(prefix, spans)

        framed_support = functools.partial(  # the guard's reading, the prompt's own words
            answer_support,
            evidence=evidence,
            question=f"{query}\n{continuation}",
            others=others,
            outside=outside,
        )
        framed = framed_support(unedited)
        ids = tokenizer(unedited, add_special_tokens=False)["input_ids"]
        kept_at = {
            k: framed_support(tokenizer.decode(ids[:k])) < SUPPORT_THRESHOLD for k in prefixes
        }
        listed = answer_support(unedited, evidence, " ".join((query, *LISTED)), others)
        rows.append(
            {
                "id": rec["id"],
                "support": framed,
                "support_listed": listed,
                "recorded": rec["support"],
                "kept": framed < SUPPORT_THRESHOLD,
                "kept_listed": listed < SUPPORT_THRESHOLD,
                "kept_at": kept_at,
            }
        )
    differ = [r for r in rows if r["kept"] != r["kept_listed"]]
    return {
        "edited": len(rows),
        "support_differs": sum(abs(r["support"] - r["support_listed"]) > 1e-9 for r in rows),
        "verdict_differs": len(differ),
        "replay_matches_run": sum(abs(r["support"] - r["recorded"]) < 1e-3 for r in rows),
        "differ": differ,
        "prefix_differs": {k: sum(r["kept_at"][k] != r["kept"] for r in rows) for k in prefixes},
    }


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument(
        "results",
        nargs="+",
        type=Path,
        help="results.json of eval litm runs (or a stopped run's partial.jsonl)",
    )
    p.add_argument("--task", default="records")
    p.add_argument("--data", default=None)
    p.add_argument("--n-docs", type=int, default=None)
    p.add_argument(
        "--positions", type=positions, default=None, help="comma-separated gold positions"
    )
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefix-tokens",
        type=positions,
        default=[],
        help="comma-separated token counts: the verdict on that much of the unedited answer",
    )
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = p.parse_args(argv)
    examples = build_examples(
        args.task, args.data, args.n_docs, args.positions, args.trials, args.seed
    )
    rows = []
    for path in args.results:
        results = read_records(path)
        _, tokenizer = load_model(results["model"])
        prompt = resolve_prompt(results["extra"]["prompt"], results["model"])
        got = replay(results, examples, tokenizer, prompt, args.prefix_tokens)
        rows.append(
            [
                path.parent.name,
                got["edited"],
                got["replay_matches_run"],
                got["support_differs"],
                got["verdict_differs"],
                ", ".join(r["id"] for r in got["differ"]) or "-",
                *(got["prefix_differs"][k] for k in args.prefix_tokens),
            ]
        )
    head = [
        "run",
        "edited",
        "replayed support = run's",
        "support differs",
        "verdict differs",
        "where",
        *(f"verdict differs on the first {k} tokens" for k in args.prefix_tokens),
    ]
    table = "\n".join(markdown_table(head, rows)) + "\n"
    print(table, end="")
    if args.out:
        write_file(args.out, table)


if __name__ == "__main__":
    main()
