"""Saving and loading states: exact round trips, atomic writes, clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import RECORDS
from helpers import same, snapshot
from safetensors import safe_open

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
    import kvedit.statefile as statefile

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(statefile, "save_file", broken)
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


# ------------------------------------------------------------------ format versions, structure


def rewrite(path, change_meta=None, change_tensors=None, version=None):
    """Rewrite a state file with changed metadata/tensors and a recomputed CRC (a file that
    passes its checksum but lies)."""
    import json

    from safetensors.torch import save_file

    from kvedit.storage import crc32_of, read_state_file

    meta, tensors = read_state_file(path)
    if change_tensors:
        change_tensors(tensors)
    if change_meta:
        change_meta(meta)
    if version is not None:
        meta["format_version"] = version
    meta["checksum"] = crc32_of(tensors)
    save_file(tensors, str(path), metadata={"kvedit": json.dumps(meta)})


def test_version_1_files_are_still_read(tmp_path, llama):
    """A file written by kvedit 0.1 (format 1, its fingerprint) loads and runs as before."""
    import json

    from safetensors.torch import save_file

    from kvedit.fingerprint import legacy_model_fingerprint, model_fingerprint
    from kvedit.storage import FORMAT_VERSION, crc32_of, state_tensors

    assert FORMAT_VERSION == 2
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    tensors = state_tensors(state)
    meta = {  # exactly the fields kvedit 0.1 wrote
        "format": "kvedit.kvstate",
        "format_version": 1,
        "kvedit_version": "0.1.0",
        "model": "tiny-llama",
        "model_fingerprint": legacy_model_fingerprint(model),
        "tokenizer_fingerprint": state.tokenizer_fingerprint,
        "text": state.text,
        "next_position": state.next_position,
        "windows": [layer.window for layer in state.layers],
        "n_layers": len(state.layers),
        "checksum": crc32_of(tensors),
    }
    path = tmp_path / "v1.kv"
    save_file(tensors, str(path), metadata={"kvedit": json.dumps(meta)})
    loaded = kvedit.load_state(path, model, tok)
    assert same(snapshot(loaded), snapshot(state))
    assert loaded.model_fingerprint == model_fingerprint(model)  # upgraded on load
    assert loaded.generate(" What is", 8) == state.generate(" What is", 8)
    loaded.save(tmp_path / "v2.kv")  # saved again: version 2
    assert json.loads(_header(tmp_path / "v2.kv"))["format_version"] == 2
    other, _ = tiny_model("llama", seed=1)
    with pytest.raises(CacheMismatchError, match="version-1"):
        kvedit.load_state(path, other, tok)


def _header(path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()["kvedit"]


def test_unknown_version_is_refused(saved):
    _, model, tok, _, path = saved
    rewrite(path, version=3)
    with pytest.raises(CorruptCacheError, match="version 3 is not supported"):
        kvedit.load_state(path, model, tok)


def _drop_last_layer(meta, tensors=None):
    meta["windows"] = meta["windows"][:-1]
    meta["n_layers"] -= 1
    meta.pop("layer_entries", None)
    for key in ("layer_kinds", "layer_params"):  # a consistent lie: every per-layer list
        if key in meta:
            meta[key] = meta[key][:-1]


@pytest.mark.parametrize(
    "case",
    [
        "fewer-layers",
        "fewer-layers-in-metadata-only",
        "kv-heads",
        "head-dim",
        "window",
        "token-id-outside-vocab",
        "token-index-out-of-range",
        "entries",
    ],
)
def test_structure_that_does_not_fit_the_model_is_refused_at_load(tmp_path, llama, case):
    """A file with a recomputed CRC whose structure lies fails at load, not in generate."""
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    path = tmp_path / "s.kv"
    state.save(path)
    last = len(state.layers) - 1

    def drop_tensors(t):
        for name in [n for n in t if n.startswith(f"layer.{last}.")]:
            del t[name]

    def regroup_heads(t):  # one KV head instead of two, or half the head size
        for name in ("layer.0.keys", "layer.0.values"):
            x = t[name]
            t[name] = (x[:, :1] if case == "kv-heads" else x[..., : x.shape[-1] // 2]).contiguous()

    def bad_token(t):
        t["token_ids"][3] = 10**6

    def bad_index(t):
        t["layer.1.token_index"][2] = len(state) + 5

    changes = {
        "fewer-layers": dict(change_meta=_drop_last_layer, change_tensors=drop_tensors),
        "fewer-layers-in-metadata-only": dict(change_meta=_drop_last_layer),
        "kv-heads": dict(change_tensors=regroup_heads),
        "head-dim": dict(change_tensors=regroup_heads),
        "window": dict(change_meta=lambda m: m.__setitem__("windows", [7] * len(m["windows"]))),
        "token-id-outside-vocab": dict(change_tensors=bad_token),
        "token-index-out-of-range": dict(change_tensors=bad_index),
        "entries": dict(change_meta=lambda m: m.__setitem__("layer_entries", [1, 2, 3])),
    }
    match = {
        "fewer-layers": "2 layers, the model has 3",
        "fewer-layers-in-metadata-only": "lists 2 layers but the file holds",
        "kv-heads": "1 KV heads, the model has 2",
        "head-dim": "head_dim 8, the model has 16",
        "window": "window 7, the model's is None",
        "token-id-outside-vocab": "vocabulary",
        "token-index-out-of-range": "token_index outside",
        "entries": "layer_entries",
    }
    rewrite(path, **changes[case])
    with pytest.raises(CorruptCacheError, match=match[case]):
        kvedit.load_state(path, model, tok)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.uint8, torch.float8_e4m3fn])
def test_save_refuses_non_float_dtypes_and_leaves_the_file(tmp_path, llama, dtype):
    from kvedit.errors import InvalidInputError

    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    path = tmp_path / "s.kv"
    state.save(path)
    before = path.read_bytes()
    with pytest.raises(InvalidInputError, match="float"):
        state.save(path, dtype=dtype)
    with pytest.raises(InvalidInputError):
        state.save(tmp_path / "new.kv", dtype=dtype)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["s.kv"]


def test_save_refuses_a_dtype_the_values_overflow(tmp_path, llama):
    from kvedit.errors import InvalidInputError, InvalidTypeError

    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    import dataclasses

    first = state.layers[0]
    big = state.replace(
        layers=[dataclasses.replace(first, keys=first.keys * 1e6), *state.layers[1:]]
    )
    with pytest.raises(InvalidInputError, match="overflow"):
        big.save(tmp_path / "s.kv", dtype=torch.float16)
    with pytest.raises(InvalidTypeError):
        state.save(tmp_path / "s.kv", dtype="bfloat16")
    assert os.listdir(tmp_path) == []
    big.save(tmp_path / "s.kv", dtype=torch.bfloat16)  # bfloat16 has float32's range


def test_layer_kinds_come_from_the_registry(tmp_path, llama):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    path = tmp_path / "s.kv"
    state.save(path)
    meta = json.loads(safe_open(str(path), "pt").metadata()["kvedit"])
    assert meta["layer_kinds"] == ["dense"] * len(state.layers)
    rewrite(path, change_meta=lambda m: m.__setitem__("layer_kinds", ["bogus"] * len(m["windows"])))
    with pytest.raises(CorruptCacheError, match="unknown cache layer kind 'bogus'"):
        kvedit.load_state(path, model, tok)
