"""Does focus scale to hundreds of passages, and does it stay out of unrelated questions?

Synthetic records ("<First Last>'s secret number is <4 digits>.", one per line, after the
records task's instruction) with 20, 50, 100 and 300 passages. Each context is captured once
(the evaluation suite's prompt: ``context + "\\n\\nQuestion: " + question`` in the chat
template, cut at the question) and asked about its first, middle and last record (the gold
positions; the cells of one size share their contexts) and about general-knowledge questions
no record answers (:data:`benchmarks.focus_abstain.UNRELATED`, rotated so that every question is asked).

Per cell: the top-1 hit rate of focus's scores (the best-scored passage is the gold record),
how often focus edits, and the accuracy (the answer's first number is the gold number) of
``none`` (no edit), ``auto`` (:func:`kvedit.focus` with its defaults: it may abstain) and
``oracle`` (focus's own adaptive edit, target 0.2 and at most 5 nats, on the gold record).
Unrelated questions: how often focus edits, and how often its answer differs from ``none``'s.

Usage::

    python -m benchmarks.focus_scale --n 5
    python -m benchmarks.focus_scale --sizes 20,50 --n 2 --unrelated 4 --out runs/scale

Writes ``rows.jsonl`` (one line per question, appended as it goes; ``--resume`` keeps it),
``results.json`` and ``results.md`` under ``--out`` (default ``runs/focus-scale``).

``--replay-guard`` runs no model: it reads ``--out``'s ``rows.jsonl`` (made by a version of
focus without the answer guard, whose ``auto`` is the edited answer) and answers each edited
question as :data:`kvedit.DEFAULT_GUARD` would, from the two answers the row holds: unedited
(``none``) where the guard's support rule (:func:`kvedit.focusing.guard.answer_support`, read on the
row's ``none``, which is ``--max-new-tokens`` long where the guard reads 32 tokens) keeps
it, edited otherwise. It writes ``results-guarded.json`` and ``results-guarded.md``.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Sequence
from pathlib import Path

import kvedit
from benchmarks.common import RUNS, add_model, command_line, parser, write_file, write_json
from benchmarks.focus_abstain import UNRELATED
from benchmarks.make_custom_records import FIRST, LAST
from kvedit.focusing.choice import QUESTION_MARK, adaptive_strengths
from kvedit.focusing.guard import answer_support, evidence_and_others
from kvedit.focusing.readout import attention_share

INSTRUCTION = "Read the records and answer the question."


def context_of(n: int, seed: int) -> tuple[str, list[str], list[str], list[str]]:
    """A context of ``n`` records: its text, the records, the names and the numbers."""
    rng = random.Random(f"focus-scale-{n}-{seed}")
    names = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], n)
    numbers = [str(x) for x in rng.sample(range(1000, 10000), n)]
    records = [f"{a}'s secret number is {b}." for a, b in zip(names, numbers, strict=True)]
    return INSTRUCTION + "\n\n" + "\n".join(records), records, names, numbers


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def run_context(model, tok, n: int, seed: int, unrelated: list[str], max_new: int) -> list[dict]:
    context, records, names, numbers = context_of(n, seed)
    t0 = time.time()
    prefix, _ = kvedit.chat_prefix(tok, context + QUESTION_MARK + " x", QUESTION_MARK)
    state = kvedit.capture(model, tok, prefix)
    start = prefix.rfind(context)
    region = (start, start + len(context))
    rows = []
    asks = [(p, pos) for p, pos in (("first", 0), ("middle", n // 2), ("last", n - 1))]
    for label, pos in [*asks, *[(q, None) for q in unrelated]]:
        question = f"What is {names[pos]}'s secret number?" if pos is not None else label
        _, cont = kvedit.chat_prefix(tok, context + QUESTION_MARK + " " + question, QUESTION_MARK)
        found = kvedit.focus(state, cont, query=question, region=region)
        plain = state.generate(cont, max_new)
        auto = found.generate(max_new) if found.chosen else plain
        row = {
            "n": n,
            "seed": seed,
            "question": question,
            "position": label if pos is not None else "unrelated",
            "edited": bool(found.chosen),
            "best": found.best,
            "chosen": found.chosen,
            "reason": found.reason,
            "none": plain,
            "auto": auto,
        }
        if pos is not None:
            gold = found.passages[pos + 1]  # passage 0 is the instruction
            assert state.text[gold[0] : gold[1]] == records[pos]
            share = attention_share(state, cont, [gold]).per_layer[:, 0]
            oracle_state = kvedit.ops.emphasize(
                state, [gold], adaptive_strengths(share, 0.2, 5.0).tolist()
            )
            row.update(
                gold=pos + 1,
                answer=numbers[pos],
                hit=found.best == pos + 1,
                oracle=oracle_state.generate(cont, max_new),
            )
            for m in ("none", "auto", "oracle"):
                row[f"{m}_ok"] = first_number(row[m]) == numbers[pos]
        else:
            row["changed"] = auto != plain
        rows.append(row)
    print(f"n={n} seed={seed}: {len(rows)} questions in {time.time() - t0:.0f}s", flush=True)
    return rows


def guarded_rows(rows: list[dict]) -> list[dict]:
    """``rows`` with each edited question's ``auto`` answered as the default guard would
    (see the module docstring); ``"kept"`` says whether the edit stood."""
    guard = kvedit.DEFAULT_GUARD
    out = []
    for r in rows:
        r = dict(r)
        if r["edited"]:
            _, records, _, _ = context_of(r["n"], r["seed"])
            passages = [INSTRUCTION, *records]  # focus's passages: the instruction, each record
            evidence, others = evidence_and_others(passages, r["chosen"])
            support = answer_support(r["none"], evidence, r["question"], others, guard.shared)
            r["kept"] = support < guard.threshold
            r["support"] = support
            if not r["kept"]:
                r["auto"] = r["none"]
                if r["position"] == "unrelated":
                    r["changed"] = False
                else:
                    r["auto_ok"] = r["none_ok"]
        out.append(r)
    return out


def summarize(rows: list[dict]) -> dict:
    cells, unrel = {}, {}
    for r in rows:
        if r["position"] == "unrelated":
            u = unrel.setdefault(r["n"], {"questions": 0, "edits": 0, "changed": 0})
            u["questions"] += 1
            u["edits"] += r["edited"]
            u["changed"] += r["changed"]
            continue
        c = cells.setdefault(f"{r['n']}/{r['position']}", {"n": r["n"], "examples": 0})
        c["examples"] += 1
        for k in ("hit", "edited", "none_ok", "auto_ok", "oracle_ok"):
            c[k] = c.get(k, 0) + r[k]
        c["lost"] = c.get("lost", 0) + (r["none_ok"] and not r["auto_ok"])
    for c in cells.values():
        for k in ("hit", "edited", "none_ok", "auto_ok", "oracle_ok"):
            c[k] = c[k] / c["examples"]
    total = {k: sum(u[k] for u in unrel.values()) for k in ("questions", "edits", "changed")}
    return {"cells": cells, "unrelated": {"by_size": unrel, "total": total}}


def markdown(summary: dict, command: str) -> str:
    lines = [
        "# Focus at scale (SmolLM2-135M-Instruct)",
        "",
        f"Command: `{command}`",
        "",
        "| passages / gold | examples | top-1 hit | focus edits | none | auto | oracle | lost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, c in summary["cells"].items():
        lines.append(
            f"| {key} | {c['examples']} | {c['hit']:.2f} | {c['edited']:.2f} | "
            f"{c['none_ok']:.2f} | {c['auto_ok']:.2f} | {c['oracle_ok']:.2f} | {c['lost']} |"
        )
    u = summary["unrelated"]
    lines += ["", "Unrelated general-knowledge questions over the same contexts:", ""]
    lines += ["| passages | questions | focus edits | answer changed |", "|---|---|---|---|"]
    for n, x in u["by_size"].items():
        lines.append(f"| {n} | {x['questions']} | {x['edits']} | {x['changed']} |")
    t = u["total"]
    q = max(1, t["questions"])
    lines.append(
        f"| all | {t['questions']} | {t['edits']} ({t['edits'] / q:.1%}) | "
        f"{t['changed']} ({t['changed'] / q:.1%}) |"
    )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--sizes", default="20,50,100,300", help="passages per context")
    p.add_argument("--n", type=int, default=20, help="contexts (examples per cell) per size")
    p.add_argument("--unrelated", type=int, default=4, help="unrelated questions per context")
    p.add_argument("--seed", type=int, default=100, help="first context seed (not a tuning seed)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    add_model(p)
    p.add_argument("--out", default=str(RUNS / "focus-scale"), help="the results' folder")
    p.add_argument("--resume", action="store_true", help="keep --out's rows.jsonl, add the rest")
    p.add_argument("--replay-guard", action="store_true", help="see the module docstring")
    args = p.parse_args(argv)
    command = command_line(__file__, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rows.jsonl"
    if args.replay_guard:
        rows = guarded_rows([json.loads(x) for x in path.read_text().splitlines()])
        summary = summarize(rows)
        kept = sum(r.get("kept") is False for r in rows)
        payload = {"command": command, "unedited_kept": kept, **summary}
        write_json(out / "results-guarded.json", payload, indent=1)
        text = markdown(summary, command)
        text += f"\nThe guard kept the unedited answer on {kept} edited questions.\n"
        write_file(out / "results-guarded.md", text)
        print(text)
        return 0
    rows = (
        [json.loads(x) for x in path.read_text().splitlines()]
        if args.resume and path.exists()
        else []
    )
    if not args.resume:
        path.write_text("")
    done = {(r["n"], r["seed"]) for r in rows}
    model, tok = kvedit.load_model(args.model, device="cpu")
    k = 0
    for i in range(args.n):
        for n in [int(x) for x in args.sizes.split(",")]:
            seed = args.seed + i
            unrelated = [UNRELATED[(k + j) % len(UNRELATED)] for j in range(args.unrelated)]
            k += args.unrelated
            if (n, seed) in done:
                continue
            new = run_context(model, tok, n, seed, unrelated, args.max_new_tokens)
            with path.open("a") as f:
                for r in new:
                    f.write(json.dumps(r) + "\n")
            rows += new
            summary = summarize(rows)
            write_json(out / "results.json", {"command": command, **summary}, indent=1)
            write_file(out / "results.md", markdown(summary, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
