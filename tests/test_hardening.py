"""Issue #13, hardening: every bad input gets a KVEditError that says what was wrong, and leaves
the state or file it was given untouched.

Tests marked ``# wiring:`` exercise validators of ``kvedit.checks`` that the core modules
(ops, steer, state) call; the others cover storage, the store, spans, fingerprints and the
atomic writer.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RECORDS
from helpers import same, snapshot

import kvedit
from kvedit import checks, errors, ops
from kvedit.atomic import atomic_write, is_temp_name
from kvedit.errors import (
    CacheMismatchError,
    EmptySelectionError,
    EntryNotFoundError,
    InvalidInputError,
    InvalidTypeError,
    KVEditError,
    ModelNotAttachedError,
    StorageError,
    StoreUnavailableError,
)
from kvedit.fingerprint import forget, model_fingerprint, tokenizer_fingerprint
from kvedit.store import KVStore
from kvedit.testing import tiny_model, tiny_tokenizer

SPAN = "Carol's secret number is 5902."
FORK = multiprocessing.get_context("fork")


@pytest.fixture()
def state(llama):
    model, tok = llama
    return kvedit.capture(model, tok, RECORDS)


def untouched(state, call, error, match=None):
    """``call(state)`` raises ``error`` (matching ``match``) and leaves ``state`` as it was."""
    before = snapshot(state)
    with pytest.raises(error, match=match) as info:
        call(state)
    assert same(snapshot(state), before)
    assert isinstance(info.value, KVEditError)
    return info.value


# ------------------------------------------------------------------------ the validators


@pytest.mark.parametrize(
    "value,expected",
    [
        (2, 2.0),
        (-1.5, -1.5),
        (np.float32(2.0), 2.0),
        (np.float64(-3.0), -3.0),
        (np.int64(4), 4.0),
        (torch.tensor(2.5), 2.5),
        (torch.tensor(3, dtype=torch.int32), 3.0),
        (1e4, 1e4),
        (-1e4, -1e4),
    ],
    ids=repr,
)
def test_strength_accepts_numbers(value, expected):
    got = checks.strength("strength", value)
    assert got == expected and type(got) is float


@pytest.mark.parametrize(
    "value,error",
    [
        (True, InvalidTypeError),
        (np.bool_(True), InvalidTypeError),
        (torch.tensor(True), InvalidTypeError),
        ("2", InvalidTypeError),
        (None, InvalidTypeError),
        (torch.tensor([1.0, 2.0]), InvalidTypeError),
        (1 + 2j, InvalidTypeError),
        (float("nan"), InvalidInputError),
        (float("inf"), InvalidInputError),
        (-float("inf"), InvalidInputError),
        (np.float32("nan"), InvalidInputError),
        (1e39, InvalidInputError),
        (1e300, InvalidInputError),
        (10**400, InvalidInputError),
        (1e4 + 1, InvalidInputError),
    ],
    ids=repr,
)
def test_strength_refuses(value, error):
    with pytest.raises(error, match="strength") as info:
        checks.strength("strength", value)
    assert isinstance(info.value, ValueError)  # also the old error type
    if isinstance(value, bool):
        assert "finite" in str(info.value)


def test_real_without_a_cap_still_refuses_what_float32_cannot_hold():
    assert checks.real("ttl", 1e30) == 1e30
    with pytest.raises(InvalidInputError, match="float32"):
        checks.real("ttl", 1e39)


def test_strength_cap_is_documented():
    assert checks.MAX_STRENGTH == 1e4
    assert "float32" in checks.strength.__doc__ and "1e4" in checks.strength.__doc__
    assert math.exp(-104) < torch.finfo(torch.float32).smallest_normal  # saturated long before


@pytest.mark.parametrize(
    "value,kwargs,error",
    [
        (2.5, {}, InvalidTypeError),
        (2.0, {}, InvalidTypeError),
        (True, {}, InvalidTypeError),
        ("3", {}, InvalidTypeError),
        (None, {}, InvalidTypeError),
        (-1, {}, InvalidInputError),
        (0, {"minimum": 1}, InvalidInputError),
        (65, {"maximum": 64}, InvalidInputError),
    ],
    ids=repr,
)
def test_count_refuses(value, kwargs, error):
    with pytest.raises(error, match="max_new_tokens"):
        checks.count("max_new_tokens", value, **kwargs)


def test_count_accepts_ints():
    assert checks.count("n", 3) == 3
    assert checks.count("n", np.int32(3)) == 3 and type(checks.count("n", np.int32(3))) is int
    assert checks.count("n", torch.tensor(3)) == 3
    assert checks.count("n", 64, maximum=checks.MAX_DUPLICATE_COPIES) == 64


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0, torch.tensor([True, False])], ids=repr)
def test_flag_refuses_what_is_not_a_bool(value):
    with pytest.raises(InvalidTypeError, match="all_words must be True or False"):
        checks.flag("all_words", value)


def test_flag_accepts_bools():
    assert checks.flag("f", True) is True and checks.flag("f", False) is False
    assert (
        checks.flag("f", np.bool_(True)) is True and checks.flag("f", torch.tensor(False)) is False
    )


@pytest.mark.parametrize("value", [None, ["a", "b"], ("a",), b"a", 3])
def test_text_refuses_non_strings(value):
    with pytest.raises(InvalidTypeError, match="text"):
        checks.text("text", value)


def test_text():
    assert checks.text("text", "") == ""
    with pytest.raises(InvalidInputError, match="empty"):
        checks.text("text", "", allow_empty=False)


def test_layers():
    assert checks.layers(None, 3) is None
    assert checks.layers([2, 0, 2], 3) == (0, 2)
    assert checks.layers(np.array([1]), 3) == (1,)
    assert checks.layers(range(3), 3) == (0, 1, 2)
    with pytest.raises(EmptySelectionError, match="layers is empty"):
        checks.layers([], 3)
    for bad in ([3], [-1], [0, 7]):
        with pytest.raises(InvalidInputError, match="out of range"):
            checks.layers(bad, 3)
    for bad in (1, "0", {0: 1}, [True], [0.5]):
        with pytest.raises(InvalidTypeError):
            checks.layers(bad, 3)


def test_duplicate_is_bounded_at_64_copies_a_bias_of_log_65(llama):
    """The most copies duplicate appends is 64: exactly emphasize's bias of log 65 nats; one
    more is refused (a larger bias is one emphasize call, at no memory cost)."""
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    question = " Question: What is Carol's secret number? Answer:"
    at_bound = ops.duplicate(state, SPAN, checks.MAX_DUPLICATE_COPIES)
    torch.testing.assert_close(
        at_bound.logits(question),
        ops.emphasize(state, SPAN, math.log(65)).logits(question),
        rtol=1e-4,
        atol=1e-4,
    )
    with pytest.raises(InvalidInputError, match="copies must be <= 64, not 65"):
        ops.duplicate(state, SPAN, 65)


# ------------------------------------------------------------------------ spans (spans.py)


@pytest.mark.parametrize(
    "spans,error",
    [
        (3, InvalidTypeError),
        (None, InvalidTypeError),
        ({"Carol": 1}, InvalidTypeError),
        ([SPAN, 7], InvalidTypeError),
        ("", InvalidInputError),
    ],
    ids=repr,
)
def test_bad_span_through_an_op(state, spans, error):
    for op in (ops.emphasize, ops.suppress, ops.duplicate):
        untouched(state, lambda s, op=op: op(s, spans), error)
    untouched(state, lambda s: s.token_indices(spans), error)


# ------------------------------------------------------------------------ ops (wiring)


@pytest.mark.parametrize("strength", [1e39, 1e300, -1e39, 1e5])
def test_overflowing_strength_is_refused_by_ops(state, strength):
    # wiring: ops.emphasize/suppress call checks.strength("strength", strength)
    untouched(state, lambda s: ops.emphasize(s, SPAN, strength), InvalidInputError, "strength")
    untouched(state, lambda s: ops.suppress(s, SPAN, strength), InvalidInputError, "strength")


def test_overflowing_factor_is_refused_by_scale_keys(state):
    # wiring: ops.scale_keys calls checks.real("factor", factor, cap=checks.MAX_SCALE_FACTOR)
    untouched(state, lambda s: ops.scale_keys(s, SPAN, 1e39), InvalidInputError, "factor")


def test_numpy_and_torch_strengths_work_in_ops(state):
    # wiring: ops.emphasize calls checks.strength
    plain = ops.emphasize(state, SPAN, 2.0)
    for value in (np.float32(2.0), np.float64(2.0), torch.tensor(2.0), 2):
        edited = ops.emphasize(state, SPAN, value)
        assert same(snapshot(edited), snapshot(plain))


def test_bool_strength_is_refused_by_ops(state):
    # wiring: ops.emphasize/suppress call checks.strength
    untouched(state, lambda s: ops.emphasize(s, SPAN, True), InvalidTypeError, "finite")
    untouched(state, lambda s: ops.suppress(s, SPAN, False), InvalidTypeError, "finite")


def test_empty_layers_are_refused_by_ops(state):
    # wiring: ops' layer_set calls checks.layers(layers, len(state.layers))
    for op in (ops.emphasize, ops.suppress):
        untouched(state, lambda s, op=op: op(s, SPAN, 1.0, layers=[]), EmptySelectionError)
    untouched(state, lambda s: ops.scale_keys(s, SPAN, 2.0, layers=[]), EmptySelectionError)


def test_duplicate_copies_are_bounded(state):
    # wiring: ops.duplicate calls checks.count("copies", copies, maximum=MAX_DUPLICATE_COPIES)
    # (the bound is checked first: unwired, 10**6 copies would exhaust the machine's memory)
    untouched(
        state,
        lambda s: ops.duplicate(s, SPAN, checks.MAX_DUPLICATE_COPIES + 1),
        InvalidInputError,
        "copies",
    )
    untouched(state, lambda s: ops.duplicate(s, SPAN, 10**6), InvalidInputError, "copies")
    untouched(state, lambda s: ops.duplicate(s, SPAN, 2.5), InvalidTypeError, "copies")


def test_spans_selecting_no_token_raise_empty_selection(state):
    # wiring: ops/_select.span_tokens raises EmptySelectionError
    blind = state.replace(offsets=torch.zeros_like(state.offsets))  # every token zero-width
    untouched(blind, lambda s: ops.emphasize(s, SPAN, 1.0), EmptySelectionError)


def test_reread_without_a_model(state):
    # wiring: ops.reread raises ModelNotAttachedError
    err = untouched(state.replace(model=None), lambda s: ops.reread(s, SPAN), ModelNotAttachedError)
    assert isinstance(err, ValueError) and isinstance(err, CacheMismatchError)


# ------------------------------------------------------------------------ steer (wiring)


@pytest.mark.parametrize("strength", [1e39, 1e300, 1e5])
def test_overflowing_strength_is_refused_by_steer(llama, strength):
    # wiring: steer() calls checks.strength("strength", strength)
    model, tok = llama
    with pytest.raises(InvalidInputError, match="strength"):
        kvedit.steer(model, tok, emphasize="Carol", strength=strength)


def test_steer_and_ops_agree_on_strength_types(llama, state):
    # wiring: steer() and ops call checks.strength
    model, tok = llama
    with pytest.raises(InvalidTypeError, match="finite"):
        kvedit.steer(model, tok, emphasize="Carol", strength=True)
    kvedit.steer(model, tok, emphasize="Carol", strength=np.float32(2.0))
    kvedit.steer(model, tok, emphasize="Carol", strength=torch.tensor(2.0))


def test_steer_layers_use_the_same_validator(llama):
    # wiring: steer() calls checks.layers(layers, n_layers)
    model, tok = llama
    with pytest.raises(EmptySelectionError, match="layers is empty"):
        kvedit.steer(model, tok, emphasize="Carol", layers=[])
    with pytest.raises(InvalidTypeError):
        kvedit.steer(model, tok, emphasize="Carol", layers=1)


def test_nested_steering_raises_its_class(llama):
    # wiring: runtime/attention raises errors.NestedSteeringError
    model, tok = llama
    with (
        kvedit.steer(model, tok, emphasize="Carol"),
        pytest.raises(errors.NestedSteeringError, match="nested"),
        kvedit.steer(model, tok, emphasize="Frank"),
    ):
        pass


# ------------------------------------------------------------------------ state (wiring)


@pytest.mark.parametrize(
    "value,error", [(-1, InvalidInputError), (2.5, InvalidTypeError), (True, InvalidTypeError)]
)
def test_max_new_tokens(state, value, error):
    # wiring: KVState.generate calls checks.count("max_new_tokens", max_new_tokens)
    untouched(state, lambda s: s.generate(" What", value), error, "max_new_tokens")


def test_max_new_tokens_zero_is_empty(state):
    assert state.generate(" What", 0) == ""


@pytest.mark.parametrize("text", [None, [RECORDS, RECORDS], b"abc", 3])
def test_capture_refuses_non_text(llama, text):
    # wiring: capture calls checks.text("text", text)
    model, tok = llama
    with pytest.raises(InvalidTypeError, match="text"):
        kvedit.capture(model, tok, text)


@pytest.mark.parametrize("text", [None, ["a", "b"]])
def test_continuations_must_be_text(state, text):
    # wiring: generate/extend/logits call checks.text("continuation"/"text", ...)
    untouched(state, lambda s: s.generate(text, 2), InvalidTypeError)
    untouched(state, lambda s: s.extend(text), InvalidTypeError)
    untouched(state, lambda s: s.logits(text), InvalidTypeError)


def test_state_is_checked_against_its_model_before_it_runs(state):
    # wiring: KVState._require_model (or _run/generate) calls
    # checks.state_fits_model(self, model, tokenizer)
    other, _ = tiny_model("llama", seed=1)
    untouched(state.replace(model=other), lambda s: s.generate(" x", 2), CacheMismatchError)
    fewer = state.replace(layers=state.layers[:-1])
    untouched(fewer, lambda s: s.generate(" x", 2), CacheMismatchError, "layers")


def test_altered_bias_is_a_kvedit_error(state):
    """The bias outgrew the cache (a state changed behind kvedit's back): no RuntimeError."""
    first = state.layers[0]
    bad = dataclasses.replace(first, bias=torch.zeros(1, 2, len(first) + 3))
    altered = state.replace(layers=[bad, *state.layers[1:]])
    with pytest.raises(KVEditError):
        altered.generate(" x", 2)


# ------------------------------------------------------------------------ storage


@pytest.mark.parametrize(
    "path,error",
    [
        ("", InvalidInputError),
        (" ", InvalidInputError),
        (None, InvalidTypeError),
        (3, InvalidTypeError),
    ],
    ids=repr,
)
def test_save_to_a_bad_path(state, path, error):
    untouched(state, lambda s: s.save(path), error, "path")


def test_save_to_a_directory(state, tmp_path):
    untouched(state, lambda s: s.save(tmp_path), InvalidInputError, "directory")
    untouched(state, lambda s: s.save(str(tmp_path) + "/"), InvalidInputError, "directory")
    assert os.listdir(tmp_path) == []


def test_save_under_a_file(state, tmp_path):
    (tmp_path / "f").write_text("x")
    untouched(state, lambda s: s.save(tmp_path / "f" / "s.kv"), InvalidInputError)


def test_load_from_a_bad_path(llama):
    model, tok = llama
    with pytest.raises(InvalidInputError):
        kvedit.load_state("", model, tok)
    with pytest.raises(InvalidTypeError):
        kvedit.load_state(None, model, tok)


def test_save_with_a_bad_dtype_never_writes(state, tmp_path):
    with pytest.raises(InvalidInputError):
        state.save(tmp_path / "s.kv", dtype=torch.int8)
    assert not (tmp_path / "s.kv").exists() and os.listdir(tmp_path) == []


# ------------------------------------------------------------------------ the atomic writer


def test_atomic_write_forms(tmp_path):
    assert atomic_write(tmp_path / "a", b"bytes").read_bytes() == b"bytes"
    assert atomic_write(tmp_path / "b", "tëxt").read_text(encoding="utf-8") == "tëxt"
    assert atomic_write(tmp_path / "c", iter([b"a", b"b"])).read_bytes() == b"ab"
    assert (
        atomic_write(tmp_path / "d" / "e", lambda p: Path(p).write_text("cb")).read_text() == "cb"
    )
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c", "d"]
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600


def test_atomic_write_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = atomic_write(tmp_path / "f", b"old")

    def half(p):
        Path(p).write_bytes(b"partial")
        Path(p).with_name(".tmpAbC123").write_bytes(b"a library's own temporary file")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        atomic_write(path, half)
    with pytest.raises(StorageError, match="no space") as info:
        atomic_write(path, lambda p: (_ for _ in ()).throw(OSError(28, "no space")))
    assert isinstance(info.value, OSError) and info.value.errno == 28
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_atomic_write_fsyncs_file_and_directory(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    atomic_write(tmp_path / "f", b"x")
    assert str(tmp_path) in synced  # the directory, after the rename
    assert any(is_temp_name(Path(p).name) for p in synced)  # the file, before it


def test_aliases_are_the_one_writer():
    import kvedit.evals.tasks as tasks
    import kvedit.states.files.write as write
    from kvedit.evals import report

    assert write.atomic_write is atomic_write
    assert tasks.atomic_write is atomic_write
    assert report.atomic_write is atomic_write


def _stalled_save(path: str, conn) -> None:
    """Save a state with safetensors, then stall inside the writer (to be SIGKILLed)."""
    from safetensors.torch import save_file

    def write(tmp):
        save_file({"x": torch.zeros(1000)}, tmp)
        conn.send("written")
        time.sleep(60)

    atomic_write(path, write)


def test_a_killed_writer_leaves_one_recognisable_temporary(tmp_path):
    ours, theirs = FORK.Pipe()
    child = FORK.Process(target=_stalled_save, args=(str(tmp_path / "s.kv"), theirs))
    child.start()
    try:
        assert ours.poll(60) and ours.recv() == "written"
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    left = os.listdir(tmp_path)
    assert len(left) == 1 and is_temp_name(left[0])  # no safetensors .tmpXXXXXX beside it


# ------------------------------------------------------------------------ the store


def test_store_whose_root_was_deleted(tmp_path, llama, state):
    model, tok = llama
    root = tmp_path / "store"
    store = KVStore(root, max_bytes=10**8)
    key = store.put(state)
    shutil.rmtree(root)
    assert store.get(key, model, tok) is None
    assert store.stats()["entries"] == 0
    with pytest.raises(EntryNotFoundError, match=key) as info:
        store.pin(key)
    assert isinstance(info.value, KeyError)
    assert store.evict(key) is False
    assert store.put(state) == key  # recreated
    assert same(snapshot(KVStore(root).get(key, model, tok)), snapshot(state))


def test_store_root_that_cannot_exist(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreUnavailableError) as info:
        KVStore(tmp_path / "file" / "store")
    assert isinstance(info.value, OSError)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(max_bytes=True), InvalidTypeError),
        (dict(max_bytes=1.5), InvalidTypeError),
        (dict(max_bytes=-1), InvalidInputError),
        (dict(chunk_tokens=0), InvalidInputError),
        (dict(lock_timeout=float("nan")), InvalidInputError),
        (dict(lock_timeout=-1), InvalidInputError),
    ],
    ids=repr,
)
def test_store_arguments(tmp_path, kwargs, error):
    with pytest.raises(error):
        KVStore(tmp_path, **kwargs)


