"""Cross-model KV projection (kvedit.project) and its evaluation, on tiny random models."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvedit import LayerKV, capture
from kvedit.errors import CacheMismatchError, CorruptCacheError, InvalidInputError
from kvedit.evals import project as evproj
from kvedit.evals.tasks import load_nq
from kvedit.project import Projector, align_tokens, depth_matched_layers, stacked_inv_freq
from kvedit.states.passes import run_model
from kvedit.testing import TINY_SLIDING_WINDOW, tiny_model

N_FIT = 24


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3")


@pytest.fixture(scope="module")
def fit_texts():
    return evproj.fit_texts(N_FIT)


@pytest.fixture(scope="module")
def identity(llama, fit_texts):
    model, tok = llama
    return Projector.fit(model, tok, model, tok, fit_texts)


@pytest.fixture(scope="module")
def cross(llama, gemma, fit_texts):
    return Projector.fit(*llama, *gemma, fit_texts)


@pytest.fixture(scope="module")
def heldout_text():
    return evproj.passage_text(load_nq()[2000])


def _r2(truth: torch.Tensor, pred: torch.Tensor) -> float:
    truth, pred = truth.double(), pred.double()
    sst = ((truth - truth.mean(dim=2, keepdim=True)) ** 2).sum()
    return float(1 - ((truth - pred) ** 2).sum() / sst)


# ------------------------------------------------------------------------------ helpers


def test_align_tokens_by_last_character():
    # A: "ab" "c" " d" and two byte pieces of one character; B: BOS "abc" " " "d" and three
    # pieces of that character.
    a = torch.tensor([[0, 2], [2, 3], [3, 5], [5, 6], [5, 6]])
    b = torch.tensor([[0, 0], [0, 3], [3, 4], [4, 5], [5, 6], [5, 6], [5, 6]])
    out = align_tokens(b, a)
    # BOS: none; "abc" -> "c" (holds char 2); " " -> " d" (starts at 3); "d" -> " d";
    # three pieces of char 5 -> A's two pieces in order, then the last.
    assert out.tolist() == [-1, 1, 2, 2, 3, 4, 4]
    assert align_tokens(b, a, special_b=[False, True, *[False] * 5]).tolist()[1] == -1


def test_align_tokens_gap_and_specials_in_a():
    a = torch.tensor([[0, 0], [0, 3], [5, 8]])  # A has a BOS and skips characters 3-4
    b = torch.tensor([[0, 2], [2, 4], [4, 6], [6, 8]])
    assert align_tokens(b, a).tolist() == [1, 1, 2, 2]


def test_identical_tokenizers_align_one_to_one(llama, heldout_text):
    _, tok = llama
    enc = tok(heldout_text + " Röntgen—Skłodowska 日本", return_offsets_mapping=True)
    offsets = torch.tensor(enc["offset_mapping"])
    out = align_tokens(offsets, offsets)
    assert out[0] == -1 and out[1:].tolist() == list(range(1, len(offsets)))


def test_depth_matched_layers():
    groups = depth_matched_layers(30, 18, 3)
    assert len(groups) == 18 and all(len(g) == 3 for g in groups)
    assert groups[0] == [0, 1, 2] and groups[-1] == [27, 28, 29]
    assert all(a[0] <= b[0] for a, b in zip(groups, groups[1:]))
    assert depth_matched_layers(3, 3, 1) == [[0], [1], [2]]
    assert depth_matched_layers(2, 4, 5) == [[0, 1]] * 4


def test_layer_inv_freq_per_layer_type(gemma):
    model, _ = gemma
    inv = stacked_inv_freq(model)
    assert inv.shape == (4, 16)
    # Gemma-3: sliding layers use base 10k, the global layer 1M.
    assert torch.equal(inv[0], inv[1]) and not torch.equal(inv[0], inv[2])


# ------------------------------------------------------------------------------ projection


def test_identity_projector_reproduces_the_cache(llama, identity, heldout_text):
    model, tok = llama
    state = capture(model, tok, heldout_text)
    projected = identity(state, model, tok)
    assert projected.token_ids.tolist() == state.token_ids.tolist()
    for truth, got in zip(state.layers, projected.layers, strict=True):
        assert _r2(truth.keys, got.keys) > 0.99
        assert _r2(truth.values, got.values) > 0.99
        assert got.positions.tolist() == truth.positions.tolist()
    for layer in identity.info["layers"]:
        assert layer["heldout_r2_keys"] > 0.99 and layer["heldout_r2_values"] > 0.99
    assert torch.allclose(projected.last_logits, state.last_logits, atol=1e-2)
    assert projected.generate(" The", max_new_tokens=6) == state.generate(" The", 6)


def test_a_projected_state_says_so_and_the_store_refuses_it(tmp_path, llama, identity):
    """A projection is dense, unbiased, at positions 0..n-1, so its tensors look like a capture;
    its history's origin is a projection (source model, source state's digest, projector), so
    its digest is not the capture's and KVStore.put refuses it, naming the projection."""
    from kvedit import KVStore, ops

    model, tok = llama
    text = "Carol's secret number is 5902. Bob's secret number is 7310."
    state = capture(model, tok, text)
    projected = identity(state, model, tok)
    origin = projected.history.origin
    assert origin.kind == "projection" and not projected.is_plain_capture
    assert origin.params["source_model"] == state.model_fingerprint
    assert origin.params["source"] == state.digest
    assert origin.params["projector"] == identity.digest
    assert "projection" in repr(projected) and "projection" in projected.explain()
    assert projected.digest != state.digest
    again = identity(capture(model, tok, text), model, tok)
    assert again.digest == projected.digest  # the same content, the same name
    edited = identity(ops.scale_keys(state, "Carol", 1.5), model, tok)
    assert edited.digest != projected.digest  # another source: another name
    with pytest.raises(InvalidInputError, match="projection"):
        KVStore(tmp_path).put(projected)


