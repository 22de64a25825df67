"""Helpers shared by tests."""

from __future__ import annotations

import asyncio
import socket

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_generate(model, tok, prefix_ids, continuation: str, max_new_tokens: int) -> str:
    """Plain ``model.generate`` on prefix ids + continuation ids (greedy), new tokens decoded."""
    cont = tok(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([list(prefix_ids) + list(cont)])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def snapshot(state) -> list[torch.Tensor]:
    """Clones of every tensor of a state, to check it was not mutated."""
    out = [state.token_ids.clone(), state.offsets.clone(), state.last_logits.clone()]
    for layer in state.layers:
        out += [layer.keys.clone(), layer.values.clone(), layer.token_index.clone()]
        out += [layer.positions.clone()]
        if layer.bias is not None:
            out.append(layer.bias.clone())
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def without_token(layer, token: int):
    """``layer`` without the entries of ``token`` (every edit recomputes the last token)."""
    return layer.select((layer.token_index != token).nonzero().flatten())


def same_layer_but_last(a, b, last: int) -> bool:
    """Whether two layers hold identical entries apart from those of token ``last``."""
    a, b = without_token(a, last), without_token(b, last)
    ta = [a.keys, a.values, a.token_index, a.positions] + ([a.bias] if a.bias is not None else [])
    tb = [b.keys, b.values, b.token_index, b.positions] + ([b.bias] if b.bias is not None else [])
    return same(ta, tb)


def check_halved_globals(out, state) -> None:
    """A keep-0.5 selection of a tiny Gemma-3 state (one KV head, so no union overhead):
    sliding layers as they were (but the recomputed last token, and ``window`` entries),
    global layers at half the entries."""
    from kvedit.testing import TINY_SLIDING_WINDOW

    for layer, orig in zip(out.layers, state.layers, strict=True):
        if orig.window is not None:
            assert same_layer_but_last(layer, orig, len(state) - 1)
            assert len(layer) == TINY_SLIDING_WINDOW
        else:
            assert len(layer) == round(0.5 * len(state))


def edit_file_header(path, change, reseal: bool = False) -> None:
    """Rewrite the ``kvedit`` JSON header entry of a safetensors file in place, tensor bytes
    untouched: ``change(meta)`` edits it. ``reseal``: recompute the seal's header digest as
    anyone can (without this installation's key: the MAC stays stale)."""
    import json
    import struct

    from kvedit.states.files.seal import header_digest

    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["kvedit"])
    change(meta)
    if reseal:
        meta["seal"]["header"] = header_digest(meta)
    header["__metadata__"]["kvedit"] = json.dumps(meta)
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def asgi_post(app, raw: bytes, path: str, chunk: int = 0) -> list[dict]:
    """The messages an ASGI ``app`` sends for one POST of ``raw`` to ``path`` (the body in
    chunks of ``chunk`` bytes when given)."""
    parts = [raw[i : i + chunk] for i in range(0, len(raw), chunk)] if chunk else [raw]
    incoming = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
        for i, p in enumerate(parts)
    ]
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(app(scope, receive, send))
    return sent


def set_at(*keys_and_value):
    """A change of a JSON-like object: ``set_at("turns", 1, "end", 5)(obj)`` sets
    ``obj["turns"][1]["end"] = 5`` in place (a memory file's attachment, say)."""
    *keys, value = keys_and_value

    def change(attachment):
        target = attachment
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return change


def asked_keywords(monkeypatch) -> list[dict]:
    """Spy on ``kvedit.Memory.ask``: the list, filled as it runs, of each call's keywords."""
    from kvedit import Memory

    seen: list[dict] = []
    ask = Memory.ask

    def spy(self, question, **keywords):
        seen.append(keywords)
        return ask(self, question, **keywords)

    monkeypatch.setattr(Memory, "ask", spy)
    return seen
