"""MiniCache merging: the merge math, bytes, save/load, composition with other ops, refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import RECORDS
from helpers import same, snapshot

import kvedit
from kvedit import ops
from kvedit.cache import LayerKV, MergedLayerKV, QuantizedLayerKV
from kvedit.compress import merge_layers, merge_plan, minicache, slerp
from kvedit.errors import InvalidInputError

TEXT = RECORDS * 3
SPAN = "Carol's secret number is 5902"
QUESTION = " Question: What is Carol's secret number?"


@pytest.fixture(scope="module")
def captured(llama):
    model, tok = llama
    return model, tok, kvedit.capture(model, tok, TEXT)


def dense_copy(state):
    """The state with every layer dense (what a merged layer rebuilds), for comparisons."""
    return state.replace(
        layers=[
            LayerKV(layer.keys, layer.values, layer.token_index, layer.positions, layer.bias)
            for layer in state.layers
        ]
    )


def hand_layer(keys: list[list[float]], values: list[list[float]]) -> LayerKV:
    """A one-batch, one-head layer ``[1, 1, n, 2]`` at positions ``0..n-1``."""
    k = torch.tensor(keys, dtype=torch.float32)[None, None]
    v = torch.tensor(values, dtype=torch.float32)[None, None]
    index = torch.arange(k.shape[-2])
    return LayerKV(k, v, index, index.clone())


# ------------------------------------------------------------------ the merge math


def test_slerp_on_the_unit_circle():
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    mid, angle = slerp(e1, e2, 0.5)
    torch.testing.assert_close(mid, torch.tensor([1.0, 1.0]) / math.sqrt(2))
    assert float(angle) == pytest.approx(math.pi / 2)
    third, _ = slerp(e1, e2, 1 / 3)  # a third of the arc: 30 degrees
    torch.testing.assert_close(third, torch.tensor([math.cos(math.pi / 6), 0.5]))
    same_dir, angle = slerp(e1, e1, 0.5)
    torch.testing.assert_close(same_dir, e1)
    opposite, _ = slerp(e1, -e1, 0.5)  # no unique arc: the first direction
    torch.testing.assert_close(opposite, e1)


def test_merge_keeps_norms_interpolates_directions_and_retains_exactly():
    # entries 0-3 are merged (residual 1); entry 2 points opposite ways in the two layers
    a = hand_layer(
        [[3, 0], [0, 2], [1, 1], [2, 0], [5, 5]], [[1, 0], [0, 1], [1, 0], [0, 2], [7, 7]]
    )
    b = hand_layer(
        [[0, 4], [0, 3], [-1, -1], [0, 1], [6, 6]], [[0, 2], [0, 5], [-1, 0], [2, 0], [8, 8]]
    )
    ma, mb = merge_layers(a, b, retain=0.25, residual=1)
    assert ma.shared is mb.shared and (ma.member, mb.member) == (0, 1)
    assert ma.n_merged == 4 and ma.shared.retained.tolist() == [2]  # the largest angle
    ka, kb, va, vb = ma.keys[0, 0], mb.keys[0, 0], ma.values[0, 0], mb.values[0, 0]
    diag = torch.tensor([1.0, 1.0]) / math.sqrt(2)
    torch.testing.assert_close(ka[0], 3 * diag)  # own norm, the slerped direction
    torch.testing.assert_close(kb[0], 4 * diag)
    torch.testing.assert_close(ka[1], torch.tensor([0.0, 2.0]))  # same direction: unchanged
    torch.testing.assert_close(kb[1], torch.tensor([0.0, 3.0]))
    torch.testing.assert_close(va[3], 2 * diag)
    torch.testing.assert_close(vb[3], 2 * diag)
    assert torch.equal(ka[2], a.keys[0, 0, 2]) and torch.equal(kb[2], b.keys[0, 0, 2])  # retained
    assert torch.equal(va[2], a.values[0, 0, 2]) and torch.equal(vb[2], b.values[0, 0, 2])
    assert torch.equal(ka[4], a.keys[0, 0, 4]) and torch.equal(vb[4], b.values[0, 0, 4])  # tail
    for merged, orig in ((ma, a), (mb, b)):  # norms kept on every merged entry
        torch.testing.assert_close(merged.keys.norm(dim=-1), orig.keys.norm(dim=-1))
        torch.testing.assert_close(merged.values.norm(dim=-1), orig.values.norm(dim=-1))
    # without retention entry 2 gets the first layer's direction (opposite: no arc)
    na, nb = merge_layers(a, b, retain=0.0, residual=1)
    torch.testing.assert_close(nb.keys[0, 0, 2], -b.keys[0, 0, 2])


def test_merge_refuses_layers_holding_different_entries():
    a = hand_layer([[1, 0], [0, 1], [1, 1]], [[1, 0], [0, 1], [1, 1]])
    moved = dataclasses.replace(a, positions=torch.tensor([0, 1, 5]))
    with pytest.raises(InvalidInputError, match="different entries"):
        merge_layers(a, moved, residual=1)
    with pytest.raises(InvalidInputError, match="sliding"):
        merge_layers(a, dataclasses.replace(a, window=4), residual=1)
    with pytest.raises(ValueError, match="retain"):
        merge_layers(a, a, retain=1.5)
    with pytest.raises(ValueError, match="bits"):
        merge_layers(a, a, bits=3)


# ------------------------------------------------------------------ on a model


def test_minicache_state_bytes_and_answers(captured):
    model, tok, state = captured
    before = snapshot(state)
    merged = minicache(state, start=0.0, retain=0.1)
    assert same(snapshot(state), before)  # the input is not modified
    assert merge_plan(state, 0.0) == [(0, 1)]  # three layers: one pair, one left over
    first, second, rest = merged.layers
    assert isinstance(first, MergedLayerKV) and first.shared is second.shared
    assert type(rest) is LayerKV
    # the pair stores one set of directions, plus each layer's norms, retained entries and tail
    b, h, n, d = state.layers[0].keys.shape
    m, r, f = n - 32, round(0.1 * (n - 32)), 4  # merged, retained entries; float32 bytes
    shared = 2 * b * h * m * d * f + 8 * r
    own = 2 * b * h * (m + r * d + (n - m) * d) * f
    pair_before = state.layers[0].nbytes + state.layers[1].nbytes
    pair_after = first.nbytes + second.nbytes
    assert pair_after == shared + 2 * own < 0.75 * pair_before
    assert merged.nbytes == pair_after + rest.nbytes
    # the last token was recomputed over the merged cache; everything runs
    assert len(merged.generate(QUESTION, 4)) > 0
    assert not torch.equal(merged.last_logits, state.last_logits)
    # everything retained: the merged layers hold exactly the original entries
    exact = minicache(state, start=0.0, retain=1.0)
    for layer, orig in zip(exact.layers, state.layers, strict=True):
        assert torch.equal(layer.keys[:, :, :-1], orig.keys[:, :, :-1])
    torch.testing.assert_close(exact.last_logits, state.last_logits, atol=1e-5, rtol=1e-5)
    assert minicache(state, start=1.0) is state  # nothing to merge


def test_minicache_save_load_round_trip(captured, tmp_path):
    model, tok, state = captured
    merged = minicache(state, start=0.0, retain=0.1)
    merged.save(tmp_path / "m.kv")
    state.save(tmp_path / "dense.kv")
    loaded = kvedit.load_state(tmp_path / "m.kv", model, tok)
    assert [type(x) for x in loaded.layers] == [type(x) for x in merged.layers]
    assert loaded.layers[0].shared is loaded.layers[1].shared  # one copy in memory too
    for layer, orig in zip(loaded.layers, merged.layers, strict=True):
        assert torch.equal(layer.keys, orig.keys) and torch.equal(layer.values, orig.values)
    assert loaded.nbytes == merged.nbytes
    assert torch.equal(loaded.logits(QUESTION), merged.logits(QUESTION))
    assert loaded.generate(QUESTION, 6) == merged.generate(QUESTION, 6)
    # the file holds the shared directions once
    saved, dense = (tmp_path / "m.kv").stat().st_size, (tmp_path / "dense.kv").stat().st_size
    assert dense - saved > 0.8 * (state.nbytes - merged.nbytes)
    q = minicache(state, start=0.0, bits=4)
    q.save(tmp_path / "q.kv")
    back = kvedit.load_state(tmp_path / "q.kv", model, tok)
    assert torch.equal(back.layers[1].keys, q.layers[1].keys)
    assert back.generate(QUESTION, 6) == q.generate(QUESTION, 6)


def test_loaded_pairs_share_only_identical_contents(captured, tmp_path):
    """Two files of one pair saved at different dtypes: loading the second while the first is
    alive gives the second its own directions (not the first's float16 ones)."""
    model, tok, state = captured
    merged = minicache(state, start=0.0, retain=0.1)
    merged.save(tmp_path / "half.kv", dtype=torch.float16)
    merged.save(tmp_path / "full.kv")
    half = kvedit.load_state(tmp_path / "half.kv", model, tok)
    full = kvedit.load_state(tmp_path / "full.kv", model, tok)
    assert half.layers[0].shared is not full.layers[0].shared
    assert torch.equal(full.layers[0].keys, merged.layers[0].keys)
    assert not torch.equal(half.layers[0].keys, merged.layers[0].keys)


def test_model_check_reads_merged_shapes_without_rebuilding(captured, monkeypatch):
    model, tok, state = captured
    merged = minicache(state, start=0.0, retain=0.1)
    assert merged.layers[0].value_shape == tuple(merged.layers[0].values.shape)

    def no_rebuild(self, which):
        raise AssertionError("rebuilt a merged layer to read its shape")

    monkeypatch.setattr(MergedLayerKV, "_rebuild", no_rebuild)
    kvedit.checks.state_fits_model(merged, model, tok)  # runs before every forward


def test_minicache_with_bits_keeps_earlier_merges(captured):
    model, tok, state = captured
    merged = minicache(state, start=0.0, retain=0.1)
    again = minicache(merged, start=0.0, bits=4)
    assert again.layers[0].shared is merged.layers[0].shared  # left as it was
    assert isinstance(again.layers[2], QuantizedLayerKV)  # the plain layer is quantized


def test_minicache_composes(captured):
    model, tok, state = captured
    merged = minicache(state, start=0.0, retain=0.1)
    # an edit after merging: the bias is per layer, the pair stays shared
    emph = ops.emphasize(merged, SPAN, 2.0)
    assert emph.layers[0].shared is merged.layers[0].shared
    assert emph.layers[0].bias is not None
    reference = ops.emphasize(dense_copy(merged), SPAN, 2.0)
    torch.testing.assert_close(emph.logits(QUESTION), reference.logits(QUESTION))
    # an edit of merged entries: the layer leaves the pair and holds the result exactly
    scaled = ops.scale_keys(merged, SPAN, 1.5)
    assert scaled.layers[0].shared is None
    e = state.token_indices(SPAN)
    ratio = scaled.layers[0].keys[:, :, e].norm() / merged.layers[0].keys[:, :, e].norm()
    assert ratio == pytest.approx(1.5, rel=1e-4)
    assert len(scaled.generate(QUESTION, 3)) > 0
    # quantization: merged with quantized directions, the other layers quantized
    q = minicache(state, start=0.0, retain=0.1, bits=4)
    assert q.layers[0].shared.bits == 4 and isinstance(q.layers[2], QuantizedLayerKV)
    assert q.nbytes < 0.5 * merged.nbytes
    err = (q.layers[0].keys - merged.layers[0].keys).abs().amax()
    assert 0 < err < 0.5 * merged.layers[0].keys.abs().amax()
    requantized = ops.quantize(merged, bits=8)  # other ops after merging work
    assert all(isinstance(x, QuantizedLayerKV) for x in requantized.layers)
    # extending appends to the exact tail; the merged part stays
    extended = merged.extend(QUESTION)
    assert extended.layers[1].shared is merged.layers[1].shared
    assert len(extended.layers[1]) == len(extended)
    assert extended.generate(" Answer:", 5) == merged.generate(QUESTION + " Answer:", 5)
    copy = merged.copy()
    assert copy.layers[0].shared is copy.layers[1].shared
    assert copy.layers[0].shared is not merged.layers[0].shared


def test_minicache_refuses_pairs_with_different_entries(captured):
    model, tok, state = captured
    layers = list(state.layers)
    keep = torch.arange(1, len(layers[1]))  # layer 1 without its first entry
    layers[1] = layers[1].select(keep)
    with pytest.raises(InvalidInputError, match="layers 0 and 1"):
        minicache(state.replace(layers=layers), start=0.0)


def test_minicache_leaves_gemma3_sliding_layers(gemma3):
    model, tok = gemma3
    state = kvedit.capture(model, tok, TEXT)
    windows = [layer.window for layer in state.layers]
    assert None in windows and any(w is not None for w in windows)
    assert merge_plan(state, 0.0) == []  # no two adjacent global layers
    assert minicache(state, start=0.0) is state
    # a global layer next to a sliding one is never paired with it
    with pytest.raises(InvalidInputError, match="sliding"):
        merge_layers(state.layers[1], state.layers[2])


def test_minicache_eval_method(llama):
    from kvedit.evals.methods import ExampleContext
    from kvedit.evals.methods.minicache import MiniCache
    from kvedit.evals.methods.registry import parse_spec
    from kvedit.evals.tasks import records_examples

    method = parse_spec("minicache:start=0.25:retain=0.1:bits=4")
    assert isinstance(method, MiniCache)
    assert (method.params.start, method.params.retain, method.params.bits) == (0.25, 0.1, 4)
    # predict answers from the merged and quantized cache, and notes the bytes it kept
    model, tok = llama
    example = records_examples(n_records=4, positions=(0,), trials=1, seed=0)[0]
    ctx = ExampleContext(model, tok, example, max_new_tokens=6)
    prediction = method.predict(ctx)
    merged = minicache(ctx.state, start=0.25, retain=0.1, bits=4)
    assert [layer.kind for layer in merged.layers] == ["quantized", "merged", "merged"]
    assert prediction == merged.generate(ctx.continuation, 6)
    assert ctx.notes["cache_bytes"] == merged.nbytes / ctx.state.nbytes < 0.7
    # the answer tells apart the full cache, quantization alone and merging alone
    for other in (ctx.state, ops.quantize(ctx.state, bits=4), minicache(ctx.state, 0.25, 0.1)):
        assert prediction != other.generate(ctx.continuation, 6)
    with pytest.raises(InvalidInputError, match="bits"):
        parse_spec("minicache:bits=3")
    with pytest.raises(InvalidInputError, match="retain"):
        parse_spec("minicache:retain=2")
