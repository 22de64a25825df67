"""``kvedit eval project``: does a projected cache give model B the content of a prefix?

Fit (or load) a :class:`~kvedit.project.Projector` from model A to model B on NQ passages
``[0, n_fit)`` (all within the first :data:`FIT_POOL` = 2000 items), then evaluate on held-out
NQ passages: items from 2000 on, in file order, whose passage is not among the first 2000
(NQ repeats gold passages), each passage once, with at least ``2 * min_words`` words. Each passage ``"{title}\\n{text}"`` is cut at a word boundary (before word
``round(prefix_fraction * n_words)`` of the text), into a prefix and a continuation that starts
with the whitespace before that word. B's loss is the mean NLL per continuation token (the
continuation tokenized by B without special tokens; row i of ``state.logits(continuation)``
predicts token i), averaged over passages, under four contexts:

``own``    B's own cache of the prefix (with B's BOS): the ceiling.
``none``   no prefix: B's cache of the empty text, i.e. just B's BOS, then the continuation.
``proj``   A's cache of the prefix, projected to B (B computes its BOS and the prefix's last
           token itself on top of the projection).
``wrong``  the projected cache of the next evaluation passage's prefix (cyclically): the same
           form without this passage's content.

Reported: ``gap_closed = (loss_none - loss_proj) / (loss_none - loss_own)`` with a paired
percentile-bootstrap 95% interval over passages (ratio of means per resample), and
``wrong_doc_delta = loss_wrong - loss_proj`` (positive: the projected cache carries this
passage's content) with its bootstrap interval. Times, summed over the evaluation passages:
``project_seconds`` (projector calls: B tokenizing, aligning, the maps, and B running its BOS
and the last prefix token), ``prefill_seconds`` (B reading the prefix: tokenizing and one
forward pass building the cache) and ``a_prefill_seconds`` (the same for A); plus
``fit_seconds``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..atomic import atomic_write
from ..errors import InvalidInputError
from ..models import load_model
from ..project import Projector
from ..states.capturing import capture
from . import project_args
from .metrics import bootstrap_ci
from .project_args import FIT_POOL
from .report import check_out, hold_out
from .tasks import load_nq

PROJECT_RESULTS = ("results.json", "passages.jsonl", "projector.safetensors")
"""The files of an earlier run that ``--out`` must not hold, unless ``--overwrite``."""

RESULT_KEYS = (
    "gap_closed",
    "gap_closed_ci95",
    "wrong_doc_delta",
    "wrong_doc_delta_ci95",
    "loss_own",
    "loss_none",
    "loss_proj",
    "loss_wrong",
    "n_passages",
    "fit_seconds",
    "project_seconds",
    "prefill_seconds",
)


def passage_text(item) -> str:
    """The text of an NQ passage as read by both models: ``"{title}\\n{text}"``."""
    return f"{item.title}\n{item.text}"


def split_passage(
    item, prefix_fraction: float = 0.5, min_words: int = 16
) -> tuple[str, str] | None:
    """``(prefix, continuation)`` of :func:`passage_text`, cut at a word boundary.

    The cut is before word ``round(prefix_fraction * n)`` of the passage's ``n``-word text
    (clamped so each side has ``min_words`` words); the continuation starts with the
    whitespace before that word. None when the text has fewer than ``2 * min_words`` words.
    """
    words = list(re.finditer(r"\S+", item.text))
    if len(words) < 2 * min_words:
        return None
    k = min(max(round(prefix_fraction * len(words)), min_words), len(words) - min_words)
    cut = words[k - 1].end()
    head = f"{item.title}\n"
    return head + item.text[:cut], item.text[cut:]


def fit_texts(n_fit: int, fit_pool: int = FIT_POOL) -> list[str]:
    """The calibration texts: passages ``[0, min(n_fit, fit_pool))`` of the bundled NQ."""
    items = load_nq()[: min(n_fit, fit_pool)]
    return [passage_text(item) for item in items]


def eval_splits(
    n_passages: int, prefix_fraction: float, min_words: int, fit_pool: int = FIT_POOL
) -> list[tuple[str, str]]:
    """The first ``n_passages`` held-out passages that can be split.

    Held out: items from ``fit_pool`` on whose passage is not also among the first
    ``fit_pool`` items (NQ repeats gold passages across questions), each passage once.
    """
    items = load_nq()
    seen = {passage_text(item) for item in items[:fit_pool]}
    out = []
    for item in items[fit_pool:]:
        text = passage_text(item)
        if text in seen:
            continue
        seen.add(text)
        split = split_passage(item, prefix_fraction, min_words)
        if split is not None:
            out.append(split)
        if len(out) == n_passages:
            break
    return out


def continuation_nll(state, continuation: str) -> float:
    """Mean NLL (nats/token) of ``continuation`` (B's tokens, no specials) after ``state``."""
    ids = state.tokenizer(continuation, add_special_tokens=False)["input_ids"]
    logits = state.logits(continuation)
    target = torch.tensor(ids, device=logits.device)
    return float(F.cross_entropy(logits.float(), target))


def ratio_ci(
    num: np.ndarray, den: np.ndarray, n_resamples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """Paired percentile-bootstrap 95% interval of ``mean(num) / mean(den)``."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(n_resamples, len(num)))
    ratios = num[idx].mean(1) / den[idx].mean(1)
    low, high = np.quantile(ratios, [0.025, 0.975])
    return float(low), float(high)


def summarize(losses: dict[str, np.ndarray]) -> dict:
    """The headline numbers from per-passage losses ``own``, ``none``, ``proj``, ``wrong``."""
    own, none, proj, wrong = (losses[k] for k in ("own", "none", "proj", "wrong"))
    gap = float((none.mean() - proj.mean()) / (none.mean() - own.mean()))
    delta = wrong - proj
    return {
        "gap_closed": gap,
        "gap_closed_ci95": list(ratio_ci(none - proj, none - own)),
        "wrong_doc_delta": float(delta.mean()),
        "wrong_doc_delta_ci95": list(bootstrap_ci(delta)),
        "loss_own": float(own.mean()),
        "loss_none": float(none.mean()),
        "loss_proj": float(proj.mean()),
        "loss_wrong": float(wrong.mean()),
        "n_passages": len(own),
    }


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``project`` to the ``kvedit eval`` subcommands, run by :func:`main` (its options:
    :mod:`kvedit.evals.project_args`, which imports no torch)."""
    return project_args.add_parser(subparsers, run=main)


def _check_project(args) -> tuple[list[tuple[str, str]], Projector | None]:
    """Refuse, before any model loads and before anything is written, a run whose ``--out``
    holds an earlier run's results, whose ``--projector`` cannot be loaded, or that has fewer
    than 2 evaluation passages: ``(the passages' splits, the loaded projector or None)``."""
    check_out(args.out, PROJECT_RESULTS, overwrite=getattr(args, "overwrite", False))
    projector = None
    if args.projector:
        path = Path(args.projector)
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "no such file"
            raise InvalidInputError(f"--projector {path}: {what}")
        projector = Projector.load(path)
    splits = eval_splits(args.n_passages, args.prefix_fraction, args.min_words)
    if len(splits) < 2:
        raise InvalidInputError(
            f"only {len(splits)} held-out passages have {2 * args.min_words} words or more; "
            "an evaluation needs at least 2 (lower --min-words)"
        )
    return splits, projector


def _prefill_seconds(model, tokenizer, text: str) -> float:
    """Seconds for ``model`` to read ``text``: :func:`~kvedit.capture` (tokenizing, one forward
    pass building the cache; the fingerprints are memoised per model and tokenizer)."""
    _sync(model)
    t0 = time.perf_counter()
    capture(model, tokenizer, text)
    _sync(model)
    return time.perf_counter() - t0


def _sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def _log(args, msg: str) -> None:
    if not getattr(args, "no_progress", False):
        print(msg, file=sys.stderr, flush=True)


def main(args) -> int:
    """``kvedit eval project``: check every argument, then hold ``--out`` and run."""
    splits, loaded = _check_project(args)
    with hold_out(args.out) as out:  # one run per --out at a time
        return _run(args, out, splits, loaded)


@torch.no_grad()
def _run(args, out: Path, splits: list[tuple[str, str]], loaded: Projector | None) -> int:
    model_a, tok_a = load_model(args.a, device=args.device)
    model_b, tok_b = load_model(args.b, device=args.device)
    if len(splits) < 100:
        _log(args, f"warning: {len(splits)} passages; intervals need >= 100 to mean much")
    projector, fit_seconds, projector_path = _projector(
        args, out, loaded, model_a, tok_a, model_b, tok_b
    )

    empty = "" if tok_b("")["input_ids"] else "\n"
    none_state = capture(model_b, tok_b, empty)
    losses, times, rows = _score_passages(
        args, splits, projector, model_a, tok_a, model_b, tok_b, none_state
    )
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in losses.items()}
    results = summarize(arrays)
    n = results["n_passages"]
    results.update(
        {
            "fit_seconds": fit_seconds,
            "project_seconds": times["project"],
            "prefill_seconds": times["prefill"],
            "a_prefill_seconds": times["a_prefill"],
            "project_seconds_per_passage": times["project"] / n,
            "prefill_seconds_per_passage": times["prefill"] / n,
            "a": args.a,
            "b": args.b,
            "projector": str(projector_path),
            "n_fit_texts": projector.info.get("texts"),
            "depth_window": projector.info.get("depth_window"),
            "own_last": args.own_last,
            "prefix_fraction": args.prefix_fraction,
            "none_context": "B's tokenization of " + repr(empty) + " (its BOS)",
            "device": str(next(model_b.parameters()).device),
            "heldout_r2": [
                {k: layer[k] for k in ("heldout_r2_keys", "heldout_r2_values")}
                for layer in projector.info.get("layers", [])
            ],
        }
    )
    for k in ("own", "none", "proj", "wrong"):
        for row, value in zip(rows, arrays[k], strict=True):
            row[f"loss_{k}"] = float(value)
    atomic_write(
        out / "passages.jsonl",
        lambda tmp: Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in rows)),
    )
    atomic_write(
        out / "results.json",
        lambda tmp: Path(tmp).write_text(json.dumps(results, indent=2) + "\n"),
    )
    _print_results(results, out)
    return 0


