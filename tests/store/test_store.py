"""KVStore: content keys, prefix lookup, tiers, pin/TTL, and crash/concurrency safety."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import RECORDS
from helpers import reference_generate, same, snapshot

import kvedit
from kvedit import ops
from kvedit.atomic import TEMP_MARKER, host_tag, is_temp_name
from kvedit.errors import CacheMismatchError, InvalidInputError, NotACaptureError
from kvedit.store import KVStore, StoreLockTimeout, chain_root, chunk_hashes, content_key
from kvedit.testing import tiny_model

CHUNK = 16
SHORT = RECORDS[: RECORDS.index(" Carol")]  # ends at a token boundary of RECORDS


def texts(i: int) -> str:
    """Distinct texts of about 40 tokens."""
    return f"Record {i}: " + RECORDS[: 60 + 7 * i]


def entry_files(root) -> list[str]:
    return sorted(p.name for p in (Path(root) / "entries").iterdir())


# ------------------------------------------------------------------ keys and round trips


def test_keys_chain_chunk_hashes():
    root = chain_root("m" * 32, "t" * 32)
    a = list(range(40))
    b = a[:32] + [7, 7, 7]
    ha, hb = chunk_hashes(root, a, CHUNK), chunk_hashes(root, b, CHUNK)
    assert len(ha) == 3 and ha[:3] == hb[:3]  # two shared full chunks (+ the root)
    assert content_key("m" * 32, "t" * 32, a[:32], CHUNK) == ha[2]  # whole chunks: last hash
    keys = {content_key("m" * 32, "t" * 32, ids, CHUNK) for ids in (a, b, a[:39], a[:33])}
    assert len(keys) == 4
    assert content_key("x" * 32, "t" * 32, a, CHUNK) != content_key("m" * 32, "t" * 32, a, CHUNK)
    assert chunk_hashes(root, [1, 2, 3], CHUNK) == [root]


def test_put_get_round_trip(tmp_path, llama):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    store = KVStore(tmp_path)
    key = store.put(state)
    assert len(key) == 32 and int(key, 16) >= 0
    assert key == store.key_for(model, tok, state.token_ids.tolist())
    loaded = KVStore(tmp_path).get(key, model, tok)  # fresh object: from disk
    assert same(snapshot(loaded), snapshot(state)) and loaded.text == state.text
    assert loaded.generate(" What is", 8) == state.generate(" What is", 8)
    other_model, _ = tiny_model("llama", seed=1)
    with pytest.raises(CacheMismatchError):
        store.get(key, other_model, tok)
    assert store.get("0" * 32, model, tok) is None
    for bad in ("../../etc/passwd", key.upper(), key[:-1]):
        with pytest.raises(ValueError, match="not a KVStore key"):
            store.get(bad, model, tok)
    # no pickles anywhere: safetensors entries, JSON records
    for name in entry_files(tmp_path):
        raw = (tmp_path / "entries" / name).read_bytes()
        if name.endswith(".json"):
            assert json.loads(raw)["key"] == key
        else:
            assert kvedit.load_state(tmp_path / "entries" / name, model, tok).text == state.text


def test_weights_changed_in_place_miss_the_store(tmp_path):
    """The store keys on the memoised model fingerprint: after an in-place weight write the
    memo is invalidated, so the old entry is neither found by prefix nor served as this
    model's (fetching it by key is a mismatch), and putting again stores a new entry."""
    model, tok = tiny_model("llama")
    store = KVStore(tmp_path, memory_bytes=10**8)
    key = store.put(kvedit.capture(model, tok, RECORDS))
    assert store.longest_prefix(model, tok, RECORDS + " More.")[1] > 0
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] += 1.0
    assert store.key_for(model, tok, tok(RECORDS)["input_ids"]) != key
    assert store.longest_prefix(model, tok, RECORDS + " More.") == (None, 0)
    with pytest.raises(CacheMismatchError):
        store.get(key, model, tok)
    assert store.put(kvedit.capture(model, tok, RECORDS)) != key


