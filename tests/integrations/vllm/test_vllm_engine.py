"""vLLM serves published kvedit caches: token-identical to ``state.generate`` (float32).

One engine for the whole module (a start takes 30-45 s on 2 cores); every prompt goes through
it in one batch. The plain state and its ``scale_keys`` edit have the same prompt ids and are
published into one root: each request names the digest it wants (none: the plain capture) and
the response echoes the digest it was served from. The bundled SmolLM2-135M has 9 query heads
on 3 KV heads (GQA).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kvedit
from kvedit.evals.tasks.records import records_examples
from kvedit.integrations.vllm import engine, files, publish, publish_stock, to_stock
from kvedit.provenance import Step

pytestmark = pytest.mark.real
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def case(smollm2):
    model, tok = smollm2
    example = records_examples(positions=[6], trials=1, n_records=10)[0]
    prefix, question = kvedit.chat_prefix(tok, example.user_message(), "\n\nQuestion:")
    state = kvedit.capture(model, tok, prefix)
    return model, tok, state, question, example.gold_document


def recorded(state: kvedit.KVState, name: str) -> kvedit.KVState:
    """An edited state with its edit in its history (added here if this checkout's op does
    not record it yet)."""
    return state.with_step(Step("edit", name)) if state.is_plain_capture else state


@pytest.fixture(scope="module")
def served(case, tmp_path_factory):
    """Publish every variant, serve them through one engine; returns name -> result."""
    from vllm import SamplingParams

    model, tok, state, question, gold = case
    root = tmp_path_factory.mktemp("published")
    qids = state.encode(question)
    ops = kvedit.ops
    variants = {
        "plain": state,
        "duplicate": recorded(ops.duplicate(state, gold, 3), "duplicate"),
        "suppress_full": recorded(ops.suppress(state, gold, 1e4), "suppress"),  # changes it
        "emphasize_log4": recorded(ops.emphasize(state, gold, math.log(4)), "emphasize"),
        "emphasize_2": recorded(ops.emphasize(state, gold, 2.0), "emphasize"),
        "scale_keys": recorded(ops.scale_keys(state, gold, 0.5), "scale_keys"),  # the same ids
    }
    other = kvedit.capture(model, tok, "A short unrelated text about the weather today.")
    llm = engine(model, root)
    out = {"block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    names, prompts, params = [], [], []

    def add(name, ids, named=None, logprobs=None, **entry):
        """A prompt of ``ids`` naming the digest ``named`` (None: names none); ``logprobs=0``
        asks vLLM for the log-probability of each token it answers."""
        names.append(name)
        prompts.append({"prompt_token_ids": list(ids)})
        extra = {"kv_transfer_params": {"kvedit": {"digest": named}}} if named else None
        params.append(
            SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, logprobs=logprobs, extra_args=extra
            )
        )
        out[name] = {"ids": list(entry.pop("published", ids)), **entry}

    for name, st in variants.items():
        ids, stock, _ = publish_stock(st, root, approximate=name == "emphasize_2")
        lps = 0 if name == "emphasize_2" else None
        add(
            name,
            ids + qids,
            ids.digest,
            logprobs=lps,
            state=st,
            stock=stock,
            published=ids,
            digest=ids.digest,
        )
    plain_ids = out["plain"]["ids"]
    # the plain prompt naming no digest, after the scale_keys edit of the same ids was
    # published into the same root: served from the plain capture
    add("no_digest", plain_ids + qids, state=state, published=plain_ids)
    # the plain state's ids alone: vLLM must compute one token, the last
    add("no_question", plain_ids, state=state, q="")
    # refused, each ending with an error: a digest that is not published, an edited cache's
    # ids alone (vLLM would compute its last slot from its id), another model's file, a
    # corrupt file
    add("unknown_digest", plain_ids + qids, "f" * 32, published=plain_ids)
    dup = out["duplicate"]
    add("whole_prompt", dup["ids"], dup["digest"])
    stock = dataclasses.replace(to_stock(other), model_fingerprint="0" * 32)
    publish(stock, root)
    add("mismatch", stock.token_ids + qids, state=other, published=stock.token_ids)
    # a file the scheduler accepts but a worker cannot load (a layer lost a KV head)
    broken = to_stock(kvedit.capture(model, tok, "Rivers run to the sea, mostly."))
    broken.keys[1], broken.values[1] = broken.keys[1][:, :2], broken.values[1][:, :2]
    publish(broken, root)
    add("load_fails", broken.token_ids + qids, published=broken.token_ids)
    bad = [1, *other.token_ids.tolist()[1:-1], 13]
    (root / files.file_name(bad, "0" * 32)).write_bytes(b"\x80\x04 not a safetensors file")
    add("corrupt", bad + qids, published=bad)
    for name, result in zip(names, llm.generate(prompts, params), strict=True):
        out[name]["vllm"] = result
    for name, entry in out.items():
        if isinstance(entry, dict) and "state" in entry and name != "mismatch":
            entry["kvedit"] = entry["state"].answer(entry.get("q", question), MAX_TOKENS)
    return out


EXACT = [
    "plain",
    "scale_keys",
    "duplicate",
    "suppress_full",
    "emphasize_log4",
    "no_digest",
    "no_question",
]


@pytest.mark.parametrize("name", EXACT)
def test_vllm_greedy_equals_kvedit_token_for_token(served, name):
    entry = served[name]
    got = entry["vllm"].outputs[0].token_ids
    want = entry["kvedit"].token_ids
    assert list(got[: len(want)]) == want, (entry["vllm"].outputs[0].text, entry["kvedit"].text)
    if "stock" in entry:
        assert entry["stock"].exact, entry["stock"].report()


@pytest.mark.parametrize(
    "name", ["plain", "duplicate", "suppress_full", "scale_keys", "emphasize_2", "no_digest"]
)
def test_every_published_token_is_served_from_the_file_the_request_names(served, name):
    entry = served[name]
    n = len(entry["ids"])
    assert entry["vllm"].num_cached_tokens == n
    got = entry["vllm"].kv_transfer_params["kvedit"]
    assert got["served"] == n
    assert got["digest"] == served["plain" if name == "no_digest" else name]["digest"]


def test_states_with_the_same_ids_are_served_from_their_own_files(served):
    """Before: one file per ids, so the plain request after a scale_keys publish was answered
    from the scale_keys cache, with an outcome no client could tell apart."""
    plain, scaled = served["no_digest"]["vllm"], served["scale_keys"]["vllm"]
    assert served["plain"]["ids"] == served["scale_keys"]["ids"]
    assert plain.kv_transfer_params["kvedit"]["file"] != scaled.kv_transfer_params["kvedit"]["file"]
    assert plain.outputs[0].token_ids != scaled.outputs[0].token_ids


def test_a_partial_last_block_is_served(served):
    n = len(served["plain"]["ids"])
    assert n % served["block_size"], "pick a prompt that does not fill whole blocks"
    assert served["plain"]["vllm"].num_cached_tokens == n


def test_a_prompt_of_published_ids_only_recomputes_the_last_token(served):
    entry = served["no_question"]
    assert entry["vllm"].num_cached_tokens == len(entry["ids"]) - 1


def test_the_edits_change_the_answer_in_vllm(served):
    """Guards against a connector that serves nothing: vLLM follows each edit where kvedit
    does, and at least one edit changes kvedit's answer."""
    plain = served["plain"]["vllm"].outputs[0].token_ids
    before = served["plain"]["kvedit"].token_ids
    changed = [n for n in EXACT[1:5] if served[n]["kvedit"].token_ids != before]
    assert {"scale_keys", "suppress_full"} <= set(changed)
    for name in changed:
        assert served[name]["vllm"].outputs[0].token_ids != plain


