"""Bad inputs, one probe per case, gathered here so that a regression fails by name.

Each probe is a case of the hardening issue: the CLI answers with one line on stderr
(``kvedit <command>: error: <message>``) and a documented exit status (2: bad arguments or
input; 1: other failures) instead of a traceback; contexts longer than the model attends to are
refused before the model runs; library functions raise :class:`~kvedit.errors.KVEditError`
subclasses; the vLLM publish root is checked and swept of a killed writer's leftovers.

Only tiny models (``kvedit.testing``): the whole file runs in a few seconds.
"""

from __future__ import annotations

import gzip
import logging
import os
import time

import pytest
import torch

from kvedit import checks
from kvedit.cli import EXIT_FAILURE, EXIT_USAGE
from kvedit.cli import main as cli_main
from kvedit.errors import InvalidExampleError, InvalidInputError, InvalidTypeError, KVEditError
from kvedit.evals.jsonl import load_jsonl
from kvedit.focusing.choice import best_covered, stands_out
from kvedit.states.capturing import capture, capture_tokens

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


# ------------------------------------------------------------------------ the length limit


@pytest.fixture
def short_llama(llama, monkeypatch):
    """The tiny Llama, its config saying it attends to 16 positions."""
    model, tok = llama
    monkeypatch.setattr(model.config.get_text_config(), "max_position_embeddings", 16)
    return model, tok


LONG = "Alice's secret number is 4821. " * 10


def test_capture_refuses_a_context_longer_than_the_model_attends_to(short_llama):
    model, tok = short_llama
    n = len(tok(LONG)["input_ids"])
    with pytest.raises(InvalidInputError, match=f"is {n} tokens long .* at most 16 positions"):
        capture(model, tok, LONG)
    with pytest.raises(InvalidInputError, match="pass max_positions= or give the CLI"):
        capture(model, tok, LONG)  # capture takes the keyword, so its message offers it


def test_capture_tokens_refuses_too_many_ids(short_llama):
    model, tok = short_llama
    with pytest.raises(InvalidInputError, match="is 17 tokens long .* at most 16"):
        capture_tokens(model, tok, [5] * 17)


def test_a_huge_context_is_refused_before_tokenizing(short_llama):
    model, _ = short_llama

    class NoTokenizer:
        def __call__(self, *args, **kwargs):
            raise AssertionError("tokenized a text that cannot fit")

    text = "x" * (16 * checks.MAX_CHARS_PER_TOKEN + 1)
    with pytest.raises(InvalidInputError, match=f"{len(text)} characters long.* 16 tokens"):
        capture(model, NoTokenizer(), text)


def test_the_limit_can_be_overridden(short_llama):
    model, tok = short_llama
    state = capture(model, tok, LONG, max_positions=4096)
    assert len(state) > 16
    assert not hasattr(checks, "MAX_POSITIONS")  # a keyword, no module-wide setting


def test_room_for_the_question_and_answer_is_kept(short_llama):
    model, _ = short_llama
    checks.context_fits(model, n_tokens=10, reserve=6)
    with pytest.raises(InvalidInputError, match="16 positions, 7 of them kept .* leaving 9"):
        checks.context_fits(model, n_tokens=10, reserve=7)
    with pytest.raises(InvalidInputError, match="no room"):
        checks.context_fits(model, n_tokens=1, reserve=16)


# ------------------------------------------------------------------------ library errors


@pytest.mark.parametrize(
    "prompt,error",
    [
        (["a prompt", "a prompt"], InvalidTypeError),
        (None, InvalidTypeError),
        (b"bytes", InvalidTypeError),
        ("", InvalidInputError),
    ],
    ids=["list", "none", "bytes", "empty"],
)
def test_steering_generate_takes_one_prompt(llama, prompt, error):
    from kvedit.steering.session import steer

    model, tok = llama
    with pytest.raises(error, match="prompt"):
        steer(model, tok, emphasize="a").generate(prompt)


def test_steering_generate_refuses_a_prompt_without_room_to_answer(short_llama):
    from kvedit.steering.session import steer

    model, tok = short_llama
    with pytest.raises(InvalidInputError, match="kept for what follows"):
        steer(model, tok, emphasize="Alice").generate("Alice's number?", max_new_tokens=15)
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        steer(model, tok, emphasize="Alice").generate("Alice?", max_new_tokens=0)


