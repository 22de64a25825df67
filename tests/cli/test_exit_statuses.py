"""The CLI's exit statuses, in one place: every refusal is one line on stderr
(``kvedit <command>: error: <message>``) with a documented status (0: done; 2: bad arguments or
input, refused before any work; 1: any other failure), ``--debug`` or ``KVEDIT_DEBUG=1`` adds
the traceback. (``kvedit chat``'s statuses are in ``tests/cli/test_chat.py``, beside the chat;
``kvedit eval memory``'s refusals in ``tests/evals/``.)

Only tiny models (``kvedit.testing``): the whole file runs in a few seconds.
"""

from __future__ import annotations

import pytest

from kvedit import checks
from kvedit.cli import EXIT_FAILURE, EXIT_USAGE
from kvedit.cli import main as cli_main
from kvedit.errors import InvalidInputError

GOOD_LINE = (
    '{"id": "a", "instruction": "Answer.", "documents": ["x"], "separator": "\\n", '
    '"question": "q?", "answers": ["x"], "gold_index": 0}\n'
)

FILES = {
    "bin.txt": b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
    "latin1.txt": "line one\nna\xefve\n".encode("latin-1"),
    "nul.txt": b"text\n\x00more",
    "empty.txt": b"",
    "blank.txt": b" \n\n\t\n",
    "context.txt": b"Alice's secret number is 4821. " * 40,
    "empty.jsonl": b"",
    "broken.jsonl": (GOOD_LINE + '{"id": "b", \n').encode(),
    "binary.jsonl": b"\xff\xfe\x00\x01",
    "bad.jsonl.gz": b"not gzip at all",
    "extra-key.jsonl": GOOD_LINE.replace('"id"', '"colour": 1, "id"').encode(),
}

# (name, argv, exit status, what stderr's last line must contain)
CLI_CASES = [
    ("version", ["--version"], 0, None),
    ("publish-missing-context", ["publish", "--context", "missing.txt"], 2, "missing.txt: no such"),
    ("publish-context-is-a-dir", ["publish", "--context", "."], 2, "is a directory"),
    ("publish-binary-context", ["publish", "--context", "bin.txt"], 2, "bin.txt:1: not UTF-8"),
    ("publish-latin1-context", ["publish", "--context", "latin1.txt"], 2, "latin1.txt:2: not UTF"),
    ("publish-nul-context", ["publish", "--context", "nul.txt"], 2, "nul.txt:2: a NUL byte"),
    ("publish-empty-context", ["publish", "--context", "empty.txt"], 2, "empty.txt: the file is"),
    ("publish-blank-context", ["publish", "--context", "blank.txt"], 2, "blank.txt: the file is"),
    ("publish-empty-root", ["publish", "--context", "context.txt", "--root", ""], 2, "--root"),
    ("publish-port-0", ["publish", "--context", "context.txt", "--port", "0"], 2, "1..65535"),
    ("publish-max-tokens-0", ["publish", "--context", "x", "--max-tokens", "0"], 2, "at least 1"),
    (
        "publish-guard-without-focus",
        ["publish", "--context", "context.txt", "--guard", "none"],
        2,
        "--guard needs --focus",
    ),
    (
        "publish-unknown-guard",
        ["publish", "--context", "context.txt", "--focus", "q", "--guard", "maybe"],
        2,
        "invalid choice: 'maybe'",
    ),
    (
        "publish-request-without-question",
        ["publish", "--context", "context.txt", "--request", "r.json"],
        2,
        "--request needs",
    ),
    (
        "publish-context-too-long",
        ["publish", "--context", "context.txt", "--model", "tiny-llama", "--max-positions", "64"],
        2,
        "tokens long and does not fit: the model attends to at most 64",
    ),
    (
        "publish-context-and-answer-too-long",
        ["publish", "--context", "context.txt", "--model", "tiny-llama", "--max-positions", "400"]
        + ["--question", "Whose number is 4821?", "--max-tokens", "200"],
        2,
        "kept for what follows",
    ),
    ("litm-missing-data", ["eval", "litm", "--data", "missing.jsonl"], 2, "missing.jsonl: no such"),
    ("litm-empty-data", ["eval", "litm", "--data", "empty.jsonl"], 2, "empty.jsonl: no examples"),
    ("litm-broken-line", ["eval", "litm", "--data", "broken.jsonl"], 2, "broken.jsonl:2: bad JSON"),
    ("litm-binary-data", ["eval", "litm", "--data", "binary.jsonl"], 2, "binary.jsonl:1: not UTF"),
    ("litm-not-gzip", ["eval", "litm", "--data", "bad.jsonl.gz"], 2, "bad.jsonl.gz: not a"),
    ("litm-unknown-key", ["eval", "litm", "--data", "extra-key.jsonl"], 2, "unknown key"),
    ("litm-positions-abc", ["eval", "litm", "--positions", "0,abc"], 2, "'abc' is not a number"),
    ("litm-positions-negative", ["eval", "litm", "--positions", "-1"], 2, "count from 0"),
    ("litm-positions-out-of-range", ["eval", "litm", "--n-docs", "5", "--positions", "9"], 2, "9"),
    ("litm-trials-0", ["eval", "litm", "--trials", "0"], 2, "--trials: must be at least 1"),
    ("litm-limit-0", ["eval", "litm", "--limit", "0"], 2, "--limit: must be at least 1"),
    ("litm-unknown-method", ["eval", "litm", "--methods", "none,bogus"], 2, "unknown method"),
    ("litm-missing-reuse", ["eval", "litm", "--reuse", "gone.json"], 2, "gone.json: no such"),
    ("litm-reuse-methods-alone", ["eval", "litm", "--reuse-methods", "none"], 2, "needs --reuse"),
    ("litm-reuse-unchecked-alone", ["eval", "litm", "--reuse-unchecked"], 2, "needs --reuse"),
    ("demo-trials-0", ["demo", "--trials", "0"], 2, "at least 1"),
    ("serve-empty-root", ["serve", "--root", ""], 2, "--root"),
    ("serve-port-text", ["serve", "--port", "http"], 2, "port number"),
    ("serve-forget-runs-model", ["serve", "--forget", "kvzip"], 2, "cannot serve"),
    (
        "serve-forget-no-memories",
        ["serve", "--no-memories", "--forget", "learned"],
        2,
        "need the chat memories on",
    ),
    ("serve-memory-bytes-0", ["serve", "--memory-max-bytes", "0"], 2, "--memory-max-bytes"),
    ("serve-memory-bytes-text", ["serve", "--memory-max-bytes", "lots"], 2, "--memory-max-bytes"),
    ("unknown-model", ["publish", "--context", "context.txt", "--model", "nope"], 2, "nope"),
]


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVEDIT_DEBUG", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    "argv,status,message", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES]
)
def test_cli_refuses_in_one_line(inputs, capsys, argv, status, message):
    if argv[:2] == ["eval", "litm"] or argv[0] == "demo":
        argv = [*argv, "--model", "no-such-model", "--out", str(inputs / "out")]
    assert cli_main(argv) == status
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if status == 0:
        assert out.startswith("kvedit ")
        return
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvedit "), last
    assert ": error: " in last and message in last, last
    assert not (inputs / "out").exists()  # refused before any work
    assert not list(inputs.glob("published/*.safetensors"))


