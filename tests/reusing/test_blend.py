"""Blending separately cached parts: RoPE moves, selective recompute, reports, the eval method."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import reference_generate

import kvedit
from kvedit.errors import UnsupportedModelError
from kvedit.reusing.blend_selection import deviation as blend_deviation
from kvedit.reusing.blend_selection import true_kv
from kvedit.rope import layer_inv_freq, move_keys
from kvedit.states.capturing import (
    capture_passage,
    capture_tokens,
    empty_state,
    encode,
    extend_ids,
    passage_after,
)
from kvedit.store import KVStore
from kvedit.testing import TINY_SLIDING_WINDOW, tiny_model

PARTS = [
    "Records follow.\n",
    "Alice's secret number is 4821. Bob's secret number is 7310. ",
    "Carol's secret number is 5902. Dave's secret number is 1234. ",
    "Eve's secret number is 8080. Frank's secret number is 6611. The quick brown fox.",
]
QUESTION = " What is Carol's secret number?"


def blended_ids(tok, parts=PARTS) -> list[int]:
    ids = tok(parts[0])["input_ids"]
    for p in parts[1:]:
        ids += tok(p, add_special_tokens=False)["input_ids"]
    return ids


# ------------------------------------------------------------------ RoPE


def test_inv_freq_per_layer_type(tiny):
    arch, model, _ = tiny
    freqs = layer_inv_freq(model)
    assert len(freqs) == model.config.num_hidden_layers
    rotary = model.get_decoder().rotary_emb
    if arch == "gemma3":
        for f, kind in zip(freqs, model.config.layer_types, strict=True):
            assert torch.equal(f, getattr(rotary, f"{kind}_inv_freq"))
        assert not torch.allclose(rotary.sliding_attention_inv_freq, rotary.full_attention_inv_freq)
    else:
        assert all(torch.equal(f, rotary.inv_freq) for f in freqs)


def test_moved_passage_keys_equal_keys_computed_in_place(tiny):
    """Layer 0 keys depend on token and position only: a passage moved to offset o must give
    exactly the keys the whole sequence has there (on Gemma-3: the sliding base)."""
    _, model, tok = tiny
    prefix, passage = PARTS[0] + PARTS[1], PARTS[2] + PARTS[3]
    alone = capture_passage(model, tok, passage)
    whole = kvedit.capture(model, tok, prefix)
    offset = len(whole)
    ids = whole.token_ids.tolist() + alone.token_ids.tolist()
    full_keys = model(torch.tensor([ids]), use_cache=True).past_key_values.layers[0].keys
    layer = alone.layers[0]
    moved = move_keys(layer.keys, torch.full((len(layer),), offset), layer_inv_freq(model)[0])
    n = min(len(layer), full_keys.shape[2])  # transformers keeps one entry fewer on sliding
    expected = full_keys[:, :, -n:]  # the passage ends the sequence
    moved = moved[:, :, -n:]
    torch.testing.assert_close(moved, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(layer.keys[:, :, -n:], expected, atol=1e-3)  # it did need moving


def test_global_layer_rope_on_gemma3():
    """Gemma-3's global base (1M, linear scaling) on a model whose layer 0 is global."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    _, tok = tiny_model("gemma3")
    config = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    alone = capture_passage(model, tok, PARTS[2])
    ids = tok(PARTS[1], add_special_tokens=False)["input_ids"] + alone.token_ids.tolist()
    with torch.no_grad():
        full = model(torch.tensor([ids]), use_cache=True).past_key_values.layers[0].keys
    o = len(ids) - len(alone)
    moved = move_keys(alone.layers[0].keys, torch.full((len(alone),), o), layer_inv_freq(model)[0])
    torch.testing.assert_close(moved, full[:, :, o:], atol=1e-5, rtol=1e-5)


def test_length_dependent_rope_is_refused():
    model, _ = tiny_model("llama")
    rotary = model.get_decoder().rotary_emb
    rotary.rope_type = "dynamic"
    try:
        with pytest.raises(UnsupportedModelError, match="dynamic"):
            layer_inv_freq(model)
    finally:
        rotary.rope_type = "default"


# ------------------------------------------------------------------ blend