def test_cross_projection_state_for_model_b(llama, gemma, cross, heldout_text):
    (model_a, tok_a), (model_b, tok_b) = llama, gemma
    state_a = capture(model_a, tok_a, heldout_text)
    state = cross(state_a, model_b, tok_b)
    own = capture(model_b, tok_b, heldout_text)
    assert state.model_fingerprint == own.model_fingerprint
    assert state.tokenizer_fingerprint == own.tokenizer_fingerprint
    assert state.token_ids.tolist() == own.token_ids.tolist()
    assert torch.equal(state.offsets, own.offsets)
    assert len(state) > TINY_SLIDING_WINDOW
    for got, ref in zip(state.layers, own.layers, strict=True):
        assert got.window == ref.window
        assert got.keys.shape == ref.keys.shape and got.values.shape == ref.values.shape
        assert got.token_index.tolist() == ref.token_index.tolist()
        assert got.positions.tolist() == ref.positions.tolist()
    global_layer = state.layers[2]
    assert global_layer.window is None
    # The BOS entry (no counterpart in A, nothing before it) is B's own, exactly.
    assert torch.allclose(global_layer.keys[:, :, 0], own.layers[2].keys[:, :, 0], atol=1e-5)
    assert torch.allclose(global_layer.values[:, :, 0], own.layers[2].values[:, :, 0], atol=1e-5)
    # last_logits are B's prediction after the projected prefix: B re-running the last token
    # on top of the projected entries before it gives them again (a text shorter than the
    # window, so no layer dropped an entry the last token saw).
    short = cross(capture(model_a, tok_a, heldout_text[:12]), model_b, tok_b)
    n = len(short)
    assert n < TINY_SLIDING_WINDOW
    before = [
        LayerKV(
            keys=layer.keys[:, :, :-1],
            values=layer.values[:, :, :-1],
            token_index=layer.token_index[:-1],
            positions=layer.positions[:-1],
            window=layer.window,
        )
        for layer in short.layers
    ]
    logits, full_kv = run_model(
        model_b, before, short.token_ids[-1:][None], torch.tensor([[n - 1]]), logits_to_keep=1
    )
    assert torch.allclose(logits[0, -1], short.last_logits, atol=1e-4)
    assert torch.allclose(full_kv[2][0], short.layers[2].keys, atol=1e-5)
    # The projected entries carry B's K/V of this text: on the global layer they explain a good
    # part of B's own keys and values (R² against each channel's mean over the text; a map that
    # ignores A, misaligns tokens or puts B's RoPE at the wrong positions gets <= 0).
    mid = slice(1, -1)  # projected entries: not the BOS or the last token, which B computes
    for part in ("keys", "values"):
        truth = getattr(own.layers[2], part)[:, :, mid]
        assert _r2(truth, getattr(global_layer, part)[:, :, mid]) > 0.2, part
    # B continues from the projected cache with this text's content: its next-token
    # distributions over a continuation are closer (KL) to those after B's own cache than after
    # the projection of another passage (the same form, other content) or after no prefix.
    cont = " the capital of France"
    rows = state.logits(cont)
    assert rows.shape[0] == len(tok_b(cont, add_special_tokens=False)["input_ids"])
    ref = own.logits(cont).float().log_softmax(-1)

    def kl_from_own(other_state) -> float:
        logp = other_state.logits(cont).float().log_softmax(-1)
        return float((ref.exp() * (ref - logp)).sum(-1).mean())

    other_text = evproj.passage_text(load_nq()[2001])
    assert other_text != heldout_text
    other = cross(capture(model_a, tok_a, other_text), model_b, tok_b)
    none = capture(model_b, tok_b, "")  # B's BOS alone
    kl_proj = kl_from_own(state)
    assert kl_proj < 0.95 * kl_from_own(other)
    assert kl_proj < 0.8 * kl_from_own(none)


