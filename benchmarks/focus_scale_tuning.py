"""Tuning focus's scores at scale (tuning seeds only): read the per-layer attention shares of
every record once, then score them offline with variants.

The contexts are :mod:`focus_scale`'s synthetic records, on seeds below 100 (the scale
benchmark reports seeds 100 and up). Each context is asked about the records at fifths of
its length (first, 1/4, middle, 3/4, last). ``--collect`` saves ``real`` and ``calib``
(as :func:`kvedit.focusing.choice.passage_shares`, but per head: ``[layers, heads, passages]``) per question to a
safetensors file; ``--analyze`` prints the top-1 hit rate and the gold's robust z of each
scoring variant per size.

Usage::

    python benchmarks/focus_scale_tuning.py --collect --sizes 100,300 --seeds 1,2,3 \
        --out runs/scale-shares.safetensors
    python benchmarks/focus_scale_tuning.py --analyze runs/scale-shares.safetensors
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kvedit
from kvedit.focusing.choice import QUESTION_MARK
from kvedit.focusing.passages import split_passages
from kvedit.focusing.readout import span_shares
from kvedit.focusing.scoring import (
    ABSTAIN_THRESHOLD,
    SCORE_SMOOTHING,
    SHARE_EPS,
    best_covered,
    content_free_question,
    passage_scores,
    stands_out,
)
from kvedit.states.observer import Observer
from kvedit.states.passes import run_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from focus_scale import context_of  # noqa: E402


class _Keep(Observer):
    """Keeps every query's attention ``[batch, heads, q, k]`` per layer."""

    def observe(self, layer_idx: int, probs: torch.Tensor) -> None:
        self.probs[layer_idx] = probs.float()


def question_end(text: str) -> int:
    return text.index("?") + 1 if "?" in text else len(text)


def kept_attention(model, state, ids: list[int]) -> dict[int, torch.Tensor]:
    """One pass of ``ids`` over ``state``: every query's attention per layer,
    ``[batch, heads, q, k]``."""
    keep = _Keep(state.layers)
    positions = torch.arange(state.next_position, state.next_position + len(ids))
    run_model(
        model, state.layers, torch.tensor([ids]), positions[None], logits_to_keep=1, plan=keep
    )
    return keep.probs


def query_shares(state, probs, n_q: int, tokens) -> dict[str, torch.Tensor]:
    """``[layers, heads, passages]`` shares, over all the queries (``all``), the queries after
    the first ``n_q`` (``tail``: the chat template after the question) and the last one
    (``last``); ``probs`` from :func:`kept_attention`, ``tokens`` each passage's token indices."""
    out = {}
    for name, sl in (
        ("all", slice(0, None)),
        ("tail", slice(n_q, None)),
        ("last", slice(-1, None)),
    ):
        out[name] = span_shares(state, {k: v[:, :, sl].mean(2) for k, v in probs.items()}, tokens)[
            0
        ]
    return out


