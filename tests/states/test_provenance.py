"""Provenance: every state says how it was made (``KVState.history``), every transformation
records a step, ``KVState.digest`` names content, and ops compose after ``reread``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import RECORDS

import kvedit
from kvedit import compress, ops
from kvedit.provenance import History, Origin, Step, cast_step, content_digest, token_ranges
from kvedit.states.passes import run_model
from kvedit.testing import tiny_model

GOLD = "Carol's secret number is 5902."


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def state(llama):
    model, tok = llama
    return kvedit.capture(model, tok, RECORDS * 2)


# ------------------------------------------------------------------ the data model


def test_history_units():
    captured = History.captured(torch.bfloat16)
    assert captured.known and captured.plain and captured.origin.params == {"dtype": "bfloat16"}
    assert not History.unknown().known and "unknown" in History.unknown().first_change()
    edit = Step("edit", "scale_keys", {"tokens": [[3, 6]], "factor": 1.5})
    assert "scale_keys" in captured.then(edit).first_change()
    assert not captured.then(Step("compression", "quantize", {}, exact=False)).exact
    lossy = cast_step(torch.float32, torch.bfloat16)
    assert not lossy.exact and cast_step("bfloat16", "float32").exact
    assert cast_step(torch.float16, torch.bfloat16).exact is False  # neither holds the other
    assert captured.then(lossy).first_change(["bfloat16"]) is None
    assert captured.then(lossy).first_change() is not None
    # an exact cast undone by the next, with nothing between, is no step at all
    up = Step("cast", "cast", {**cast_step("bfloat16", "float32").params, "at_tokens": 5})
    down = Step("cast", "cast", {**cast_step("float32", "bfloat16").params, "at_tokens": 5}, False)
    assert captured.then(up).then(down) == captured
    later = Step("cast", "cast", {**down.params, "at_tokens": 9}, False)  # extended between
    assert len(captured.then(up).then(later).steps) == 2
    with pytest.raises(ValueError):
        Step("magic", "x")
    with pytest.raises(ValueError):
        Origin("magic")
    assert token_ranges(torch.tensor([9, 3, 4, 5])) == [[3, 6], [9, 10]]
    h = captured.then(edit)
    assert History.from_json(h.to_json()) == h
    assert History.from_json(None, "old.kv") == History.unknown() and "old.kv" in str(
        History.from_json(None, "old.kv")
    )
    # the digest: model, ids, history; never the path a file was read from
    d = content_digest("m", [1, 2], h)
    assert d == content_digest("m", [1, 2], h.read_from("/x.kv"))
    assert d != content_digest("m", [1, 2, 3], h) != content_digest("n", [1, 2], h)
    assert d != content_digest("m", [1, 2], captured)


def test_digest_names_content(llama, tmp_path):
    """Capture twice: the same digest; scale_keys: another; capture, save, load: the same."""
    model, tok = llama
    a, b = kvedit.capture(model, tok, RECORDS), kvedit.capture(model, tok, RECORDS)
    assert a.digest == b.digest and len(a.digest) == 32
    assert ops.scale_keys(a, "Carol", 1.5).digest != a.digest
    assert ops.scale_keys(a, "Carol", 1.5).digest == ops.scale_keys(b, "Carol", 1.5).digest
    assert ops.scale_keys(a, "Carol", 1.5).digest != ops.scale_keys(a, "Carol", 1.25).digest
    assert ops.scale_keys(a, "Carol", 1.5).digest != ops.scale_keys(a, "Bob", 1.5).digest
    a.save(tmp_path / "a.kv")
    assert kvedit.load_state(tmp_path / "a.kv", model, tok).digest == a.digest
    assert kvedit.capture(model, tok, RECORDS + " x").digest != a.digest
    # an edit before an extension is not the same edit after it
    ext = " Grace's secret number is 4444."
    before = ops.emphasize(a, "Carol", 2.0).extend(ext)
    after = ops.emphasize(a.extend(ext), "Carol", 2.0)
    assert before.digest != after.digest


def test_repr_and_explain_print_the_history(state):
    edited = ops.quantize(ops.emphasize(state, "Carol", 2.0), bits=4)
    text = edited.explain()
    assert "origin: capture" in text and "emphasize" in text and "quantize" in text
    assert text.index("emphasize") < text.index("quantize")
    assert "emphasize" in repr(edited) and edited.digest[:12] in repr(edited)
    assert "plain capture" in state.explain()


# ------------------------------------------------------------------ every op records its step

# name -> (call, kind, exact): every public transformation of kvedit.ops and kvedit.compress
TRANSFORMS = {
    "emphasize": (lambda s: ops.emphasize(s, "Carol", 2.0), "edit", True),
    "suppress": (lambda s: ops.suppress(s, "Carol", 2.0), "edit", True),
    "scale_keys": (lambda s: ops.scale_keys(s, "Carol", 1.5), "edit", True),
    "duplicate": (lambda s: ops.duplicate(s, "Carol", 2), "edit", True),
    "reread": (lambda s: ops.reread(s, GOLD), "reread", True),
    "select": (lambda s: compress.select(s, "knorm", 0.5), "compression", False),
    "snapkv": (lambda s: ops.snapkv(s, keep=0.5, window=4), "compression", False),
    "quantize": (lambda s: ops.quantize(s, bits=4), "compression", False),
    "minicache": (lambda s: ops.minicache(s, start=0.0), "compression", False),
}


def test_every_public_transformation_is_listed():
    """A new op must be added to TRANSFORMS (and so record a step) to pass."""
    public = set()
    for name in (*ops.__all__, *compress.__all__):
        obj = getattr(ops, name) if name in ops.__all__ else getattr(compress, name)
        if callable(obj) and not isinstance(obj, type):
            public.add(name)
    helpers = {  # functions of the packages that build no state
        "adaptive_budgets",
        "keep_mask",
        "live_entries",
        "make_scorer",
        "masked_union",
        "merge_layers",
        "merge_plan",
        "protected_tokens",
        "rank_keep",
        "register_scorer",
        "slerp",
    }
    assert public - helpers == set(TRANSFORMS)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transformation_records_its_step(state, name):
    call, kind, exact = TRANSFORMS[name]
    base = ops.emphasize(state, "Bob", 1.0)  # one step already: the new one goes after it
    out = call(base)
    assert out.history.origin == base.history.origin
    assert out.history.steps[:-1] == base.history.steps, "exactly one step, appended"
    step = out.history.steps[-1]
    assert (step.name, step.kind, step.exact) == (name, kind, exact)
    assert step.params["at_tokens"] == len(base)
    assert out.digest != base.digest and not out.is_plain_capture
    assert name in str(step) and name in str(out.history) and name in out.explain()
    assert base.history.steps == (base.history.steps[0],)  # the input is untouched


def test_step_parameters_name_what_was_done(state):
    carol = state.token_indices("Carol")
    step = ops.scale_keys(state, "Carol", 1.5, layers=[1]).history.steps[-1]
    assert step.params["factor"] == 1.5 and step.params["layers"] == [1]
    assert step.params["tokens"] == token_ranges(carol)
    step = ops.emphasize(state, "Carol", [1.0, 2.0, 3.0]).history.steps[-1]
    assert step.params["strength"] == [1.0, 2.0, 3.0]
    step = ops.quantize(state, bits=2, residual=8, group=16).history.steps[-1]
    assert (step.params["bits"], step.params["residual"], step.params["group"]) == (2, 8, 16)


# ------------------------------------------------------------------ reread composes


def _hand_built(r, edit_layer) -> torch.Tensor:
    """The last logits of ``r`` with ``edit_layer(i, layer)`` applied to every layer and the
    last input (the last re-read token, at its position) run again over every other entry."""
    model, _ = r.require_model()
    t, pos = r.last_input
    layers = []
    for i, layer in enumerate(r.layers):
        layer = edit_layer(i, layer)
        mine = (layer.token_index == t) & (layer.positions == pos)
        layers.append(layer.select((~mine).nonzero().flatten()))
    logits, _ = run_model(
        model, layers, torch.tensor([[int(r.token_ids[t])]]), torch.tensor([[pos]]), 1
    )
    return logits[0, -1].float()


def _biased(tokens, strength):
    def edit(i, layer):
        on = torch.isin(layer.token_index, tokens)
        bias = layer.dense_bias().clone()
        bias[:, :, on] += strength
        return dataclasses.replace(layer, bias=bias)

    return edit


def test_reread_knows_its_last_input(state):
    r = ops.reread(state, GOLD)
    gold = state.token_indices(GOLD)
    assert r.last_input == (int(gold[-1]), r.next_position - 1)
    assert state.last_input == (len(state) - 1, len(state) - 1)
    e = r.extend(" Who?")
    assert e.last_input == (len(e) - 1, e.next_position - 1)


@pytest.mark.parametrize("strength", [1e-6, 2.0])
def test_emphasize_after_reread_equals_the_hand_built_edit(state, strength):
    """The bias on both readings of a span, then the last re-read token run again at its own
    position over everything else: exactly what an emphasize after a reread gives."""
    r = ops.reread(state, GOLD)
    out = ops.emphasize(r, "Carol", strength)
    want = _hand_built(r, _biased(state.token_indices("Carol"), strength))
    torch.testing.assert_close(out.last_logits, want, atol=1e-4, rtol=1e-4)


def test_scale_keys_after_reread_covering_the_last_input(state):
    """A span covering the last input: its fresh keys are scaled too, and the text token it was
    re-read from keeps its own (scaled) entry at its own position."""
    r = ops.reread(state, GOLD)
    out = ops.scale_keys(r, GOLD, 1.5)
    tokens = state.token_indices(GOLD)

    def scale(i, layer):
        on = torch.isin(layer.token_index, tokens)
        keys = layer.keys.clone()
        keys[:, :, on] *= 1.5
        return dataclasses.replace(layer, keys=keys)

    torch.testing.assert_close(out.last_logits, _hand_built(r, scale), atol=1e-4, rtol=1e-4)
    t, pos = r.last_input
    for a, b in zip(out.layers, r.layers, strict=True):
        # the re-read copy of the last input sits where it was, not at the text token's position
        assert bool(((a.token_index == t) & (a.positions == pos)).any())
        assert torch.equal(a.positions.sort().values, b.positions.sort().values)


def test_reread_covering_the_last_text_token_keeps_both_readings(llama):
    """Re-reading the end of the text: the last input is the re-read copy of the last text
    token; an op after it recomputes that copy at its own position and leaves the text
    token's own entry (at the old position) as it was."""
    model, tok = llama
    s = kvedit.capture(model, tok, RECORDS)
    end = (len(RECORDS) - 12, len(RECORDS))
    r = ops.reread(s, end)
    t = len(s) - 1
    assert r.last_input.token_index == t and r.last_input.position == r.next_position - 1
    out = ops.emphasize(r, end, 1e-6)
    for a, b in zip(out.layers, r.layers, strict=True):
        orig, orig_b = (
            (a.token_index == t) & (a.positions == t),
            (b.token_index == t) & (b.positions == t),
        )
        assert int(orig.sum()) == int(orig_b.sum()) == 1
        assert torch.equal(a.keys[:, :, orig], b.keys[:, :, orig_b])  # not overwritten
        assert torch.equal(a.positions.sort().values, b.positions.sort().values)
    assert (out.last_logits - r.last_logits).abs().max() < 1e-3


