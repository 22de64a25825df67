"""Published caches addressed by content, and the one rule for what vLLM serves: no vLLM needed.

* Files are named by their token ids *and* the state's digest (:mod:`kvedit.integrations.vllm.
  files`): a plain capture and an edit that keeps its ids (``scale_keys``) published into one
  root never replace each other, and the index finds each by its digest.
* The rule (:mod:`kvedit.integrations.vllm.servable`), applied by ``publish``: exact is served;
  approximate only with ``approximate=True``, labelled by a ``Step("approximation", ...)`` in
  the state's history (hence in its digest and the file's name); an edit nothing of which is
  realised is refused even then. Nothing is written when it refuses.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import kvedit
from kvedit.errors import InvalidInputError
from kvedit.integrations.vllm import files, kv_transfer_params, publish, publish_stock, to_stock
from kvedit.integrations.vllm.servable import check, judge, label, realize
from kvedit.integrations.vllm.stock import BiasRealization, StockCache
from kvedit.provenance import Step

TEXT = (
    "Alice's secret number is 4821. Bob's secret number is 7310. Carol's secret number is 5902. "
    "Eve Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil Trent Victor Walter."
)
SPAN = "Bob's secret number is 7310."


def scaled(state: kvedit.KVState) -> kvedit.KVState:
    """``scale_keys`` on SPAN: the plain state's ids, another digest (the step is recorded by
    the op; added here if this checkout's op does not record it yet)."""
    out = kvedit.ops.scale_keys(state, SPAN, 0.5)
    if out.is_plain_capture:
        out = out.with_step(Step("edit", "scale_keys", {"factor": 0.5}))
    return out


def published(root) -> list[str]:
    return sorted(p.name for p in root.glob("*.safetensors"))


@pytest.fixture(scope="module")
def plain(llama):
    model, tok = llama
    return kvedit.capture(model, tok, TEXT)


# ---------------------------------------------------------------- addressed by content


def test_states_with_the_same_ids_and_other_digests_never_replace_each_other(plain, tmp_path):
    edited = scaled(plain)
    a = publish(plain, tmp_path)
    b = publish(edited, tmp_path)
    assert list(a) == list(b) and a.digest != b.digest
    assert (a.digest, b.digest) == (plain.digest, edited.digest)
    assert published(tmp_path) == sorted(
        [files.file_name(a, a.digest), files.file_name(b, b.digest)]
    )
    for ids, state in ((a, plain), (b, edited)):  # each file holds its own state's cache
        meta, tensors = files.read(ids.path)
        assert meta["digest"] == ids.digest == files.digest_of(ids.path)
        assert torch.equal(tensors["layer.1.keys"], to_stock(state).keys[1])
        assert meta["history"] == json.loads(json.dumps(state.history.to_json()))
    assert a.plain_capture and not b.plain_capture
    publish(plain, tmp_path)  # the same state again replaces its own file only
    assert len(published(tmp_path)) == 2


def test_the_index_finds_a_file_by_digest_and_lists_every_digest_of_a_prefix(plain, tmp_path):
    a = publish(plain, tmp_path)
    b = publish(scaled(plain), tmp_path)
    index = files.PublishedIndex(tmp_path)
    prompt = list(a) + [5, 6, 7]
    assert index.find(prompt, a.digest) == (a.path, len(a))
    assert index.find(prompt, b.digest) == (b.path, len(a))
    assert index.find(prompt, "f" * 32) is None  # a digest that is not there
    assert index.find([5, *prompt], a.digest) is None  # the ids must start the prompt
    assert index.candidates(prompt) == (len(a), {a.digest: a.path, b.digest: b.path})
    assert index.candidates(prompt[: len(a) - 1]) is None


def test_a_request_names_the_digest_it_wants(plain, tmp_path):
    ids = publish(plain, tmp_path)
    assert ids.kv_transfer_params == {"kvedit": {"digest": plain.digest}}
    assert ids.sampling_extra_args() == {"kv_transfer_params": ids.kv_transfer_params}
    assert kv_transfer_params(plain.digest) == ids.kv_transfer_params
    assert ids + [1] == [*list(ids), 1] and json.loads(json.dumps(ids)) == list(ids)


@pytest.mark.parametrize("bad", ["", "A" * 32, "0" * 31, "0" * 32 + "/", None, 7])
def test_a_malformed_digest_is_refused(bad):
    with pytest.raises(InvalidInputError, match="32 lowercase hex"):
        files.check_digest(bad)


def test_a_cache_built_by_hand_gets_a_digest_of_its_contents(plain, tmp_path):
    stock = dataclasses.replace(to_stock(plain), digest="", history=None)
    path = files.write(stock, tmp_path, "x")
    stock.keys[0] = stock.keys[0] * 2
    other = files.write(stock, tmp_path, "x")
    assert path != other and files.read_header(path)["plain_capture"] is False


# ---------------------------------------------------------------- the rule


def test_an_edit_realised_exactly_is_published_unlabelled(plain, tmp_path):
    state = kvedit.ops.emphasize(plain, SPAN, math.log(4))  # 3 copies: exact
    ids, stock, _ = publish_stock(state, tmp_path)
    assert stock.exact and ids.exact and ids.digest == state.digest
    assert judge(stock).label == "exact"


def test_an_approximate_realisation_is_refused_unless_asked(plain, tmp_path):
    state = kvedit.ops.emphasize(plain, SPAN, 2.0)  # 6 copies = 1.946 nats
    with pytest.raises(InvalidInputError, match=r"only approximately.*approximate=True"):
        publish(state, tmp_path)
    assert not published(tmp_path)


