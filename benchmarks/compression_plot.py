"""Accuracy against bytes for the compression methods of one or more ``kvedit eval litm`` runs.

Reads ``results.json`` files (each method's ``mean`` accuracy and ``bytes``, the compressed
cache's bytes as a fraction of the full cache's, which compression methods record), groups
them by task, and draws one panel per task: accuracy relative to ``none`` (the full cache)
against bytes, with the byte budgets 0.5 and 0.25 and the targets (95% at 0.5, 90% at 0.25)
marked. Prints the table it plots::

    python benchmarks/compression_plot.py runs/compression-records-seed0/results.json \
        runs/compression-nq-a-seed0/results.json runs/compression-nq-b-seed0/results.json \
        --out reports/compression.png --json reports/compression.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(paths: list[str]) -> dict[str, dict[str, dict]]:
    """``{task: {method: summary}}`` merged from the files (a method seen twice must agree)."""
    out: dict[str, dict[str, dict]] = {}
    for path in paths:
        res = json.loads(Path(path).read_text())
        task = out.setdefault(res["task"], {})
        for method, summary in res["methods"].items():
            if method in task and task[method]["mean"] != summary["mean"]:
                raise SystemExit(f"{path}: {method} disagrees with an earlier file")
            task[method] = summary
    return out


def table(results: dict[str, dict[str, dict]]) -> list[dict]:
    rows = []
    for task, methods in results.items():
        full = methods["none"]["mean"]
        for method, s in methods.items():
            size = 1.0 if method == "none" else s.get("bytes")
            if size is None:
                continue
            rows.append(
                {
                    "task": task,
                    "method": method,
                    "bytes": round(size, 4),
                    "accuracy": round(s["mean"], 4),
                    "worst": round(s["worst"], 4),
                    "relative": round(s["mean"] / full, 4) if full else None,
                    "n": s["n"],
                }
            )
    return rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 5.5), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        mine = [r for r in rows if r["task"] == task]
        for r in mine:
            ax.scatter(r["bytes"], r["relative"], s=30)
            ax.annotate(
                r["method"],
                (r["bytes"], r["relative"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        for budget, target in ((0.5, 0.95), (0.25, 0.90)):
            ax.axvline(budget, color="grey", lw=0.8, ls="--")
            ax.hlines(target, 0, budget, color="green", lw=0.8, ls=":")
        ax.set_xlim(0, 1.05)
        ax.set_xlabel("cache bytes (fraction of the full cache)")
        ax.set_ylabel("accuracy / full-cache accuracy")
        n = mine[0]["n"] if mine else 0
        ax.set_title(f"{task} (n={n} per method)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default="reports/compression.png")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = table(load(args.results))
    print(f"{'task':<8} {'method':<45} {'bytes':>6} {'acc':>6} {'worst':>6} {'rel':>6}")
    for r in sorted(rows, key=lambda r: (r["task"], r["bytes"])):
        print(
            f"{r['task']:<8} {r['method']:<45} {r['bytes']:>6.3f} {r['accuracy']:>6.3f} "
            f"{r['worst']:>6.3f} {r['relative']:>6.3f}"
        )
    plot(rows, Path(args.out))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
