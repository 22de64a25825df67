"""How often does ``auto`` pick the gold document? Scoring variants side by side.

For each example the question's attention (and that of its content-free calibration query) over
the documents is read once per layer and head; each variant then scores documents from those
readings, and the script prints the hit rate (top-1 = gold) by gold position. Use it on a tuning
seed to choose ``auto``'s settings, then report the suite on another seed.

Usage: ``python benchmarks/auto_retrieval.py --task records --seed 1 --trials 6``
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import kvedit
from kvedit.evals.litm import build_examples
from kvedit.evals.methods import ExampleContext, content_free_question
from kvedit.focusing.readout import span_shares
from kvedit.states.observer import observed_attention


def readings(ctx: ExampleContext, continuation: str) -> dict[str, torch.Tensor]:
    """Per-head shares ``[L, H, n_docs]``: averaged over all continuation tokens, and last only."""
    state = ctx.state
    spans = [state.token_indices(s) for s in ctx.doc_spans]
    ids = state.encode(continuation)
    out = {}
    for name, skip in (("all", 0), ("last", len(ids) - 1)):
        pos = torch.arange(state.next_position, state.next_position + len(ids))
        probs = observed_attention(
            state.model, state.layers, ids, pos, skip_queries=skip, reduce="mean"
        )
        out[name], _ = span_shares(state, probs, spans)
    return out


def variants(real: dict, calib: dict) -> dict[str, torch.Tensor]:
    eps = 1e-6
    out = {}
    for q in ("all", "last"):
        r, c = real[q], calib[q]
        L = r.shape[0]
        lift = torch.log(r + eps) - torch.log(c + eps)  # [L, H, D]
        out[f"raw/{q}"] = r.mean((0, 1))
        out[f"diff/{q}"] = (r - c).mean((0, 1))
        out[f"logratio-layer/{q}"] = (torch.log(r.mean(1) + eps) - torch.log(c.mean(1) + eps)).mean(
            0
        )
        out[f"logratio-head/{q}"] = lift.mean((0, 1))
        for lo, hi in ((0.0, 0.5), (0.5, 1.0), (0.25, 0.75)):
            sl = slice(int(lo * L), int(hi * L))
            out[f"logratio-layer[{lo}-{hi}]/{q}"] = (
                torch.log(r[sl].mean(1) + eps) - torch.log(c[sl].mean(1) + eps)
            ).mean(0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="records")
    p.add_argument("--data", default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--model", default="smollm2-135m-instruct")
    args = p.parse_args()
    model, tok = kvedit.load_model(args.model, device="cpu")
    examples = build_examples(
        args.task, args.data, trials=args.trials, seed=args.seed, limit=args.limit
    )
    hits: dict[str, dict[int, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for ex in examples:
        ctx = ExampleContext(model, tok, ex)
        calib_q = content_free_question(ex.question, ex.documents)
        real = readings(ctx, ctx.continuation)
        calib = readings(ctx, ctx.continuation.replace(ex.question, calib_q, 1))
        for name, scores in variants(real, calib).items():
            hits[name][ex.gold_index].append(int(scores.argmax()) == ex.gold_index)
    positions = sorted({e.gold_index for e in examples})
    print(f"top-1 = gold, {len(examples)} examples, seed {args.seed}")
    print(f"{'variant':36s} " + " ".join(f"p{p:<4d}" for p in positions) + "  total")
    for name, by_pos in hits.items():
        total = sum(sum(v) for v in by_pos.values())
        n = sum(len(v) for v in by_pos.values())
        cells = " ".join(f"{sum(by_pos[p]):2d}/{len(by_pos[p]):<2d}" for p in positions)
        print(f"{name:36s} {cells}  {total}/{n}")


if __name__ == "__main__":
    main()
