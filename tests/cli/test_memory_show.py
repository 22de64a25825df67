"""``kvedit memory show FILE [--plot PNG]`` (#69): what a saved memory file holds, read without
the model, and the app's Memory chart drawn to a PNG; every bad input one error line, exit 2,
before any work. On the tiny random Llama (``kvedit.testing``): the answers are noise, the
bookkeeping is the real memory's."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import kvedit
from kvedit.cli.main import main
from kvedit.memory.holdings_file import read_held_file

SYSTEM = "You are a helpful assistant."
TURNS = ["My dog's name is Biscuit and I live in Paris.", "My locker code is 4821.", "Hi?"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _save(llama, path, **settings):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system=SYSTEM, **settings)
    for text in TURNS:
        mem.ask(text, max_new_tokens=8)
    mem.save(path)
    return mem


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    """A memory under a byte budget that forgot (window: the oldest messages first), saved."""
    path = tmp_path_factory.mktemp("show") / "chat.kvm"
    mem = _save(llama, path, max_bytes=60 * 1024, forget="window")
    assert mem.forgetting  # the budget made rounds
    return path, mem


def _run(capsys, *argv) -> tuple[int, str, str]:
    status = main(["memory", "show", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def test_show_prints_what_the_file_holds(saved, capsys, no_model):
    path, mem = saved
    status, out, err = _run(capsys, path)
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"memory file: {path} (sealed by this installation)"
    assert lines[1] == "model: tiny-llama"
    assert lines[2] == f"messages: {len(mem.messages)}, {len(mem.state)} tokens (chat format)"
    entries = sorted(len(mem.state.layers[i]) for i in mem.state.counted_layers)
    assert f"holds per global layer {entries[0]} / " in lines[3]
    assert f"{mem.nbytes / 1024:,.1f} KiB in all" in lines[3]
    used = 100 * mem.nbytes / (60 * 1024)
    assert (
        lines[4]
        == f"budget: 60.0 KiB ({used:.0f}% used), forget window, keep layer, recent_tokens 16"
    )
    n = len(mem.forgetting)
    assert lines[5].startswith(f"forgetting: {n} rounds ({n} by window), ")
    rows = lines[7:]
    assert len(rows) == len(mem.messages)
    for turn, row in zip(mem.turns, rows, strict=True):
        assert re.match(rf"\s*{turn.index} {turn.role}\s+{turn.n_tokens} tok  ", row), row
    assert " tok  kept  'You are a helpful assistant.'" in rows[0]  # never forgotten
    assert " tok  forgotten  \"My dog's name" in rows[1]  # the oldest: window drops it first
    # What each message still holds is what the loaded memory's layers hold of its tokens.
    for turn, row in zip(mem.turns, rows, strict=True):
        held = [
            int(((mem.state.layers[i].token_index >= turn.start)
                 & (mem.state.layers[i].token_index < turn.end)).sum())
            for i in mem.state.counted_layers
        ]  # fmt: skip
        want = (
            "kept"
            if min(held) == turn.n_tokens
            else "forgotten"
            if max(held) == 0
            else "partly forgotten"
        )
        assert f" tok  {want}" in row, (row, held)


def test_plot_writes_the_chart_as_a_png(saved, capsys, tmp_path, no_model):
    path, _ = saved
    png = tmp_path / "held.png"
    status, out, err = _run(capsys, path, "--plot", png)
    assert (status, err) == (0, "")
    assert out.splitlines()[-1] == f"chart written: {png}"
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 2000
    from PIL import Image  # matplotlib's own dependency

    with Image.open(png) as image:
        image.verify()
    assert [p.name for p in tmp_path.iterdir()] == ["held.png"]  # no temporary file left


def test_the_chart_holds_the_apps_rows(saved):
    """The rows ``show`` reads from the file are the app's, computed from the live memory."""
    path, mem = saved
    from kvedit.memory.holdings import held_by_message

    state = mem.state
    live = held_by_message(mem.turns, state.layers, state.counted_layers, len(state))
    from_file = read_held_file(path).held()
    assert [r.state for r in from_file] == [r.state for r in live]
    assert [r.layers for r in from_file] == [r.layers for r in live]
    assert {r.state for r in live} >= {"kept", "forgotten"}


