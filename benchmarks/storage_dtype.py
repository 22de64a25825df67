"""Stored caches in float32, bfloat16 and float16: bytes on disk and answers.

For each example (NQ-10 or records, seed 0), the captured context is saved once per dtype
(``KVState.save(path, dtype=...)``), loaded back into the float32 model (``kvedit.load_state``
casts to the model's dtype) and asked the question. Reports each dtype's file size relative to
float32, how often its answer is the float32 state's answer, and its accuracy.

Usage: ``python benchmarks/storage_dtype.py --task nq --examples 30 --out reports/benchmarks/storage_dtype_nq.json``
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import kvedit
from kvedit.evals.litm import build_examples
from kvedit.evals.methods import ExampleContext
from kvedit.evals.schema import score

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="nq")
    p.add_argument("--examples", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model, tok = kvedit.load_model(args.model)
    examples = build_examples(args.task, None, None, None, None, args.seed, args.examples)
    totals = {name: {"bytes": 0, "same": 0, "correct": 0} for name in DTYPES}
    with tempfile.TemporaryDirectory() as tmp:
        for ex in examples:
            ctx = ExampleContext(model, tok, ex, args.max_new_tokens)
            answers = {}
            for name, dtype in DTYPES.items():
                path = ctx.state.save(Path(tmp) / f"{name}.kv", dtype=dtype)
                loaded = kvedit.load_state(path, model, tok)
                answers[name] = loaded.generate(ctx.continuation, args.max_new_tokens)
                totals[name]["bytes"] += path.stat().st_size
                totals[name]["correct"] += int(bool(score(ex, answers[name])))
            for name in DTYPES:
                totals[name]["same"] += int(answers[name] == answers["float32"])
            print(ex.id, {k: v[:30] for k, v in answers.items()}, flush=True)
    n = len(examples)
    base = totals["float32"]["bytes"]
    summary = {
        name: {
            "bytes_vs_float32": t["bytes"] / base,
            "same_answer_as_float32": t["same"] / n,
            "accuracy": t["correct"] / n,
        }
        for name, t in totals.items()
    }
    summary["examples"] = n
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