def _refused_states(model, tok):
    """``(name, state, phrase its refusal names)``: every kind of state the store must refuse.
    Several (scaled keys, a projection, an unknown history) have tensors that look like a
    capture's; only their history says otherwise."""
    from kvedit.provenance import History, Origin

    state = kvedit.capture(model, tok, RECORDS)
    long = kvedit.capture(model, tok, RECORDS * 2)
    return [
        ("emphasize", ops.emphasize(state, "Carol", 2.0), "emphasize"),
        ("suppress", ops.suppress(state, "Carol", 2.0), "suppress"),
        ("scale_keys", ops.scale_keys(state, "Carol", 1.5), "scale_keys"),
        ("duplicate", ops.duplicate(state, "Carol", 1), "duplicate"),
        ("reread", ops.reread(state, "Carol"), "reread"),
        ("quantize", ops.quantize(long, bits=8), "quantize"),
        ("snapkv", ops.snapkv(long, keep=0.5, window=4), "snapkv"),
        ("unknown", state.replace(history=History.unknown()), "unknown history"),
        ("projection", state.replace(history=History(Origin("projection"))), "projection"),
        ("blend", state.replace(history=History(Origin("blend"))), "blend"),
        (
            "edit-then-extend",  # a plain extension of an edited state is still edited
            ops.scale_keys(state, "Carol", 1.5).extend(" More."),
            "scale_keys",
        ),
    ]


def test_put_refuses_every_state_that_is_not_a_plain_capture(tmp_path, llama):
    model, tok = llama
    store = KVStore(tmp_path)
    for name, edited, phrase in _refused_states(model, tok):
        with pytest.raises(NotACaptureError, match="unedited captures only") as e:
            store.put(edited)
        assert phrase in str(e.value), name
        assert store.refusal(edited) is not None, name
    assert entry_files(tmp_path) == []
    plain = kvedit.capture(model, tok, RECORDS)
    assert store.refusal(plain) is None
    store.put(plain.extend(" More."))  # an extension of a capture is a capture


def test_put_refuses_a_hand_built_state_whose_tensors_are_edited(tmp_path, llama):
    """The history is checked first; the tensors are still checked (a state that claims to be a
    capture but holds a bias is refused)."""
    import dataclasses

    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    first = state.layers[0]
    biased = state.replace(
        layers=[dataclasses.replace(first, bias=torch.ones(1, 2, len(first))), *state.layers[1:]]
    )
    assert biased.is_plain_capture  # it lies
    with pytest.raises(NotACaptureError, match="has a bias"):
        KVStore(tmp_path).put(biased)


def test_declared_casts(tmp_path, llama):
    """A lossy cast (a float32 capture saved in bfloat16 and loaded) is refused, unless the
    store was told to allow casts to that dtype; exact casts always pass."""
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    state.save(tmp_path / "half.kv", dtype=torch.bfloat16)
    half = kvedit.load_state(tmp_path / "half.kv", model, tok)
    with pytest.raises(InvalidInputError, match="cast"):
        KVStore(tmp_path / "a").put(half)
    store = KVStore(tmp_path / "b", allow_casts=[torch.bfloat16])
    key = store.put(half)
    assert KVStore(tmp_path / "b", allow_casts=["bfloat16"]).get(key, model, tok) is not None
    state.save(tmp_path / "wide.kv", dtype=torch.float64)
    KVStore(tmp_path / "a").put(kvedit.load_state(tmp_path / "wide.kv", model, tok))


def _as_written_by_0_2(path) -> None:
    """Rewrite a store entry's state file as kvedit 0.2 wrote it: format 2, no history."""
    from safetensors.torch import save_file

    from kvedit.states.files.format import crc32_of
    from kvedit.states.files.read import read_state_file

    found = read_state_file(path)
    meta, tensors = found.meta, found.tensors
    meta.pop("seal")
    for name in ("history", "kv_dtype", "last_input"):
        del meta[name]
    meta["format_version"] = 2
    meta["checksum"] = crc32_of(tensors)
    save_file(tensors, str(path), metadata={"kvedit": json.dumps(meta)})


