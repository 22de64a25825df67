"""Every entry point that adds tokens to a state checks, before any work, that the state's next
position plus the new tokens (plus the tokens to decode) fits the model's positions, and says
the numbers. The limit is the state's own ``max_positions`` (set at capture or load, carried to
every derived state; None: the model config's), never a module-wide setting; apart from it, one
call adds at most :data:`kvedit.checks.MAX_TOKENS_PER_CALL` tokens (a memory bound)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import RECORDS

import kvedit
from kvedit import checks, ops
from kvedit.errors import InvalidInputError


@pytest.fixture()
def near_full(llama):
    """A state with 6 positions left before its limit (``max_positions`` at capture)."""
    model, tok = llama
    n = len(tok(RECORDS)["input_ids"])
    return kvedit.capture(model, tok, RECORDS, max_positions=n + 6)


LONG = " and then some more words follow here" * 3


@pytest.mark.parametrize(
    "use",
    [
        lambda s: s.extend(LONG),
        lambda s: s.logits(LONG),
        lambda s: s.generate(" Who?", 200),
        lambda s: s.generate("", 7),
        lambda s: s.answer(LONG, 1),
        lambda s: kvedit.attention_share(s, LONG, ["Bob"]),
        lambda s: s.extend("x" * 2_000_000),
    ],
    ids=["extend", "logits", "generate", "generate-no-prompt", "answer", "share", "2MB"],
)
def test_past_the_positions_is_refused_with_the_numbers(near_full, use):
    limit = near_full.next_position + 6
    with pytest.raises(InvalidInputError, match=f"at most {limit} positions.*next position"):
        use(near_full)


def test_within_the_positions_still_runs(near_full):
    assert isinstance(near_full.generate(" Who", 3), str)
    assert len(near_full.extend(" Bob.")) > len(near_full)


def test_the_limit_counts_positions_not_cache_entries(llama):
    """``duplicate`` adds entries at old positions; ``reread`` advances the positions."""
    model, tok = llama
    n = len(tok(RECORDS)["input_ids"])
    state = kvedit.capture(model, tok, RECORDS, max_positions=n + 4)
    doubled = ops.duplicate(state, "Bob", 4)
    assert doubled.cache_length > doubled.next_position
    assert isinstance(doubled.generate("", 3), str)  # the copies take no position
    reread = ops.reread(state, "Bob")
    with pytest.raises(InvalidInputError, match="next position"):
        reread.generate(" Who is Bob?", 3)


def test_a_long_focus_question_is_refused_before_scoring(near_full):
    with pytest.raises(InvalidInputError, match="positions"):
        kvedit.focus(near_full, "Which secret number does Bob hold in this long list?" * 3)


# ------------------------------------------------------------------------ the field


def test_every_derived_state_keeps_the_limit(llama, tmp_path):
    model, tok = llama
    limit = 3000
    state = kvedit.capture(model, tok, RECORDS, max_positions=limit)
    derived = {
        "extend": state.extend(" More."),
        "emphasize": ops.emphasize(state, "Bob", 2.0),
        "duplicate": ops.duplicate(state, "Bob", 2),
        "reread": ops.reread(state, "Bob"),
        "copy": state.copy(),
        "to": state.to("cpu"),
        "focus": kvedit.focus(state, " Which number does Bob hold?", guard=None).state,
    }
    for name, s in derived.items():
        assert s.max_positions == limit, name
    # a runtime setting, not content: the digest and the file do not hold it
    plain = kvedit.capture(model, tok, RECORDS)
    assert plain.max_positions is None and plain.digest == state.digest
    path = state.save(tmp_path / "s.safetensors")
    assert kvedit.load_state(path, model, tok).max_positions is None
    loaded = kvedit.load_state(path, model, tok, max_positions=len(state) + 1)
    assert loaded.max_positions == len(state) + 1 and loaded.digest == state.digest
    with pytest.raises(InvalidInputError, match=f"at most {len(state) + 1} positions"):
        loaded.extend(" Bob holds 17.")  # the loader's limit reaches the next call


def test_a_bad_limit_is_refused_as_an_argument(llama, tmp_path):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    with pytest.raises(InvalidInputError, match="max_positions"):
        state.replace(max_positions=0)
    path = state.save(tmp_path / "s.safetensors")
    with pytest.raises(InvalidInputError, match="max_positions"):  # not a corrupt file
        kvedit.load_state(path, model, tok, max_positions=-1)


def test_a_limit_above_the_config_reaches_later_calls(llama, monkeypatch):
    """A model whose config understates its context: the capture's keyword lets every later
    call on the state (and on states made from it) run past the config's number."""
    model, tok = llama
    n = len(tok(RECORDS)["input_ids"])
    monkeypatch.setattr(model.config.get_text_config(), "max_position_embeddings", n + 1)
    with pytest.raises(InvalidInputError, match=f"at most {n + 1} positions"):
        kvedit.capture(model, tok, RECORDS).generate(" Who?", 3)
    state = ops.emphasize(kvedit.capture(model, tok, RECORDS, max_positions=4096), "Bob", 1.0)
    assert isinstance(state.extend(" Who holds 17?").generate("", 3), str)


