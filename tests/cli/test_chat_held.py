"""``kvedit chat`` says what its memory holds: the turn line (entries per global layer held,
the transcript's tokens, bytes against the budget), ``/explain``'s per-message lines of what
is still held, and ``[cut at N tokens]`` after an answer that hit --max-new-tokens (#69)."""

from __future__ import annotations

import io
import re
import sys

import pytest

from kvedit.cli import main as cli_main
from kvedit.memory.conversation import Memory
from kvedit.memory.forgetting import layer_entries
from kvedit.models import load_model


def _run(monkeypatch, capsys, lines: str, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    capsys.readouterr()
    status = cli_main(["chat", "--model", "tiny-llama", *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def tiny():
    return load_model("tiny-llama")


def test_the_turn_line_and_explain_say_what_the_memory_holds_now(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    lines = "".join(
        f"line {i}: my locker code is {4821 + i}, the river is calm\n" for i in range(6)
    )
    args = ["--memory", str(path), "--max-new-tokens", "6", "--max-tokens", "60"]
    status, out, err = _run(monkeypatch, capsys, lines + "/explain\n", *args, "--forget", "window")
    assert status == 0, err
    memory = Memory.load(path, *tiny)
    state = memory.state
    counted = sorted(layer_entries(state, i) for i in state.counted_layers)
    costs = [line for line in out.splitlines() if "tok reused" in line]
    spread = f"{counted[0]:.0f} / {counted[len(counted) // 2]:.0f} / {counted[-1]:.0f}"
    assert (
        f"memory {len(state):,} tok, holds {spread} entries per global layer "
        "(least / median / most), " in costs[-1]
    )
    assert counted[-1] < len(state)  # entries, not the transcript's tokens
    # /explain: the first question was forgotten (window), the last answer is all held
    held = out[out.index("held now, per message") :].splitlines()[1:13]
    assert len(memory.turns) == 12
    # the first tokens are never forgotten: 4 entries of the first message in every layer
    assert re.match(r"\s+0 user\s+40 tok  4 / 4 / 4 of 40 \(10%\)$", held[0]), held[0]
    assert re.match(r"\s+2 user\s+\d+ tok  forgotten$", held[2]), held[2]
    assert held[-1].endswith("all held"), held[-1]


def test_an_answer_cut_at_max_new_tokens_says_so(monkeypatch, capsys, tmp_path, tiny):
    status, out, err = _run(monkeypatch, capsys, "hello\n", "--max-new-tokens", "3")
    assert status == 0, err
    lines = out.splitlines()
    answer = lines[1]
    n = len(tiny[1](answer, add_special_tokens=False)["input_ids"])
    assert n >= 3  # the tiny model never ends an answer this short
    assert lines[2] == "[cut at 3 tokens: --max-new-tokens]"
