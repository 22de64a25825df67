"""Compare the predictions of two eval runs made by ``benchmarks/smoke_predictions.sh``.

``python benchmarks/compare_predictions.py OLD_DIR NEW_DIR`` prints, per run folder and method,
how many predictions are identical, and exits 1 if any differs or is missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def predictions(results: Path) -> dict[tuple, str]:
    data = json.loads(results.read_text())
    return {(r["method"], r["id"]): r["prediction"] for r in data["examples"]}


def main(old: str, new: str) -> int:
    bad = 0
    for res in sorted(Path(old).glob("*/results.json")):
        other = Path(new) / res.parent.name / "results.json"
        a = predictions(res)
        b = predictions(other) if other.exists() else {}
        methods = sorted({m for m, _ in a})
        for m in methods:
            keys = [k for k in a if k[0] == m]
            same = sum(a[k] == b.get(k) for k in keys)
            bad += len(keys) - same
            print(f"{res.parent.name:22s} {m:12s} {same}/{len(keys)} identical")
    print("all identical" if not bad else f"{bad} predictions differ or are missing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