def test_store_put_arguments(tmp_path, state):
    store = KVStore(tmp_path)
    for ttl in (True, float("nan"), 0, -1):
        with pytest.raises(InvalidInputError, match="ttl"):
            store.put(state, ttl=ttl)
    with pytest.raises(InvalidTypeError):
        store.put("not a state")
    with pytest.raises(InvalidTypeError, match="key"):
        store.get(None, *state_model(state))
    assert os.listdir(tmp_path / "entries") == []


def state_model(state):
    return state.model, state.tokenizer


def test_store_errors_live_in_kvedit_errors():
    import kvedit.store as store_module

    assert store_module.StoreLockTimeout is errors.StoreLockTimeout
    assert issubclass(errors.StoreLockTimeout, TimeoutError)
    assert issubclass(errors.EntryNotFoundError, KeyError)


def test_leftovers_count_against_max_bytes_and_are_swept(tmp_path, state):
    store = KVStore(tmp_path, max_bytes=10**9)
    key = store.put(state)
    entries = tmp_path / "entries"
    kept = store.stats()["bytes"]
    assert kept == sum(p.stat().st_size for p in entries.iterdir())  # records count too
    # what dead writers leave: kvedit's temporary directory holding safetensors' own file,
    # kvedit 0.1's .NAME.XXXX.tmp and a bare safetensors .tmpXXXXXX
    (entries / f".{key}.kv.kvedit-tmp-0123456789abcdef").mkdir()
    (entries / f".{key}.kv.kvedit-tmp-0123456789abcdef" / ".tmpQwErTy").write_bytes(b"a" * 5000)
    (entries / f".{key}.kv.abc123.tmp").write_bytes(b"b" * 3000)
    (entries / ".tmpAbC123").write_bytes(b"c" * 2000)
    past = time.time() - 2  # the listing's timestamp set past the racy second, no sleep
    os.utime(entries, (past, past))
    stats = store.stats()
    assert (stats["stray_files"], stats["stray_bytes"]) == (3, 10000)
    assert stats["bytes"] == kept + 10000
    KVStore(tmp_path)  # opening sweeps them
    assert sorted(os.listdir(entries)) == sorted([f"{key}.kv", f"{key}.json"])


