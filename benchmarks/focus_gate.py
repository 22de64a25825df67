"""Tuning data for focus's do-no-harm rule: both answers and their confidences, per example.

For every example, the model answers from the captured context as it is (``none``) and after
:func:`kvedit.focus` emphasizes the chosen passage without any gate. One JSON line per example
records both answers, each token's log-probability, whether each is correct (the gold label
is used here only to *evaluate* candidate rules, never by a rule), the chosen passage and its
scores. ``--analyze FILE...`` then prints, per rule and threshold, the accuracy per position
of "edit only when the rule says so", so the rule is chosen on tuning seeds and reported on
others.

Usage::

    python benchmarks/focus_gate.py --task records --seed 1 --trials 6 --out runs/gate-records-s1.jsonl
    python benchmarks/focus_gate.py --analyze runs/gate-*.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from pathlib import Path

from kvedit.evals.litm import build_examples
from kvedit.evals.methods import ExampleContext
from kvedit.evals.schema import score
from kvedit.focusing.choice import focus
from kvedit.focusing.readout import attention_share
from kvedit.models import load_model
from kvedit.ops import emphasize


def collect(args) -> None:
    model, tok = load_model(args.model)
    positions = None if args.positions is None else [int(x) for x in args.positions.split(",")]
    examples = build_examples(
        args.task, args.data, args.n_docs, positions, args.trials, args.seed, args.limit
    )
    out = Path(args.out)
    done = set()
    if out.exists():
        done = {json.loads(line)["id"] for line in out.read_text().splitlines() if line.strip()}
    with out.open("a") as f:
        for ex in examples:
            if ex.id in done:
                continue
            ctx = ExampleContext(model, tok, ex, args.max_new_tokens)
            t0 = time.perf_counter()
            none = ctx.state.answer(ctx.continuation, args.max_new_tokens)
            t1 = time.perf_counter()
            found = focus(ctx.state, ctx.continuation, ctx.doc_spans, query=ex.question)
            edited = found.state.answer(ctx.continuation, args.max_new_tokens)
            t2 = time.perf_counter()
            cross_edit = ctx.state.token_logprobs(ctx.continuation, edited.token_ids)
            cross_none = found.state.token_logprobs(ctx.continuation, none.token_ids)
            variants = {}
            if args.variants and found.chosen:
                # per layer, every passage's share of the question's attention (unedited)
                real = attention_share(ctx.state, ctx.continuation, list(found.passages)).per_layer
                others = real.clone()
                others[:, found.chosen] = -1.0
                leads = (real[:, found.chosen].sum(-1) >= others.max(-1).values).tolist()
                nolead = [
                    0.0 if lead else s for s, lead in zip(found.strengths, leads, strict=True)
                ]
                spans = [found.passages[i] for i in found.chosen]
                alt = emphasize(ctx.state, spans, nolead).answer(
                    ctx.continuation, args.max_new_tokens
                )
                variants = {
                    "shares": [[round(x, 5) for x in row] for row in real.tolist()],
                    "leads": leads,
                    "nolead": alt.text,
                    "nolead_ok": bool(score(ex, alt.text)),
                }
            rec = {
                "id": ex.id,
                "gold_index": ex.gold_index,
                "n_docs": len(ex.documents),
                "none": none.text,
                "none_lp": none.logprobs,
                "none_ids": none.token_ids,
                "none_ok": bool(score(ex, none.text)),
                "edit": edited.text,
                "edit_lp": edited.logprobs,
                "edit_ids": edited.token_ids,
                "edit_ok": bool(score(ex, edited.text)),
                "edit_under_none_lp": cross_edit,
                "none_under_edit_lp": cross_none,
                "chosen": found.chosen,
                "scores": found.scores,
                "strengths": found.strengths,
                "seconds_none": round(t1 - t0, 3),
                "seconds_focus": round(t2 - t1, 3),
                **variants,
            }
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(ex.id, rec["none_ok"], rec["edit_ok"], flush=True)


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def _conf(lps, n):
    lps = lps[:n] if n else lps
    return _mean(lps)


def _diverge_conf(a, b, lps_a, n):
    """Mean log-prob of answer a's tokens from the first token where a and b differ."""
    i = _first_difference(a, b)
    part = lps_a[i : i + n] if n else lps_a[i:]
    return _mean(part)


