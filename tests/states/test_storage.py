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
    import kvedit.states.files.write as statefile

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
    """Rewrite a state file with changed metadata/tensors, sealed again with this
    installation's key (a file that passes its seal but lies)."""
    import json

    from safetensors.torch import save_file

    from kvedit.states.files.read import read_state_file
    from kvedit.states.files.seal import make_seal, tensors_digest

    found = read_state_file(path)
    meta, tensors = found.meta, found.tensors
    if change_tensors:
        change_tensors(tensors)
    if change_meta:
        change_meta(meta)
    if version is not None:
        meta["format_version"] = version
    meta["seal"] = make_seal(meta, tensors_digest(tensors))
    save_file(tensors, str(path), metadata={"kvedit": json.dumps(meta)})


def test_version_1_files_are_still_read(tmp_path, llama):
    """A file written by kvedit 0.1 (format 1, its fingerprint) loads and runs as before."""
    import json

    from safetensors.torch import save_file

    from kvedit.fingerprint import legacy_model_fingerprint, model_fingerprint
    from kvedit.states.files.format import FORMAT_VERSION, crc32_of
    from kvedit.states.files.write import state_tensors

    assert FORMAT_VERSION == 4
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
    assert not loaded.history.known  # kvedit 0.1 recorded no history
    loaded.save(tmp_path / "v4.kv")  # saved again: version 4, history still unknown
    assert json.loads(_header(tmp_path / "v4.kv"))["format_version"] == 4
    assert not kvedit.load_state(tmp_path / "v4.kv", model, tok).history.known
    other, _ = tiny_model("llama", seed=1)
    with pytest.raises(CacheMismatchError, match="version-1"):
        kvedit.load_state(path, other, tok)


def _header(path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()["kvedit"]


def version_2_file(state, path) -> None:
    """Write ``state`` as kvedit 0.2 did: format 2, exactly the fields it wrote (no history,
    no K/V dtype, no last input)."""
    from safetensors.torch import save_file

    from kvedit.states.files.format import crc32_of
    from kvedit.states.files.write import _state_tensors_and_params

    tensors, params = _state_tensors_and_params(state, None)
    meta = {
        "format": "kvedit.kvstate",
        "format_version": 2,
        "kvedit_version": "0.2.0",
        "model": "tiny-llama",
        "model_fingerprint": state.model_fingerprint,
        "tokenizer_fingerprint": state.tokenizer_fingerprint,
        "text": state.text,
        "next_position": state.next_position,
        "windows": [layer.window for layer in state.layers],
        "n_layers": len(state.layers),
        "n_tokens": len(state),
        "layer_entries": [len(layer) for layer in state.layers],
        "layer_kinds": [layer.kind for layer in state.layers],
        "layer_params": params,
        "checksum": crc32_of(tensors),
    }
    save_file(tensors, str(path), metadata={"kvedit": json.dumps(meta)})


def test_version_2_files_are_still_read_with_an_unknown_history(tmp_path, llama):
    """A file written by kvedit 0.2 (format 2) loads and runs as before; it recorded no
    history, so the state's is "unknown" (never a plain capture), and the entry its last
    logits follow is found from its layers (a re-read state's last re-read token)."""
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    version_2_file(state, tmp_path / "v2.kv")
    loaded = kvedit.load_state(tmp_path / "v2.kv", model, tok)
    assert same(snapshot(loaded), snapshot(state))
    assert not loaded.history.known and not loaded.is_plain_capture
    assert loaded.history.origin.path == str(tmp_path / "v2.kv")
    assert "unknown" in loaded.explain() and loaded.digest != state.digest
    assert loaded.last_input == state.last_input
    assert loaded.generate(" What is", 8) == state.generate(" What is", 8)

    reread = kvedit.ops.reread(state, "Carol's secret number is 5902.")
    version_2_file(reread, tmp_path / "r2.kv")
    loaded = kvedit.load_state(tmp_path / "r2.kv", model, tok)
    assert loaded.last_input == reread.last_input != (len(state) - 1, len(state) - 1)


def test_unknown_version_is_refused(saved):
    _, model, tok, _, path = saved
    rewrite(path, version=5)
    with pytest.raises(CorruptCacheError, match="version 5 is not supported"):
        kvedit.load_state(path, model, tok)


# ------------------------------------------------------------------ provenance in the file


def test_history_is_saved_and_loaded(tmp_path, llama):
    """A file records the state's history (format 4, sealed): capture, save, load is the same content
    (same digest, a plain capture); an edit's steps come back in order; the file read is noted
    in the origin but is no part of the digest."""
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    state.save(tmp_path / "c.kv")
    meta = json.loads(_header(tmp_path / "c.kv"))
    assert meta["format_version"] == 4 and meta["history"]["origin"]["kind"] == "capture"
    assert meta["kv_dtype"] == "float32" and meta["last_input"] == [len(state) - 1] * 2
    loaded = kvedit.load_state(tmp_path / "c.kv", model, tok)
    assert loaded.digest == state.digest and loaded.is_plain_capture
    assert loaded.history.origin.path == str(tmp_path / "c.kv")
    assert str(tmp_path / "c.kv") in loaded.explain() and "c.kv" in repr(loaded)

    edited = kvedit.ops.emphasize(kvedit.ops.scale_keys(state, "Carol", 1.5), "Bob", 2.0)
    edited.save(tmp_path / "e.kv")
    back = kvedit.load_state(tmp_path / "e.kv", model, tok)
    assert back.history == edited.history and back.digest == edited.digest != state.digest
    assert [s.name for s in back.history.steps] == ["scale_keys", "emphasize"]


def test_dtype_casts_on_save_and_load_are_steps(tmp_path, llama):
    """``save(dtype=...)`` records a cast in the file (lossy float32 -> bfloat16), loading casts
    back to the model's dtype (exact); an exact cast undone by the next one leaves a plain
    capture."""
    from kvedit.provenance import History

    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    state.save(tmp_path / "half.kv", dtype=torch.bfloat16)
    meta = json.loads(_header(tmp_path / "half.kv"))
    assert meta["kv_dtype"] == "bfloat16"
    loaded = kvedit.load_state(tmp_path / "half.kv", model, tok)
    casts = [(s.params["from"], s.params["dtype"], s.exact) for s in loaded.history.steps]
    assert casts == [("float32", "bfloat16", False), ("bfloat16", "float32", True)]
    assert not loaded.is_plain_capture and loaded.digest != state.digest
    assert "cast" in loaded.history.first_change()
    assert loaded.history.first_change(allowed=[torch.bfloat16]) is None  # declared

    state.save(tmp_path / "wide.kv", dtype=torch.float64)  # exact, then cast back: undone
    wide = kvedit.load_state(tmp_path / "wide.kv", model, tok)
    assert wide.history == state.history and wide.digest == state.digest
    assert torch.equal(wide.layers[0].keys, state.layers[0].keys)
    assert History.captured(torch.float32) == state.history


def test_a_bad_history_in_a_file_is_corrupt(tmp_path, llama):
    model, tok = llama
    path = tmp_path / "s.kv"
    kvedit.capture(model, tok, RECORDS).save(path)
    rewrite(path, change_meta=lambda m: m.__setitem__("history", {"origin": {"kind": "magic"}}))
    with pytest.raises(CorruptCacheError, match="history"):
        kvedit.load_state(path, model, tok)
    kvedit.capture(model, tok, RECORDS).save(path)
    rewrite(path, change_meta=lambda m: m.__setitem__("last_input", [10**6, 0]))
    with pytest.raises(CorruptCacheError, match="last_input"):
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