def test_cli_error_line_names_the_command(inputs, capsys):
    assert cli_main(["eval", "litm", "--data", "empty.jsonl"]) == EXIT_USAGE
    assert capsys.readouterr().err.startswith("kvedit eval litm: error: empty.jsonl")


@pytest.mark.parametrize("how", ["flag-before", "flag-after", "env"])
def test_debug_shows_the_traceback(inputs, capsys, monkeypatch, how):
    argv = ["publish", "--context", "missing.txt"]
    if how == "flag-before":
        argv = ["--debug", *argv]
    elif how == "flag-after":
        argv = [*argv, "--debug"]
    else:
        monkeypatch.setenv("KVEDIT_DEBUG", "1")
    assert cli_main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("missing.txt: no such file")


def test_an_unexpected_error_is_one_line_and_status_1(inputs, capsys, monkeypatch):
    import kvedit.cli.serving

    def boom(*args, **kwargs):
        raise RuntimeError("something broke")

    monkeypatch.setattr(kvedit.cli.serving, "read_input", boom)
    assert cli_main(["publish", "--context", "context.txt"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "kvedit publish: error: RuntimeError: something broke" in err and "--debug" in err


def test_max_positions_of_the_cli_reaches_the_check_and_does_not_leak(inputs, capsys):
    """``--max-positions`` travels in the command's arguments: it refuses this call's context,
    and the next call in the same process (without it) has the model's own limit again."""
    from kvedit.cli.main import run

    args = ["publish", "--context", "context.txt", "--model", "tiny-llama", "--root", "pub"]
    with pytest.raises(InvalidInputError, match="does not fit: the model attends to at most 64"):
        run([*args, "--max-positions", "64"])
    assert not (inputs / "pub").exists()
    assert run(args) == 0  # within tiny-llama's own 4096 positions
    assert len(list((inputs / "pub").rglob("*.safetensors"))) == 1
    assert not hasattr(checks, "MAX_POSITIONS")


@pytest.mark.parametrize("flag", ["--question", "--focus"])
def test_publish_refuses_an_empty_question(tmp_path, capsys, flag):
    path = tmp_path / "context.txt"
    path.write_text("Some text.")
    args = ["publish", "--root", str(tmp_path / "pub"), "--context", str(path), flag, " "]
    assert cli_main(args) == 2
    assert f"{flag} is empty" in capsys.readouterr().err
    assert not (tmp_path / "pub").exists()