def _projector(
    args, out: Path, loaded: Projector | None, model_a, tok_a, model_b, tok_b
) -> tuple[Projector, float, Path]:
    """``(projector, fit seconds, its path)``: ``loaded`` (``--projector``'s file), or one
    fitted from A to B on ``--n-fit`` NQ passages and saved as ``out/projector.safetensors``."""
    if loaded is not None:
        projector = loaded
        fit_seconds = float(projector.info.get("fit_seconds", float("nan")))
        projector_path = Path(args.projector)
    else:
        texts = fit_texts(args.n_fit)
        _log(args, f"fitting {args.a} -> {args.b} on {len(texts)} NQ passages")
        t0 = time.perf_counter()
        projector = Projector.fit(
            model_a,
            tok_a,
            model_b,
            tok_b,
            texts,
            depth_window=args.depth_window,
            progress=not args.no_progress,
        )
        fit_seconds = time.perf_counter() - t0
        projector_path = projector.save(out / "projector.safetensors")
        _log(args, f"fitted in {fit_seconds:.0f} s -> {projector_path}")
    return projector, fit_seconds, projector_path


def _score_passages(
    args, splits, projector: Projector, model_a, tok_a, model_b, tok_b, none_state
) -> tuple[dict[str, list[float]], dict[str, float], list[dict]]:
    """B's continuation loss of every ``(prefix, continuation)`` split after its own prefix
    cache, after ``none_state``, after A's projected cache, and after the next passage's
    projected cache (``wrong``; the last passage takes the first's), with the projection's
    and both prefills' seconds and one row per passage: ``(losses, times, rows)``."""
    times = {"project": 0.0, "a_prefill": 0.0, "prefill": 0.0}
    losses: dict[str, list[float]] = {"own": [], "none": [], "proj": [], "wrong": []}
    first_proj = prev_proj = None
    rows = []
    for i, (prefix, continuation) in enumerate(splits):
        own = capture(model_b, tok_b, prefix)
        state_a = capture(model_a, tok_a, prefix)
        _sync(model_b)
        t0 = time.perf_counter()
        proj = projector(state_a, model_b, tok_b, own_last=args.own_last)
        _sync(model_b)
        times["project"] += time.perf_counter() - t0
        times["prefill"] += _prefill_seconds(model_b, tok_b, prefix)
        times["a_prefill"] += _prefill_seconds(model_a, tok_a, prefix)
        losses["own"].append(continuation_nll(own, continuation))
        losses["none"].append(continuation_nll(none_state, continuation))
        losses["proj"].append(continuation_nll(proj, continuation))
        if prev_proj is not None:  # passage i-1 scored with passage i's projected prefix
            losses["wrong"].append(continuation_nll(proj, splits[i - 1][1]))
        first_proj = proj if first_proj is None else first_proj
        prev_proj = proj
        rows.append({"index": i, "prefix_chars": len(prefix), "b_prefix_tokens": len(own)})
        if (i + 1) % 10 == 0:
            _log(
                args,
                f"  {i + 1}/{len(splits)}: own {np.mean(losses['own']):.3f} "
                f"none {np.mean(losses['none']):.3f} proj {np.mean(losses['proj']):.3f}",
            )
    losses["wrong"].append(continuation_nll(first_proj, splits[-1][1]))
    return losses, times, rows


def _print_results(results: dict, out: Path) -> None:
    """One line to stdout: the gap closed, the wrong-document delta (with their intervals),
    the four mean losses and where the results are."""
    print(
        f"gap_closed {results['gap_closed']:.3f} "
        f"[{results['gap_closed_ci95'][0]:.3f}, {results['gap_closed_ci95'][1]:.3f}]  "
        f"wrong_doc_delta {results['wrong_doc_delta']:.3f} "
        f"[{results['wrong_doc_delta_ci95'][0]:.3f}, {results['wrong_doc_delta_ci95'][1]:.3f}]  "
        f"losses own {results['loss_own']:.3f} none {results['loss_none']:.3f} "
        f"proj {results['loss_proj']:.3f} wrong {results['loss_wrong']:.3f}  "
        f"(n={results['n_passages']}) -> {out / 'results.json'}"
    )


def _standalone(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvedit.evals.project")
    sub = parser.add_subparsers(dest="suite", required=True)
    add_parser(sub)
    args = parser.parse_args(["project", *(argv if argv is not None else sys.argv[1:])])
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(_standalone())
