"""Cache edits (``kvedit.ops``): each returns a new state, never touches its input, and does
exactly what it says to the entries of the chosen tokens and layers."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import RECORDS
from helpers import same, snapshot

import kvedit
import kvedit.attention as ka
from kvedit import ops
from kvedit.errors import EmptySelectionError, InvalidInputError, SpanNotFoundError
from kvedit.runtime import seam
from kvedit.testing import TINY_SLIDING_WINDOW, tiny_model

QUESTION = " Question: What is Carol's secret number? Answer:"
SPAN = "Carol's secret number is 5902"
TOL = dict(atol=1e-4, rtol=1e-4)


def capture_records(model, tok, text=RECORDS):
    return kvedit.capture(model, tok, text)


def close(a, b, **tol):
    torch.testing.assert_close(a, b, **(tol or TOL))


def differs(a, b, by=1e-3) -> bool:
    return bool((a - b).abs().amax() > by)


def unchanged_layers(before, after) -> list[int]:
    """Indices of layers whose keys, values, bias and bookkeeping are all identical, except for
    the last token's entries (every edit recomputes those in every layer)."""
    last = len(before) - 1
    out = []
    for i, (a, b) in enumerate(zip(before.layers, after.layers, strict=True)):
        a, b = (x.select((x.token_index != last).nonzero().flatten()) for x in (a, b))
        if same(layer_tensors(a), layer_tensors(b)):
            out.append(i)
    return out


def layer_tensors(layer):
    tensors = [layer.keys, layer.values, layer.token_index, layer.positions]
    return tensors + ([layer.dense_bias()] if layer.bias is not None else [])


# ---------------------------------------------------------------------- new states, no mutation


EDITS = {
    "emphasize": lambda s: ops.emphasize(s, SPAN, 2.0),
    "suppress": lambda s: ops.suppress(s, SPAN, 1.5),
    "scale_keys": lambda s: ops.scale_keys(s, SPAN, 1.7),
    "duplicate": lambda s: ops.duplicate(s, SPAN, 2),
    "reread": lambda s: ops.reread(s, SPAN),
    "emphasize-one-layer": lambda s: ops.emphasize(s, "Frank's secret", 2.0, layers=[0]),
}


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_ops_return_a_new_state_and_never_mutate_their_input(tiny, edit):
    _, model, tok = tiny
    plain = capture_records(model, tok)
    for state in (plain, ops.emphasize(plain, "Bob", 1.0)):  # also with a stored bias
        before = snapshot(state)
        out = EDITS[edit](state)
        assert out is not state
        assert not same(snapshot(out), before)
        out.logits(QUESTION)
        out.generate(QUESTION, max_new_tokens=3)
        out.extend(" More.")
        assert same(snapshot(state), before)
        assert out.text == state.text and torch.equal(out.token_ids, state.token_ids)


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: ops.emphasize(s, SPAN, 0.0),
        lambda s: ops.suppress(s, SPAN, 0.0),
        lambda s: ops.scale_keys(s, SPAN, 1.0),
        lambda s: ops.duplicate(s, SPAN, 0),
    ],
    ids=["emphasize-0", "suppress-0", "scale_keys-1", "duplicate-0"],
)
def test_neutral_strength_is_the_identity(tiny, edit):
    _, model, tok = tiny
    state = capture_records(model, tok)
    out = edit(state)
    assert same(snapshot(out), snapshot(state))
    close(out.logits(QUESTION), state.logits(QUESTION), atol=0, rtol=0)


# ------------------------------------------------------------- emphasize(log r) == duplicate(r-1)


def assert_emphasis_equals_duplication(model, tok, text, span, question=QUESTION):
    state = kvedit.capture(model, tok, text)
    plain = state.logits(question)
    for r in (2, 3):
        emphasized = ops.emphasize(state, span, math.log(r))
        duplicated = ops.duplicate(state, span, r - 1)
        ours = emphasized.logits(question)
        close(duplicated.logits(question), ours)
        assert differs(ours[1:], plain[1:])  # the edit does something
    return state


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_emphasize_log_r_equals_duplicate_r_minus_1(arch):
    model, tok = tiny_model(arch)
    assert_emphasis_equals_duplication(model, tok, RECORDS, SPAN)
    # and the two compose: a stored bias log 2 plus one copy is a bias log 4
    state = capture_records(model, tok)
    both = ops.duplicate(ops.emphasize(state, SPAN, math.log(2)), SPAN, 1)
    close(both.logits(QUESTION), ops.emphasize(state, SPAN, math.log(4)).logits(QUESTION))


@pytest.mark.real
def test_emphasize_log_r_equals_duplicate_on_smollm2(smollm2):
    model, tok = smollm2
    prefix, question = kvedit.chat_prefix(
        tok, "Records:\n" + RECORDS + "\n\nQuestion: What is Carol's secret number?", "\n\n"
    )
    assert_emphasis_equals_duplication(model, tok, prefix, SPAN, question=question)