def test_entries_without_history_are_misses_and_recomputed(tmp_path, llama):
    """An entry written before kvedit 0.3 may hold anything (0.2 stored scaled keys and
    projections): it is never served; it is a miss, dropped, and reuse recomputes and
    stores the prompt again, with its history."""
    model, tok = llama
    key = KVStore(tmp_path).put(kvedit.capture(model, tok, RECORDS))
    _as_written_by_0_2(tmp_path / "entries" / f"{key}.kv")
    store = KVStore(tmp_path)
    assert store.fetch(key, model, tok) == (None, "miss")
    assert store.stats()["stale"] == 1 and store.stats()["entries"] == 0

    key = KVStore(tmp_path).put(kvedit.capture(model, tok, RECORDS))
    _as_written_by_0_2(tmp_path / "entries" / f"{key}.kv")
    store = KVStore(tmp_path)
    assert store.longest_prefix(model, tok, RECORDS + " More.") == (None, 0)
    key = KVStore(tmp_path).put(kvedit.capture(model, tok, RECORDS))
    _as_written_by_0_2(tmp_path / "entries" / f"{key}.kv")
    state, report = kvedit.reuse(model, tok, RECORDS + " More.", KVStore(tmp_path))
    assert report.tokens_reused == 0 and state.is_plain_capture
    assert kvedit.reuse(model, tok, RECORDS + " More.", KVStore(tmp_path))[1].source == "disk"
    served = KVStore(tmp_path).get(report.key, model, tok)
    assert served.is_plain_capture and served.digest == state.digest


# ------------------------------------------------------------------ prefix lookup


def test_longest_prefix_whole_entry_and_chunk_cut(tmp_path, llama):
    model, tok = llama
    store = KVStore(tmp_path, chunk_tokens=CHUNK)
    base = kvedit.capture(model, tok, RECORDS)  # 56 tokens: 3 full chunks + 8
    store.put(base)
    state, n = store.longest_prefix(model, tok, RECORDS + " Question: who?")
    assert n == len(base)  # the whole entry
    assert same(snapshot(state)[3:], snapshot(base)[3:])  # the same cache entries
    # a prompt sharing the first 3 chunks only: the entry is cut at 48 tokens
    ids = base.token_ids.tolist()
    prompt = tok.decode(ids[:48], skip_special_tokens=True) + " Zebra Zebra Zebra Zebra Zebra"
    prompt_ids = tok(prompt)["input_ids"]
    assert prompt_ids[:48] == ids[:48] and prompt_ids[48:52] != ids[48:52]
    state, n = store.longest_prefix(model, tok, prompt)
    assert n == 48 and len(state) == 48 and state.token_ids.tolist() == ids[:48]
    assert all(len(layer) == 48 for layer in state.layers)
    # the cut state's last logits were recomputed: it continues like a fresh prefill
    assert state.generate(" x", 10) == reference_generate(model, tok, ids[:48], " x", 10)
    torch.testing.assert_close(
        state.last_logits, model(torch.tensor([ids[:48]])).logits[0, -1], atol=1e-4, rtol=1e-4
    )
    assert store.longest_prefix(model, tok, "Zebra " + RECORDS) == (None, 0)


def test_longest_prefix_prefers_the_longest_entry(tmp_path, llama):
    model, tok = llama
    store = KVStore(tmp_path, chunk_tokens=CHUNK, memory_bytes=10**8)
    short = kvedit.capture(model, tok, SHORT)
    long = kvedit.capture(model, tok, RECORDS)
    store.put(short)
    store.put(long)
    _, n = store.longest_prefix(model, tok, RECORDS + " And more.")
    assert n == len(long)
    _, n = store.longest_prefix(model, tok, SHORT + " Zebra Zebra Zebra.")
    assert n == len(short)  # the short entry whole beats the long one cut at 16


def test_sliding_window_entries_are_used_whole_only(tmp_path, gemma3):
    model, tok = gemma3
    store = KVStore(tmp_path, chunk_tokens=CHUNK)
    base = kvedit.capture(model, tok, RECORDS)
    store.put(base)
    assert store.longest_prefix(model, tok, RECORDS + " Q?")[1] == len(base)
    ids = base.token_ids.tolist()
    assert store.longest_prefix(
        model, tok, tok.decode(ids[:48], skip_special_tokens=True) + " Zebra Zebra"
    ) == (None, 0)


# ------------------------------------------------------------------ tiers, eviction, pin, TTL


