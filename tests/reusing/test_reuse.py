"""Prefix reuse: the result equals a fresh capture, and only the new tokens are computed."""

from __future__ import annotations

import pytest
import torch
from conftest import RECORDS
from helpers import reference_generate, same, snapshot

import kvedit
from kvedit.states.capturing import capture_passage, cut_layers, extend_ids
from kvedit.store import KVStore
from kvedit.testing import TINY_SLIDING_WINDOW, tiny_model, tiny_tokenizer

QUESTION = " Question: What is Carol's secret number? Answer:"


@pytest.fixture(scope="module")
def llama_model():
    return tiny_model("llama")


def assert_same_as_capture(state, model, tok, text):
    fresh = kvedit.capture(model, tok, text)
    assert state.text == fresh.text and state.next_position == fresh.next_position
    assert torch.equal(state.token_ids, fresh.token_ids)
    assert torch.equal(state.offsets, fresh.offsets)
    assert torch.equal(state.position_ids, fresh.position_ids)
    for a, b in zip(state.layers, fresh.layers, strict=True):
        assert torch.equal(a.token_index, b.token_index) and a.window == b.window
        torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.last_logits, fresh.last_logits, atol=1e-4, rtol=1e-4)
    assert state.generate(" What is", 12) == fresh.generate(" What is", 12)


def test_reuse_equals_fresh_capture(tmp_path, tiny):
    arch, model, tok = tiny
    store = KVStore(tmp_path, chunk_tokens=16, memory_bytes=10**8)
    first, report = kvedit.reuse(model, tok, RECORDS, store)
    assert (report.tokens_reused, report.tokens_computed) == (0, len(first))
    assert report.source is None and report.key is not None
    assert_same_as_capture(first, model, tok, RECORDS)

    second, report = kvedit.reuse(model, tok, RECORDS + QUESTION, store)
    assert report.tokens_reused == len(first) and report.source == "memory"
    assert report.tokens_computed == len(second) - len(first) > 0
    assert_same_as_capture(second, model, tok, RECORDS + QUESTION)

    again, report = kvedit.reuse(model, tok, RECORDS + QUESTION, store)
    assert report.tokens_computed == 0 and report.tokens_reused == len(again)
    assert same(snapshot(again)[3:], snapshot(second)[3:])

    # a fresh store object on the same root: from disk
    third, report = kvedit.reuse(model, tok, RECORDS + " Who?", KVStore(tmp_path), save=False)
    assert report.source == "disk" and report.tokens_reused == len(first)
    assert report.key is None
    assert_same_as_capture(third, model, tok, RECORDS + " Who?")


def test_reuse_across_a_token_boundary(tmp_path, llama_model):
    """The stored text ends inside what becomes one token of the new prompt."""
    model, tok = llama_model
    store = KVStore(tmp_path, chunk_tokens=8)
    stored = RECORDS + "Grace's secret number is 48"
    prompt = RECORDS + "Grace's secret number is 4821."
    s_ids, p_ids = tok(stored)["input_ids"], tok(prompt)["input_ids"]
    split = next(i for i, (a, b) in enumerate(zip(s_ids, p_ids)) if a != b)
    assert split < len(s_ids)  # the last stored tokens are not tokens of the prompt
    kvedit.reuse(model, tok, stored, store)
    state, report = kvedit.reuse(model, tok, prompt, store)
    assert report.tokens_reused == split // 8 * 8 > 0  # cut at the last shared chunk
    assert_same_as_capture(state, model, tok, prompt)


def test_remaining_tokens_are_never_retokenized(tmp_path, llama_model):
    """With a prefix-space tokenizer (SentencePiece-like), tokenizing the rest of the text on
    its own would add a space token: reuse must take the full text's own tokens."""
    from tokenizers import pre_tokenizers

    model, _ = llama_model
    tok = tiny_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    stored, rest = RECORDS.rstrip(), "Grace's secret number is 4821."
    n = len(tok(stored)["input_ids"])
    assert tok(stored + rest)["input_ids"][:n] == tok(stored)["input_ids"]
    alone = tok(rest, add_special_tokens=False)["input_ids"]
    assert alone != tok(stored + rest)["input_ids"][n:]  # " Grace" instead of "Grace"
    store = KVStore(tmp_path, chunk_tokens=8)
    kvedit.reuse(model, tok, stored, store)
    state, report = kvedit.reuse(model, tok, stored + rest, store)
    assert report.tokens_reused == n
    assert_same_as_capture(state, model, tok, stored + rest)