NEAR_IDENTITY = {
    "emphasize": lambda s: ops.emphasize(s, "Carol", 1e-6),
    "scale_keys": lambda s: ops.scale_keys(s, "Carol", 1 + 1e-6),
    "quantize": lambda s: ops.quantize(s, bits=8, residual=len(s)),
    "quantize-cache": lambda s: ops.quantize(s, bits=8, residual=s.cache_length),
    "quantize-100000": lambda s: ops.quantize(s, bits=8, residual=100000),
}
BEFORE = {
    "reread": lambda s: ops.reread(s, GOLD),
    "reread-sep": lambda s: ops.reread(s, GOLD, separator="\n"),
    "duplicate": lambda s: ops.duplicate(s, GOLD, 1),  # 16 more entries: fewer than a group
    "quantize": lambda s: ops.quantize(s, bits=4, residual=8),
}


@pytest.mark.parametrize("first", sorted(BEFORE))
@pytest.mark.parametrize("then", sorted(NEAR_IDENTITY))
def test_a_near_identity_op_moves_last_logits_by_less_than_1e_3(state, first, then):
    """Each near-identity op (``quantize`` with a residual that leaves nothing to quantize)
    recomputes the last input where it sits: the logits stay put."""
    before = BEFORE[first](state)
    after = NEAR_IDENTITY[then](before)
    assert (after.last_logits - before.last_logits).abs().max() < 1e-3
    assert after.generate("", 8) == before.generate("", 8)


