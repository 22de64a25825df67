"""What a memory is given is checked before any work, and a refusal leaves it unchanged: flags
are real bools, sampling arguments are checked (tests/states/test_sampling.py), ``load`` takes
only its keywords, a lone surrogate and a template's own error are kvedit errors, a message
too long for the positions by its characters is refused before it is tokenized, and a template
that folds the system message into the first user turn (Gemma-3's) still has it protected from
forgetting."""

from __future__ import annotations

import copy

import pytest

import kvedit
from kvedit.checks import MAX_CHARS_PER_TOKEN
from kvedit.errors import InvalidInputError, InvalidTypeError, TemplateError
from kvedit.memory.budget import never_forgotten
from kvedit.states.room import chars_per_token

CHAT = [
    ("user", "My locker code is 4821."),
    ("assistant", "Noted."),
    ("user", "The weather is nice today, isn't it?"),
    ("assistant", "It is sunny."),
]

# Gemma-3's official template, on the tiny tokenizer's markers: the system message is no turn
# of its own but a prefix of the first user turn, and roles must alternate.
GEMMA_LIKE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "<|im_start|>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ first_user_prefix if loop.first else '' }}{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>model\n{% endif %}"
)
SYSTEM = "You are terse. The code word is PELICAN."


def _state_of(mem):
    return (mem.state.digest, mem.messages, mem.turns, mem.forgetting)


def _with_template(tok, template: str):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


@pytest.fixture()
def memory(llama):
    mem = kvedit.Memory(*llama, system="You are terse.")
    mem.add("user", "My locker code is 4821.")
    return mem


@pytest.mark.parametrize(
    "bad, error, said",
    [
        (lambda m: m.ask("Code?", remember="False"), InvalidTypeError, "remember must be True"),
        (lambda m: m.ask("Code?", remember=0), InvalidTypeError, "remember"),
        (lambda m: m.ask("Code?", do_sample=True, temperature=-1), InvalidInputError, "temper"),
        (lambda m: m.ask("Code?", do_sample=True, top_k=0), InvalidInputError, "top_k"),
        (lambda m: m.ask("Code?", top_p=1.5), InvalidInputError, "top_p"),
        (lambda m: m.ask("Code?", do_sample=True, generator="x"), InvalidTypeError, "generator"),
        (lambda m: m.add("user", "a\ud800b"), InvalidInputError, "user message holds a lone"),
        (lambda m: m.ask("Code \udcff?"), InvalidInputError, "user message holds a lone"),
        (lambda m: m.save(m.path, overwrite="yes"), InvalidTypeError, "overwrite"),
        (lambda m: m.ask("Code?", repetition_penalty=0), InvalidInputError, "repetition_pen"),
        (lambda m: m.ask("Code?", on_text="print"), InvalidTypeError, "on_text must be call"),
        (lambda m: m.extend([("bot", "hi")]), InvalidInputError, "message 0 of the batch: role"),
        (lambda m: m.extend([("user", "ok"), ("user", " ")]), InvalidInputError, "message 1"),
    ],
    ids=[
        "remember-str",
        "remember-int",
        "temperature",
        "top_k",
        "top_p",
        "generator",
        "surrogate-add",
        "surrogate-ask",
        "overwrite-str",
        "repetition-penalty",
        "on-text",
        "extend-role",
        "extend-empty",
    ],
)
def test_a_bad_argument_is_refused_and_the_memory_unchanged(memory, tmp_path, bad, error, said):
    memory.path = tmp_path / "m.kv"
    before = _state_of(memory)
    with pytest.raises(error, match=said):
        bad(memory)
    assert _state_of(memory) == before
    assert not memory.path.exists()


def test_not_a_model_or_tokenizer_is_refused_before_any_work(llama, tmp_path):
    model, tok = llama
    with pytest.raises(InvalidTypeError, match="model must be a transformers model"):
        kvedit.Memory(None, tok)
    with pytest.raises(InvalidTypeError, match="tokenizer must be the model's"):
        kvedit.Memory(model, "tok")
    with pytest.raises(InvalidTypeError, match="model must be"):
        kvedit.Memory.load(tmp_path / "nothing.kv", "model", tok)


def test_load_takes_only_its_keywords_and_the_file_s_prompt_and_system(memory, tmp_path):
    model, tok = memory.model, memory.tokenizer
    path = memory.save(tmp_path / "m.kv")
    with pytest.raises(InvalidTypeError, match="takes no keyword foo=; it takes max_positions="):
        kvedit.Memory.load(path, model, tok, foo=1)
    with pytest.raises(InvalidInputError, match="rendered in the 'chat' format"):
        kvedit.Memory.load(path, model, tok, prompt="plain")
    with pytest.raises(InvalidInputError, match="system='X'.*keeps the file's messages"):
        kvedit.Memory.load(path, model, tok, system="X")
    same = kvedit.Memory.load(path, model, tok, prompt="chat", system="You are terse.")
    assert same.messages == memory.messages and same.state.digest == memory.state.digest


