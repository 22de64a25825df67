"""Where a blend departs from a full prefill: the question's attention per passage and layer,
and the K/V deviation per token and layer.

For ``--per-position`` NQ examples at each gold position (``kvedit.evals.tasks.nq_examples``),
the documents are cut into blend parts as the eval's ``blend`` method does (the instruction,
then one part per document), stored, and blended (``--recompute``, ``--rule``, ``--context``);
the same token ids are prefilled in full. For both states:

* attention: the share of the question's attention (averaged over its tokens and the heads,
  the stored bias included: ``kvedit.attention_share``) on each part, per layer;
* deviation: per token and layer, ``|dK|^2 / mean |K|^2 + |dV|^2 / mean |V|^2`` of the blend's
  entries against the prefill's (``kvedit.reusing.blend_rules.deviation_scores``, the means over the
  layer's prefill entries; null where a sliding layer holds no entry), and its mean per part;
* the greedy answers, scored, and how many tokens of each part the blend recomputed.

Writes ``OUT/blend_diagnosis.json`` (every number) and ``OUT/blend_diagnosis.md`` (per example
and per gold position: the gold document's attention share under both, the layer where it
changes most, the mean deviation of the gold document and of the others).

Usage::

    python benchmarks/blend_diagnosis.py --model smollm2-135m-instruct --per-position 3 \\
        --recompute 0.15 --rule gradual=2:leading=4
    python benchmarks/blend_diagnosis.py --model tiny-llama --n-docs 3 --out /tmp/bd
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

import kvedit
from kvedit.evals.litm import resolve_prompt
from kvedit.evals.methods.blend import document_parts
from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.schema import Example, score
from kvedit.evals.tasks import nq_examples
from kvedit.reusing.blend_rules import deviation_scores
from kvedit.states.capturing import empty_state, extend_ids
from kvedit.states.state import KVState

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blend_curve import parse_rule  # noqa: E402


def deviation_matrix(blended: KVState, full: KVState) -> torch.Tensor:
    """``[layers, n]`` float32 deviation of each token's blended entries from the prefill's
    (NaN where either layer holds no entry of the token)."""
    n = len(full)
    out = torch.full((len(full.layers), n), float("nan"))
    for i, (b, f) in enumerate(zip(blended.layers, full.layers, strict=True)):
        entry_of = torch.full((n,), -1, dtype=torch.long)
        entry_of[f.token_index] = torch.arange(len(f))
        held = entry_of[b.token_index] >= 0
        tokens = b.token_index[held]
        mine, theirs = held.nonzero().flatten(), entry_of[tokens]
        out[i, tokens] = deviation_scores(
            b.keys[:, :, mine], b.values[:, :, mine], f.keys[:, :, theirs], f.values[:, :, theirs]
        ).cpu()
    return out


def rounded(values, digits: int = 5):
    """Nested lists of floats, rounded, NaN as None (JSON)."""
    if isinstance(values, list):
        return [rounded(v, digits) for v in values]
    return None if values != values else round(float(values), digits)


@torch.no_grad()
def diagnose(model, tok, example: Example, store, rule: dict, args) -> dict:
    ctx = ExampleContext(model, tok, example, args.max_new_tokens, args.prompt_format)
    parts = document_parts(ctx)
    blended, report = kvedit.blend(
        model, tok, parts, store, recompute=args.recompute, context=args.context, **rule
    )
    ids = blended.token_ids.tolist()
    full = extend_ids(empty_state(model, tok), ids, blended.offsets, blended.text)
    bounds = [0]
    for text in parts:
        bounds.append(bounds[-1] + len(text))
    spans = list(zip(bounds, bounds[1:]))
    shares = {
        name: kvedit.attention_share(state, ctx.continuation, spans).per_layer
        for name, state in (("full", full), ("blend", blended))
    }
    deviation = deviation_matrix(blended, full)
    starts = [0]
    for p in report.parts:
        starts.append(starts[-1] + p.n_tokens)
    per_part = [deviation[:, a:b].nanmean(dim=1) for a, b in zip(starts, starts[1:])]
    recomputed = [
        int(((report.recomputed_tokens >= a) & (report.recomputed_tokens < b)).sum())
        for a, b in zip(starts, starts[1:])
    ]
    answers = {
        name: state.generate(ctx.continuation, args.max_new_tokens)
        for name, state in (("full", full), ("blend", blended))
    }
    return {
        "id": example.id,
        "gold_index": example.gold_index,
        "gold_part": example.gold_index + 1,  # part 0 is the instruction
        "tokens": len(blended),
        "part_tokens": [p.n_tokens for p in report.parts],
        "recomputed_per_part": recomputed,
        "rules": list(report.rules),
        "answers": answers,
        "correct": {name: score(example, text) for name, text in answers.items()},
        "attention": {name: rounded(s.tolist()) for name, s in shares.items()},
        "deviation_per_part": rounded(torch.stack(per_part, dim=1).tolist()),
        "deviation": rounded(deviation.tolist(), 4),
    }


def summary(records: Sequence[dict], title: str) -> str:
    """The markdown summary: one row per example, then means per gold position."""
    head = "| example | gold | right (full/blend) | gold share full | gold share blend | "
    head += "largest change (layer) | dev gold | dev others | recomputed in gold |"
    lines = [f"# {title}", "", head, "|" + "---|" * 9]
    by_position: dict[int, list[dict]] = {}
    for r in records:
        g = r["gold_part"]
        full = [row[g] for row in r["attention"]["full"]]
        blend = [row[g] for row in r["attention"]["blend"]]
        change = [b - f for f, b in zip(full, blend)]
        worst = max(range(len(change)), key=lambda i: abs(change[i]))
        dev = [
            statistics.fmean(x for x in col if x is not None)
            for col in zip(*r["deviation_per_part"])
        ]
        others = (
            statistics.fmean(d for i, d in enumerate(dev) if i not in (0, g))
            if len(dev) > 2
            else float("nan")
        )
        row = {
            "full": statistics.fmean(full),
            "blend": statistics.fmean(blend),
            "dev_gold": dev[g],
            "dev_others": others,
        }
        by_position.setdefault(r["gold_index"], []).append(row)
        right = f"{r['correct']['full']:.0f}/{r['correct']['blend']:.0f}"
        lines.append(
            f"| {r['id']} | {r['gold_index']} | {right} | {row['full']:.3f} | {row['blend']:.3f} | "
            f"{change[worst]:+.3f} ({worst}) | {dev[g]:.3f} | {others:.3f} | "
            f"{r['recomputed_per_part'][g]}/{r['part_tokens'][g]} |"
        )
    lines += [
        "",
        "| gold position | n | gold share full | gold share blend | dev gold | dev others |",
    ]
    lines.append("|" + "---|" * 6)
    for pos, rows in sorted(by_position.items()):
        mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
        lines.append(
            f"| {pos} | {len(rows)} | {mean['full']:.3f} | {mean['blend']:.3f} | "
            f"{mean['dev_gold']:.3f} | {mean['dev_others']:.3f} |"
        )
    note = (
        "Shares: the question's attention on the gold document, mean over layers, heads and "
        "question tokens. Deviation: mean over the document's tokens and the layers."
    )
    return "\n".join([*lines, "", note]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default=None)
    parser.add_argument("--n-docs", type=int, default=10)
    parser.add_argument("--positions", default=None, help="gold positions (default 0,4,9)")
    parser.add_argument("--per-position", type=int, default=1, help="examples per position")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="an NQ file (default: the bundled one)")
    parser.add_argument("--recompute", type=float, default=0.15)
    parser.add_argument("--rule", default="default", help="e.g. gradual=2:leading=4")
    parser.add_argument("--context", default="prefix", choices=("prefix", "alone"))
    parser.add_argument("--prompt", default="auto", help="chat, plain or auto")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="reports", help="folder of the json and md")
    args = parser.parse_args(argv)
    rule = parse_rule(args.rule)
    args.prompt_format = resolve_prompt(args.prompt, args.model)
    last = args.n_docs - 1
    positions = (
        tuple(int(p) for p in args.positions.split(","))
        if args.positions
        else tuple(dict.fromkeys((0, last // 2, last)))
    )
    model, tok = kvedit.load_model(args.model, device=args.device)
    examples = nq_examples(
        n_docs=args.n_docs,
        positions=positions,
        trials=args.per_position,
        seed=args.seed,
        path=args.data,
    )
    with tempfile.TemporaryDirectory(prefix="kvedit-blend-diagnosis-") as tmp:
        store = kvedit.KVStore(tmp, memory_bytes=2**30)
        records = []
        for i, example in enumerate(examples):
            records.append(diagnose(model, tok, example, store, rule, args))
            print(f"[{i + 1}/{len(examples)}] {example.id}", file=sys.stderr, flush=True)
    title = (
        f"blend diagnosis: {args.model}, NQ-{args.n_docs}, recompute={args.recompute:g}, "
        f"rule {args.rule}, context={args.context}"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"settings": vars(args), "records": records}
    (out / "blend_diagnosis.json").write_text(json.dumps(payload))
    text = summary(records, title)
    (out / "blend_diagnosis.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
