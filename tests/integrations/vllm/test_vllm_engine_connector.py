"""The connector's decisions, request by request, without starting an engine (needs vLLM).

The scheduler side of :class:`~kvedit.integrations.vllm.connector.KVEditConnector` is driven
the way vLLM 0.32's scheduler drives it (``get_num_new_matched_tokens``, then
``update_state_after_alloc`` with the tokens vLLM took, then ``build_connector_meta``), and the
worker side is handed the metadata. Served end to end in ``test_vllm_engine.py``.

* A request names the digest it wants; it is served from that file and the outcome echoes the
  digest; a request naming none is served only from a plain capture of its ids.
* Under ``load_failure="fail"`` the connector fails closed: an unknown digest, a prompt that
  names no digest where only edited states are published, a prefix-cache hit on a published
  prompt, and a prompt that is exactly an edited cache's ids each get a load that fails (so
  vLLM ends the request with an error), and the worker reports only the blocks of that load.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import kvedit
from kvedit.provenance import Step

pytest.importorskip("vllm")
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvedit.integrations.vllm import connector_config, kv_transfer_params, publish  # noqa: E402
from kvedit.integrations.vllm.connector import KVEditConnector  # noqa: E402

BLOCK = 16
TEXT = (
    "Alice's secret number is 4821. Bob's secret number is 7310. Carol's secret number is 5902. "
    "Dave's secret number is 1234. Eve's secret number is 8807."
)
SPAN = "Bob's secret number is 7310."


@pytest.fixture(scope="module")
def states(llama):
    model, tok = llama
    plain = kvedit.capture(model, tok, TEXT)
    scaled = recorded(kvedit.ops.scale_keys(plain, SPAN, 0.5), "scale_keys")
    duplicated = recorded(kvedit.ops.duplicate(plain, SPAN, 2), "duplicate")
    return model, plain, scaled, duplicated


def recorded(state: kvedit.KVState, name: str) -> kvedit.KVState:
    """An edited state with its edit in its history (added here if this checkout's op does
    not record it yet)."""
    return state.with_step(Step("edit", name)) if state.is_plain_capture else state


def make(root, model, policy: str = "fail", prefix_caching: bool = False) -> KVEditConnector:
    cfg = connector_config(root, None, load_failure=policy)
    n_layers = model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=cfg["kv_connector_extra_config"],
            kv_load_failure_policy=policy,
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        model_config=SimpleNamespace(
            get_total_num_hidden_layers=lambda: n_layers,
            get_total_num_kv_heads=lambda: heads,
            get_head_size=lambda: head_dim,
        ),
    )
    groups = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[])])
    return KVEditConnector(vllm_config, KVConnectorRole.SCHEDULER, groups)


class Req(SimpleNamespace):
    def __init__(self, rid: str, ids: list[int], digest: str | None = None, params=None):
        if params is None and digest is not None:
            params = kv_transfer_params(digest)
        super().__init__(
            request_id=rid,
            prompt_token_ids=list(ids),
            num_tokens=len(ids),
            kv_transfer_params=params,
        )


def schedule(conn: KVEditConnector, req: Req, computed: int = 0, taken: int | None = None):
    """What vLLM's scheduler does with a new request: ``(claimed, load spec or None)``.
    ``taken``: the external tokens vLLM took (default: all claimed)."""
    claim, is_async = conn.get_num_new_matched_tokens(req, computed)
    assert is_async is False
    conn.update_state_after_alloc(req, None, claim if taken is None else taken)
    blocks = [list(range(100, 100 + (req.num_tokens + BLOCK - 1) // BLOCK))]
    new = SimpleNamespace(req_id=req.request_id, block_ids=(blocks[0],))
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[])
    meta = conn.build_connector_meta(
        SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached)
    )
    return claim, (meta.loads[0] if meta.loads else None)


def outcome(conn: KVEditConnector, req: Req) -> dict:
    _, params = conn.request_finished(req, [])
    return (params or {}).get("kvedit", {})


def failed_blocks(conn: KVEditConnector, load) -> set[int]:
    """The blocks the worker reports for ``load`` (a refused load fails before any layer)."""
    from kvedit.integrations.vllm.connector import KVEditConnectorMetadata

    conn.bind_connector_metadata(KVEditConnectorMetadata(loads=[load]))
    conn.start_load_kv(SimpleNamespace(no_compile_layers={}))
    return conn.get_block_ids_with_load_errors()


@pytest.fixture
def root(states, tmp_path):
    _, plain, scaled, _ = states
    return tmp_path, publish(plain, tmp_path), publish(scaled, tmp_path)


def test_a_request_is_served_from_the_digest_it_names_and_the_outcome_echoes_it(states, root):
    model = states[0]
    path, plain, scaled = root
    conn = make(path, model)
    question = [5, 6, 7]
    for name, ids, digest in [("p", plain, None), ("s", scaled, scaled.digest)]:
        req = Req(name, ids + question, digest)
        claim, load = schedule(conn, req)
        assert claim == len(ids) and load.refused == "" and (load.start, load.end) == (0, claim)
        got = outcome(conn, req)
        want = ids.digest  # a request naming no digest is served from the plain capture
        assert got == {
            "served": claim,
            "published": len(ids),
            "file": ids.path.name,
            "digest": want,
        }
    req = Req("p2", plain + question, plain.digest)
    assert schedule(conn, req)[1].path == str(plain.path)


def test_an_unknown_digest_fails_the_request(states, root):
    model = states[0]
    path, plain, _ = root
    conn = make(path, model)
    req = Req("u", plain + [5, 6], "f" * 32)
    claim, load = schedule(conn, req)
    assert claim >= 1 and load.refused.startswith("unknown-digest")
    assert failed_blocks(conn, load) == {100}  # the load fails: vLLM ends the request
    got = outcome(conn, req)
    assert (got["refused"], got["digest"]) == ("unknown-digest", "f" * 32)
    assert conn.refusals["unknown-digest"] == 1
    recompute = make(path, model, "recompute")
    assert schedule(recompute, Req("u", plain + [5, 6], "f" * 32)) == (0, None)


@pytest.mark.parametrize(
    "params", [{"kvedit": {"digest": "nope"}}, {"kvedit": "x"}, {"kvedit": {"dgst": "0" * 32}}]
)
def test_a_malformed_request_fails(states, root, params):
    path, plain, _ = root
    conn = make(path, states[0])
    claim, load = schedule(conn, Req("b", plain + [5], params=params))
    assert claim >= 1 and load.refused.startswith("bad-request")


def test_without_a_digest_only_a_plain_capture_is_served(states, tmp_path):
    model, plain, scaled, duplicated = states
    conn = make(tmp_path, model)
    edited = publish(scaled, tmp_path)
    req = Req("n", edited + [5, 6])
    claim, load = schedule(conn, req)
    assert claim >= 1 and load.refused.startswith("digest-required")
    assert edited.digest in load.refused and "kv_transfer_params" in load.refused
    copies = publish(duplicated, tmp_path)
    claim, load = schedule(conn, Req("d", copies + [5, 6]))
    assert load.refused.startswith("digest-required")
    claim, load = schedule(conn, Req("d2", copies + [5, 6], copies.digest))
    assert claim == len(copies) and not load.refused
    publish(plain, tmp_path)  # now the plain capture is there
    claim, load = schedule(conn, Req("n2", edited + [5, 6]))
    assert claim == len(edited) and not load.refused and "-" + plain.digest in load.path


def test_a_prefix_cache_hit_on_a_published_prompt_fails_the_request(states, root):
    """Before: refused without a failing load, so vLLM computed the rest of the published ids
    as text (copies read as repeated tokens)."""
    path, plain, scaled = root
    conn = make(path, states[0], prefix_caching=True)
    req = Req("c", scaled + [5, 6, 7], scaled.digest)
    claim, load = schedule(conn, req, computed=BLOCK)
    assert claim == len(scaled) - BLOCK and load.refused.startswith("prefix-cache")
    assert (load.start, load.end) == (BLOCK, len(scaled))
    # only the request's own blocks after the cached ones: no other request shares them
    assert failed_blocks(conn, load) == set(range(101, 100 + (len(scaled) - 1) // BLOCK + 1))
    # the prefix cache covers all but the last prompt token: nothing left to claim, so the
    # last cached block fails (and is evicted)
    ids = list(scaled) + [5] * (3 * BLOCK + 1 - len(scaled))
    req = Req("c2", ids, scaled.digest)
    claim, load = schedule(conn, req, computed=3 * BLOCK)
    assert claim == 0 and load.refused.startswith("prefix-cache")
    assert (load.start, load.end) == (3 * BLOCK - 1, 3 * BLOCK)
    assert failed_blocks(conn, load) == {102}
    recompute = make(path, states[0], "recompute", prefix_caching=True)
    assert schedule(recompute, Req("c", scaled + [5], scaled.digest), computed=BLOCK)[0] == 0


def test_a_kept_sub_block_prefix_hit_fails_the_request(states, root):
    """vLLM may keep a partial-block prefix hit and take none of the claim."""
    path, plain, scaled = root
    conn = make(path, states[0], prefix_caching=True)
    claim, load = schedule(conn, Req("k", scaled + [5], scaled.digest), taken=0)
    assert (
        claim > 0 and load.refused.startswith("prefix-cache") and (load.start, load.end) == (0, 1)
    )


def test_a_prompt_of_exactly_the_published_ids_is_served_exactly_or_refused(states, root):
    """vLLM computes the last prompt token itself, from its id: right for a plain capture,
    not for an edited cache's last slot (a copy, or an entry the edit changed)."""
    model, *_ = states
    path, plain, scaled = root
    conn = make(path, model)
    claim, load = schedule(conn, Req("w", list(plain)))
    assert claim == len(plain) - 1 and not load.refused
    claim, load = schedule(conn, Req("w2", list(scaled), scaled.digest))
    assert claim == len(scaled) - 1 and load.refused.startswith("whole-prompt")
    assert failed_blocks(conn, load)