def test_emphasize_is_realised_by_the_nearest_copy_count(served, case):
    """A bias of 2.0 nats has no stock-kernel form: published with approximate=True it becomes
    6 extra copies of the passage (log 7 = 1.946 nats, the nearest count), labelled, and vLLM
    then answers as kvedit answers from the passage duplicated 6 times: the same tokens, with
    the same log-probabilities (not those of the exact 2.0 nats)."""
    _, _, state, question, gold = case
    entry = served["emphasize_2"]
    (r,) = {(x.asked, x.realized, x.copies) for x in entry["stock"].realizations}
    assert r == (2.0, pytest.approx(math.log(7)), 6)
    assert not entry["stock"].exact  # published only when asked, and labelled:
    assert entry["stock"].history.steps[-1].kind == "approximation"
    assert entry["digest"] != entry["state"].digest
    # the file vLLM served holds the 6 copies: 6 more slots per token of the passage
    n_gold = state.token_indices(gold).numel()
    assert len(entry["ids"]) == len(served["plain"]["ids"]) + 6 * n_gold
    assert entry["vllm"].num_cached_tokens == len(entry["ids"])
    assert entry["vllm"].kv_transfer_params["kvedit"]["digest"] == entry["digest"]
    copies = kvedit.ops.duplicate(state, gold, 6).answer(question, MAX_TOKENS)
    out = entry["vllm"].outputs[0]
    got = list(out.token_ids)
    assert got[: len(copies.token_ids)] == copies.token_ids, (out.text, copies.text)
    # with the 6 copies' log-probabilities, which tell them from other edits that would
    # give the same tokens: the plain state, 3 copies, the exact bias of 2.0 nats
    got_lps = torch.tensor([step[t].logprob for step, t in zip(out.logprobs, got, strict=True)])
    got_lps = got_lps[: len(copies.token_ids)]
    torch.testing.assert_close(got_lps, torch.tensor(copies.logprobs), atol=2e-4, rtol=0)
    for other in ("plain", "duplicate", "emphasize_2"):
        theirs = served[other]["kvedit"]  # (here all of them give the same tokens)
        if theirs.token_ids == copies.token_ids:
            assert (got_lps - torch.tensor(theirs.logprobs)).abs().max() > 2e-3, other


@pytest.mark.parametrize(
    "name,reason",
    [
        ("mismatch", "mismatch"),
        ("corrupt", "corrupt"),
        ("unknown_digest", "unknown-digest"),
        ("whole_prompt", "whole-prompt"),
    ],
)
def test_what_cannot_be_served_is_refused_with_an_error(served, name, reason):
    """load_failure="fail" (engine's default): a refused file, a digest that is not there and
    an edited cache's ids alone end the request with an error, not with vLLM's answer to the
    published ids read as text."""
    out = served[name]["vllm"]
    assert out.outputs[0].finish_reason == "error"
    if out.kv_transfer_params is not None:  # vLLM 0.32 returns none for a failed request
        assert out.kv_transfer_params["kvedit"]["refused"] == reason
    assert not out.outputs[0].token_ids


def test_a_cache_a_worker_cannot_load_fails_the_request(served):
    """engine's default load_failure="fail": no answer from vLLM's own reading of the ids."""
    out = served["load_fails"]["vllm"]
    assert out.outputs[0].finish_reason == "error"
    assert not out.outputs[0].token_ids