# ------------------------------------------------------------------------ the memory bound


@pytest.fixture()
def unbounded(llama, monkeypatch):
    """The tiny Llama with no maximum in its config, and a state of it; its forward pass fails
    the test (a refusal must come before it)."""
    model, tok = llama
    config = model.config.get_text_config()
    monkeypatch.delattr(config, "max_position_embeddings")  # and the class's default:
    monkeypatch.delattr(type(config), "max_position_embeddings", raising=False)
    assert checks.positions_limit(model) is None
    state = kvedit.capture(model, tok, RECORDS)

    def no_forward(*args, **kwargs):
        raise AssertionError("the forward pass ran")

    monkeypatch.setattr(model, "forward", no_forward)
    return state


HUGE = "word " * 400_000  # 2 MB


@pytest.mark.parametrize(
    "use",
    [
        lambda s: s.extend(HUGE),
        lambda s: s.generate(HUGE, 3),
        lambda s: s.logits(HUGE),
        lambda s: kvedit.attention_share(s, HUGE, ["Bob"]),
        lambda s: s.generate("", checks.MAX_TOKENS_PER_CALL + 1),
    ],
    ids=["extend", "generate", "logits", "share", "decode-past-the-bound"],
)
def test_a_model_without_a_maximum_is_bounded_per_call(unbounded, use):
    limit = checks.MAX_TOKENS_PER_CALL
    with pytest.raises(InvalidInputError, match=rf"tokens in all: one call adds at most {limit}"):
        use(unbounded)


def test_capture_is_bounded_too(unbounded):
    model, tok = unbounded.model, unbounded.tokenizer
    with pytest.raises(InvalidInputError, match=f"at most {checks.MAX_TOKENS_PER_CALL} tokens"):
        kvedit.capture(model, tok, HUGE)


def test_the_bound_leaves_the_bundled_models_their_context():
    # Gemma-3 attends to 32,768 positions (SmolLM2 8,192): a full context and its answer pass
    checks.call_size(n_tokens=32_768 - 64, reserve=64, what="context")
    with pytest.raises(InvalidInputError, match="131073 tokens in all"):
        checks.call_size(n_tokens=checks.MAX_TOKENS_PER_CALL, reserve=1, what="context")


def test_the_entry_points_that_take_a_text_take_the_limit(llama, tmp_path):
    from kvedit.store import KVStore

    model, tok = llama
    store = KVStore(tmp_path / "store", memory_bytes=2**30)  # the memory tier keeps objects
    state, first = kvedit.reuse(model, tok, RECORDS, store, max_positions=3000)
    assert state.max_positions == 3000
    assert store.get(first.key, model, tok).max_positions is None  # a setting, not stored
    again, report = kvedit.reuse(model, tok, RECORDS + " More.", store)
    assert report.tokens_reused > 0 and again.max_positions is None  # the call's, not the entry's
    assert kvedit.reuse(model, tok, RECORDS, store, max_positions=99)[0].max_positions == 99
    blended, _ = kvedit.blend(model, tok, ["Prefix. ", " A passage."], store, max_positions=3000)
    assert blended.max_positions == 3000
    found = kvedit.focus_text(model, tok, RECORDS, "What does Bob hold?", max_positions=3000)
    assert found.state.max_positions == 3000
    with pytest.raises(InvalidInputError, match=r"prompt is \d+ tokens long .* attends to 40 pos"):
        kvedit.steer(model, tok, emphasize="Bob", max_positions=40).generate(RECORDS)


def test_global_layers_are_those_without_a_window(llama, gemma3):
    """Gemma-3's sliding layers are not global; every layer of a model without them is; the
    cache length is counted on the global layers."""
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    assert state.global_layers == tuple(range(len(state.layers)))
    model, tok = gemma3
    state = kvedit.capture(model, tok, RECORDS * 3)
    windows = [layer.window for layer in state.layers]
    assert state.global_layers == tuple(i for i, w in enumerate(windows) if w is None)
    assert 0 < len(state.global_layers) < len(state.layers)
    assert state.cache_length == max(len(state.layers[i]) for i in state.global_layers)
    assert state.counted_layers == state.global_layers


def test_every_layer_counts_when_every_layer_slides(llama):
    """A model whose layers all slide has no global layer: a length and a memory budget then
    count every layer (KVState.counted_layers)."""
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    sliding = state.replace(
        layers=[dataclasses.replace(layer, window=10_000) for layer in state.layers]
    )
    assert sliding.global_layers == ()
    assert sliding.counted_layers == tuple(range(len(state.layers)))
    assert sliding.cache_length == len(state)
