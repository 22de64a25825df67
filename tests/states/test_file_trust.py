"""A state file cannot pass for what it is not: the seal binds header and tensors (careless
edits are corrupt files), and only this installation's MAC makes a file's history believed
(a file built elsewhere loads with an unknown history, never stored or served as a capture)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import RECORDS
from helpers import edit_file_header

import kvedit
from kvedit import ops
from kvedit.errors import CorruptCacheError, InvalidInputError, StorageError
from kvedit.states.files import seal
from kvedit.states.files.seal import KEY_ENV, installation_key


def _strip_steps(meta):
    meta["history"]["steps"] = []


@pytest.fixture()
def edited(tmp_path, llama):
    model, tok = llama
    state = ops.scale_keys(kvedit.capture(model, tok, RECORDS), "Bob", 3.0)
    path = tmp_path / "edited.kv"
    state.save(path)
    return model, tok, state, path


def test_a_stripped_history_is_a_corrupt_file(edited):
    model, tok, _, path = edited
    edit_file_header(path, _strip_steps)
    with pytest.raises(CorruptCacheError, match="edited.kv.*header was edited"):
        kvedit.load_state(path, model, tok)


def test_a_history_stripped_and_resealed_without_the_key_loads_unknown(edited, tmp_path):
    model, tok, state, path = edited
    edit_file_header(path, _strip_steps, reseal=True)
    loaded = kvedit.load_state(path, model, tok)  # usable when loaded explicitly ...
    assert not loaded.history.known and not loaded.is_plain_capture
    assert loaded.digest != kvedit.capture(model, tok, RECORDS).digest
    store = kvedit.KVStore(tmp_path / "store")
    with pytest.raises(InvalidInputError):  # ... never stored as a capture
        store.put(loaded)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.__setitem__("text", m["text"].replace("Bob", "Rob")),
        lambda m: m.__setitem__("last_input", [0, 0]),
        lambda m: m.__setitem__("next_position", m["next_position"] + 1),
    ],
    ids=["text", "last_input", "next_position"],
)
def test_any_header_field_edited_by_hand_is_corrupt(tmp_path, llama, change):
    model, tok = llama
    path = tmp_path / "plain.kv"
    kvedit.capture(model, tok, RECORDS).save(path)
    edit_file_header(path, change)
    with pytest.raises(CorruptCacheError, match="plain.kv"):
        kvedit.load_state(path, model, tok)


def test_a_tensor_changed_in_the_file_is_corrupt_even_after_a_first_load(tmp_path, llama):
    model, tok = llama
    path = tmp_path / "s.kv"
    kvedit.capture(model, tok, RECORDS).save(path)
    kvedit.load_state(path, model, tok)  # remembered as verified ...
    size = path.stat().st_size
    with open(path, "r+b") as f:  # ... then one byte of the last tensor flipped, same size
        f.seek(size - 3)
        byte = f.read(1)
        f.seek(size - 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert path.stat().st_size == size
    with pytest.raises(CorruptCacheError, match="tensors"):
        kvedit.load_state(path, model, tok)


def test_a_step_field_of_the_wrong_json_type_is_corrupt(tmp_path, llama):
    """``"exact": "no"`` is not false (bool("no") is True): a strict parse refuses it, even in
    a file this installation sealed."""
    from kvedit.states.files.read import read_state_file
    from kvedit.states.files.seal import make_seal, tensors_digest

    model, tok = llama
    path = tmp_path / "s.kv"
    ops.scale_keys(kvedit.capture(model, tok, RECORDS), "Bob", 3.0).save(path)
    tensors = read_state_file(path).tensors

    def lie(meta):
        meta["history"]["steps"][0]["exact"] = "no"
        meta["seal"] = make_seal(meta, tensors_digest(tensors))

    edit_file_header(path, lie)
    with pytest.raises(CorruptCacheError, match="exact"):
        kvedit.load_state(path, model, tok)


def test_a_file_of_another_installation_loads_unknown_and_the_store_misses_it(
    tmp_path, llama, monkeypatch
):
    model, tok = llama
    store = kvedit.KVStore(tmp_path / "store")
    state = kvedit.capture(model, tok, RECORDS)
    key = store.put(state)
    state.save(tmp_path / "s.kv")
    assert kvedit.load_state(tmp_path / "s.kv", model, tok).is_plain_capture
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "other.key"))  # another installation
    installation_key(create=True)
    loaded = kvedit.load_state(tmp_path / "s.kv", model, tok)
    assert not loaded.history.known and not loaded.is_plain_capture
    assert kvedit.KVStore(tmp_path / "store").get(key, model, tok) is None  # a miss
    _, report = kvedit.reuse(model, tok, RECORDS + " More.", kvedit.KVStore(tmp_path / "s2"))
    assert report.tokens_reused == 0


def test_a_file_older_than_the_seal_loads_unknown(tmp_path, llama):
    from safetensors.torch import save_file

    from kvedit.states.files.format import crc32_of
    from kvedit.states.files.read import read_state_file

    model, tok = llama
    path = tmp_path / "v3.kv"
    kvedit.capture(model, tok, RECORDS).save(path)
    found = read_state_file(path)
    meta, tensors = dict(found.meta), found.tensors
    meta.pop("seal")
    meta["format_version"], meta["checksum"] = 3, crc32_of(tensors)
    save_file(tensors, str(path), metadata={"kvedit": json.dumps(meta)})
    loaded = kvedit.load_state(path, model, tok)
    assert not loaded.history.known and not loaded.is_plain_capture


def test_the_installation_key_is_private_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "k" / "installation.key"))
    assert installation_key() is None  # reading never makes one
    key = installation_key(create=True)
    assert len(key) == 32 and installation_key() == key
    assert os.stat(tmp_path / "k" / "installation.key").st_mode & 0o777 == 0o600
    (tmp_path / "k" / "installation.key").write_bytes(b"short")
    with pytest.raises(StorageError, match="32 bytes"):
        installation_key()
    assert seal.key_path() == tmp_path / "k" / "installation.key"


# ------------------------------------------------------------------ in-place writes


def test_a_state_written_in_place_is_refused_where_it_matters(tmp_path, llama):
    from kvedit.errors import StateAlteredError
    from kvedit.integrations.vllm import publish

    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    state.layers[0].keys.mul_(3)  # the plain capture's digest no longer says what it holds
    for use, match in [
        (lambda: state.save(tmp_path / "s.kv"), "saving it"),
        (lambda: kvedit.KVStore(tmp_path / "store").put(state), "storing it"),
        (lambda: publish(state, tmp_path / "pub"), "publishing it"),
        (lambda: ops.emphasize(state, "Bob", 2.0), "a new state built from it"),
    ]:
        with pytest.raises(StateAlteredError, match=f"{match}.*layer 0 keys"):
            use()
    assert not (tmp_path / "s.kv").exists() and not (tmp_path / "pub").exists()


def test_a_state_written_after_put_is_served_from_disk(tmp_path, llama):
    from helpers import same, snapshot

    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    pristine = snapshot(state)
    store = kvedit.KVStore(tmp_path, memory_bytes=10**8)
    key = store.put(state)
    state.layers[1].values.add_(1.0)  # the memory tier shares these tensors
    with pytest.warns(UserWarning, match="serving the disk copy"):
        served, source = store.fetch(key, model, tok)
    assert source == "disk" and same(snapshot(served), pristine)
    reused, report = kvedit.reuse(model, tok, RECORDS + " More.", store)
    assert report.tokens_reused == len(state)