def test_full_recompute_equals_full_prefill(tmp_path, tiny):
    arch, model, tok = tiny
    store = KVStore(tmp_path)
    state, report = kvedit.blend(model, tok, PARTS, store, recompute=1.0)
    ids = blended_ids(tok)
    assert state.token_ids.tolist() == ids and state.text == "".join(PARTS)
    assert report.tokens_recomputed == len(ids) and report.tokens_reused == 0
    assert report.tokens_computed == len(ids)  # nothing was stored yet
    logits = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(state.last_logits, logits, atol=1e-4, rtol=1e-4)
    assert state.generate(QUESTION, 16) == reference_generate(model, tok, ids, QUESTION, 16)
    # the cache itself is a prefill's, entry for entry (sliding layers: the last window)
    fresh = extend_ids(empty_state(model, tok), ids, torch.zeros(len(ids), 2), "")
    for a, b in zip(state.layers, fresh.layers, strict=True):
        assert torch.equal(a.token_index, b.token_index)
        torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4)
    if arch == "gemma3":
        assert min(len(layer) for layer in state.layers) == TINY_SLIDING_WINDOW
    # every part is now stored: a second blend reuses them all
    _, again = kvedit.blend(model, tok, PARTS, store, recompute=1.0)
    assert [p.source for p in again.parts] == ["disk"] * 4 and again.tokens_computed == 0


def test_zero_recompute_is_naive_concatenation(tmp_path, llama):
    model, tok = llama
    store = KVStore(tmp_path, memory_bytes=10**8)
    parts = [kvedit.capture(model, tok, PARTS[0])] + [
        capture_passage(model, tok, p) for p in PARTS[1:]
    ]
    for p in parts:
        store.put(p)
    state, report = kvedit.blend(model, tok, PARTS, store, recompute=0.0, context="alone")
    assert [p.source for p in report.parts] == ["memory"] * 4
    assert (report.tokens_reused, report.tokens_recomputed, report.tokens_computed) == (
        len(state),
        0,
        0,
    )
    assert report.deviation_layer is None
    freqs = layer_inv_freq(model)
    for i, layer in enumerate(state.layers):
        start = 0
        for part in parts:
            n = len(part)
            seg = slice(start, start + n)
            torch.testing.assert_close(layer.values[:, :, seg], part.layers[i].values)
            moved = move_keys(part.layers[i].keys, torch.full((n,), start), freqs[i])
            torch.testing.assert_close(layer.keys[:, :, seg], moved)
            start += n
    assert torch.equal(state.last_logits, parts[-1].last_logits)


