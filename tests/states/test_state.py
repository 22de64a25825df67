"""Capture and continue: the identity every later feature relies on."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import RECORDS
from helpers import reference_generate, same, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

import kvedit
from kvedit.errors import SpanNotFoundError
from kvedit.provenance import Step
from kvedit.states.state import LastInput
from kvedit.testing import TINY_SLIDING_WINDOW

QUESTION = " What is Carol's secret number?"


def test_capture_then_generate_matches_model_generate(tiny):
    arch, model, tok = tiny
    text = RECORDS * 2
    state = kvedit.capture(model, tok, text)
    if arch == "gemma3":  # the prefix must be longer than the sliding window
        assert len(state) > TINY_SLIDING_WINDOW
        assert {len(layer) for layer in state.layers} == {TINY_SLIDING_WINDOW, len(state)}
    ours = state.generate(QUESTION, max_new_tokens=24)
    ref = reference_generate(model, tok, state.token_ids.tolist(), QUESTION, 24)
    assert ours == ref
    assert len(tok(ours, add_special_tokens=False)["input_ids"]) >= 10  # not trivially short


def test_generate_with_empty_continuation_uses_stored_logits(tiny):
    _, model, tok = tiny
    state = kvedit.capture(model, tok, RECORDS)
    assert state.generate("", max_new_tokens=12) == reference_generate(
        model, tok, state.token_ids.tolist(), "", 12
    )


@pytest.mark.real
def test_smollm2_identity(smollm2):
    model, tok = smollm2
    prefix, cont = kvedit.chat_prefix(
        tok, "Records:\n" + RECORDS + "\n\nQuestion: What is Dave's secret number?", "\n\nQuestion:"
    )
    state = kvedit.capture(model, tok, prefix)
    ours = state.generate(cont, max_new_tokens=16)
    assert ours == reference_generate(model, tok, state.token_ids.tolist(), cont, 16)
    assert "secret number" in ours  # sensible text, not noise


def test_logits_rows_match_a_full_forward(tiny):
    _, model, tok = tiny
    state = kvedit.capture(model, tok, RECORDS)
    rows = state.logits(QUESTION)
    cont = tok(QUESTION, add_special_tokens=False)["input_ids"]
    assert rows.shape == (len(cont), model.config.vocab_size)
    ids = torch.tensor([state.token_ids.tolist() + cont])
    with torch.no_grad():
        full = model(ids).logits[0, len(state) - 1 : -1]
    torch.testing.assert_close(rows, full.float(), atol=1e-4, rtol=1e-4)


def test_extend_equals_capturing_the_concatenated_tokens(tiny):
    arch, model, tok = tiny
    state = kvedit.capture(model, tok, RECORDS)
    extended = state.extend(" Grace's secret number is 4444.")
    assert extended.text == RECORDS + " Grace's secret number is 4444."
    assert len(extended) == len(state) + len(
        tok(" Grace's secret number is 4444.", add_special_tokens=False)["input_ids"]
    )
    assert extended.next_position == len(extended)
    assert extended.generate(QUESTION, 16) == reference_generate(
        model, tok, extended.token_ids.tolist(), QUESTION, 16
    )
    # the new tokens' offsets point at their text
    idx = extended.token_indices("4444")
    assert idx.numel() >= 1 and idx.min() >= len(state)
    if arch == "gemma3":
        assert all(len(layer) == TINY_SLIDING_WINDOW for layer in extended.layers if layer.window)


def test_continuing_never_mutates_the_state(tiny):
    _, model, tok = tiny
    state = kvedit.capture(model, tok, RECORDS)
    before = snapshot(state)
    state.generate(QUESTION, 8)
    state.logits(QUESTION)
    state.extend(" more text")
    assert same(before, snapshot(state))


def hand_built_state(n: int = 4) -> kvedit.KVState:
    """A state built without a model: one dense layer of ``n`` entries."""
    k = torch.randn(1, 2, n, 8)
    layer = kvedit.LayerKV(k, k.clone(), torch.arange(n), torch.arange(n))
    return kvedit.KVState(
        layers=[layer],
        token_ids=torch.arange(n),
        offsets=torch.stack([torch.arange(n), torch.arange(1, n + 1)], dim=1),
        text="abcd"[:n],
        position_ids=torch.arange(n),
        next_position=n,
        last_logits=torch.zeros(10),
        model_fingerprint="m",
        tokenizer_fingerprint="t",
    )


def test_a_state_is_frozen_and_changes_build_new_states():
    state = hand_built_state()
    assert state.last_input == LastInput(3, 3)  # derived while the state was built
    for name in ("layers", "text", "history", "last_input", "model", "next_position"):
        before = getattr(state, name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(state, name, before)
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(state, name)
        assert getattr(state, name) is before
    history = state.history
    stepped = state.with_step(Step("edit", "scale_keys", {"factor": 0.5}))
    renamed = state.replace(text="dcba")
    assert stepped is not state and stepped.history != history and state.history is history
    assert (renamed.text, state.text) == ("dcba", "abcd")
    assert renamed.layers is state.layers  # a shallow copy: tensors are shared


def test_copy_to_len_nbytes(tiny):
    _, model, tok = tiny
    state = kvedit.capture(model, tok, RECORDS)
    clone = state.copy()
    assert clone.layers[0].keys.data_ptr() != state.layers[0].keys.data_ptr()
    assert same(snapshot(clone), snapshot(state))
    assert len(state) == len(tok(RECORDS)["input_ids"])
    expected = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in state.layers)
    assert state.nbytes == expected
    moved = state.to("cpu")
    assert moved.generate(QUESTION, 6) == state.generate(QUESTION, 6)


def test_token_indices_substring_regex_and_range(tiny):
    _, model, tok = tiny
    state = kvedit.capture(model, tok, RECORDS + RECORDS)
    both = state.token_indices("4821")
    assert both.numel() >= 2  # every occurrence
    first_end = RECORDS.index("4821") + 4
    only_first = state.token_indices((RECORDS.index("4821"), first_end))
    assert set(only_first.tolist()) < set(both.tolist())
    by_regex = state.token_indices(re.compile(r"\d{4}"))
    assert set(both.tolist()) <= set(by_regex.tolist())
    occurrences = [m.span() for m in re.finditer("4821", state.text)]
    assert len(occurrences) == 2
    for i in range(len(state)):  # selected exactly when the token overlaps an occurrence
        a, b = state.offsets[i].tolist()
        overlaps = b > a and any(a < end and b > start for start, end in occurrences)
        assert (i in both.tolist()) == overlaps
    digits = [m.span() for m in re.finditer(r"\d{4}", state.text)]
    for i in range(len(state)):
        a, b = state.offsets[i].tolist()
        overlaps = b > a and any(a < end and b > start for start, end in digits)
        assert (i in by_regex.tolist()) == overlaps
    with pytest.raises(SpanNotFoundError, match="Zed"):
        state.token_indices("Zed's")
    with pytest.raises(ValueError, match="empty"):
        state.token_indices("")
    with pytest.raises(SpanNotFoundError):
        state.token_indices((0, len(state.text) + 5))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_ranges_map_to_overlapping_tokens(data):
    from kvedit.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    text = RECORDS
    enc = tok(text, return_offsets_mapping=True)
    offsets = torch.tensor(enc["offset_mapping"])
    start = data.draw(st.integers(0, len(text) - 1))
    end = data.draw(st.integers(start + 1, len(text)))
    from kvedit.spans import char_ranges, tokens_in_ranges

    idx = set(tokens_in_ranges(offsets, char_ranges(text, (start, end))).tolist())
    for i, (a, b) in enumerate(offsets.tolist()):
        overlaps = a < end and b > start and b > a
        assert (i in idx) == overlaps
    # and back: the selected tokens' characters cover the range
    covered = set()
    for i in idx:
        a, b = offsets[i].tolist()
        covered.update(range(a, b))
    assert set(range(start, end)) <= covered | {
        c for c in range(start, end) if not any(a <= c < b for a, b in offsets.tolist())
    }


@pytest.mark.real
def test_chat_prefix_splits_the_templated_prompt(smollm2):
    _, tok = smollm2
    prefix, cont = kvedit.chat_prefix(tok, "Docs here.\n\nQuestion: Why?", "\n\nQuestion:")
    assert prefix.endswith("Docs here.")
    assert cont.startswith("\n\nQuestion: Why?")
    assert "assistant" in cont
    with pytest.raises(SpanNotFoundError):
        kvedit.chat_prefix(tok, "no split here", "Question:")
