"""Does choosing among the best-covered passages (:func:`kvedit.focusing.best_covered`) keep
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

# ruff: noqa
import sys, re, json

sys.path.insert(0, "benchmarks")
import torch
from safetensors import safe_open
from focus_scale_tuning import load as load_scale
from focus_scale import context_of
from kvedit.evals.litm import build_examples
from kvedit.focus_scoring import passage_scores, stands_out, echo_passages


def distinctive(question, texts):
    lowered = [t.lower() for t in texts]
    n = max(1, len(texts))
    out = []
    for w in set(re.findall(r"\w+", question.lower())):
        df = sum(1 for d in lowered if re.search(r"\b" + re.escape(w) + r"\b", d))
        if 0 < df <= max(1, n // 2):
            out.append(w)
    return out


def coverage(question, texts):
    d = distinctive(question, texts)
    if not d:
        return torch.zeros(len(texts))
    return torch.tensor(
        [
            sum(1 for w in d if re.search(r"\b" + re.escape(w) + r"\b", t.lower())) / len(d)
            for t in texts
        ]
    )


def rows_of(path, examples):
    by_id = {ex.id: ex for ex in examples}
    f = safe_open(path, "pt")
    meta = json.loads(f.metadata()["rows"])
    for i, m in enumerate(meta):
        ex = by_id[m["id"]]
        q = m.get("question", ex.question)
        yield {
            "gold": m["gold"],
            "q": q,
            "texts": list(ex.documents),
            "real": f.get_tensor(f"{i}.real"),
            "calib": f.get_tensor(f"{i}.calib"),
            "cand0": True,
        }


sets = {}
nq = build_examples("nq", None, None, None, 100, 1, 45)
sets["nq-s1"] = list(rows_of("reports/focus-tuning/shares-nq-s1.safetensors", nq))
sets["nq-s1-unrel"] = list(
    rows_of(
        "reports/focus-scale/tuning/unrel-nq-s1.safetensors",
        build_examples("nq", None, None, None, 100, 1, 8),
    )
)
sets["records-s1"] = list(
    rows_of(
        "reports/focus-tuning/shares-records-s1.safetensors",
        build_examples("records", None, None, None, 10, 1, None),
    )
)
sets["lockers-s3"] = list(
    rows_of(
        "reports/focus-tuning/shares-lockers-s3.safetensors",
        build_examples(
            "records", "reports/focus-tuning/lockers-seed3-t5.jsonl", None, None, None, 3, None
        ),
    )
)
for r in load_scale(sys.argv[1:]) if sys.argv[1:] else []:
    if r["reduce"] != "all":
        continue
    ctx, records, names, _ = context_of(r["n"], r["seed"])
    texts = [ctx.split("\n\n")[0]] + records
    sets.setdefault(f"scale-{r['n']}", []).append(
        {
            "gold": r["gold"],
            "q": f"What is {names[r['pos']]}'s secret number?",
            "texts": texts,
            "real": r["real"].mean(1),
            "calib": r["calib"].mean(1),
            "cand0": False,
        }
    )


def run(rows, variant):
    hit = edits = 0
    for r in rows:
        s = passage_scores(r["real"], r["calib"]).double()
        cov = coverage(r["q"], r["texts"]).double()
        cand = torch.ones_like(s, dtype=torch.bool)
        if not r["cand0"]:
            cand[0] = False
        for e in echo_passages(r["q"], r["texts"]):
            cand[e] = False
        kind, a = variant
        if kind == "add":
            s = s + a * cov
        elif kind == "gate" and cov.max() > 0:
            cand &= cov >= cov.max() - a
        if kind == "zall":
            full = cand.clone()
            if cov.max() > 0:
                cand = cand & (cov >= cov.max() - a)
            from kvedit.focus_scoring import robust_z

            z = robust_z(s.float(), full)
            order = [i for i in cand.nonzero().flatten()[s[cand].argsort(descending=True)].tolist()]
            keep = [i for i in order if s[i] > 0 and z[i] >= 2.5]
        else:
            keep = stands_out(s.float(), cand, 2.5)
        edits += bool(keep)
        hit += keep[:1] == [r["gold"]]
    return hit / len(rows), edits / len(rows)


variants = [("base", 0), ("add", 0.1), ("add", 0.3), ("add", 1.0), ("gate", 0.0), ("zall", 0.0)]
print("set".ljust(14), " ".join(f"{k}{a}".ljust(14) for k, a in variants))
for name, rows in sets.items():
    print(name.ljust(14), " ".join(("%.2f/%.2f" % run(rows, v)).ljust(14) for v in variants))