def test_duplicate_grows_the_cache_but_not_the_text_and_continues_correctly(tiny):
    arch, model, tok = tiny
    state = capture_records(model, tok)
    n_span = state.token_indices(SPAN).numel()
    dup = ops.duplicate(state, SPAN, 2)
    assert len(dup) == len(state)
    assert dup.next_position == state.next_position
    assert dup.cache_length == state.cache_length + 2 * n_span
    for after in dup.layers:
        if after.window is None:  # the copies sit at their tokens' positions
            span = state.token_indices(SPAN)
            held = torch.isin(after.token_index, span)
            assert int(held.sum()) == 3 * span.numel()  # each span token: itself and 2 copies
            assert torch.equal(after.positions[held].sort().values, span.repeat(3).sort().values)
            assert torch.equal(after.token_index[held], after.positions[held])
    emphasized = ops.emphasize(state, SPAN, math.log(3))
    if arch == "gemma3":  # the span is held by sliding layers too, which duplicate skips
        emphasized = ops.emphasize(state, SPAN, math.log(3), layers=[2])
    text = " Grace's secret number is 4444."
    dup_ext, emph_ext = dup.extend(text), emphasized.extend(text)
    n_new = len(tok(text, add_special_tokens=False)["input_ids"])
    assert dup_ext.next_position == state.next_position + n_new == len(dup_ext)
    for layer in dup_ext.layers:
        assert torch.equal(layer.positions[-n_new:], torch.arange(len(state), len(state) + n_new))
    close(dup_ext.logits(QUESTION), emph_ext.logits(QUESTION))
    assert dup_ext.generate(QUESTION, 12) == emph_ext.generate(QUESTION, 12)
    assert dup.generate(QUESTION, 12) == emphasized.generate(QUESTION, 12)


# ------------------------------------------------------------------ direction of emphasis


def test_emphasize_raises_and_suppress_lowers_the_attention_share(tiny):
    _, model, tok = tiny
    state = capture_records(model, tok)
    share = kvedit.attention_share(state, QUESTION, SPAN).total[0]
    up = kvedit.attention_share(ops.emphasize(state, SPAN, 2.0), QUESTION, SPAN).total[0]
    down = kvedit.attention_share(ops.suppress(state, SPAN, 2.0), QUESTION, SPAN).total[0]
    assert down < share - 1e-3 and up > share + 1e-3
    more = kvedit.attention_share(ops.duplicate(state, SPAN, 3), QUESTION, SPAN).total[0]
    assert more > share + 1e-3


# ----------------------------------------------------------------------------------- layers


@pytest.mark.parametrize(
    "edit",
    [
        lambda s, layers: ops.emphasize(s, SPAN, 2.0, layers=layers),
        lambda s, layers: ops.suppress(s, SPAN, 2.0, layers=layers),
        lambda s, layers: ops.scale_keys(s, SPAN, 2.0, layers=layers),
    ],
    ids=["emphasize", "suppress", "scale_keys"],
)
def test_layers_restrict_which_layers_an_edit_touches(llama, edit):
    model, tok = llama
    state = capture_records(model, tok)
    for layers in ([0], [1, 2]):
        out = edit(state, layers)
        assert unchanged_layers(state, out) == [i for i in range(3) if i not in layers]
    with pytest.raises(EmptySelectionError, match="layers is empty"):
        edit(state, [])
    everywhere = edit(state, None)
    assert unchanged_layers(state, everywhere) == []
    # an edit of the last layer alone still changes the prediction
    assert differs(edit(state, [2]).logits(QUESTION), state.logits(QUESTION), by=1e-5)


# ------------------------------------------------------------------------------- scale_keys


def record_attend_inputs(monkeypatch):
    """Patch the seam's ``attend`` to record ``(query, key, kwargs)`` of every call."""
    calls = []
    real = ka.attend

    def spy(q, k, v, **kwargs):
        calls.append((q.clone(), k.clone(), kwargs))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(seam, "attend", spy)  # the seam calls it by this name
    return calls


