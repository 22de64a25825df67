"""How should focus score passages? Hit rates (top-1 = gold) of scoring variants, per position.

For each example the per-layer attention shares of the documents are read once, from the
question and from its content-free calibration (:func:`kvedit.focus.passage_shares`), and
saved (``--out``, a safetensors file). Each variant then scores documents from those
readings. Use it on tuning seeds to choose :func:`kvedit.focus.passage_scores`'s smoothing,
then report the suite on other seeds.

Usage::

    python benchmarks/focus_scoring.py --data runs/lockers-seed3.jsonl --out runs/shares-lockers-s3.safetensors
    python benchmarks/focus_scoring.py --analyze runs/shares-*.safetensors
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvedit.evals.litm import build_examples
from kvedit.evals.methods import ExampleContext
from kvedit.focusing.choice import passage_shares
from kvedit.models import load_model


def collect(args) -> None:
    model, tok = load_model(args.model)
    examples = build_examples(args.task, args.data, None, None, args.trials, args.seed, args.limit)
    rows = []
    for ex in examples:
        ctx = ExampleContext(model, tok, ex)
        real, calib = passage_shares(ctx.state, ctx.continuation, ctx.doc_spans, query=ex.question)
        rows.append({"id": ex.id, "gold": ex.gold_index, "real": real, "calib": calib})
        print(ex.id, flush=True)
    tensors = {f"{i}.{k}": r[k].contiguous() for i, r in enumerate(rows) for k in ("real", "calib")}
    meta = {"rows": json.dumps([{"id": r["id"], "gold": r["gold"]} for r in rows])}
    save_file(tensors, args.out, metadata=meta)  # safetensors: no pickle


def variants(real: torch.Tensor, calib: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[n_docs]`` scores from ``[layers, n_docs]`` shares."""
    out = {"diff": (real - calib).mean(0)}
    for eps in (1e-6, 1e-3, 1e-2, 3e-2, 1e-1):
        out[f"logratio eps={eps:g}"] = (torch.log(real + eps) - torch.log(calib + eps)).mean(0)
    for f in (0.25, 0.5, 1.0, 2.0):
        eps = f * calib.mean(-1, keepdim=True)  # per layer, a fraction of the mean share
        out[f"logratio eps={f:g}*mean"] = (torch.log(real + eps) - torch.log(calib + eps)).mean(0)
    return out


def analyze(paths: list[str]) -> None:
    for path in paths:
        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()["rows"])
            rows = [
                {**m, "real": f.get_tensor(f"{i}.real"), "calib": f.get_tensor(f"{i}.calib")}
                for i, m in enumerate(meta)
            ]
        hits: dict[str, dict[int, list[bool]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            for name, s in variants(r["real"].double(), r["calib"].double()).items():
                hits[name][r["gold"]].append(int(s.argmax()) == r["gold"])
        pos = sorted({r["gold"] for r in rows})
        print(f"\n== {path}: {len(rows)} examples; positions {pos}")
        for name, by in hits.items():
            rates = [sum(by[p]) / len(by[p]) for p in pos]
            total = sum(sum(by[p]) for p in pos) / len(rows)
            print(f"{name:<26} total {total:.3f}  " + " ".join(f"{x:.2f}" for x in rates))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="records")
    p.add_argument("--data", default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", default="runs/shares.safetensors")
    p.add_argument("--analyze", nargs="*", default=None)
    args = p.parse_args()
    if args.analyze:
        analyze(args.analyze)
    else:
        collect(args)


if __name__ == "__main__":
    main()
