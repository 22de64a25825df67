"""Packed caches at run time: quantized and merged states attend layer by layer, without the
whole dense cache, and answer exactly as the dense copy of the same entries does."""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import RECORDS

import kvedit
from kvedit import ops
from kvedit.cache import LayerKV, MergedLayerKV, QuantizedLayerKV
from kvedit.cache.adapter import PackedCacheLayer, dynamic_cache
from kvedit.compress import minicache

TEXT = RECORDS * 3
SPAN = "Carol's secret number is 5902"
QUESTION = " Question: What is Carol's secret number?"


@pytest.fixture(scope="module")
def states(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    return {
        "dense": state,
        "quantized": ops.quantize(state, bits=4),
        "merged": minicache(state, start=0.0, retain=0.1),
        "merged+4bit": minicache(state, start=0.0, retain=0.1, bits=4),
    }


def dense_copy(state):
    """The same entries held dense: what the dequantize-everything path attended to."""
    return state.replace(
        layers=[
            LayerKV(layer.keys, layer.values, layer.token_index, layer.positions, layer.bias)
            for layer in state.layers
        ]
    )


@pytest.mark.parametrize("kind", ["quantized", "merged", "merged+4bit"])
def test_packed_path_equals_dense_path(states, kind):
    packed = states[kind]
    kinds = [type(layer) for layer in packed.layers]
    assert any(layer.packed for layer in packed.layers)
    reference = dense_copy(packed)
    assert torch.equal(packed.logits(QUESTION), reference.logits(QUESTION))
    assert packed.answer(QUESTION, 8) == reference.answer(QUESTION, 8)
    extended, ref_extended = packed.extend(QUESTION), reference.extend(QUESTION)
    assert [type(x) for x in extended.layers] == kinds  # new tokens: the exact part grows
    assert torch.equal(extended.last_logits, ref_extended.last_logits)
    for layer, ref in zip(extended.layers, ref_extended.layers, strict=True):
        assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
    # an edit (its last-token recomputation runs over the packed cache)
    emph = ops.emphasize(packed, SPAN, 2.0)
    ref_emph = ops.emphasize(reference, SPAN, 2.0)
    assert torch.equal(emph.last_logits, ref_emph.last_logits)
    assert emph.generate(QUESTION, 6) == ref_emph.generate(QUESTION, 6)


def test_dense_states_keep_the_plain_cache(states):
    state = states["dense"]
    cache = dynamic_cache(state.layers)
    assert not any(isinstance(layer, PackedCacheLayer) for layer in cache.layers)
    assert all(c.keys is layer.keys for c, layer in zip(cache.layers, state.layers, strict=True))


@pytest.mark.parametrize("kind", ["quantized", "merged"])
def test_one_layer_dense_at_a_time(states, kind, monkeypatch):
    """Every expansion a forward makes is freed before the next layer expands its own."""
    packed = states[kind]
    cls = QuantizedLayerKV if kind == "quantized" else MergedLayerKV
    original = cls.dense_kv
    live: list[weakref.ref] = []
    most = [0]
    calls = [0]

    def tracked(self, new_keys=None, new_values=None):
        alive = [r for r in live if r() is not None]
        most[0] = max(most[0], len(alive))
        calls[0] += 1
        out = original(self, new_keys, new_values)
        live.extend(weakref.ref(t) for t in out)
        return out

    monkeypatch.setattr(cls, "dense_kv", tracked)
    n_new = 5
    packed.generate(QUESTION, n_new)
    # one forward over the question, then one per new token but the last; each packed layer
    # expanded once per forward, and no expansion alive when the next one starts
    forwards = 1 + (n_new - 1)
    assert calls[0] == forwards * sum(type(layer) is cls for layer in packed.layers)
    assert most[0] == 0
    assert not any(r() is not None for r in live)


def test_packed_cache_layer_reads_and_assignments(states):
    packed = states["quantized"]
    layer = packed.layers[0]
    cache = dynamic_cache(packed.layers)
    cl = cache.layers[0]
    assert isinstance(cl, PackedCacheLayer) and cl.packed_source is layer
    assert cl.get_seq_length() == len(layer) and cache.get_seq_length() == len(layer)
    assert torch.equal(cl.keys, layer.keys)  # reading expands
    new_k = torch.randn(1, layer.keys.shape[1], 2, layer.keys.shape[-1])
    full_k, full_v = cl.update(new_k, new_k.clone())
    assert torch.equal(full_k[:, :, -2:], new_k) and cl.get_seq_length() == len(layer) + 2
    assert cl.new_keys.shape[-2] == 2  # the layer keeps only the new entries
    cl.keys = full_k[:, :, :-1]  # an assignment (a crop) turns it into a plain dense layer
    assert cl.packed_source is None and torch.equal(cl.values, full_v)
    assert cl.get_seq_length() == len(layer) + 1


@pytest.mark.parametrize("kind", ["quantized", "merged", "merged+4bit"])
def test_file_size_is_the_packed_size(states, kind, tmp_path):
    dense, packed = states["dense"], states[kind]
    dense.save(tmp_path / "d.kv")
    packed.save(tmp_path / "p.kv")
    d, p = (tmp_path / "d.kv").stat().st_size, (tmp_path / "p.kv").stat().st_size
    overhead = d - dense.nbytes  # bookkeeping tensors (token ids, logits...) and the header
    assert abs((p - packed.nbytes) - overhead) < 4096  # the header names more tensors
    assert packed.nbytes < 0.85 * dense.nbytes
