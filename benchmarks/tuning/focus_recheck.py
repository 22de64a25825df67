"""An eval run's ``auto`` answered again by today's focus, only where today's choice can differ.

A change to focus that can only turn an abstention into an edit leaves every other answer of a
run as it was (answers are deterministic). This takes an earlier ``kvedit eval litm`` run with
``none`` and ``auto`` and answers ``auto`` again on the examples where the run's ``auto``
abstained and today's :func:`kvedit.focusing.scoring.sole_holder` names a document (a word rule
on the question and the documents, no model); every other record is taken from the run. It
checks the shortcut by answering ``--verify`` more examples again (the first edited ones and
the first abstained ones the rule leaves out) and comparing their answers with the run's.

The examples are built from the arguments the run was made with (``--task``, ``--data``,
``--n-docs``, ``--positions``, ``--trials``, ``--seed``, ``--limit``; the model, prompt format
and answer length are read from the run) and must be the run's: every record's example digest
is checked. The run's ``auto`` (``--spec``, default ``auto``) must have had the parameters that
spec has today but for ``all_words``.

Usage::

    python -m benchmarks.tuning.focus_recheck runs/nq20-seed0 --task nq --n-docs 20 --seed 0 \\
        --trials 30 --out runs/nq20-seed0-recheck

Writes ``--out``/``results.json`` (a run ``benchmarks.focus_no_harm`` reads; ``extra.recheck``
lists the examples answered again, the choices and answers that changed and the verification)
and prints what changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.common import parser, read_run
from kvedit.cli.arguments import positions as parse_positions
from kvedit.errors import InvalidInputError
from kvedit.evals.litm import build_examples, run
from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.registry import parse_spec
from kvedit.evals.report import write_results
from kvedit.focusing.scoring import sole_holder
from kvedit.models import load_model
from kvedit.version import __version__, source_digest


def sole_documents(
    model, tokenizer, examples, records: dict, spec: str, max_new: int, prompt: str
) -> dict:
    """``id -> document index`` for each example whose ``spec`` record abstained (chose
    nothing) and whose question has a :func:`sole_holder` among its documents."""
    out = {}
    for ex in examples:
        rec = records.get((ex.id, spec))
        if rec is None or rec.get("chosen") != [] or not ex.documents:
            continue
        ctx = ExampleContext(model, tokenizer, ex, max_new, prompt)
        texts = [ctx.prefix[a:b] for a, b in ctx.doc_spans]
        sole = sole_holder(ex.question, texts, torch.ones(len(texts), dtype=torch.bool))
        if sole is not None:
            out[ex.id] = sole
    return out


def verify_ids(examples, records: dict, spec: str, skip: set[str], k: int) -> list[str]:
    """The first ``k`` edited and the first ``k`` abstained examples outside ``skip``."""
    chosen = {e.id: records[(e.id, spec)].get("chosen") for e in examples if e.id not in skip}
    edited = [i for i, c in chosen.items() if c]
    return edited[:k] + [i for i, c in chosen.items() if c == []][:k]


def answer_of(record: dict) -> tuple:
    """What a record says (not its seconds): the answer, whether right, the choice, the
    guard's verdict."""
    return tuple(record.get(k) for k in ("prediction", "correct", "chosen", "kept", "support"))


