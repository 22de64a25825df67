"""The kvedit attention: ``attend`` against a naive fp64 softmax, and whole models against sdpa.

``attend`` masks causally aligned bottom-right (query ``i`` of ``Sq`` sits at absolute index
``Sk - Sq + i``), applies a sliding window, a padding mask and a per-key bias from query
``unbiased_queries`` on. The reference below spells each of these out on an explicit
``[B, H, Sq, Sk]`` logit matrix in float64.
"""

from __future__ import annotations

import pytest
import torch

import kvedit
import kvedit.attention as ka

FP32_TOL = 1e-5


# ------------------------------------------------------------------------------------ reference


def reference_attention(
    q, k, v, *, scale=None, bias=None, unbiased_queries=0, padding=None, window=None, softcap=None
):
    """Naive float64 attention. Returns ``(out [B,H,Sq,D], probs [B,H,Sq,Sk], live [B,H,Sq])``.

    ``live`` marks queries that see at least one key; the others have no defined output.
    """
    q, k, v = q.double(), k.double(), v.double()
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = H // Hkv
    k = k.repeat_interleave(G, dim=1)  # query head h reads kv head h // G
    v = v.repeat_interleave(G, dim=1)
    scale = D**-0.5 if scale is None else scale
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if bias is not None:
        b = bias.double()
        b = b.repeat_interleave(H // b.shape[1], dim=1)  # [B, H, Sk]
        biased_rows = (torch.arange(Sq) >= unbiased_queries).double()  # [Sq]
        logits = logits + b[:, :, None, :] * biased_rows[None, None, :, None]
    q_abs = torch.arange(Sk - Sq, Sk)[:, None]
    key = torch.arange(Sk)[None, :]
    visible = key <= q_abs
    if window is not None:
        visible = visible & (q_abs - key < window)
    visible = visible[None, None].expand(B, H, Sq, Sk)
    if padding is not None:
        visible = visible & padding[:, None, None, :]
    logits = logits.masked_fill(~visible, float("-inf"))
    live = visible.any(-1)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return probs @ v, probs, live


def make_inputs(*, B=2, Hkv=2, G=2, Sq=5, Sk=9, D=8, bias=None, padded=False, seed=0):
    """Random fp32 ``q, k, v``, an optional bias (``"kv"``: per KV head, ``"q"``: per query head)
    and an optional padding mask (row 1 left-padded by 3, row 0 with a hole)."""
    gen = torch.Generator().manual_seed(seed)
    H = Hkv * G
    q = torch.randn(B, H, Sq, D, generator=gen)
    k = torch.randn(B, Hkv, Sk, D, generator=gen)
    v = torch.randn(B, Hkv, Sk, D, generator=gen)
    b = None
    if bias is not None:
        b = 2.0 * torch.randn(B, Hkv if bias == "kv" else H, Sk, generator=gen)
    padding = None
    if padded:
        padding = torch.ones(B, Sk, dtype=torch.bool)
        padding[-1, :3] = False  # left padding
        padding[0, 2] = False  # a hole
    return q, k, v, b, padding


def assert_live_close(out, ref, live, atol=FP32_TOL):
    """``out`` equals ``ref`` on every query that sees at least one key."""
    assert live.any()
    torch.testing.assert_close(out.double()[live], ref[live], atol=atol, rtol=atol)


# ------------------------------------------------------------------------ attend vs reference


SHAPES = [(7, 7), (3, 11), (1, 9)]  # (Sq, Sk): prefill, a continuation over a cache, decode


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("sq_sk", SHAPES, ids=[f"sq{a}-sk{b}" for a, b in SHAPES])
@pytest.mark.parametrize("bias", [None, "kv", "q"])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_attend_matches_naive_reference(group, sq_sk, bias, window, padded):
    Sq, Sk = sq_sk
    q, k, v, b, padding = make_inputs(G=group, Sq=Sq, Sk=Sk, bias=bias, padded=padded)
    for unbiased in sorted({0, min(2, Sq)}):
        kwargs = dict(bias=b, unbiased_queries=unbiased, padding=padding, window=window)
        out = ka.attend(q, k, v, **kwargs)
        ref, _, live = reference_attention(q, k, v, **kwargs)
        assert out.shape == q.shape
        assert_live_close(out, ref, live)


@pytest.mark.parametrize("sq_sk", SHAPES, ids=[f"sq{a}-sk{b}" for a, b in SHAPES])
def test_attend_with_softcap_and_explicit_scale(sq_sk):
    Sq, Sk = sq_sk
    q, k, v, b, padding = make_inputs(G=2, Sq=Sq, Sk=Sk, bias="kv", padded=True, seed=3)
    q = 4 * q  # large logits, so the cap bites
    kwargs = dict(scale=0.3, softcap=5.0, bias=b, padding=padding, window=6)
    out = ka.attend(q, k, v, **kwargs)
    ref, _, live = reference_attention(q, k, v, **kwargs)
    assert_live_close(out, ref, live)
    uncapped, _, _ = reference_attention(q, k, v, **{**kwargs, "softcap": None})
    assert not torch.allclose(ref[live], uncapped[live], atol=1e-3)  # the cap matters here


def test_unbiased_queries_split_the_queries_exactly():
    q, k, v, b, _ = make_inputs(G=2, Sq=6, Sk=10, bias="q", seed=1)
    biased = ka.attend(q, k, v, bias=b)
    plain = ka.attend(q, k, v)
    split = ka.attend(q, k, v, bias=b, unbiased_queries=4)
    torch.testing.assert_close(split[:, :, :4], plain[:, :, :4], atol=FP32_TOL, rtol=0)
    torch.testing.assert_close(split[:, :, 4:], biased[:, :, 4:], atol=FP32_TOL, rtol=0)
    assert not torch.allclose(biased[:, :, :4], plain[:, :, :4], atol=1e-3)


def test_chunked_path_runs_several_chunks_and_matches_reference(monkeypatch):
    B, Hkv, G, Sq, Sk = 2, 2, 3, 11, 17
    q, k, v, b, padding = make_inputs(B=B, Hkv=Hkv, G=G, Sq=Sq, Sk=Sk, bias="kv", padded=True)
    chunks = []
    real_chunk_mask = ka._chunk_mask

    def counting_chunk_mask(a, b_, *args):
        chunks.append((a, b_))
        return real_chunk_mask(a, b_, *args)

    # two query rows per chunk: MASK_CHUNK_BYTES // (B * H * Sk * 4 bytes) == 2
    monkeypatch.setattr(ka, "MASK_CHUNK_BYTES", 2 * B * Hkv * G * Sk * 4)
    monkeypatch.setattr(ka, "_chunk_mask", counting_chunk_mask)
    for window in (None, 5):
        chunks.clear()
        kwargs = dict(bias=b, unbiased_queries=3, padding=padding, window=window)
        out = ka.attend(q, k, v, **kwargs)
        ref, _, live = reference_attention(q, k, v, **kwargs)
        assert_live_close(out, ref, live)
        # queries [0, 3) unbiased and [3, 11) biased, two rows at a time
        assert chunks == [(0, 2), (2, 3), (3, 5), (5, 7), (7, 9), (9, 11)]


def test_attend_rejects_bad_head_counts():
    q, k, v, _, _ = make_inputs(Hkv=2, G=2)
    with pytest.raises(kvedit.errors.KVEditError, match="multiple"):
        ka.attend(q[:, :3], k, v)
    with pytest.raises(kvedit.errors.KVEditError, match="heads"):
        ka.attend(q, k, v, bias=torch.zeros(2, 3, k.shape[2]), padding=torch.ones(2, 9).bool())


# ---------------------------------------------------------------------------- attention_probs


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("bias", [None, "kv", "q"])
def test_attention_probs_times_values_is_the_attend_output(group, bias):
    q, k, v, b, padding = make_inputs(G=group, Sq=4, Sk=12, bias=bias, padded=True, seed=2)
    kwargs = dict(bias=b, unbiased_queries=1, padding=padding, window=7)
    probs = ka.attention_probs(q, k, **kwargs)
    out = ka.attend(q, k, v, **kwargs)
    ref_out, ref_probs, live = reference_attention(q, k, v, **kwargs)
    assert probs.shape == (2, 2 * group, 4, 12) and probs.dtype == torch.float32
    via_probs = probs @ v.repeat_interleave(group, dim=1)
    torch.testing.assert_close(via_probs[live], out[live], atol=FP32_TOL, rtol=FP32_TOL)
    # attend_probs groups the query heads onto their KV head as attend does
    grouped = ka.attend_probs(probs, v)
    assert grouped.shape == out.shape and grouped.dtype == v.dtype
    torch.testing.assert_close(grouped[live], out[live], atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(probs.double()[live], ref_probs[live], atol=FP32_TOL, rtol=0)
    torch.testing.assert_close(probs.sum(-1)[live], torch.ones_like(probs.sum(-1)[live]))
