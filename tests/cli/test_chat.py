"""``kvedit chat``: piped questions, the memory file saved on end of input and loaded again,
refusals of a memory file it cannot use (the file left as it was), a line too long for the
model, an interrupted answer not kept; and the chat in a terminal (tmux), ended by Ctrl-C or
Ctrl-D with the memory saved (#41)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvedit import capture
from kvedit.atomic import TEMP_MARKER, host_tag
from kvedit.cli import main as cli_main
from kvedit.cli.chat_sampling import DEFAULT_REPEAT_PENALTY as PENALTY
from kvedit.errors import StorageError
from kvedit.memory import conversation
from kvedit.memory.conversation import Memory
from kvedit.models import load_model
from kvedit.states.files.write import save_state
from kvedit.store.lock import WriterLock

REPO = Path(__file__).resolve().parents[2]
CHAT = ["chat", "--model", "tiny-llama", "--max-new-tokens", "6"]


def _chat(monkeypatch, capsys, memory: Path, lines: str, *args: str) -> tuple[int, str, str]:
    """Run ``kvedit chat`` with ``lines`` piped in; (status, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    capsys.readouterr()
    status = cli_main([*CHAT, "--memory", str(memory), *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def tiny():
    return load_model("tiny-llama")


def test_piped_questions_are_answered_and_saved_at_end_of_input(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    status, out, err = _chat(
        monkeypatch, capsys, path, "hello there\n\n   \nwhat now?\n/explain\n", "--system", "Terse."
    )
    assert status == 0, err
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == f"[new memory {path}, prompt 'chat']"
    costs = [line for line in lines if "tok reused" in line]
    assert len(costs) == 2  # the empty and blank lines were skipped
    assert "\x1b[" not in out  # dimmed only on a terminal
    assert "   0 system" in out and "   4 assistant" in out  # /explain
    memory = Memory.load(path, *tiny)
    assert [m.role for m in memory.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [m.content for m in memory.messages[:2]] == ["Terse.", "hello there"]
    assert lines[-1] == f"saved {path}: 5 messages, {len(memory.state)} tok, " + (
        f"{memory.nbytes / 1024:.1f} KiB"
    )
    q = memory.turns[1]
    assert costs[0].startswith(f"[{q.start} tok reused, question {q.n_tokens} tok computed, ")
    assert f"memory {len(memory.state)} tok" in costs[1]


def test_a_saved_memory_is_loaded_and_only_the_new_question_is_computed(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    assert _chat(monkeypatch, capsys, path, "my code is 4821\n")[0] == 0
    first = Memory.load(path, *tiny)
    status, out, err = _chat(monkeypatch, capsys, path, "what is my code?\n")
    assert status == 0, err
    assert (
        out.splitlines()[0] == f"[memory {path}: 2 messages, {len(first.state)} tok, prompt 'chat']"
    )
    assert f"[{len(first.state)} tok reused, question " in out
    second = Memory.load(path, *tiny)
    assert second.messages[:2] == first.messages
    assert second.messages[2].content == "what is my code?"
    assert second.state.token_ids[: len(first.state)].tolist() == first.state.token_ids.tolist()


def test_quit_ends_the_chat_and_save_writes_the_file_at_once(monkeypatch, capsys, tmp_path, tiny):
    path = tmp_path / "chat.kv"
    saved = {}

    def save(self, p):  # what the file holds at each save
        saved[len(saved)] = len(self)
        return real_save(self, p)

    real_save = Memory.save
    monkeypatch.setattr(Memory, "save", save)
    status, out, err = _chat(monkeypatch, capsys, path, "one\n/save\n/quit\nnever asked\n")
    assert status == 0, err
    assert saved == {0: 2}  # /save wrote it; unchanged after, so /quit did not write again
    assert f"memory {path} unchanged: 2 messages" in out
    assert "never asked" not in [m.content for m in Memory.load(path, *tiny).messages]


def test_a_question_starting_with_a_slash_is_written_with_two(monkeypatch, capsys, tmp_path, tiny):
    path = tmp_path / "chat.kv"
    status, _, err = _chat(monkeypatch, capsys, path, "/nope\n//etc/hosts?\n")
    assert status == 0
    assert err.splitlines() == [
        "kvedit chat: error: unknown command '/nope': the commands are /explain, /save, /undo, "
        "/retry, /clear, /quit, /help (a question that starts with / is written //...)"
    ]
    assert Memory.load(path, *tiny).messages[0].content == "/etc/hosts?"


def test_a_line_too_long_for_the_model_is_one_error_and_the_chat_goes_on(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    long = "word " * 5000
    status, out, err = _chat(monkeypatch, capsys, path, f"{long}\nshort one\n")
    assert status == 0
    (line,) = err.splitlines()
    assert line.startswith("kvedit chat: error: the question is ")
    assert "at most 4096 positions" in line and line.endswith("; the question was not kept")
    assert out.count("tok reused") == 1
    assert [m.content for m in Memory.load(path, *tiny).messages][0] == "short one"


def test_an_interrupted_answer_is_not_kept_and_the_memory_is_saved(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    real_decode, calls = conversation.decode, []

    def decode(*a, **k):  # Ctrl-C during the second answer
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_decode(*a, **k)

    monkeypatch.setattr(conversation, "decode", decode)
    status, out, err = _chat(monkeypatch, capsys, path, "first\nsecond\nthird\n")
    assert status == 130
    assert err == ""
    assert "[interrupted: the question and its partial answer were not kept]" in out
    memory = Memory.load(path, *tiny)
    assert [m.content for m in memory.messages][0] == "first" and len(memory) == 2
    assert out.splitlines()[-1].startswith(f"saved {path}: 2 messages, ")


def _other_model(path: Path) -> None:
    Memory(*load_model("tiny-qwen2"), system="hi").save(path)


def _damaged(path: Path) -> None:
    Memory(*load_model("tiny-llama"), system="hi").save(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _plain_state(path: Path) -> None:
    save_state(capture(*load_model("tiny-llama"), "hello world"), path)


def _text(path: Path) -> None:
    path.write_text("my notes\n")


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (
            _other_model,
            "a memory of the model 'tiny-qwen2', not of 'tiny-llama' (--model): give --model "
            "tiny-qwen2, or another --memory file",
        ),
        (_damaged, "checksum mismatch"),
        (_plain_state, "a state file, not a memory"),
        (_text, "safetensors"),
    ],
)
def test_a_memory_file_it_cannot_use_is_refused_and_left_as_it_is(
    monkeypatch, capsys, tmp_path, make, says
):
    path = tmp_path / "chat.kv"
    make(path)
    before = path.read_bytes()
    status, out, err = _chat(monkeypatch, capsys, path, "hello\n")
    assert status == 2
    (line,) = err.splitlines()
    assert line.startswith(f"kvedit chat: error: --memory {path}: ") and says in line
    assert line.endswith("; the file is left as it is")
    assert out == ""
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--system", "Chatty."], "--system 'Chatty.': the memory {path} has the system message"),
        (["--prompt", "plain"], "--prompt plain: the memory {path} uses the 'chat' format"),
    ],
)
def test_system_or_prompt_that_differ_from_the_file_are_refused(
    monkeypatch, capsys, tmp_path, tiny, args, says
):
    path = tmp_path / "chat.kv"
    Memory(*tiny, system="Terse.").save(path)
    before = path.read_bytes()
    status, _, err = _chat(monkeypatch, capsys, path, "hello\n", *args)
    assert status == 2
    (line,) = err.splitlines()
    assert line.startswith("kvedit chat: error: " + says.format(path=path))
    assert path.read_bytes() == before
    # the same values are accepted
    status, _, err = _chat(
        monkeypatch, capsys, path, "hi\n", "--system", "Terse.", "--prompt", "chat"
    )
    assert status == 0, err


def test_a_memory_path_that_cannot_be_written_is_refused_before_the_model_loads(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr("kvedit.models.load_model", lambda *a: pytest.fail("model loaded"))
    for memory, says in [
        (tmp_path, f"--memory {tmp_path}: is a directory, not a file"),
        (tmp_path / "no" / "c.kv", f"--memory {tmp_path / 'no' / 'c.kv'}: the folder"),
    ]:
        status, _, err = _chat(monkeypatch, capsys, memory, "hi\n")
        assert status == 2
        assert err.startswith(f"kvedit chat: error: {says}")
    status, _, err = _chat(monkeypatch, capsys, tmp_path / "c.kv", "hi\n", "--system", " ")
    assert (status, err.strip()) == (
        2,
        "kvedit chat: error: --system is empty: give the system message, or leave --system out",
    )


def test_no_messages_writes_no_file(monkeypatch, capsys, tmp_path):
    path = tmp_path / "chat.kv"
    status, out, _ = _chat(monkeypatch, capsys, path, "\n/explain\n")
    assert status == 0
    assert out.splitlines()[-1] == f"memory {path} not written: no messages: 0 messages, 0 tok"
    assert not path.exists()


def test_a_real_pipe_gets_no_prompt_and_the_file(tmp_path):
    path = tmp_path / "chat.kv"
    done = subprocess.run(
        [sys.executable, "-m", "kvedit", *CHAT, "--memory", str(path)],
        input="hello\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "> " not in done.stdout
    assert done.stdout.splitlines()[-1].startswith(f"saved {path}: 2 messages, ")
    assert path.exists()


def test_focus_says_after_each_answer_what_it_did(monkeypatch, capsys, tmp_path, tiny):
    path = tmp_path / "chat.kv"
    questions = ["my locker code is 4821", "the river is calm", "what is my locker code?"]
    status, out, err = _chat(
        monkeypatch, capsys, path, "".join(q + "\n" for q in questions), "--focus"
    )
    assert status == 0, err
    said = [line for line in out.splitlines() if line.startswith("[focus: ")]
    memory, expected = Memory(*tiny), []  # the same lines through the library
    for q in questions:  # a statement asks nothing: focus stays off for it
        memory.ask(q, max_new_tokens=6, focus=q.endswith("?"), repetition_penalty=PENALTY)
        if not q.endswith("?"):
            expected.append("[focus: off, the line asks nothing]")
            continue
        expected.append(f"[focus: {memory.focus_said() or 'no earlier message to emphasize'}]")
    assert said == expected
    assert said[0] == said[1] == "[focus: off, the line asks nothing]" != said[2]
    assert Memory.load(path, *tiny).messages == memory.messages


def test_a_budget_forgets_and_the_turns_that_forgot_say_so(monkeypatch, capsys, tmp_path, tiny):
    path = tmp_path / "chat.kv"
    lines = "".join(
        f"was line {i}: my locker code is {4821 + i}, the river is calm?\n" for i in range(6)
    )
    budget = ["--max-tokens", "150", "--forget", "knorm", "--protect", "4821"]
    status, out, err = _chat(monkeypatch, capsys, path, lines, *budget)
    assert status == 0, err
    first, *rest = out.splitlines()
    assert first == (
        f"[new memory {path}, prompt 'chat', holds at most 150 entries a global layer on average "
        "(forgets by knorm, the last 16 tokens kept)]"
    )
    costs = [line for line in rest if "tok reused" in line]
    found = [
        re.search(r"\((\d+) of 150 entries held, question and answer on top\)", c) for c in costs
    ]
    held = [int(m.group(1)) for m in found]
    assert len(held) == 6 and max(held) <= 150
    forgot = [c for c in costs if ", forgot " in c]
    assert forgot and all(c.endswith(" s)]") and "(knorm, " in c for c in forgot)
    memory = Memory.load(path, *tiny)
    assert len(memory.forgetting) == len(forgot) and len(memory) == 12
    held_now = set(memory.state.layers[0].token_index.tolist())
    assert set(memory.state.token_indices("4821").tolist()) <= held_now  # --protect
    # the budget is in the file: a run without the options goes on under it
    status, out, err = _chat(monkeypatch, capsys, path, "/explain\n")
    assert status == 0, err
    n = len(forgot)
    assert out.splitlines()[0].endswith(
        "holds at most 150 entries a global layer on average (forgets by knorm, the last 16 "
        f"tokens kept); it forgot in {n} rounds before]"
    )
    assert f"forgetting (budget 150 entries per layer): {n} rounds ({n} by knorm), " in out
    # another policy from here on: the start line and /explain tell the rounds apart
    more = "".join(f"and line {i}: the bridge is old\n" for i in range(3))
    status, out, err = _chat(
        monkeypatch, capsys, path, more + "/explain\n", "--max-tokens", "150", "--forget", "window"
    )
    assert status == 0, err
    assert out.splitlines()[0].endswith(
        f"(forgets by window, the last 16 tokens kept); it forgot in {n} rounds before]"
    )
    m = len(Memory.load(path, *tiny).forgetting) - n
    assert m > 0 and f"({n} by knorm, {m} by window)" in out


def test_max_bytes_takes_a_size_with_units(monkeypatch, capsys, tmp_path, tiny):
    path = tmp_path / "chat.kv"
    lines = "".join(
        f"line {i}: my locker code is {4821 + i}, the river is calm\n" for i in range(8)
    )
    status, out, err = _chat(monkeypatch, capsys, path, lines, "--max-bytes", "96KiB")
    assert status == 0, err
    assert "holds at most 96.0 KiB" in out.splitlines()[0]
    said = re.findall(r"most\), ([\d.]+) KiB of 96\.0 KiB \((\d+)%\)", out)
    sizes = [float(x) for x, _ in said]
    assert len(sizes) == 8 and max(sizes) <= 96.0  # what each turn line prints, bounded
    assert [int(p) for _, p in said] == [round(100 * x / 96) for x in sizes]
    assert Memory.load(path, *tiny).nbytes <= 96 * 1024
    small = tmp_path / "small.kv"
    status, out, err = _chat(monkeypatch, capsys, small, "hi\n", "--max-bytes", "300")
    assert status == 2 and "raise --max-bytes" in err


@pytest.mark.parametrize(
    "budget",
    [["--max-bytes", "100"], ["--max-tokens", "10"], ["--max-tokens", "10", "--quantize", "4"]],
)
def test_a_budget_the_memory_can_never_hold_is_refused_before_the_first_question(
    monkeypatch, capsys, tmp_path, tiny, budget
):
    """Under one token, or under the protected part: exit 2, one line naming the option, the
    smallest budget that holds and why, before any question is answered (#65)."""
    path = tmp_path / "chat.kv"
    status, out, err = _chat(monkeypatch, capsys, path, "hello\n", "--system", "Terse.", *budget)
    assert status == 2 and out == ""
    (line,) = err.splitlines()
    assert f"{budget[0]} {budget[1]} can never hold: the smallest budget that holds is" in line
    assert "the protected part" in line and f"raise {budget[0]}" in line
    assert not path.exists()


def test_quantize_holds_older_messages_in_fewer_bits(monkeypatch, capsys, tmp_path, tiny):
    lines = "my locker code is 4821\nthe river is calm\nwhat now\n"
    plain, packed = tmp_path / "plain.kv", tmp_path / "packed.kv"
    assert _chat(monkeypatch, capsys, plain, lines)[0] == 0
    status, out, err = _chat(monkeypatch, capsys, packed, lines, "--quantize", "4", "--recent", "2")
    assert status == 0, err
    assert out.splitlines()[0] == (
        f"[new memory {packed}, prompt 'chat', messages before the last 2 held in 4 bits]"
    )
    a, b = Memory.load(plain, *tiny), Memory.load(packed, *tiny, quantize=4)
    assert a.messages == b.messages and b.nbytes < 0.75 * a.nbytes


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--forget", "knorm"],
            "--forget without a budget: give --max-tokens, --max-bytes or --keep",
        ),
        (
            ["--protect", "x"],
            "--protect without a budget: give --max-tokens, --max-bytes or --keep",
        ),
        (["--recent-tokens", "3"], "--recent-tokens without a budget"),
        (["--recent", "3"], "--exact-messages says which messages --quantize holds exact"),
        (["--max-bytes", "3XB"], "argument --max-bytes: expected a size such as 2000000"),
        (["--max-bytes", "0.5"], "argument --max-bytes: must be at least one byte"),
        (["--max-tokens", "9", "--max-bytes", "9"], "not allowed with argument"),
        (["--max-tokens", "9", "--forget", "lru"], "argument --forget: invalid choice: 'lru'"),
        (["--quantize", "3"], "argument --quantize: invalid choice: 3 (choose from 2, 4, 8)"),
        (["--quantize", "4", "--forget", "window"], "--forget without a budget"),
    ],
)
def test_bad_forgetting_options_are_refused_before_the_model_loads(
    monkeypatch, capsys, tmp_path, args, says
):
    monkeypatch.setattr("kvedit.models.load_model", lambda *a: pytest.fail("model loaded"))
    status, out, err = _chat(monkeypatch, capsys, tmp_path / "c.kv", "hi\n", *args)
    assert status == 2
    assert says in err.splitlines()[-1]
    assert not (tmp_path / "c.kv").exists()


def test_h2o_on_a_sliding_window_model_is_a_bad_option_and_the_file_is_left(
    monkeypatch, capsys, tmp_path
):
    path = tmp_path / "c.kv"
    Memory(*load_model("tiny-gemma3"), system="hi").save(path)
    before = path.read_bytes()
    status, out, err = _chat(
        monkeypatch, capsys, path, "hi\n", "--model", "tiny-gemma3",
        "--max-tokens", "50", "--forget", "h2o",
    )  # fmt: skip
    assert status == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(
        "kvedit chat: error: --max-tokens 50 --forget h2o: forget='h2o': cannot serve a model "
        "with sliding-window layers"
    )
    assert path.read_bytes() == before


def test_a_closed_output_pipe_ends_the_chat_without_a_message_and_saves(tmp_path):
    path = tmp_path / "chat.kv"
    chat = _start_chat(path)
    chat.stdin.write(b"hello\n")
    chat.stdin.flush()
    while b"tok reused" not in chat.stdout.readline():  # the first answer's cost line
        pass
    chat.stdout.close()  # the reader goes away, as `| head` does
    _, err = chat.communicate(b"and again\n", timeout=300)
    assert chat.returncode == 1
    assert err.decode() == ""
    memory = Memory.load(path, *load_model("tiny-llama"))  # saved on the way out
    assert [m.content for m in memory.messages][0] == "hello"


def test_a_broken_pipe_that_is_not_the_output_is_an_error(monkeypatch, capsys, tmp_path):
    def run_chat(args):
        raise BrokenPipeError(32, "Broken pipe")  # a socket's, say: stdout is fine

    monkeypatch.setattr("kvedit.cli.chat.run_chat", run_chat)
    with (tmp_path / "out").open("w") as out:  # a real, open stdout
        monkeypatch.setattr(sys, "stdout", out)
        status = cli_main([*CHAT, "--memory", str(tmp_path / "c.kv")])
    assert status == 1
    err = capsys.readouterr().err
    assert err.startswith("kvedit chat: error: ") and "Broken pipe" in err


# ---------------------------------------------------------------------------- in a terminal


def _pane(tmux, name: str, escapes: bool = False) -> str:
    args = [*tmux, "capture-pane", "-p", "-t", name, *(["-e"] if escapes else [])]
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


def _wait(tmux, name: str, done, what: str, timeout: float = 180) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = _pane(tmux, name)
        if done(text):
            return text
        time.sleep(0.3)
    pytest.fail(f"no {what} in the pane after {timeout} s:\n{_pane(tmux, name)}")


@contextlib.contextmanager
def _chat_pane(arguments: str, path: Path):
    """A tmux session running ``python -m kvedit ARGUMENTS --memory PATH`` (then printing
    ``EXIT=status``); yields ``(tmux command, pane name)`` and kills the server after. Each
    pane has a server of its own: the last one's may still be shutting down, its "chat"
    session alive (a shared socket made ``new-session`` fail now and then)."""
    socket = f"kvedit-chat-{os.getpid()}-{path.parent.name}-{time.monotonic_ns()}"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    name = "chat"
    command = (
        f"cd {REPO} && PYTHONPATH={REPO} {sys.executable} -m kvedit {arguments} "
        f"--memory {path}; echo EXIT=$?; sleep 300"
    )
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", name, "-x", "200", "-y", "50", command], check=True
    )
    try:
        yield tmux, name
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed: no terminal test")
@pytest.mark.parametrize("end", ["C-c", "C-d"])
def test_in_a_terminal_the_chat_answers_and_ctrl_c_or_ctrl_d_saves(tmp_path, end):
    path = tmp_path / "chat.kv"
    with _chat_pane(" ".join(CHAT), path) as (tmux, name):
        _wait(tmux, name, lambda t: t.rstrip().endswith(">"), "prompt")
        subprocess.run([*tmux, "send-keys", "-t", name, "hello there", "Enter"], check=True)
        text = _wait(tmux, name, lambda t: "tok reused" in t and t.rstrip().endswith(">"), "answer")
        assert "> hello there" in text
        assert "\x1b[" not in text  # capture-pane drops the escapes
        assert "\x1b[2m[" in _pane(tmux, name, escapes=True)  # dimmed on a terminal
        subprocess.run([*tmux, "send-keys", "-t", name, end], check=True)
        text = _wait(tmux, name, lambda t: "EXIT=" in t, "exit")
        lines = [line for line in text.splitlines() if line.strip()]
        assert lines[-2].startswith(f"saved {path}: 2 messages, "), text
        assert lines[-1] == f"EXIT={130 if end == 'C-c' else 0}"
        assert "Traceback" not in text and "error:" not in text
        assert len(Memory.load(path, *load_model("tiny-llama"))) == 2


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed: no terminal test")
def test_in_a_terminal_ctrl_c_during_an_answer_keeps_the_memory_as_before(tmp_path):
    path = tmp_path / "chat.kv"
    # on an idle machine tiny-llama can decode 1,000 tokens before a Ctrl-C sent a second
    # later lands: 3,500 (most of its 4,096 positions) keep the answer under way past it
    arguments = "chat --model tiny-llama --max-new-tokens 3500"
    with _chat_pane(arguments, path) as (tmux, name):
        _wait(tmux, name, lambda t: t.rstrip().endswith(">"), "prompt")
        subprocess.run([*tmux, "send-keys", "-t", name, "hello there", "Enter"], check=True)
        _wait(tmux, name, lambda t: "> hello there" in t, "question")
        time.sleep(0.3)  # the line is read: the answer is under way
        subprocess.run([*tmux, "send-keys", "-t", name, "C-c"], check=True)
        text = _wait(tmux, name, lambda t: "EXIT=" in t, "exit")
        assert "[interrupted: the question and its partial answer were not kept]" in text, text
        assert "tok reused" not in text
        lines = [line for line in text.splitlines() if line.strip()]
        assert lines[-2] == f"memory {path} not written: no messages: 0 messages, 0 tok", text
        assert lines[-1] == "EXIT=130"
        assert "Traceback" not in text and not path.exists()


# ------------------------------------------------------------------- the memory file (#56)


def _start_chat(path: Path) -> subprocess.Popen:
    """A ``kvedit chat`` on ``path`` in another process, once it has started (its start line
    read)."""
    chat = subprocess.Popen(
        [sys.executable, "-m", "kvedit", *CHAT, "--memory", str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert chat.stdout.readline().startswith(b"[")  # the start line: it holds the file
    return chat


def test_a_second_chat_on_one_memory_is_refused_and_a_killed_ones_lock_does_not_block(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    Memory(*tiny, system="Terse.").save(path)
    before = path.read_bytes()
    first = _start_chat(path)
    try:
        with monkeypatch.context() as m:  # refused before its model loads
            m.setattr("kvedit.models.load_model", lambda *a: pytest.fail("model loaded"))
            status, out, err = _chat(monkeypatch, capsys, path, "hello\n")
        assert (status, out) == (2, "")
        (line,) = err.splitlines()
        assert line.startswith(
            f"kvedit chat: error: --memory {path}: another kvedit chat is using it "
            f"(kvedit chat {first.pid}, since "
        )
        assert line.endswith("); end that chat first, or give another file")
        assert path.read_bytes() == before
    finally:
        first.kill()  # kill -9: its lock file stays, naming it
        first.communicate(timeout=60)
    assert f'"pid": {first.pid}' in (tmp_path / "chat.kv.lock").read_text()
    status, out, err = _chat(monkeypatch, capsys, path, "hello\n")
    assert status == 0, err
    assert len(Memory.load(path, *tiny)) == 3
    assert not (tmp_path / "chat.kv.lock").exists()  # released at the end: no file left


class _Lines:
    """A piped stdin whose line ``k`` runs ``actions[k]`` first (the file system changing while
    the chat runs)."""

    def __init__(self, lines: list[str], actions: dict) -> None:
        self.lines, self.actions, self.buffer, self.k = lines, actions, self, 0

    def isatty(self) -> bool:
        return False

    def readline(self) -> bytes:
        self.actions.get(self.k, lambda: None)()
        self.k += 1
        return self.lines[self.k - 1].encode() if self.k <= len(self.lines) else b""


def test_save_path_writes_a_copy_and_a_failed_save_is_one_error_line(
    monkeypatch, capsys, tmp_path, tiny
):
    path, copy, held = tmp_path / "chat.kv", tmp_path / "copy.kv", tmp_path / "held.kv"
    lines = ["one\n", f"/save {copy}\n", "/save\n", f"/save {tmp_path}\n", f"/save {held}\n"]
    lines += ["two\n"]
    actions = {2: path.mkdir, 5: path.rmdir}  # the chat's own file a folder for a while
    monkeypatch.setattr(sys, "stdin", _Lines(lines, actions))
    capsys.readouterr()
    with WriterLock(tmp_path / "held.kv.lock", "kvedit chat"):  # another chat's file
        status = cli_main([*CHAT, "--memory", str(path)])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert f"[saved a copy {copy}: 2 messages, " in out
    assert [m.content for m in Memory.load(copy, *tiny).messages][0] == "one"
    errors = err.splitlines()
    assert len(errors) == 3 and all(e.startswith("kvedit chat: error: /save ") for e in errors)
    assert all(
        e.endswith("; nothing was saved, and the chat goes on with its messages") for e in errors
    )
    assert errors[0].startswith(f"kvedit chat: error: /save {path}: ") and "directory" in errors[0]
    assert (
        errors[1].startswith(f"kvedit chat: error: /save {tmp_path}: ") and "directory" in errors[1]
    )
    assert errors[2].startswith(
        f"kvedit chat: error: /save {held}: another kvedit chat is using it (kvedit chat "
        f"{os.getpid()}, since "
    )
    assert not held.exists()
    memory = Memory.load(path, *tiny)  # saved at the end, every turn kept
    assert [m.content for m in memory.messages][::2] == ["one", "two"]


def test_a_memory_that_is_a_link_is_written_through_and_locked_as_its_file(
    monkeypatch, capsys, tmp_path, tiny
):
    (tmp_path / "files").mkdir()
    file, link = tmp_path / "files" / "memory.kv", tmp_path / "chat.kv"
    link.symlink_to(file)  # dangling: the chat's first save makes the file
    status, out, err = _chat(monkeypatch, capsys, link, "hello\n")
    assert status == 0, err
    assert link.is_symlink() and len(Memory.load(file, *tiny)) == 2
    with WriterLock(tmp_path / "files" / "memory.kv.lock", "kvedit chat"):  # a chat on the file
        status, _, err = _chat(monkeypatch, capsys, link, "again\n")
    assert status == 2 and "another kvedit chat is using it" in err
    status, out, err = _chat(monkeypatch, capsys, link, "again\n")
    assert status == 0, err
    assert out.splitlines()[0].startswith(f"[memory {link}: 2 messages")
    assert link.is_symlink() and len(Memory.load(file, *tiny)) == 4
    assert [n for n in os.listdir(tmp_path) if n != "files" and n != "chat.kv"] == []


def test_opening_a_memory_sweeps_what_a_killed_save_left(monkeypatch, capsys, tmp_path, tiny):
    path = tmp_path / "chat.kv"
    Memory(*tiny, system="Terse.").save(path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f".chat.kv{TEMP_MARKER}{dead.pid}@{host_tag()}-{'0' * 16}"
    left.mkdir()
    (left / "chat.kv").write_bytes(b"half a file" * 1000)
    status, out, err = _chat(monkeypatch, capsys, path, "")  # nothing asked: nothing saved
    assert status == 0, err
    assert out.splitlines()[-1].startswith(f"memory {path} unchanged")
    assert not left.exists()


def test_a_save_that_fails_on_a_full_disk_is_one_plain_error_line(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    real_save, saves = Memory.save, []

    def save(self, p):  # the disk is full at the first save only
        saves.append(p)
        if len(saves) == 1:
            raise StorageError(errno.ENOSPC, f"cannot write {p}: No space left on device")
        return real_save(self, p)

    monkeypatch.setattr(Memory, "save", save)
    status, _, err = _chat(monkeypatch, capsys, path, "one\n/save\ntwo\n")
    assert status == 0, err
    assert err.splitlines() == [
        f"kvedit chat: error: /save {path}: cannot write {path}: No space left on device; "
        "nothing was saved, and the chat goes on with its messages"
    ]
    assert len(Memory.load(path, *tiny)) == 4  # saved at the end, every turn kept


def test_focus_under_an_entry_budget_answers_every_round(monkeypatch, capsys, tmp_path, tiny):
    """``--focus --max-tokens N`` makes a memory whose heads keep the same entries (focus reads
    them so): every question answered past the first round, none refused (#65)."""
    path = tmp_path / "chat.kv"
    lines = "".join(
        f"was line {i}: my locker code is {4821 + i}, the river is calm?\n" for i in range(6)
    )
    status, out, err = _chat(monkeypatch, capsys, path, lines, "--max-tokens", "60", "--focus")
    assert status == 0 and err == "", err
    assert out.count("[focus: ") == 6
    memory = Memory.load(path, *tiny)
    assert memory.forgetting and memory.budget.keep == "layer"


def test_focus_on_a_file_that_forgot_per_head_is_refused_at_start(
    monkeypatch, capsys, tmp_path, tiny
):
    path = tmp_path / "chat.kv"
    mem = Memory(*tiny, system="You are terse.", max_tokens=60, forget="kvzip")
    for i in range(6):
        mem.add("user", f"line {i}: my locker code is {4821 + i}, the river is calm")
    assert mem.budget.per_head and mem.forgetting
    mem.save(path)
    before = path.read_bytes()
    status, out, err = _chat(monkeypatch, capsys, path, "hi\n", "--focus")
    assert status == 2 and out == ""
    (line,) = err.splitlines()
    assert "forgot per KV head" in line and "leave --focus out" in line
    assert path.read_bytes() == before
