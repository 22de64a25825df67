"""The highlight app (``apps/highlight/``): request parsing, the steering itself,
Auto-highlight, the ``/steer`` and ``/focus`` endpoints of a server started with ``kvedit app``
and called with ``gradio_client``, and the app in the wheel (installed as
``kvedit_apps.highlight``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import html
import inspect
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from gradio_client import Client
from helpers import free_port

import kvedit
from apps import highlight
from apps.highlight import Highlighter, InputError, Limits, span_lines, split_prompt, strip_markers

REPO = Path(__file__).resolve().parents[2]

CONTEXT = (
    "Alice's secret number is 4821. Bob's secret number is 7310. "
    "Carol's secret number is 5902. Dave's secret number is 1234."
)
QUESTION = "What is Carol's secret number?"


@pytest.fixture(scope="module")
def app(llama):
    model, tok = llama
    # A random tiny model: no passage stands out, so the abstain rule is off here (it is
    # tested on the real model in test_focus_abstain.py and below).
    return Highlighter(model, tok, "tiny-llama", focus_threshold=None)


# ------------------------------------------------------------------------- parsing the request


def test_strip_markers_gives_clean_text_and_ranges():
    marked = strip_markers("A [[red]] fox and a {{blue}} hen [[ran]].")
    assert marked.context == "A red fox and a blue hen ran."
    assert [marked.context[a:b] for a, b in marked.emphasize] == ["red", "ran"]
    assert [marked.context[a:b] for a, b in marked.suppress] == ["blue"]


def test_strip_markers_keeps_text_without_markers():
    marked = strip_markers("plain [text] {here}")
    assert marked == highlight.Marked("plain [text] {here}", (), ())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a [[b c", "Unmatched `[[`"),
        ("a b]] c", "Unmatched `]]`"),
        ("a {{b}} c}}", "Unmatched `}}`"),
        ("a [[b {{c}} d]]", "Nested markers"),
        ("a [[  ]] b", "Empty marked span"),
    ],
)
def test_bad_markers_are_explained(text, message):
    with pytest.raises(InputError, match=re.escape(message)):
        strip_markers(text)


def test_span_lines_skip_blank_lines_and_strip():
    assert span_lines("  Alice \n\n\tBob's number\r\n ") == ["Alice", "Bob's number"]
    assert span_lines(None) == []


def test_split_prompt_cuts_the_template_after_the_context(llama):
    _, tok = llama
    split = split_prompt(tok, CONTEXT, QUESTION)
    full = kvedit.templated_prompt(tok, CONTEXT + "\n\nQuestion: " + QUESTION)
    assert split.prefix + split.continuation == full
    assert split.prefix.endswith(CONTEXT)
    assert split.prefix[split.context_start :] == CONTEXT
    assert split.continuation.startswith("\n\nQuestion: " + QUESTION)
    assert "<|im_start|>assistant" in split.continuation


def test_split_prompt_falls_back_to_the_plain_message_when_the_template_rewrites_it(llama):
    import copy

    _, tok = llama
    odd = copy.deepcopy(tok)
    odd.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    split = split_prompt(odd, CONTEXT, QUESTION)
    assert (split.prefix, split.context_start) == (CONTEXT, 0)
    assert split.continuation == highlight.QUESTION_SEPARATOR + QUESTION


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "Alice", "", 2.0, QUESTION), "context is empty"),
        ((CONTEXT, "Alice", "", 2.0, " "), "Ask a question"),
        ((CONTEXT, "", "", 2.0, QUESTION), "Mark at least one span"),
        ((CONTEXT, "Zed", "", 2.0, QUESTION), "not found in the context: “Zed”"),
        ((CONTEXT, "Alice", "Mallory\nBob", 2.0, QUESTION), "Span to suppress not found"),
        ((CONTEXT, "Alice", "", 11.0, QUESTION), "between 0 and 10"),
        ((CONTEXT, "Alice", "", float("nan"), QUESTION), "between 0 and 10"),
        ((CONTEXT, "Alice", "", "strong", QUESTION), "must be a number"),
        ((CONTEXT, "Alice's", "Alice", 2.0, QUESTION), "both to emphasize and to suppress"),
        (("[[Alice]]" + CONTEXT, "", "Alice", 2.0, QUESTION), "both to emphasize"),
        (("x" * 12_001, "x", "", 2.0, QUESTION), "too long: 12,001 characters"),
        ((CONTEXT, "Alice", "", 2.0, "?" * 501), "question is too long"),
        ((CONTEXT, "\n".join("Alice" for _ in range(33)), "", 2.0, QUESTION), "Too many spans"),
    ],
)
def test_invalid_requests_get_clear_messages(app, args, message):
    with pytest.raises(InputError, match=re.escape(message)):
        app.run(*args)


def test_token_limit_is_reported(llama):
    model, tok = llama
    small = Highlighter(model, tok, "tiny-llama", Limits(max_context_tokens=20))
    with pytest.raises(InputError, match=r"too long: \d+ tokens with the chat template \(max 20\)"):
        small.run(CONTEXT, "Alice", "", 2.0, QUESTION)


def test_spans_sharing_a_token_are_refused(app):
    # "Ali" and "ce" are different characters but the same token.
    with pytest.raises(InputError, match="share the token"):
        app.run("[[Ali]]{{ce}} Alice", "", "", 2.0, "Who?")


# ------------------------------------------------------------------------- steering


def test_run_steers_the_cache_and_reports_attention(app, llama, tmp_path):
    model, tok = llama
    gold = "Carol's secret number is 5902."
    result = app.run(CONTEXT, gold, "", 4.0, QUESTION, save_dir=tmp_path)

    split = split_prompt(tok, CONTEXT, QUESTION)
    state = kvedit.capture(model, tok, split.prefix)
    span = (split.prefix.index(gold), split.prefix.index(gold) + len(gold))
    edited = kvedit.ops.emphasize(state, [span], 4.0)
    limit = app.limits.max_new_tokens
    assert result.baseline == state.generate(split.continuation, limit).strip()
    assert result.steered == edited.generate(split.continuation, limit).strip()
    assert result.baseline != result.steered  # 4 nats change this random model's answer

    share = [
        kvedit.attention_share(s, split.continuation, [span]).total.item() for s in (state, edited)
    ]
    assert share[1] > share[0]
    assert f"{100 * share[0]:.1f}% → **{100 * share[1]:.1f}%**" in result.status

    # The downloaded cache is the edited one.
    loaded = kvedit.load_state(result.cache_path, model, tok)
    assert Path(result.cache_path).parent == tmp_path
    assert loaded.generate(split.continuation, limit).strip() == result.steered


def test_inline_markers_match_listed_spans(app):
    listed = app.run(CONTEXT, "Carol's secret number is 5902.", "Dave", 3.0, QUESTION)
    inline = app.run(
        CONTEXT.replace(
            "Carol's secret number is 5902.", "[[Carol's secret number is 5902.]]"
        ).replace("Dave", "{{Dave}}"),
        "",
        "",
        3.0,
        QUESTION,
    )
    assert (inline.baseline, inline.steered) == (listed.baseline, listed.steered)
    assert "suppressed spans (" in inline.status


def test_attention_view_colours_tokens_and_escapes_html(app):
    context = "<b>Alice</b> & <script>alert(1)</script> Bob"
    result = app.run(context, "Alice", "Bob", 2.0, "Who?")
    for view in (result.before_html, result.after_html):
        assert "<script" not in view and "<b>" not in view
        assert "background:rgba(" in view
        assert "border-bottom:3px solid" in view  # the emphasized span
        assert "border-bottom:3px dashed" in view  # the suppressed span
    # Every character of the context is shown once, in order.
    body = result.before_html.split('border-radius:8px">', 1)[1].removesuffix("</div></div>")
    shown = re.sub(r'<span style="[^"]*" title="[^"]*">|</span>', "", body)
    assert shown == html.escape(context)


def test_render_attention_escapes_text_between_and_around_tokens():
    context = "<i>x</i> & <u>y</u>"
    pieces = [highlight._Piece(3, 4, 0.5), highlight._Piece(11, 14, 0.25)]  # "x", "<u>"
    view = highlight.render_attention("<T>", context, pieces, 0.5, [(3, 4)], [(11, 14)])
    assert "<i>" not in view and "<u>" not in view and "<T>" not in view
    body = view.split('border-radius:8px">', 1)[1].removesuffix("</div></div>")
    spans = re.findall(r'<span style="([^"]*)" title="([^"]*)">([^<]*)</span>', body)
    assert [(title, text) for _, title, text in spans] == [("50.00%", "x"), ("25.00%", "&lt;u&gt;")]
    assert "rgba(234, 88, 12,0.900)" in spans[0][0] and "3px solid" in spans[0][0]
    assert "rgba(234, 88, 12,0.636)" in spans[1][0] and "3px dashed" in spans[1][0]
    assert re.sub(r"<span [^>]*>|</span>", "", body) == html.escape(context)


def test_zero_strength_leaves_the_answer_alone(app):
    result = app.run(CONTEXT, "Carol", "", 0.0, QUESTION)
    assert result.steered == result.baseline


# ------------------------------------------------------------------------- auto-highlight

RECORDS = "Read the records.\n\nAnn's number is 11.\nBo's number is 22.\nCy's number is 33."


def test_focus_picks_a_sentence_the_run_accepts(app, llama):
    # One line of four sentences: the passages are the sentences.
    result = app.focus(CONTEXT, QUESTION)
    sentences = re.findall(r"[^.]+\.", CONTEXT)
    got = [p["passage"] for p in result.passages]
    assert got == [s.strip() for s in sentences]
    for p in result.passages:
        assert CONTEXT[p["start"] : p["end"]] == p["passage"]
        assert isinstance(p["score"], float) and isinstance(p["chosen"], bool)
    scores = [p["score"] for p in result.passages]
    best = max(range(len(scores)), key=scores.__getitem__)
    assert [p["chosen"] for p in result.passages] == [i == best for i in range(len(scores))]
    assert result.emphasize == got[best]
    assert highlight.locate(CONTEXT, span_lines(result.emphasize), "emphasize")
    app.run(CONTEXT, result.emphasize, "", 2.0, QUESTION)  # the Emphasize box text is accepted
    assert result.status.startswith("**Auto-highlight** in")
    assert "picked 1 of 4 passages" in result.status
    assert "Press **Run** to steer" in result.status
    assert "<ol" in result.scores_html and result.scores_html.count("<li") == 4

    # The scores are kvedit.focus's for the question asked after the context in the template.
    model, tok = llama
    split = split_prompt(tok, CONTEXT, QUESTION)
    state = kvedit.capture(model, tok, split.prefix)
    ranges = [split.shift([(p["start"], p["end"])])[0] for p in result.passages]
    want = kvedit.choose(state, split.continuation, ranges, query=QUESTION, threshold=None)
    assert scores == pytest.approx(want.scores, abs=1e-6)


def test_focus_keeps_to_the_context_and_orders_the_picks(app):
    result = app.focus(RECORDS, "What is Bo's number?", top_k=2)
    texts = [p["passage"] for p in result.passages]
    assert texts == [
        "Read the records.",
        "Ann's number is 11.",
        "Bo's number is 22.",
        "Cy's number is 33.",
    ]
    assert not any("im_start" in t or "Question" in t for t in texts)
    picks = result.emphasize.split("\n")
    assert [p["passage"] for p in result.passages if p["chosen"]] == sorted(picks, key=texts.index)
    # focus's order: the passage naming Bo first, then the best-scored of the others
    others = [p for p in result.passages if p["passage"] != "Bo's number is 22."]
    assert picks == ["Bo's number is 22.", max(others, key=lambda p: p["score"])["passage"]]
    # More passages asked for than there are: all of them, and the status says so.
    every = app.focus(RECORDS, "What is Bo's number?", top_k=10)
    assert all(p["chosen"] for p in every.passages)
    assert "picked 4 of 4 passages (asked for 10; the context has only 4)" in every.status


def test_focus_never_scores_the_template_text(llama):
    # A chat template with a system message: its text is in the captured prompt, not a passage.
    model, tok = llama
    tok = copy.deepcopy(tok)
    tok.chat_template = tok.chat_template.replace(
        "{% for message in messages %}",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% for message in messages %}",
    )
    result = Highlighter(model, tok, "tiny-llama").focus(RECORDS, "What is Bo's number?")
    assert "You are a helpful assistant." in split_prompt(tok, RECORDS, "x").prefix
    assert [p["passage"] for p in result.passages] == RECORDS.replace("\n\n", "\n").split("\n")


def test_focus_reads_the_context_without_markers(app):
    marked = RECORDS.replace("Bo's number is 22.", "[[Bo's number is 22.]]")
    plain = app.focus(RECORDS, "What is Cy's number?")
    got = app.focus(marked, "What is Cy's number?")
    assert got.passages == plain.passages and got.emphasize == plain.emphasize
    assert "[[" not in got.emphasize


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", QUESTION), "context is empty"),
        (("  \n ", QUESTION), "context is empty"),
        ((CONTEXT, " "), "Ask a question"),
        ((CONTEXT, QUESTION, 0), "Passages to pick must be a whole number from 1 to 32, not 0"),
        ((CONTEXT, QUESTION, 33), "from 1 to 32"),
        ((CONTEXT, QUESTION, 1.5), "whole number"),
        ((CONTEXT, QUESTION, None), "whole number"),
        ((CONTEXT, QUESTION, "many"), "whole number"),
        (("a [[b", QUESTION), "Unmatched `[[`"),
        (("x" * 12_001, QUESTION), "too long: 12,001 characters"),
        ((CONTEXT, "?" * 501), "question is too long"),
    ],
)
def test_invalid_focus_requests_get_clear_messages(app, args, message):
    with pytest.raises(InputError, match=re.escape(message)):
        app.focus(*args)


def test_focus_token_limit_is_reported(llama):
    model, tok = llama
    small = Highlighter(model, tok, "tiny-llama", Limits(max_context_tokens=20))
    with pytest.raises(InputError, match=r"too long: \d+ tokens with the chat template \(max 20\)"):
        small.focus(CONTEXT, QUESTION)


def test_render_scores_draws_bars_and_escapes_html():
    passages = [
        {"passage": "<b>low</b>", "start": 0, "end": 10, "score": -1.0, "chosen": False},
        {"passage": "high & " + "y" * 80, "start": 11, "end": 98, "score": 1.0, "chosen": True},
        {"passage": "mid", "start": 99, "end": 102, "score": 0.0, "chosen": False},
    ]
    view = highlight.render_scores(passages)
    assert "<b>" not in view and "&lt;b&gt;low&lt;/b&gt;" in view
    rows = re.findall(r'<li class="([^"]*)".*?</li>', view)
    assert rows == ["kvedit-passage", "kvedit-passage chosen", "kvedit-passage"]
    assert re.findall(r"width:([\d.]+)%", view) == ["0.0", "100.0", "50.0"]
    assert "+1.000" in view and "-1.000" in view and "✓" in view
    assert ". high &amp; " + "y" * 52 + "…<" in view  # the first 60 characters of the passage
    same = highlight.render_scores([{**p, "score": 0.5} for p in passages])
    assert re.findall(r"width:([\d.]+)%", same) == ["100.0"] * 3


def test_samples_are_middle_records_with_the_gold_hint():
    example = highlight.sample_examples()[3]
    context, question, hint = highlight.sample_fields(example)
    assert example.gold_index == highlight.SAMPLE_POSITION
    assert example.gold_document in context and example.gold_document in hint
    assert question == example.question and "Question" not in context


def test_cli_defaults_bind_to_localhost():
    from kvedit.cli import build_parser

    assert highlight.build_parser().parse_args([]).host == "127.0.0.1"
    assert inspect.signature(highlight.serve).parameters["host"].default == "127.0.0.1"

    args = build_parser().parse_args(["app"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 7860, "smollm2-135m-instruct")
    args = build_parser().parse_args(["app", "--model", "tiny-llama", "--port", "9", "--host", "h"])
    assert (args.host, args.port, args.model) == ("h", 9, "tiny-llama")


def test_cli_finds_the_app_outside_the_repository(tmp_path):
    # From another directory (the checkout not on sys.path), `kvedit app` still finds apps/ of
    # the checkout kvedit runs from: through the editable install, else next to kvedit/.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = (
        "from kvedit.cli.app import load_app; app = load_app(); print(app.__name__, app.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    name, file = out.stdout.split()
    assert (name, Path(file)) == (
        "kvedit_apps.highlight",
        REPO / "apps" / "highlight" / "__init__.py",
    )


_INSTALLED_CHECK = """
import runpy, sys
from pathlib import Path
from kvedit.cli.app import load_app

