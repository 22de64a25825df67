"""Compression ops: SnapKV (per-head selection as a masked union) and KIVI-style quantization."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import RECORDS
from helpers import check_halved_globals, same, same_layer_but_last, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

import kvedit
from kvedit import ops
from kvedit.cache import QuantizedLayerKV
from kvedit.cache.packed import PackedKV, pack_codes, unpack_codes
from kvedit.compress import DROPPED
from kvedit.testing import tiny_model

TEXT = RECORDS * 3
SPAN = "Carol's secret number is 5902"
QUESTION = " Question: What is Carol's secret number?"


@pytest.fixture(scope="module")
def llama():
    model, tok = tiny_model("llama")
    return model, tok, kvedit.capture(model, tok, TEXT)


def kept_per_head(layer) -> torch.Tensor:
    """``[batch, kv_heads, n]`` bool: entries a head still attends to."""
    return layer.dense_bias() > DROPPED / 2


# ------------------------------------------------------------------ SnapKV


@pytest.mark.parametrize("query", [None, QUESTION])
def test_snapkv_keeps_a_budget_per_head(llama, query):
    model, tok, state = llama
    before = snapshot(state)
    out = ops.snapkv(state, keep=0.25, query=query, window=8)
    assert same(snapshot(state), before)  # the input is untouched
    n = len(state)
    for layer, orig in zip(out.layers, state.layers, strict=True):
        kept = kept_per_head(layer)
        assert (kept.sum(-1) == round(0.25 * n)).all()  # each head keeps exactly its budget
        assert kept.any(dim=1).all()  # every physically kept entry serves some head
        assert len(layer) < n and torch.equal(layer.token_index, layer.token_index.sort().values)
        e = torch.isin(orig.token_index, layer.token_index) & (orig.token_index < n - 1)
        mine = layer.token_index < n - 1  # the last token is recomputed over the kept entries
        torch.testing.assert_close(layer.keys[:, :, mine], orig.keys[:, :, e])
        last = layer.token_index >= n - 8
        assert last.sum() == 8 and kept[..., last].all()  # the recent window, for every head
    assert out.nbytes < state.nbytes


def test_snapkv_masks_per_head(llama):
    """An entry a head dropped has no effect on that head: garbage there changes nothing."""
    model, tok, state = llama
    out = ops.snapkv(state, keep=0.3, query=QUESTION)
    spoiled = []
    for layer in out.layers:
        dropped = ~kept_per_head(layer)  # [1, kv_heads, m]
        assert dropped.any(), "heads should disagree on a random model"
        values = layer.values.clone()
        values[dropped] = 1e4
        spoiled.append(layer.__class__(**{**layer.__dict__, "values": values}))
    torch.testing.assert_close(
        out.replace(layers=spoiled).logits(QUESTION), out.logits(QUESTION), atol=1e-4, rtol=1e-4
    )


def test_snapkv_keeps_what_the_question_attends_to(llama):
    """Make the question attend to one span (a large stored bias): every head keeps it."""
    model, tok, state = llama
    focused = ops.emphasize(state, SPAN, 12.0)
    out = ops.snapkv(focused, keep=0.2, query=QUESTION, window=4, kernel=1)
    span_tokens = state.token_indices(SPAN)
    for layer in out.layers:
        e = torch.isin(layer.token_index, span_tokens)
        assert e.sum() == len(span_tokens) and kept_per_head(layer)[..., e].all()


def test_snapkv_memory_real_vs_nominal(llama):
    _, _, state = llama
    out = ops.snapkv(state, keep=0.5, query=QUESTION)
    union = sum(len(layer) for layer in out.layers) / sum(len(layer) for layer in state.layers)
    assert 0.5 <= union < 1.0  # heads disagree: the union is more than the nominal half
    assert out.nbytes == pytest.approx(state.nbytes * union, rel=0.05)  # + the mask bias


def test_snapkv_gemma3_keeps_sliding_layers():
    model, tok = tiny_model("gemma3")
    state = kvedit.capture(model, tok, TEXT)
    out = ops.snapkv(state, keep=0.5)
    check_halved_globals(out, state)


def test_snapkv_arguments(llama):
    _, _, state = llama
    assert ops.snapkv(state, keep=1.0) is state
    for kwargs in ({"keep": 0}, {"keep": 1.5}, {"kernel": 4}, {"window": 0}):
        with pytest.raises(ValueError):
            ops.snapkv(state, **kwargs)
    with pytest.raises(ValueError, match="query"):
        ops.snapkv(state, query="")


# ------------------------------------------------------------------ quantize


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), n=st.integers(1, 9), seed=st.integers(0, 1000))
def test_pack_unpack_round_trip(bits, n, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (1, 2, n, 16), generator=gen, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] == 16 * bits // 8
    assert torch.equal(unpack_codes(packed, bits, 16), codes)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantization_error_is_within_half_a_step(bits):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 100, 16, generator=gen) * torch.linspace(0.1, 10, 16)  # outlier channels
    keys = PackedKV.quantize(x, bits, 32, 64, "channel")
    values = PackedKV.quantize(x, bits, 8, 64, "token")
    assert keys.scale.shape == (1, 2, 2, 1, 16) and values.scale.shape == (1, 2, 64, 2, 1)
    for packed in (keys, values):
        out = packed.dequantize()
        assert torch.equal(out[:, :, 64:], x[:, :, 64:])  # the residual is exact
        step = packed.scale.float().amax()
        assert (out[:, :, :64] - x[:, :, :64]).abs().amax() <= step / 2 + 0.02
    # per-channel keys follow channel ranges: the small channel's error stays small
    small = (keys.dequantize() - x)[..., 0].abs().amax()
    assert small <= 0.1 * 2 * 4 / (2**bits - 1)


def packed_bytes(layer, bits: int, group: int, residual: int = 32) -> int:
    """Bytes of one dense layer quantized KIVI-style, from its shape alone: codes, float16
    scale and zero per key channel and group of tokens, per token and group of value channels,
    and the exact residual."""
    b, h, n, d = layer.keys.shape
    n_quant = (max(0, n - residual) // group) * group
    exact = n - n_quant
    codes = 2 * b * h * n_quant * d * bits // 8
    key_meta = 2 * b * h * (n_quant // group) * d * 2
    value_meta = 2 * b * h * n_quant * (d // min(group, d)) * 2
    dense = 2 * b * h * exact * d * layer.keys.element_size()
    bias = 0 if layer.bias is None else layer.bias.numel() * layer.bias.element_size()
    return codes + key_meta + value_meta + dense + bias


def test_quantize_state(llama):
    model, tok, state = llama
    before = snapshot(state)
    q8, q4 = ops.quantize(state, bits=8), ops.quantize(state, bits=4)
    assert same(snapshot(state), before)
    assert all(isinstance(layer, QuantizedLayerKV) for layer in q8.layers)
    n = len(state)
    exact = q8.layers[0].packed_keys.residual.shape[-2]
    assert 32 <= exact < 64 and (n - exact) % 32 == 0
    for bits, q in ((8, q8), (4, q4)):  # nbytes counts exactly what the packed layers hold
        assert q.nbytes == sum(packed_bytes(layer, bits, 32) for layer in state.layers)
        assert q.nbytes < state.nbytes
    for layer, orig in zip(q8.layers, state.layers, strict=True):
        assert len(layer) == n and torch.equal(layer.token_index, orig.token_index)
        torch.testing.assert_close(layer.keys, orig.keys, atol=0.05, rtol=0)
        assert torch.equal(layer.values[:, :, -exact:-1], orig.values[:, :, -exact:-1])
    torch.testing.assert_close(q8.logits(QUESTION), state.logits(QUESTION), atol=0.15, rtol=0)
    assert q8.generate(QUESTION, 12) == state.generate(QUESTION, 12)
    err8 = (q8.logits(QUESTION) - state.logits(QUESTION)).abs().mean()
    err4 = (q4.logits(QUESTION) - state.logits(QUESTION)).abs().mean()
    assert err8 < err4
    with pytest.raises(ValueError, match="bits"):
        ops.quantize(state, bits=3)
    with pytest.raises(ValueError, match="group"):
        ops.quantize(state, group=12)


def test_quantized_states_compose(llama):
    model, tok, state = llama
    q = ops.quantize(state, bits=4)
    extended = q.extend(QUESTION)
    layer, orig = extended.layers[0], q.layers[0]
    assert isinstance(layer, QuantizedLayerKV)
    assert torch.equal(layer.packed_keys.codes, orig.packed_keys.codes)  # the packed part stays
    assert len(layer) == len(extended) and extended.nbytes > q.nbytes
    assert extended.generate(" Answer:", 6) == q.generate(QUESTION + " Answer:", 6)
    emphasized = ops.emphasize(q, SPAN, 2.0)
    assert isinstance(emphasized.layers[0], QuantizedLayerKV)
    assert emphasized.layers[0].packed_keys.codes is q.layers[0].packed_keys.codes  # no requant
    scaled = ops.scale_keys(q, SPAN, 1.5)
    e = state.token_indices(SPAN)
    ratio = scaled.layers[0].keys[:, :, e].norm() / q.layers[0].keys[:, :, e].norm()
    assert ratio == pytest.approx(1.5, rel=0.03)  # scaled, then quantized again
    duplicated = ops.duplicate(q, SPAN, 1)
    assert len(duplicated.layers[0]) == len(q.layers[0]) + len(e)
    # composed: one copy on the quantized layers is a log 2 bias on the same dequantized keys
    emph2 = ops.emphasize(q, SPAN, math.log(2))
    torch.testing.assert_close(
        duplicated.logits(QUESTION), emph2.logits(QUESTION), atol=1e-4, rtol=1e-4
    )
    copy = q.copy()
    assert copy.layers[0].packed_keys.codes.data_ptr() != q.layers[0].packed_keys.codes.data_ptr()
    assert copy.generate(QUESTION, 6) == q.generate(QUESTION, 6)


def test_quantize_gemma3_leaves_sliding_layers(tmp_path):
    model, tok = tiny_model("gemma3")
    state = kvedit.capture(model, tok, TEXT)
    q = ops.quantize(state, bits=8)
    for layer, orig in zip(q.layers, state.layers, strict=True):
        if orig.window is not None:
            assert same_layer_but_last(layer, orig, len(state) - 1)
        else:
            assert isinstance(layer, QuantizedLayerKV)
    q.save(tmp_path / "q.kv")  # saved packed, loads packed
    state.save(tmp_path / "dense.kv")
    loaded = kvedit.load_state(tmp_path / "q.kv", model, tok)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in q.layers]
    assert torch.equal(loaded.layers[2].packed_keys.codes, q.layers[2].packed_keys.codes)
    torch.testing.assert_close(loaded.layers[2].keys, q.layers[2].keys, atol=0, rtol=0)
    assert loaded.generate(QUESTION, 6) == q.generate(QUESTION, 6)
    # the file holds the packed bytes: the global layer's keys/values shrink about 4x at 8 bits
    saved = (tmp_path / "q.kv").stat().st_size
    dense = (tmp_path / "dense.kv").stat().st_size
    g = state.layers[2]
    kv_bytes = 2 * g.keys.numel() * g.keys.element_size()
    assert dense - saved > 0.5 * kv_bytes


# ------------------------------------------------------------------ eval methods
