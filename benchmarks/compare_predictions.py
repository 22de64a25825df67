"""Compare the predictions of two eval runs made by ``benchmarks/smoke_predictions.sh``.

``python -m benchmarks.compare_predictions OLD_DIR NEW_DIR`` prints, per run folder
(``OLD_DIR/*/results.json``) and method, how many predictions are identical, and exits 1 if any
differs or is missing (also when ``OLD_DIR`` holds no run).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import parser


def predictions(results: Path) -> dict[tuple, str]:
    data = json.loads(results.read_text())
    return {(r["method"], r["id"]): r["prediction"] for r in data["examples"]}


def compare(old: str | Path, new: str | Path) -> int:
    """Print the counts of identical predictions; the number that differ or are missing."""
    bad = 0
    runs = sorted(Path(old).glob("*/results.json"))
    if not runs:
        print(f"{old} holds no */results.json")
        return 1
    for res in runs:
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
    return bad


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("old", type=Path, help="the folder of the runs before the change")
    p.add_argument("new", type=Path, help="the folder of the runs after it")
    args = p.parse_args(argv)
    return 1 if compare(args.old, args.new) else 0


if __name__ == "__main__":
    raise SystemExit(main())
