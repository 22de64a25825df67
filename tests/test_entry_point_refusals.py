"""Entry points refuse what they cannot use before any work: a guard given as a class, a guard
whose ``decide`` cannot take kvedit's keywords or returns no verdict, a ``SupportGuard`` with a
``read`` that is no function, an ``edit`` that is not ``(state, spans) -> state`` of the same
model and tokens, ``blend`` parts given as a generator (accepted), ``reuse``'s text and store,
``reread``'s separator and positions, ``publish``'s empty question; and a save sweeps what a
killed save of the same file left."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import RECORDS

import kvedit
from kvedit import ops
from kvedit.errors import InvalidInputError, InvalidTypeError, StateAlteredError
from kvedit.focusing import choice
from kvedit.focusing.guard import AgreementGuard, SupportGuard
from kvedit.store import KVStore

QUESTION = "\n\nQuestion: What is Carol's secret number?"


@pytest.fixture
def state(llama):
    model, tok = llama
    return kvedit.capture(model, tok, RECORDS)


@pytest.fixture
def no_scoring(monkeypatch):
    """Make any scoring fail the test: a refusal must come before it."""
    monkeypatch.setattr(choice, "chosen", lambda *a, **k: pytest.fail("scored before refusing"))


# ---------------------------------------------------------------------------- guards


def test_a_guard_class_is_refused_with_a_hint_to_pass_an_instance(state, llama, no_scoring):
    with pytest.raises(InvalidTypeError, match=r"pass an instance, SupportGuard\(\)"):
        kvedit.focus(state, QUESTION, guard=SupportGuard)
    model, tok = llama
    with pytest.raises(InvalidTypeError, match=r"pass an instance, AgreementGuard\(\)"):
        kvedit.steer(model, tok, focus=True, question="Carol's number?", guard=AgreementGuard)


class NoOthers:
    def decide(self, original, edited, continuation, *, evidence=(), query=None):
        raise AssertionError("never called")


class NoOutside:  # the guard protocol before it passed the prompt's frame
    def decide(self, original, edited, continuation, *, evidence=(), others=(), query=None):
        raise AssertionError("never called")


class Positional:
    def decide(self, original, edited):
        raise AssertionError("never called")


class AnyKeywords:
    def decide(self, original, edited, continuation, **kwargs):
        return AgreementGuard(max_new_tokens=2).decide(original, edited, continuation)


@pytest.mark.parametrize(
    ("guard", "match"),
    [
        (NoOthers(), "NoOthers.decide .*takes no keyword others="),
        (NoOutside(), "NoOutside.decide .*takes no keyword outside="),
        (Positional(), "Positional"),
    ],
)
def test_a_decide_that_cannot_take_what_focus_passes_is_refused_before_work(
    state, no_scoring, guard, match
):
    with pytest.raises(InvalidTypeError, match=match):
        kvedit.focus(state, QUESTION, guard=guard)


def test_a_decide_taking_kwargs_is_accepted(state):
    found = kvedit.focus(state, QUESTION, guard=AnyKeywords(), threshold=None)
    assert found.chosen and found.verdict is not None


@pytest.mark.parametrize("returned", [True, None])
def test_a_decide_that_returns_no_verdict_is_a_clear_error(state, returned):
    class Says:
        def decide(
            self, original, edited, continuation, *, evidence=(), others=(), query=None, outside=""
        ):
            return returned

    with pytest.raises(InvalidTypeError, match=rf"guard Says.decide returned {returned!r}"):
        kvedit.focus(state, QUESTION, guard=Says(), threshold=None)


@pytest.mark.parametrize("read", [5, "first line", lambda: "x"], ids=["int", "str", "no-arg"])
def test_support_guard_refuses_a_read_that_is_no_function_at_construction(read):
    with pytest.raises(InvalidTypeError, match="read must be a function"):
        SupportGuard(read=read)


def test_support_guard_refuses_a_read_that_returns_no_text(state):
    guard = SupportGuard(read=lambda text: None, max_new_tokens=2)
    with pytest.raises(InvalidTypeError, match="read .* returned None"):
        kvedit.focus(state, QUESTION, guard=guard, threshold=None)
    assert SupportGuard(read=str.strip).read is str.strip  # a function of the text is fine


# ---------------------------------------------------------------------------- edits


def test_an_edit_that_cannot_take_state_and_spans_is_refused_before_work(state, no_scoring):
    with pytest.raises(InvalidTypeError, match=r"edit must be a function \(state, spans\)"):
        kvedit.focus(state, QUESTION, edit=lambda st: st)


def test_an_edit_returning_another_models_state_is_refused(state, gemma3):
    model, tok = gemma3
    other = kvedit.capture(model, tok, RECORDS)
    with pytest.raises(InvalidInputError, match="differs in its model fingerprint"):
        kvedit.focus(state, QUESTION, edit=lambda st, spans: other, threshold=None, guard=None)
    state.check_unaltered()  # the focused state is as it was


def test_an_edit_returning_a_state_of_other_tokens_is_refused(state, llama):
    model, tok = llama
    shorter = kvedit.capture(model, tok, RECORDS[:60])
    with pytest.raises(InvalidInputError, match="differs in its token ids"):
        kvedit.focus(state, QUESTION, edit=lambda st, spans: shorter, threshold=None, guard=None)


def test_an_edit_that_writes_the_focused_state_in_place_is_refused(state):
    def in_place(st, spans):
        st.layers[0].keys.mul_(2)
        return st

    with pytest.raises(StateAlteredError, match="focus with edit 'in_place'"):
        kvedit.focus(state, QUESTION, edit=in_place, threshold=None, guard=None)


def test_a_real_edit_is_accepted(state):
    found = kvedit.focus(state, QUESTION, edit=ops.reread, threshold=None, guard=None)
    assert found.state is not state and torch.equal(found.state.token_ids, state.token_ids)


# ---------------------------------------------------------------------------- blend

PARTS = [
    "Records follow.\n",
    "Alice's secret number is 4821. Bob's secret number is 7310. ",
    "Carol's secret number is 5902. Dave's secret number is 1234. ",
]


def test_blend_accepts_parts_as_a_generator(llama, tmp_path):
    model, tok = llama
    listed, _ = kvedit.blend(model, tok, PARTS, KVStore(tmp_path / "a"), recompute=0.5)
    generated, report = kvedit.blend(
        model, tok, (p for p in PARTS), KVStore(tmp_path / "b"), recompute=0.5
    )
    assert len(report.parts) == len(PARTS)
    assert generated.text == listed.text
    assert torch.equal(generated.token_ids, listed.token_ids)
    torch.testing.assert_close(generated.last_logits, listed.last_logits)


@pytest.mark.parametrize("parts", [set(PARTS), 5], ids=["set", "int"])
def test_blend_refuses_unordered_or_non_iterable_parts(llama, tmp_path, parts):
    model, tok = llama
    store = KVStore(tmp_path)
    with pytest.raises(InvalidTypeError, match="ordered iterable"):
        kvedit.blend(model, tok, parts, store)
    assert store.stats()["entries"] == 0


@pytest.mark.parametrize("text", ["", None, b"abc"], ids=["empty", "none", "bytes"])
def test_reuse_refuses_a_text_that_is_not_a_non_empty_str(llama, tmp_path, text):
    model, tok = llama
    store = kvedit.KVStore(tmp_path)
    error = InvalidInputError if text == "" else InvalidTypeError
    with pytest.raises(error, match="text"):
        kvedit.reuse(model, tok, text, store)
    assert store.stats()["entries"] == 0


def test_reuse_refuses_a_store_that_is_not_one(llama):
    model, tok = llama
    with pytest.raises(InvalidTypeError, match="store must be a kvedit.KVStore"):
        kvedit.reuse(model, tok, RECORDS, {"not": "a store"})


def test_reread_refuses_a_separator_that_is_not_a_str(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    with pytest.raises(InvalidTypeError, match="separator"):
        ops.reread(state, "Bob", separator=5)


def test_reread_refuses_to_run_past_the_models_positions(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    state = state.replace(max_positions=state.next_position + 2)
    with pytest.raises(InvalidInputError, match="re-read"):
        ops.reread(state, RECORDS[:60])


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_save_sweeps_what_a_killed_save_of_the_same_file_left(llama, tmp_path):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    dead = tmp_path / f".state.kv.kvedit-tmp-{_dead_pid()}-0123456789abcdef"
    dead.mkdir()
    (dead / "state.kv").write_bytes(b"half a file")
    alive = tmp_path / f".state.kv.kvedit-tmp-{os.getpid()}-fedcba9876543210"
    alive.mkdir()
    other = tmp_path / f".other.kv.kvedit-tmp-{_dead_pid()}-0123456789abcdef"
    other.mkdir()
    old = time.time() - 120
    for leftover in (dead, alive, other):
        os.utime(leftover, (old, old))
    state.save(tmp_path / "state.kv")
    assert not dead.exists()  # its writer is dead: swept
    assert alive.exists() and other.exists()  # a live writer's, another file's: kept
    assert kvedit.load_state(tmp_path / "state.kv", model, tok).is_plain_capture
