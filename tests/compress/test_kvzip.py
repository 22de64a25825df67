"""The ``kvzip`` scorer (KVzip's chunk-local scores) and ``rank_keep`` (one ranking across
layers), kvedit.compress."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit.compress import SCORERS, select
from kvedit.compress.allocation import rank_keep
from kvedit.compress.scorers import kvzip as kvzip_module
from kvedit.compress.scorers.kvzip import SINKS, KVzip
from kvedit.compress.scorers.reconstruct import DEFAULT_PROMPT as REPEAT
from kvedit.errors import InvalidInputError

TEXT = " ".join(f"Person{i}'s code is {1000 + 37 * i}." for i in range(6))


def _state(pair):
    model, tok = pair
    return kvedit.capture(model, tok, TEXT)


def _eager_reference(pair, state, start, end):
    """Per layer ``[heads, end - start]``: one eager forward of the text, the prompt and the
    chunk's ids again; each re-read query's attention renormalized over the sinks, the chunk
    and the re-read's own keys; the largest over the re-read queries."""
    model, tok = pair
    prompt = tok(REPEAT, add_special_tokens=False)["input_ids"]
    ids = state.token_ids.tolist()
    run = ids + prompt + ids[start:end]
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([run]), output_attentions=True)
    finally:
        model.set_attn_implementation(before)
    n, first = len(ids), len(ids) + len(prompt)
    keep = torch.zeros(len(run), dtype=torch.bool)
    keep[: min(SINKS, start)] = True
    keep[start:end] = True
    keep[n:] = True
    refs = []
    for att in out.attentions:
        p = att[0, :, first:, :].float() * keep  # [heads, q, k]
        p = p / p.sum(-1, keepdim=True)
        refs.append(p[..., start:end].amax(dim=1))
    return refs


@pytest.mark.parametrize("chunk", [(0, 12), (7, 30)])
def test_scores_match_one_eager_pass(llama, chunk):
    state = _state(llama)
    start, end = chunk
    got = KVzip().score_tokens(state, start, end, list(state.global_layers))
    refs = _eager_reference(llama, state, start, end)
    for i, s in got.items():
        kv = state.layers[i].kv_shape[1]
        want = refs[i].reshape(kv, -1, end - start).amax(dim=1)
        torch.testing.assert_close(s[0], want, rtol=1e-4, atol=1e-5)
        assert (s > 0).all() and (s <= 1).all()


def test_scores_do_not_depend_on_the_queries_run_at_once(llama, monkeypatch):
    state = _state(llama)
    layers = list(state.global_layers)
    whole = KVzip().score_tokens(state, 3, 25, layers)
    monkeypatch.setattr(kvzip_module, "QUERIES", 4)
    parts = KVzip().score_tokens(state, 3, 25, layers)
    for i in layers:
        torch.testing.assert_close(parts[i], whole[i], rtol=1e-5, atol=1e-6)


def test_a_whole_state_is_scored_chunk_by_chunk(llama):
    state = _state(llama)
    layers = list(state.global_layers)
    scores = KVzip(chunk=10).score(state, layers)
    n = len(state)
    for start in range(0, n, 10):
        part = KVzip().score_tokens(state, start, min(n, start + 10), layers)
        for i in layers:
            torch.testing.assert_close(scores[i][..., start : min(n, start + 10)], part[i])


def test_a_headwise_layer_normalizes_over_each_heads_own_sinks(llama):
    """A headwise layer's heads hold the sinks in different slots (its shared token_index
    names none of them): each head's re-read is still normalized over its own sinks. Head 0
    holds every entry, head 1 one fewer: head 0's scores on the first layer (whose input is the
    same) are the dense layer's."""
    from kvedit.cache import is_headwise, keep_per_head

    state = _state(llama)
    n = len(state)
    kept = torch.ones(state.layers[0].kv_shape[1], n, dtype=torch.bool)
    kept[1, 10] = False  # not a sink: head 1's sinks move one slot right
    layers = list(state.layers)
    layers[0] = keep_per_head(layers[0], kept)
    assert is_headwise(layers[0]) and not (layers[0].token_index[:SINKS] >= 0).any()
    dense = KVzip().score_tokens(state, n - 8, n, [0])[0]
    headwise = KVzip().score_tokens(state.replace(layers=layers), n - 8, n, [0])[0]
    torch.testing.assert_close(headwise[:, 0], dense[:, 0], rtol=1e-4, atol=1e-6)


