"""Cost of steering: decode throughput on a 2K context, and peak memory of a 7K prefill.

Decode (one process, interleaved repeats, median):
  * ``generate``: ``model.generate`` on a 2K-token prompt vs ``kvedit.steer(...).generate`` with
    the same prompt (scope ``"all"``); decode time = first to last new token, timestamped by a
    stopping-criteria hook (so the prefill, slower when steered, is not counted).
  * ``state``: ``state.generate`` on a captured 2K context vs the ``emphasize``-edited state.
  Target: steered throughput >= 0.95x unsteered.

Memory (one fresh process per variant; the process's max RSS during the call, after the peak
was reset past model loading through /proc/self/clear_refs where Linux allows it):
  ``generate`` with one new token on a 7K-token prompt, unsteered vs steered (scope ``"all"``).
  Target: steered peak <= 1.2x unsteered.

Seam (one process, interleaved repeats, median): the same 2K-token prefill and a 32-token
greedy ``model.generate`` on a model prepared by kvedit (its attention seam installed, no plan
active) and on a twin loaded the same way that kvedit never touched. Target: prepared speed
>= 0.98x untouched (``--skip-seam`` leaves it out).

Usage: ``python -m benchmarks.steer_speed [--decode-tokens 48] [--repeats 3]
[--json runs/steer_speed.json]``
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import time
from collections.abc import Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import kvedit
from benchmarks.common import (
    REPO,
    add_model,
    module_command,
    parser,
    peak_rss_kb,
    reset_peak_rss,
    write_json,
)
from kvedit.evals.tasks import load_nq


def context(tok, n_tokens: int) -> tuple[str, str]:
    """A prompt of about ``n_tokens`` tokens (NQ passages) and a span inside it to emphasize."""
    parts, total = [], 0
    for item in load_nq():
        parts.append(f"{item.title}: {item.text}")
        total += len(tok(item.text, add_special_tokens=False)["input_ids"]) + 8
        if total >= n_tokens:
            break
    text = "\n".join(parts)
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    end = enc["offset_mapping"][min(n_tokens, len(enc["input_ids"])) - 1][1]
    text = text[:end]
    span = parts[len(parts) // 2][:200]
    return text, span


class _Stamps(StoppingCriteria):
    """Records the time at which each new token is produced; never stops generation."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _decode_seconds(fn, n_new: int) -> float:
    """Seconds from the first to the last new token of one ``model.generate`` call (decode only)."""
    stamps = _Stamps()
    fn(n_new, StoppingCriteriaList([stamps]))
    return stamps.times[-1] - stamps.times[0]


def _gen_time(fn, n_new: int) -> float:
    t0 = time.perf_counter()
    fn(n_new)
    return time.perf_counter() - t0


@torch.no_grad()
def decode_bench(model, tok, n_ctx: int, n_new: int, repeats: int) -> dict:
    text, span = context(tok, n_ctx)
    prompt = text + "\n\nQuestion: What is this about?\nAnswer:"
    ids = tok(prompt, return_tensors="pt")
    steering = kvedit.steer(model, tok, emphasize=span, strength=2.0)

    def plain(n, stops):
        model.generate(
            **ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, stopping_criteria=stops
        )

    def steered(n, stops):
        steering.generate(prompt, max_new_tokens=n, min_new_tokens=n, stopping_criteria=stops)

    state = kvedit.capture(model, tok, text)
    edited = kvedit.ops.emphasize(state, span, 2.0)
    eos = set()  # no EOS: every run decodes exactly n tokens

    def state_plain(n):
        state.generate("\n\nAnswer:", n, eos_token_id=list(eos))

    def state_steered(n):
        edited.generate("\n\nAnswer:", n, eos_token_id=list(eos))

    out = {"context_tokens": int(ids["input_ids"].shape[1]), "new_tokens": n_new}
    for name, a, b in (("generate", plain, steered), ("state", state_plain, state_steered)):
        da, db = [], []
        for _ in range(repeats):  # interleaved, so drift hits both alike
            if name == "generate":  # token timestamps: the prefill is not part of the figure
                da.append(_decode_seconds(a, n_new))
                db.append(_decode_seconds(b, n_new))
            else:
                da.append(_gen_time(a, n_new) - _gen_time(a, 1))
                db.append(_gen_time(b, n_new) - _gen_time(b, 1))
        tps_a = (n_new - 1) / statistics.median(da)
        tps_b = (n_new - 1) / statistics.median(db)
        out[name] = {
            "unsteered_tok_s": tps_a,
            "steered_tok_s": tps_b,
            "ratio": tps_b / tps_a,
        }
    return out


