"""``kvedit serve``: vLLM's OpenAI server answers a published, edited context as kvedit does.

One server for the module (``kvedit serve`` as a subprocess, 40-60 s to start on 2 cores);
requests go through plain HTTP (what ``curl`` sends) and the ``openai`` client. The edit,
removing the gold record (a full suppress, exact on vLLM's kernels), changes the answer, so a
server that ignored the published cache would fail. Each request names the digest it wants
(``kv_transfer_params``) and checks the echo; one naming a digest that is not published fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from helpers import free_port

import kvedit
from kvedit.cli import main as cli_main
from kvedit.evals.tasks.records import records_examples
from kvedit.focusing.choice import QUESTION_MARK
from kvedit.integrations.vllm.contexts import publish_context

pytestmark = pytest.mark.real
MAX_TOKENS = 16
START_TIMEOUT_S = 360


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(base url, publish root)`` of a running ``kvedit serve``."""
    root = tmp_path_factory.mktemp("published")
    log_path = tmp_path_factory.mktemp("log") / "serve.log"
    port = free_port()
    cmd = [sys.executable, "-m", "kvedit", "serve", "--root", str(root), "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"kvedit serve exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"kvedit serve did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield url, root
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def case(smollm2):
    model, tok = smollm2
    ex = records_examples(positions=[6], trials=1, n_records=10)[0]
    context = ex.user_message().split(QUESTION_MARK)[0]
    prefix, continuation = kvedit.chat_prefix(
        tok, context + QUESTION_MARK + " " + ex.question, QUESTION_MARK
    )
    state = kvedit.capture(model, tok, prefix)
    edited = kvedit.ops.suppress(state, ex.gold_document, 1e4)
    want = {
        "plain": state.answer(continuation, MAX_TOKENS).token_ids,
        "edited": edited.answer(continuation, MAX_TOKENS).token_ids,
    }
    assert want["plain"] != want["edited"], "pick an edit that changes kvedit's answer"
    return ex, context, want


def test_a_curl_request_gets_the_edited_answer(server, case, tmp_path, capsys):
    url, root = server
    ex, context, want = case
    path = tmp_path / "context.txt"
    path.write_text(context)
    req = tmp_path / "request.json"
    args = ["publish", "--root", str(root), "--context", str(path), "--question", ex.question]
    args += ["--suppress", ex.gold_document, "--max-tokens", str(MAX_TOKENS), "--request", str(req)]
    assert cli_main(args) == 0
    published = json.loads(capsys.readouterr().out)
    body = json.loads(req.read_text())  # what `curl -d @request.json` sends
    got = post(url, body)
    assert got["choices"][0]["token_ids"][: len(want["edited"])] == want["edited"]
    echo = got["kv_transfer_params"]["kvedit"]
    assert echo["served"] == published["served"] == len(published["published_token_ids"])
    assert echo["digest"] == published["digest"] == body["kv_transfer_params"]["kvedit"]["digest"]


def test_the_openai_client_gets_the_plain_answer_for_the_plain_context(server, case, smollm2):
    openai = pytest.importorskip("openai")
    url, root = server
    ex, context, want = case
    model, tok = smollm2
    published = publish_context(
        model, tok, context, root, question=ex.question, served_model_name="smollm2-135m-instruct"
    )
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    out = client.completions.create(
        model=published.model,
        prompt=published.prompt_token_ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    text = tok.decode(want["plain"], skip_special_tokens=True)
    assert out.choices[0].text.strip() == text.strip()
    assert out.usage.prompt_tokens == len(published.prompt_token_ids)
    echo = (out.model_extra or {})["kv_transfer_params"]["kvedit"]
    assert echo["served"] == published.served  # from the file, not computed by vLLM
    assert echo["digest"] == published.digest  # no digest named: served from the plain capture
    body = published.request(MAX_TOKENS)  # naming the digest: the same, through extra_body
    extra = {k: body[k] for k in ("ignore_eos", "stop_token_ids", "kv_transfer_params")}
    named = client.completions.create(
        model=published.model,
        prompt=published.prompt_token_ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=extra,
    )
    assert named.model_extra["kv_transfer_params"]["kvedit"]["digest"] == published.digest
    assert named.choices[0].text == out.choices[0].text


def test_a_request_for_a_digest_that_is_not_published_fails(server, case, smollm2):
    url, root = server
    ex, context, _ = case
    model, tok = smollm2
    published = publish_context(model, tok, context, root, question=ex.question)
    body = published.request(MAX_TOKENS)
    body["kv_transfer_params"] = {"kvedit": {"digest": "f" * 32}}
    with pytest.raises(urllib.error.HTTPError) as err:
        post(url, body)
    assert err.value.code == 404  # kvedit's request check answers, with the reason
    answer = json.loads(err.value.read())
    assert "unknown-digest" in answer["error"]["message"] and "f" * 32 in answer["error"]["message"]
    assert answer["kvedit"]["refused"] == "unknown-digest"


def test_a_corrupt_published_file_fails_the_request_with_its_reason(server, case, smollm2):
    url, root = server
    ex, context, _ = case
    model, tok = smollm2
    state = kvedit.capture(model, tok, context + " (a copy to corrupt)")
    published = kvedit.integrations.vllm.publish(
        kvedit.ops.suppress(state, ex.gold_document, 1e4), root
    )
    data = bytearray(published.path.read_bytes())
    data[-5] ^= 0xFF  # one byte of the tensors: the header still reads
    published.path.write_bytes(bytes(data))
    body = {
        "model": "smollm2-135m-instruct",
        "prompt": list(published) + tok(" Answer:", add_special_tokens=False)["input_ids"],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "kv_transfer_params": {"kvedit": {"digest": published.digest}},
    }
    with pytest.raises(urllib.error.HTTPError) as err:
        post(url, body)
    assert err.value.code == 500
    answer = json.loads(err.value.read())
    assert "checksum mismatch" in answer["error"]["message"]
    assert answer["kvedit"]["file"] == published.path.name
