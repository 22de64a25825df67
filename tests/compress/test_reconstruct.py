"""The ``reconstruct`` scorer (KVzip's context-reconstruction attention, kvedit.compress)."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit.compress import SCORERS, make_scorer, select
from kvedit.compress.masking import live_entries
from kvedit.compress.scorers.reconstruct import DEFAULT_PROMPT, Reconstruct
from kvedit.errors import InvalidInputError, InvalidTypeError

TEXT = " ".join(f"Person{i}'s code is {1000 + 37 * i}." for i in range(5))


def _state(pair, **kw):
    model, tok = pair
    return kvedit.capture(model, tok, TEXT, **kw)


def _all(state, scorer):
    return scorer.score(state, range(len(state.layers)))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_shapes_and_finite(arch, request):
    state = _state(request.getfixturevalue(arch))
    scores = _all(state, Reconstruct())
    assert sorted(scores) == list(range(len(state.layers)))
    for i, s in scores.items():
        layer = state.layers[i]
        assert s.shape == (*layer.kv_shape[:2], len(layer))
        assert s.dtype == torch.float32
        assert torch.isfinite(s).all() and (s >= 0).all() and (s <= 1).all()
        if layer.window is None:  # every global entry is seen by some reconstruction query
            assert (s > 0).all()


def test_matches_one_eager_pass(llama):
    """The scores equal the max attention of the reconstruction rows in one plain forward of
    text + prompt + text (transformers' own eager attention): chunks, positions, the max."""
    model, tok = llama
    state = _state(llama)
    prompt = tok(DEFAULT_PROMPT, add_special_tokens=False)["input_ids"]
    special = set(tok.all_special_ids)
    again = [t for t in state.token_ids.tolist() if t not in special]
    ids = state.token_ids.tolist() + prompt + again
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        model.set_attn_implementation(before)
    n, first = len(state), len(state) + len(prompt)
    scores = _all(state, Reconstruct(chunk=5))
    for i, att in enumerate(out.attentions):
        want = att[0, :, first:, :n].float().amax(dim=1)  # [heads, n]
        kv = state.layers[i].kv_shape[1]
        want = want.reshape(kv, -1, n).amax(dim=1)
        torch.testing.assert_close(scores[i][0], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_equals_unchunked(arch, request):
    state = _state(request.getfixturevalue(arch))
    whole = _all(state, Reconstruct(chunk=10_000))
    for chunk in (2, 5):
        parts = _all(state, Reconstruct(chunk=chunk))
        for i in whole:
            torch.testing.assert_close(parts[i], whole[i], atol=1e-5, rtol=1e-4)


def test_segments_when_positions_run_short(llama):
    """Too few positions for the whole reconstruction: segments of what fits, each chunked the
    same way whatever ``chunk``; the scores differ from the unsegmented ones."""
    free = _state(llama)
    prompt = len(llama[1](DEFAULT_PROMPT, add_special_tokens=False)["input_ids"])
    state = _state(llama, max_positions=len(free) + prompt + 20)
    whole = _all(state, Reconstruct(chunk=20))
    parts = _all(state, Reconstruct(chunk=3))
    unsegmented = _all(free, Reconstruct())
    for i in whole:
        assert torch.isfinite(whole[i]).all()
        torch.testing.assert_close(parts[i], whole[i], atol=1e-5, rtol=1e-4)
    assert any(not torch.allclose(whole[i], unsegmented[i]) for i in whole)


def test_refuses_when_nothing_fits(llama):
    free = _state(llama)
    prompt = len(llama[1](DEFAULT_PROMPT, add_special_tokens=False)["input_ids"])
    state = _state(llama, max_positions=len(free) + prompt + 3)
    with pytest.raises(InvalidInputError, match=r"prompt and chunk is \d+ tokens long"):
        Reconstruct(chunk=4).score(state, [0])
    fits = Reconstruct(chunk=3).score(state, [0])  # 3 fit: segments of 3
    assert fits[0].shape[-1] == len(state) and torch.isfinite(fits[0]).all()
    full = _state(llama, max_positions=len(free) + 2)
    with pytest.raises(InvalidInputError, match="attends to at most"):
        Reconstruct().score(full, [0])  # not even the prompt
    Reconstruct(chunk=2, prompt="").score(full, [0])  # no prompt: two tokens at a time fit


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_select_keeps_the_fraction(arch, request):
    state = _state(request.getfixturevalue(arch))
    small = select(state, "reconstruct", 0.3)
    assert small.history.steps[-1].params["scorer"] == repr(Reconstruct())
    for before, after in zip(state.layers, small.layers):
        if before.window is not None:
            assert after is before or len(after) == len(before)
            continue
        kv_heads = after.kv_shape[1]
        live = live_entries(after, kv_heads).sum(dim=-1)
        assert (live == round(0.3 * len(before))).all()


def test_parameters_are_checked():
    assert SCORERS["reconstruct"] is Reconstruct
    assert make_scorer("reconstruct", chunk=8, prompt="Say it again:") == Reconstruct(
        8, "Say it again:"
    )
    for bad in (0, -1, 2.5, True):
        with pytest.raises((InvalidInputError, InvalidTypeError)):
            make_scorer("reconstruct", chunk=bad)
    with pytest.raises(InvalidTypeError):
        make_scorer("reconstruct", prompt=3)
    # query-agnostic: there is no question to give it
    with pytest.raises(InvalidInputError, match="unknown parameter"):
        make_scorer("reconstruct", query="What is Person3's code?")


def test_prompt_matters(llama):
    state = _state(llama)
    plain = _all(state, Reconstruct())
    other = _all(state, Reconstruct(prompt=" Once more:"))
    assert any(not torch.allclose(plain[i], other[i]) for i in plain)


def test_dropped_entries_score_zero(llama):
    """A head's entries dropped by an earlier selection get no attention, so score 0."""
    small = select(_state(llama), "knorm", 0.5)
    scores = _all(small, Reconstruct())
    for i, layer in enumerate(small.layers):
        live = live_entries(layer, layer.kv_shape[1])
        assert (scores[i][~live] == 0).all() and (scores[i][live] > 0).all()


def test_a_state_that_forgot_reconstructs_only_what_it_holds(llama):
    """After whole entries are dropped (as a forgetting memory drops them), the model re-reads
    the held tokens only: a round costs in proportion to what is held."""
    model, _ = llama
    state = _state(llama)
    keep = torch.arange(len(state))[: len(state) // 3]
    short = state.replace(layers=[layer.select(keep) for layer in state.layers])
    read = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: read.append(kwargs["input_ids"].shape[-1]), with_kwargs=True
    )
    try:
        Reconstruct(prompt="").score(short, [0])
    finally:
        hook.remove()
    special = set(llama[1].all_special_ids)
    assert sum(read) == sum(t not in special for t in state.token_ids[keep].tolist())