def test_registered_and_selects(llama):
    assert SCORERS["kvzip"] is KVzip
    state = _state(llama)
    small = select(state, "kvzip", 0.5)
    assert small.nbytes < state.nbytes
    with pytest.raises(InvalidInputError, match="not in the"):
        KVzip().score_tokens(state, 5, 5, [0])
    with pytest.raises(InvalidInputError):
        KVzip(chunk=0)


def test_rank_keep_one_ranking_across_layers():
    scores = {0: torch.tensor([[0.9, 0.1, 0.8, 0.2]]), 1: torch.tensor([[0.3, 0.7, 0.05, 0.6]])}
    must = {0: torch.tensor([True, False, False, False]), 1: torch.zeros(4, dtype=torch.bool)}
    cost = {0: 1.0, 1: 1.0}
    kept = rank_keep(scores, must, 4, cost)
    # the protected entry, then 0.8, 0.7, 0.6: layer 1 keeps more than layer 0
    assert kept[0].tolist() == [True, False, True, False]
    assert kept[1].tolist() == [False, True, False, True]
    # a layer whose entries cost twice as much: the budget buys fewer of them
    kept = rank_keep(scores, must, 4, {0: 1.0, 1: 2.0})
    assert int(kept[0].sum()) + 2 * int(kept[1].sum()) <= 4
    with pytest.raises(InvalidInputError, match="protected"):
        rank_keep(scores, must, 0.5, cost)


def test_rank_keep_per_head():
    scores = {0: torch.tensor([[0.9, 0.1, 0.2], [0.1, 0.8, 0.3]])}
    must = {0: torch.zeros(3, dtype=torch.bool)}
    kept = rank_keep(scores, must, 2, {0: 2.0}, per_head=True)  # 2 head-entries of cost 1
    assert kept[0].tolist() == [[True, False, False], [False, True, False]]
    uniform = rank_keep(scores, must, 2, {0: 2.0})  # one token on both heads
    assert uniform[0].tolist() == [True, False, False]


def _fit_for(pair, state, seed=0):
    """A random learned-scorer fit for ``pair``'s model (the maps' values do not matter)."""
    from kvedit.compress.scorers.learned import Fitted, entry_features
    from kvedit.fingerprint import model_fingerprint

    g = torch.Generator().manual_seed(seed)
    layers = {}
    for i in state.global_layers:
        f = entry_features(state, i).shape[1]
        kv = state.layers[i].kv_shape[1]
        layers[i] = (
            torch.randn(f, generator=g),
            torch.rand(f, generator=g) + 0.5,
            torch.randn(f, kv, generator=g),
            torch.randn(kv, generator=g),
        )
    return Fitted(layers, {"model": model_fingerprint(pair[0]), "model_name": "tiny"})


