"""``kvedit chat`` over Memory.ask's answer API (#69): the answer printed as it is decoded
(stdout flushed each piece, the printed text the same as the answer), ``[cut at N tokens]``
from why the decoder ended (``Memory.last_answer``), and ``--repeat-penalty``."""

from __future__ import annotations

import dataclasses
import io
import sys

import pytest
from helpers import asked_keywords

from kvedit.cli import main as cli_main
from kvedit.cli.chat_loop import _printable
from kvedit.cli.chat_sampling import DEFAULT_REPEAT_PENALTY as PENALTY
from kvedit.memory import conversation
from kvedit.memory.conversation import Memory
from kvedit.models import load_model

CHAT = ["chat", "--model", "tiny-llama", "--system", "Terse."]


class _Flushes(io.StringIO):
    """stdout that keeps what had been written at each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def flush(self) -> None:
        self.seen.append(self.getvalue())

    def isatty(self) -> bool:
        return False


def _chat(monkeypatch, lines: str, *args: str, stdout=None) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    out, err = stdout or _Flushes(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    status = cli_main([*CHAT, *args])
    return status, out.getvalue(), err.getvalue()


@pytest.fixture
def tiny():
    return load_model("tiny-llama")


def test_the_answer_is_printed_as_it_is_decoded(monkeypatch, tiny):
    stdout = _Flushes()
    status, out, err = _chat(monkeypatch, "hello\n", "--max-new-tokens", "16", stdout=stdout)
    assert status == 0, err
    memory = Memory(*tiny, system="Terse.")
    answer = _printable(memory.ask("hello", max_new_tokens=16, repetition_penalty=PENALTY))
    lines = out.splitlines()
    assert lines[1] == answer  # printed whole, as before streaming
    start = len(lines[0]) + 1
    partial = [s[start:] for s in stdout.seen if len(s) > start and "\n" not in s[start:]]
    assert len(set(partial)) >= 3, partial  # flushed piece by piece, before the line ended
    assert all(answer.startswith(p) for p in partial)


def test_cut_at_says_what_the_decoder_said(monkeypatch, tiny):
    """An answer that took every token it could but ended at EOS is not cut: the marker
    follows why decoding ended, not the answer's length."""
    status, out, err = _chat(monkeypatch, "hello\n", "--max-new-tokens", "4")
    assert status == 0, err
    assert out.splitlines()[2] == "[cut at 4 tokens: --max-new-tokens]"
    real = conversation.decode

    def ended_at_eos(*a, **k):
        return dataclasses.replace(real(*a, **k), ended="eos")

    monkeypatch.setattr(conversation, "decode", ended_at_eos)
    status, out, err = _chat(monkeypatch, "hello\n", "--max-new-tokens", "4")
    assert status == 0, err
    assert "[cut at" not in out


def test_an_interrupted_streamed_answer_ends_its_line(monkeypatch, tiny):
    real = conversation.decode

    def interrupted(*a, **k):
        k["on_text"]("Half an ans")
        raise KeyboardInterrupt

    monkeypatch.setattr(conversation, "decode", interrupted)
    status, out, err = _chat(monkeypatch, "hello\n")
    assert status == 130
    assert "Half an ans\n[interrupted: the question and its partial answer were not kept]" in out
    assert real is not interrupted


def test_repeat_penalty_reaches_memory_ask_greedy_or_sampled(monkeypatch, tiny):
    seen = asked_keywords(monkeypatch)
    assert _chat(monkeypatch, "hello\n", "--repeat-penalty", "1.3")[0] == 0
    assert seen[-1]["repetition_penalty"] == 1.3 and "do_sample" not in seen[-1]
    sampled = ["--temperature", "0.8", "--seed", "1", "--repeat-penalty", "2"]
    assert _chat(monkeypatch, "hello\n", *sampled)[0] == 0
    assert seen[-1]["repetition_penalty"] == 2.0 and seen[-1]["do_sample"] is True
    assert _chat(monkeypatch, "hello\n")[0] == 0
    assert seen[-1]["repetition_penalty"] == 1.1  # the default, as ollama's
    assert _chat(monkeypatch, "hello\n", "--repeat-penalty", "1")[0] == 0
    assert "repetition_penalty" not in seen[-1]  # 1: off, greedy decoding exactly
    status, out, err = _chat(monkeypatch, "/help\n", "--help")
    assert status == 0 and "--repeat-penalty F" in out and "(default 1.1" in out


@pytest.mark.parametrize(
    "value, said",
    [
        ("0", "--repeat-penalty must be in (0, 10] (1: off), not 0.0"),
        ("10.5", "--repeat-penalty must be in (0, 10] (1: off), not 10.5"),
        ("nan", "must be a finite number, not 'nan'"),
    ],
)
def test_a_bad_repeat_penalty_is_refused_before_the_model_loads(monkeypatch, value, said):
    monkeypatch.setattr("kvedit.models.load_model", lambda *a, **k: pytest.fail("loaded"))
    status, out, err = _chat(monkeypatch, "hello\n", "--repeat-penalty", value)
    assert status == 2 and said in err, err
