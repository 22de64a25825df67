"""The launch-config table (kvedit/triton/configs.py): every config it can start from computes
the right attention (in the interpreter: block shapes only, tiny shapes), and the lookup falls
back to the tested default for GPUs and head dims the table does not name."""

from __future__ import annotations

import pytest
import torch

import kvedit.triton as kt
from kvedit.triton import configs

pytestmark = pytest.mark.skipif(
    not kt.is_available(), reason="Triton missing, or neither CUDA nor TRITON_INTERPRET=1"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cases():
    """One case per distinct (kind, head dim, tile shape); warps and stages do not matter to
    the interpreter (on a GPU every entry runs, warps and stages included)."""
    seen, out = set(), []
    for kind, cap, block_d, cfg in configs.table_configs():
        shape_key = (kind, block_d, cfg.block_m, cfg.block_n)
        if shape_key in seen and not torch.cuda.is_available():
            continue
        seen.add(shape_key)
        gpu = "default" if cap is None else f"sm{cap[0]}{cap[1]}"
        tile = f"{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"
        name = f"{kind}-{gpu}-d{block_d}-{tile}"
        out.append(pytest.param(kind, block_d, cfg, id=name))
    return out


@pytest.mark.parametrize("kind, block_d, cfg", _cases())
def test_every_table_config_is_correct(kind: str, block_d: int, cfg) -> None:
    """Prefill configs: a tile of query rows over two key blocks with a window (masked edge,
    diagonal, ragged end). Decode: one query, 4 heads, two key blocks."""
    from kvedit.triton import _attention

    gen = torch.Generator().manual_seed(block_d + cfg.block_m + cfg.block_n)
    G, Hkv = 4, 1
    if kind == "prefill":
        Sq, Sk, window = cfg.block_m // G, cfg.block_n + 9, cfg.block_n // 2 + 3
    else:
        Sq, Sk, window = 1, cfg.block_n + 9, None
    D = block_d if block_d <= 128 else block_d - 16  # also the ragged head-dim path at 256
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q = torch.randn(1, Hkv * G, Sq, D, generator=gen).to(DEVICE, dtype)
    k = torch.randn(1, Hkv, Sk, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(1, Hkv, Sk, D, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(1, Hkv, Sk, generator=gen).to(DEVICE)
    out = _attention.attention(q, k, v, bias, window=window, config=cfg)
    ref = kt.attention_reference(q.float(), k.float(), v.float(), bias, window=window)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (out.float() - ref).abs().max().item() <= tol


def test_lookup_uses_the_table_and_falls_back_to_the_default() -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    hopper = (9, 0)
    assert configs.pick_config(4096, 128, bf16, hopper) == configs.PREFILL_CONFIGS[hopper][128]
    decode = configs.pick_config(4, 128, bf16, hopper)
    assert decode.block_m == 16 and decode.block_n == configs.DECODE_CONFIGS[hopper][128].block_n
    for rows, block_d, dtype, cap in [
        (4096, 128, bf16, (7, 5)),  # a GPU the table does not name
        (4096, 32, bf16, hopper),  # a head dim it does not name
        (4096, 128, fp32, hopper),  # float32: the default
        (4, 128, bf16, None),  # off CUDA
    ]:
        assert configs.pick_config(rows, block_d, dtype, cap) == configs.default_config(
            rows, block_d, dtype
        )
    chain = configs.fallbacks(configs.PREFILL_CONFIGS[hopper][128])
    assert chain[-1] == configs.KernelConfig(16, 16, 4, 1)
    assert all(c.block_m * c.block_n >= d.block_m * d.block_n for c, d in zip(chain, chain[1:]))


def test_decode_threshold_is_one_named_constant() -> None:
    from kvedit.triton import _attention

    assert _attention.DECODE_SINGLE_PASS_MAX_KEYS is configs.DECODE_SINGLE_PASS_MAX_KEYS
    assert configs.DECODE_SINGLE_PASS_MAX_KEYS >= 256