def test_leftovers_are_swept_by_the_next_write(tmp_path, llama, state):
    model, tok = llama
    store = KVStore(tmp_path)
    (tmp_path / "entries" / ".x.kv.kvedit-tmp-0123456789abcdef").write_bytes(b"z" * 100)
    store.put(kvedit.capture(model, tok, "Another text entirely."))
    assert not [n for n in os.listdir(tmp_path / "entries") if n.startswith(".")]


def _saver(root: str, state) -> None:
    store = KVStore(root)
    while True:
        key = store.put(state)
        store.evict(key)


def test_kill_9_during_saves_leaves_nothing_after_open(tmp_path, llama):
    """Kill writers at random points of their saves: the next open leaves only whole entries."""
    model, tok = llama
    big = kvedit.capture(model, tok, RECORDS * 12)  # ~700 tokens
    good = kvedit.capture(model, tok, RECORDS)
    root = str(tmp_path / "s")
    good_key = KVStore(root).put(good)
    rng = random.Random(0)
    for _ in range(4):
        child = FORK.Process(target=_saver, args=(root, big))
        child.start()
        time.sleep(rng.uniform(0.3, 0.8))
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    store = KVStore(root)
    names = sorted(os.listdir(Path(root) / "entries"))
    assert not [n for n in names if n.startswith(".")], names
    stats = store.stats()
    assert stats["stray_files"] == 0
    assert stats["bytes"] == sum((Path(root) / "entries" / n).stat().st_size for n in names)
    assert len(names) == 2 * stats["entries"]
    assert same(snapshot(store.get(good_key, model, tok)), snapshot(good))
    big_key = store.key_for(model, tok, big.token_ids.tolist())
    got = store.get(big_key, model, tok)
    assert got is None or same(snapshot(got), snapshot(big))


