"""``kvedit.memory.attached.check_fields`` (#65): a memory file's attachment checked without the
tokenizer, for :func:`kvedit.memory.holdings_file.read_held_file` (``kvedit memory show``),
through the code :func:`~kvedit.memory.attached.parse_attachment` runs: the same fields for a
true file, the same refusal, word for word, for a false one (the turns must tile the tokens, as
a load checks of a file this installation sealed)."""

from __future__ import annotations

import copy

import pytest
from helpers import set_at

import kvedit
from kvedit.errors import CorruptCacheError
from kvedit.memory.attached import check_fields, parse_attachment
from kvedit.states.files.read import read_state_file

CHAT = [
    ("user", "My locker code is 4821."),
    ("assistant", "Noted."),
    ("user", "My badge number is 77."),
    ("assistant", "Got it: 77."),
]


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    """A memory file with a forgetting round and a budget: its attachment and token ids."""
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=60, forget="window")
    for role, content in CHAT * 2:
        mem.add(role, content)
    assert mem.forgetting
    path = mem.save(tmp_path_factory.mktemp("attached") / "mem.kv")
    found = read_state_file(path)
    return path, found.meta["attachment"], found.tensors["token_ids"].tolist(), tok


def _fields(x) -> tuple:
    return (x.prompt, x.messages, x.turns, x.rounds, x.keywords, x.scores)


def test_check_fields_gives_what_parse_attachment_gives(saved):
    path, attachment, ids, tok = saved
    fields = check_fields(attachment, path, len(ids))
    assert fields.rounds and fields.keywords["max_tokens"] == 60
    for trusted in (True, False):
        parsed = parse_attachment(attachment, path, ids, tok, trusted=trusted)
        assert _fields(fields) == _fields(parsed)


BAD = {
    "version": set_at("version", 99),
    "unknown-field": set_at("extra", 1),
    "bot-role": set_at("messages", 1, "role", "bot"),
    "turns-short": lambda a: a["turns"].pop(),
    "turn-gap": set_at("turns", 1, "end", 10**6),
    "turn-source": set_at("turns", 1, "source", "magic"),
    "turn-count": set_at("turns", 1, "computed", -5),
    "round-past": set_at("rounds", 0, "at_message", 99),
    "round-seconds": set_at("rounds", 0, "seconds", -1.0),
    "budget-zero": set_at("budget", "max_tokens", 0),
    "budget-span": set_at("budget", "protect", [{"chars": [5, 1]}]),
    "scores-policy": set_at("scores", {"policy": "", "layers": [0]}),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_check_fields_refuses_what_a_sealed_load_refuses(saved, case):
    """Every field checked: the refusal names the file and the field, as a load's does."""
    path, attachment, ids, tok = saved
    bad = copy.deepcopy(attachment)
    BAD[case](bad)
    with pytest.raises(CorruptCacheError, match=r"mem\.kv: the memory's ") as loading:
        parse_attachment(bad, path, ids, tok, trusted=True)
    with pytest.raises(CorruptCacheError) as showing:
        check_fields(bad, path, len(ids))
    assert str(showing.value) == str(loading.value)


def test_check_fields_refuses_turns_that_end_before_the_tokens(saved):
    path, attachment, ids, _ = saved
    with pytest.raises(CorruptCacheError, match=r"turns end at token \d+, not at the file's"):
        check_fields(attachment, path, len(ids) + 1)


def test_check_fields_refuses_a_state_file_that_is_no_memory(saved):
    path, attachment, ids, _ = saved
    for other in (None, {**attachment, "kind": "something"}):
        with pytest.raises(CorruptCacheError, match="a state file, not a memory"):
            check_fields(other, path, len(ids))