@pytest.mark.parametrize(
    "name,data,message",
    [
        ("missing.jsonl", None, "no such file"),
        ("dir.jsonl", "dir", "is a directory"),
        ("binary.jsonl", b"ok\n\xff", ":2: not UTF-8"),
        ("empty.jsonl", b"", "no examples"),
        ("broken.jsonl", (GOOD_LINE + "{").encode(), ":2: bad JSON"),
        ("bad.jsonl.gz", b"nope", "not a complete gzip"),
        ("cut.jsonl.gz", gzip.compress(GOOD_LINE.encode())[:-6], "not a complete gzip"),
    ],
)
def test_load_jsonl_names_the_file_and_line(tmp_path, name, data, message):
    path = tmp_path / name
    if data == "dir":
        path.mkdir()
    elif data is not None:
        path.write_bytes(data)
    with pytest.raises(InvalidExampleError, match=message) as info:
        load_jsonl(path)
    assert str(path) in str(info.value)


@pytest.fixture(scope="module")
def long_state(llama):
    """A 288-token capture (9 key groups of 32) of the tiny Llama (head size 16)."""
    model, tok = llama
    ids = tok(" ".join(f"w{i}" for i in range(400)))["input_ids"][:288]
    state = capture_tokens(model, tok, ids)
    assert len(state) == 288
    return state


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(kwargs, id=name)
        for name, kwargs in [
            ("bits-3", {"bits": 3}),
            ("bits-16", {"bits": 16}),
            ("residual-negative", {"residual": -1}),
            ("group-0", {"group": 0}),
            ("group-not-dividing", {"group": 12}),
        ]
    ],
)
def test_quantize_refuses_with_a_kvedit_error(long_state, kwargs):
    from kvedit import ops

    with pytest.raises(KVEditError):
        ops.quantize(long_state, **kwargs)


def test_quantize_with_no_residual_compresses(long_state):
    from kvedit import ops

    out = ops.quantize(long_state, bits=4, residual=0)
    assert out.nbytes < long_state.nbytes / 2
    assert all(layer.packed for layer in out.layers if layer.window is None)
    assert len(out.generate("Question: who?", 3)) > 0  # the last input, kept exact, reruns


def test_select_of_a_packed_state_is_refused_before_any_work(long_state):
    from kvedit import compress, ops

    small = ops.quantize(long_state, 8)
    with pytest.raises(InvalidInputError, match="select the dense state first"):
        compress.select(small, "knorm", 0.5)
    out = ops.quantize(compress.select(long_state, "knorm", 0.5), 8)  # the order that works
    assert out.nbytes < small.nbytes


@pytest.mark.parametrize("root", ["", "   ", None])
def test_publish_refuses_an_empty_root(llama, tmp_path, monkeypatch, root):
    from kvedit.integrations.vllm import publish

    model, tok = llama
    monkeypatch.chdir(tmp_path)
    state = capture(model, tok, "Alice's secret number is 4821.")
    with pytest.raises(InvalidInputError, match="publish root"):
        publish(state, root)
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------ publish leftovers


def _leftovers(root, age: float = 0.0, tag: int = 0) -> list:
    made = []
    for i, is_dir in enumerate([True, False]):
        path = root / f".{i}-{'0' * 32}.safetensors.kvedit-tmp-{tag:08x}{i:08x}"
        if is_dir:
            path.mkdir()
            (path / "inner.safetensors").write_bytes(b"half")
        else:
            path.write_bytes(b"half")
        if age:
            stamp = time.time() - age
            os.utime(path, (stamp, stamp))
        made.append(path)
    return made


def test_publish_sweeps_what_killed_writers_left(llama, tmp_path, caplog):
    from kvedit.integrations.vllm import publish

    model, tok = llama
    root = tmp_path / "root"
    root.mkdir()
    left = _leftovers(root)
    with caplog.at_level(logging.WARNING, logger="kvedit.integrations.vllm.files"):
        publish(capture(model, tok, "Alice's secret number is 4821."), root)
    assert not any(p.exists() for p in left)
    assert "removed 2 temporary file(s)" in caplog.text and str(root) in caplog.text
    assert len(list(root.glob("*.safetensors"))) == 1