site = Path(sys.argv[1])
app = load_app()
assert app.__name__ == "kvedit_apps.highlight", app.__name__
assert app.Highlighter.__module__ == "kvedit_apps.highlight.steer"
loaded = {n: m.__file__ for n, m in sys.modules.items() if n.split(".")[0] in ("kvedit", "kvedit_apps", "apps")}
outside = {n: f for n, f in loaded.items() if f and not Path(f).is_relative_to(site)}
assert not outside, outside
sys.argv = ["kvedit app", "--help"]
runpy.run_module("kvedit_apps.highlight", run_name="__main__")
"""


def test_the_wheel_installs_the_app(tmp_path):
    """``pip install kvedit[app]`` gives ``kvedit app`` without a checkout: the wheel holds every
    module of apps/ as ``kvedit_apps``, and kvedit and the app import from the install alone."""
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("kvedit", "apps"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")]
    done = subprocess.run([*build, str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("kvedit-*.whl")
    site = tmp_path / "site"
    install = [*pip, "install", "--no-deps", "--target", str(site), str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    apps = {p.relative_to(REPO / "apps") for p in (REPO / "apps").rglob("*.py")}
    installed = {p.relative_to(site / "kvedit_apps") for p in (site / "kvedit_apps").rglob("*.py")}
    assert installed == apps  # a new file in apps/ needs its line in pyproject's py-modules
    assert not (site / "apps").exists()

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)  # ahead of the editable install of the checkout
    out = subprocess.run(
        [sys.executable, "-c", _INSTALLED_CHECK, str(site)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--model" in out.stdout and "--host" in out.stdout  # python -m kvedit_apps.highlight


# ------------------------------------------------------------------------- the server


def start_app(model: str, log_path: Path, timeout: float = 180.0) -> tuple[subprocess.Popen, str]:
    """Start ``kvedit app`` on a free localhost port; return the process and its URL."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvedit", "app", "--model", model, "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvedit app exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"kvedit app did not answer within {timeout:.0f} s:\n{log_path.read_text()}")


