"""Re-rotation of cached post-RoPE keys: kernel vs reference, and vs transformers' own RoPE.

The defining property: ``rerotate(rope(k, p), d) == rope(k, p + d)``, with ``rope`` computed by
the model's own rotary embedding class and ``apply_rotary_pos_emb`` from transformers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

import kvedit.triton as kt
from kvedit.triton import KernelInputError, rerotate_reference

pytestmark = pytest.mark.skipif(
    not kt.is_available(), reason="Triton missing, or neither CUDA nor TRITON_INTERPRET=1"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # interpreter


def _inv_freq(half: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(half, dtype=torch.float32) / half)


@settings(SLOW, max_examples=40)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    seq=st.integers(1, 70),
    head_dim=st.sampled_from([6, 16, 32, 64, 128]),
    dtype=st.sampled_from(DTYPES),
    max_delta=st.sampled_from([3, 300, 5000]),
    layout=st.sampled_from(["contiguous", "bshd", "in_place"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rerotate_matches_reference(
    batch, kv_heads, seq, head_dim, dtype, max_delta, layout, seed
) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, kv_heads, seq, head_dim)
    if layout == "bshd":  # [B, S, Hkv, D] storage, as some caches keep it
        keys = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).transpose(1, 2)
    else:
        keys = torch.randn(shape, generator=gen)
    keys = keys.to(device=DEVICE, dtype=dtype)
    delta = torch.randint(-max_delta, max_delta + 1, (seq,), generator=gen).to(DEVICE)
    inv_freq = _inv_freq(head_dim // 2).to(DEVICE)

    expected = rerotate_reference(keys, delta, inv_freq)
    if layout == "in_place":
        got = kt.rerotate(keys, delta, inv_freq, out=keys)
        assert got.data_ptr() == keys.data_ptr()
    else:
        got = kt.rerotate(keys, delta, inv_freq)
    assert got.shape == shape and got.dtype == dtype
    scale = expected.float().abs().max().item() + 1.0
    # fp32: sin/cos of kernel and torch differ by an ulp or two; halves: one rounding step
    tol = 2e-5 * scale if dtype == torch.float32 else 1e-2 * scale
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"


def _rotary_cases():
    llama = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    yarn = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 1024,
        },
    )
    qwen2 = Qwen2Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    # Gemma-3: local (sliding) layers use base 10k, global layers base 1M with linear scaling,
    # each with its own inv_freq buffer on one shared rotary module.
    gemma3 = Gemma3TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        num_hidden_layers=2,
        intermediate_size=64,
        vocab_size=128,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    )
    return {
        "llama": (LlamaRotaryEmbedding(llama), None),
        "llama-yarn": (LlamaRotaryEmbedding(yarn), None),
        "qwen2": (Qwen2RotaryEmbedding(qwen2), None),
        "gemma3-sliding": (Gemma3RotaryEmbedding(gemma3), "sliding_attention"),
        "gemma3-full": (Gemma3RotaryEmbedding(gemma3), "full_attention"),
    }


ROTARY = _rotary_cases()


def _layer_rope(name: str):
    """``(rope(k, positions), inv_freq, attention_scaling)`` for one model's layer."""
    rotary, layer_type = ROTARY[name]
    rotary = rotary.to(DEVICE)
    suffix = "" if layer_type is None else f"{layer_type}_"
    inv_freq = getattr(rotary, f"{suffix}inv_freq")
    scaling = getattr(rotary, f"{suffix}attention_scaling")

    def rope(k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        args = (k, positions[None, :]) + (() if layer_type is None else (layer_type,))
        cos, sin = rotary(*args)
        return apply_rotary_pos_emb(k, k, cos, sin)[1]

    return rope, inv_freq, scaling


def _positions_and_deltas(seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted cache positions in [0, 800) and deltas moving them anywhere in [0, 1200)."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 800, (seq,), generator=gen).sort().values
    targets = torch.randint(0, 1200, (seq,), generator=gen)
    return positions.to(DEVICE), (targets - positions).to(DEVICE)


@pytest.mark.parametrize("name", list(ROTARY))
def test_rerotate_equals_rope_at_shifted_positions(name: str) -> None:
    rope, inv_freq, scaling = _layer_rope(name)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 37, 2 * inv_freq.shape[0], generator=gen).to(DEVICE)
    positions, delta = _positions_and_deltas(keys.shape[2], seed=1)

    cached = rope(keys, positions)
    expected = rope(keys, positions + delta)
    got = kt.rerotate(cached, delta, inv_freq)
    # fp32 angles near 1200 rad carry ~1e-4 rad of rounding, in HF's computation as in ours
    err = (got - expected).abs().max().item()
    assert err <= 1e-3, f"{name}: max abs error {err:.3g}"
    if scaling != 1.0:  # applying the scaling once more must be caught by this tolerance
        assert (got * scaling - expected).abs().max().item() > 1e-2


def test_rope_cases_cover_what_they_claim() -> None:
    """The yarn case scales, and Gemma-3's two layer types really rotate differently."""
    assert _layer_rope("llama-yarn")[2] != 1.0
    assert not torch.allclose(_layer_rope("gemma3-sliding")[1], _layer_rope("gemma3-full")[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keys_use_fp32_angles(dtype: torch.dtype) -> None:
    """Half keys, large deltas: angles computed in half precision would be off by radians."""
    rope, inv_freq, _ = _layer_rope("llama")
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 2, 33, 2 * inv_freq.shape[0], generator=gen).to(DEVICE)
    positions, delta = _positions_and_deltas(keys.shape[2], seed=3)
    cached = rope(keys, positions).to(dtype)
    expected = rope(keys, positions + delta)
    got = kt.rerotate(cached, delta, inv_freq)
    assert got.dtype == dtype
    err = (got.float() - expected).abs().max().item()
    assert err <= 3e-2 * expected.abs().max().item(), f"max abs error {err:.3g}"


def test_zero_delta_is_identity_and_deltas_compose() -> None:
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(1, 2, 11, 32, generator=gen).to(DEVICE)
    inv_freq = _inv_freq(16).to(DEVICE)
    zero = torch.zeros(11, dtype=torch.long, device=DEVICE)
    assert torch.allclose(kt.rerotate(keys, zero, inv_freq), keys, atol=1e-6)
    a = torch.randint(-50, 50, (11,), generator=gen).to(DEVICE)
    b = torch.randint(-50, 50, (11,), generator=gen).to(DEVICE)
    twice = kt.rerotate(kt.rerotate(keys, a, inv_freq), b, inv_freq)
    assert torch.allclose(twice, kt.rerotate(keys, a + b, inv_freq), atol=1e-4)


@pytest.mark.parametrize("fn", ["rerotate", "rerotate_reference"])
def test_bad_inputs_are_rejected(fn: str) -> None:
    rot = getattr(kt, fn)
    keys = torch.zeros(1, 2, 5, 16, device=DEVICE)
    delta = torch.zeros(5, dtype=torch.long, device=DEVICE)
    inv_freq = torch.ones(8, device=DEVICE)
    with pytest.raises(KernelInputError, match="even"):
        rot(torch.zeros(1, 2, 5, 15, device=DEVICE), delta, torch.ones(7, device=DEVICE))
    with pytest.raises(KernelInputError, match="delta"):
        rot(keys, delta[:4], inv_freq)
    with pytest.raises(KernelInputError, match="integer"):
        rot(keys, delta.float(), inv_freq)
    with pytest.raises(KernelInputError, match="inv_freq"):
        rot(keys, delta, inv_freq[:4])
    with pytest.raises(KernelInputError, match="4-dim"):
        rot(keys[0], delta, inv_freq)


def test_out_must_match_keys() -> None:
    keys = torch.zeros(1, 2, 5, 16, device=DEVICE)
    delta = torch.zeros(5, dtype=torch.long, device=DEVICE)
    with pytest.raises(KernelInputError, match="out must match"):
        kt.rerotate(keys, delta, torch.ones(8, device=DEVICE), out=keys.half())
