"""Headwise cache layers: each KV head holds its own entries (kvedit.cache.headwise)."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit.cache import HeadwiseLayerKV, LayerKV, is_headwise, keep_per_head
from kvedit.compress.masking import masked_union
from kvedit.states.capturing import extend_ids

TEXT = " ".join(f"Person{i}'s code is {1000 + 37 * i}." for i in range(6))


def _kept(layer, seed: int) -> torch.Tensor:
    """A random per-head selection ``[kv_heads, n]`` (the last entry kept by every head)."""
    g = torch.Generator().manual_seed(seed)
    heads, n = layer.kv_shape[1], len(layer)
    kept = torch.rand(heads, n, generator=g) < 0.4
    kept[:, -1] = True
    return kept


def _both(state):
    """The state with its global layers cut per head, as headwise layers and as the masked
    union kvedit.compress keeps (the reference: the same entries, masked by bias)."""
    heads, union = list(state.layers), list(state.layers)
    for i in state.global_layers:
        kept = _kept(state.layers[i], i)
        heads[i] = keep_per_head(state.layers[i], kept)
        union[i] = masked_union(state.layers[i], kept[None])
    return state.replace(layers=heads), state.replace(layers=union)


def test_a_head_keeps_its_own_entries_right_aligned(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    layer = state.layers[0]
    assert layer.kv_shape[1] == 2
    kept = _kept(layer, 0)
    held = keep_per_head(layer, kept)
    assert is_headwise(held)
    counts = kept.sum(dim=1)
    assert len(held) == int(counts.max())
    for h in range(2):
        row = held.head_index[h]
        assert row[row >= 0].tolist() == kept[h].nonzero().flatten().tolist()
        assert bool((row[: len(held) - int(counts[h])] == -1).all())  # padding on the left
        want = layer.keys[0, h, kept[h]]
        torch.testing.assert_close(held.keys[0, h, len(held) - int(counts[h]) :], want)
    assert int(held.token_index[-1]) == len(state) - 1  # the last input: the same on each head
    assert held.nbytes < layer.nbytes
    same = keep_per_head(layer, kept[:1].expand(2, -1))
    assert type(same) is LayerKV and same.bias is None  # every head the same: a plain layer


def test_attention_is_exact_per_head(llama):
    """Headwise layers answer as the masked union of the same per-head entries."""
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    heads, union = _both(state)
    assert heads.nbytes < union.nbytes
    ids = tok(" Person3's code is", add_special_tokens=False)["input_ids"]
    offsets = torch.zeros(len(ids), 2, dtype=torch.long)
    a = extend_ids(heads, ids, offsets, state.text)
    b = extend_ids(union, ids, offsets, state.text)
    torch.testing.assert_close(a.last_logits, b.last_logits, rtol=1e-4, atol=1e-4)
    assert a.generate("", max_new_tokens=6) == b.generate("", max_new_tokens=6)
    grown = a.layers[0]
    assert is_headwise(grown)  # appended entries: the same tokens after every head's own
    assert grown.token_index[-len(ids) :].tolist() == list(range(len(state), len(a)))


def test_saved_and_loaded(llama, tmp_path):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    heads, _ = _both(state)
    heads.save(tmp_path / "h.kv")
    back = kvedit.load_state(tmp_path / "h.kv", model, tok)
    for a, b in zip(heads.layers, back.layers, strict=True):
        assert type(a) is type(b)
        torch.testing.assert_close(a.keys, b.keys)
        if is_headwise(a):
            assert torch.equal(a.head_index, b.head_index)
    torch.testing.assert_close(back.last_logits, heads.last_logits)


def test_select_keeps_each_heads_slots(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    held = keep_per_head(state.layers[0], _kept(state.layers[0], 3))
    part = held.select(torch.arange(1, len(held)))
    assert isinstance(part, HeadwiseLayerKV)
    assert torch.equal(part.head_index, held.head_index[:, 1:])
    with pytest.raises(ValueError, match="window"):
        HeadwiseLayerKV(
            keys=held.keys,
            values=held.values,
            token_index=held.token_index,
            positions=held.positions,
            window=4,
            head_index=held.head_index,
            head_positions=held.head_positions,
        )


def test_what_maps_entries_to_tokens_refuses_a_headwise_state(llama):
    """An edit, focus, a selection, quantizing, merging and vLLM's stock kernel would reach only
    the slots every head shares: each refuses before any work."""
    from kvedit import ops
    from kvedit.compress import minicache, quantize, select
    from kvedit.errors import InvalidInputError
    from kvedit.integrations.vllm.stock import to_stock

    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    heads, _ = _both(state)
    calls = {
        "emphasize": lambda: ops.emphasize(heads, "Person2", strength=2.0),
        "focus": lambda: kvedit.focus(heads, "What is Person2's code?"),
        "select": lambda: select(heads, "knorm", 0.5),
        "quantize": lambda: quantize(heads, 4),
        "minicache": lambda: minicache(heads),
        "stock": lambda: to_stock(heads),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidInputError, match="per head"):
            call()
        assert name
