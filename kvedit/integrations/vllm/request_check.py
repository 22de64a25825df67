"""``kvedit serve``'s request check: a refusal reaches the client with its reason.

vLLM ends a request whose KV load failed with HTTP 500 and the message "Internal server error"
(``finish_reason == "error"``); the connector's reason is only in the server log. So
``kvedit serve`` adds this ASGI middleware (vLLM's documented ``--middleware`` option) in front
of the completion routes. Before vLLM sees a request it makes the connector's decision
(:func:`~kvedit.integrations.vllm.admission.admit`) on the request's body, verifies the file it
would be served from (its seal: the header's and the tensors' digests, one tensor at a time;
once per file version), and answers a refusal itself: an error status (:data:`~kvedit.integrations.vllm.admission.STATUS`:
400 a malformed or incomplete request, 404 an unknown digest, 409 another model's file, 500 a
corrupt or vanished file) and OpenAI's error body, its message naming the reason and the file
or digest, plus ``"kvedit": {"refused": reason, "detail": ..., "digest": ...}``. A request it
admits goes on to vLLM unchanged (the connector decides again; a file that changes in between
still fails closed there).

A prompt given as token ids (what ``kvedit publish`` prints) gets the whole decision. A text
or chat prompt cannot be matched to published ids here (the server tokenizes it later); when
it names a digest, the check refuses a digest published under no ids and a file with that
digest that is corrupt or another model's.

The middleware is configured by the environment variable :data:`CONFIG_ENV` (the connector's
``--kv-transfer-config`` JSON), which :func:`~kvedit.integrations.vllm.server.serve` sets.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from ...errors import KVEditError
from . import files
from .admission import Admitted, Refusal, admit, fingerprint_problem, requested_digest

__all__ = ["CONFIG_ENV", "MAX_BODY_BYTES", "TURN_SCOPE_KEY", "RequestCheck", "read_body", "replay"]

CONFIG_ENV = "KVEDIT_SERVE_CONFIG"
"""The environment variable holding the connector's ``--kv-transfer-config`` JSON."""

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Bodies larger than this are passed to vLLM unread (its own limits apply)."""

TURN_SCOPE_KEY = "kvedit.turn"
"""The ASGI scope key under which kvedit's chat middleware passes the turn id it set in the
body: a ``kv_transfer_params["kvedit"]["turn"]`` without it was set by a client, and refused
(a worker would write a turn file nobody collects)."""

_ROUTES = ("/v1/completions", "/v1/chat/completions")
_VERIFIED = 64  # file versions whose verification is remembered

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _no_shape_check(meta: dict) -> None:
    """The server process does not know the engine's shapes: the connector checks them."""
    return None


