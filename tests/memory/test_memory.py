"""kvedit.Memory: exact turn after turn, each message computed once, no half-added message,
answers committed from their decoded K/V, focus as a view, saved and loaded."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import kvedit
from kvedit.errors import (
    CacheMismatchError,
    CorruptCacheError,
    InvalidInputError,
    InvalidTypeError,
    TemplateError,
)
from kvedit.memory.answering import decode
from kvedit.memory.rendering import Message

CHAT = [
    ("user", "My locker code is 4821."),
    ("assistant", "Noted."),
    ("user", "The weather is nice today, isn't it?\n"),
    ("assistant", "It is sunny.  "),
    ("tool", '{"temperature": 21}'),
    ("user", "My badge number is 77."),
    ("assistant", "Got it: 77."),
]


def reference(mem: kvedit.Memory) -> kvedit.KVState:
    """A fresh capture of the tokenizer's ids for the whole rendering."""
    ids = mem.renderer.render(mem.messages).ids
    return kvedit.capture_tokens(mem.model, mem.tokenizer, ids)


def assert_exact(mem: kvedit.Memory, tol: float = 1e-4) -> None:
    ref = reference(mem)
    assert mem.state.token_ids.tolist() == ref.token_ids.tolist()
    assert mem.state.digest == ref.digest
    assert mem.state.is_plain_capture
    diff = (mem.state.last_logits - ref.last_logits).abs().max().item()
    assert diff < tol, diff


