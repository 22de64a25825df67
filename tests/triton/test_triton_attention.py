"""The Triton attention kernel against its torch reference (and the reference against SDPA).

Without CUDA the kernels run in Triton's CPU interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``), which is slow: shapes stay tiny and examples few. With CUDA the same
tests run the compiled kernels, including real bf16/fp16 arithmetic.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvedit.triton as kt
from kvedit.triton import KernelInputError, attention_reference

pytestmark = pytest.mark.skipif(
    not kt.is_available(), reason="Triton missing, or neither CUDA nor TRITON_INTERPRET=1"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP32_TOL = 1e-4
HALF_TOL = 3e-2
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # interpreter
# On CUDA the time goes into compiling a kernel variant per dtype/head_dim/bias/tile mix.
MANY, FEW = (40, 15) if torch.cuda.is_available() else (100, 30)


def _impl():
    """The kernel module, for its test-only knobs (``num_splits``, ``config``)."""
    from kvedit.triton import _attention

    return _attention


@dataclass(frozen=True)
class Case:
    batch: int
    kv_heads: int
    group: int
    q_len: int
    k_len: int
    head_dim: int
    dtype: torch.dtype
    causal: bool = True
    window: int | None = None
    bias: str | None = None  # None, "kv" ([B, Hkv, Sk]) or "q" ([B, H, Sk])
    mask_value: float = float("-inf")  # what masked-out bias entries hold
    mask_fraction: float = 0.0
    scale: float | None = None
    seed: int = 0


def make_inputs(case: Case):
    """Random ``q, k, v, bias`` for ``case`` (bias in float32), on ``DEVICE``."""
    gen = torch.Generator().manual_seed(case.seed)
    H = case.kv_heads * case.group
    B, Sq, Sk, D = case.batch, case.q_len, case.k_len, case.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=case.dtype)

    q, k, v = randn(B, H, Sq, D), randn(B, case.kv_heads, Sk, D), randn(B, case.kv_heads, Sk, D)
    bias = None
    if case.bias is not None:
        heads = case.kv_heads if case.bias == "kv" else H
        bias = 2.0 * torch.randn(B, heads, Sk, generator=gen)
        hidden = torch.rand(B, heads, Sk, generator=gen) < case.mask_fraction
        bias = bias.masked_fill(hidden, case.mask_value).to(DEVICE)
    return q, k, v, bias


def check_against_reference(case: Case, out: torch.Tensor, q, k, v, bias) -> None:
    """``out`` must match the fp32 reference on the same (already rounded) inputs."""
    ref = attention_reference(
        q.float(),
        k.float(),
        v.float(),
        None if bias is None else bias.float(),
        causal=case.causal,
        window=case.window,
        scale=case.scale,
    )
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    assert out.device == q.device
    assert torch.isfinite(out).all(), "kernel produced NaN/inf"
    tol = FP32_TOL if q.dtype == torch.float32 else HALF_TOL
    err = (out.float() - ref).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol} for {case}"


def run_case(case: Case, **knobs) -> None:
    q, k, v, bias = make_inputs(case)
    if knobs:
        out = _impl().attention(
            q, k, v, bias, causal=case.causal, window=case.window, scale=case.scale, **knobs
        )
    else:
        out = kt.attention(q, k, v, bias, causal=case.causal, window=case.window, scale=case.scale)
    check_against_reference(case, out, q, k, v, bias)


@st.composite
def cases(draw, max_len: int = 70, max_q_len: int = 70) -> Case:
    k_len = draw(st.integers(1, max_len))
    # decode, full prefill, or a chunk of queries on top of a cache
    q_len = min(max_q_len, draw(st.sampled_from([1, k_len, draw(st.integers(1, k_len))])))
    causal = draw(st.booleans()) if q_len > 1 else draw(st.sampled_from([True, True, False]))
    bias = draw(st.sampled_from([None, "kv", "q"]))
    return Case(
        batch=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 3, 4])),
        q_len=q_len,
        k_len=k_len,
        head_dim=draw(st.sampled_from([16, 32, 64])),
        dtype=draw(st.sampled_from(DTYPES)),
        causal=causal,
        window=draw(st.one_of(st.none(), st.integers(1, k_len + 2))) if causal else None,
        bias=bias,
        mask_value=draw(st.sampled_from([float("-inf"), -1e30])),
        mask_fraction=draw(st.sampled_from([0.0, 0.3, 1.0])) if bias else 0.0,
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(SLOW, max_examples=MANY)
@given(
    case=cases(),
    tile=st.sampled_from([None, None, (16, 16), (64, 16), (16, 32)]),
)
def test_attention_matches_reference(case: Case, tile: tuple[int, int] | None) -> None:
    """``tile``: None for the public entry point, else (BLOCK_M, BLOCK_N) forced, so that even
    these short sequences span several key blocks (window edge, interior, diagonal, tail)."""
    if tile is None:
        run_case(case)
    else:
        run_case(case, config=_impl().KernelConfig(*tile))


@pytest.mark.parametrize(
    "q_len, k_len, window", [(1, 70, 40), (1, 70, 3), (5, 70, 33), (30, 64, 17), (64, 64, 64)]
)
def test_windows_with_unaligned_edges(q_len: int, k_len: int, window: int) -> None:
    """Window edges inside a key block, with whole unmasked blocks after them."""
    case = Case(1, 1, 4, q_len, k_len, 16, torch.float32, window=window, bias="kv", seed=q_len)
    run_case(case, config=_impl().KernelConfig(16, 16))


@settings(SLOW, max_examples=FEW)
@given(case=cases(max_q_len=8), splits=st.integers(2, 7), block_n=st.sampled_from([16, 32]))
def test_split_k_matches_reference(case: Case, splits: int, block_n: int) -> None:
    """Split-K (decode and short chunks on GPU), including splits that get no key block."""
    rows = case.q_len * case.group
    config = _impl().KernelConfig(block_m=16 if rows <= 16 else 32, block_n=block_n)
    run_case(case, num_splits=splits, config=config)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dim_256(dtype: torch.dtype) -> None:
    run_case(Case(1, 2, 2, 9, 21, 256, dtype, window=12, bias="q", mask_fraction=0.3, seed=1))


@pytest.mark.parametrize("head_dim", [40, 80])
def test_head_dim_not_a_power_of_two(head_dim: int) -> None:
    run_case(Case(1, 1, 3, 7, 19, head_dim, torch.float32, bias="kv", seed=head_dim))


@pytest.mark.parametrize("splits", [None, 3])
def test_rows_that_see_no_key_output_zero(splits: int | None) -> None:
    """A fully masked bias row and queries before the first key give 0, never NaN."""
    B, Hkv, G, Sq, Sk, D = 1, 2, 2, 6, 4, 16
    q, k, v, _ = make_inputs(Case(B, Hkv, G, Sq, Sk, D, torch.float32, seed=3))
    bias = torch.zeros(B, Hkv, Sk, device=DEVICE)
    bias[:, 1] = float("-inf")  # kv head 1 (query heads 2, 3): every key hidden
    knobs = {} if splits is None else {"num_splits": splits, "config": _impl().KernelConfig(16, 16)}
    out = _impl().attention(q, k, v, bias, causal=True, **knobs)
    assert torch.isfinite(out).all()
    assert (out[:, 2:] == 0).all()
    # Sq > Sk: query i sits at position Sk - Sq + i, so the first Sq - Sk queries see no key.
    assert (out[:, :2, : Sq - Sk] == 0).all()
    assert (out[:, :2, Sq - Sk :].abs().sum(-1) > 0).all()
    ref = attention_reference(q, k, v, bias)
    assert (out - ref).abs().max().item() <= FP32_TOL


def _sink_reference(q, k, v, bias, sinks, window=None):
    """Attention with a per-head sink logit, written out: softmax over [scores, sink]."""
    G = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
    scores = q.float() @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias.float().repeat_interleave(G, 1)[:, :, None]
    Sq, Sk = q.shape[2], k.shape[2]
    qi = torch.arange(Sk - Sq, Sk, device=q.device)[:, None]
    kj = torch.arange(Sk, device=q.device)[None]
    allowed = (kj <= qi) & ((qi - kj < window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return probs @ vf


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_sinks_match_the_written_out_softmax(splits: int | None, window: int | None) -> None:
    """gpt-oss sinks: a per-head logit in the denominator; split-K adds it exactly once."""
    q, k, v, _ = make_inputs(Case(1, 2, 2, 5, 11, 16, torch.float32, seed=7))
    bias = torch.randn(1, 2, 11, device=DEVICE)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], device=DEVICE)
    knobs = {} if splits is None else {"num_splits": splits, "config": _impl().KernelConfig(16, 16)}
    out = _impl().attention(q, k, v, bias, window=window, sinks=sinks, **knobs)
    expected = _sink_reference(q, k, v, bias, sinks, window)
    assert (out.float() - expected).abs().max().item() <= FP32_TOL
    ref = attention_reference(q, k, v, bias, window=window, sinks=sinks)
    assert (ref.float() - expected).abs().max().item() <= FP32_TOL
    plain = _impl().attention(q, k, v, bias, window=window, **knobs)
    assert (plain - out).abs().max().item() > 1e-2  # the sinks did take mass


@pytest.mark.parametrize("splits", [None, 2, 5])
def test_huge_finite_bias_on_every_key(splits: int | None) -> None:
    """Bias -1e30 on all keys: softmax is uniform over the visible keys, as in the reference
    (split-K must weigh splits by their key counts, which a log-sum-exp would round away)."""
    case = Case(1, 1, 2, 1, 37, 16, torch.float32, bias="kv", mask_value=-1e30, mask_fraction=1.0)
    knobs = {} if splits is None else {"num_splits": splits, "config": _impl().KernelConfig(16, 16)}
    run_case(case, **knobs)


def test_strided_inputs_and_expanded_bias() -> None:
    """Non-contiguous q/k/v ([B, S, H, D] storage) and a stride-0 broadcast bias."""
    gen = torch.Generator().manual_seed(7)
    B, H, Hkv, Sq, Sk, D = 2, 4, 2, 9, 23, 32
    q = torch.randn(B, Sq, H, D, generator=gen).to(DEVICE).transpose(1, 2)
    k = torch.randn(B, Sk, Hkv, D, generator=gen).to(DEVICE).transpose(1, 2)
    v = torch.randn(B, Sk, Hkv, D, generator=gen).to(DEVICE).transpose(1, 2)
    bias = torch.randn(B, 1, Sk, generator=gen).to(DEVICE).expand(B, Hkv, Sk)
    out = kt.attention(q, k, v, bias, window=10)
    ref = attention_reference(q, k, v, bias, window=10)
    assert (out - ref).abs().max().item() <= FP32_TOL


def test_bias_changes_the_output() -> None:
    """Guards against a kernel that ignores the bias (every test above would still compare)."""
    q, k, v, bias = make_inputs(Case(1, 2, 2, 5, 30, 16, torch.float32, bias="kv", seed=5))
    with_bias = kt.attention(q, k, v, bias)
    without = kt.attention(q, k, v)
    assert (with_bias - without).abs().max().item() > 0.1


def _sdpa_ground_truth(q, k, v, bias, causal, window, scale):
    """The same attention through torch SDPA with a dense float mask (tiny shapes only)."""
    from transformers.models.llama.modeling_llama import repeat_kv

    G = q.shape[1] // k.shape[1]
    Sq, Sk = q.shape[2], k.shape[2]
    mask = torch.zeros(q.shape[0], q.shape[1], Sq, Sk, dtype=torch.float32, device=q.device)
    if bias is not None:
        bias4 = bias[:, :, None, :]  # [B, Hkv|H, 1, Sk]
        mask = mask + (repeat_kv(bias4, G) if bias.shape[1] != q.shape[1] else bias4)
    if causal:
        pos = torch.arange(Sq, device=q.device)[:, None] + (Sk - Sq)
        keys = torch.arange(Sk, device=q.device)[None, :]
        visible = keys <= pos
        if window is not None:
            visible &= pos - keys < window
        mask = mask.masked_fill(~visible, float("-inf"))
    return F.scaled_dot_product_attention(
        q, repeat_kv(k, G), repeat_kv(v, G), attn_mask=mask, scale=scale
    )


@pytest.mark.parametrize(
    "case",
    [
        Case(2, 2, 3, 5, 17, 16, torch.float32, window=4, bias="kv", seed=11),
        Case(1, 1, 4, 17, 17, 16, torch.float32, bias="q", scale=0.3, seed=12),
        Case(1, 3, 1, 1, 40, 32, torch.float32, causal=False, bias="kv", seed=13),
    ],
    ids=["gqa3-window-kvbias", "gqa4-prefill-qbias-scale", "mha-decode-noncausal"],
)
def test_reference_matches_sdpa(case: Case) -> None:
    """The ground truth itself: bottom-right causal alignment, GQA grouping, window, bias."""
    q, k, v, bias = make_inputs(case)
    ref = attention_reference(
        q, k, v, bias, causal=case.causal, window=case.window, scale=case.scale, chunk_size=3
    )
    expected = _sdpa_ground_truth(q, k, v, bias, case.causal, case.window, case.scale)
    assert (ref - expected).abs().max().item() <= 1e-5


BAD_INPUTS = {
    "heads not divisible": (
        dict(q=(1, 6, 3, 16), k=(1, 4, 5, 16)),
        "divisible",
    ),
    "bias wrong heads": (
        dict(q=(1, 4, 3, 16), k=(1, 2, 5, 16), bias=(1, 3, 5)),
        "bias must be",
    ),
    "bias wrong length": (
        dict(q=(1, 4, 3, 16), k=(1, 2, 5, 16), bias=(1, 2, 4)),
        "bias must be",
    ),
    "bias 4-dim mask": (
        dict(q=(1, 4, 3, 16), k=(1, 2, 5, 16), bias=(1, 2, 3, 5)),
        "bias must be",
    ),
    "head dims differ": (dict(q=(1, 4, 3, 16), k=(1, 2, 5, 32)), "head_dim"),
    "batch differs": (dict(q=(2, 4, 3, 16), k=(1, 2, 5, 16)), "batch"),
    "head dim too big": (dict(q=(1, 1, 3, 512), k=(1, 1, 5, 512)), "head_dim"),
    "3-dim q": (dict(q=(4, 3, 16), k=(1, 2, 5, 16)), "4 dims"),
}


@pytest.mark.parametrize("fn", ["attention", "attention_reference"])
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_shapes_are_rejected(fn: str, name: str) -> None:
    shapes, message = BAD_INPUTS[name]
    q = torch.zeros(shapes["q"], device=DEVICE)
    k = torch.zeros(shapes["k"], device=DEVICE)
    bias = torch.zeros(shapes["bias"], device=DEVICE) if "bias" in shapes else None
    with pytest.raises(KernelInputError, match=message):
        getattr(kt, fn)(q, k, k, bias)


@pytest.mark.parametrize("fn", ["attention", "attention_reference"])
def test_bad_arguments_are_rejected(fn: str) -> None:
    attend = getattr(kt, fn)
    q, k = torch.zeros(1, 2, 3, 16, device=DEVICE), torch.zeros(1, 1, 5, 16, device=DEVICE)
    with pytest.raises(KernelInputError, match="causal=True"):
        attend(q, k, k, causal=False, window=4)
    with pytest.raises(KernelInputError, match="window"):
        attend(q, k, k, window=0)
    with pytest.raises(KernelInputError, match="share a dtype"):
        attend(q, k.half(), k.half())
    with pytest.raises(KernelInputError, match="floating"):
        attend(q, k, k, torch.zeros(1, 1, 5, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError):  # KernelInputError is a ValueError too
        attend(q.int(), k.int(), k.int())


def test_empty_inputs() -> None:
    q, k = torch.randn(1, 2, 3, 16, device=DEVICE), torch.randn(1, 1, 0, 16, device=DEVICE)
    assert (kt.attention(q, k, k) == 0).all()
    empty_q = torch.randn(1, 2, 0, 16, device=DEVICE)
    assert kt.attention(empty_q, q[:, :1], q[:, :1]).shape == (1, 2, 0, 16)


def test_missing_triton_is_explained() -> None:
    """With Triton unimportable the package still imports; the kernels say how to install it."""
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kvedit.triton as kt\n"
        "assert not kt.is_available()\n"
        "q = torch.randn(1, 2, 3, 16)\n"
        "assert kt.attention_reference(q, q, q).shape == q.shape\n"
        "for call in (lambda: kt.attention(q, q, q),\n"
        "             lambda: kt.rerotate(q, torch.zeros(3, dtype=torch.long), torch.ones(8))):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as error:\n"
        "        assert 'pip install triton' in str(error), error\n"
        "    else:\n"
        "        raise AssertionError('no ImportError')\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