def test_disk_lru_eviction_by_bytes(tmp_path, llama):
    model, tok = llama
    states = [kvedit.capture(model, tok, texts(i)) for i in range(4)]
    probe = KVStore(tmp_path / "probe")
    probe.put(states[0])
    size = probe.stats()["bytes"]
    store = KVStore(tmp_path / "s", max_bytes=int(size * 2.9))  # room for two entries
    keys = [store.put(states[0]), store.put(states[1])]
    time.sleep(0.02)
    assert store.get(keys[0], model, tok) is not None  # 0 is now more recent than 1
    keys.append(store.put(states[2]))
    assert store.get(keys[1], model, tok) is None  # the least recently used went
    assert store.get(keys[0], model, tok) is not None
    assert store.get(keys[2], model, tok) is not None
    stats = store.stats()
    assert stats["entries"] == 2 and stats["bytes"] <= store.max_bytes and stats["evictions"] == 1
    # an entry larger than the whole budget is not written
    tiny = KVStore(tmp_path / "tiny", max_bytes=size // 2)
    tiny.put(states[3])
    assert tiny.stats()["entries"] == 0 and tiny.stats()["rejected"] == 1


def test_memory_tier_lru_and_hits(tmp_path, llama):
    model, tok = llama
    states = [kvedit.capture(model, tok, texts(i)) for i in range(3)]
    budget = int(max(s.nbytes for s in states) * 2.5)
    store = KVStore(tmp_path, memory_bytes=budget)
    keys = [store.put(s) for s in states]
    stats = store.stats()
    assert stats["memory_entries"] == 2 and stats["memory_bytes"] <= budget
    assert store.fetch(keys[2], model, tok)[1] == "memory"
    assert store.fetch(keys[0], model, tok)[1] == "disk"  # evicted from memory, promoted back
    assert store.fetch(keys[0], model, tok)[1] == "memory"
    assert store.fetch(keys[1], model, tok)[1] == "disk"  # 1 was the least recent one
    stats = store.stats()
    assert (stats["hits_memory"], stats["hits_disk"]) == (2, 2)
    got = store.get(keys[2], model, tok)
    assert got.model is model and got.generate(" x", 5) == states[2].generate(" x", 5)


def test_pin_ttl_and_evict(tmp_path, llama):
    model, tok = llama
    states = [kvedit.capture(model, tok, texts(i)) for i in range(3)]
    probe = KVStore(tmp_path / "probe")
    probe.put(states[0])
    size = probe.stats()["bytes"]
    store = KVStore(tmp_path / "s", max_bytes=int(size * 2.5))
    hot = store.put(states[0])
    store.pin(hot)
    time.sleep(0.02)
    b = store.put(states[1])
    time.sleep(0.02)
    store.put(states[2])  # over budget: b goes, although hot is older
    assert store.get(hot, model, tok) is not None and store.get(b, model, tok) is None
    assert store.stats()["pinned"] == 1
    with pytest.raises(KeyError):
        store.pin("f" * 32)
    assert store.evict(hot) and not store.evict(hot)
    assert store.get(hot, model, tok) is None
    # TTL: served until it expires; pinning overrides it
    ttl_store = KVStore(tmp_path / "t")
    cold = ttl_store.put(states[1], ttl=0.2)
    warm = ttl_store.put(states[2], ttl=0.2)
    ttl_store.pin(warm)
    memory = KVStore(tmp_path / "m", memory_bytes=10**8)  # TTL holds in the memory tier too
    memory_cold = memory.put(states[1], ttl=0.2)
    assert ttl_store.get(cold, model, tok) is not None
    assert memory.fetch(memory_cold, model, tok)[1] == "memory"
    time.sleep(0.3)
    assert ttl_store.get(cold, model, tok) is None
    assert memory.get(memory_cold, model, tok) is None
    assert ttl_store.get(warm, model, tok) is not None
    ttl_store.unpin(warm)
    assert ttl_store.get(warm, model, tok) is None  # expired as soon as it was unpinned
    assert KVStore(tmp_path / "t").stats()["entries"] == 0  # gone from disk too
    with pytest.raises(ValueError, match="ttl"):
        ttl_store.put(states[0], ttl=0)
    # expired entries are swept from disk by the next write, read or not
    short = ttl_store.put(states[0], ttl=0.05)
    time.sleep(0.1)
    ttl_store.put(states[1])
    assert not (tmp_path / "t" / "entries" / f"{short}.kv").exists()
    assert ttl_store.stats()["expired"] >= 1


# ------------------------------------------------------------------ corruption and crashes


def test_corrupt_entry_is_dropped_not_served(tmp_path, llama):
    model, tok = llama
    store = KVStore(tmp_path, chunk_tokens=CHUNK)
    short = kvedit.capture(model, tok, SHORT)
    long = kvedit.capture(model, tok, RECORDS)
    store.put(short)
    key = store.put(long)
    path = tmp_path / "entries" / f"{key}.kv"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x04
    path.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="corrupt"):
        state, n = store.longest_prefix(model, tok, RECORDS + " Q?")
    assert n == len(short)  # the corrupt longer entry was skipped and dropped
    assert same(snapshot(state)[3:], snapshot(short)[3:])
    assert not path.exists() and store.get(key, model, tok) is None
    assert store.stats()["corrupt"] == 1


