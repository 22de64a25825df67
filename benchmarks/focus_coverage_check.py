"""Does choosing among the best-covered passages (:func:`kvedit.focusing.choice.best_covered`) keep
focus's hit rate and abstention on the tuning seeds? Scores stored shares offline (no model):
records seed 1, lockers seed 3, NQ-10 seed 1 (``reports/focus-tuning/shares-*``), 32 unrelated
questions over NQ seed 1 (``reports/focus-scale/tuning/unrel-nq-s1.safetensors``) and,
if given, :mod:`focus_scale_tuning`'s scale shares. Prints ``hit/edits`` per set and variant:
``base`` (every candidate may be chosen), ``add<a>`` (score + a x word coverage), ``gate0.0``
(the z-score taken among the best covered only) and ``zall0.0`` (what :func:`kvedit.choose`
does: the best covered may be chosen, the z-score against every candidate).

Usage::

    python benchmarks/focus_coverage_check.py [scale-shares.safetensors]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from kvedit.evals.litm import build_examples
from kvedit.focusing.scoring import (
    ABSTAIN_THRESHOLD,
    best_covered,
    echo_passages,
    passage_scores,
    stands_out,
    word_coverage,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from focus_scale import context_of  # noqa: E402
from focus_scale_tuning import load as load_scale  # noqa: E402

VARIANTS = [("base", 0), ("add", 0.1), ("add", 0.3), ("add", 1.0), ("gate", 0.0), ("zall", 0.0)]


def rows_of(path: str, examples) -> list[dict]:
    """The stored shares of ``path`` (``focus_scoring.py``/``focus_abstain.py`` files) with
    their examples' question and documents."""
    by_id = {ex.id: ex for ex in examples}
    rows = []
    with safe_open(path, "pt") as f:
        for i, m in enumerate(json.loads(f.metadata()["rows"])):
            ex = by_id[m["id"]]
            rows.append(
                {
                    "gold": m["gold"],
                    "q": m.get("question", ex.question),
                    "texts": list(ex.documents),
                    "real": f.get_tensor(f"{i}.real"),
                    "calib": f.get_tensor(f"{i}.calib"),
                    "first_is_candidate": True,
                }
            )
    return rows


def scale_rows(paths: list[str]) -> dict[str, list[dict]]:
    """:mod:`focus_scale_tuning`'s shares (every query, mean over heads) per size; the
    instruction line is not a candidate."""
    out: dict[str, list[dict]] = {}
    for r in load_scale(paths):
        if r["reduce"] != "all":
            continue
        context, records, names, _ = context_of(r["n"], r["seed"])
        out.setdefault(f"scale-{r['n']}", []).append(
            {
                "gold": r["gold"],
                "q": f"What is {names[r['pos']]}'s secret number?",
                "texts": [context.split("\n\n")[0], *records],
                "real": r["real"].mean(1),
                "calib": r["calib"].mean(1),
                "first_is_candidate": False,
            }
        )
    return out


def edited(row: dict, kind: str, weight: float) -> list[int]:
    """What a variant edits (at most one passage, at the default threshold)."""
    scores = passage_scores(row["real"], row["calib"])
    cand = torch.ones_like(scores, dtype=torch.bool)
    cand[0] = row["first_is_candidate"]
    cand[echo_passages(row["q"], row["texts"])] = False
    covered = best_covered(row["q"], row["texts"], cand)
    if kind == "add":
        scores = (scores.double() + weight * word_coverage(row["q"], row["texts"])).float()
    if kind == "gate":  # the z-score among the best covered only
        return stands_out(scores, covered, ABSTAIN_THRESHOLD)[:1]
    if kind == "zall":  # kvedit.choose: the best covered, the z-score against every candidate
        return stands_out(scores, cand, ABSTAIN_THRESHOLD, covered)[:1]
    return stands_out(scores, cand, ABSTAIN_THRESHOLD)[:1]


def main() -> None:
    sets = {
        "nq-s1": rows_of(
            "reports/focus-tuning/shares-nq-s1.safetensors",
            build_examples("nq", None, None, None, 100, 1, 45),
        ),
        "nq-s1-unrel": rows_of(
            "reports/focus-scale/tuning/unrel-nq-s1.safetensors",
            build_examples("nq", None, None, None, 100, 1, 8),
        ),
        "records-s1": rows_of(
            "reports/focus-tuning/shares-records-s1.safetensors",
            build_examples("records", None, None, None, 10, 1, None),
        ),
        "lockers-s3": rows_of(
            "reports/focus-tuning/shares-lockers-s3.safetensors",
            build_examples(
                "records", "reports/focus-tuning/lockers-seed3-t5.jsonl", None, None, None, 3, None
            ),
        ),
        **scale_rows(sys.argv[1:]),
    }
    print("set".ljust(14), " ".join(f"{k}{a}".ljust(14) for k, a in VARIANTS))
    for name, rows in sets.items():
        cells = []
        for kind, weight in VARIANTS:
            picks = [edited(r, kind, weight) for r in rows]
            hit = sum(p == [r["gold"]] for p, r in zip(picks, rows, strict=True)) / len(rows)
            edits = sum(bool(p) for p in picks) / len(rows)
            cells.append(f"{hit:.2f}/{edits:.2f}".ljust(14))
        print(name.ljust(14), " ".join(cells))


if __name__ == "__main__":
    main()