def check_run(res: dict, examples, spec: str) -> dict:
    """``(id, method) -> record`` of the run, after checking it holds ``none`` and ``spec`` for
    exactly ``examples`` (by digest) with ``spec``'s parameters today but ``all_words``."""
    records = {(r["id"], r["method"]): r for r in res["examples"]}
    digests = {e.id: e.digest() for e in examples}
    if {(i, m) for i in digests for m in ("none", spec)} != set(records):
        raise InvalidInputError(
            f"the run's records are not none and {spec} on the examples these arguments build "
            f"({len(records)} records, {len(digests)} examples)"
        )
    wrong = [i for (i, _), r in records.items() if r.get("example") != digests[i]]
    if wrong:
        raise InvalidInputError(
            f"{len(wrong)} records asked other prompts than these arguments build (first: "
            f"{wrong[0]}): give the run's own --task/--data/--n-docs/--trials/--seed"
        )
    recorded = res["extra"].get("params", {}).get(spec)
    if not isinstance(recorded, dict):
        raise InvalidInputError(f"the run recorded no parameters for {spec}")
    theirs = dict(recorded)
    ours = {k: v for k, v in parse_spec(spec).param_dict().items() if k != "all_words"}
    theirs.pop("all_words", None)
    if {k: list(v) if isinstance(v, tuple) else v for k, v in ours.items()} != theirs:
        raise InvalidInputError(f"the run's {spec} had other parameters than today's: {theirs}")
    return records


def recheck(args) -> dict:
    res = read_run(Path(args.run) / "results.json")
    extra = res["extra"]
    examples = build_examples(
        args.task, args.data, args.n_docs, args.positions, args.trials, args.seed, args.limit
    )
    spec = args.spec
    records = check_run(res, examples, spec)
    model, tok = load_model(res["model"])
    prompt, max_new = extra["prompt"], extra["max_new_tokens"]
    sole = sole_documents(model, tok, examples, records, spec, max_new, prompt)
    if args.dry_run:
        return {"answered_again": sorted(sole), "dry_run": True}
    verify = verify_ids(examples, records, spec, set(sole), args.verify)
    again = set(sole) | set(verify)
    done = {key: r for key, r in records.items() if not (key[1] == spec and key[0] in again)}
    new = run(model, tok, examples, ["none", spec], max_new, False, None, done, prompt)
    by_id = {r["id"]: r for r in new if r["method"] == spec}
    old = {i: records[(i, spec)] for i in again}
    changed = [i for i in sorted(sole) if by_id[i].get("chosen") != []]
    answers = [i for i in changed if by_id[i]["prediction"] != old[i]["prediction"]]
    mismatched = [i for i in verify if answer_of(by_id[i]) != answer_of(old[i])]
    summary = {
        "from": str(args.run),
        "kvedit": {"version": __version__, "source": source_digest()},  # the answers redone
        "answered_again": sorted(sole),
        "chosen_now": {i: by_id[i].get("chosen") for i in changed},
        "answer_changed": answers,
        "right_now": [i for i in answers if by_id[i]["correct"]],
        "right_before": [i for i in answers if old[i]["correct"]],
        "verified": len(verify),
        "verify_mismatched": mismatched,
    }
    write_results(args.out, res["model"], res["task"], new, extra={**extra, "recheck": summary})
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("run", help="the earlier run's folder (its results.json)")
    p.add_argument("--task", default="records")
    p.add_argument("--data", default=None)
    p.add_argument("--n-docs", type=int, default=None)
    p.add_argument("--positions", type=parse_positions, default=None)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--spec", default="auto", help="the run's auto method spec (default: auto)")
    p.add_argument("--verify", type=int, default=3, help="edited and abstained examples redone")
    p.add_argument(
        "--out", default=None, help="the rechecked run's folder (needed but with --dry-run)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="only list the abstentions the rule could change"
    )
    args = p.parse_args(argv)
    if args.out is None and not args.dry_run:
        p.error("--out is needed (or --dry-run)")
    try:
        s = recheck(args)
    except InvalidInputError as e:
        raise SystemExit(f"{args.run}: {e}") from None
    if s.get("dry_run"):
        print(f"{args.run}: {len(s['answered_again'])} abstentions to answer again")
        return 0
    print(
        f"{args.run}: {len(s['answered_again'])} abstentions answered again, "
        f"{len(s['chosen_now'])} now edit, {len(s['answer_changed'])} answers changed "
        f"({len(s['right_now'])} right now, {len(s['right_before'])} right before); "
        f"{s['verified']} verified, {len(s['verify_mismatched'])} mismatched"
    )
    return 1 if s["verify_mismatched"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