def _first_difference(a, b) -> int:
    """The first index where token lists ``a`` and ``b`` differ (their common length if none)."""
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def _window(r, n):
    """``(i, j)``: from the first differing token of the two answers, up to ``n`` tokens (all
    with ``n=0``); ``None`` when the answers are the same."""
    a, b = r["edit_ids"], r["none_ids"]
    i = _first_difference(a, b)
    if i == len(a) == len(b):
        return None
    return i, (i + n) if n else None


def _committee(r, n):
    """Both states' log-probs of the edited answer minus both states' log-probs of none's,
    from the first token where they differ (summed over up to n tokens)."""
    w = _window(r, n)
    if w is None:
        return 0.0
    i, j = w
    edit = sum(r["edit_lp"][i:j]) + sum(r["edit_under_none_lp"][i:j])
    none = sum(r["none_lp"][i:j]) + sum(r["none_under_edit_lp"][i:j])
    return edit - none


def _cross(r, n):
    """From the first differing token: the unedited state's log-prob of the edited answer
    minus the edited state's log-prob of the unedited answer (summed over up to n tokens)."""
    w = _window(r, n)
    if w is None:
        return 0.0
    i, j = w
    return sum(r["edit_under_none_lp"][i:j]) - sum(r["none_under_edit_lp"][i:j])


RULES = {
    # keep the edit when the edited answer is more confident (first n tokens) by > delta
    "conf_first_n": lambda r, n, d: _conf(r["edit_lp"], n) > _conf(r["none_lp"], n) + d,
    # edit only when none's first tokens are not confident (mean prob below exp(d))
    "none_unsure": lambda r, n, d: _conf(r["none_lp"], n) < d,
}


def analyze(paths: list[str]) -> None:
    for path in paths:
        recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        print(f"\n== {path}: {len(recs)} examples")
        pos = sorted({r["gold_index"] for r in recs})

        def line(name, pick, recs=recs, pos=pos):
            by = defaultdict(list)
            for r in recs:
                by[r["gold_index"]].append(r["edit_ok"] if pick(r) else r["none_ok"])
            accs = [_mean(by[p]) for p in pos]
            kept = _mean([pick(r) for r in recs])
            print(
                f"{name:<28} mean {_mean(accs):.3f} worst {min(accs):.3f} kept {kept:.2f}  "
                + " ".join(f"{a:.2f}" for a in accs)
            )

        print("positions", pos)
        line("none", lambda r: False)
        line("focus (no gate)", lambda r: True)
        line("oracle gate (uses gold)", lambda r: r["edit_ok"] and not r["none_ok"])
        for n in (1, 2, 3, 4, 6, 8, 0):
            for d in (-0.5, -0.2, 0.0, 0.2, 0.5):
                line(f"conf n={n} d={d}", lambda r, n=n, d=d: RULES["conf_first_n"](r, n, d))
        for n in (1, 2, 4, 0):
            for p in (0.3, 0.5, 0.7, 0.9):
                d = math.log(p)
                line(f"none_unsure n={n} p<{p}", lambda r, n=n, d=d: RULES["none_unsure"](r, n, d))
        for n in (1, 2, 4, 0):
            for d in (-1.0, 0.0, 1.0):
                line(
                    f"committee n={n} d={d}",
                    lambda r, n=n, d=d: _committee(r, n) > d,
                )
        for n in (1, 2, 4, 0):
            for d in (-2.0, -1.0, 0.0, 1.0):
                line(f"cross n={n} d={d}", lambda r, n=n, d=d: _cross(r, n) > d)
        for n in (1, 2, 4, 0):
            line(
                f"diverge n={n}",
                lambda r, n=n: (
                    _diverge_conf(r["edit_ids"], r["none_ids"], r["edit_lp"], n)
                    > _diverge_conf(r["none_ids"], r["edit_ids"], r["none_lp"], n)
                ),
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="records")
    p.add_argument("--data", default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--n-docs", type=int, default=None)
    p.add_argument("--positions", default=None, help="comma-separated gold positions")
    p.add_argument(
        "--variants",
        action="store_true",
        help="also record every layer's shares and the answer with no bias on the layers "
        "where the chosen passage already leads",
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", default="runs/gate.jsonl")
    p.add_argument("--analyze", nargs="*", default=None)
    args = p.parse_args()
    if args.analyze:
        analyze(args.analyze)
    else:
        collect(args)


if __name__ == "__main__":
    main()