def stop_app(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("app") / "server.log"
    proc, url = start_app("tiny-llama", log)
    try:
        yield url
    finally:
        stop_app(proc)


@pytest.fixture(scope="module")
def client(server):
    return Client(server, verbose=False, download_files=True)


def _outside_addresses() -> set[str]:
    """This machine's IPv4 addresses other than loopback."""
    found = set()
    with contextlib.suppress(OSError):
        found |= {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, contextlib.suppress(OSError):
        s.connect(("10.254.254.254", 1))  # UDP: picks a route, sends nothing
        found.add(s.getsockname()[0])
    return {a for a in found if not a.startswith("127.")}


def test_server_is_bound_to_localhost_only(server):
    port = int(server.rsplit(":", 1)[1].strip("/"))
    addresses = _outside_addresses()
    if not addresses:
        pytest.skip("this machine has no address besides loopback")
    for address in addresses:
        with socket.socket() as s, pytest.raises(OSError):
            s.settimeout(2)
            s.connect((address, port))


def test_steer_endpoint_is_documented(client):
    info = client.view_api(print_info=False, return_format="dict")
    steer = info["named_endpoints"]["/steer"]
    assert [p["parameter_name"] for p in steer["parameters"]] == [
        "context",
        "emphasize",
        "suppress",
        "strength",
        "question",
    ]
    assert [r["label"] for r in steer["returns"]][:2] == ["Baseline answer", "Steered answer"]
    assert set(info["named_endpoints"]) == {"/steer", "/focus"}  # the UI helpers stay private


def test_focus_endpoint_is_documented(client):
    focus = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/focus"]
    params = focus["parameters"]
    assert [p["parameter_name"] for p in params] == ["context", "question", "top_k"]
    assert (params[2]["parameter_has_default"], params[2]["parameter_default"]) == (True, 1)
    assert [r["label"] for r in focus["returns"]] == [
        "Emphasize (one span per line)",
        "Passage scores",
        "Passages",
        "Status",
    ]


def test_steer_endpoint_returns_both_answers_and_the_cache(client, llama, app):
    gold = "Carol's secret number is 5902."
    baseline, steered, before, after, cache, status = client.predict(
        CONTEXT, gold, "", 4.0, QUESTION, api_name="/steer"
    )
    expected = app.run(CONTEXT, gold, "", 4.0, QUESTION)  # same model, in this process
    assert (baseline, steered) == (expected.baseline, expected.steered)
    assert baseline and steered and baseline != steered
    assert status.startswith("**Done** in") and "emphasized spans" in status
    assert "Before: the captured cache" in before and "After: the edited cache" in after
    model, tok = llama
    split = split_prompt(tok, CONTEXT, QUESTION)
    loaded = kvedit.load_state(cache, model, tok)
    assert loaded.has_bias
    assert loaded.generate(split.continuation, app.limits.max_new_tokens).strip() == steered


def test_focus_endpoint_picks_passages_for_steer(client, llama):
    emphasize, scores, passages, status = client.predict(CONTEXT, QUESTION, api_name="/focus")
    model, tok = llama  # the served app keeps the abstain rule: the same as this one
    expected = Highlighter(model, tok, "tiny-llama").focus(CONTEXT, QUESTION)
    assert emphasize == expected.emphasize and emphasize in CONTEXT
    assert [{**p, "score": pytest.approx(p["score"], abs=1e-5)} for p in expected.passages] == (
        passages
    )
    assert sum(p["chosen"] for p in passages) == sum(p["chosen"] for p in expected.passages)
    assert "Passage scores" in scores and status.startswith("**Auto-highlight** in")
    assert (emphasize == "") == ("Nothing picked" in status)
    if emphasize:  # what Auto-highlight picks, Run accepts
        *_, status = client.predict(CONTEXT, emphasize, "", 2.0, QUESTION, api_name="/steer")
        assert status.startswith("**Done** in")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", QUESTION, 1), "**Not run:** The context is empty"),
        ((CONTEXT, "", 1), "**Not run:** Ask a question"),
        ((CONTEXT, QUESTION, 0), "**Not run:** Passages to pick must be a whole number"),
    ],
)
def test_bad_focus_request_is_a_message_not_a_trace(client, args, message):
    emphasize, scores, passages, status = client.predict(*args, api_name="/focus")
    assert status.startswith(message), status
    assert (scores, passages) == ("", [])
    assert not emphasize
    assert "Traceback" not in status