def test_partial_recompute_selects_deviating_tokens(tmp_path, llama):
    model, tok = llama
    store = KVStore(tmp_path)
    kvedit.blend(model, tok, PARTS, store, recompute=0.0, context="alone")  # stores the parts
    state, report = kvedit.blend(model, tok, PARTS, store, recompute=0.3, context="alone")
    ids = torch.tensor(blended_ids(tok))
    n0 = len(tok(PARTS[0])["input_ids"])
    assert report.deviation_layer == 1
    assert report.tokens_recomputed == -(-3 * len(ids) // 10)
    assert report.tokens_reused == len(ids) - report.tokens_recomputed
    selected = report.recomputed_tokens
    assert selected[-1] == len(ids) - 1  # the last token always
    assert (selected >= n0).all()  # part 0 was cached in its real context: no deviation
    # the selection is the top of the layer-1 deviation of the naive blend
    naive, _ = kvedit.blend(model, tok, PARTS, store, recompute=0.0, context="alone")
    deviation = blend_deviation(model, ids, naive.layers[1], 1)
    deviation[-1] = float("inf")
    assert set(selected.tolist()) == set(deviation.topk(len(selected)).indices.tolist())
    # layer-0 entries are exact after the move, so the recomputed tokens' layer-1 entries
    # are exactly a real prefill's; the reused ones are not
    true_k, _ = true_kv(model, ids, 1)
    got = state.layers[1].keys
    torch.testing.assert_close(got[:, :, selected], true_k[:, :, selected], atol=1e-4, rtol=1e-4)
    others = torch.tensor([i for i in range(n0, len(ids)) if i not in set(selected.tolist())])
    assert (got[:, :, others] - true_k[:, :, others]).abs().amax() > 1e-3


def test_gemma3_partial_recompute_respects_the_window(tmp_path, gemma3, monkeypatch):
    """Parts shorter than the window keep every token in their sliding layers, so layer 0
    (sliding, position-only) is exact after the move, and the recomputed tokens' layer-1
    entries must be a real prefill's: only if their queries see exactly their window."""
    model, tok = gemma3
    parts = ["Records:", " Alice is 4821.", " Bob is 7310.", " Carol is 5902.", " Dave is 1."]
    parts += [" Eve is 8080.", " Frank is 6611."]
    lengths = [len(tok(p, add_special_tokens=i == 0)["input_ids"]) for i, p in enumerate(parts)]
    assert max(lengths) < TINY_SLIDING_WINDOW < sum(lengths)
    state, report = kvedit.blend(model, tok, parts, KVStore(tmp_path), recompute=0.5)
    ids = state.token_ids
    true_k, _ = true_kv(model, ids, 1)  # layer 1: sliding
    selected = report.recomputed_tokens
    assert selected.min() < len(ids) - TINY_SLIDING_WINDOW  # some early tokens recomputed
    torch.testing.assert_close(
        _blend_layer1(model, tok, parts, tmp_path, monkeypatch)[:, :, selected],
        true_k[:, :, selected],
        atol=1e-4,
        rtol=1e-4,
    )


def _blend_layer1(model, tok, parts, tmp_path, monkeypatch):
    """Layer 1 keys of every token of a 0.5 blend (before the final trim to the window)."""
    module = importlib.import_module("kvedit.reusing.blending")  # `kvedit.blend` is the function
    real, kept = module._recompute, {}

    def spy(model_, layers, ids, selected):
        new_layers, logits = real(model_, layers, ids, selected)
        kept["keys"] = new_layers[1].keys
        return new_layers, logits

    monkeypatch.setattr(module, "_recompute", spy)
    kvedit.blend(model, tok, parts, KVStore(tmp_path), recompute=0.5)
    return kept["keys"]


def test_gemma3_partial_blend_uses_first_global_layer(tmp_path, gemma3):
    model, tok = gemma3
    state, report = kvedit.blend(model, tok, PARTS, KVStore(tmp_path), recompute=0.5)
    assert report.deviation_layer == model.config.layer_types.index("full_attention")
    assert {len(layer) for layer in state.layers} == {TINY_SLIDING_WINDOW, len(state)}


def test_blend_rejects_bad_input(tmp_path, llama):
    model, tok = llama
    store = KVStore(tmp_path)
    with pytest.raises(ValueError, match="non-empty list"):
        kvedit.blend(model, tok, "one string", store)
    with pytest.raises(ValueError, match="recompute"):
        kvedit.blend(model, tok, PARTS, store, recompute=1.5)
    with pytest.raises(ValueError, match="part 1"):
        kvedit.blend(model, tok, ["a", ""], store)
    with pytest.raises(ValueError, match="context"):
        kvedit.blend(model, tok, PARTS, store, context="before")


# ------------------------------------------------------------------ passages behind the prefix


def test_prefix_context_stores_each_passage_behind_the_prefix(tmp_path, tiny):
    """Each later part is stored as the plain capture of prefix ids + its ids (so its key is
    a function of the prefix and the passage), and placed from there: with nothing
    recomputed, part 1's entries are a real prefill's, later parts are their capture behind
    the prefix, moved to their offset."""
    arch, model, tok = tiny
    store = KVStore(tmp_path, memory_bytes=10**8)
    state, report = kvedit.blend(model, tok, PARTS, store, recompute=0.0)
    assert report.context == "prefix" and [p.source for p in report.parts] == ["computed"] * 4
    ids0 = tok(PARTS[0])["input_ids"]
    n0 = len(ids0)
    start = n0
    freqs = layer_inv_freq(model)
    for i, text in enumerate(PARTS[1:], 1):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert report.parts[i].key == store.key_for(model, tok, ids0 + ids)
        assert report.parts[i].key != store.key_for(model, tok, ids)  # not the alone key
        behind = capture_tokens(model, tok, ids0 + ids)
        for layer, ref, f in zip(state.layers, behind.layers, freqs, strict=True):
            got = (layer.token_index >= start) & (layer.token_index < start + len(ids))
            want = ref.token_index >= n0
            if layer.window is not None:  # the blend keeps its last window entries
                continue
            torch.testing.assert_close(layer.values[:, :, got], ref.values[:, :, want])
            moved = move_keys(ref.keys[:, :, want], torch.full((len(ids),), start - n0), f)
            torch.testing.assert_close(layer.keys[:, :, got], moved, atol=1e-5, rtol=1e-5)
        start += len(ids)
    assert start == len(state)
    # part 1 read right after the prefix: the blend of two parts is a prefill's, exactly
    two, _ = kvedit.blend(model, tok, PARTS[:2], store, recompute=0.0)
    fresh = capture_tokens(model, tok, two.token_ids.tolist())
    torch.testing.assert_close(two.last_logits, fresh.last_logits, atol=1e-4, rtol=1e-4)
    # stored: the next blend reads every part from the store
    _, again = kvedit.blend(model, tok, PARTS, store, recompute=0.15)
    assert [p.source for p in again.parts] == ["memory"] * 4 and again.tokens_computed == 0


def test_prefix_context_keys_depend_on_the_prefix(tmp_path, llama):
    model, tok = llama
    store = KVStore(tmp_path)
    kvedit.blend(model, tok, PARTS, store, recompute=0.0)
    other = ["Other records follow.\n", *PARTS[1:]]
    _, report = kvedit.blend(model, tok, other, store, recompute=0.0)
    assert [p.source for p in report.parts] == ["computed"] * 4  # same passages, new prefix
    _, alone = kvedit.blend(model, tok, PARTS, store, recompute=0.0, context="alone")
    assert [p.source for p in alone.parts] == ["disk", "computed", "computed", "computed"]
    # a stored (prefix, passage) entry is a plain capture: prefix reuse finds it too
    found, n = store.longest_prefix(model, tok, PARTS[0] + PARTS[1] + "More text.")
    assert n == report.parts[0].n_tokens + report.parts[1].n_tokens


def test_prefix_context_recomputes_only_after_the_first_passage(tmp_path, llama):
    """Part 1 was stored as read right after the prefix: the prefix's and its entries are
    a prefill's, kept as stored, and only later tokens are recomputed: those of largest
    deviation at layer 1, whose entries then equal a prefill's. The recompute brings the
    blend closer to a full prefill than plain placement."""
    model, tok = llama
    tol = dict(atol=1e-4, rtol=1e-4)
    store = KVStore(tmp_path)
    state, report = kvedit.blend(model, tok, PARTS, store, recompute=0.3)
    n01 = report.parts[0].n_tokens + report.parts[1].n_tokens
    assert report.tokens_recomputed == -(-3 * len(state) // 10)
    selected = report.recomputed_tokens
    assert (selected >= n01).all()  # prefix and part 1 are exact
    assert selected[-1] == len(state) - 1  # the last token always
    ids = state.token_ids
    full = capture_tokens(model, tok, ids.tolist())  # a prefill of the blended ids
    # the stored (prefix, part 1) entries, bit for bit, which are a prefill's
    stored, _ = store.fetch(report.parts[1].key, model, tok)
    assert len(stored) == n01
    for layer, ref, real in zip(state.layers, stored.layers, full.layers, strict=True):
        assert torch.equal(layer.keys[:, :, :n01], ref.keys)
        assert torch.equal(layer.values[:, :, :n01], ref.values)
        torch.testing.assert_close(layer.keys[:, :, :n01], real.keys[:, :, :n01], **tol)
        torch.testing.assert_close(layer.values[:, :, :n01], real.values[:, :, :n01], **tol)
    # the selection is the top of the layer-1 deviation of plain placement, whose entries
    # the tokens not selected keep
    placed, _ = kvedit.blend(model, tok, PARTS, store, recompute=0.0)
    assert report.deviation_layer == 1
    deviation = blend_deviation(model, ids, placed.layers[1], 1)
    deviation[-1] = float("inf")
    assert selected.tolist() == deviation.topk(len(selected)).indices.sort().values.tolist()
    others = torch.tensor([i for i in range(n01, len(ids)) if i not in set(selected.tolist())])
    for layer, plain in zip(state.layers, placed.layers, strict=True):
        assert torch.equal(layer.keys[:, :, others], plain.keys[:, :, others])
        assert torch.equal(layer.values[:, :, others], plain.values[:, :, others])
    # layer 0 is exact after the move, so the recomputed tokens' layer-1 entries are a
    # prefill's; the reused ones deviate
    got, want = state.layers[1], full.layers[1]
    for a, b in [(got.keys, want.keys), (got.values, want.values)]:
        torch.testing.assert_close(a[:, :, selected], b[:, :, selected], **tol)
        assert (a[:, :, others] - b[:, :, others]).abs().amax() > 1e-3
    # closer to a full prefill than plain placement: the next token's logits, every layer
    blend_error = (state.last_logits - full.last_logits).abs().amax()
    placed_error = (placed.last_logits - full.last_logits).abs().amax()
    assert blend_error < 0.5 * placed_error
    layers = zip(state.layers, placed.layers, full.layers, strict=True)
    for layer, plain, real in list(layers)[1:]:  # layer 0 is exact either way
        assert (layer.values - real.values).norm() < (plain.values - real.values).norm()


def test_passage_after(llama):
    model, tok = llama
    prefix = kvedit.capture(model, tok, PARTS[0])
    ids, offsets = encode(tok, PARTS[1], special_tokens=False)
    full = extend_ids(prefix, ids, offsets + len(PARTS[0]), PARTS[0] + PARTS[1])
    part = passage_after(full, len(prefix), len(PARTS[0]))
    assert part.text == PARTS[1] and part.token_ids.tolist() == ids
    assert torch.equal(part.offsets, offsets)
    assert part.position_ids.tolist() == list(range(len(prefix), len(full)))
    for layer, ref in zip(part.layers, full.layers, strict=True):
        assert layer.token_index.tolist() == list(range(len(ids)))
        assert torch.equal(layer.positions, ref.positions[len(prefix) :])
        assert torch.equal(layer.keys, ref.keys[:, :, len(prefix) :])
    with pytest.raises(ValueError, match="n_prefix"):
        passage_after(full, len(full), 0)


# ------------------------------------------------------------------ the eval method


def test_blend_eval_method(llama):
    from kvedit.evals.litm import run
    from kvedit.evals.methods import ExampleContext, document_parts, parse_spec
    from kvedit.evals.tasks import records_examples

    model, tok = llama
    examples = records_examples(n_records=4, positions=(0, 3), trials=1, seed=0)
    ctx = ExampleContext(model, tok, examples[0])
    parts = document_parts(ctx)
    assert "".join(parts) == ctx.prefix and len(parts) == 5
    assert parts[1].startswith(examples[0].documents[0])
    assert parse_spec("blend").params.context == "prefix"
    with pytest.raises(kvedit.errors.InvalidInputError, match="context"):
        parse_spec("blend:context=before")
    method = parse_spec("blend:recompute=1.0:context=alone")
    answer = method.predict(ctx)
    report = ctx.notes["blend_report"]
    ids = blended_ids(tok, parts)
    assert answer == reference_generate(model, tok, ids, ctx.continuation, ctx.max_new_tokens)
    assert [p.source for p in report.parts] == ["computed"] * 5
    other = ExampleContext(model, tok, examples[1])  # the same documents, in another order
    method.predict(other)
    sources = [p.source for p in other.notes["blend_report"].parts]
    assert sources[0] == "memory" and sources.count("memory") >= 3  # the method's store
    records = run(model, tok, examples, ["blend:recompute=0.15"], progress=False)
    assert [r["method"] for r in records] == ["blend:recompute=0.15"] * 2


def test_a_blend_says_it_is_a_blend(tmp_path, llama):
    """A blend's history has a "blend" origin (its parts' digests, recompute, context, the
    recomputed tokens): the store refuses it, and the parts it read are plain captures."""
    from kvedit.errors import InvalidInputError, StateAlteredError

    model, tok = llama
    store = KVStore(tmp_path)
    state, report = kvedit.blend(model, tok, PARTS, store, recompute=0.3)
    origin = state.history.origin
    assert origin.kind == "blend" and not state.is_plain_capture
    assert origin.params["recompute"] == 0.3 and origin.params["context"] == "prefix"
    assert len(origin.params["parts"]) == len(PARTS)
    assert "blend" in repr(state) and state.last_input == (len(state) - 1, len(state) - 1)
    again, _ = kvedit.blend(model, tok, PARTS, store, recompute=0.3)
    assert again.digest == state.digest
    assert kvedit.blend(model, tok, PARTS, store, recompute=0.5)[0].digest != state.digest
    with pytest.raises(InvalidInputError, match="blend"):
        store.put(state)
    # a store that handed back an edited part: the blend refuses to use it
    edited = kvedit.ops.scale_keys(kvedit.capture(model, tok, PARTS[0]), "Records", 1.5)
    store.fetch = lambda key, m, t: (edited, "memory")
    with pytest.raises(StateAlteredError, match="scale_keys"):
        kvedit.blend(model, tok, PARTS, store)


def test_passage_after_records_the_cut(llama):
    model, tok = llama
    full = kvedit.capture(model, tok, PARTS[0] + PARTS[1])
    n = len(tok(PARTS[0])["input_ids"])
    part = passage_after(full, n, len(PARTS[0]))
    assert [s.name for s in part.history.steps] == ["passage_after"]
    assert part.last_input == (len(full) - 1 - n, len(full) - 1)
