"""vLLM serving kvedit caches: engine start, throughput, and per edit whether vLLM's greedy
answer equals kvedit's own ``state.generate`` (and the bias realised vs asked).

Run in the vLLM venv (``make vllm-setup``)::

    .venv-vllm/bin/python -m benchmarks.vllm_serve [--tokens 32] [--out runs/vllm_serve.json]
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import kvedit
from benchmarks.common import DEFAULT_MODEL, RUNS, parser, write_json
from kvedit.evals.tasks.records import records_examples
from kvedit.integrations.vllm import engine, publish_stock
from kvedit.prompts import QUESTION_MARK


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per answer")
    ap.add_argument("--records", type=int, default=20, help="records in the prompt")
    ap.add_argument("--out", default=str(RUNS / "vllm_serve.json"), help="write the rows here")
    args = ap.parse_args(argv)
    from vllm import SamplingParams

    model, tok = kvedit.load_model(DEFAULT_MODEL)
    example = records_examples(positions=[args.records // 2], trials=1, n_records=args.records)[0]
    prefix, question = kvedit.chat_prefix(tok, example.user_message(), QUESTION_MARK)
    state = kvedit.capture(model, tok, prefix)
    gold = example.gold_document
    ops = kvedit.ops
    focus = kvedit.focus(state, question)
    variants = {
        "plain": state,
        "scale_keys(gold, 0.5)": ops.scale_keys(state, gold, 0.5),
        "duplicate(gold, 3)": ops.duplicate(state, gold, 3),
        "suppress(gold, 1e4)": ops.suppress(state, gold, 1e4),
        "emphasize(gold, log 4)": ops.emphasize(state, gold, math.log(4)),
        "emphasize(gold, 2.0)": ops.emphasize(state, gold, 2.0),
        "suppress(gold, 2.0)": ops.suppress(state, gold, 2.0),
        "focus (per-layer)": focus.state,
    }
    root = Path(tempfile.mkdtemp(prefix="kvedit-vllm-"))
    t0 = time.perf_counter()
    llm = engine(model, root)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=False)
    qids = state.encode(question)
    rows = []
    for name, st in variants.items():
        ids, stock, _ = publish_stock(st, root)
        t = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids + qids}, params, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        got = list(out.outputs[0].token_ids)
        want = st.answer(question, args.tokens)
        agree = next((i for i, (a, b) in enumerate(zip(got, want.token_ids)) if a != b), None)
        rows.append(
            {
                "edit": name,
                "slots": stock.n_slots,
                "shift": stock.shift,
                "exact_cache": stock.exact,
                "identical": got[: len(want.token_ids)] == want.token_ids,
                "agree_tokens": len(want.token_ids) if agree is None else agree,
                "kvedit_tokens": len(want.token_ids),
                "cached": out.num_cached_tokens,
                "bias": sorted(
                    {(r.asked, r.realized, r.how) for r in stock.realizations},
                    key=lambda x: x[0],
                ),
                "vllm_text": out.outputs[0].text,
                "kvedit_text": want.text,
                "tok_per_s": len(got) / wall,
            }
        )
        print(
            f"{name:24s} identical={rows[-1]['identical']!s:5s} "
            f"agree={rows[-1]['agree_tokens']}/{len(want.token_ids)} "
            f"slots={stock.n_slots} shift={stock.shift:+d} cached={out.num_cached_tokens} "
            f"{len(got) / wall:.1f} tok/s | {out.outputs[0].text!r}"
        )
        for line in stock.report().splitlines()[1:]:
            print("   ", line)
    # throughput: one prompt, fixed length, after warm-up
    ids, _, _ = publish_stock(state, root)
    fixed = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    t = time.perf_counter()
    llm.generate({"prompt_token_ids": ids + qids}, fixed, use_tqdm=False)
    tps = 64 / (time.perf_counter() - t)
    print(f"engine start {start_s:.1f} s; {tps:.1f} tok/s (one prompt, 64 tokens, float32)")
    write_json(args.out, {"engine_start_s": start_s, "tok_per_s": tps, "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
