"""Edits reach the next token: every op recomputes the last token over the edited cache.

The reference for ``emphasize`` is independent of the op's code: ``steer(scope="decode")``
biases only the queries that predict new tokens, so a plain forward of the whole prompt under
it gives, at the last position, what ``ops.emphasize`` on the captured prompt must predict.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import RECORDS

import kvedit
from kvedit import ops
from kvedit.testing import tiny_model

SPAN = "Carol's secret number is 5902."
TOL = 2e-5


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def captured(request):
    model, tok = tiny_model(request.param)
    text = RECORDS * (3 if request.param == "gemma3" else 1)  # past the sliding window too
    return model, tok, kvedit.capture(model, tok, text)


def changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.float() - b.float()).abs().max().item() > 1e-3


def first_rows_agree(state) -> None:
    """``logits(text)[0]`` and ``generate("")``'s first token come from ``last_logits``."""
    assert torch.equal(state.logits(" What")[0], state.last_logits.float())
    first = state.generate("", max_new_tokens=1)
    expected = state.tokenizer.decode([int(state.last_logits.argmax())], skip_special_tokens=True)
    assert first == expected


@pytest.mark.parametrize("strength", [3.0, -3.0])
def test_emphasize_predicts_what_decode_scope_steering_predicts(captured, strength):
    model, tok, state = captured
    edited = ops.emphasize(state, SPAN, strength)
    ids = state.token_ids[None]
    spans = {"emphasize": SPAN} if strength > 0 else {"suppress": SPAN}
    with (
        kvedit.steer(
            model, tok, strength=abs(strength), scope="decode", protect_special=False, **spans
        ),
        torch.no_grad(),
    ):
        steered = model(input_ids=ids).logits[0, -1]
    torch.testing.assert_close(edited.last_logits, steered.float(), atol=TOL, rtol=TOL)
    assert changed(edited.last_logits, state.last_logits)
    first_rows_agree(edited)


def test_suppress_and_scale_keys_reach_the_next_token(captured):
    _, _, state = captured
    for edited in (ops.suppress(state, SPAN, 3.0), ops.scale_keys(state, SPAN, 2.0)):
        assert changed(edited.last_logits, state.last_logits)
        first_rows_agree(edited)


def test_duplicate_reaches_the_next_token_as_emphasize_log_copies(captured):
    _, _, state = captured
    dup = ops.duplicate(state, SPAN, 2)
    global_layers = state.global_layers
    emph = ops.emphasize(state, SPAN, math.log(3), layers=global_layers)
    assert changed(dup.last_logits, state.last_logits)
    torch.testing.assert_close(dup.last_logits, emph.last_logits, atol=1e-4, rtol=1e-4)
    first_rows_agree(dup)


def test_compression_reaches_the_next_token(captured):
    _, _, state = captured
    for edited in (ops.snapkv(state, keep=0.3, window=4), ops.quantize(state, bits=2, residual=4)):
        assert changed(edited.last_logits, state.last_logits)
        first_rows_agree(edited)


def test_an_edit_that_changes_nothing_keeps_the_prediction_exactly(captured):
    _, _, state = captured
    for same in (ops.emphasize(state, SPAN, 0.0), ops.scale_keys(state, SPAN, 1.0)):
        assert torch.equal(same.last_logits, state.last_logits)


def test_an_edit_of_the_last_token_itself_is_kept(captured):
    _, _, state = captured
    last = (int(state.offsets[-1, 0]), int(state.offsets[-1, 1]))
    edited = ops.emphasize(state, last, 2.0)
    t = len(state) - 1
    for layer in edited.layers:  # the recomputed entry carries the new bias
        assert torch.all(layer.dense_bias()[..., layer.token_index == t] == 2.0)
    scaled = ops.scale_keys(state, last, 3.0)
    recomputed = ops.scale_keys(state, last, 1.0 + 1e-9)  # recomputed, (almost) unscaled
    for a, b in zip(scaled.layers, recomputed.layers, strict=True):
        mine = a.token_index == t
        torch.testing.assert_close(
            a.keys[:, :, mine], 3.0 * b.keys[:, :, mine], rtol=1e-5, atol=1e-5
        )
