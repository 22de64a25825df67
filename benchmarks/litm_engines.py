"""The same lost-in-the-middle run answered by both engines: kvedit's own decoding
(``--engine transformers``) and vLLM serving each method's published cache
(``--engine vllm``), one after the other in one process on one machine.

Writes ``OUT/transformers/`` and ``OUT/vllm/`` (each a normal ``kvedit eval litm`` result) and
``OUT/engines.json``: per method the accuracy and 95% CI of each engine, whether each
engine's mean lies in the other's CI, how many answers are identical, and the seconds per
example (whole run; for vLLM also without the engine's start). Run in the vLLM venv::

    .venv-vllm/bin/python -m benchmarks.litm_engines --task nq --n-docs 10 \\
        --positions 0,4,9 --trials 10 --out runs/litm-nq-engines-seed0
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers

from benchmarks.common import RUNS, add_model, command_line, parser, write_json
from kvedit.cli.arguments import positions as position_list
from kvedit.evals.litm import evaluate

METHODS = ["none", "oracle", "auto"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--task", default="nq", help="records or nq")
    ap.add_argument("--n-docs", type=int, default=10, help="documents per prompt")
    ap.add_argument("--positions", type=position_list, default="0,4,9", help="gold positions")
    ap.add_argument("--trials", type=int, default=10, help="examples per position")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS), help="methods both engines run")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    add_model(ap)
    ap.add_argument("--out", default=str(RUNS / "litm-engines"), help="the runs' folder")
    args = ap.parse_args(argv)
    out = Path(args.out)
    methods = args.methods.split(",")
    common = dict(
        model_name=args.model,
        methods=methods,
        task=args.task,
        n_docs=args.n_docs,
        positions=args.positions,
        trials=args.trials,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        progress=False,
    )
    summaries, wall = {}, {}
    for engine in ("transformers", "vllm"):
        t0 = time.perf_counter()
        summaries[engine] = evaluate(out=out / engine, engine=engine, batch=args.batch, **common)
        wall[engine] = time.perf_counter() - t0
    results = {e: json.loads((out / e / "results.json").read_text()) for e in summaries}
    preds = {e: {(r["id"], r["method"]): r for r in res["examples"]} for e, res in results.items()}
    rows = {}
    for m in methods:
        hf, vl = summaries["transformers"][m], summaries["vllm"][m]
        keys = [k for k in preds["transformers"] if k[1] == m]
        same = sum(
            preds["vllm"][k]["prediction"] == preds["transformers"][k]["prediction"] for k in keys
        )
        exact = sum(bool(preds["vllm"][k].get("exact")) for k in keys)
        rows[m] = {
            "transformers": {"mean": hf["mean"], "ci95": hf["ci95"]},
            "vllm": {"mean": vl["mean"], "ci95": vl["ci95"]},
            "vllm_mean_in_transformers_ci": hf["ci95"][0] <= vl["mean"] <= hf["ci95"][1],
            "transformers_mean_in_vllm_ci": vl["ci95"][0] <= hf["mean"] <= vl["ci95"][1],
            "identical_answers": same,
            "exact_caches": exact,
            "n": len(keys),
        }
    n = results["vllm"]["extra"]["n_examples"]
    extra = {e: results[e]["extra"] for e in results}
    timing = {
        "transformers_seconds_per_example": extra["transformers"]["seconds_per_example"],
        "vllm_seconds_per_example": extra["vllm"]["seconds_per_example"],
        "vllm_seconds_per_example_after_start": extra["vllm"]["seconds_per_example_after_start"],
        "vllm_engine_start_seconds": extra["vllm"]["engine_start_seconds"],
        "vllm_serve_seconds": extra["vllm"]["serve_seconds"],
        "wall_seconds_with_model_load": {e: round(s, 1) for e, s in wall.items()},
    }
    report = {
        "command": command_line(__file__, argv),
        "settings": {k: v for k, v in vars(args).items()},
        "n_examples": n,
        "machine": {
            "platform": platform.platform(),
            "cpus": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "methods": rows,
        "timing": timing,
    }
    write_json(out / "engines.json", report, indent=1)
    print(f"{'method':8s} {'transformers':>22s} {'vllm':>22s}  identical  exact")
    for m, r in rows.items():
        cell = {
            e: f"{r[e]['mean']:.3f} [{r[e]['ci95'][0]:.2f}, {r[e]['ci95'][1]:.2f}]"
            for e in ("transformers", "vllm")
        }
        print(
            f"{m:8s} {cell['transformers']:>22s} {cell['vllm']:>22s}  {r['identical_answers']:>4d}/{r['n']:<4d} {r['exact_caches']:>4d}"
        )
    print(json.dumps(timing, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