class RequestCheck:
    """ASGI middleware answering the requests the kvedit connector would refuse (module doc).

    Args:
        app: the ASGI app it wraps (vLLM's).
        config: the connector's ``--kv-transfer-config`` as a dict; default: the JSON in
            :data:`CONFIG_ENV`.

    Raises:
        KVEditError: no configuration, or one without a publish root.
    """

    def __init__(self, app: ASGIApp, config: dict | None = None) -> None:
        if config is None:
            raw = os.environ.get(CONFIG_ENV)
            if not raw:
                raise KVEditError(
                    f"the kvedit request check needs {CONFIG_ENV} (the connector's "
                    "--kv-transfer-config JSON); kvedit serve sets it"
                )
            config = json.loads(raw)
        extra = (config or {}).get("kv_connector_extra_config") or {}
        if not extra.get("root"):
            raise KVEditError("the kvedit request check needs kv_connector_extra_config['root']")
        self.app = app
        self.root = Path(extra["root"])
        self.fingerprint: str | None = extra.get("model_fingerprint")
        self.index = files.PublishedIndex(self.root)
        self._verified: OrderedDict[tuple, tuple[str, str] | None] = OrderedDict()
        self._lock = threading.Lock()  # decisions run in worker threads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope.get("type") != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in _ROUTES
        ):
            await self.app(scope, receive, send)
            return
        body, messages = await read_body(receive)
        refusal = None
        if body is not None:
            refusal = await asyncio.to_thread(self.decide, body, scope.get(TURN_SCOPE_KEY))
        if refusal is not None:
            await _answer(send, refusal)
            return
        await self.app(scope, replay(messages, receive), send)

    def decide(self, body: bytes, turn: str | None = None) -> Refusal | None:
        """The refusal a request body gets, or None (it goes on to vLLM). ``turn``: the turn
        id kvedit's chat middleware set (any other turn in the body is a client's: refused)."""
        try:
            request = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None  # vLLM answers a malformed body itself
        if not isinstance(request, dict):
            return None
        params = request.get("kv_transfer_params")
        own = params.get("kvedit") if isinstance(params, dict) else None
        if isinstance(own, dict) and "turn" in own and own["turn"] != turn:
            detail = (
                'kv_transfer_params["kvedit"]["turn"] is set by kvedit serve\'s chat memories, '
                f"never by a client (got {own['turn']!r:.40})"
            )
            return Refusal("bad-request", detail, 1)
        prompts = _token_prompts(request.get("prompt"))
        if prompts is None:
            return self._decide_by_digest(params)
        for ids in prompts:
            decision = admit(
                self.index, ids, params, check=_no_shape_check, fingerprint=self.fingerprint
            )
            if isinstance(decision, Refusal):
                return decision
            if isinstance(decision, Admitted):
                refusal = self._verify(decision.path, decision.n, decision.meta.get("digest"))
                if refusal is not None:
                    return refusal
        return None

    def _decide_by_digest(self, params: object) -> Refusal | None:
        """A text or chat prompt: the named digest must be published, readable and this
        model's (the connector matches the tokenized prompt later)."""
        digest, bad = requested_digest(params)
        if bad:
            return Refusal("bad-request", bad, 1)
        if digest is None:
            return None
        try:
            paths = self.index.with_digest(digest)
        except OSError as e:
            return Refusal("root", f"cannot list {self.root}: {e}", 1, digest=digest)
        if not paths:
            detail = f"no cache with digest {digest} is published under {self.root}"
            return Refusal("unknown-digest", detail, 1, digest=digest)
        for path, n in paths:
            refusal = self._verify(path, n, digest)
            if refusal is not None:
                return refusal
        return None

    def _verify(self, path: Path, n: int, digest: str | None) -> Refusal | None:
        """A refusal when ``path`` is missing, corrupt or another model's (remembered per file
        version: inode, size and modification time)."""
        try:
            st = path.stat()
            key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
            with self._lock:
                if key not in self._verified:
                    self._verified[key] = self._problem(path)
                    while len(self._verified) > _VERIFIED:
                        self._verified.popitem(last=False)
                self._verified.move_to_end(key)
                problem = self._verified[key]
        except FileNotFoundError:
            problem = ("missing", f"{path} was removed after the lookup")
        return None if problem is None else Refusal(*problem, n, str(path), digest)

    def _problem(self, path: Path) -> tuple[str, str] | None:
        """``(reason, detail)`` when the file at ``path`` fails its seal or is another model's.

        Raises:
            FileNotFoundError: it vanished.
        """
        try:
            meta = files.verify(path)
        except FileNotFoundError:
            raise
        except (KVEditError, OSError) as e:
            return "corrupt", str(e)
        problem = fingerprint_problem(meta, self.fingerprint)
        return None if problem is None else ("mismatch", f"{path.name}: {problem}")


def _token_prompts(prompt: object) -> list[list[int]] | None:
    """A completion prompt given as token ids (one list, or a list of lists), else None."""

    def ids(x: object) -> bool:
        return isinstance(x, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x
        )

    if ids(prompt) and prompt:
        return [list(prompt)]  # type: ignore[arg-type]
    if isinstance(prompt, list) and prompt and all(ids(p) for p in prompt):
        return [list(p) for p in prompt]
    return None


async def read_body(receive: Receive) -> tuple[bytes | None, list[Message]]:
    """``(the whole body, or None past MAX_BODY_BYTES or on a disconnect; the messages read)``."""
    messages: list[Message] = []
    size = 0
    chunks: list[bytes] = []
    while True:
        message = await receive()
        messages.append(message)
        if message.get("type") != "http.request":
            return None, messages
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None, messages
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), messages


def replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` giving the messages already read, then the client's own."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


async def _answer(send: Send, refusal: Refusal) -> None:
    """Send OpenAI's error body for ``refusal``, with its kvedit outcome."""
    outcome: dict[str, Any] = {"refused": refusal.reason, "detail": refusal.detail}
    if refusal.digest is not None:
        outcome["digest"] = refusal.digest
    if refusal.path:
        outcome["file"] = Path(refusal.path).name
    body = json.dumps(
        {
            "error": {
                "message": refusal.message,
                "type": "KVEditRefusal",
                "param": "kv_transfer_params",
                "code": refusal.status,
            },
            "kvedit": outcome,
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
