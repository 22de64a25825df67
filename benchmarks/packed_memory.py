"""Peak memory of ``generate`` from a packed state (quantized, merged) vs the dense state.

A ~7K-token context of NQ passages (as ``benchmarks.reuse`` builds it) is captured once on
the bundled SmolLM2-135M-Instruct and saved dense, 4-bit and 8-bit quantized
(``kvedit.compress.quantize``), merged (``kvedit.compress.minicache`` at its defaults) and
merged + 4-bit. Each file is then measured in a fresh process: load the model, load the state
(``kvedit.load_state``), reset the peak RSS (``/proc/self/clear_refs``; the process's
``ru_maxrss`` where Linux refuses), and ``state.generate(question, 16)`` (EOS ignored, so
every variant decodes all 16 tokens). Reported per
variant: the state's bytes and file size, the process's RSS after loading the model and after
loading the state, the peak during ``generate`` (absolute), and that peak above each of the two,
with glibc's default allocator settings and with its mmap threshold pinned to 128 KiB (the
default threshold grows as large blocks are freed, after which freed tensors can stay
resident as heap free space: the peak then depends on the allocation history, not only on
the tensors alive).

A packed state attends layer by layer (``kvedit.cache.adapter.dynamic_cache``): only the
current layer's dense K/V exist during a forward, so its peak above the loaded state stays near
one layer; the dense state's ``generate`` concatenates the question onto every layer (a copy of
the whole cache). Target: the 4-bit state's peak <= 0.6x the dense state's.

Usage::

    OMP_NUM_THREADS=1 python -m benchmarks.packed_memory --tokens 7000 \\
        --json runs/packed_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import kvedit
from benchmarks.common import (
    DEFAULT_MODEL,
    REPO,
    command_line,
    module_command,
    parser,
    peak_rss_kb,
    reset_peak_rss,
    rss_kb,
    write_json,
)
from benchmarks.reuse import QUESTION, context_text
from kvedit import ops
from kvedit.compress import minicache

MODEL = DEFAULT_MODEL
# glibc raises its mmap threshold as big blocks are freed, after which freed tensors may stay
# resident as heap free space; "mmap128k" pins the threshold (128 KiB), so RSS follows the
# tensors alive. Both are measured.
ALLOCATORS = {"default": {}, "mmap128k": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
VARIANTS = {
    "dense": lambda s: s,
    "quantize:bits=8": lambda s: ops.quantize(s, bits=8),
    "quantize:bits=4": lambda s: ops.quantize(s, bits=4),
    "minicache": lambda s: minicache(s),
    "minicache:bits=4": lambda s: minicache(s, bits=4),
}


def child(path: str, new_tokens: int) -> None:
    """One measurement, in this (fresh) process; prints one JSON line."""
    model, tok = kvedit.load_model(MODEL, device="cpu")
    kvedit.prepare(model)
    after_model = rss_kb()
    state = kvedit.load_state(path, model, tok)
    after_state = rss_kb()
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    answer = state.answer(QUESTION, new_tokens, eos_token_id=[])  # never stops early
    seconds = time.perf_counter() - t0
    peak = peak_rss_kb(reset)
    print(
        json.dumps(
            {
                "rss_after_model_mb": after_model / 1024,
                "rss_after_state_mb": after_state / 1024,
                "peak_mb": peak / 1024,
                "peak_above_model_mb": (peak - after_model) / 1024,
                "peak_above_state_mb": (peak - after_state) / 1024,
                "peak_reset": reset,
                "generate_s": seconds,
                "new_tokens": len(answer.token_ids),
                "answer": answer.text,
            }
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=7000, help="context tokens")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generate decodes")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.new_tokens)
        return 0
    model, tok = kvedit.load_model(MODEL, device="cpu")
    state = kvedit.capture(model, tok, context_text(tok, args.tokens))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in VARIANTS.items():
            packed = make(state)
            path = Path(tmp) / f"{name.replace(':', '_').replace('=', '')}.kv"
            packed.save(path)
            kinds = sorted({layer.kind for layer in packed.layers})
            row = {"nbytes": packed.nbytes, "file_bytes": path.stat().st_size, "kinds": kinds}
            del packed
            command = module_command(__file__, "--child", str(path))
            command += ["--new-tokens", str(args.new_tokens)]
            for allocator, env in ALLOCATORS.items():
                out = subprocess.run(
                    command,
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=REPO,
                    env={**os.environ, **env},
                )
                row[allocator] = json.loads(out.stdout.strip().splitlines()[-1])
            rows[name] = row
            print(name, json.dumps(row), flush=True)
    dense = rows["dense"]
    for row in rows.values():
        row["bytes_vs_dense"] = row["nbytes"] / dense["nbytes"]
        for allocator in ALLOCATORS:
            r, d = row[allocator], dense[allocator]
            r["peak_vs_dense"] = r["peak_mb"] / d["peak_mb"]
            r["peak_above_model_vs_dense"] = r["peak_above_model_mb"] / d["peak_above_model_mb"]
    result = {
        "model": MODEL,
        "context_tokens": len(state),
        "new_tokens": args.new_tokens,
        "command": "OMP_NUM_THREADS=1 " + command_line(__file__, argv),
        "target": "quantize:bits=4 peak <= 0.6x dense",
        "rows": rows,
    }
    print(f"{'variant':18} {'MB':>6} {'file MB':>7}  allocator  peak  >model  >state  x dense")
    for name, row in rows.items():
        for allocator in ALLOCATORS:
            r = row[allocator]
            print(
                f"{name:18} {row['nbytes'] / 2**20:6.1f} {row['file_bytes'] / 2**20:7.1f}  "
                f"{allocator:9} {r['peak_mb']:5.0f} {r['peak_above_model_mb']:7.0f} "
                f"{r['peak_above_state_mb']:7.0f} {r['peak_vs_dense']:8.2f}"
            )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
