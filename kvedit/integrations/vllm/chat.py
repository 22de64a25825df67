"""``kvedit serve``'s chat memories: ``POST /v1/chat/completions`` answered from each
conversation's memory (ASGI middleware, vLLM's ``--middleware``).

For a chat request (streaming or not) the middleware plans the turn
(:meth:`~kvedit.integrations.vllm.conversations.Conversations.plan`: the longest memory of the
request's earlier messages, or the one its ``kv_transfer_params`` names), rewrites the body so
vLLM takes the memory's slots and the new tokens as its prompt
(``kv_transfer_params.prompt_token_ids``) and the connector loads the memory and saves the turn,
passes it to vLLM (with the prompt format's own stop strings, as ``Memory.ask`` stops: the
``"plain"`` format's next message label), and once the answer is complete folds the turn into
the next memory
(:meth:`~kvedit.integrations.vllm.conversations.Conversations.commit`) before the response ends
(what it says is in the response), and writes it once the response has ended (or when the next
request comes first: it is then served from it).
The response's ``kv_transfer_params.kvedit`` says what happened:

* ``digest``: the memory that served the request (None: a new conversation);
* ``served``: prompt tokens taken from it; ``computed``: prompt tokens vLLM computed;
* ``memory_digest``, ``memory_bytes``: the memory after this turn (the answer included);
  ``forgot``: entries forgotten this turn; ``error`` when the turn could not be kept (the
  answer stands; the next turn is served from the last memory kept).

A streaming response gets it in one more chunk before ``data: [DONE]`` (``"choices": []``).
Requests the memories cannot render (non-text content, ``echo``, ``n`` > 1, token-id prompts)
go to vLLM unchanged. A bad kvedit parameter (an unknown digest, a bad ``max_bytes``) is
answered 400 with its reason, before vLLM sees the request.

``fallback`` (``{"from": digest, "why": ...}``) when the conversation's latest memory was
damaged and its parent served.

The turn id in the rewritten body is the middleware's own: the inner scope carries it
(:data:`TURN_SCOPE_KEY`), and the request check refuses a turn any client set. Once the
response has ended (or the client left) the turn's files are removed, and again
:data:`ABANDONED_TURN_SECONDS` later (a worker saving an aborted turn writes it after the
request ended), so no turn of a client that left waits for a later request to be swept.
A refusal is answered 400 (500 when the fault is the server's: ``ROOT/memories`` unusable),
with kvedit's message, never a traceback.

Configured by the environment variable :data:`CHAT_ENV` (JSON: ``root``, ``model``,
``max_bytes``, ``forget``), which :func:`~kvedit.integrations.vllm.server.serve` sets.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from ...errors import KVEditError, StorageError
from .conversations import Conversations, Plan, message_of
from .request_check import TURN_SCOPE_KEY, ASGIApp, Receive, Scope, Send, read_body, replay

__all__ = ["ABANDONED_TURN_SECONDS", "CHAT_ENV", "TURN_SCOPE_KEY", "ChatMemories"]

ABANDONED_TURN_SECONDS = 30.0
"""A turn's files are removed again this long after its response ended: what a worker saved
for a request whose client left (it saves once the request is over, within a step)."""

CHAT_ENV = "KVEDIT_CHAT_MEMORIES"
"""The environment variable holding the chat memories' configuration (JSON)."""

_ROUTE = "/v1/chat/completions"


class ChatMemories:
    """ASGI middleware serving chat conversations from their memories (see the module doc).

    Args:
        app: the ASGI app it wraps (vLLM's).
        conversations: the memories; default: built from :data:`CHAT_ENV` at the first chat
            request (the model is loaded then, once).
    """

    def __init__(self, app: ASGIApp, conversations: Conversations | None = None) -> None:
        self.app = app
        self._conversations = conversations
        self._config = None if conversations is not None else _config()

    def conversations(self) -> Conversations:
        if self._conversations is None:
            from ...models import load_model

            cfg = self._config or {}
            model, tok = load_model(cfg["model"])
            self._conversations = Conversations(
                cfg["root"],
                model,
                tok,
                max_bytes=cfg.get("max_bytes"),
                forget=cfg.get("forget"),
                defer_writes=True,  # the memory's files written after the response
            )
        return self._conversations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope.get("type") != "http"
            or scope.get("method") != "POST"
            or scope.get("path") != _ROUTE
        ):
            await self.app(scope, receive, send)
            return
        body, messages = await read_body(receive)
        request = _chat_request(body)
        if request is None:
            await self.app(scope, replay(messages, receive), send)
            return
        try:
            conversations = await asyncio.to_thread(self.conversations)
            plan = await asyncio.to_thread(
                conversations.plan, request["messages"], request.get("kv_transfer_params")
            )
        except StorageError as e:  # the server's fault: its folders
            await _error(send, 500, str(e))
            return
        except KVEditError as e:
            await _error(send, 400, str(e))
            return
        except OSError as e:
            await _error(send, 500, f"kvedit's chat memories cannot use {conversations.root}: {e}")
            return
        request["kv_transfer_params"] = plan.kv_transfer_params
        stops = conversations.renderer.stops  # the prompt format's own: the next message's label
        if stops:
            given = request.get("stop") or []
            given = [given] if isinstance(given, str) else list(given)
            request["stop"] = [*given, *(s for s in stops if s not in given)]
        new_body = json.dumps(request).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new_body)).encode()))
        inner = {**scope, "headers": headers, TURN_SCOPE_KEY: plan.turn}
        sent = [{"type": "http.request", "body": new_body, "more_body": False}]
        response = _Response(send, plan, conversations)
        try:
            await self.app(inner, replay(sent, receive), response.send)
        finally:  # kept or not, the turn's files go (a late save: once more, later); its
            # memory, made before the response ended, is written now
            loop = asyncio.get_running_loop()
            loop.call_later(ABANDONED_TURN_SECONDS, conversations.drop_turn, plan.turn)
            await asyncio.to_thread(conversations.drop_turn, plan.turn)


