"""Memory a compressed cache really holds, on the lost-in-the-middle prompts.

For examples of ``records`` and ``nq`` (the prompts of ``kvedit eval litm``), the documents' cache
is captured and compressed as the eval's ``snapkv`` and ``quantize`` methods do; ``state.nbytes``
is compared with the full cache's. SnapKV keeps the union of the entries its KV heads keep
(each head masks the rest), so its saving is below the nominal ``1 - keep``; quantization keeps
the most recent entries in full precision, which weighs on short caches::

    python -m benchmarks.compression_memory --examples 10 --out runs/compression_memory.json
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks.common import add_model, parser, write_json
from kvedit import ops
from kvedit.evals.litm import build_examples
from kvedit.evals.methods import ExampleContext
from kvedit.models import load_model

METHODS = {
    "snapkv:keep=0.5": lambda ctx: ops.snapkv(ctx.state, keep=0.5, query=ctx.continuation),
    "snapkv:keep=0.25": lambda ctx: ops.snapkv(ctx.state, keep=0.25, query=ctx.continuation),
    "quantize:bits=8": lambda ctx: ops.quantize(ctx.state, bits=8),
    "quantize:bits=4": lambda ctx: ops.quantize(ctx.state, bits=4),
}


def measure(model_name: str, task: str, n_examples: int, seed: int) -> dict:
    model, tokenizer = load_model(model_name)
    trials = 100 if task == "nq" else 30
    examples = build_examples(task, None, None, None, trials, seed, n_examples)
    ratios: dict[str, list[float]] = {name: [] for name in METHODS}
    tokens, full_bytes = [], []
    for example in examples:
        ctx = ExampleContext(model, tokenizer, example)
        full = ctx.state.nbytes
        tokens.append(len(ctx.state))
        full_bytes.append(full)
        for name, compress in METHODS.items():
            ratios[name].append(compress(ctx).nbytes / full)
    return {
        "task": task,
        "examples": len(examples),
        "mean_tokens": statistics.mean(tokens),
        "mean_full_bytes": statistics.mean(full_bytes),
        "fraction_kept": {k: statistics.mean(v) for k, v in ratios.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    p.add_argument("--examples", type=int, default=10, help="examples per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    results = [measure(args.model, t, args.examples, args.seed) for t in ("records", "nq")]
    print(f"{'task':8} {'tokens':>7} {'full MB':>8}  " + "  ".join(f"{m:>17}" for m in METHODS))
    for r in results:
        kept = "  ".join(
            f"{r['fraction_kept'][m]:>8.3f} (-{1 - r['fraction_kept'][m]:.0%})".rjust(17)
            for m in METHODS
        )
        print(f"{r['task']:8} {r['mean_tokens']:>7.0f} {r['mean_full_bytes'] / 1e6:>8.2f}  {kept}")
    print("(fraction of the full cache's bytes kept; in brackets, the saving)")
    write_json(args.out, {"model": args.model, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