def test_a_template_s_own_error_is_a_template_error_and_the_memory_unchanged(llama):
    model, tok = llama
    mem = kvedit.Memory(model, _with_template(tok, GEMMA_LIKE), system=SYSTEM, prompt="chat")
    mem.add("user", "My locker code is 4821.")
    before = _state_of(mem)
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        mem.add("user", "And my badge?")
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        mem.ask("And my badge?", max_new_tokens=2)
    assert _state_of(mem) == before
    mem.add("assistant", "Noted.")  # alternating: fine


def test_a_system_message_folded_into_the_first_user_turn_is_never_forgotten(llama):
    """Gemma-3's template writes the system message inside the first user turn: the system
    turn is one token (the BOS). Its text is protected by its tokens wherever they are, and
    explain says where they are."""
    model, tok = llama
    mem = kvedit.Memory(
        model,
        _with_template(tok, GEMMA_LIKE),
        system=SYSTEM,
        prompt="chat",
        max_tokens=120,
        forget="window",
        recent=1,
    )
    assert mem.turns[0].n_tokens == 1
    for role, content in CHAT * 4:
        mem.add(role, content)
    assert mem.forgetting  # it forgot ...
    text = mem.state.text
    at = text.index(SYSTEM)
    system_tokens = set(mem.state.token_indices((at, at + len(SYSTEM))).tolist())
    assert min(system_tokens) >= mem.turns[1].start  # in the first user turn's tokens
    for i in mem.state.global_layers:  # ... but never the system message's text
        assert system_tokens <= set(mem.state.layers[i].token_index.tolist())
    line = mem.explain().splitlines()[1]
    assert "system" in line and "its text is in message 1's tokens" in line


def test_a_template_that_does_not_write_the_system_message_verbatim_has_no_budget(llama):
    model, tok = llama
    upper = GEMMA_LIKE.replace("messages[0]['content'] + ", "messages[0]['content'] | upper + ")
    tok = _with_template(tok, upper)
    free = kvedit.Memory(model, tok, system=SYSTEM, prompt="chat")  # no budget: fine
    free.add("user", "My locker code is 4821.")
    mem = kvedit.Memory(model, tok, system=SYSTEM, prompt="chat", max_tokens=500)
    before = _state_of(mem)
    with pytest.raises(TemplateError, match="does not write the system message verbatim"):
        mem.add("user", "My locker code is 4821.")
    assert _state_of(mem) == before


def test_never_forgotten_counts_each_protected_token_once():
    """The sinks, the system message's range and the last recent tokens, overlapping or not,
    each token counted once and never past the tokens there are."""
    assert never_forgotten(100, [(4, 10)], 16) == 4 + 6 + 16
    assert never_forgotten(100, [(2, 10), (8, 12)], 16) == 12 + 16
    assert never_forgotten(10, [(0, 3)], 16) == 10  # all of a short conversation
    assert never_forgotten(100, [], 0) == 4 + 1  # the last token, always


def test_a_message_too_long_by_its_characters_is_refused_before_it_is_tokenized(
    memory, monkeypatch
):
    """The tiny tokenizer's longest entry is 13 characters: a message of more than 13
    characters per position left cannot fit, whatever it holds, and is refused before the
    template renders and the tokenizer reads the whole conversation."""
    per_token = chars_per_token(memory.tokenizer)
    assert per_token == max(len(t) for t in memory.tokenizer.get_vocab()) < MAX_CHARS_PER_TOKEN
    before = _state_of(memory)

    def never(*args, **kwargs):
        raise AssertionError("rendered and tokenized")

    monkeypatch.setattr(type(memory.renderer), "render", never)
    message = "word " * (memory.model.config.max_position_embeddings * per_token // 5 + 1)
    with pytest.raises(InvalidInputError, match="characters long.*at most 13 characters"):
        memory.add("user", message)
    with pytest.raises(InvalidInputError, match="characters long"):
        memory.ask(message)
    assert _state_of(memory) == before


def test_the_characters_bound_holds_only_where_no_step_drops_characters(llama):
    from tokenizers import AddedToken, normalizers, pre_tokenizers

    _, tok = llama
    text = "x" * 50 + " " * 40 + "<|im_start|>" + "é" * 30 + "=" * 64
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) * chars_per_token(tok) >= len(text)  # a true bound here
    for change in (
        lambda t: setattr(t.backend_tokenizer, "normalizer", normalizers.Strip()),
        lambda t: setattr(t.backend_tokenizer, "pre_tokenizer", pre_tokenizers.Whitespace()),
        lambda t: t.add_tokens([AddedToken("<mask>", lstrip=True)]),
    ):
        other = copy.deepcopy(tok)
        change(other)
        assert chars_per_token(other) == MAX_CHARS_PER_TOKEN
    nfc = copy.deepcopy(tok)
    nfc.backend_tokenizer.normalizer = normalizers.NFC()
    assert chars_per_token(nfc) == 4 * chars_per_token(tok)
