"""What focus costs per example, next to answering without it.

For each example: the capture of the documents (shared by every method), ``none`` (answer
from the captured state), and ``auto`` split into its parts: scoring (two question-length
passes: the question and its content-free calibration), the edit (one recompute of the last
token; none when focus abstains) and the answer: with an edit, the default answer guard
(:data:`kvedit.focusing.choice.DEFAULT_GUARD`) decodes the unedited answer and, unless that answer
comes from the chosen passage, the edited one (two question-length passes and their decode
steps); after an abstention, the unedited answer only. Times are medians over the examples, in seconds, on this machine's
threads (``torch.get_num_threads()``).

Usage: ``python -m benchmarks.focus_cost --task nq --examples 12 --out runs/focus_cost_nq.json``
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks.common import add_model, parser, write_json
from kvedit import ops
from kvedit.evals.litm import build_examples
from kvedit.evals.methods import ExampleContext
from kvedit.focusing.choice import DEFAULT_GUARD, choose
from kvedit.focusing.guard import evidence_and_others
from kvedit.models import load_model


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--task", default="nq", help="records, nq, lockers...")
    p.add_argument("--n-docs", type=int, default=None, help="documents per prompt")
    p.add_argument("--examples", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    add_model(p)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="write the times here (JSON)")
    args = p.parse_args(argv)
    model, tok = load_model(args.model)
    examples = build_examples(args.task, None, args.n_docs, None, None, args.seed, args.examples)
    rows = []
    for ex in examples:
        ctx = ExampleContext(model, tok, ex, args.max_new_tokens)
        q, n = ctx.continuation, args.max_new_tokens
        t = [time.perf_counter()]
        state = ctx.state
        t.append(time.perf_counter())
        state.generate(q, n)
        t.append(time.perf_counter())
        found = choose(state, q, ctx.doc_spans, query=ex.question)
        t.append(time.perf_counter())
        edited = (  # an abstention makes no edit and answers from the unedited state
            ops.emphasize(state, [found.passages[i] for i in found.chosen], found.strengths)
            if found.chosen
            else state
        )
        t.append(time.perf_counter())
        if found.chosen:
            texts = [state.text[a:b] for a, b in found.passages]
            evidence, others = evidence_and_others(texts, found.chosen)
            guard = dataclasses.replace(DEFAULT_GUARD, max_new_tokens=n)
            verdict = guard.decide(
                state, edited, q, evidence=evidence, others=others, query=ex.question
            )
        else:
            edited.generate(q, n)
        t.append(time.perf_counter())
        t_capture, t_none, t_score, t_edit, t_answer = (b - a for a, b in zip(t, t[1:]))
        rows.append(
            {
                "id": ex.id,
                "prompt_tokens": len(state),
                "question_tokens": len(state.encode(q)),
                "abstained": not found.chosen,
                "guard_kept_edit": bool(found.chosen) and verdict.kept,
                "capture": t_capture,
                "none": t_none,
                "auto_score": t_score,
                "auto_edit": t_edit,
                "auto_answer": t_answer,
                "auto": t_score + t_edit + t_answer,
            }
        )
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()})
    keys = ["capture", "none", "auto_score", "auto_edit", "auto_answer", "auto"]
    summary = {k: statistics.median(r[k] for r in rows) for k in keys}
    summary["auto_over_none"] = summary["auto"] / summary["none"]
    summary["threads"] = torch.get_num_threads()
    summary["prompt_tokens"] = statistics.median(r["prompt_tokens"] for r in rows)
    summary["abstained"] = sum(r["abstained"] for r in rows)
    summary["guard_kept_edit"] = sum(r["guard_kept_edit"] for r in rows)
    print(json.dumps({k: round(v, 3) for k, v in summary.items()}, indent=1))
    write_json(args.out, {"summary": summary, "examples": rows}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
