"""Does focus scale to hundreds of passages, and does it stay out of unrelated questions?

Synthetic records, one per line after the records task's instruction, with 20, 50, 100 and 300
passages, in one of the wordings of :mod:`benchmarks.focus_wordings` (``--wording``): ``secret``
(the default, the wording focus was tuned on), ``doors`` and ``moves`` (held out: the
question's telling words each on several lines, only the gold holding all), ``lessons`` and
``visits`` (tuning wordings of those two shapes).

Each context is captured once (the evaluation suite's prompt: ``context + "\\n\\nQuestion: " +
question`` in the chat template, cut at the question) and asked about its first, middle and
last record (the gold positions; the cells of one size share their contexts) and about
general-knowledge questions no record answers (:data:`benchmarks.focus_abstain.UNRELATED`,
``--unrelated`` per context rotated over the whole run, or ``--unrelated-per-size`` spread over
each size's contexts so that every size asks each of them).

Per cell: the top-1 hit rate of focus's scores (the best-scored passage is the gold record),
how often focus edits, and the accuracy (the answer's first number is the gold number; for
``moves`` and ``visits``, the first city or country of the wording's list it names is the
gold one: :func:`benchmarks.focus_wordings.answer_of`) of ``none`` (no
edit), ``auto`` (:func:`kvedit.focus` with its defaults: it may abstain) and ``oracle`` (focus's
own adaptive edit, target 0.2 and at most 5 nats, on the gold record). Unrelated questions: how
often focus edits, and how often its answer differs from ``none``'s. Each row also keeps the
gold's score and robust z and the best other passage's (``gold_z``, ``rival``...), to tell an
abstention the threshold caused from one the scores caused, and ``by_words``: focus chose the
passage because it alone holds all of the question's words
(:func:`kvedit.focusing.scoring.sole_holder`), not because its score stands out.

Usage::

    python -m benchmarks.focus_scale --n 5
    python -m benchmarks.focus_scale --sizes 20,50 --n 2 --unrelated 4 --out runs/scale
    python -m benchmarks.focus_scale --wording doors --sizes 20 --n 2 --unrelated-per-size 4

Writes ``rows.jsonl`` (one line per question, appended as it goes; ``--resume`` keeps it),
``results.json`` and ``results.md`` under ``--out`` (default ``runs/focus-scale``).

``--replay-guard`` runs no model: it reads ``--out``'s ``rows.jsonl`` (made by a version of
focus without the answer guard, whose ``auto`` is the edited answer) and answers each edited
question as :data:`kvedit.DEFAULT_GUARD` would, from the two answers the row holds: unedited
(``none``) where the guard's support rule (:func:`kvedit.focusing.guard.answer_support`, read on the
row's ``none``, which is ``--max-new-tokens`` long where the guard reads 32 tokens) keeps
it, edited otherwise. It writes ``results-guarded.json`` and ``results-guarded.md``.

``--recheck DIR`` answers again, with today's focus, only the rows of ``DIR/rows.jsonl`` (made
by a focus before the rule for a passage holding all of the question's words) where that rule
may change the answer: focus abstained and :func:`kvedit.focusing.scoring.sole_holder` names a
passage. The rule only turns an abstention into an edit, so every other row stands; all rows
go to ``--out``.

``--abstentions`` runs no model either: from ``--out``'s ``rows.jsonl`` it writes
``abstentions.md``, each cell's abstentions on relevant questions and whether the scores (another
passage scored above the gold) or the abstain rule (the gold scored highest, its robust z below
the threshold) caused each.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import kvedit
from benchmarks.common import RUNS, add_model, command_line, parser, write_file, write_json
from benchmarks.focus_abstain import UNRELATED
from benchmarks.focus_wordings import (
    INSTRUCTION,
    WORDINGS,
    answer_of,
    context_of,
)
from kvedit.errors import InvalidInputError
from kvedit.focusing.choice import QUESTION_MARK, adaptive_strengths
from kvedit.focusing.guard import answer_support, evidence_and_others
from kvedit.focusing.readout import attention_share
from kvedit.focusing.scoring import robust_z, sole_holder


def score_fields(found, gold: int | None) -> dict:
    """The scores behind focus's choice: the best other passage's (``rival``) score and robust
    z among the candidates (non-echo passages), and with ``gold`` (a passage index) the gold's.
    Without ``gold`` the rival is the best-scored passage."""
    scores = torch.tensor(found.scores, dtype=torch.float64)
    candidates = torch.ones(scores.numel(), dtype=torch.bool)
    candidates[found.echoes] = False
    z = robust_z(scores, candidates)
    order = [int(i) for i in scores.argsort(descending=True) if candidates[i] and i != gold]
    out = {"eligible": len(found.eligible)}
    if order:
        r = order[0]
        out.update(rival=r, rival_score=float(scores[r]), rival_z=float(z[r]))
    if gold is not None:
        out.update(gold_score=float(scores[gold]), gold_z=float(z[gold]))
    return out


def run_context(
    model,
    tok,
    n: int,
    seed: int,
    unrelated: list[str],
    max_new: int,
    wording: str = "secret",
    only: set[str] | None = None,
) -> list[dict]:
    """The rows of one context: its first, middle and last record's questions, then
    ``unrelated``; with ``only``, just the questions it holds."""
    context, records, questions, answers = context_of(n, seed, wording)
    t0 = time.time()
    prefix, _ = kvedit.chat_prefix(tok, context + QUESTION_MARK + " x", QUESTION_MARK)
    state = kvedit.capture(model, tok, prefix)
    start = prefix.rfind(context)
    region = (start, start + len(context))
    rows = []
    asks = [(p, pos) for p, pos in (("first", 0), ("middle", n // 2), ("last", n - 1))]
    for label, pos in [*asks, *[(q, None) for q in unrelated]]:
        question = questions[pos] if pos is not None else label
        if only is not None and question not in only:
            continue
        _, cont = kvedit.chat_prefix(tok, context + QUESTION_MARK + " " + question, QUESTION_MARK)
        found = kvedit.focus(state, cont, query=question, region=region)
        plain = state.generate(cont, max_new)
        auto = found.generate(max_new) if found.chosen else plain
        row = {
            "wording": wording,
            "n": n,
            "seed": seed,
            "question": question,
            "position": label if pos is not None else "unrelated",
            "edited": bool(found.chosen),
            "by_words": found.by_words,
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
                answer=answers[pos],
                hit=found.best == pos + 1,
                oracle=oracle_state.generate(cont, max_new),
                **score_fields(found, pos + 1),
            )
            for m in ("none", "auto", "oracle"):
                row[f"{m}_ok"] = answer_of(wording, row[m]) == answers[pos]
        else:
            row["changed"] = auto != plain
            row.update(score_fields(found, None))
        rows.append(row)
    print(
        f"{wording} n={n} seed={seed}: {len(rows)} questions in {time.time() - t0:.0f}s", flush=True
    )
    return rows


def guarded_rows(rows: list[dict]) -> list[dict]:
    """``rows`` with each edited question's ``auto`` answered as the default guard would
    (see the module docstring); ``"kept"`` says whether the edit stood."""
    guard = kvedit.DEFAULT_GUARD
    out = []
    for r in rows:
        r = dict(r)
        if r["edited"]:
            _, records, _, _ = context_of(r["n"], r["seed"], r.get("wording", "secret"))
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


def sole_questions(rows: list[dict]) -> set[tuple[int, int, str]]:
    """``(n, seed, question)`` of each row whose question focus did not edit and for which
    :func:`kvedit.focusing.scoring.sole_holder` names a passage (the instruction or a record):
    the only rows today's focus may answer otherwise than a focus without that rule."""
    out = set()
    for r in rows:
        if r["edited"]:
            continue
        _, records, _, _ = context_of(r["n"], r["seed"], r.get("wording", "secret"))
        passages = [INSTRUCTION, *records]  # focus's passages: the instruction, each record
        if sole_holder(r["question"], passages, torch.ones(len(passages), dtype=torch.bool)):
            out.add((r["n"], r["seed"], r["question"]))
    return out


