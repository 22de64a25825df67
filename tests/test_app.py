"""The highlight app (``apps/highlight/``): request parsing, the steering itself, the
``/steer`` endpoint of a server started with ``kvedit app`` and called with ``gradio_client``,
and the app in the wheel (installed as ``kvedit_apps.highlight``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
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

import kvedit
from apps import highlight
from apps.highlight import Highlighter, InputError, Limits, span_lines, split_prompt, strip_markers

REPO = Path(__file__).resolve().parent.parent

CONTEXT = (
    "Alice's secret number is 4821. Bob's secret number is 7310. "
    "Carol's secret number is 5902. Dave's secret number is 1234."
)
QUESTION = "What is Carol's secret number?"


@pytest.fixture(scope="module")
def app(llama):
    model, tok = llama
    return Highlighter(model, tok, "tiny-llama")


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
    full = kvedit.state.templated_prompt(tok, CONTEXT + "\n\nQuestion: " + QUESTION)
    assert split.prefix + split.continuation == full
    assert split.prefix.endswith(CONTEXT)
    assert split.prefix[split.context_start :] == CONTEXT
    assert split.continuation.startswith("\n\nQuestion: " + QUESTION)
    assert "<|im_start|>assistant" in split.continuation


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
    code = "from kvedit.cli import _load_app; app = _load_app(); print(app.__name__, app.__file__)"
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
from kvedit.cli import _load_app

site = Path(sys.argv[1])
app = _load_app()
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    assert set(info["named_endpoints"]) == {"/steer"}  # the UI helpers stay private


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


def test_build_app_registers_the_steer_endpoint(app):
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
