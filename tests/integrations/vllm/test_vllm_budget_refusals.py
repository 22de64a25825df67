"""A served memory's byte budget that can never hold is refused before any work, on every
served entry point (without vLLM): ``kvedit serve --memory-max-bytes`` (exit 2, one line, once
the model is loaded and before vLLM starts), a request's ``{"kvedit": {"max_bytes": N}}``
(400 naming the smallest that holds), and the server's budget against a request's system
message (which no turn forgets)."""

from __future__ import annotations

import json

import pytest
from helpers import asgi_post
from test_vllm_conversations import SYSTEM, USERS

from kvedit.errors import InvalidInputError
from kvedit.integrations.vllm import turns
from kvedit.integrations.vllm.chat import ChatMemories
from kvedit.integrations.vllm.conversations import MEMORIES, Conversations
from kvedit.memory.budget import RECENT_TOKENS
from kvedit.memory.smallest import smallest_budget, system_head


def test_kvedit_serve_refuses_a_budget_that_can_never_hold_before_vllm_starts(
    llama, tmp_path, monkeypatch, capsys
):
    from kvedit.cli.main import main as cli_main
    from kvedit.integrations.vllm import server

    model = llama[0]
    least = smallest_budget(model, recent_tokens=RECENT_TOKENS).max_bytes
    assert least > 1024  # a few tokens' entries on every layer
    reached: list = []
    monkeypatch.setattr(server, "require_vllm", lambda what: None)
    monkeypatch.setattr(server, "loaded_model", lambda m: model)
    monkeypatch.setattr(server, "model_folder", lambda m: reached.append(m) or ("/m", "fp"))
    args = ["serve", "--dry-run", "--root", str(tmp_path / "root"), "--memory-max-bytes"]
    for size in ("1KiB", str(least - 1)):
        capsys.readouterr()
        assert cli_main([*args, size]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--memory-max-bytes=" in err[0]
        assert (
            f"can never hold: the smallest budget a served memory of this model holds is "
            f"{least:,} bytes" in err[0]
        )
    assert not reached  # refused before the command was built
    assert cli_main([*args, str(least)]) == 0  # the smallest holds
    assert len(reached) == 1


def test_a_requests_budget_that_can_never_hold_is_refused_400_naming_the_smallest(llama, tmp_path):
    model, tok = llama
    conv = Conversations(tmp_path, model, tok, forget="window")
    messages = [SYSTEM, {"role": "user", "content": USERS[0]}]
    head = system_head(conv.renderer, SYSTEM["content"])
    least = smallest_budget(model, system_tokens=head, recent_tokens=RECENT_TOKENS).max_bytes
    for n in (1, least - 1):
        with pytest.raises(
            InvalidInputError,
            match=f'max_bytes"\\]={n:,} can never hold.*'
            f"with this system message holds is {least:,} bytes",
        ):
            conv.plan(messages, {"kvedit": {"max_bytes": n}})
    assert conv.plan(messages, {"kvedit": {"max_bytes": least}}).budget is not None
    body = {"model": "m", "messages": messages, "kv_transfer_params": {"kvedit": {"max_bytes": 1}}}

    async def vllm(scope, receive, send):
        pytest.fail("vLLM was asked")

    sent = asgi_post(ChatMemories(vllm, conv), json.dumps(body).encode(), "/v1/chat/completions")
    assert sent[0]["status"] == 400
    said = json.loads(sent[1]["body"])
    assert f"is {least:,} bytes" in json.dumps(said)
    assert not list((tmp_path / MEMORIES).iterdir())  # nothing stored
    assert not (tmp_path / turns.TURNS).exists() or not list((tmp_path / turns.TURNS).iterdir())


def test_the_servers_budget_is_refused_at_start_and_against_a_long_system_message(llama, tmp_path):
    model, tok = llama
    least = smallest_budget(model, recent_tokens=RECENT_TOKENS).max_bytes
    with pytest.raises(InvalidInputError, match=f"--memory-max-bytes={least - 1:,} can never"):
        Conversations(tmp_path, model, tok, forget="window", max_bytes=least - 1)
    conv = Conversations(tmp_path, model, tok, forget="window", max_bytes=least)
    assert conv.plan([{"role": "user", "content": USERS[0]}]).budget is not None
    system = {"role": "system", "content": "Keep every note. " * 20}  # no turn forgets it
    with pytest.raises(InvalidInputError, match="with this system message holds is"):
        conv.plan([system, {"role": "user", "content": USERS[0]}])