def rechecked(model, tok, rows: list[dict], max_new: int) -> tuple[list[dict], int]:
    """``rows`` (made by a focus before :func:`kvedit.focusing.scoring.sole_holder`'s rule)
    with each row :func:`sole_questions` names answered again by today's focus; and how many
    were. Every other row stands: the rule only turns an abstention into an edit."""
    again = sole_questions(rows)
    unrelated = {(r["n"], r["seed"], r["question"]) for r in rows if r["position"] == "unrelated"}
    wording = rows[0].get("wording", "secret") if rows else "secret"
    fresh = {}
    for n, seed in sorted({(n, seed) for n, seed, _ in again}):
        only = {q for m, s, q in again if (m, s) == (n, seed)}
        asked = sorted(q for q in only if (n, seed, q) in unrelated)
        for r in run_context(model, tok, n, seed, asked, max_new, wording, only):
            fresh[(n, seed, r["question"])] = r
    return [fresh.get((r["n"], r["seed"], r["question"]), r) for r in rows], len(again)


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


def abstentions(rows: list[dict]) -> str:
    """A markdown table of where focus abstained on a relevant question, per cell, and why:
    ``scores`` when another passage scored above the gold (the gold may still be the only
    passage the coverage rule leaves, and so the top-1 hit), ``rule`` when the gold scored
    highest of all and its robust z still fell below the threshold; then each abstention's
    scores. Reads the rows' ``gold_score``, ``gold_z``, ``rival_score`` and ``rival_z``."""
    cells: dict[tuple[int, str], dict] = {}
    listed = []
    order = {"first": 0, "middle": 1, "last": 2}
    for r in rows:
        if r["position"] == "unrelated":
            continue
        c = cells.setdefault((r["n"], r["position"]), dict.fromkeys(
            ("examples", "top", "abstained", "scores", "rule", "won", "lost"), 0
        ))  # fmt: skip
        top = r["gold_score"] > r["rival_score"]
        c["examples"] += 1
        c["top"] += top
        c["won"] += r["auto_ok"] and not r["none_ok"]
        c["lost"] += r["none_ok"] and not r["auto_ok"]
        if not r["edited"]:
            c["abstained"] += 1
            c["rule" if top else "scores"] += 1
            listed.append((r, "rule" if top else "scores"))
    lines = [
        "| passages / gold | examples | gold scored highest of all | abstained | "
        "of which: gold outscored (scores) / gold highest, z too low (rule) | won / lost |",
        "|---|---|---|---|---|---|",
    ]
    for (n, pos), c in sorted(cells.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        lines.append(
            f"| {n}/{pos} | {c['examples']} | {c['top'] / c['examples']:.2f} | {c['abstained']} "
            f"| {c['scores']} / {c['rule']} | {c['won']} / {c['lost']} |"
        )
    lines += [
        "",
        "| passages / gold | seed | gold score (z) | best other passage: score (z) | why | "
        "none right | oracle right |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, why in sorted(listed, key=lambda x: (x[0]["n"], order[x[0]["position"]], x[0]["seed"])):
        lines.append(
            f"| {r['n']}/{r['position']} | {r['seed']} | {r['gold_score']:.3f} ({r['gold_z']:.2f}) "
            f"| #{r['rival']}: {r['rival_score']:.3f} ({r['rival_z']:.2f}) | {why} "
            f"| {'yes' if r['none_ok'] else 'no'} | {'yes' if r['oracle_ok'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def markdown(summary: dict, command: str, wording: str = "secret") -> str:
    title = "" if wording == "secret" else f", the {wording} wording"
    lines = [
        f"# Focus at scale (SmolLM2-135M-Instruct{title})",
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


def spread_unrelated(per_size: int, contexts: int, i: int) -> list[str]:
    """Context ``i``'s share (of ``contexts``) of ``per_size`` unrelated questions: the
    questions ``i * per_size // contexts`` up to ``(i + 1) * per_size // contexts`` of
    :data:`UNRELATED` (rotated), so the contexts of one size ask ``per_size`` in all."""
    a, b = i * per_size // contexts, (i + 1) * per_size // contexts
    return [UNRELATED[j % len(UNRELATED)] for j in range(a, b)]


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--sizes", default="20,50,100,300", help="passages per context")
    p.add_argument("--n", type=int, default=20, help="contexts (examples per cell) per size")
    p.add_argument("--unrelated", type=int, default=4, help="unrelated questions per context")
    p.add_argument(
        "--unrelated-per-size",
        type=int,
        default=None,
        help="instead of --unrelated: this many unrelated questions per size, spread over its "
        "--n contexts (48: each question once per size)",
    )
    p.add_argument("--wording", choices=WORDINGS, default="secret", help="the records' wording")
    p.add_argument("--seed", type=int, default=100, help="first context seed (not a tuning seed)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    add_model(p)
    p.add_argument("--out", default=str(RUNS / "focus-scale"), help="the results' folder")
    p.add_argument("--resume", action="store_true", help="keep --out's rows.jsonl, add the rest")
    p.add_argument("--replay-guard", action="store_true", help="see the module docstring")
    p.add_argument(
        "--recheck",
        default=None,
        metavar="DIR",
        help="answer again, with today's focus, the rows of DIR/rows.jsonl where the rule for a "
        "passage holding all of the question's words may change the answer; write all rows to "
        "--out (see the module docstring)",
    )
    p.add_argument(
        "--abstentions",
        action="store_true",
        help="no model: write abstentions.md from --out's rows.jsonl (see abstentions())",
    )
    args = p.parse_args(argv)
    command = command_line(__file__, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rows.jsonl"
    if args.abstentions:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        text = f"Command: `{command}`\n\n" + abstentions(rows)
        write_file(out / "abstentions.md", text)
        print(text)
        return 0
    if args.recheck is not None:
        rows = [json.loads(x) for x in (Path(args.recheck) / "rows.jsonl").read_text().splitlines()]
        if any(r.get("wording", "secret") != args.wording for r in rows):
            raise InvalidInputError(
                f"{args.recheck} holds rows of another wording than {args.wording!r}"
            )
        model, tok = kvedit.load_model(args.model, device="cpu")
        rows, again = rechecked(model, tok, rows, args.max_new_tokens)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = summarize(rows)
        write_json(
            out / "results.json", {"command": command, "answered_again": again, **summary}, indent=1
        )
        text = markdown(summary, command, args.wording)
        text += f"\n{again} questions answered again (the rest from {args.recheck}).\n"
        write_file(out / "results.md", text)
        print(text)
        return 0
    if args.replay_guard:
        rows = guarded_rows([json.loads(x) for x in path.read_text().splitlines()])
        summary = summarize(rows)
        kept = sum(r.get("kept") is False for r in rows)
        payload = {"command": command, "unedited_kept": kept, **summary}
        write_json(out / "results-guarded.json", payload, indent=1)
        text = markdown(summary, command, args.wording)
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
    if any(r.get("wording", "secret") != args.wording for r in rows):
        raise InvalidInputError(f"{path} holds rows of another wording than {args.wording!r}")
    done = {(r["n"], r["seed"]) for r in rows}
    model, tok = kvedit.load_model(args.model, device="cpu")
    k = 0
    for i in range(args.n):
        for n in [int(x) for x in args.sizes.split(",")]:
            seed = args.seed + i
            if args.unrelated_per_size is None:
                unrelated = [UNRELATED[(k + j) % len(UNRELATED)] for j in range(args.unrelated)]
                k += args.unrelated
            else:
                unrelated = spread_unrelated(args.unrelated_per_size, args.n, i)
            if (n, seed) in done:
                continue
            new = run_context(model, tok, n, seed, unrelated, args.max_new_tokens, args.wording)
            with path.open("a") as f:
                for r in new:
                    f.write(json.dumps(r) + "\n")
            rows += new
            summary = summarize(rows)
            write_json(out / "results.json", {"command": command, **summary}, indent=1)
            write_file(out / "results.md", markdown(summary, command, args.wording))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
