"""Launch configurations of the attention kernel, per GPU and head dim, in one small table.

:func:`kvedit.triton._attention.attention` reads its first launch config from here:

* :data:`PREFILL_CONFIGS` for tiles of more than 64 query rows (prefill, long chunks), keyed by
  the GPU's compute capability ``(major, minor)`` and the head dim rounded up to a power of two
  (``block_d``), for 16-bit inputs (fp16/bf16); float32 and any GPU or head dim the table does
  not name get :func:`default_config`, the tested portable choice.
* :data:`DECODE_CONFIGS` likewise for 64 query rows or fewer (decode: ``Sq * G`` rows).
* :data:`DECODE_SINGLE_PASS_MAX_KEYS`: up to this many visible keys a decode call is one launch,
  one program per (batch row, KV head) over the whole cache; longer caches split the keys among
  programs and merge the partials in a second kernel (split-K).

If a config does not fit a GPU (``OutOfResources``), the kernel falls back to smaller ones
derived from it (:func:`fallbacks`). Every config in the tables is run for correctness through
Triton's interpreter by ``tests/triton/test_triton_configs.py`` (tiny shapes); speed is measured
only by ``python -m benchmarks.attention --sweep`` on a GPU (``benchmarks/gpu_check.sh
--sweep``), which also
times single-pass against split-K decode to place the threshold.

Kept free of any ``triton`` import (like :mod:`._common`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DECODE_CONFIGS",
    "DECODE_SINGLE_PASS_MAX_KEYS",
    "KernelConfig",
    "PREFILL_CONFIGS",
    "default_config",
    "fallbacks",
    "pick_config",
    "table_configs",
]


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the attention kernel.

    ``block_m``: query rows per tile (``Sq * G`` rows, the group packed in), ``block_n``: keys
    per tile, ``num_warps`` and ``num_stages`` (software-pipelining depth) as Triton takes them.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# NOT YET MEASURED: provisional. It must be chosen on the GPU from the `decode-threshold` rows of
# `python -m benchmarks.attention --sweep` (where split-K starts to beat one pass). Reasoning
# behind 2048 (H200, bf16, 8 KV heads, D = 128): one pass runs B * Hkv = 8 programs, each reading
# 2 * Sk * D * 2 bytes at perhaps 50-100 GB/s per SM: about 5-10 us at 1K, 10-20 us at 2K; split-K
# adds a second launch (a few us of GPU time, more of host time) and two workspaces.
DECODE_SINGLE_PASS_MAX_KEYS = 2048

# Prefill tiles (> 64 query rows), fp16/bf16. (major, minor) -> {block_d: first config}.
# NOT YET MEASURED: seeded from the notes (Hopper: bigger key tiles, 8 warps, 2-3 stages within
# its 227 KB of shared memory) and from the one H200 run (reports/benchmarks/gpu_h200: 128x64, 8 warps, 3 stages
# at D = 128 gave 0.62x SDPA at 16K). Replace with the sweep's winners.
PREFILL_CONFIGS: dict[tuple[int, int], dict[int, KernelConfig]] = {
    (9, 0): {  # H100 / H200
        64: KernelConfig(128, 128, 4, 3),
        128: KernelConfig(128, 128, 8, 2),
        256: KernelConfig(64, 64, 8, 2),
    },
    (8, 0): {  # A100
        64: KernelConfig(128, 64, 4, 3),
        128: KernelConfig(128, 64, 8, 3),
        256: KernelConfig(64, 64, 8, 2),
    },
}

# Decode tiles (<= 64 query rows): block_m is set from the rows at launch (16..64); the table
# gives block_n, warps and stages. NOT YET MEASURED (Hopper: wider key tiles and deeper pipelines
# keep more bytes in flight per program, which a one-pass decode with few programs needs).
DECODE_CONFIGS: dict[tuple[int, int], dict[int, KernelConfig]] = {
    (9, 0): {
        64: KernelConfig(16, 128, 4, 3),
        128: KernelConfig(16, 128, 4, 3),
        256: KernelConfig(16, 64, 4, 3),
    },
}


def _pow2_at_least(n: int, floor: int = 16) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def default_config(rows: int, block_d: int, dtype: torch.dtype) -> KernelConfig:
    """The portable first config (any GPU, any dtype): what the kernel used before the table."""
    fp32 = dtype == torch.float32
    if rows <= 64:
        return KernelConfig(_pow2_at_least(rows), 64 if block_d <= 128 else 32, 4, 2 if fp32 else 3)
    if block_d <= 64:
        return KernelConfig(128, 64, 4, 2 if fp32 else 3)
    if block_d <= 128:
        return KernelConfig(64, 32, 4, 2) if fp32 else KernelConfig(128, 64, 8, 3)
    return KernelConfig(32, 32, 4, 1) if fp32 else KernelConfig(64, 64, 8, 2)


def pick_config(
    rows: int, block_d: int, dtype: torch.dtype, capability: tuple[int, int] | None
) -> KernelConfig:
    """First config for a call: the table's entry for this GPU and head dim, else the default.

    ``rows`` is ``Sq * G`` (query rows per KV head); ``capability`` is None off CUDA.
    """
    if dtype != torch.float32 and capability is not None:
        table = DECODE_CONFIGS if rows <= 64 else PREFILL_CONFIGS
        entry = table.get(tuple(capability), {}).get(block_d)
        if entry is not None:
            if rows <= 64:  # a tile just tall enough for the rows
                return KernelConfig(
                    _pow2_at_least(rows), entry.block_n, entry.num_warps, entry.num_stages
                )
            return entry
    return default_config(rows, block_d, dtype)


def fallbacks(first: KernelConfig) -> list[KernelConfig]:
    """``first`` and ever smaller configs after it (fewer stages, then narrower tiles)."""
    configs = [first]
    c = first
    while c.num_stages > 1 or c.block_n > 16 or c.block_m > 16:
        if c.num_stages > 1:
            c = KernelConfig(c.block_m, c.block_n, c.num_warps, c.num_stages - 1)
        elif c.block_n > 16:
            c = KernelConfig(c.block_m, c.block_n // 2, c.num_warps, 2)
        else:
            c = KernelConfig(c.block_m // 2, c.block_n, max(4, c.num_warps // 2), 2)
        configs.append(c)
    return configs


def table_configs() -> list[tuple[str, tuple[int, int] | None, int, KernelConfig]]:
    """Every config the tables and the defaults can start from: ``(kind, capability, block_d,
    config)``, for the interpreter test (``capability`` None for the defaults)."""
    rows = []
    for kind, table in (("prefill", PREFILL_CONFIGS), ("decode", DECODE_CONFIGS)):
        for cap, by_d in table.items():
            for block_d, cfg in by_d.items():
                rows.append((kind, cap, block_d, cfg))
    for block_d in (64, 128, 256):
        for dtype in (torch.float32, torch.bfloat16):
            rows.append(("prefill", None, block_d, default_config(128, block_d, dtype)))
            rows.append(("decode", None, block_d, default_config(4, block_d, dtype)))
    return rows
