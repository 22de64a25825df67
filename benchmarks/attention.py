"""Benchmark kvedit's Triton attention (with a key bias) against torch and flash-attn kernels.

Methods, for causal prefill (``Sq == Sk``) and decode (``Sq == 1`` against an ``Sk``-long cache):

* ``kvedit``        kvedit.triton.attention with a ``[B, Hkv, Sk]`` float32 bias.
* ``sdpa``          torch SDPA, no bias, ``enable_gqa=True``.
* ``sdpa_repeat``   torch SDPA, no bias, K/V repeated to ``H`` heads beforehand (not timed).
* ``sdpa_mask``     torch SDPA with the bias (and causality) as a dense float mask
                    ``[B, H, Sq, Sk]`` and repeated K/V, as a stock transformers model would
                    run it. Skipped when the mask would not fit in ``--mask-budget`` of free
                    memory (32K prefill needs a 64 GiB mask).
* ``flash_attn``    flash-attn's ``flash_attn_func``, no bias (only if installed).
* ``flex``          ``torch.compile``-d FlexAttention with a ``score_mod`` adding the same bias.

Numbers: ``tok/s`` is query tokens per second (``B * Sq / time``); ``TFLOP/s`` counts
``4 * B * H * D * P`` flops, ``P`` the visible (query, key) pairs (``Sq * Sk - Sq * (Sq - 1) / 2``
causal, about ``2 * 2 * B * H * Sq * Sk * D / 2`` for prefill); ``GB/s`` counts the bytes of K
and V read once (``2 * B * Hkv * Sk * D * itemsize``), the decode roofline. ``x SDPA`` divides
the method's throughput by the faster of ``sdpa``/``sdpa_repeat``. Peak memory is
``torch.cuda.max_memory_allocated`` during set-up and the first call (inputs included);
``extra`` is the part above what was allocated before.

Without CUDA (or with ``--cpu-smoke``) it runs tiny shapes through Triton's interpreter, only to
prove that the script runs; those timings mean nothing.

    python -m benchmarks.attention --quick --out runs/attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

if "--cpu-smoke" in sys.argv[1:] or not torch.cuda.is_available():
    # Triton reads this when triton.language is imported, which importing kvedit does.
    os.environ["TRITON_INTERPRET"] = "1"

# imported after the line above: they import kvedit
from benchmarks.common import parser as make_parser  # noqa: E402
from benchmarks.common import write_json  # noqa: E402

GIB = 2**30
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768]
QUICK_LENGTHS = [1024, 4096, 16384, 32768]
METHODS = ["kvedit", "sdpa", "sdpa_repeat", "sdpa_mask", "flash_attn", "flex"]
TARGET_LEN = 16384


class Skip(Exception):
    """A method cannot run this configuration; the message says why."""


@dataclass(frozen=True)
class Problem:
    mode: str  # "prefill" or "decode"
    seq_len: int  # Sk, and Sq for prefill
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str

    @property
    def q_len(self) -> int:
        return self.seq_len if self.mode == "prefill" else 1

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def flops(self) -> float:
        sq, sk = self.q_len, self.seq_len
        pairs = sq * sk - sq * (sq - 1) / 2  # causal, bottom-right aligned, sq <= sk
        return 4.0 * self.batch * self.heads * self.head_dim * pairs

    def kv_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.batch * self.kv_heads * self.seq_len * self.head_dim * itemsize


@dataclass
class Result:
    mode: str
    seq_len: int
    method: str
    ms: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    ratio_to_sdpa: float | None = None
    peak_gib: float | None = None
    extra_gib: float | None = None
    max_abs_diff_vs_kvedit: float | None = None
    note: str = ""


@dataclass
class Inputs:
    q: torch.Tensor  # [B, H, Sq, D]
    k: torch.Tensor  # [B, Hkv, Sk, D]
    v: torch.Tensor  # [B, Hkv, Sk, D]
    bias: torch.Tensor  # [B, Hkv, Sk] float32, nats
    scale: float
    extras: dict = field(default_factory=dict)


def make_inputs(p: Problem, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=p.device).manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = p.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=p.device, dtype=dtype)

    return Inputs(
        q=randn(p.batch, p.heads, p.q_len, p.head_dim),
        k=randn(p.batch, p.kv_heads, p.seq_len, p.head_dim),
        v=randn(p.batch, p.kv_heads, p.seq_len, p.head_dim),
        bias=randn(p.batch, p.kv_heads, p.seq_len, dtype=torch.float32),
        scale=p.head_dim**-0.5,
    )


# ----------------------------------------------------------------------------- methods
# Each builder does its untimed set-up and returns the callable to time, or raises Skip.


def build_kvedit(p: Problem, x: Inputs, args: argparse.Namespace) -> Callable[[], torch.Tensor]:
    import kvedit.triton as kt

    return lambda: kt.attention(x.q, x.k, x.v, x.bias, causal=True, scale=x.scale)


def build_sdpa(p: Problem, x: Inputs, args: argparse.Namespace) -> Callable[[], torch.Tensor]:
    causal = p.mode == "prefill"  # Sq == Sk: top-left and bottom-right alignment agree
    return lambda: F.scaled_dot_product_attention(
        x.q, x.k, x.v, is_causal=causal, scale=x.scale, enable_gqa=True
    )


def _repeated_kv(p: Problem, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    if "kv" not in x.extras:
        x.extras["kv"] = (
            x.k.repeat_interleave(p.group, dim=1),
            x.v.repeat_interleave(p.group, dim=1),
        )
    return x.extras["kv"]


def build_sdpa_repeat(
    p: Problem, x: Inputs, args: argparse.Namespace
) -> Callable[[], torch.Tensor]:
    k, v = _repeated_kv(p, x)
    causal = p.mode == "prefill"
    return lambda: F.scaled_dot_product_attention(x.q, k, v, is_causal=causal, scale=x.scale)


def build_sdpa_mask(p: Problem, x: Inputs, args: argparse.Namespace) -> Callable[[], torch.Tensor]:
    itemsize = torch.empty((), dtype=p.dtype).element_size()
    need = p.batch * p.heads * p.q_len * p.seq_len * itemsize + p.q_len * p.seq_len
    if p.device == "cuda":
        budget = args.mask_budget * torch.cuda.mem_get_info()[0]
        if need > budget:
            raise Skip(
                f"dense [B, H, Sq, Sk] mask needs {need / GIB:.1f} GiB, over the budget of "
                f"{budget / GIB:.1f} GiB ({args.mask_budget:g} of free memory)"
            )
    k, v = _repeated_kv(p, x)
    mask = torch.empty(p.batch, p.heads, p.q_len, p.seq_len, dtype=p.dtype, device=p.device)
    mask.copy_(x.bias.repeat_interleave(p.group, dim=1)[:, :, None, :].expand(mask.shape))
    offset = p.seq_len - p.q_len
    hidden = torch.ones(p.q_len, p.seq_len, dtype=torch.bool, device=p.device).triu_(offset + 1)
    mask.masked_fill_(hidden, float("-inf"))
    del hidden
    return lambda: F.scaled_dot_product_attention(x.q, k, v, attn_mask=mask, scale=x.scale)


def build_flash_attn(p: Problem, x: Inputs, args: argparse.Namespace) -> Callable[[], torch.Tensor]:
    try:
        from flash_attn import flash_attn_func
    except ImportError as error:
        raise Skip(f"flash-attn not installed ({error.__class__.__name__})") from None
    if p.device != "cuda":
        raise Skip("flash-attn needs CUDA")
    # flash-attn wants [B, S, H, D]; the layout change is set-up, not timed
    q, k, v = (t.transpose(1, 2).contiguous() for t in (x.q, x.k, x.v))
    return lambda: flash_attn_func(q, k, v, softmax_scale=x.scale, causal=True)


_COMPILED_FLEX: Callable | None = None


def build_flex(p: Problem, x: Inputs, args: argparse.Namespace) -> Callable[[], torch.Tensor]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as error:
        raise Skip(f"FlexAttention unavailable in torch {torch.__version__}: {error}") from None
    global _COMPILED_FLEX
    if p.device == "cuda":
        if _COMPILED_FLEX is None:
            for knob in ("cache_size_limit", "recompile_limit"):  # one compile per shape
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, 256)
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        flex = _COMPILED_FLEX
    else:  # CPU smoke: the eager reference path, compiling would take minutes here
        flex = flex_attention
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    bias, group = x.bias, p.group

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, h // group, kv_idx]

    block_mask = None
    if p.mode == "prefill":
        offset = p.seq_len - p.q_len

        def causal(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        block_mask = create_block_mask(
            causal, B=None, H=None, Q_LEN=p.q_len, KV_LEN=p.seq_len, device=p.device
        )
    return lambda: flex(
        x.q, x.k, x.v, score_mod=add_bias, block_mask=block_mask, scale=x.scale, enable_gqa=True
    )


BUILDERS = {
    "kvedit": build_kvedit,
    "sdpa": build_sdpa,
    "sdpa_repeat": build_sdpa_repeat,
    "sdpa_mask": build_sdpa_mask,
    "flash_attn": build_flash_attn,
    "flex": build_flex,
}


# ----------------------------------------------------------------------------- timing


def time_ms(fn: Callable[[], object], device: str, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds per call: CUDA events through triton's do_bench, or a CPU clock."""
    if device == "cuda":
        import triton.testing

        return float(
            triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        )
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def run_method(
    name: str, p: Problem, x: Inputs, args: argparse.Namespace, ref: torch.Tensor | None
) -> tuple[Result, torch.Tensor | None]:
    """Set up, call once (compiles), check against ``ref``, time, and measure memory."""
    result = Result(mode=p.mode, seq_len=p.seq_len, method=name)
    cuda = p.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    out = None
    try:
        fn = BUILDERS[name](p, x, args)
        out = fn()
        if cuda:
            torch.cuda.synchronize()
            result.peak_gib = torch.cuda.max_memory_allocated() / GIB
            result.extra_gib = (torch.cuda.max_memory_allocated() - before) / GIB
        if ref is not None and out is not None and name != "kvedit" and _same_bias(name):
            result.max_abs_diff_vs_kvedit = (out.float() - ref.float()).abs().max().item()
        ms = time_ms(fn, p.device, args.warmup_ms, args.rep_ms)
    except Skip as why:
        result.note = f"skipped: {why}"
        return result, None
    except torch.cuda.OutOfMemoryError as error:
        result.note = f"skipped: out of memory ({str(error).splitlines()[0][:80]})"
        return result, None
    finally:
        x.extras.pop("kv", None)  # repeated K/V count towards the method that made them
    result.ms = ms
    result.tokens_per_s = p.batch * p.q_len / (ms * 1e-3)
    result.tflops = p.flops() / (ms * 1e-3) / 1e12
    result.gbps = p.kv_bytes() / (ms * 1e-3) / 1e9
    return result, out


