"""What focus costs per example, next to answering without it: without and with the reuse of the
scoring pass, side by side in one process.

For each example: the capture of the documents (shared by every method), ``none`` (the greedy
answer from the captured state), then ``auto`` (what ``kvedit eval litm --methods auto`` runs:
:func:`kvedit.focusing.choice.choose`, :func:`kvedit.ops.emphasize` when a document is chosen,
:func:`kvedit.focusing.choice.guarded` with the eval's answer guard, :meth:`Focus.generate`),
split into scoring (two question-length passes), the edit (one recompute of the last token;
none on an abstention) and the answer, three ways, each example alternating their order:

- ``old``: the question's scoring pass dropped (:attr:`Focus.continued` ``None``): the guard's
  unedited answer, and the answer after an abstention, run the question again (kvedit before
  the reuse);
- ``new``: the unedited answer starts after the scoring pass (what ``kvedit.focus`` does);
- ``eval``: ``new`` given ``none``'s answer (``focus(..., unedited=)``, what the eval does when
  ``none`` answered the example first): eval time only.

Every way must give the same choice, verdict and answer (``identical`` in the summary; the run
exits 1 otherwise). Each example is put on one of three paths: ``abstained`` (no edit),
``unedited`` (the guard kept the unedited answer) and ``edited`` (the edit answered). Times are
wall and process CPU seconds (``*_cpu``: both threads summed, less disturbed by other jobs on a
shared machine); the summary gives means and medians, per path too, and ``auto / none`` of the
means, on ``torch.get_num_threads()`` threads.

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
from kvedit.evals.methods.auto import AutoParams
from kvedit.evals.methods.focus import focus_args, guard_of
from kvedit.focusing.choice import choose, guarded
from kvedit.models import load_model

WAYS = ("old", "new", "eval")
PATHS = ("abstained", "unedited", "edited")
PARTS = ("score", "edit", "answer")


class Clock:
    """Wall and process CPU seconds since the last :meth:`lap`."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def auto(ctx: ExampleContext, way: str, none_answer) -> tuple[dict, tuple]:
    """One ``auto`` answer the ``way`` says: its times, and what it decided and answered."""
    params = AutoParams()
    state, q, n = ctx.state, ctx.continuation, ctx.max_new_tokens
    clock, times = Clock(), {}
    found = choose(state, q, ctx.doc_spans, **focus_args(ctx, params))
    if way == "old":
        found = dataclasses.replace(found, continued=None)
    elif way == "eval":
        found = dataclasses.replace(
            found, continued=dataclasses.replace(found.continued, known=none_answer)
        )
    times["score"] = clock.lap()
    edited = None
    if found.chosen:
        spans = [found.passages[i] for i in found.chosen]
        edited = ops.emphasize(state, spans, found.strengths)
    times["edit"] = clock.lap()
    if edited is not None:
        found = guarded(found, edited, guard_of(params, ctx))
    text = found.generate(n)
    times["answer"] = clock.lap()
    path = "abstained" if not found.chosen else ("edited" if found.kept else "unedited")
    verdict = None if found.verdict is None else (found.verdict.kept, found.verdict.reason)
    return {"path": path, **times}, (found.chosen, verdict, text)


def mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in rows) if rows else float("nan")


def summarize(rows: list[dict], identical: bool) -> dict:
    """Means and medians of ``rows`` (one per example), per way, part and path."""
    summary: dict = {"threads": torch.get_num_threads(), "examples": len(rows)}
    summary["identical"] = identical
    for suffix in ("", "_cpu"):
        none = mean(rows, "none" + suffix)
        summary["none" + suffix] = none
        summary["none_median" + suffix] = statistics.median(r["none" + suffix] for r in rows)
        for way in WAYS:
            summary[way + suffix] = mean(rows, way + suffix)
            summary[f"{way}_median{suffix}"] = statistics.median(r[way + suffix] for r in rows)
            summary[f"{way}_over_none{suffix}"] = summary[way + suffix] / none
            for part in PARTS:
                summary[f"{way}_{part}{suffix}"] = mean(rows, f"{way}_{part}{suffix}")
        for path in PATHS:
            on = [r for r in rows if r["path"] == path]
            summary[f"{path}_examples"] = len(on)
            summary[f"{path}_none{suffix}"] = mean(on, "none" + suffix)
            for way in WAYS:
                summary[f"{path}_{way}{suffix}"] = mean(on, way + suffix)
    return summary


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
    rows, identical = [], True
    for k, ex in enumerate(examples):
        ctx = ExampleContext(model, tok, ex, args.max_new_tokens)
        clock = Clock()
        state = ctx.state
        row = {"id": ex.id, "prompt_tokens": len(state), "capture": clock.lap()[0]}
        none_answer = state.answer(ctx.continuation, ctx.max_new_tokens)
        row["none"], row["none_cpu"] = clock.lap()
        outcomes = {}
        for way in WAYS[k % 3 :] + WAYS[: k % 3]:  # each way first on a third of the examples
            times, outcomes[way] = auto(ctx, way, none_answer)
            row["path"] = times["path"]
            for part in PARTS:
                row[f"{way}_{part}"], row[f"{way}_{part}_cpu"] = times[part]
            for suffix, i in (("", 0), ("_cpu", 1)):
                row[f"{way}{suffix}"] = sum(times[part][i] for part in PARTS)
        row["identical"] = outcomes["old"] == outcomes["new"] == outcomes["eval"]
        identical &= row["identical"]
        rows.append(row)
        print({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()})
        summary = summarize(rows, identical)
        write_json(args.out, {"summary": summary, "examples": rows}, indent=1)  # so far
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