def test_learned_scores_from_the_entries_alone(llama, gemma3, tmp_path):
    from kvedit.compress.scorers.learned import Fitted, Learned
    from kvedit.errors import CacheMismatchError, CorruptCacheError

    state = _state(llama)
    path = _fit_for(llama, state).save(tmp_path / "fit.safetensors")
    again = Fitted.load(path)
    assert again.meta["model_name"] == "tiny"
    scorer = Learned(path=str(path))
    layers = list(state.global_layers)
    scores = scorer.score(state, layers)
    for i in layers:
        assert scores[i].shape == (*state.layers[i].kv_shape[:2], len(state.layers[i]))
    part = scorer.score_tokens(state, 4, 20, layers)
    for i in layers:  # an entry's score is its own: the same alone as with the others
        torch.testing.assert_close(part[i], scores[i][..., 4:20], rtol=1e-5, atol=1e-5)
    # the key's rotation is undone: the same entries moved to other positions score the same
    import dataclasses

    from kvedit.rope import movers

    model, _ = llama
    layers_moved = list(state.layers)
    for i in layers:
        layer = state.layers[i]
        delta = torch.full((len(layer),), 9)
        keys = movers(model)[i].move(layer.keys, delta)
        layers_moved[i] = dataclasses.replace(layer, keys=keys, positions=layer.positions + 9)
    other = scorer.score(state.replace(layers=layers_moved), layers)
    for i in layers:
        torch.testing.assert_close(other[i], scores[i], rtol=1e-3, atol=1e-3)
    with pytest.raises(CacheMismatchError, match="another model"):
        Learned(path=str(path)).score(_state(gemma3), list(_state(gemma3).global_layers))
    (tmp_path / "bad.safetensors").write_bytes(b"not a fit")
    with pytest.raises(CorruptCacheError, match="bad.safetensors"):
        Learned(path=str(tmp_path / "bad.safetensors")).score(state, layers)
    with pytest.raises(InvalidInputError, match="fit-scorer"):
        Learned().score(state, layers)  # no fit ships for a tiny random model


def test_a_fit_replaced_under_the_same_times_is_read_again(llama, tmp_path, monkeypatch):
    """fitted_for reads a fit once per file version: a file replaced by another fit is read
    again, even when the new one carries the old one's modification time and size (``cp -p``,
    ``rsync -t``, a coarse clock); for a given path and for the fits it finds itself."""
    import os

    from kvedit.compress.scorers.learned import USER_DIR, fitted_for

    monkeypatch.setenv("KVEDIT_CACHE", str(tmp_path / "cache"))
    model, state = llama[0], _state(llama)
    path = tmp_path / "cache" / USER_DIR / "fit.safetensors"
    path.parent.mkdir(parents=True)
    for given in (path, None):
        _fit_for(llama, state, seed=0).save(path)
        first = fitted_for(model, given)
        old = path.stat()
        _fit_for(llama, state, seed=1).save(path)
        os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
        assert path.stat().st_size == old.st_size
        again = fitted_for(model, given)
        assert not torch.equal(again.layers[0][2], first.layers[0][2])


def test_a_fit_predicts_on_the_device_of_the_features(llama):
    """A fit's maps are read on the CPU; the features come from the cache's device (a GPU's
    for a model there): predict follows the features (the meta device stands in for a GPU)."""
    from kvedit.compress.scorers.learned import entry_features

    state = _state(llama)
    fit, i = _fit_for(llama, state), state.global_layers[0]
    features = entry_features(state, i)
    got = fit.predict(i, features.to("meta"))
    assert got.device.type == "meta" and got.shape == fit.predict(i, features).shape


@pytest.mark.parametrize("part, value", [(2, float("nan")), (3, float("inf")), (1, 0.0)])
def test_a_fit_that_is_not_finite_is_refused(llama, tmp_path, part, value):
    """A map with a NaN, an infinity or a zero scale scores entries NaN (or infinite): a round
    reads a NaN score as padding and never keeps the entry, so a head forgot all but its
    protected entries without a word. Such a fit is refused as damaged."""
    from kvedit.compress.scorers.learned import Fitted
    from kvedit.errors import CorruptCacheError

    state = _state(llama)
    fit = _fit_for(llama, state)
    i = state.global_layers[0]
    bad = [t.clone() for t in fit.layers[i]]
    bad[part].view(-1)[0] = value
    path = Fitted({**fit.layers, i: tuple(bad)}, fit.meta).save(tmp_path / "bad.safetensors")
    with pytest.raises(CorruptCacheError, match="not finite"):
        Fitted.load(path)
