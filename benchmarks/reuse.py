"""Time-to-first-token: full prefill vs a stored state (from disk, from memory).

For each context length the context is NQ passages (shipped with kvedit) cut to that many
tokens, followed by a short question. Each number is the median of ``--repeats`` runs.

* prefill: the best plain-transformers prefill, one forward over context + question with
  ``logits_to_keep=1``.
* disk: ``kvedit.load_state`` of the saved context state, then the question's forward
  (``state.extend(question).last_logits``): the first answer token's distribution. The file is in the page
  cache (warm), as it is on a serving machine that stored it recently.
* memory: the question's forward on a state already in memory.

Usage: ``python benchmarks/reuse.py [--lengths 512,2048,4096] [--repeats 5] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kvedit
from kvedit.evals.tasks import load_nq

QUESTION = "\n\nQuestion: Which of these passages mentions a war?\nAnswer:"


def context_text(tokenizer, n_tokens: int) -> str:
    """NQ passages concatenated and cut at a token boundary to ``n_tokens`` tokens."""
    parts, total = [], 0
    for item in load_nq():
        parts.append(f"{item.title}: {item.text}")
        total += len(item.text) // 3
        if total > n_tokens * 2:
            break
    text = "\n".join(parts)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    if len(enc["input_ids"]) < n_tokens:
        raise ValueError("not enough text for the requested length")
    end = enc["offset_mapping"][n_tokens - 1][1]
    return text[:end]


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def bench_length(model, tok, n_tokens: int, repeats: int, tmpdir: Path) -> dict:
    text = context_text(tok, n_tokens)
    state = kvedit.capture(model, tok, text)
    # the same token sequence for all three: context tokens, then the question's tokens
    question_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([state.token_ids.tolist() + question_ids])

    def prefill():
        return model(ids, logits_to_keep=1).logits[0, -1]

    path = tmpdir / f"ctx{n_tokens}.kv"
    state.save(path)

    def from_disk():
        return kvedit.load_state(path, model, tok).extend(QUESTION).last_logits

    def from_memory():
        return state.extend(QUESTION).last_logits

    # the three agree on the first answer token
    ref = prefill()
    for other in (from_disk(), from_memory()):
        assert int(other.argmax()) == int(ref.argmax()), "reuse changed the prediction"
    row = {
        "tokens": len(state),
        "file_mb": round(path.stat().st_size / 2**20, 1),
        "prefill_s": median_time(prefill, repeats),
        "disk_s": median_time(from_disk, repeats),
        "memory_s": median_time(from_memory, repeats),
    }
    row["disk_speedup"] = row["prefill_s"] / row["disk_s"]
    row["memory_speedup"] = row["prefill_s"] / row["memory_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", default="512,2048,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model, tok = kvedit.load_model(args.model, device="cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.lengths.split(",")]:
            rows.append(bench_length(model, tok, n, args.repeats, Path(tmp)))
    print(f"time to first token, {args.model}, {torch.get_num_threads()} threads (median)")
    print(
        f"{'tokens':>7} {'file MB':>8} {'prefill s':>10} {'disk s':>8} {'memory s':>9} "
        f"{'disk x':>7} {'memory x':>9}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['file_mb']:>8.1f} {r['prefill_s']:>10.3f} {r['disk_s']:>8.4f} "
            f"{r['memory_s']:>9.4f} {r['disk_speedup']:>7.1f} {r['memory_speedup']:>9.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
