"""When should focus abstain? Attention shares of relevant and unrelated questions, and rules.

For each example of a task the per-layer attention shares of its documents are read
(:func:`kvedit.focusing.choice.passage_shares`) for its own question and for general-knowledge
questions that no document answers (:data:`UNRELATED`, a few per context), and saved
(``--out``, safetensors). ``--analyze`` then scores them with the library's
:func:`kvedit.focusing.choice.passage_scores` and reports, per abstain threshold, the top-1 hit rate of
relevant questions (an abstention counts as a miss) and how often an unrelated question
would be edited. Tune on tuning seeds (records 1, lockers 3, NQ 1), report on others.

Usage::

    python -m benchmarks.focus_abstain --task records --seed 1 --trials 4 \
        --out runs/abst-records-s1.safetensors
    python -m benchmarks.focus_abstain --analyze runs/abst-*.safetensors
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.common import RUNS, add_model, parser, write_file
from kvedit.evals.litm import build_examples
from kvedit.evals.methods import ExampleContext
from kvedit.focusing.choice import (
    ABSTAIN_THRESHOLD,
    SCORE_SMOOTHING,
    content_free_question,
    echo_passages,
    passage_scores,
    passage_shares,
    stands_out,
)
from kvedit.models import load_model

UNRELATED = [
    "What is the capital of Japan?",
    "What is the capital of France?",
    "Who wrote the play Hamlet?",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Which planet is known as the Red Planet?",
    "Who painted the Mona Lisa?",
    "What is the largest ocean on Earth?",
    "What gas do plants absorb from the air?",
    "How many days are in a leap year?",
    "What is the chemical symbol for gold?",
    "Who was the first person to walk on the Moon?",
    "What is the tallest mountain in the world?",
    "Which language is spoken in Brazil?",
    "What is the square root of 81?",
    "Who developed the theory of relativity?",
    "What is the longest river in Africa?",
    "How many continents are there?",
    "What is the freezing point of water in Fahrenheit?",
    "Which animal is known as the king of the jungle?",
    "What is the currency of the United Kingdom?",
    "Who invented the telephone?",
    "What is the hardest natural substance?",
    "In which year did World War II end?",
    "What is the main ingredient of guacamole?",
    "How many strings does a standard violin have?",
    "What is the smallest prime number?",
    "Which organ pumps blood through the body?",
    "What is the capital of Australia?",
    "Who composed the Moonlight Sonata?",
    "What color do you get by mixing blue and yellow?",
    "How many minutes are in an hour?",
    "What is the largest planet in the solar system?",
    "Which country is home to the kangaroo?",
    "What is the opposite of hot?",
    "Who wrote Pride and Prejudice?",
    "What do bees make?",
    "What is the capital of Canada?",
    "How many sides does a hexagon have?",
    "What is the speed of light?",
    "Which metal is liquid at room temperature?",
    "What is the national sport of Japan?",
    "Who discovered penicillin?",
    "What is the largest desert in the world?",
    "How many players are on a soccer team?",
    "What is H2O commonly called?",
    "Which bird is a symbol of peace?",
    "What is the capital of Italy?",
]
"""General-knowledge questions no synthetic record or NQ passage set is about."""


def collect(args) -> None:
    model, tok = load_model(args.model)
    examples = build_examples(
        args.task, args.data, args.n_docs, None, args.trials, args.seed, args.limit
    )
    tensors, rows = {}, []
    for i, ex in enumerate(examples):
        ctx = ExampleContext(model, tok, ex, prompt_format=args.prompt)
        asks = [] if args.skip_relevant else [(ex.question, True)]
        for j in range(args.unrelated):
            asks.append((UNRELATED[(i * args.unrelated + j) % len(UNRELATED)], False))
        for q, relevant in asks:
            cont = ctx.continuation.replace(ex.question, q, 1)
            real, calib = passage_shares(ctx.state, cont, ctx.doc_spans, query=q)
            texts = [ctx.state.text[a:b] for a, b in ctx.doc_spans]
            k = len(rows)
            tensors[f"{k}.real"], tensors[f"{k}.calib"] = real.contiguous(), calib.contiguous()
            rows.append(
                {
                    "id": ex.id,
                    "gold": ex.gold_index if relevant else -1,
                    "question": q,
                    "free": content_free_question(q, texts),
                    "echo": echo_passages(q, texts),
                }
            )
        print(ex.id, flush=True)
    write_file(args.out, lambda tmp: save_file(tensors, tmp, metadata={"rows": json.dumps(rows)}))


def load(path: str) -> list[dict]:
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["rows"])
        return [
            {**m, "real": f.get_tensor(f"{i}.real"), "calib": f.get_tensor(f"{i}.calib")}
            for i, m in enumerate(meta)
        ]


def analyze(paths: list[str], smoothing: float, thresholds: list[float]) -> dict:
    out = {}
    for path in paths:
        rows = load(path)
        rel = [r for r in rows if r["gold"] >= 0]
        unrel = [r for r in rows if r["gold"] < 0]
        res = {"n_relevant": len(rel), "n_unrelated": len(unrel), "by_threshold": {}}
        for t in thresholds:
            hit = edit_rel = edit_unrel = 0
            for r in rows:
                scores = passage_scores(r["real"], r["calib"], smoothing=smoothing)
                mask = torch.ones_like(scores, dtype=torch.bool)
                for e in r.get("echo", []):
                    mask[e] = False
                keep = stands_out(scores, mask, t)
                if r["gold"] >= 0:
                    edit_rel += bool(keep)
                    hit += keep[:1] == [r["gold"]]
                else:
                    edit_unrel += bool(keep)
            res["by_threshold"][t] = {
                "hit": hit / max(1, len(rel)),
                "edits_relevant": edit_rel / max(1, len(rel)),
                "edits_unrelated": edit_unrel / max(1, len(unrel)),
            }
            print(
                f"{path} t={t:<5} hit {hit / max(1, len(rel)):.3f} edits rel "
                f"{edit_rel / max(1, len(rel)):.3f} unrel {edit_unrel / max(1, len(unrel)):.3f}"
            )
        out[path] = res
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--task", default="records", help="records, nq, lockers...")
    p.add_argument("--data", default=None)
    p.add_argument("--n-docs", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--unrelated", type=int, default=2, help="unrelated questions per context")
    p.add_argument("--skip-relevant", action="store_true", help="only the unrelated questions")
    add_model(p)
    p.add_argument("--prompt", choices=["chat", "plain"], default="chat")
    p.add_argument("--out", default=str(RUNS / "abstain.safetensors"), help="shares file")
    p.add_argument("--analyze", nargs="*", default=None, help="score saved shares files")
    p.add_argument("--smoothing", type=float, default=SCORE_SMOOTHING)
    p.add_argument("--thresholds", default=f"0,1,2,3,4,5,6,{ABSTAIN_THRESHOLD}")
    args = p.parse_args(argv)
    if args.analyze:
        analyze(args.analyze, args.smoothing, [float(x) for x in args.thresholds.split(",")])
    else:
        collect(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