def _same_bias(name: str) -> bool:
    """Methods computing the same function as kvedit (with the bias), worth comparing to it."""
    return name in ("sdpa_mask", "flex")


# ----------------------------------------------------------------------------- reporting


def add_ratios(results: list[Result]) -> None:
    """Fill ``ratio_to_sdpa``: throughput over the faster unbiased SDPA of the same problem."""
    for r in results:
        base = [
            o.ms
            for o in results
            if o.mode == r.mode
            and o.seq_len == r.seq_len
            and o.method in ("sdpa", "sdpa_repeat")
            and o.ms
        ]
        if r.ms and base:
            r.ratio_to_sdpa = min(base) / r.ms


def _fmt(value: float | None, spec: str) -> str:
    """``format(value, spec)``, or a dash of the same width for a missing value."""
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if value is None else format(value, spec)


def print_table(results: list[Result]) -> None:
    header = (
        f"{'mode':7} {'len':>6} {'method':12} {'ms':>9} {'tok/s':>10} {'TFLOP/s':>8} "
        f"{'GB/s':>7} {'x SDPA':>7} {'peak GiB':>9} {'extra GiB':>9}  note"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        tflops = r.tflops if r.mode == "prefill" else None
        gbps = r.gbps if r.mode == "decode" else None
        diff = (
            ""
            if r.max_abs_diff_vs_kvedit is None
            else f"|diff vs kvedit| {r.max_abs_diff_vs_kvedit:.2g}"
        )
        note = "; ".join(s for s in (r.note, diff) if s)
        print(
            f"{r.mode:7} {r.seq_len:>6} {r.method:12} {_fmt(r.ms, '9.3f')} "
            f"{_fmt(r.tokens_per_s, '10.4g')} {_fmt(tflops, '8.1f')} {_fmt(gbps, '7.0f')} "
            f"{_fmt(r.ratio_to_sdpa, '7.2f')} {_fmt(r.peak_gib, '9.2f')} "
            f"{_fmt(r.extra_gib, '9.2f')}  {note}"
        )


def evaluate_targets(results: list[Result], target_len: int) -> list[dict]:
    """The issue's performance targets, each PASS, MISS or SKIP (not measured)."""

    def ms_of(mode: str, length: int, method: str) -> float | None:
        for r in results:
            if (r.mode, r.seq_len, r.method) == (mode, length, method) and r.ms:
                return r.ms
        return None

    def sdpa_ms(mode: str, length: int) -> float | None:
        times = [t for t in (ms_of(mode, length, "sdpa"), ms_of(mode, length, "sdpa_repeat")) if t]
        return min(times) if times else None

    def verdict(name: str, ok: bool | None, detail: str) -> dict:
        return {
            "target": name,
            "status": "SKIP" if ok is None else ("PASS" if ok else "MISS"),
            "detail": detail,
        }

    out = []
    ours, base = ms_of("prefill", target_len, "kvedit"), sdpa_ms("prefill", target_len)
    out.append(
        verdict(
            f"prefill {target_len}: kvedit+bias >= 0.8x SDPA-without-bias throughput",
            None if not (ours and base) else base / ours >= 0.8,
            "not measured" if not (ours and base) else f"{base / ours:.2f}x",
        )
    )
    masked = ms_of("prefill", target_len, "sdpa_mask")
    out.append(
        verdict(
            f"prefill {target_len}: kvedit+bias >= 2x SDPA-with-float-mask throughput",
            None if not (ours and masked) else masked / ours >= 2.0,
            "not measured" if not (ours and masked) else f"{masked / ours:.2f}x",
        )
    )
    for length in sorted({r.seq_len for r in results if r.mode == "decode"}):
        ours, base = ms_of("decode", length, "kvedit"), sdpa_ms("decode", length)
        out.append(
            verdict(
                f"decode {length}: kvedit+bias time <= 1.2x SDPA's",
                None if not (ours and base) else ours <= 1.2 * base,
                "not measured" if not (ours and base) else f"{ours / base:.2f}x SDPA's time",
            )
        )
    for mode, length in sorted({(r.mode, r.seq_len) for r in results}):
        ours, flex = ms_of(mode, length, "kvedit"), ms_of(mode, length, "flex")
        out.append(
            verdict(
                f"{mode} {length}: kvedit at least as fast as FlexAttention with the bias",
                None if not (ours and flex) else ours <= flex,
                "not measured" if not (ours and flex) else f"{flex / ours:.2f}x Flex's speed",
            )
        )
    return out


# ----------------------------------------------------------------------------- kernel sweep


def sweep(
    device: str, dtype: torch.dtype, shape: dict, lengths: tuple[int, int], args
) -> list[dict]:
    """Time a few launch configs and split-K factors of the kvedit kernel (to tune defaults).

    ``lengths``: the prefill and the decode length to sweep at.
    """
    from kvedit.triton import _attention as impl
    from kvedit.triton import configs as table

    Config = impl.KernelConfig
    prefill_configs = [
        None,
        *dict.fromkeys(c for by_d in table.PREFILL_CONFIGS.values() for c in by_d.values()),
        Config(128, 64, 8, 3),
        Config(128, 128, 8, 3),
        Config(128, 32, 4, 3),
        Config(64, 64, 4, 3),
        Config(128, 64, 8, 4),
    ]
    decode_configs = [None, Config(16, 64, 4, 3), Config(16, 128, 4, 3), Config(16, 32, 4, 4)]
    cases = [
        (Problem("prefill", lengths[0], dtype=dtype, device=device, **shape), prefill_configs, [None]),
        (Problem("decode", lengths[1], dtype=dtype, device=device, **shape), decode_configs,
         [None, 16, 32, 64, 128]),
    ]  # fmt: skip
    rows = []
    for p, configs, split_options in cases:
        x = make_inputs(p)
        for cfg in configs:
            for splits in split_options:
                label = f"{p.mode} {p.seq_len} config={cfg} num_splits={splits}"
                call = _kernel_call(impl, x, cfg, splits)
                try:
                    ms = time_ms(call, device, args.warmup_ms, args.rep_ms)
                except Exception as error:  # a config may not fit: record it and go on
                    print(f"sweep {label}: failed: {str(error).splitlines()[0][:100]}")
                    rows.append({"case": label, "ms": None, "error": str(error)[:200]})
                    continue
                print(f"sweep {label}: {ms:.3f} ms")
                rows.append({"case": label, "ms": ms})
    rows += decode_threshold_sweep(impl, device, dtype, shape, args)
    return rows


def decode_threshold_sweep(impl, device: str, dtype: torch.dtype, shape: dict, args) -> list[dict]:
    """One-pass decode against split-K at growing lengths, to place
    ``kvedit.triton.configs.DECODE_SINGLE_PASS_MAX_KEYS`` (the longest length where one pass
    is at least as fast)."""
    if device != "cuda":
        return []
    rows, best = [], 0
    for length in (512, 1024, 2048, 4096, 8192, 16384):
        p = Problem("decode", length, dtype=dtype, device=device, **shape)
        x = make_inputs(p)
        programs = p.batch * p.kv_heads
        splits = impl._default_num_splits(programs, triton_cdiv(length, 64), x.q.device)
        single = time_ms(_kernel_call(impl, x, None, 1), device, args.warmup_ms, args.rep_ms)
        split = time_ms(_kernel_call(impl, x, None, splits), device, args.warmup_ms, args.rep_ms)
        if single <= split and best == (length // 2 if length > 512 else 0):
            best = length  # one pass has won at every length so far
        print(
            f"sweep decode-threshold {length}: one pass {single:.4f} ms, split-K x{splits} "
            f"{split:.4f} ms"
        )
        rows.append(
            {"case": f"decode-threshold {length}", "single_ms": single, "split_ms": split,
             "splits": splits}
        )  # fmt: skip
    print(
        f"sweep decode-threshold: one pass wins up to {best or 'none'} keys "
        f"(DECODE_SINGLE_PASS_MAX_KEYS is {impl.DECODE_SINGLE_PASS_MAX_KEYS})"
    )
    rows.append({"case": "decode-threshold suggestion", "max_keys": best})
    return rows


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel_call(impl, x: Inputs, cfg, splits: int | None) -> Callable[[], torch.Tensor]:
    return lambda: impl.attention(x.q, x.k, x.v, x.bias, num_splits=splits, config=cfg)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--out", type=Path, help="write results as JSON here")
    parser.add_argument("--quick", action="store_true", help="fewer lengths, shorter timing")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes through Triton's interpreter (the default without CUDA)",
    )
    parser.add_argument("--lengths", type=str, help="comma-separated sequence lengths")
    parser.add_argument("--modes", type=str, default="prefill,decode")
    parser.add_argument("--methods", type=str, default=",".join(METHODS))
    parser.add_argument(
        "--mask-budget",
        type=float,
        default=0.5,
        help="largest dense mask for sdpa_mask, as a fraction of free GPU memory",
    )
    parser.add_argument("--warmup-ms", type=float, help="do_bench warm-up (default 25, quick 10)")
    parser.add_argument("--rep-ms", type=float, help="do_bench repetition (default 100, quick 40)")
    parser.add_argument("--sweep", action="store_true", help="also time kernel launch configs")
    args = parser.parse_args(argv)
    args.warmup_ms = args.warmup_ms or (10.0 if args.quick else 25.0)
    args.rep_ms = args.rep_ms or (40.0 if args.quick else 100.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    smoke = args.cpu_smoke or not torch.cuda.is_available()  # TRITON_INTERPRET set above
    import kvedit.triton as kt

    if not kt.is_available():
        print("kvedit.triton is not available here (Triton missing?); nothing to benchmark")
        return 1
    device = "cpu" if smoke else "cuda"
    if smoke:
        dtype, shape = torch.float32, dict(batch=1, heads=4, kv_heads=2, head_dim=32)
        lengths = [int(s) for s in args.lengths.split(",")] if args.lengths else [64]
    else:
        dtype, shape = torch.bfloat16, dict(batch=1, heads=32, kv_heads=8, head_dim=128)
        default = QUICK_LENGTHS if args.quick else LENGTHS
        lengths = [int(s) for s in args.lengths.split(",")] if args.lengths else default
    modes = [m for m in args.modes.split(",") if m]
    methods = [m for m in args.methods.split(",") if m]
    for name in [*modes, *methods]:
        if name not in ("prefill", "decode", *BUILDERS):
            raise SystemExit(f"unknown mode or method {name!r}")
    if "kvedit" in methods:  # first: the others are compared to its output
        methods = ["kvedit"] + [m for m in methods if m != "kvedit"]

    env = {
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "dtype": str(dtype).removeprefix("torch."),
        **shape,
        "quick": args.quick,
        "cpu_smoke": smoke,
    }
    print("attention benchmark:", json.dumps(env))
    results: list[Result] = []
    payload = {
        "env": env,
        "flops_formula": "4 * B * H * D * (Sq * Sk - Sq * (Sq - 1) / 2)  (causal pairs)",
        "bytes_formula": "2 * B * Hkv * Sk * D * itemsize  (K and V read once)",
        "tokens_per_s": "B * Sq / time",
        "complete": False,
        "results": [],
        "targets": [],
        "sweep": [],
    }
    for mode in modes:
        for length in lengths:
            p = Problem(mode, length, dtype=dtype, device=device, **shape)
            x = make_inputs(p)
            ref = None
            for name in methods:
                result, out = run_method(name, p, x, args, ref)
                if name == "kvedit":
                    ref = out
                results.append(result)
                done = f"{result.ms:.3f} ms" if result.ms is not None else result.note
                print(f"  {mode} {length} {name}: {done}", flush=True)
                del out
            del x, ref
            payload["results"] = [asdict(r) for r in results]
            write_json(args.out, payload)  # partial results survive a timeout
    add_ratios(results)
    print()
    print_table(results)

    if smoke:  # the only claim a smoke run makes: the kernel ran and agreed with the others
        diffs = [r.max_abs_diff_vs_kvedit for r in results if r.max_abs_diff_vs_kvedit is not None]
        worst = max(diffs, default=0.0)
        print(f"\ncpu smoke: ran (interpreter); worst |diff vs kvedit| {worst:.2g}")
        if worst > 1e-3:
            print("cpu smoke: FAILED, the kernel disagrees with SDPA/Flex")
            return 1
        targets: list[dict] = []
    else:
        targets = evaluate_targets(results, TARGET_LEN)
        print("\ntargets:")
        for t in targets:
            print(f"  {t['status']:4}  {t['target']}  ({t['detail']})")

    sweep_rows: list[dict] = []
    if args.sweep:
        sweep_rows = sweep(device, dtype, shape, (64, 64) if smoke else (8192, 32768), args)
    payload.update(
        complete=True,
        results=[asdict(r) for r in results],
        targets=targets,
        sweep=sweep_rows,
    )
    if write_json(args.out, payload):
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