def test_scale_keys_scales_the_span_logits_of_the_chosen_layers(llama, monkeypatch):
    model, tok = llama
    state = capture_records(model, tok)
    tokens = state.token_indices(SPAN)
    factor, layer = 1.8, 1
    scaled = ops.scale_keys(state, SPAN, factor, layers=[layer])
    assert unchanged_layers(state, scaled) == [0, 2]
    old, new = state.layers[layer], scaled.layers[layer]
    entries = old.entries_for(tokens)
    rest = old.token_index != len(state) - 1  # the last token is recomputed
    rest[entries] = False
    close(new.keys[:, :, entries], factor * old.keys[:, :, entries], atol=0, rtol=1e-6)
    assert torch.equal(new.keys[:, :, rest], old.keys[:, :, rest])
    mine = old.token_index != len(state) - 1
    assert torch.equal(new.values[:, :, mine], old.values[:, :, mine]) and new.bias is None

    calls = record_attend_inputs(monkeypatch)
    state.logits(QUESTION)
    scaled.logits(QUESTION)
    n_layers = len(state.layers)
    (q0, k0, kw0), (q1, k1, kw1) = calls[layer], calls[n_layers + layer]
    torch.testing.assert_close(q1, q0, atol=1e-5, rtol=0)  # layers below are untouched
    # probabilities with scaled keys == softmax of the original logits, span columns times f
    probs = ka.attention_probs(q1, k1, scale=kw1["scale"])
    G = q0.shape[1] // k0.shape[1]
    logits = q0.double() @ k0.double().repeat_interleave(G, dim=1).transpose(-1, -2)
    logits = logits * kw0["scale"]
    logits[..., entries] *= factor
    n_cache, n_q = len(old), q0.shape[2]
    causal = torch.ones(n_q, n_q, dtype=torch.bool).tril()
    mask = torch.cat([torch.ones(n_q, n_cache, dtype=torch.bool), causal], dim=1)
    expected = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    close(probs.double(), expected, atol=1e-5, rtol=0)
    assert differs(probs, ka.attention_probs(q0, k0, scale=kw0["scale"]), by=1e-4)


# ------------------------------------------------------------------------ gemma3 sliding layers


def sliding_and_global(state):
    sliding = [i for i, layer in enumerate(state.layers) if layer.window is not None]
    return sliding, [i for i in range(len(state.layers)) if i not in sliding]


def test_gemma3_edits_touch_only_the_layers_that_hold_the_span(gemma3):
    model, tok = gemma3
    state = capture_records(model, tok, RECORDS * 2)
    sliding, global_ = sliding_and_global(state)
    assert sliding == [0, 1, 3] and global_ == [2]
    early = (0, len("Alice's secret number is 4821"))  # the first occurrence only
    late = "Frank's secret number is 6611"  # the last occurrence is inside the window
    assert state.token_indices(early).max() < len(state) - TINY_SLIDING_WINDOW
    edits = [
        (lambda s, span: ops.emphasize(s, span, 2.0), False),
        (lambda s, span: ops.suppress(s, span, 2.0), False),
        (lambda s, span: ops.scale_keys(s, span, 2.0), False),
        (lambda s, span: ops.duplicate(s, span, 2), True),  # never on sliding layers
    ]
    plain = state.logits(QUESTION)
    for edit, skips_sliding in edits:
        out = edit(state, early)
        assert unchanged_layers(state, out) == sliding
        assert differs(out.logits(QUESTION), plain, by=1e-5)
        assert unchanged_layers(state, edit(state, late)) == (sliding if skips_sliding else [])
    dup = ops.duplicate(state, early, 2)
    n_early = state.token_indices(early).numel()
    assert [len(layer) for layer in dup.layers] == [
        len(layer) + (2 * n_early if layer.window is None else 0) for layer in state.layers
    ]
    # on the global layer alone, duplication is still the exact log(copies + 1) bias
    close(dup.logits(QUESTION), ops.emphasize(state, early, math.log(3)).logits(QUESTION))


# -------------------------------------------------------------------------------------- reread


def test_reread_equals_a_forward_over_the_text_plus_the_span(tiny):
    arch, model, tok = tiny
    state = capture_records(model, tok, RECORDS * 2 if arch == "gemma3" else RECORDS)
    spans = ["Carol's secret number is 5902.", "Bob"]
    tokens = state.token_indices(spans)
    n = tokens.numel()
    out = ops.reread(state, spans)
    assert out.next_position == state.next_position + n
    assert len(out) == len(state) and out.text == state.text
    new_positions = torch.arange(len(state), len(state) + n)
    for before, after in zip(state.layers, out.layers):
        held = n if after.window is None else min(n, after.window)  # sliding: the last ones
        assert len(after) == (len(before) + n if after.window is None else after.window)
        assert torch.equal(after.token_index[-held:], tokens[-held:])  # original token indices
        assert torch.equal(after.positions[-held:], new_positions[-held:])
    question = tok(QUESTION, add_special_tokens=False)["input_ids"]
    ids = state.token_ids.tolist() + state.token_ids[tokens].tolist() + question
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0].float()
    start = len(state) + n - 1
    close(out.logits(QUESTION), full[start : start + len(question)])
    assert out.generate(QUESTION, 6) == tok.decode(
        model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids) :],
        skip_special_tokens=True,
    )