def test_quantized_and_per_head_memories(llama, tmp_path, capsys):
    quantized = tmp_path / "q.kvm"
    _save(llama, quantized, quantize=4)
    status, out, _ = _run(capsys, quantized, "--plot", tmp_path / "q.png")
    assert status == 0 and "budget: none (nothing is forgotten)" in out
    assert "forgetting: no rounds" in out
    assert "   0 system        30 tok  held, quantized (low bits)" in out
    headwise = tmp_path / "h.kvm"
    _save(llama, headwise, max_tokens=60, forget="kvzip", keep="head")
    status, out, _ = _run(capsys, headwise)
    assert status == 0 and "budget: 60 entries per global layer (" in out
    assert "forget kvzip, keep head" in out and "partly forgotten: " in out


def _error(capsys, *argv) -> str:
    status, out, err = _run(capsys, *argv)
    assert status == 2 and out == "", (status, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvedit memory show: error: "), err
    return lines[0]


def test_bad_files_are_refused_by_name(saved, tmp_path, capsys, llama, no_model):
    path, _ = saved
    assert "no such memory file" in _error(capsys, tmp_path / "none.kvm")
    assert "is a folder, not a memory file" in _error(capsys, tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("not a memory\n")
    assert str(text) in _error(capsys, text)
    torn = tmp_path / "torn.kvm"
    torn.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert str(torn) in _error(capsys, torn)
    tampered = tmp_path / "tampered.kvm"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # a byte of the last tensor's data
    tampered.write_bytes(bytes(data))
    assert str(tampered) in _error(capsys, tampered)
    model, tok = llama
    state = kvedit.capture(model, tok, "A plain state, no memory.")
    plain = tmp_path / "plain.kvstate"
    state.save(plain)
    assert "a state file, not a memory" in _error(capsys, plain)


def test_bad_plot_paths_are_refused_before_the_file_is_read(tmp_path, capsys, monkeypatch):
    import kvedit.memory.holdings_file as holdings_file

    def refuse(path):
        raise AssertionError("the memory file was read before the refusal")

    monkeypatch.setattr(holdings_file, "read_held_file", refuse)
    some = tmp_path / "some.kvm"
    line = _error(capsys, some, "--plot", tmp_path / "missing" / "held.png")
    assert "its folder" in line and "does not exist: create it first" in line
    assert "name a .png file" in _error(capsys, some, "--plot", tmp_path / "held.jpg")
    (tmp_path / "dir.png").mkdir()
    assert "is a folder" in _error(capsys, some, "--plot", tmp_path / "dir.png")
    assert "--plot is empty" in _error(capsys, some, "--plot", "")


def test_help_imports_nothing_heavy():
    code = (
        "import contextlib, io, json, sys\n"
        "from kvedit.cli.main import main\n"
        "statuses = []\n"
        "for argv in (['memory', '--help'], ['memory', 'show', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        statuses.append((main(argv), 'show' in out.getvalue()))\n"
        "heavy = [n for n in ('torch', 'transformers', 'numpy', 'safetensors', 'matplotlib')"
        " if n in sys.modules]\n"
        "print(json.dumps({'statuses': statuses, 'heavy': heavy}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"statuses": [[0, True], [0, True]], "heavy": []}


def test_an_empty_memory_is_shown_but_not_drawn(llama, tmp_path, capsys):
    model, tok = llama
    empty = tmp_path / "empty.kvm"
    kvedit.Memory(model, tok).save(empty)
    status, out, _ = _run(capsys, empty)
    assert status == 0 and "messages: 0, 0 tokens" in out
    assert "holds no messages, there is nothing to draw" in _error(
        capsys, empty, "--plot", tmp_path / "e.png"
    )
    assert not (tmp_path / "e.png").exists()