# ------------------------------------------------------------------------ fingerprints


def test_fingerprint_sees_a_change_in_the_middle_of_a_tensor():
    from kvedit.fingerprint import legacy_model_fingerprint

    model, _ = tiny_model("llama")
    before, legacy = model_fingerprint(model), legacy_model_fingerprint(model)
    weight = model.model.layers[1].mlp.up_proj.weight
    middle = weight.numel() // 2
    assert 2048 <= middle < weight.numel() - 2048  # outside what the old sample read
    with torch.no_grad():
        weight.view(-1)[middle] += 0.5  # in place: the version counter moves
    after = model_fingerprint(model)
    assert after != before
    assert legacy_model_fingerprint(model) == legacy  # the old fingerprint missed it
    with torch.no_grad():
        weight.view(-1)[middle] -= 0.5
    assert model_fingerprint(model) == before


def test_fingerprint_is_the_same_for_the_bf16_copy():
    model, _ = tiny_model("llama")
    copy, _ = tiny_model("llama")
    assert model_fingerprint(copy) == model_fingerprint(model)
    assert model_fingerprint(copy.to(torch.bfloat16)) == model_fingerprint(model)
    assert model_fingerprint(tiny_model("llama", dtype=torch.bfloat16)[0]) == model_fingerprint(
        model
    )
    other, _ = tiny_model("llama", seed=1)
    assert model_fingerprint(other) != model_fingerprint(model)