def test_publish_keeps_a_live_writers_temporary_files(llama, tmp_path):
    fcntl = pytest.importorskip("fcntl")
    from kvedit.integrations.vllm import files, publish

    model, tok = llama
    root = tmp_path / "root"
    root.mkdir()
    young = _leftovers(root)
    old = _leftovers(root, age=2 * files.STALE_TEMP_SECONDS, tag=1)
    fd = os.open(root / files.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # another writer, alive
        publish(capture(model, tok, "Alice's secret number is 4821."), root)
    finally:
        os.close(fd)
    assert all(p.exists() for p in young)
    assert not any(p.exists() for p in old)


# ------------------------------------------------------------------------ the app


def test_the_app_hands_top_k_to_the_validator_unrounded(llama):
    """2.5 typed in the Passages box reaches /focus as 2.5 and is refused (a box that rounded,
    as Gradio's ``precision=0`` does, would hand on 2 and pick two passages)."""
    pytest.importorskip("gradio")  # the app's extra; not in the vLLM environment
    from apps.highlight import Highlighter, build_app

    model, tok = llama
    demo = build_app(Highlighter(model, tok, "tiny-llama", focus_threshold=None))
    endpoint = next(f for f in demo.fns.values() if f.api_name == "focus")
    context, question, top_k = endpoint.inputs
    assert top_k.elem_id == "top-k"
    typed = top_k.preprocess(2.5)
    assert typed == 2.5
    picked, _, passages, status = endpoint.fn(
        "Alice's number is 1. Bob's number is 2. Carol's number is 3.", "Whose?", typed
    )
    assert (picked, passages) == ("", [])
    assert status.startswith("**Not run:**") and "whole number" in status


# ------------------------------------------------------------------------ new entry points


@pytest.mark.parametrize(
    "rule,problem",
    [
        ({"gradual": 0.5}, "gradual must be a number >= 1"),
        ({"leading": 0}, "leading must be an int >= 1"),
        ({"rescale": 0}, "rescale must be a factor in"),
        ({"rescale": 2e4}, "rescale must be a factor in"),
        ({"previous": "  "}, "previous must be a non-empty passage text"),
        ({"previous": "Notes.", "context": "alone"}, 'previous needs context="prefix"'),
        ({"previous": "word " * 40_000}, r"previous passage and longest later part is \d+ tokens"),
    ],
    ids=[
        "gradual-below-1",
        "leading-0",
        "rescale-0",
        "rescale-over-limit",
        "previous-blank",
        "previous-without-prefix",
        "previous-over-the-context",
    ],  # fmt: skip
)
def test_blend_refuses_a_bad_rule_before_any_work(llama, tmp_path, rule, problem):
    import kvedit
    from kvedit.store import KVStore

    model, tok = llama
    store_dir = tmp_path / "store"
    with pytest.raises(InvalidInputError, match=problem):
        kvedit.blend(model, tok, ["Prefix.", " A passage."], KVStore(store_dir), **rule)
    assert not store_dir.exists() or not any(store_dir.rglob("*.safetensors"))  # nothing stored


@pytest.mark.parametrize(
    "parts,previous,problem",
    [
        (["Prefix."] + [" word" * 1500] * 4, None, r"the blend is \d+ tokens long"),
        (["Prefix.", " A.", " word" * 1000], " word" * 1000, r"and longest later part is \d+ tok"),
    ],
    ids=["blend-over-the-context", "part-behind-previous-over-the-context"],
)
def test_blend_refuses_more_than_the_model_attends_to_before_any_work(
    llama, tmp_path, parts, previous, problem
):
    import kvedit
    from kvedit.store import KVStore

    model, tok = llama  # 4096 positions
    store_dir = tmp_path / "store"
    with pytest.raises(InvalidInputError, match=problem) as refused:
        kvedit.blend(model, tok, parts, KVStore(store_dir), previous=previous)
    assert not store_dir.exists() or not any(store_dir.rglob("*.safetensors"))  # nothing stored
    # blend takes max_positions=, so its message offers it
    assert "pass max_positions=" in str(refused.value)


def test_focus_refuses_an_edit_that_is_not_a_function(llama):
    import kvedit

    model, tok = llama
    state = capture(model, tok, "Alice's secret number is 4821.\n\nBob's is 7310.")
    with pytest.raises(InvalidTypeError, match="edit must be a function"):
        kvedit.focus(state, " Whose is 7310?", edit="reread")


@pytest.mark.parametrize(
    "call",
    [
        lambda: best_covered(
            "Who is Cy?", ["Cy is 1.", "Bo is 2."], torch.ones(3, dtype=torch.bool)
        ),
        lambda: stands_out(torch.zeros(4), None, 2.5, torch.ones(2, dtype=torch.bool)),
        lambda: stands_out(torch.zeros(4), [True, False, True, True]),
    ],
    ids=["best_covered-candidates", "stands_out-eligible", "stands_out-candidates-list"],
)
def test_focus_masks_of_the_wrong_shape_are_named(call):
    with pytest.raises(InvalidInputError, match=r"(candidates|eligible) must be a mask of the"):
        call()
