"""Saving and loading states: exact round trips, atomic writes, clear errors."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import RECORDS
from helpers import same, snapshot

import kvedit
from kvedit.errors import CacheMismatchError, CorruptCacheError
from kvedit.testing import tiny_model, tiny_tokenizer


@pytest.fixture()
def saved(tmp_path, tiny):
    arch, model, tok = tiny
    state = kvedit.capture(model, tok, RECORDS)
    path = tmp_path / "state.kv"
    state.save(path)
    return arch, model, tok, state, path


def test_round_trip_is_exact(saved):
    _, model, tok, state, path = saved
    loaded = kvedit.load_state(path, model, tok)
    assert same(snapshot(loaded), snapshot(state))
    assert loaded.text == state.text and loaded.next_position == state.next_position
    assert [layer.window for layer in loaded.layers] == [layer.window for layer in state.layers]
    assert loaded.generate(" What is", 10) == state.generate(" What is", 10)
    assert not [p for p in os.listdir(path.parent) if p.endswith(".tmp")]


def test_round_trip_keeps_the_bias(tmp_path):
    model, tok = tiny_model("llama")
    state = kvedit.capture(model, tok, RECORDS)
    biased = state.replace(
        layers=[
            layer.__class__(**{**layer.__dict__, "bias": torch.randn(1, 2, len(layer))})
            for layer in state.layers
        ]
    )
    biased.save(tmp_path / "b.kv")
    loaded = kvedit.load_state(tmp_path / "b.kv", model, tok)
    assert same(snapshot(loaded), snapshot(biased))


def test_dtype_downcast_on_save(tmp_path):
    model, tok = tiny_model("llama")
    state = kvedit.capture(model, tok, RECORDS)
    state.save(tmp_path / "full.kv")
    state.save(tmp_path / "half.kv", dtype=torch.bfloat16)
    assert os.path.getsize(tmp_path / "half.kv") < 0.7 * os.path.getsize(tmp_path / "full.kv")
    loaded = kvedit.load_state(tmp_path / "half.kv", model, tok)
    torch.testing.assert_close(loaded.layers[0].keys, state.layers[0].keys, atol=0.05, rtol=0.02)


def test_bit_flip_is_detected(saved):
    _, model, tok, _, path = saved
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCacheError, match="checksum"):
        kvedit.load_state(path, model, tok)


@pytest.mark.parametrize("keep", [0, 5, 100, -50])
def test_truncated_file_is_detected(saved, keep):
    _, model, tok, _, path = saved
    raw = path.read_bytes()
    path.write_bytes(raw[:keep] if keep >= 0 else raw[:keep])
    with pytest.raises(CorruptCacheError):
        kvedit.load_state(path, model, tok)


def test_pickle_is_refused_without_unpickling(tmp_path, monkeypatch):
    model, tok = tiny_model("llama")
    path = tmp_path / "evil.kv"
    torch.save({"x": torch.zeros(2)}, path)
    import pickle

    def boom(*a, **k):
        raise AssertionError("kvedit must never unpickle")

    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(torch, "load", boom)
    with pytest.raises(CorruptCacheError, match="pickle"):
        kvedit.load_state(path, model, tok)
    raw_pickle = tmp_path / "raw.kv"
    raw_pickle.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CorruptCacheError, match="pickle"):
        kvedit.load_state(raw_pickle, model, tok)


def test_other_model_or_tokenizer_is_refused(saved):
    arch, model, tok, _, path = saved
    other_model, _ = tiny_model(arch, seed=1)
    with pytest.raises(CacheMismatchError, match="model fingerprint"):
        kvedit.load_state(path, other_model, tok)
    other_tok = tiny_tokenizer()
    other_tok.add_tokens(["<extra>"])
    with pytest.raises(CacheMismatchError, match="tokenizer"):
        kvedit.load_state(path, model, other_tok)


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    model, tok = tiny_model("llama")
    state = kvedit.capture(model, tok, RECORDS)
    path = tmp_path / "s.kv"
    state.save(path)
    before = path.read_bytes()
    import kvedit.storage as storage

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(storage, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        state.extend(" more").save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["s.kv"]


def test_header_length_ending_in_0x80_is_not_mistaken_for_a_pickle(tmp_path):
    """The first byte of a safetensors file is the low byte of its header length."""
    model, tok = tiny_model("llama")
    state = kvedit.capture(model, tok, RECORDS)
    for extra in range(0, 320, 4):  # vary the (8-byte aligned) header length via the text
        s = state.replace(text=state.text + " " * extra)
        path = tmp_path / f"s{extra}.kv"
        s.save(path)
        if path.read_bytes()[0] == 0x80:
            assert kvedit.load_state(path, model, tok).text == s.text
            return
    pytest.fail("no header length ending in 0x80 was produced")
