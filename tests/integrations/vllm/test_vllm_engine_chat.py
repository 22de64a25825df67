"""``kvedit serve`` answering chat conversations from their memories, driven by the ``openai``
client (a real vLLM server as a subprocess, SmolLM2 in float32).

* A conversation answers token for token as an in-process ``kvedit.Memory`` over the same
  messages (greedy; every other turn streamed), each turn served from the last turn's memory:
  vLLM computes only the new message (with the last answer's end-of-turn markup) and the
  answer, and the memory holds the same tokens at the same positions as the in-process one,
  its entries within float tolerance (vLLM's kernels computed them).
* A budget named per request bounds every memory, which forgets.
* A digest no memory of the messages has is refused before vLLM sees the request.
* A second server on the same root serves the conversation's next turn from the first one's
  memory, and back; a server killed in the middle of a turn loses that turn only: the other
  serves the next request from the last memory stored, and every stored memory reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from helpers import free_port

import kvedit

pytestmark = pytest.mark.real
pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from kvedit.integrations.vllm.conversations import MEMORIES  # noqa: E402
from kvedit.states.files.read import read_attached  # noqa: E402

MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 360
TOKENS = 16
SYSTEM = "You are a helpful assistant. Keep answers short."
USERS = [
    "My name is Ada and my locker code is 4821.",
    "What is the capital of France?",
    "Name a fruit that is yellow.",
    "What is my locker code?",
    "What is my name?",
    "Thanks! Say goodbye.",
]


def start(root, log):
    """A ``kvedit serve`` process on ``root``: ``(process, base url)`` once it answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvedit", "serve", "--root", str(root), "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"kvedit serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"kvedit serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(1)


def stop(proc, sig=signal.SIGTERM):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("served")


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    proc, url = start(root, tmp_path_factory.mktemp("log") / "a.log")
    yield url
    stop(proc)


def chat(url, messages, *, stream=False, params=None):
    """``(answer, kv_transfer_params["kvedit"])`` of one greedy chat request."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    kw = dict(model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0)
    if params is not None:
        kw["extra_body"] = {"kv_transfer_params": params}
    if stream:
        said, parts = None, []
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            else:
                said = (chunk.model_extra or {}).get("kv_transfer_params")
        return "".join(parts), (said or {}).get("kvedit")
    r = client.chat.completions.create(**kw)
    return r.choices[0].message.content, (r.model_extra or {}).get("kv_transfer_params")["kvedit"]


def memory_file(root, digest):
    (path,) = (root / MEMORIES).glob(f"*-{digest}.safetensors")
    return path


def written(root, digest, timeout: float = 30.0) -> None:
    """Wait until memory ``digest``'s file is on disk: a server writes a turn's memory once the
    response has ended, so another server sees it only then."""
    end = time.monotonic() + timeout
    while not list((root / MEMORIES).glob(f"*-{digest}.safetensors")):
        assert time.monotonic() < end, f"memory {digest} was never written"
        time.sleep(0.05)


def test_a_conversation_answers_as_an_in_process_memory_each_turn_served_from_the_last(
    server, root, smollm2
):
    model, tok = smollm2
    mem = kvedit.Memory(model, tok, system=SYSTEM)
    messages = [{"role": "system", "content": SYSTEM}]
    last = None
    for t, user in enumerate(USERS):
        messages.append({"role": "user", "content": user})
        held = len(mem.state)
        answer, said = chat(server, messages, stream=bool(t % 2))
        assert answer.strip() == mem.ask(user, max_new_tokens=TOKENS), f"turn {t}"
        assert said["digest"] == (last["memory_digest"] if last else None)
        prompt = mem.renderer.render(mem.messages[:-1], generation_prompt=True).ids
        # the whole last memory: its answer's closing tokens were computed at its commit
        assert said["served"] == (held if last else 0)
        assert said["served"] + said["computed"] == len(prompt)
        assert said["forgot"] == 0 and said["memory_bytes"] > 0
        served = read_attached(memory_file(root, said["memory_digest"]), model, tok).state
        n = len(served)
        assert n == len(mem.state) and served.token_ids.tolist() == mem.state.token_ids.tolist()
        for a, b in zip(served.layers, mem.state.layers, strict=True):
            assert torch.equal(a.positions, b.positions[:n])
            assert torch.allclose(a.keys, b.keys[:, :, :n], atol=1e-3)
            assert torch.allclose(a.values, b.values[:, :, :n], atol=1e-3)
        assert not served.is_plain_capture  # its history says vLLM computed it
        messages.append({"role": "assistant", "content": answer.strip()})
        last = said


def test_a_budget_named_per_request_bounds_every_memory(server):
    budget = 3 * 2**20
    messages = [{"role": "system", "content": SYSTEM}]
    forgot = 0
    for t, user in enumerate(USERS):
        messages.append({"role": "user", "content": user})
        answer, said = chat(
            server, messages, stream=bool(t % 2), params={"kvedit": {"max_bytes": budget}}
        )
        assert "error" not in said and said["memory_bytes"] <= budget, f"turn {t}: {said}"
        forgot += said["forgot"]
        messages.append({"role": "assistant", "content": answer.strip()})
    assert forgot > 0


def test_a_digest_no_memory_of_the_messages_has_is_refused(server):
    messages = [{"role": "user", "content": "hello"}]
    for digest in ("0" * 32, "forged"):
        with pytest.raises(openai.BadRequestError, match="digest"):
            chat(server, messages, params={"kvedit": {"digest": digest}})


def test_two_servers_share_the_root_and_a_killed_turn_loses_only_itself(
    server, root, tmp_path, smollm2
):
    model, tok = smollm2
    other, other_url = start(root, tmp_path / "b.log")
    try:
        messages = [{"role": "system", "content": "You answer in one sentence."}]
        saids = []
        for url, user in zip((server, other_url, server), USERS[:3], strict=True):
            messages.append({"role": "user", "content": user})
            answer, said = chat(url, messages)
            written(root, said["memory_digest"])  # the next turn may go to the other server
            saids.append(said)
            messages.append({"role": "assistant", "content": answer.strip()})
        assert [s["digest"] for s in saids[1:]] == [s["memory_digest"] for s in saids[:-1]]
        # the other server dies in the middle of the next turn
        messages.append({"role": "user", "content": USERS[3]})
        client = openai.OpenAI(base_url=other_url + "/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0, stream=True
        )
        next(iter(stream))
        stop(other, signal.SIGKILL)
        answer, said = chat(server, messages)
        assert said["digest"] == saids[-1]["memory_digest"] and said["served"] > 0
        assert "error" not in said
    finally:
        stop(other)
    for path in (root / MEMORIES).glob("*.safetensors"):  # no torn memory
        try:
            read_attached(path, model, tok)
        except FileNotFoundError:  # pruned by the live server since listed: not torn
            continue
