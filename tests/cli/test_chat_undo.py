"""``kvedit chat``'s /undo, /retry, /clear (the memory as it was before a question, nothing
recomputed) and its short /help (#69)."""

from __future__ import annotations

import io
import sys

import pytest

from kvedit.cli import main as cli_main
from kvedit.cli.chat_sampling import DEFAULT_REPEAT_PENALTY as PENALTY
from kvedit.memory.conversation import Memory
from kvedit.models import load_model


def _run(monkeypatch, capsys, path, lines: str, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    capsys.readouterr()
    argv = ["chat", "--model", "tiny-llama", "--max-new-tokens", "5", "--memory", str(path)]
    status = cli_main([*argv, *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def tiny():
    return load_model("tiny-llama")


def _contents(path, tiny) -> list[str]:
    return [m.content for m in Memory.load(path, *tiny).messages]


def test_undo_takes_back_the_last_question_and_retry_asks_it_again(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    status, out, err = _run(monkeypatch, capsys, path, "one\ntwo\n/undo\n", "--system", "S.")
    assert status == 0, err
    assert "[undo: the last question and its answer taken back; the memory holds 3 messages" in out
    contents = _contents(path, tiny)
    assert contents[:2] == ["S.", "one"] and len(contents) == 3
    # a memory taken back is the memory as it was: its state answers as the file's does
    status, out, err = _run(monkeypatch, capsys, path, "two\n/retry\n/explain\n")
    assert status == 0, err
    answers = [line for line in out.splitlines() if line and not line.startswith(("[", " "))]
    assert answers[0] == answers[1]  # greedy: the same answer again
    memory = Memory.load(path, *tiny)
    assert [m.content for m in memory.messages][:4] == ["S.", "one", contents[2], "two"]
    assert len(memory) == 5 and memory.turns[-1].end == len(memory.state)
    again = Memory.load(path, *tiny)
    fresh = Memory(*tiny, system="S.")
    fresh.ask("one", max_new_tokens=5, repetition_penalty=PENALTY)
    fresh.ask("two", max_new_tokens=5, repetition_penalty=PENALTY)
    assert again.state.token_ids.tolist() == fresh.state.token_ids.tolist()


def test_clear_goes_back_to_the_start_and_a_changed_memory_is_saved(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    assert _run(monkeypatch, capsys, path, "one\n")[0] == 0
    saved = _contents(path, tiny)
    status, out, err = _run(monkeypatch, capsys, path, "/clear\ntwo\nthree\n/clear\n/undo\n")
    assert status == 0
    assert err.splitlines() == [
        "kvedit chat: error: /clear: no question asked in this chat to take back",
        "kvedit chat: error: /undo: no question asked in this chat to take back",
    ]
    assert "[clear: 2 questions and answers taken back; the memory holds 2 messages" in out
    assert _contents(path, tiny) == saved
    # the same number of messages and tokens as when it was saved, yet another question
    status, out, err = _run(monkeypatch, capsys, path, "two\n/save\n/undo\nfour\n")
    assert status == 0, err
    assert _contents(path, tiny)[2] == "four"


def test_help_is_short(monkeypatch, capsys, tmp_path):
    status, out, err = _run(monkeypatch, capsys, tmp_path / "chat.kv", "/help\n")
    assert status == 0, err
    said = out.splitlines()[1:-1]
    assert said[0].startswith("/explain") and len(said) <= 6
    assert all(c in out for c in ("/undo", "/retry", "/clear", "/save", "/quit"))


def test_undo_and_retry_are_memory_undo_and_bounded_by_it(monkeypatch, capsys, tmp_path, tiny):
    """/undo and /retry take back through kvedit.Memory.undo (nothing copied by the chat): as
    far back as the memory keeps (UNDO_STEPS changes), then an error that names /clear."""
    from kvedit.memory.undoing import UNDO_STEPS

    calls = []
    undo = Memory.undo

    def spy(self):
        calls.append(len(self))
        return undo(self)

    monkeypatch.setattr(Memory, "undo", spy)
    questions = "".join(f"q{k}\n" for k in range(UNDO_STEPS + 1))
    lines = questions + "/retry\n" + "/undo\n" * (UNDO_STEPS + 1)
    status, out, err = _run(monkeypatch, capsys, tmp_path / "chat.kv", lines, "--system", "S.")
    assert status == 0, err
    n = 1 + 2 * (UNDO_STEPS + 1)
    assert calls == [n, n] + [n - 2 * k for k in range(1, UNDO_STEPS)]
    assert err.splitlines() == [
        "kvedit chat: error: /undo: the memory keeps only its last few changes to take back "
        "(kvedit.Memory.undo), and they were taken back already; /clear goes back to where "
        "this chat started"
    ]
    assert _contents(tmp_path / "chat.kv", tiny)[:2] == ["S.", "q0"]
    assert len(_contents(tmp_path / "chat.kv", tiny)) == 3