def test_reread_equals_extending_with_the_span_text_also_on_an_edited_state(llama):
    """Re-read tokens see the stored bias, as any continuation does."""
    model, tok = llama
    plain = capture_records(model, tok)
    tokens = plain.token_indices(SPAN)
    span_text = tok.decode(plain.token_ids[tokens])
    assert tok(span_text, add_special_tokens=False)["input_ids"] == plain.token_ids[tokens].tolist()
    for state in (plain, ops.emphasize(plain, "Bob's secret number is 7310", 3.0)):
        reread = ops.reread(state, SPAN)
        extended = state.extend(span_text)
        assert reread.next_position == extended.next_position
        close(reread.last_logits, extended.last_logits)
        close(reread.logits(QUESTION), extended.logits(QUESTION))


def test_reread_with_separator_marks_separator_entries_as_non_text(llama):
    model, tok = llama
    state = capture_records(model, tok)
    sep = tok("\n", add_special_tokens=False)["input_ids"]
    tokens = state.token_indices(SPAN)
    out = ops.reread(state, SPAN, separator="\n")
    n = len(sep) + tokens.numel()
    assert out.next_position == state.next_position + n
    index = out.layers[0].token_index[-n:]
    assert torch.equal(index, torch.cat([torch.full((len(sep),), -1), tokens]))
    ids = state.token_ids.tolist() + sep + state.token_ids[tokens].tolist()
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0, -1].float()
    close(out.last_logits, full)
    # span lookups find both readings
    share = kvedit.attention_share(out, QUESTION, SPAN)
    assert share.total[0] > kvedit.attention_share(state, QUESTION, SPAN).total[0]


# -------------------------------------------------------------------------------------- errors


def test_ops_raise_for_missing_and_empty_spans(llama):
    model, tok = llama
    state = capture_records(model, tok)
    for op in (
        ops.emphasize,
        ops.suppress,
        lambda s, span: ops.scale_keys(s, span, 2.0),
        ops.duplicate,
        ops.reread,
    ):
        with pytest.raises(SpanNotFoundError, match="Zed"):
            op(state, "Zed's number")
        with pytest.raises(SpanNotFoundError):
            op(state, (0, len(state.text) + 1))
        with pytest.raises(ValueError, match="empty"):
            op(state, "")
        with pytest.raises(ValueError, match="empty"):
            op(state, ["Carol", ""])


@pytest.mark.parametrize(
    "call",
    [
        lambda s: ops.duplicate(s, SPAN, -1),
        lambda s: ops.duplicate(s, SPAN, 1.5),
        lambda s: ops.duplicate(s, SPAN, True),
        lambda s: ops.scale_keys(s, SPAN, float("nan")),
        lambda s: ops.scale_keys(s, SPAN, float("inf")),
        lambda s: ops.emphasize(s, SPAN, float("nan")),
        lambda s: ops.emphasize(s, SPAN, float("inf")),
        lambda s: ops.suppress(s, SPAN, float("nan")),
        lambda s: ops.suppress(s, SPAN, -float("inf")),
        lambda s: ops.emphasize(s, SPAN, 1.0, layers=[3]),
        lambda s: ops.emphasize(s, SPAN, 1.0, layers=[-1]),
        lambda s: ops.suppress(s, SPAN, 1.0, layers=[0, 7]),
        lambda s: ops.scale_keys(s, SPAN, 2.0, layers=[3]),
        lambda s: ops.reread(s.replace(model=None), SPAN),
    ],
    ids=[
        "copies-negative",
        "copies-float",
        "copies-bool",
        "factor-nan",
        "factor-inf",
        "strength-nan",
        "strength-inf",
        "suppress-nan",
        "suppress-inf",
        "layer-3-of-3",
        "layer-negative",
        "suppress-layer-7",
        "scale-layer-3",
        "reread-without-model",
    ],
)
def test_ops_reject_bad_arguments(llama, call):
    model, tok = llama
    state = capture_records(model, tok)
    before = snapshot(state)
    with pytest.raises(ValueError):
        call(state)
    assert same(snapshot(state), before)


def test_emphasize_takes_one_strength_per_layer(llama):
    model, tok = llama
    state = capture_records(model, tok)
    strengths = [0.5, 0.0, 2.5]
    once = ops.emphasize(state, SPAN, strengths)
    by_layer = state
    for i, s in enumerate(strengths):
        if s:
            by_layer = ops.emphasize(by_layer, SPAN, s, layers=[i])
    tokens = state.token_indices(SPAN)
    for i, (a, b) in enumerate(zip(once.layers, by_layer.layers, strict=True)):
        entries = a.entries_for(tokens)
        assert torch.all(a.dense_bias()[..., entries] == strengths[i])
        close(a.dense_bias(), b.dense_bias(), atol=0, rtol=0)
    close(once.last_logits, by_layer.last_logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidInputError, match="2 per-layer strengths for a 3-layer state"):
        ops.emphasize(state, SPAN, [1.0, 2.0])