# Child processes are forked: they share the parent's imported modules and precomputed states,
# so they start at once; the store they open is their own, as in any other process.
FORK = multiprocessing.get_context("fork")


def _killed_writer(root: str, state, mode: str, conn) -> None:
    """Put ``state``, stalling (to be SIGKILLed) half-way through the .kv or before the record."""
    import kvedit.states.files.write as statefile
    import kvedit.store as ks

    store = ks.KVStore(root)
    if mode == "data":
        real = statefile.save_file

        def stalled(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            with open(filename, "r+b") as f:
                f.truncate(f.seek(0, 2) // 2)
            conn.send("writing")
            time.sleep(60)

        statefile.save_file = stalled  # the writer process is forked: this patch stays in it
    else:

        def stalled(self, meta):
            conn.send("writing")
            time.sleep(60)

        ks.KVStore._write_record = stalled
    store.put(state)


@pytest.mark.parametrize("mode", ["data", "record"])
def test_writer_killed_mid_write_leaves_store_consistent(tmp_path, llama, mode):
    model, tok = llama
    good = kvedit.capture(model, tok, RECORDS)
    lost = kvedit.capture(model, tok, "Alice's secret number is 4821. " * 12)
    good_key = KVStore(tmp_path).put(good)
    ours, theirs = FORK.Pipe()
    child = FORK.Process(target=_killed_writer, args=(str(tmp_path), lost, mode, theirs))
    child.start()
    try:
        assert ours.poll(60) and ours.recv() == "writing"
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == -signal.SIGKILL
    # what the killed writer left: a partial temporary file, or a .kv without its record
    left = entry_files(tmp_path)
    assert any(is_temp_name(name) for name in left) == (mode == "data")
    assert len([n for n in left if n.endswith(".kv")]) == (1 if mode == "data" else 2)
    store = KVStore(tmp_path)  # recovery runs on open
    lost_key = store.key_for(model, tok, lost.token_ids.tolist())
    names = entry_files(tmp_path)
    assert not [n for n in names if n.startswith(".")]
    assert same(snapshot(store.get(good_key, model, tok)), snapshot(good))
    if mode == "data":  # the half-written entry never became visible
        assert store.get(lost_key, model, tok) is None
        assert names == sorted([f"{good_key}.json", f"{good_key}.kv"])
    else:  # the complete .kv got its record rebuilt from the file
        assert same(snapshot(store.get(lost_key, model, tok)), snapshot(lost))
        assert store.stats()["entries"] == 2


def test_orphan_and_broken_files_are_cleaned_on_open(tmp_path, llama):
    model, tok = llama
    key = KVStore(tmp_path).put(kvedit.capture(model, tok, RECORDS))
    entries = tmp_path / "entries"
    (entries / ("a" * 32 + ".json")).write_text("{}")  # a record without its file
    (entries / ("b" * 32 + ".kv")).write_bytes(b"\x80\x04 not safetensors")  # junk file
    os.unlink(entries / f"{key}.json")  # an entry whose record was lost
    store = KVStore(tmp_path)
    assert entry_files(tmp_path) == sorted([f"{key}.json", f"{key}.kv"])
    assert store.get(key, model, tok) is not None


def _writer(root: str, states, budget: int) -> None:
    store = KVStore(root, max_bytes=budget)
    for state in states:
        store.put(state)


def test_concurrent_writers_and_readers(tmp_path, llama):
    model, tok = llama
    texts_by = {(w, i): f"Writer {w} entry {i}. " * 6 for w in range(2) for i in range(10)}
    states = {k: kvedit.capture(model, tok, t) for k, t in texts_by.items()}
    KVStore(tmp_path / "probe").put(states[0, 0])
    budget = int(KVStore(tmp_path / "probe").stats()["bytes"] * 8.5)  # forces evictions
    root = str(tmp_path / "s")
    reader = KVStore(root, max_bytes=budget)
    procs = [
        FORK.Process(target=_writer, args=(root, [states[w, i] for i in range(10)], budget))
        for w in range(2)
    ]
    for p in procs:
        p.start()
    keys = {reader.key_for(model, tok, s.token_ids.tolist()): k for k, s in states.items()}
    served = 0
    while any(p.is_alive() for p in procs):
        for key, which in keys.items():
            state = reader.get(key, model, tok)  # never a partial or corrupt entry
            if state is not None:
                assert state.text == texts_by[which]
                served += 1
        time.sleep(0.005)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    final = KVStore(root, max_bytes=budget)
    stats = final.stats()
    assert stats["corrupt"] == 0 and reader.stats()["corrupt"] == 0
    assert stats["entries"] > 0 and stats["bytes"] <= budget and stats["evictions"] == 0
    names = entry_files(root)
    assert len(names) == 2 * stats["entries"] and not [n for n in names if n.startswith(".")]
    for name in names:
        assert final.get(Path(name).stem, model, tok).text in texts_by.values()
    assert served > 0


def test_stuck_writer_is_refused_clearly(tmp_path, llama):
    import fcntl

    model, tok = llama
    store = KVStore(tmp_path, lock_timeout=0.2)
    state = kvedit.capture(model, tok, RECORDS)
    with open(tmp_path / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(StoreLockTimeout, match="held the store lock"):
            store.put(state)
        assert store.get(store.key_for(model, tok, state.token_ids.tolist()), model, tok) is None
    store.put(state)  # released: writes again


def test_threads_share_a_store(tmp_path, llama):
    model, tok = llama
    store = KVStore(tmp_path, memory_bytes=10**7)
    states = [kvedit.capture(model, tok, texts(i)) for i in range(6)]
    errors = []

    def work(i):
        try:
            key = store.put(states[i])
            assert store.get(key, model, tok).text == states[i].text
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and KVStore(tmp_path).stats()["entries"] == 6


def test_store_config_is_fixed_at_creation(tmp_path):
    KVStore(tmp_path, chunk_tokens=64)
    assert KVStore(tmp_path).chunk_tokens == 64
    with pytest.raises(ValueError, match="chunk_tokens=64"):
        KVStore(tmp_path, chunk_tokens=128)
    with pytest.raises(ValueError, match="max_bytes"):
        KVStore(tmp_path / "x", max_bytes=-1)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_scan_removes_what_a_dead_writer_left_while_the_lock_is_held(tmp_path, llama):
    """A writer killed mid-save leaves its temporary directory: any scan removes it (no lock
    needed: its writer is gone), while another writer holds the lock; a running writer's stays."""
    import fcntl

    model, tok = llama
    store = KVStore(tmp_path)
    key = store.put(kvedit.capture(model, tok, RECORDS))
    entries = tmp_path / "entries"
    kept = store.stats()["bytes"]
    dead = entries / f".{key}.kv{TEMP_MARKER}{_dead_pid()}@{host_tag()}-{'a' * 16}"
    running = entries / f".{key}.kv{TEMP_MARKER}{os.getpid()}@{host_tag()}-{'b' * 16}"
    for leftover in (dead, running):
        leftover.mkdir()
        (leftover / f"{key}.kv").write_bytes(b"x" * 5000)
    with open(tmp_path / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a writer at work: the store's own sweep cannot run
        stats = store.stats()
        assert not dead.exists() and running.exists()
        assert (stats["stray_files"], stats["bytes"]) == (1, kept + 5000)
        assert store.get(key, model, tok) is not None