def test_missing_span_is_a_message_not_a_trace(client):
    baseline, steered, before, after, cache, status = client.predict(
        CONTEXT, "Mallory's secret number", "", 2.0, QUESTION, api_name="/steer"
    )
    assert (baseline, steered, before, after, cache) == ("", "", "", "", None)
    assert status.startswith("**Not run:** Span to emphasize not found in the context")
    assert "“Mallory's secret number”" in status
    assert "Traceback" not in status and 'File "' not in status


def test_oversized_context_is_refused_with_its_size(client):
    *_, status = client.predict("y" * 20_000, "y", "", 2.0, QUESTION, api_name="/steer")
    assert "too long: 20,000 characters (max 12,000)" in status


def test_concurrent_requests_keep_their_own_spans(client, app):
    requests = [
        (CONTEXT, "Alice's secret number is 4821.", "", 5.0, QUESTION),
        (CONTEXT, "", "Carol's secret number is 5902.", 5.0, QUESTION),
        (CONTEXT, "Dave", "", 5.0, "What is Dave's secret number?"),
    ]
    jobs = [client.submit(*r, api_name="/steer") for r in requests]
    with concurrent.futures.ThreadPoolExecutor(3):
        got = [job.result(timeout=120)[1] for job in jobs]
    want = [app.run(*r).steered for r in requests]
    assert got == want


