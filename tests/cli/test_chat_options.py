"""``kvedit chat``'s options from issue 69: a chat without --memory (held in RAM only), the
sampling options passed to ``Memory.ask`` (#69)."""

from __future__ import annotations

import io
import sys

import pytest
from helpers import asked_keywords

from kvedit.cli import main as cli_main
from kvedit.memory.conversation import Memory
from kvedit.models import load_model

CHAT = ["chat", "--model", "tiny-llama", "--max-new-tokens", "6"]


def _run(monkeypatch, capsys, lines: str, *args: str) -> tuple[int, str, str]:
    """``kvedit chat`` (no --memory unless in ``args``) with ``lines`` piped in."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    capsys.readouterr()
    status = cli_main([*CHAT, *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def tiny():
    return load_model("tiny-llama")


def test_without_memory_the_chat_is_held_in_ram_and_save_path_still_writes(
    monkeypatch, capsys, tmp_path, tiny
):
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "copy.kv"
    status, out, err = _run(monkeypatch, capsys, f"hello there\n/save\n/save {copy}\nagain\n")
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0] == "[new memory held in RAM only (no --memory), prompt 'chat']"
    assert "/save: this chat has no --memory file (held in RAM only); give /save PATH" in err
    assert f"[saved a copy {copy}: 2 messages" in out and "goes on in RAM only]" in out
    assert lines[-1].startswith("memory held in RAM only, not written: 4 messages, ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.kv"]  # no file, no lock
    assert [m.role for m in Memory.load(copy, *tiny).messages] == ["user", "assistant"]


def test_sampling_options_reach_memory_ask_and_a_seed_repeats_the_answer(monkeypatch, capsys, tiny):
    seen = asked_keywords(monkeypatch)
    sampled = ["--temperature", "1.5", "--top-p", "0.9", "--seed", "7"]
    first = _run(monkeypatch, capsys, "hello\n", *sampled)
    second = _run(monkeypatch, capsys, "hello\n", *sampled)
    assert first[0] == second[0] == 0, first[2] + second[2]
    assert first[1].splitlines()[1] == second[1].splitlines()[1]  # the same seed, same answer
    k = seen[0]
    assert (k["do_sample"], k["temperature"], k["top_p"]) == (True, 1.5, 0.9)
    assert k["generator"].initial_seed() == 7
    assert _run(monkeypatch, capsys, "hello\n")[0] == 0
    assert "do_sample" not in seen[-1] and "generator" not in seen[-1]  # greedy by default


@pytest.mark.parametrize(
    "args, said",
    [
        (["--top-p", "0.9"], "--top-p without sampling: give --temperature above 0"),
        (["--seed", "1"], "--seed without sampling: give --temperature above 0"),
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or above, not -1.0"),
        (["--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1], not 0.0"),
        (["--temperature", "nan"], "must be a finite number, not 'nan'"),
    ],
)
def test_bad_sampling_options_are_refused_before_the_model_loads(monkeypatch, capsys, args, said):
    monkeypatch.setattr("kvedit.models.load_model", lambda *a, **k: pytest.fail("loaded"))
    status, out, err = _run(monkeypatch, capsys, "hello\n", *args)
    assert status == 2 and said in err, err


def test_keep_is_a_fraction_of_the_entries_the_memory_holds_at_start(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    lines = "".join(
        f"line {i}: my locker code is {4821 + i}, the river is calm\n" for i in range(4)
    )
    assert _run(monkeypatch, capsys, lines, "--memory", str(path))[0] == 0
    entries = len(Memory.load(path, *tiny).state)  # nothing forgotten: every token an entry
    status, out, err = _run(
        monkeypatch, capsys, "and more\n", "--memory", str(path), "--keep", "0.5"
    )
    assert status == 0, err
    most = round(0.5 * entries)
    assert f"holds at most {most:,} entries a global layer on average" in out.splitlines()[0]
    assert Memory.load(path, *tiny).budget.max_tokens == most


def test_keep_without_an_existing_memory_file_is_refused_before_the_model_loads(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr("kvedit.models.load_model", lambda *a, **k: pytest.fail("loaded"))
    for where in ([], ["--memory", str(tmp_path / "new.kv")]):
        status, out, err = _run(monkeypatch, capsys, "hello\n", "--keep", "0.25", *where)
        assert status == 2 and "--keep 0.25: a fraction of the entries the memory holds" in err
    status, out, err = _run(monkeypatch, capsys, "hello\n", "--keep", "1.5")
    assert status == 2 and "--keep: must be in (0, 1], not 1.5" in err, err


@pytest.mark.parametrize("value", ["-0.1", "1.0", "nan", "half"])
def test_a_bad_layer_floor_is_refused_in_one_line_before_the_model_loads(
    monkeypatch, capsys, value
):
    monkeypatch.setattr("kvedit.models.load_model", lambda *a, **k: pytest.fail("loaded"))
    status, out, err = _run(
        monkeypatch, capsys, "hello\n", "--max-tokens", "200", "--layer-floor", value
    )
    assert status == 2 and err.strip().splitlines() == [
        f"kvedit chat: error: --layer-floor must be a number in [0, 1), not {value!r}"
    ], err
    status, out, err = _run(monkeypatch, capsys, "hello\n", "--layer-floor", "0.5")
    assert status == 2 and "--layer-floor without a budget" in err, err


def test_layer_floor_reaches_the_memory_and_its_file(monkeypatch, capsys, tmp_path, tiny):
    monkeypatch.setattr("kvedit.models.load_model", lambda *a, **k: tiny)
    path = tmp_path / "mem.kv"
    floored = ["--memory", str(path), "--max-tokens", "400", "--layer-floor", "0.5"]
    status, out, _ = _run(monkeypatch, capsys, "hello\n", *floored)
    assert status == 0 and "0.5 of each round's room shared among the layers" in out
    assert Memory.load(path, *tiny).budget.layer_floor == 0.5
    assert _run(monkeypatch, capsys, "again\n", "--memory", str(path))[0] == 0  # the file's
    assert Memory.load(path, *tiny).budget.layer_floor == 0.5