class _Response:
    """Forwards vLLM's response, holding its end until the turn is kept, and adds what
    happened (``kv_transfer_params.kvedit``)."""

    def __init__(self, send: Send, plan: Plan, conversations: Conversations) -> None:
        self._send, self.plan, self.conversations = send, plan, conversations
        self._start: dict | None = None
        self._streaming = False
        self._chunks: list[bytes] = []
        self._pending = b""  # a streamed event not yet complete
        self._answer: list[str] = []
        self._finish: str | None = None  # a streamed answer's finish reason
        self._status = 200

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self._status = int(message.get("status", 200))
            headers = dict((k.lower(), v) for k, v in message.get("headers", []))
            self._streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if self._streaming or self._status != 200:
                await self._send(message)
            else:
                self._start = message
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        more = bool(message.get("more_body", False))
        if self._status != 200:
            await self._send(message)
        elif self._streaming:
            await self._stream(message.get("body", b""), more)
        else:
            self._chunks.append(message.get("body", b""))
            if not more:
                await self._whole()

    async def _whole(self) -> None:
        body = b"".join(self._chunks)
        try:
            response = json.loads(body)
            choice = response["choices"][0]
            answer = choice["message"].get("content") or ""
            vllm_said = (response.get("kv_transfer_params") or {}).get("kvedit")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            response = None
        if isinstance(response, dict):
            said = await self._commit(answer, vllm_said, choice.get("finish_reason"))
            response["kv_transfer_params"] = {"kvedit": said}
            body = json.dumps(response).encode()
        start = dict(self._start or {"type": "http.response.start", "status": 200})
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        start["headers"] = [*headers, (b"content-length", str(len(body)).encode())]
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream(self, data: bytes, more: bool) -> None:
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        out = []
        for event in events:
            text = event.decode("utf-8", "replace")
            payload = text[len("data: ") :] if text.startswith("data: ") else None
            if payload is not None and payload.strip() == "[DONE]":
                said = await self._commit("".join(self._answer), None, self._finish)
                extra = {"object": "chat.completion.chunk", "choices": []}
                extra["kv_transfer_params"] = {"kvedit": said}
                out.append(b"data: " + json.dumps(extra).encode())
            elif payload is not None:
                self._read_chunk(payload)
            out.append(event)
        body = b"".join(e + b"\n\n" for e in out)
        if not more:
            body += self._pending
        await self._send({"type": "http.response.body", "body": body, "more_body": more})

    def _read_chunk(self, payload: str) -> None:
        try:
            chunk = json.loads(payload)
            for choice in chunk.get("choices") or []:
                self._answer.append((choice.get("delta") or {}).get("content") or "")
                self._finish = choice.get("finish_reason") or self._finish
        except (ValueError, AttributeError, TypeError):
            pass

    async def _commit(self, answer: str, vllm_said: Any, finish: str | None) -> dict:
        plan = self.plan
        served = len(plan.slots)
        if isinstance(vllm_said, dict) and isinstance(vllm_said.get("served"), int):
            served = vllm_said["served"]
        said: dict[str, Any] = {
            "digest": plan.digest,
            "served": served,
            "computed": len(plan.prompt_token_ids) - served,
            "memory_digest": None,
            "memory_bytes": None,
            "forgot": 0,
        }
        if plan.fallback is not None:
            said["fallback"] = plan.fallback
        if finish not in ("stop", "length"):
            said["error"] = f"the answer ended with {finish!r}: the turn is not kept"
            return said
        try:
            said.update(await asyncio.to_thread(self.conversations.commit, plan, answer))
        except (KVEditError, OSError) as e:
            said["error"] = f"the turn was answered but not kept: {e}"
        return said


def _config() -> dict:
    raw = os.environ.get(CHAT_ENV)
    if not raw:
        raise KVEditError(f"kvedit's chat memories need {CHAT_ENV}; kvedit serve sets it")
    return json.loads(raw)


def _chat_request(body: bytes | None) -> dict | None:
    """The chat request in ``body`` when the memories can serve it, else None."""
    if body is None:
        return None
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        return None
    if request.get("echo") or request.get("n", 1) not in (1, None) or request.get("tools"):
        return None
    try:
        for m in request["messages"]:
            message_of(m)
    except KVEditError:
        return None  # not text: vLLM renders it itself
    return request


async def _error(send: Send, status: int, message: str) -> None:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "KVEditRefusal",
                "param": "kv_transfer_params",
                "code": status,
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