@pytest.mark.parametrize("prompt", ["chat", "plain"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_exact_after_every_message(arch, prompt, request):
    """gemma3's sliding-window layers (window 16) are crossed many times over."""
    model, tok = request.getfixturevalue(arch)
    mem = kvedit.Memory(model, tok, system="You are terse.", prompt=prompt)
    assert_exact(mem)
    for role, content in CHAT * 2:
        mem.add(role, content)
        assert_exact(mem)
    mem.ask("What is my locker code?", max_new_tokens=6)
    assert_exact(mem)
    assert [t.role for t in mem.turns][-2:] == ["user", "assistant"]
    assert mem.turns[-1].end == len(mem.state)


def _count_tokens(model):
    counts: list[int] = []
    embed = model.get_input_embeddings()
    handle = embed.register_forward_pre_hook(lambda mod, args: counts.append(args[0].numel()))
    return counts, handle


@pytest.mark.parametrize("prompt", ["chat", "plain"])
def test_a_message_computes_only_its_own_tokens(llama, prompt):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.", prompt=prompt)
    for role, content in CHAT:
        mem.add(role, content)
    counts, handle = _count_tokens(model)
    try:
        for role, content in CHAT:
            counts.clear()
            turn = mem.add(role, content)
            assert counts == [turn.n_tokens] and turn.computed == turn.n_tokens
        counts.clear()
        n = len(mem.state)
        question = "What is my locker code?"
        asked_msgs = [*mem.messages, Message("user", question)]
        n_prompt = len(mem.renderer.render(asked_msgs, generation_prompt=True).ids)
        mem.ask(question, max_new_tokens=5)
    finally:
        handle.remove()
    asked, answer = mem.turns[-2:]
    # the question and the generation prompt run once, then one token per decode step, then
    # only what the decode did not give (the end-of-turn markup, a differing tail)
    assert counts[0] == n_prompt - n
    assert asked.computed == asked.n_tokens == asked.end - n and asked.recomputed == 0
    tail = answer.computed - (n_prompt - answer.start)  # run by the commit
    pushes = len(counts) - 2
    assert counts[-1] == tail and all(c == 1 for c in counts[1:-1])
    assert answer.kept <= pushes <= 4
    assert sum(counts) == asked.computed + answer.computed + pushes


def test_answer_kv_comes_from_decoding(smollm2):
    """On the bundled model the answer's tokens are kept, not computed again."""
    model, tok = smollm2
    mem = kvedit.Memory(model, tok, system="You are a helpful assistant.")
    mem.add("user", "My locker code is 4821.")
    mem.add("assistant", "Noted.")
    answer = mem.ask("What is my locker code? Answer in one sentence.", max_new_tokens=24)
    assert answer
    turn = mem.turns[-1]
    assert turn.source == "decoded" and turn.kept > 0 and turn.recomputed == 0
    assert_exact(mem)


test_answer_kv_comes_from_decoding = pytest.mark.real(test_answer_kv_comes_from_decoding)


@pytest.mark.real
def test_exact_over_fifty_messages_on_the_bundled_model(smollm2):
    model, tok = smollm2
    mem = kvedit.Memory(model, tok, system="You are a helpful assistant.")
    for i in range(26):
        mem.add("user", f"Fact {i}: the code of box {i} is {1000 + 37 * i}.")
        mem.add("assistant", "Noted.")
        if i % 5 == 0:
            assert_exact(mem)
    assert len(mem) == 53
    mem.ask("What is the code of box 3?", max_new_tokens=12)
    assert_exact(mem)


def _state_of(mem):
    return (mem.state.digest, len(mem), len(mem.turns), mem.nbytes)


@pytest.mark.parametrize(
    "bad, error",
    [
        (lambda m: m.add("robot", "hi"), InvalidInputError),
        (lambda m: m.add("user", ""), InvalidInputError),
        (lambda m: m.add("user", "   \n"), InvalidInputError),
        (lambda m: m.add("user", 5), InvalidTypeError),
        (lambda m: m.add("user", "word " * 5000), InvalidInputError),
        (lambda m: m.add("user", "x" * 10_000_000), InvalidInputError),
        (lambda m: m.ask("What?", max_new_tokens=5000), InvalidInputError),
        (lambda m: m.ask("What?", max_new_tokens=0), InvalidInputError),
        (lambda m: m.ask("What?", stop="\n"), InvalidInputError),
        (lambda m: m.ask("What?", focus="yes"), InvalidTypeError),
        (lambda m: m.ask(""), InvalidInputError),
    ],
    ids=[
        "role",
        "empty",
        "blank",
        "not-text",
        "past-positions",
        "10MB",
        "answer-past-positions",
        "no-tokens",
        "stop-str",
        "focus-str",
        "empty-question",
    ],
)
def test_bad_input_is_refused_and_the_memory_unchanged(llama, bad, error):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.")
    mem.add("user", "My locker code is 4821.")
    before = _state_of(mem)
    with pytest.raises(error):
        bad(mem)
    assert _state_of(mem) == before


def _with_template(tok, template: str):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


COUNTING = (
    "{{ messages | length }} messages\n"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# hides every assistant message but the last (as templates that drop earlier reasoning do)
LAST_ANSWER_ONLY = (
    "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_template_that_rewrites_earlier_text_is_refused(llama):
    model, tok = llama
    mem = kvedit.Memory(model, _with_template(tok, COUNTING), prompt="chat")
    mem.add("user", "My locker code is 4821.")
    before = _state_of(mem)
    with pytest.raises(TemplateError, match="not append-only"):
        mem.add("assistant", "Noted.")
    assert _state_of(mem) == before


def test_an_answer_the_template_rewrites_is_not_half_committed(llama):
    model, tok = llama
    mem = kvedit.Memory(model, _with_template(tok, LAST_ANSWER_ONLY), prompt="chat")
    mem.add("user", "My locker code is 4821.")
    mem.add("assistant", "Noted.")  # the last message: shown
    before = _state_of(mem)
    with pytest.raises(TemplateError, match="not append-only"):
        mem.add("user", "And my badge?")  # now the answer above is hidden
    assert _state_of(mem) == before


def test_remember_false_leaves_the_memory_as_it_was(llama):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.")
    mem.add("user", "My locker code is 4821.")
    before = _state_of(mem)
    mem.ask("What is my locker code?", max_new_tokens=4, remember=False)
    assert _state_of(mem) == before


def test_a_failed_ask_with_focus_leaves_last_focus_as_it_was(llama, monkeypatch):
    """Focus runs before the answer is decoded; an ask that fails after it (here: decoding)
    leaves :attr:`Memory.last_focus` as it was, as the rest of the memory."""
    import kvedit.memory.conversation as conversation

    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.")
    mem.add("user", "My locker code is 4821.")
    mem.add("assistant", "Noted.")
    mem.add("user", "My badge number is 77.")
    mem.ask("What is my locker code?", max_new_tokens=2, focus=True, remember=False)
    earlier = mem.last_focus
    assert earlier is not None
    before = _state_of(mem)

    def fails(*args, **kw):
        raise RuntimeError("decoding failed")

    monkeypatch.setattr(conversation, "decode", fails)
    for remember in (True, False):
        with pytest.raises(RuntimeError, match="decoding failed"):
            mem.ask("And my badge number?", max_new_tokens=2, focus=True, remember=remember)
        assert mem.last_focus is earlier
    assert _state_of(mem) == before


def test_decode_stops_before_a_stop_string(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, "Alice's secret number is 4821. Bob's")
    free = decode(state, 8)
    assert free.ended == "length" and len(free.token_ids) == 8
    stop = tok.decode(free.token_ids[:3], skip_special_tokens=True)[-2:]
    assert stop.strip()
    cut = decode(state, 8, stops=[stop])
    assert cut.ended == "stop" and stop not in cut.text
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    assert len(cut.token_ids) <= 3


def test_plain_format_boundaries_never_merge(llama):
    """Each part is tokenized alone: the ids of a message are the same whatever follows."""
    _, tok = llama
    mem = kvedit.Memory(*llama, prompt="plain")
    one = mem.renderer.render([Message("user", "Noted.\n")])
    two = mem.renderer.render([Message("user", "Noted.\n"), Message("assistant", "ok")])
    assert two.ids[: len(one.ids)] == one.ids
    assert two.text.startswith(one.text)
    assert one.text.endswith("User: Noted.\n\n\n")
    start, end = one.contents[0]
    assert one.text[start:end] == "Noted.\n"


def test_saved_loaded_and_continued_gives_the_same_answers(llama, tmp_path):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.")
    for role, content in CHAT[:4]:
        mem.add(role, content)
    path = mem.save(tmp_path / "chat.kv")
    loaded = kvedit.Memory.load(path, model, tok)
    assert loaded.state.digest == mem.state.digest and loaded.messages == mem.messages
    assert {t.source for t in loaded.turns} == {"loaded"}
    for q in ["What is my locker code?", "And the weather?"]:
        assert loaded.ask(q, max_new_tokens=5) == mem.ask(q, max_new_tokens=5)
        assert loaded.state.digest == mem.state.digest
    assert_exact(loaded)


def test_a_memory_file_of_another_model_or_not_a_memory_is_refused(llama, gemma3, tmp_path):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.")
    path = mem.save(tmp_path / "chat.kv")
    with pytest.raises(CacheMismatchError):
        kvedit.Memory.load(path, *gemma3)
    plain = mem.state.save(tmp_path / "plain.kv")
    with pytest.raises(CorruptCacheError, match="not a memory"):
        kvedit.Memory.load(plain, model, tok)


def test_the_memory_is_a_plain_capture_the_store_takes_and_reuse_finds(llama, tmp_path):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.")
    for role, content in CHAT[:4]:
        mem.add(role, content)
    store = kvedit.KVStore(tmp_path / "store")
    store.put(mem.state)
    # reuse tokenizes with the tokenizer's special tokens: its BOS, which the template wrote
    text = mem.state.text.removeprefix(tok.bos_token)
    longer = text + "<|im_start|>user\nMore?<|im_end|>\n"
    state, report = kvedit.reuse(model, tok, longer, store, save=False)
    assert report.tokens_reused == len(mem.state)
    assert state.token_ids[: len(mem.state)].tolist() == mem.state.token_ids.tolist()


@pytest.mark.real
def test_focus_is_a_view_for_one_answer(smollm2):
    model, tok = smollm2
    mem = kvedit.Memory(model, tok, system="You are a helpful assistant.")
    plain = kvedit.Memory(model, tok, system="You are a helpful assistant.")
    for m in (mem, plain):
        m.add("user", "My locker code is 4821.")
        m.add("assistant", "Noted.")
        for i in range(3):
            m.add("user", f"Some chat number {i}: the weather is nice today.")
            m.add("assistant", "Indeed it is.")
    question = "What is my locker code?"
    mem.ask(question, max_new_tokens=12, focus=True)
    assert mem.last_focus is not None and mem.last_focus.chosen  # it did edit
    assert "locker" in mem.explain().split("last focus:")[1]
    answer = mem.messages[-1].content
    plain.add("user", question)
    plain.add("assistant", answer)
    # committed: what an unedited memory holds
    assert mem.state.digest == plain.state.digest
    assert torch.allclose(mem.state.last_logits, plain.state.last_logits, atol=1e-4)
    assert mem.turns[-2].recomputed == mem.turns[-2].n_tokens
    assert_exact(mem)


@pytest.mark.parametrize("prompt", ["chat", "plain"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rendering_after_a_prefix_equals_rendering_it_all(arch, prompt, request):
    """What a memory renders each turn (building on what it holds) is the full rendering."""
    _, tok = request.getfixturevalue(arch)
    renderer = kvedit.Memory(*request.getfixturevalue(arch), prompt=prompt).renderer
    messages = [Message(role, content) for role, content in CHAT * 2]
    held = renderer.render(messages[:1])
    for i in range(2, len(messages) + 1):
        for gen in (False, True):
            step = renderer.render(messages[:i], gen, after=held)
            full = renderer.render(messages[:i], gen)
            assert step.ids == full.ids and step.text == full.text
            assert torch.equal(step.offsets, full.offsets) and step.contents == full.contents
        held = renderer.render(messages[:i], after=held)


def test_focus_said_names_the_messages_and_why_they_were_chosen():
    from kvedit.focusing.choice import Focus
    from kvedit.memory.explaining import focus_said
    from kvedit.memory.rendering import Message

    messages = [Message("user", "The red oak door is 1111."), Message("user", "Hi")]
    found = Focus(None, [(0, 25), (30, 32)], [0.1, 0.0], [0], [1.0], "q?")
    said = focus_said(found, [(0, 25), (30, 32)], messages)
    assert said == "emphasized message 0 (user: 'The red oak door is 1111.')"
    by_words = focus_said(dataclasses.replace(found, by_words=True), [(0, 25), None], messages)
    assert by_words == said + " (the only one holding all of the question's words)"
    none = dataclasses.replace(found, chosen=[], reason="no passage stands out")
    assert focus_said(none, [(0, 25), None], messages) == "abstained (no passage stands out)"