def test_own_last_tokens_are_computed_by_b(llama, gemma, cross, heldout_text):
    (model_a, tok_a), (model_b, tok_b) = llama, gemma
    state_a = capture(model_a, tok_a, heldout_text[:60])
    one = cross(state_a, model_b, tok_b)
    three = cross(state_a, model_b, tok_b, own_last=3)
    g = 2  # the global layer holds every token
    assert torch.equal(one.layers[g].keys[:, :, :-3], three.layers[g].keys[:, :, :-3])
    assert not torch.allclose(one.layers[g].keys[:, :, -3], three.layers[g].keys[:, :, -3])
    with pytest.raises(InvalidInputError, match="own_last"):
        cross(state_a, model_b, tok_b, own_last=0)


def test_wrong_model_pair_raises(llama, gemma, cross, heldout_text):
    (model_a, tok_a), (model_b, tok_b) = llama, gemma
    qwen, qtok = tiny_model("qwen2")
    with pytest.raises(CacheMismatchError, match="model A"):
        cross(capture(qwen, qtok, heldout_text), model_b, tok_b)
    state_a = capture(model_a, tok_a, heldout_text)
    other_b, _ = tiny_model("gemma3", seed=1)
    with pytest.raises(CacheMismatchError, match="model B"):
        cross(state_a, other_b, tok_b)
    with pytest.raises(CacheMismatchError):  # A and B swapped
        cross(capture(model_b, tok_b, heldout_text), model_a, tok_a)


def test_save_load_roundtrip(tmp_path, llama, gemma, cross, heldout_text):
    (model_a, tok_a), (model_b, tok_b) = llama, gemma
    path = cross.save(tmp_path / "p.safetensors")
    assert path.read_bytes()[:1] != b"\x80"
    loaded = Projector.load(path)
    assert loaded.a_layers == cross.a_layers and loaded.b_windows == cross.b_windows
    assert loaded.info["layers"] == cross.info["layers"]
    state_a = capture(model_a, tok_a, heldout_text)
    x, y = cross(state_a, model_b, tok_b), loaded(state_a, model_b, tok_b)
    for a, b in zip(x.layers, y.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(x.last_logits, y.last_logits)
    assert not list(tmp_path.glob(".*tmp"))  # atomic: no temporary file left


def test_load_rejects_corrupt_and_pickled_files(tmp_path, cross):
    path = cross.save(tmp_path / "p.safetensors")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptCacheError, match="checksum"):
        Projector.load(bad)
    truncated = tmp_path / "short.safetensors"
    truncated.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptCacheError):
        Projector.load(truncated)
    pickled = tmp_path / "p.pt"
    torch.save({"w": torch.zeros(2)}, pickled)
    with pytest.raises(CorruptCacheError):
        Projector.load(pickled)