def distinctive_marks(state, cont: str, question: str, free: str) -> list[bool]:
    """For each token of ``cont``: whether it is part of a distinctive word of ``question``
    (one that :func:`content_free_question` removed, leaving ``free``)."""
    enc = state.tokenizer(cont, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == state.encode(cont)
    kept = set(re.findall(r"\w+", free.lower()))
    q0 = cont.index(question)
    marks = []
    for a, b in enc["offset_mapping"]:
        inside = q0 <= a < q0 + len(question)
        word = re.search(r"\w+", cont[a:b])
        marks.append(bool(inside and word and word.group(0).lower() not in kept))
    return marks


def token_shares(state, probs, tokens) -> torch.Tensor:
    """``[layers, q, passages]``: each query token's shares (mean over heads)."""
    n_q = next(iter(probs.values())).shape[2]
    per_q = [
        span_shares(state, {k: v[:, :, qi] for k, v in probs.items()}, tokens)[0].mean(1)
        for qi in range(n_q)
    ]
    return torch.stack(per_q, 1).contiguous()


def collect(args) -> None:
    model, tok = kvedit.load_model(args.model, device="cpu")
    tensors, meta = {}, []
    for seed in [int(s) for s in args.seeds.split(",")]:
        if seed >= 100:
            raise SystemExit(
                f"seed {seed}: seeds 100 and up are the scale benchmark's report seeds"
            )
        for n in [int(s) for s in args.sizes.split(",")]:
            t0 = time.time()
            context, records, names, _ = context_of(n, seed)
            prefix, _ = kvedit.chat_prefix(tok, context + QUESTION_MARK + " x", QUESTION_MARK)
            state = kvedit.capture(model, tok, prefix)
            start = prefix.rfind(context)
            spans = split_passages(state, None, (start, start + len(context)))
            tokens = [state.token_indices(s) for s in spans]
            texts = [state.text[a:b] for a, b in spans]
            for pos in sorted({0, n // 4, n // 2, (3 * n) // 4, n - 1}):
                question = f"What is {names[pos]}'s secret number?"
                _, cont = kvedit.chat_prefix(
                    tok, context + QUESTION_MARK + " " + question, QUESTION_MARK
                )
                gold = pos + 1  # passage 0 is the instruction
                assert state.text[spans[gold][0] : spans[gold][1]] == records[pos]
                free = content_free_question(question, texts)
                i = len(meta)
                for key, text in (("real", cont), ("calib", cont.replace(question, free, 1))):
                    ids = state.encode(text)
                    probs = kept_attention(model, state, ids)
                    n_q = len(state.encode(text[: question_end(text)]))
                    for reduce, shares in query_shares(state, probs, n_q, tokens).items():
                        tensors[f"{i}.{key}.{reduce}"] = shares.contiguous()
                    if key == "real":  # the real question's pass also gives its per-token shares
                        tensors[f"{i}.tokens"] = token_shares(state, probs, tokens)
                    del probs
                marks = distinctive_marks(state, cont, question, free)
                meta.append({"n": n, "seed": seed, "pos": pos, "gold": gold, "distinctive": marks})
            print(f"n={n} seed={seed}: {time.time() - t0:.0f}s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out, metadata={"rows": json.dumps(meta)})


def load(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with safe_open(path, "pt") as f:
            for i, m in enumerate(json.loads(f.metadata()["rows"])):
                m["tokens"] = f.get_tensor(f"{i}.tokens")
                for reduce in ("all", "tail", "last"):
                    rows.append(
                        {
                            **m,
                            "reduce": reduce,
                            "real": f.get_tensor(f"{i}.real.{reduce}"),
                            "calib": f.get_tensor(f"{i}.calib.{reduce}"),
                        }
                    )
    return rows


def variants(real: torch.Tensor, calib: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"default": passage_scores(real, calib)}
    for s in (0.1, 0.25, 1.0):
        out[f"smoothing={s}"] = passage_scores(real, calib, smoothing=s)
    r, c = real.double(), calib.double()
    eps = SCORE_SMOOTHING * c.mean(-1, keepdim=True).clamp_min(SHARE_EPS)
    out["per-layer eps"] = (torch.log(r + eps) - torch.log(c + eps)).mean(0)
    n_layers = r.shape[0]
    for lo, hi in ((0, n_layers // 2), (n_layers // 2, n_layers), (n_layers // 3, n_layers)):
        out[f"layers {lo}-{hi - 1}"] = passage_scores(real, calib, list(range(lo, hi)))
    return {k: v.float() for k, v in out.items()}


def analyze(paths: list[str]) -> None:
    """Per scoring variant and size: the top-1 hit rate (the best-scored record is the gold),
    and the rate at which focus would edit the gold (it stands out: robust z >= the
    threshold), each over every record and over :func:`best_covered`'s (the records holding
    the most of the question's distinctive words, as :func:`kvedit.choose` does)."""
    stats: dict = {}
    for row in load(paths):
        real, calib = row["real"], row["calib"]
        if real.dim() == 3:
            real, calib = real.mean(1), calib.mean(1)
        context, records, names, _ = context_of(row["n"], row["seed"])
        texts = [context.split("\n\n")[0], *records]
        question = f"What is {names[row['pos']]}'s secret number?"
        cand = torch.ones(len(texts), dtype=torch.bool)
        cand[0] = False  # the instruction line
        covered = best_covered(question, texts, cand)
        for name, scores in variants(real, calib).items():
            for gate, eligible in (("all", cand), ("best covered", covered)):
                chosen = stands_out(scores, cand, None, eligible)[0]
                edited = stands_out(scores, cand, ABSTAIN_THRESHOLD, eligible)[:1]
                key = (f"{row['reduce']}/{name}", gate, row["n"])
                s = stats.setdefault(key, {"hit": 0, "edit_hit": 0, "count": 0})
                s["count"] += 1
                s["hit"] += chosen == row["gold"]
                s["edit_hit"] += edited == [row["gold"]]
    print("| queries/variant | choose among | passages | count | top-1 hit | edits the gold |")
    print("|---|---|---|---|---|---|")
    for (name, gate, n), s in sorted(stats.items()):
        print(
            f"| {name} | {gate} | {n} | {s['count']} | {s['hit'] / s['count']:.2f} | "
            f"{s['edit_hit'] / s['count']:.2f} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collect", action="store_true")
    p.add_argument("--sizes", default="100,300")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", default="runs/scale-shares.safetensors")
    p.add_argument("--analyze", nargs="*", default=None)
    args = p.parse_args()
    if args.analyze:
        analyze(args.analyze)
    elif args.collect:
        collect(args)
    else:
        p.error("--collect or --analyze FILE...")


if __name__ == "__main__":
    main()
