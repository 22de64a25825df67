"""kvedit.Memory.ask's answer API (#69): the answer streamed as it is decoded (``on_text``:
pieces that concatenate to exactly the answer, nothing handed on later cut), why it ended
(``last_answer``) and a repetition penalty (``repetition_penalty``)."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit.errors import InvalidInputError, InvalidTypeError
from kvedit.memory.answering import Stripped, TextStream, decode
from kvedit.states.decoding import Sampling


def _pair(model, tok, prompt):
    return [kvedit.Memory(model, tok, system="You are terse.", prompt=prompt) for _ in range(2)]


@pytest.mark.parametrize("prompt", ["chat", "plain"])
def test_streamed_pieces_make_the_same_answer_as_without(llama, prompt):
    model, tok = llama
    streamed, plain = _pair(model, tok, prompt)
    pieces: list[str] = []
    for question in ("What is my code?", "And the weather?"):
        a = streamed.ask(question, max_new_tokens=12, on_text=pieces.append)
        b = plain.ask(question, max_new_tokens=12)
        assert a == b
        assert "".join(pieces) == a and all(pieces)
        assert streamed.state.digest == plain.state.digest
        assert streamed.messages == plain.messages
        pieces.clear()


def test_sampled_answers_stream_the_same_too(llama):
    model, tok = llama
    streamed, plain = _pair(model, tok, "chat")
    pieces: list[str] = []
    keywords = dict(max_new_tokens=10, do_sample=True, temperature=1.5, top_p=0.9)
    a = streamed.ask(
        "Hi?", on_text=pieces.append, generator=torch.Generator().manual_seed(3), **keywords
    )
    b = plain.ask("Hi?", generator=torch.Generator().manual_seed(3), **keywords)
    assert a == b == "".join(pieces)
    assert streamed.state.digest == plain.state.digest


def test_pieces_come_while_the_answer_is_decoded(llama):
    """Each piece is handed on before the answer ends: the forward passes run by then are
    counted, and the first piece comes long before the last pass."""
    model, tok = llama
    memory = kvedit.Memory(model, tok, system="You are terse.")
    passes: list[int] = []
    handle = model.register_forward_pre_hook(lambda mod, args, kw=None: passes.append(1))
    at: list[int] = []
    try:
        answer = memory.ask(
            "Tell me more.", max_new_tokens=16, on_text=lambda s: at.append(len(passes))
        )
    finally:
        handle.remove()
    assert answer and len(at) > 2
    assert at[0] < len(passes) - 8  # not all at the end


def test_a_stop_string_is_never_streamed(llama):
    """A stop string cut from the answer: what was handed on before it is still the answer's
    start, and none of the stop string was handed on, even where it began pieces before."""
    model, tok = llama
    probe = kvedit.Memory(model, tok, system="You are terse.")
    full = probe.ask("Say something.", max_new_tokens=20, remember=False)
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    assert len(stop.strip()) >= 2
    memory = kvedit.Memory(model, tok, system="You are terse.")
    pieces: list[str] = []
    answer = memory.ask("Say something.", max_new_tokens=20, stop=[stop], on_text=pieces.append)
    assert memory.last_answer.ended == "stop"
    assert answer == full[: full.find(stop)].strip() == "".join(pieces)


def test_the_stream_holds_back_what_could_still_change():
    got: list[str] = []
    stream = TextStream(got.append, ["\nUser:"], cleans_spaces=False)
    stream.update("caf\ufffd")  # a partial UTF-8 character
    assert got == ["caf"]
    stream.update("café\n")  # "\n" may start the stop string
    stream.update("café\nUs")
    assert got == ["caf", "é"]
    stream.update("café\nUsually")  # it did not: handed on
    assert got == ["caf", "é", "\nUsually"]
    stream.finish("café\nUsually")
    assert "".join(got) == "café\nUsually"
    got.clear()
    stream = TextStream(got.append, ["ab", "bcd"], cleans_spaces=False)
    stream.update("xabc")  # "bc" may start "bcd" (the longest held, over all stop strings)
    assert got == ["xa"]
    got.clear()
    stream = TextStream(got.append, [], cleans_spaces=True)
    stream.update("do n")  # " n" may become "n't" with the space cleaned away
    stream.update("don't")
    stream.finish("don't")
    assert got == ["do", "n't"]


def test_stripped_pieces_make_the_stripped_text():
    text = "  \n Hello  there \n\n and more \n "
    for cut in range(1, len(text)):
        got: list[str] = []
        strip = Stripped(got.append)
        strip(text[:cut])
        strip(text[cut:])
        assert "".join(got) == text.strip(), cut
        assert all(got)


def test_on_text_must_be_callable_and_is_refused_before_any_work(llama):
    model, tok = llama
    memory = kvedit.Memory(model, tok, system="You are terse.")
    with pytest.raises(InvalidTypeError, match="on_text must be callable"):
        memory.ask("Hi?", on_text="print")
    assert len(memory) == 1


def test_last_answer_says_why_the_answer_ended(llama, monkeypatch):
    model, tok = llama
    memory = kvedit.Memory(model, tok, system="You are terse.")
    assert memory.last_answer is None
    answer = memory.ask("Hi?", max_new_tokens=3)
    said = memory.last_answer
    assert (said.text, said.n_tokens, said.ended, said.cut) == (answer, 3, "length", True)
    # the first token greedy decoding picks next is made the model's EOS: it ends at once
    probe = kvedit.Memory(model, tok, system="You are terse.")
    asked = probe.renderer.render(
        [*probe.messages, kvedit.memory.rendering.Message("user", "Hi?")], True
    )
    state = kvedit.capture_tokens(model, tok, asked.ids)
    first = decode(state, 2).token_ids[0]
    monkeypatch.setattr(model.generation_config, "eos_token_id", first)
    assert probe.ask("Hi?", max_new_tokens=5) == ""
    assert (probe.last_answer.n_tokens, probe.last_answer.ended) == (0, "eos")
    assert not probe.last_answer.cut


def test_a_repetition_penalty_is_checked_before_any_work(llama):
    model, tok = llama
    memory = kvedit.Memory(model, tok, system="You are terse.")
    for bad in (0, -1.0, 10.5, float("nan")):
        with pytest.raises(InvalidInputError, match="repetition_penalty"):
            memory.ask("Hi?", repetition_penalty=bad)
    for bad in ("1.2", True, None):
        with pytest.raises(InvalidTypeError, match="repetition_penalty"):
            memory.ask("Hi?", repetition_penalty=bad)
    assert len(memory) == 1
    assert Sampling(repetition_penalty=10).repetition_penalty == 10.0


def test_the_penalty_divides_positive_logits_and_multiplies_negative_ones():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    seen = torch.tensor([0, 1, 1])
    out = Sampling(repetition_penalty=2.0).penalized(logits, seen)
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0]
    assert Sampling().penalized(logits, None) is logits  # 1.0: off
    with pytest.raises(InvalidInputError, match="needs the tokens seen"):
        Sampling(repetition_penalty=1.5).pick(logits)
    # greedy: token 0 was the argmax; penalized it is not
    assert Sampling(repetition_penalty=3.0).pick(logits, torch.tensor([0])) == 2


def test_a_penalty_makes_an_answer_repeat_less(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, "Go on and on and on:")
    repeats = {}
    for penalty in (1.0, 2.0, 5.0):
        ids = decode(state, 40, repetition_penalty=penalty).token_ids
        repeats[penalty] = len(ids) - len(set(ids))
    assert repeats[5.0] <= repeats[2.0] < repeats[1.0], repeats
    memory = kvedit.Memory(model, tok, system="You are terse.")
    plain = kvedit.Memory(model, tok, system="You are terse.")
    a = memory.ask("Go on.", max_new_tokens=40, repetition_penalty=5.0)
    assert a != plain.ask("Go on.", max_new_tokens=40)