def test_bf16_model_loads_a_float32_cache(tmp_path, llama, state):
    model, tok = llama
    state.save(tmp_path / "s.kv")
    half, _ = tiny_model("llama", dtype=torch.bfloat16)
    loaded = kvedit.load_state(tmp_path / "s.kv", half, tok)
    assert loaded.layers[0].keys.dtype == torch.bfloat16


def test_fingerprint_is_memoised_and_invalidated(monkeypatch):
    import kvedit.fingerprint as fp

    model, _ = tiny_model("llama")
    calls = []
    real = fp.tensor_digest
    monkeypatch.setattr(fp, "tensor_digest", lambda t: calls.append(1) or real(t))
    first = model_fingerprint(model)
    n_tensors = len(calls)
    assert n_tensors > 0
    assert model_fingerprint(model) == first and len(calls) == n_tensors  # memoised
    with torch.no_grad():
        model.model.norm.weight.mul_(2)
    assert model_fingerprint(model) != first
    assert len(calls) == n_tensors + 1  # only the changed tensor was hashed again
    with torch.no_grad():
        model.model.norm.weight.data.div_(2)  # through .data: not seen ...
    forget(model)  # ... until forgotten
    assert model_fingerprint(model) == first


def test_tokenizer_fingerprint_is_memoised_per_tokenizer(monkeypatch):
    tok = tiny_tokenizer()
    first = tokenizer_fingerprint(tok)
    calls = []
    real = tok.get_vocab
    monkeypatch.setattr(tok, "get_vocab", lambda: calls.append(1) or real())
    assert tokenizer_fingerprint(tok) == first and calls == []
    tok.add_tokens(["<new>"])
    assert tokenizer_fingerprint(tok) != first and calls == [1]


@pytest.mark.real
def test_smollm2_fingerprint_is_fast(smollm2):
    model, _ = smollm2
    forget(model)
    start = time.perf_counter()
    model_fingerprint(model)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, elapsed  # ~0.2 s on 2 idle cores; generous for a busy machine
    start = time.perf_counter()
    model_fingerprint(model)
    assert time.perf_counter() - start < 0.05  # memoised


# ------------------------------------------------------------------------ errors


def test_moved_errors_are_the_same_classes():
    import kvedit.evals.tasks as tasks
    import kvedit.triton as triton
    from kvedit.triton import _common

    assert triton.KernelInputError is errors.KernelInputError is _common.KernelInputError
    assert triton.TritonUnavailableError is errors.TritonUnavailableError
    assert tasks.InvalidExampleError is errors.InvalidExampleError
    assert issubclass(errors.NestedSteeringError, KVEditError)
    assert issubclass(errors.NestedSteeringError, RuntimeError)
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, KVEditError), name
        assert cls.__module__ == "kvedit.errors", name
