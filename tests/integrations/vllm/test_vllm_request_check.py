"""``kvedit serve``'s request check: a request the connector would refuse is answered with an
error status and its reason before vLLM sees it. No vLLM needed: the middleware is plain ASGI,
driven here with a stand-in app that records what reached it.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import asgi_post, edit_file_header

import kvedit
from kvedit.errors import KVEditError
from kvedit.integrations.vllm import kv_transfer_params, publish
from kvedit.integrations.vllm.admission import STATUS
from kvedit.integrations.vllm.chat import CHAT_ENV
from kvedit.integrations.vllm.engines import connector_config
from kvedit.integrations.vllm.request_check import CONFIG_ENV, RequestCheck
from kvedit.integrations.vllm.server import serve_command, serve_environment

TEXT = "Alice's secret number is 4821. Bob's secret number is 7310. Carol's is 5902."
SPAN = "Bob's secret number is 7310."
QUESTION = [11, 12, 13]


class Downstream:
    """The app behind the check (vLLM's): records the bodies that reached it."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.bodies.append(b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"served": true}'})


def call(check: RequestCheck, body: object, path: str = "/v1/completions", chunk: int = 0):
    """``(status, JSON body)`` of one POST through ``check`` (the body sent in chunks of
    ``chunk`` bytes when given)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = asgi_post(check, raw, path, chunk)
    status = sent[0]["status"]
    return status, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.fixture(scope="module")
def states(llama):
    model, tok = llama
    plain = kvedit.capture(model, tok, TEXT)
    return plain, kvedit.ops.scale_keys(plain, SPAN, 0.5)


@pytest.fixture
def served(states, tmp_path):
    """``(check, downstream, plain ids, edited ids, root)`` over a root holding both states."""
    plain, edited = states
    root = tmp_path / "published"
    plain_ids, edited_ids = publish(plain, root), publish(edited, root)
    downstream = Downstream()
    config = connector_config(root, plain.model_fingerprint)
    return RequestCheck(downstream, config), downstream, plain_ids, edited_ids, root


def request(ids, digest: str | None = None, **extra) -> dict:
    body = {"model": "m", "prompt": list(ids) + QUESTION, "max_tokens": 4, **extra}
    if digest is not None:
        body["kv_transfer_params"] = kv_transfer_params(digest)
    return body


def test_a_servable_request_reaches_vllm_unchanged(served):
    check, downstream, plain_ids, edited_ids, _ = served
    for body in (request(edited_ids, edited_ids.digest), request(plain_ids)):
        raw = json.dumps(body).encode()
        assert call(check, raw, chunk=7) == (200, {"served": True})
        assert downstream.bodies[-1] == raw  # the body vLLM reads is the client's, whole


def test_requests_the_check_cannot_judge_pass_through(served):
    check, downstream, *_ = served
    assert call(check, b"{not json")[0] == 200  # vLLM answers a malformed body itself
    assert call(check, {"model": "m", "prompt": "plain text"})[0] == 200
    assert call(check, {"model": "m", "prompt": [1, 2, 3]})[0] == 200  # nothing published
    assert len(downstream.bodies) == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_digest_is_404_and_named(served, path):
    check, downstream, plain_ids, *_ = served
    body = request(plain_ids, "f" * 32)
    if path.endswith("chat/completions"):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        body["kv_transfer_params"] = kv_transfer_params("f" * 32)
    status, answer = call(check, body, path)
    assert status == 404 == answer["error"]["code"]
    assert "unknown-digest" in answer["error"]["message"] and "f" * 32 in answer["error"]["message"]
    assert answer["kvedit"] == {
        "refused": "unknown-digest",
        "detail": answer["kvedit"]["detail"],
        "digest": "f" * 32,
    }
    assert downstream.bodies == []


@pytest.mark.parametrize(
    "params",
    [{"kvedit": {"digest": "XYZ"}}, {"kvedit": {"digest": "a" * 32, "other": 1}}, {"kvedit": 3}],
)
def test_malformed_kvedit_parameters_are_400(served, params):
    check, downstream, plain_ids, *_ = served
    status, answer = call(check, {**request(plain_ids), "kv_transfer_params": params})
    assert status == 400 and answer["kvedit"]["refused"] == "bad-request"
    assert downstream.bodies == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_turn_a_client_sets_is_400_and_only_kvedits_own_passes(served, path):
    """A turn id makes vLLM's worker write the turn's K/V for the chat memories: only kvedit's
    chat middleware sets one (and passes it in the ASGI scope), never a client."""
    check, downstream, plain_ids, *_ = served
    body = {**request(plain_ids), "kv_transfer_params": {"kvedit": {"turn": "a" * 32}}}
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    status, answer = call(check, body, path)
    assert status == 400 and answer["kvedit"]["refused"] == "bad-request"
    assert "never by a client" in answer["error"]["message"] and downstream.bodies == []
    assert check.decide(json.dumps(body).encode(), "b" * 32) is not None  # another turn
    assert check.decide(json.dumps(body).encode(), "a" * 32) is None  # the middleware's own


def test_an_edited_prefix_without_a_digest_is_400_and_lists_the_digests(states, tmp_path):
    _, edited = states
    ids = publish(edited, tmp_path)
    check = RequestCheck(Downstream(), connector_config(tmp_path, None))
    status, answer = call(check, request(ids))
    assert status == 400 and answer["kvedit"]["refused"] == "digest-required"
    assert ids.digest in answer["error"]["message"]


def test_the_whole_prompt_of_an_edited_state_is_400(served):
    check, _, _, edited_ids, _ = served
    body = {
        "model": "m",
        "prompt": list(edited_ids),
        "kv_transfer_params": kv_transfer_params(edited_ids.digest),
    }
    status, answer = call(check, body)
    assert status == 400 and answer["kvedit"]["refused"] == "whole-prompt"


def corrupt(path) -> None:
    """Flip one byte of the tensor data (the header stays readable)."""
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("text_prompt", [False, True])
def test_a_corrupt_file_is_500_and_named(served, text_prompt):
    check, downstream, _, edited_ids, _ = served
    body = request(edited_ids, edited_ids.digest)
    if text_prompt:
        body["prompt"] = TEXT
    assert call(check, body)[0] == 200  # verified once, then remembered ...
    corrupt(edited_ids.path)  # ... per file version: the changed file is verified again
    status, answer = call(check, body)
    assert status == STATUS["corrupt"] == 500
    assert "checksum mismatch" in answer["error"]["message"]
    assert edited_ids.path.name in answer["error"]["message"]
    assert answer["kvedit"]["file"] == edited_ids.path.name


def test_a_missing_file_is_named(served):
    check, _, _, edited_ids, _ = served
    edited_ids.path.unlink()
    status, answer = call(check, request(edited_ids, edited_ids.digest))
    assert status == 404 and answer["kvedit"]["refused"] == "unknown-digest"


def test_another_models_file_is_409(states, tmp_path):
    plain, edited = states
    ids = publish(edited, tmp_path)
    check = RequestCheck(Downstream(), connector_config(tmp_path, "0" * 16))
    status, answer = call(check, request(ids, ids.digest))
    assert status == 409 and answer["kvedit"]["refused"] == "mismatch"
    assert (
        "made by model" in answer["error"]["message"]
        and ids.path.name in answer["error"]["message"]
    )


def test_other_routes_and_methods_are_not_read(served):
    check = RequestCheck(
        lambda scope, receive, send: reached.append(scope["path"]) or _done(),
        {"kv_connector_extra_config": {"root": str(served[4])}},
    )
    reached: list[str] = []

    async def receive():
        raise AssertionError("the check read a body it has no business with")

    async def send(message):
        raise AssertionError("the check answered a request it has no business with")

    for method, path in (("GET", "/health"), ("POST", "/v1/embeddings")):
        scope = {"type": "http", "method": method, "path": path, "headers": []}
        asyncio.run(check(scope, receive, send))
    assert reached == ["/health", "/v1/embeddings"]


async def _done() -> None:
    return None


def test_the_check_needs_its_configuration(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(KVEditError, match=CONFIG_ENV):
        RequestCheck(Downstream())
    with pytest.raises(KVEditError, match="root"):
        RequestCheck(Downstream(), {"kv_connector_extra_config": {}})


def test_kvedit_serve_installs_the_check_with_the_connectors_configuration(tmp_path, monkeypatch):
    from kvedit.integrations.vllm import server

    monkeypatch.setattr(server, "model_folder", lambda model: ("/models/m", "f1ngerprint"))
    argv = serve_command("m", tmp_path, cpu=True)
    assert argv[argv.index("--middleware") + 1] == (
        "kvedit.integrations.vllm.request_check.RequestCheck"
    )
    env = serve_environment(argv)
    assert json.loads(env[CONFIG_ENV]) == json.loads(argv[argv.index("--kv-transfer-config") + 1])
    check = RequestCheck(Downstream(), json.loads(env[CONFIG_ENV]))
    assert check.root == tmp_path.resolve() and check.fingerprint == "f1ngerprint"


def test_the_printed_serve_command_carries_the_checks_configuration(
    llama, tmp_path, monkeypatch, capsys
):
    """``kvedit serve --dry-run`` prints a command a shell can run as it is: the request check
    reads its configuration from the environment, so the line sets it."""
    import shlex

    from kvedit.integrations.vllm import server

    monkeypatch.setattr(server, "require_vllm", lambda what: None)
    monkeypatch.setattr(server, "loaded_model", lambda model: llama[0])
    monkeypatch.setattr(server, "model_folder", lambda model: ("/models/m", "f1ngerprint"))
    argv = server.serve("m", tmp_path, dry_run=True, memory_max_bytes=1 << 20, forget="knorm")
    words = shlex.split(capsys.readouterr().err.strip().splitlines()[-1])
    env = dict(w.partition("=")[::2] for w in words[:2])
    assert set(env) == {CONFIG_ENV, CHAT_ENV}
    assert json.loads(env[CONFIG_ENV]) == json.loads(serve_environment(argv)[CONFIG_ENV])
    chat = json.loads(env[CHAT_ENV])
    assert (chat["model"], chat["max_bytes"], chat["forget"]) == ("/models/m", 1 << 20, "knorm")
    assert words[2:] == argv and argv[-2:] == ["--middleware", server.CHAT_MEMORIES]


def test_chat_memory_options_are_checked_before_anything_runs(tmp_path, monkeypatch):
    """A budget or a policy without the memories, a policy that runs the model, and a budget
    that is no positive count of bytes are refused before vLLM is started."""
    from kvedit.errors import InvalidInputError
    from kvedit.integrations.vllm import server

    monkeypatch.setattr(server, "require_vllm", lambda what: None)
    monkeypatch.setattr(server, "loaded_model", lambda model: model)
    monkeypatch.setattr(server, "model_folder", lambda model: ("/models/m", "f1ngerprint"))
    for kw, match in (
        ({"memories": False, "forget": "learned"}, "need the chat memories"),
        ({"forget": "kvzip"}, "cannot serve"),
        ({"memory_max_bytes": 0}, "positive"),
    ):
        with pytest.raises(InvalidInputError, match=match):
            server.serve("m", tmp_path, dry_run=True, **kw)
    argv = server.serve("m", tmp_path, dry_run=True, memories=False)
    assert server.CHAT_MEMORIES not in argv and CHAT_ENV not in server.serve_environment(argv)


def test_kvedit_serve_loads_the_model_once_and_refuses_bad_roots_and_policies(
    llama, tmp_path, monkeypatch, capsys
):
    """The weights are loaded once (for the folder and the fingerprint, which both the command
    and the chat memories' configuration use); a root that is a file and an empty --forget
    are one error line, exit 2, before vLLM is looked for."""
    from kvedit.cli.main import main as cli_main
    from kvedit.integrations.vllm import server

    loads: list = []
    monkeypatch.setattr(server, "require_vllm", lambda what: None)
    monkeypatch.setattr(server, "loaded_model", lambda m: loads.append(m) or llama[0])
    monkeypatch.setattr(server, "model_folder", lambda m: ("/m", "fp"))
    server.serve("m", tmp_path, dry_run=True, memory_max_bytes=1 << 20)
    assert loads == ["m"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setattr(server, "require_vllm", lambda what: pytest.fail("looked for vLLM"))
    for args in (["--root", str(afile)], ["--root", str(tmp_path), "--forget", ""]):
        capsys.readouterr()
        assert cli_main(["serve", "--dry-run", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("not a folder" in err[0] or "cannot serve" in err[0])
    assert loads == ["m"]


def test_the_servable_policies_come_from_the_scorers_traits(monkeypatch, capsys):
    """A scorer that does not read the model serves (the server's option check, Conversations'
    and --forget's help take it) and one that does is refused, with nothing else touched."""
    from dataclasses import dataclass

    from kvedit.cli.main import main as cli_main
    from kvedit.compress import SCORERS, Scorer, register_scorer
    from kvedit.errors import InvalidInputError
    from kvedit.integrations.vllm import server
    from kvedit.integrations.vllm.conversations import servable_policies, served_policy

    @dataclass(frozen=True)
    class Newest(Scorer):
        reads_model = False

    @dataclass(frozen=True)
    class Probing(Scorer):
        pass  # reads the model, as a scorer does unless it says otherwise

    register_scorer("test_newest")(Newest)
    register_scorer("test_probing")(Probing)
    try:
        assert "test_newest" in servable_policies() and "test_probing" not in servable_policies()
        assert {"learned", "knorm", "window"} <= set(servable_policies())
        assert served_policy("test_newest") == "test_newest"
        assert server.check_chat_options(True, None, "test_newest")
        with pytest.raises(InvalidInputError, match="test_newest"):  # named among the servable
            server.check_chat_options(True, None, "test_probing")
        assert cli_main(["serve", "--help"]) == 0
        assert "test_newest" in " ".join(capsys.readouterr().out.split())
    finally:
        del SCORERS["test_newest"], SCORERS["test_probing"]


# ------------------------------------------------------------------ a file's claims


def _claim_plain(meta):
    meta["plain_capture"] = True
    meta["history"]["steps"] = []


def test_an_edited_file_claiming_plain_capture_is_corrupt(states, tmp_path):
    from kvedit.errors import CorruptCacheError
    from kvedit.integrations.vllm import files

    _, edited = states
    ids = publish(edited, tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    edit_file_header(path, _claim_plain)
    with pytest.raises(CorruptCacheError, match="header was edited"):
        files.verify(path)
    check = RequestCheck(Downstream(), connector_config(tmp_path, None))
    status, answer = call(check, request(ids))  # no digest named: nothing plain to serve
    assert status != 200 and answer["kvedit"]["refused"] in {"corrupt", "digest-required"}


def test_a_claim_resealed_without_the_key_is_not_believed(states, tmp_path):
    from kvedit.integrations.vllm import files

    _, edited = states
    ids = publish(edited, tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    assert files.verify(path)["trusted"] is True
    edit_file_header(path, _claim_plain, reseal=True)
    meta = files.verify(path)  # whole, but not this installation's
    assert meta["trusted"] is False and meta["plain_capture"] is True
    downstream = Downstream()
    check = RequestCheck(downstream, connector_config(tmp_path, None))
    status, answer = call(check, request(ids))
    assert status == 400 and answer["kvedit"]["refused"] == "digest-required"
    assert downstream.bodies == []