def test_an_approximation_asked_for_is_labelled_in_the_history(plain, tmp_path):
    state = kvedit.ops.emphasize(plain, SPAN, 2.0)
    ids, stock, path = publish_stock(state, tmp_path, approximate=True)
    labelled, _ = realize(state, approximate=True)
    step = labelled.history.steps[-1]
    assert (step.kind, step.name, step.exact) == ("approximation", "vllm", False)
    assert step.params["approximate_biases"] > 0 and step.params["max_error_nats"] > 0.05
    assert ids.digest == labelled.digest != state.digest and not ids.exact
    meta = files.read_header(path)
    assert meta["history"]["steps"][-1]["kind"] == "approximation"
    assert meta["digest"] == ids.digest and meta["exact"] is False
    assert stock.history == labelled.history


def test_labelling_returns_a_new_stock_cache_and_leaves_its_input_as_it_was(plain):
    state = kvedit.ops.emphasize(plain, SPAN, 2.0)
    stock = to_stock(state)
    digest, history = stock.digest, stock.history
    labelled, named = label(state, stock)
    assert named is not stock and (stock.digest, stock.history) == (digest, history)
    assert (named.digest, named.history) == (labelled.digest, labelled.history)
    assert named.digest != digest and named.keys is stock.keys  # the rest is shared
    assert label(labelled, named)[0] is labelled  # already labelled: kept


def test_a_stock_cache_is_frozen():
    k = torch.zeros(3, 1, 2)
    stock = StockCache([1, 2, 3], [k], [k], [None], 3, 0)
    for name in ("digest", "history", "keys", "token_ids", "shift"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(stock, name, None)
    assert stock.digest == "" and stock.history is None and stock.shift == 0


def test_per_layer_strengths_are_an_approximation(plain, tmp_path):
    """focus asks layers for different biases; vLLM gives every global layer one copy count,
    layers left at 0 on purpose included: not exact, so refused unless asked."""
    n = len(plain.layers)
    state = kvedit.ops.emphasize(plain, SPAN, [math.log(3)] + [0.0] * (n - 1))
    with pytest.raises(InvalidInputError, match="only approximately"):
        publish(state, tmp_path)
    verdict = judge(to_stock(state))
    assert verdict.realisable and any(r.asked == 0 for r in verdict.approximate)
    assert publish(state, tmp_path, approximate=True).exact is False


def test_biases_dropped_on_sliding_layers_are_an_approximation(gemma3, tmp_path):
    model, tok = gemma3
    state = kvedit.capture(model, tok, TEXT)  # the span in the sliding layers' window too
    state = kvedit.ops.emphasize(state, "Victor Walter.", math.log(4))
    verdict = judge(to_stock(state))
    sliding = {i for i, layer in enumerate(state.layers) if layer.window is not None}
    assert sliding and {r.layer for r in verdict.lost} == sliding and verdict.realisable
    with pytest.raises(InvalidInputError, match=r"left out on layers"):
        publish(state, tmp_path)
    ids = publish(state, tmp_path, approximate=True)
    step = files.read_header(ids.path)["history"]["steps"][-1]
    assert step["params"]["lost_layers"] == sorted(sliding)


@pytest.mark.parametrize("approximate", [False, True])
def test_an_edit_nothing_of_which_is_realised_is_refused_even_when_asked(
    plain, tmp_path, approximate
):
    state = kvedit.ops.suppress(plain, SPAN, 2.0)  # no per-key bias on vLLM: nothing realised
    with pytest.raises(InvalidInputError, match=r"cannot be served.*remove_at=2") as err:
        publish(state, tmp_path, approximate=approximate)
    assert "[-2.0]" in str(err.value)
    with pytest.raises(InvalidInputError, match="log 1.5"):
        publish(kvedit.ops.emphasize(plain, SPAN, 0.3), tmp_path, approximate=approximate)
    assert not published(tmp_path)
    # what the refusal suggests: a removal, asked for as an approximation
    ids = publish(state, tmp_path, remove_at=2.0, approximate=True)
    assert not ids.exact and len(ids) < len(plain)


def test_a_stock_cache_is_published_by_the_same_rule(plain, tmp_path):
    raw = to_stock(kvedit.ops.emphasize(plain, SPAN, 2.0))  # approximate, unlabelled
    with pytest.raises(InvalidInputError, match="only approximately"):
        publish(raw, tmp_path)
    with pytest.raises(InvalidInputError, match="no approximation label"):
        publish(raw, tmp_path, approximate=True)
    _, stock = realize(kvedit.ops.emphasize(plain, SPAN, 2.0), approximate=True)
    assert publish(stock, tmp_path, approximate=True).digest == stock.digest
    assert len(published(tmp_path)) == 1


def test_judge_reads_the_realisations_alone():
    def cache(*rs, nulls=0):
        k = torch.zeros(3, 1, 2)
        return StockCache([1, 2, 3], [k], [k], [None], 3, 0, list(rs), [nulls])

    exact = BiasRealization(0, math.log(4), math.log(4), "copies", 1, 3)
    near = BiasRealization(0, 2.0, math.log(7), "copies", 1, 6)
    lost = BiasRealization(1, -2.0, 0.0, "unrealized", 1)
    zero = BiasRealization(0, 0.3, 0.0, "copies", 1, 0)
    assert judge(cache()).label == "exact" and judge(cache(exact)).label == "exact"
    assert judge(cache(exact, lost)).label == "approximate"
    assert judge(cache(near)).label == "approximate"
    assert judge(cache(exact, nulls=2)).label == "approximate"
    assert judge(cache(lost)).label == "not realisable"
    assert judge(cache(lost, zero)).label == "not realisable"
    assert check(cache(near), approximate=True).approximate == (near,)
    with pytest.raises(InvalidInputError):
        check(cache(lost), approximate=True)