def test_fit_progress_bar(capsys, llama, fit_texts):
    model, tok = llama
    Projector.fit(model, tok, model, tok, fit_texts[:12], progress=True)
    assert "projector fit" in capsys.readouterr().err
    Projector.fit(model, tok, model, tok, fit_texts[:12])
    assert capsys.readouterr().err == ""


def test_fit_needs_heldout_text(llama, fit_texts):
    model, tok = llama
    with pytest.raises(InvalidInputError, match="held-out"):
        Projector.fit(model, tok, model, tok, fit_texts[:3])
    with pytest.raises(InvalidInputError, match="no calibration text"):
        Projector.fit(model, tok, model, tok, ["", ""])
    for bad in ({"depth_window": 0}, {"heldout_every": 1}, {"lambdas": ()}, {"lambdas": (0.1, 0)}):
        with pytest.raises(InvalidInputError):
            Projector.fit(model, tok, model, tok, fit_texts[:12], **bad)


# ------------------------------------------------------------------------------ evaluation


def test_split_passage_at_word_boundary():
    item = load_nq()[2000]
    prefix, continuation = evproj.split_passage(item, 0.5, 16)
    assert prefix + continuation == evproj.passage_text(item)
    assert continuation[0].isspace() and not prefix[-1].isspace()
    assert len(continuation.split()) >= 16 and len(prefix.split()) >= 16
    short = type(item)("q", ("a",), "T", "only a few words here")
    assert evproj.split_passage(short, 0.5, 16) is None


def test_eval_splits_are_held_out():
    fit = set(evproj.fit_texts(10_000))
    assert len(fit) <= evproj.FIT_POOL
    splits = evproj.eval_splits(200, 0.5, 16)
    assert len(splits) == 200
    texts = [prefix + continuation for prefix, continuation in splits]
    assert len(set(texts)) == len(texts) and not set(texts) & fit


def test_eval_project_cli(tmp_path):
    args = argparse.Namespace(
        a="tiny-llama",
        b="tiny-gemma3",
        out=str(tmp_path / "run"),
        projector=None,
        n_passages=4,
        n_fit=12,
        depth_window=2,
        own_last=1,
        prefix_fraction=0.5,
        min_words=16,
        device="cpu",
        no_progress=True,
    )
    assert evproj.main(args) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    for key in evproj.RESULT_KEYS:
        assert key in results
    assert results["n_passages"] == 4
    assert len(results["gap_closed_ci95"]) == 2
    assert results["wrong_doc_delta"] == pytest.approx(
        results["loss_wrong"] - results["loss_proj"], abs=1e-6
    )
    # --projector: load instead of fitting
    args.projector = str(tmp_path / "run" / "projector.safetensors")
    args.out = str(tmp_path / "again")
    args.n_passages = 3
    assert evproj.main(args) == 0
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["n_passages"] == 3
    assert again["loss_own"] == pytest.approx(
        sum(
            json.loads(r)["loss_own"]
            for r in (tmp_path / "run" / "passages.jsonl").read_text().splitlines()[:3]
        )
        / 3,
        abs=1e-5,
    )


def test_cli_parser_wiring():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="suite")
    evproj.add_parser(sub)
    args = parser.parse_args(
        ["project", "--a", "tiny-llama", "--b", "tiny-gemma3", "--out", "x", "--n-passages", "5"]
    )
    assert args.run is evproj.main and args.n_passages == 5 and args.projector is None
