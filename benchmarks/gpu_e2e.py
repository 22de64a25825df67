"""End to end on a GPU: steered generation of 8B- and 4B-shaped models against unsteered.

Models (random bf16 weights built on the GPU from a config, no download):

* ``llama3-8b``: Llama-3-8B's shape: 32 layers, hidden 4096, 32 query / 8 KV heads, head dim 128,
  MLP 14336, vocab 128256.
* ``gemma3-4b``: Gemma-3-4B's text shape: 34 layers, hidden 2560, 8 / 4 heads, head dim 256,
  MLP 10240, vocab 262208, sliding window 1024 with five local layers to one global.

For each model and context length (4K and 16K tokens of random words from kvedit's tiny
tokenizer, whose ids are a subset of the model's vocabulary), three ways to generate:

* ``unsteered``: ``model.generate`` (greedy, stock SDPA attention);
* ``steer``: the same inside ``kvedit.steer(model, tok, emphasize=<a 200-token span>)``;
* ``state``: ``kvedit.capture`` of the prompt, ``kvedit.ops.emphasize`` of the span, then
  ``state.answer`` (what ``state.generate`` runs) decoding the continuation.

Time to first token is the time of a 1-token generation (for ``state``: capture, edit and the
first token); decode tokens/s is ``(n - 1) / (t_n - t_1)``. Ratios are to ``unsteered`` of the same
run. Checks (exit 1 if one fails): the steered tokens differ from the unsteered ones, and
kvedit's Triton attention kernel ran once per layer on every decode step of ``steer`` and
``state`` (counted launches), so a silent fall-back to SDPA cannot pass.

``--tiny`` runs tiny shapes (on CPU through Triton's interpreter when there is no GPU) in a few
seconds: it proves the script, not the speed.

    python -m benchmarks.gpu_e2e --json runs/gpu_e2e.json     # GPU
    python -m benchmarks.gpu_e2e --tiny                       # anywhere
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton reads this when triton.language is first imported (importing kvedit does).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# imported after the line above (kvedit imports triton.language)
import kvedit.ops  # noqa: E402
from benchmarks.common import parser, write_json  # noqa: E402
from kvedit.testing import tiny_tokenizer  # noqa: E402
from kvedit.triton.counting import LAUNCHES  # noqa: E402

SPAN_TOKENS = 200
STRENGTH = 3.0
LENGTHS = [4096, 16384]
NEW_TOKENS = 32
_WORD_TEXT = (
    "Alice Bob Carol Dave Eve Frank Grace Heidi Ivan Judy secret number is the of and to in was "
    "for on that with as by at from his her it an are which or be this Paris France capital "
    "quick brown fox jumps over lazy dog answer question records document title search results "
    "0 1 2 3 4 5 6 7 8 9 10 42 100 2024"
)
WORDS = _WORD_TEXT.split()


@dataclass
class Row:
    model: str
    context: int
    method: str
    ttft_s: float
    decode_tok_s: float
    ttft_ratio: float | None = None  # over unsteered (lower is better)
    decode_ratio: float | None = None  # over unsteered (higher is better)
    tokens: list[int] | None = None
    kernel_launches_per_step: list[int] | None = None


def model_configs(tiny: bool) -> dict:
    from transformers import Gemma3TextConfig, LlamaConfig

    if tiny:
        llama = LlamaConfig(
            vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=4096,
        )  # fmt: skip
        gemma = Gemma3TextConfig(
            vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=24,
            max_position_embeddings=4096,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        )  # fmt: skip
    else:
        llama = LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
            max_position_embeddings=131072, tie_word_embeddings=False,
        )  # fmt: skip
        gemma = Gemma3TextConfig(
            vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
            max_position_embeddings=131072,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)
            ],
        )  # fmt: skip
    return {"llama3-8b": llama, "gemma3-4b": gemma}


def build_model(config, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def make_prompt(tok, n_tokens: int, seed: int) -> tuple[str, str]:
    """A prompt of about ``n_tokens`` random words and a span of its tokens from the middle
    (``SPAN_TOKENS``, or a quarter of the prompt when shorter)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(n_tokens)]
    ids = tok(" ".join(words), add_special_tokens=False)["input_ids"][: n_tokens - 1]
    span_len = min(SPAN_TOKENS, len(ids) // 4)
    start = len(ids) // 2 - span_len // 2
    text = tok.decode(ids)
    span = tok.decode(ids[start : start + span_len]).strip()
    assert text.count(span) == 1, "span not unique"
    return text, span


class StepLaunches:
    """Attention-kernel launches in each forward of ``model`` (one forward = one step)."""

    def __init__(self, model):
        self.model, self.steps, self._before = model, [], 0

    def __enter__(self):
        def pre(module, args, kwargs):
            self._before = LAUNCHES["attention"]

        def post(module, args, kwargs, output):
            self.steps.append(LAUNCHES["attention"] - self._before)

        self._hooks = [
            self.model.register_forward_pre_hook(pre, with_kwargs=True),
            self.model.register_forward_hook(post, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str):
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


@torch.no_grad()
def run_methods(model, tok, text: str, span: str, new_tokens: int, device: str) -> dict:
    """``{method: (t_1, t_n, tokens, launches per step of the n-token run)}``."""
    ids = tok(text, return_tensors="pt").to(device)

    def generate(n):
        out = model.generate(
            **ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
        return out[0, ids["input_ids"].shape[1] :].tolist()

    def steered(n):
        with kvedit.steer(model, tok, emphasize=span, strength=STRENGTH):
            return generate(n)

    def state_path(n):
        state = kvedit.capture(model, tok, text)
        edited = kvedit.ops.emphasize(state, span, STRENGTH)
        return edited.answer("", n, eos_token_id=[]).token_ids

    results = {}
    for name, fn in (("unsteered", generate), ("steer", steered), ("state", state_path)):
        t1, _ = timed(lambda fn=fn: fn(1), device)
        with StepLaunches(model) as launches:
            tn, tokens = timed(lambda fn=fn: fn(new_tokens), device)
        results[name] = (t1, tn, tokens, launches.steps)
    return results


def check(rows: list[Row], n_layers: dict[str, int], new_tokens: int) -> list[str]:
    """The failures: steered output equal to unsteered, or a decode step without the kernel."""
    failures = []
    for r in rows:
        if r.method == "unsteered":
            continue
        base = next(
            o for o in rows if (o.model, o.context, o.method) == (r.model, r.context, "unsteered")
        )
        if r.tokens == base.tokens:
            failures.append(f"{r.model} {r.context} {r.method}: output equals unsteered")
        steps = r.kernel_launches_per_step or []
        decode = steps[-(new_tokens - 1) :] if new_tokens > 1 else []
        want = n_layers[r.model]
        if len(decode) < new_tokens - 1 or any(n != want for n in decode):
            failures.append(
                f"{r.model} {r.context} {r.method}: kvedit kernel launches per decode step "
                f"{decode}, expected {want} (one per layer) on each of {new_tokens - 1} steps"
            )
    return failures


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'model':10} {'context':>7} {'method':10} {'TTFT s':>8} {'x unst.':>7} "
        f"{'decode tok/s':>12} {'x unst.':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        tr = "-" if r.ttft_ratio is None else f"{r.ttft_ratio:.2f}"
        dr = "-" if r.decode_ratio is None else f"{r.decode_ratio:.2f}"
        print(
            f"{r.model:10} {r.context:>7} {r.method:10} {r.ttft_s:8.3f} {tr:>7} "
            f"{r.decode_tok_s:12.1f} {dr:>7}"
        )


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU-capable, seconds)")
    p.add_argument("--lengths", type=str, help="comma-separated context lengths")
    p.add_argument("--models", type=str, default="llama3-8b,gemma3-4b")
    p.add_argument("--new-tokens", type=int, help=f"tokens per generation (default {NEW_TOKENS})")
    p.add_argument("--json", type=Path, help="write the rows and checks here")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print("no CUDA: only --tiny runs here")
        return 2
    if device == "cpu":  # kvedit's attention takes the Triton path only on CUDA unless forced
        os.environ["KVEDIT_ATTENTION"] = "triton"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else (
        [40] if args.tiny else LENGTHS
    )  # fmt: skip
    new_tokens = args.new_tokens or (3 if args.tiny else NEW_TOKENS)
    tok = tiny_tokenizer()
    cfgs = model_configs(args.tiny)
    rows: list[Row] = []
    n_layers: dict[str, int] = {}
    env = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "tiny": args.tiny,
        "new_tokens": new_tokens,
        "span_tokens": SPAN_TOKENS,
        "strength": STRENGTH,
    }
    print("end-to-end benchmark:", json.dumps(env), flush=True)
    for name in [m for m in args.models.split(",") if m]:
        model = build_model(cfgs[name], device, dtype)
        n_layers[name] = model.config.num_hidden_layers
        if not args.tiny:  # warm-up (kernel compilation, allocator): each method, short prompt
            warm_text, warm_span = make_prompt(tok, 256, seed=99)
            run_methods(model, tok, warm_text, warm_span, 2, device)
        for length in lengths:
            text, span = make_prompt(tok, length, seed=length)
            res = run_methods(model, tok, text, span, new_tokens, device)
            for method, (t1, tn, tokens, steps) in res.items():
                # (n - 1) / (t_n - t_1); a noisy t_1 (tiny runs) falls back to n / t_n
                decode = (new_tokens - 1) / (tn - t1) if tn > 1.05 * t1 else new_tokens / tn
                rows.append(Row(name, length, method, t1, decode, None, None, tokens, steps))
            base = rows[-3]
            for r in rows[-3:]:
                r.ttft_ratio = r.ttft_s / base.ttft_s
                r.decode_ratio = r.decode_tok_s / base.decode_tok_s
            print(
                "  "
                + "; ".join(
                    f"{name} {length} {r.method}: TTFT {r.ttft_s:.3f} s, {r.decode_tok_s:.1f} tok/s"
                    for r in rows[-3:]
                ),
                flush=True,
            )
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    failures = check(rows, n_layers, new_tokens)
    print()
    print_table(rows)
    targets = []
    if not args.tiny:
        for r in rows:
            if r.method != "unsteered":
                ok = r.decode_ratio is not None and r.decode_ratio >= 0.9
                targets.append(
                    f"{'PASS' if ok else 'MISS'}  {r.model} {r.context} {r.method}: decode within "
                    f"10% of unsteered ({r.decode_ratio:.2f}x)"
                )
        print("\ntargets:")
        print("\n".join(f"  {t}" for t in targets))
    print("\nchecks:", "PASS" if not failures else "FAIL")
    for f in failures:
        print("  " + f)
    payload = {
        "env": env,
        "rows": [asdict(r) for r in rows],
        "targets": targets,
        "failures": failures,
    }
    write_json(args.json, payload)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