@torch.no_grad()
def memory_child(variant: str, model_name: str, n_ctx: int) -> None:
    model, tok = kvedit.load_model(model_name, device="cpu")
    text, span = context(tok, n_ctx)
    ids = tok(text, return_tensors="pt")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Reset the peak (VmHWM) so the model's load does not hide the prefill's peak.
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    if variant == "steered":
        with kvedit.steer(model, tok, emphasize=span, strength=2.0):
            model.generate(**ids, max_new_tokens=1, do_sample=False)
    else:
        model.generate(**ids, max_new_tokens=1, do_sample=False)
    peak_kb = peak_rss_kb(reset)
    print(
        json.dumps(
            {
                "variant": variant,
                "tokens": int(ids["input_ids"].shape[1]),
                "maxrss_mb": peak_kb / 1024,
                "load_peak_mb": base / 1024,
                "peak_reset": reset,
                "seconds": time.perf_counter() - t0,
            }
        )
    )


def memory_bench(model_name: str, n_ctx: int) -> dict:
    rows = {}
    for variant in ("plain", "steered"):
        command = module_command(__file__, "--child", variant, "--model", model_name)
        command += ["--memory-tokens", str(n_ctx)]
        out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    rows["ratio"] = rows["steered"]["maxrss_mb"] / rows["plain"]["maxrss_mb"]
    return rows


@torch.no_grad()
def seam_bench(model_name: str, n_ctx: int, repeats: int) -> dict:
    """Unsteered speed through the installed seam vs an untouched twin (see the docstring)."""
    prepared, tok = kvedit.load_model(model_name, device="cpu")
    kvedit.prepare(prepared)
    untouched, _ = kvedit.load_model(model_name, device="cpu")
    assert prepared.config._attn_implementation == "kvedit"
    assert untouched.config._attn_implementation != "kvedit"
    text, _ = context(tok, n_ctx)
    ids = tok(text, return_tensors="pt")

    def prefill(model):
        t0 = time.perf_counter()
        model(**ids, logits_to_keep=1)
        return time.perf_counter() - t0

    def decode(model):
        t0 = time.perf_counter()
        model.generate(**ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        return time.perf_counter() - t0

    out = {"context_tokens": int(ids["input_ids"].shape[1])}
    for name, fn in (("prefill", prefill), ("generate_32", decode)):
        fn(prepared), fn(untouched)  # warm-up
        a, b = [], []
        for _ in range(repeats):
            a.append(fn(untouched))
            b.append(fn(prepared))
        ta, tb = statistics.median(a), statistics.median(b)
        out[name] = {"untouched_s": ta, "prepared_s": tb, "speed_ratio": ta / tb}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    p.add_argument("--context-tokens", type=int, default=2048, help="decode and seam context")
    p.add_argument("--decode-tokens", type=int, default=48, help="new tokens per decode run")
    p.add_argument("--memory-tokens", type=int, default=7168, help="prompt of the memory runs")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median)")
    p.add_argument("--skip-memory", action="store_true", help="leave the memory runs out")
    p.add_argument("--skip-seam", action="store_true", help="leave the seam runs out")
    p.add_argument("--child", choices=["plain", "steered"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.child:
        memory_child(args.child, args.model, args.memory_tokens)
        return 0
    result = {"threads": torch.get_num_threads()}
    if not args.skip_seam:
        seam = result["seam"] = seam_bench(args.model, args.context_tokens, args.repeats)
        for name in ("prefill", "generate_32"):
            r = seam[name]
            verdict = "PASS" if r["speed_ratio"] >= 0.98 else "MISS"
            print(
                f"seam, {name} on {seam['context_tokens']} tokens: untouched "
                f"{r['untouched_s']:.3f} s, prepared (no plan) {r['prepared_s']:.3f} s, speed "
                f"ratio {r['speed_ratio']:.3f} (target >= 0.98: {verdict})"
            )
    model, tok = kvedit.load_model(args.model, device="cpu")
    result["decode"] = decode_bench(
        model, tok, args.context_tokens, args.decode_tokens, args.repeats
    )
    d = result["decode"]
    print(
        f"decode on a {d['context_tokens']}-token context, {d['new_tokens']} new tokens, "
        f"{result['threads']} threads (median of {args.repeats})"
    )
    for name in ("generate", "state"):
        r = d[name]
        verdict = "PASS" if r["ratio"] >= 0.95 else "MISS"
        print(
            f"  {name:9s} unsteered {r['unsteered_tok_s']:6.1f} tok/s  steered "
            f"{r['steered_tok_s']:6.1f} tok/s  ratio {r['ratio']:.3f}  (target >= 0.95: {verdict})"
        )
    if not args.skip_memory:
        m = memory_bench(args.model, args.memory_tokens)
        result["memory"] = m
        verdict = "PASS" if m["ratio"] <= 1.2 else "MISS"
        print(
            f"prefill of {m['plain']['tokens']} tokens, generate(max_new_tokens=1), max RSS: "
            f"unsteered {m['plain']['maxrss_mb']:.0f} MB ({m['plain']['seconds']:.1f} s), "
            f"steered {m['steered']['maxrss_mb']:.0f} MB ({m['steered']['seconds']:.1f} s), "
            f"ratio {m['ratio']:.3f} (target <= 1.2: {verdict})"
        )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