def test_save_false_stores_nothing(tmp_path, llama_model):
    model, tok = llama_model
    store = KVStore(tmp_path)
    kvedit.reuse(model, tok, RECORDS, store, save=False)
    assert store.stats()["entries"] == 0
    _, report = kvedit.reuse(model, tok, RECORDS, store, ttl=60)
    assert store.stats()["entries"] == 1 and report.key is not None


def test_extend_ids_and_passages(llama_model):
    model, tok = llama_model
    state = kvedit.capture(model, tok, RECORDS)
    enc = tok(QUESTION, add_special_tokens=False, return_offsets_mapping=True)
    offsets = torch.tensor(enc["offset_mapping"]) + len(RECORDS)
    extended = extend_ids(state, enc["input_ids"], offsets, RECORDS + QUESTION)
    assert same(snapshot(extended), snapshot(state.extend(QUESTION)))
    passage = capture_passage(model, tok, RECORDS)
    ids = tok(RECORDS, add_special_tokens=False)["input_ids"]
    assert passage.token_ids.tolist() == ids  # no BOS: a passage starts at position 0
    assert passage.generate(" x", 8) == reference_generate(model, tok, ids, " x", 8)


def test_cut_layers(llama_model):
    model, tok = llama_model
    state = kvedit.capture(model, tok, RECORDS)
    head = kvedit.capture(model, tok, RECORDS[: RECORDS.index(" Carol")])
    cut = cut_layers(state.layers, len(head))
    for a, b in zip(cut, head.layers, strict=True):
        assert torch.equal(a.token_index, b.token_index)
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
    gemma3, gtok = tiny_model("gemma3")
    long = kvedit.capture(gemma3, gtok, RECORDS)  # its sliding layers hold only the end
    with pytest.raises(ValueError, match="cannot be cut"):
        cut_layers(long.layers, 20)
    assert len(cut_layers(long.layers, len(long))[0]) == TINY_SLIDING_WINDOW


@pytest.mark.real
def test_smollm2_reuse_with_default_chunks(tmp_path, smollm2):
    model, tok = smollm2
    prompt = kvedit.templated_prompt(tok, "Records:\n" + RECORDS * 5)
    assert len(tok(prompt)["input_ids"]) > 256
    store = KVStore(tmp_path, memory_bytes=2**30)
    kvedit.reuse(model, tok, prompt, store)
    state, report = kvedit.reuse(model, tok, prompt + "Dave's number is", store)
    assert report.source == "memory" and report.tokens_computed < 10
    assert state.generate("", 8) == reference_generate(model, tok, state.token_ids.tolist(), "", 8)


# ------------------------------------------------------------------ provenance


def test_reuse_result_is_a_plain_capture_with_the_captures_digest(tmp_path, llama_model):
    model, tok = llama_model
    store = KVStore(tmp_path, chunk_tokens=16)
    kvedit.reuse(model, tok, RECORDS, store)
    state, report = kvedit.reuse(model, tok, RECORDS + QUESTION, store)
    assert report.tokens_reused > 0 and state.is_plain_capture
    assert state.digest == kvedit.capture(model, tok, RECORDS + QUESTION).digest


def test_reuse_never_extends_an_edited_state(tmp_path, llama_model, monkeypatch):
    """Even if a store handed back an edited state (the store refuses to hold one; this is the
    promise's second guard), reuse refuses to extend it rather than return it as a capture."""
    from kvedit import ops
    from kvedit.errors import StateAlteredError
    from kvedit.store import PrefixMatch

    model, tok = llama_model
    store = KVStore(tmp_path)
    edited = ops.scale_keys(kvedit.capture(model, tok, RECORDS), "Carol", 1.5)
    monkeypatch.setattr(
        store, "longest_prefix_ids", lambda *a: PrefixMatch(edited, len(edited), "0" * 32, "memory")
    )
    with pytest.raises(StateAlteredError, match="scale_keys"):
        kvedit.reuse(model, tok, RECORDS + QUESTION, store)