def test_a_failed_load_reports_only_its_own_blocks(states, root, tmp_path_factory):
    path, plain, _ = root
    conn = make(path, states[0])
    req = Req("g", plain + [5, 6], plain.digest)
    claim, load = schedule(conn, req)
    plain.path.unlink()  # gone after the lookup: the worker's load fails
    assert failed_blocks(conn, load) == set(range(100, 100 + (claim - 1) // BLOCK + 1))


def test_a_request_asked_again_is_decided_afresh(states, tmp_path):
    """vLLM asks again for a request it could not schedule; a match from the first answer
    must not be used for the second."""
    plain = publish(states[1], tmp_path)
    conn = make(tmp_path, states[0])
    req = Req("r", plain + [5, 6])
    assert conn.get_num_new_matched_tokens(req, 0)[0] == len(plain)
    plain.path.unlink()
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, None, 0)
    assert outcome(conn, req) == {} and not conn.refusals


# ---------------------------------------------------------------- end to end, one engine


@pytest.mark.real
def test_a_prefix_cache_hit_ends_the_request_with_an_error(smollm2, tmp_path):
    """With prefix caching on (a misconfiguration ``engine`` warns about), a plain request
    that hits the blocks vLLM cached for an edited cache of the same ids must not be answered
    from them: under ``load_failure="fail"`` it ends with an error."""
    from vllm import SamplingParams

    from kvedit.integrations.vllm import engine

    model, tok = smollm2
    text = " ".join(f"Record {i}: the code of box {i} is {1000 + 37 * i}." for i in range(12))
    plain = kvedit.capture(model, tok, text)
    scaled = recorded(kvedit.ops.scale_keys(plain, "box 3 is", 0.3), "scale_keys")
    a, b = publish(plain, tmp_path), publish(scaled, tmp_path)
    q = plain.encode(" Question: what is the code of box 3? Answer:")
    with pytest.warns(UserWarning, match="prefix_caching"):
        llm = engine(model, tmp_path, enable_prefix_caching=True)
    try:
        greedy = dict(temperature=0, max_tokens=4)
        first = llm.generate(
            {"prompt_token_ids": b + q},
            SamplingParams(**greedy, extra_args=b.sampling_extra_args()),
        )[0]
        assert first.kv_transfer_params["kvedit"]["digest"] == b.digest
        second = llm.generate({"prompt_token_ids": a + q}, SamplingParams(**greedy))[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert second.outputs[0].finish_reason == "error" and not second.outputs[0].token_ids