def test_build_app_registers_the_steer_and_focus_endpoints(app):
    demo = highlight.build_app(app)
    named = {fn.api_name: fn for fn in demo.fns.values() if fn.api_name}
    assert [c.elem_id for c in named["steer"].inputs] == [
        "context",
        "emphasize",
        "suppress",
        "strength",
        "question",
    ]
    assert [c.elem_id for c in named["steer"].outputs] == [
        "baseline",
        "steered",
        "before",
        "after",
        "cache",
        "status",
    ]

    assert [c.elem_id for c in named["focus"].inputs] == ["context", "question", "top-k"]
    assert [c.elem_id for c in named["focus"].outputs] == [
        "emphasize",
        "focus-scores",
        "focus-passages",
        "status",
    ]


def test_auto_highlight_button_keeps_typed_spans_on_error(app):
    demo = highlight.build_app(app)
    (auto,) = [b for b in demo.blocks.values() if b.elem_id == "auto-highlight"]
    (button,) = [f for f in demo.fns.values() if f.targets == [(auto._id, "click")]]
    endpoint = next(f for f in demo.fns.values() if f.api_name == "focus")
    assert [c.elem_id for c in button.inputs] == [c.elem_id for c in endpoint.inputs]
    assert [c.elem_id for c in button.outputs] == [c.elem_id for c in endpoint.outputs]
    kept, scores, passages, status = button.fn(CONTEXT, "", 1)
    assert kept == {"__type__": "update"}  # gr.skip(): the Emphasize box is left alone
    assert (scores, passages) == ("", []) and status.startswith("**Not run:** Ask a question")
    assert endpoint.fn(CONTEXT, "", 1)[0] == ""
    picked, *_ = button.fn(CONTEXT, QUESTION, 1)
    assert picked == app.focus(CONTEXT, QUESTION).emphasize


