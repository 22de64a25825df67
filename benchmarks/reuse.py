"""Time-to-first-token: full prefill vs stored states, a KVStore, and a blend of stored passages.

For each context length the context is NQ passages (shipped with kvedit) cut to that many
tokens, followed by a short question. Each number is the median of ``--repeats`` runs.

* prefill: the best plain-transformers prefill, one forward over context + question with
  ``logits_to_keep=1``.
* disk: ``kvedit.load_state`` of the saved context state, then the question's forward
  (``state.logits(question)``). The file is in the page cache (warm), as it is on a serving
  machine that stored it recently.
* memory (the floor): the same question's forward on the state already in memory.
* store mem / store disk: ``kvedit.reuse(model, tok, context + question, store)`` with the
  context stored in a :class:`kvedit.KVStore`: tokenize, hash the chunks, find the longest
  stored prefix (``longest_prefix_ids``) and prefill the question on top of it; from the
  store's memory tier, or from its disk tier (a store without memory tier, checksum verified
  on every load).
* blend: the context cut into ``--passages`` passages, each stored on its own, then
  ``kvedit.blend(..., recompute=--recompute)`` and the question's forward, vs a prefill of the
  same token ids. ``agree`` says whether the first answer token is the prefill's; ``|dlogit|``
  is the largest difference of the first answer token's logits. ``--rule`` adds blend rules
  (``rescale=0.7``, ``leading=8:rescale=0.6``: ``kvedit.reusing.blend_rules``; default none).

Usage: ``python -m benchmarks.reuse [--lengths 512,2048,4096] [--repeats 5] [--rule RULE]
[--json runs/reuse.json]``
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

import kvedit
from benchmarks.blend_curve import parse_rule
from benchmarks.common import add_model, median_time, parser, write_json
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


@torch.no_grad()
def bench_length(
    model,
    tok,
    n_tokens: int,
    repeats: int,
    tmpdir: Path,
    passages: int,
    recompute: float,
    rule: dict | None = None,
) -> dict:
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
        return kvedit.load_state(path, model, tok).logits(QUESTION)

    def from_memory():
        return state.logits(QUESTION)

    # the three agree on the first answer token
    ref = prefill()
    first = state.extend(QUESTION).last_logits
    assert int(first.argmax()) == int(ref.argmax()), "reuse changed the prediction"
    assert torch.equal(from_disk(), from_memory()), "the stored state answers differently"
    row = {
        "tokens": len(state),
        "file_mb": round(path.stat().st_size / 2**20, 1),
        "prefill_s": median_time(prefill, repeats),
        "disk_s": median_time(from_disk, repeats),
        "memory_s": median_time(from_memory, repeats),
    }
    row.update(bench_store(model, tok, state, repeats, tmpdir / f"store{n_tokens}"))
    row.update(bench_blend(model, tok, state, passages, recompute, repeats, tmpdir, rule))
    for name in ("disk", "memory", "store_mem", "store_disk", "blend"):
        row[f"{name}_speedup"] = row["prefill_s"] / row[f"{name}_s"]
    for name in ("disk", "store_mem", "store_disk"):
        row[f"{name}_over_floor"] = row[f"{name}_s"] / row["memory_s"]
    return row


def bench_store(model, tok, state, repeats: int, root: Path) -> dict:
    """``kvedit.reuse`` of context + question with the context in a KVStore (memory/disk)."""
    prompt = state.text + QUESTION
    with_memory = kvedit.KVStore(root, memory_bytes=2 * state.nbytes)
    with_memory.put(state)
    disk_only = kvedit.KVStore(root)  # the same entry, no memory tier

    def from_store(store):
        def run():
            out, report = kvedit.reuse(model, tok, prompt, store, save=False)
            assert report.tokens_reused == len(state), report
            return out.last_logits

        return run

    return {
        "store_mem_s": median_time(from_store(with_memory), repeats),
        "store_disk_s": median_time(from_store(disk_only), repeats),
    }


def passage_texts(state, n_passages: int) -> list[str]:
    """The state's text cut at token boundaries into ``n_passages`` pieces of equal length."""
    ids, offsets = state.token_ids, state.offsets
    cuts = [round(i * len(ids) / n_passages) for i in range(n_passages + 1)]
    starts = [0] + [int(offsets[c, 0]) for c in cuts[1:-1]] + [len(state.text)]
    return [state.text[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def bench_blend(
    model, tok, state, n_passages: int, recompute: float, repeats, tmp, rule: dict | None = None
) -> dict:
    """Blend of ``n_passages`` stored passages + the question, vs a prefill of the same ids;
    ``rule``: :func:`kvedit.blend`'s rule keywords."""
    rule = rule or {}
    parts = passage_texts(state, n_passages)
    store = kvedit.KVStore(tmp / f"blend{len(state)}", memory_bytes=4 * state.nbytes)
    blended, report = kvedit.blend(model, tok, parts, store, recompute=recompute, **rule)
    question_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([blended.token_ids.tolist() + question_ids])

    def prefill():
        return model(ids, logits_to_keep=1).logits[0, -1]

    def from_blend():
        out, report = kvedit.blend(model, tok, parts, store, recompute=recompute, **rule)
        assert report.tokens_computed == 0, report
        return out.extend(QUESTION).last_logits

    ref, got = prefill(), from_blend()
    return {
        "blend_prefill_s": median_time(prefill, repeats),
        "blend_s": median_time(from_blend, repeats),
        "blend_agree": int(got.argmax()) == int(ref.argmax()),
        "blend_dlogit": float((got - ref).abs().max()),
        "blend_recomputed": report.tokens_recomputed,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    p.add_argument("--lengths", default="512,2048,4096", help="context lengths in tokens")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per number (median)")
    p.add_argument("--passages", type=int, default=10, help="passages of the blend")
    p.add_argument("--recompute", type=float, default=0.15, help="the blend's recompute fraction")
    p.add_argument("--rule", default="default", help="blend rules, e.g. rescale=0.7")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rule = parse_rule(args.rule)
    model, tok = kvedit.load_model(args.model, device="cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.lengths.split(",")]:
            rows.append(
                bench_length(
                    model, tok, n, args.repeats, Path(tmp), args.passages, args.recompute, rule
                )
            )
    print(f"time to first token, {args.model}, {torch.get_num_threads()} threads (median, s)")
    header = ["tokens", "file MB", "prefill", "disk", "memory", "store mem", "store disk"]
    print(" ".join(f"{h:>10}" for h in header) + "   speedup: disk memory st-mem st-disk")
    for r in rows:
        cells = [r["tokens"], r["file_mb"], r["prefill_s"], r["disk_s"], r["memory_s"]]
        cells += [r["store_mem_s"], r["store_disk_s"]]
        print(
            f"{cells[0]:>10} {cells[1]:>10.1f} "
            + " ".join(f"{c:>10.4f}" for c in cells[2:])
            + f"   {r['disk_speedup']:>13.1f} {r['memory_speedup']:>6.1f} "
            f"{r['store_mem_speedup']:>6.1f} {r['store_disk_speedup']:>7.1f}"
        )
    print("\nover the floor (the question's forward on the state in memory):")
    for r in rows:
        print(
            f"{r['tokens']:>10} disk {r['disk_over_floor']:.2f}x  store mem "
            f"{r['store_mem_over_floor']:.2f}x  store disk {r['store_disk_over_floor']:.2f}x"
        )
    print(
        f"\nblend of {args.passages} stored passages (recompute={args.recompute}, rule "
        f"{args.rule}) + question, "
        "vs prefill of the same ids"
    )
    print(
        f"{'tokens':>10} {'prefill':>10} {'blend':>10} {'speedup':>8} {'recomputed':>11} "
        f"{'agree':>6} {'|dlogit|':>9}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>10} {r['blend_prefill_s']:>10.4f} {r['blend_s']:>10.4f} "
            f"{r['blend_prefill_s'] / r['blend_s']:>8.1f} {r['blend_recomputed']:>11} "
            f"{str(r['blend_agree']):>6} {r['blend_dlogit']:>9.3f}"
        )
    write_json(args.json, [{**r, "rule": args.rule} for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
