"""``kvedit serve``'s chat middleware without vLLM (:mod:`kvedit.integrations.vllm.chat`): an ASGI
app stands in for vLLM's server and a stand-in for the memories records what they were asked.

* A chat request is rewritten (the engine prompt and the turn in ``kv_transfer_params``), and
  the response, whole or streamed, ends with what happened to the conversation's memory.
* A turn that did not end as asked is not kept, and says so; a commit that fails leaves the
  answer and says why.
* A bad kvedit parameter is answered 400 before vLLM sees the request; requests the memories
  cannot render go to vLLM unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from helpers import asgi_post

from kvedit.errors import InvalidInputError, KVEditError
from kvedit.integrations.vllm.chat import ChatMemories

MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass
class FakePlan:
    slots: list = field(default_factory=lambda: [1, 2, 3])
    digest: str = "a" * 32
    turn: str = "b" * 32
    fallback: dict | None = None

    @property
    def prompt_token_ids(self):
        return [*self.slots, 7, 8]

    @property
    def kv_transfer_params(self):
        return {"prompt_token_ids": self.prompt_token_ids, "kvedit": {"turn": self.turn}}


class FakeConversations:
    def __init__(self, fail: Exception | None = None, stops: tuple = ()):
        self.fail = fail
        self.committed: list[str] = []
        self.dropped: list[str] = []
        self.root = "ROOT"
        self.renderer = type("Renderer", (), {"stops": stops})()

    def plan(self, messages, params):
        if params and params.get("kvedit", {}).get("digest") == "bad":
            raise InvalidInputError("no memory with digest bad")
        return FakePlan()

    def drop_turn(self, turn):
        self.dropped.append(turn)

    def commit(self, plan, answer):
        if self.fail is not None:
            raise self.fail
        self.committed.append(answer)
        return {"memory_digest": "c" * 32, "memory_bytes": 123, "forgot": 4}


def vllm_app(stream: bool, finish: str = "stop", seen: list | None = None):
    """vLLM's server as the middleware sees it: reads the body, answers "Hello world"."""

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if seen is not None:
            seen.append((scope, json.loads(body)))
        said = {"kvedit": {"served": 3, "turn": "b" * 32}}
        if stream:
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for i, part in enumerate(["Hello", " world"]):
                done = finish if i == 1 else None
                chunk = {"choices": [{"delta": {"content": part}, "finish_reason": done}]}
                data = f"data: {json.dumps(chunk)}\n\n".encode()
                await send({"type": "http.response.body", "body": data[:7], "more_body": True})
                await send({"type": "http.response.body", "body": data[7:], "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        out = {
            "choices": [{"message": {"content": "Hello world"}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5},
            "kv_transfer_params": said,
        }
        data = json.dumps(out).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app


def call(middleware, body: dict, path="/v1/chat/completions"):
    """``(status, headers, body bytes)`` of one POST through ``middleware``."""
    sent = asgi_post(middleware, json.dumps(body).encode(), path)
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start.get("headers", [])), data


def test_a_whole_response_ends_with_what_happened_to_the_memory():
    seen: list = []
    conversations = FakeConversations()
    mw = ChatMemories(vllm_app(stream=False, seen=seen), conversations)
    status, headers, data = call(mw, {"model": "m", "messages": MESSAGES})
    assert status == 200
    scope, body = seen[0]
    assert body["kv_transfer_params"] == FakePlan().kv_transfer_params  # the engine prompt
    assert dict(scope["headers"])[b"content-length"] == str(len(json.dumps(body))).encode()
    said = json.loads(data)["kv_transfer_params"]["kvedit"]
    assert said == {
        "digest": "a" * 32,
        "served": 3,
        "computed": 2,
        "memory_digest": "c" * 32,
        "memory_bytes": 123,
        "forgot": 4,
    }
    assert headers[b"content-length"] == str(len(data)).encode()
    assert conversations.committed == ["Hello world"]


def test_the_prompt_formats_stop_strings_are_added_to_the_clients():
    """A plain-format memory stops where Memory.ask stops: at the next message's label."""
    seen: list = []
    mw = ChatMemories(vllm_app(stream=False, seen=seen), FakeConversations(stops=("\nUser:",)))
    call(mw, {"messages": MESSAGES, "stop": "END"})
    call(mw, {"messages": MESSAGES})
    assert [body["stop"] for _, body in seen] == [["END", "\nUser:"], ["\nUser:"]]


def test_a_streamed_response_gets_one_more_chunk_before_done():
    conversations = FakeConversations()
    mw = ChatMemories(vllm_app(stream=True), conversations)
    status, _, data = call(mw, {"model": "m", "messages": MESSAGES, "stream": True})
    events = [e for e in data.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"] == [] and last["kv_transfer_params"]["kvedit"]["memory_bytes"] == 123
    assert len(events) == 4 and conversations.committed == ["Hello world"]


def test_a_turn_not_ended_as_asked_or_not_kept_says_so_and_keeps_the_answer():
    conversations = FakeConversations()
    mw = ChatMemories(vllm_app(stream=False, finish="abort"), conversations)
    said = json.loads(call(mw, {"messages": MESSAGES})[2])["kv_transfer_params"]["kvedit"]
    assert "not kept" in said["error"] and said["memory_digest"] is None
    assert conversations.committed == []
    mw = ChatMemories(vllm_app(stream=True), FakeConversations(KVEditError("disk full")))
    data = call(mw, {"messages": MESSAGES, "stream": True})[2].decode()
    assert "Hello" in data and "disk full" in data


def test_bad_kvedit_parameters_are_answered_400_and_other_requests_pass_unchanged():
    seen: list = []
    mw = ChatMemories(vllm_app(stream=False, seen=seen), FakeConversations())
    body = {"messages": MESSAGES, "kv_transfer_params": {"kvedit": {"digest": "bad"}}}
    status, _, data = call(mw, body)
    assert status == 400 and "no memory with digest bad" in data.decode() and not seen
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for body in ({"messages": image}, {"messages": MESSAGES, "echo": True}, {"prompt": [1, 2]}):
        call(mw, body)
        assert seen.pop()[1] == body
    call(mw, {"messages": MESSAGES}, path="/v1/completions")
    assert seen.pop()[1] == {"messages": MESSAGES}


def test_a_turn_is_dropped_when_its_response_ends_and_again_later(monkeypatch):
    """A client that leaves leaves no turn file for a later request to sweep: the middleware
    removes the turn's files once the response ends, and again once a late save is written;
    the inner app sees the turn in its scope (the request check's proof it is kvedit's)."""
    import asyncio
    import contextlib

    from kvedit.integrations.vllm import chat
    from kvedit.integrations.vllm.request_check import TURN_SCOPE_KEY

    monkeypatch.setattr(chat, "ABANDONED_TURN_SECONDS", 0.01)
    seen: list = []
    conversations = FakeConversations()
    app = vllm_app(stream=True, seen=seen)

    async def leaves(scope, receive, send):  # the client disconnects mid-answer
        await app(scope, receive, send)
        raise asyncio.CancelledError

    mw = ChatMemories(leaves, conversations)

    async def run():
        sent = []
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        body = json.dumps({"messages": MESSAGES, "stream": True}).encode()
        incoming = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(m):
            sent.append(m)

        with contextlib.suppress(asyncio.CancelledError):
            await mw(scope, receive, send)
        assert conversations.dropped == ["b" * 32]  # at once
        await asyncio.sleep(0.05)
        assert conversations.dropped == ["b" * 32] * 2  # and once more, later

    asyncio.run(run())
    assert seen[0][0][TURN_SCOPE_KEY] == "b" * 32


def test_a_fallback_from_a_damaged_memory_is_said():
    conversations = FakeConversations()
    fallback = {"from": "d" * 32, "why": "bad seal"}
    conversations.plan = lambda messages, params: FakePlan(fallback=fallback)
    mw = ChatMemories(vllm_app(stream=False), conversations)
    said = json.loads(call(mw, {"messages": MESSAGES})[2])["kv_transfer_params"]["kvedit"]
    assert said["fallback"] == fallback and said["digest"] == "a" * 32