def test_reread_then_emphasize_generates_like_the_hand_built_cache(state):
    r = ops.reread(state, GOLD)
    out = ops.emphasize(r, "Carol", 3.0)
    want = _hand_built(r, _biased(state.token_indices("Carol"), 3.0))
    assert int(out.last_logits.argmax()) == int(want.argmax())


# ------------------------------------------------------------------ observation scorers


def test_observation_window_never_sees_later_positions(state):
    """SnapKV's observation window, run again over the entries before it, must not see the
    re-read copies (later positions): the attention it gives the text's entries is the same
    with or without a reread, and zero on the copies."""
    from kvedit.compress.observe import accumulated_attention, window_attention

    r = ops.reread(state, GOLD, separator="\n")
    for observe in (lambda s: window_attention(s, 4), lambda s: accumulated_attention(s, 16)):
        plain, reread = observe(state), observe(r)
        for i, layer in enumerate(r.layers):
            text = layer.positions < state.next_position
            torch.testing.assert_close(reread[i][..., text], plain[i], atol=1e-5, rtol=1e-4)
            assert float(reread[i][..., ~text].abs().max()) == 0.0


# ------------------------------------------------------------------ no extra model pass


class Forwards:
    """Counts model calls (the top model and its decoder, which blending calls directly)."""

    def __init__(self, model):
        self.n = 0
        self.handles = [m.register_forward_hook(self._count) for m in (model, model.get_decoder())]

    def _count(self, module, args, output):
        self.n += 1

    def close(self):
        for h in self.handles:
            h.remove()


def test_no_extra_model_pass_on_capture_generate_or_load(llama, tmp_path):
    """Provenance is bookkeeping: capture is one pass (a model call and its decoder), load is
    none, generate one per new token after the first."""
    model, tok = llama
    count = Forwards(model)
    try:
        s = kvedit.capture(model, tok, RECORDS)
        assert count.n == 2
        s.save(tmp_path / "s.kv")
        assert count.n == 2
        loaded = kvedit.load_state(tmp_path / "s.kv", model, tok)
        assert count.n == 2
        _ = loaded.digest, loaded.history, repr(loaded), loaded.explain()
        assert count.n == 2
        loaded.answer("", 5, eos_token_id=-1)
        assert count.n == 2 + 2 * 4  # 5 tokens: the first from last_logits
        s.answer(" Who?", 3, eos_token_id=-1)
        assert count.n == 10 + 2 * 3  # the continuation's pass, then 2 more tokens
    finally:
        count.close()