def test_auto_highlight_abstains_where_no_passage_stands_out(llama):
    model, tok = llama
    result = Highlighter(model, tok, "tiny-llama").focus(RECORDS, "What is Bo's number?")
    assert result.emphasize == ""
    assert not any(p["chosen"] for p in result.passages)
    assert "Nothing picked: no passage stands out" in result.status


def test_auto_highlight_says_so_when_it_abstains_and_leaves_the_box_empty(llama):
    model, tok = llama
    result = Highlighter(model, tok, "tiny-llama").focus(RECORDS, "What is Bo's number?", 3)
    assert result.emphasize == ""
    assert "picked 3 of" not in result.status and "now in the Emphasize box" not in result.status
    assert "found no passage that stands out" in result.status
    assert "the Emphasize box is left empty" in result.status


def test_auto_highlight_reports_how_many_stand_out_when_fewer_than_asked():
    status = highlight.render_focus_status("m", 0.1, 10, 4, 1, 3, "")
    assert "picked 1 of 4 passages (asked for 3; only 1 stands out)" in status


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((5, "Alice", "", 2.0, QUESTION), "The context must be text, not int"),
        ((CONTEXT, ["Alice"], "", 2.0, QUESTION), "The Emphasize box must be text, not list"),
        ((CONTEXT, "Alice", 3.5, 2.0, QUESTION), "The Suppress box must be text, not float"),
        ((CONTEXT, "Alice", "", 2.0, {"q": 1}), "The question must be text, not dict"),
    ],
)
def test_non_text_inputs_to_steer_get_the_normal_message(app, args, message):
    with pytest.raises(InputError, match=re.escape(message)):
        app.run(*args)
    steer = next(f for f in highlight.build_app(app).fns.values() if f.api_name == "steer")
    *_, status = steer.fn(*args)
    assert status.startswith(f"**Not run:** {message}"), status


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([CONTEXT], QUESTION, 1), "The context must be text, not list"),
        ((CONTEXT, 42, 1), "The question must be text, not int"),
    ],
)
def test_non_text_inputs_to_focus_get_the_normal_message(app, args, message):
    with pytest.raises(InputError, match=re.escape(message)):
        app.focus(*args)
    focus = next(f for f in highlight.build_app(app).fns.values() if f.api_name == "focus")
    emphasize, scores, passages, status = focus.fn(*args)
    assert (emphasize, scores, passages) == ("", "", [])
    assert status.startswith(f"**Not run:** {message}"), status
