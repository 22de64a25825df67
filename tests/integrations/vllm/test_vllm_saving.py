"""The save path without vLLM: a paged cache's layout probed through its writer and read back
(:mod:`kvedit.integrations.vllm.saving`), which finished requests are saved, and the saved turn's
file (:mod:`kvedit.integrations.vllm.turns`).

The writers below lay caches out as vLLM's backends do: the CPU backend's
``[blocks, kv_heads, block, 2 * head_dim]`` with keys column-major inside a block, and a
GPU-style ``[2, blocks, block, kv_heads, head_dim]`` with keys and values in two planes. The
engine's own writer is exercised in ``test_vllm_engine_chat.py``.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvedit.errors import KVEditError
from kvedit.integrations.vllm import saving, turns

H, BS, D, NB = 3, 8, 4, 5


def cpu_writer(k, v, cache, slots):
    """vLLM's CPU (VEC) layout: per (block, head) keys ``[D, BS]`` then values ``[BS, D]``."""
    view = cache.view(cache.shape[0], H, 2, BS * D)
    keys = view[:, :, 0].view(-1, H, D, BS)
    values = view[:, :, 1].view(-1, H, BS, D)
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, BS)
        keys[b, :, :, o] = k[i]
        values[b, :, o, :] = v[i]


def planes_writer(k, v, cache, slots):
    """A GPU-style layout: ``[2, blocks, block, kv_heads, head_dim]``."""
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, BS)
        cache[0, b, o] = k[i]
        cache[1, b, o] = v[i]


LAYOUTS = {
    "cpu": (cpu_writer, (NB, H, BS, 2 * D)),
    "planes": (planes_writer, (2, NB, BS, H, D)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_probed_layout_reads_back_each_token_written(layout):
    write, shape = LAYOUTS[layout]
    cache = torch.zeros(shape)
    slot_map = saving.probe(write, cache, BS, H, D)
    blocks = [3, 1, 4]  # a request's blocks, out of order
    n = 2 * BS + 3
    k, v = torch.randn(n, H, D), torch.randn(n, H, D)
    token = torch.arange(n)
    slots = torch.tensor(blocks)[token // BS] * BS + token % BS
    write(k, v, cache, slots)
    got_k, got_v = saving.gather(cache, slot_map, blocks, 5, n)
    assert torch.equal(got_k, k[5:]) and torch.equal(got_v, v[5:])
    assert torch.count_nonzero(cache) > 0  # the probe wrote a scratch tensor, not the cache
    before = cache.clone()
    saving.probe(write, cache, BS, H, D)
    assert torch.equal(cache, before)


def test_a_layout_the_codes_do_not_read_back_from_is_refused():
    def lossy(k, v, cache, slots):  # drops the last head's values
        planes_writer(k, v.clone().index_fill_(1, torch.tensor([H - 1]), 0.0), cache, slots)

    with pytest.raises(KVEditError, match="could not be read back"):
        saving.probe(lossy, torch.zeros(2, NB, BS, H, D), BS, H, D)


def test_caches_kvedit_cannot_read_exactly_are_refused():
    with pytest.raises(KVEditError, match="float32"):
        saving.probe(planes_writer, torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16), BS, H, D)
    cache = torch.zeros(2, NB, BS, H, D)
    slot_map = saving.probe(planes_writer, cache, BS, H, D)
    with pytest.raises(KVEditError, match="not contiguous"):
        saving.gather(cache.transpose(1, 2), slot_map, [1], 0, 2)
    with pytest.raises(KVEditError, match="not in the request's 1 blocks"):
        saving.gather(cache, slot_map, [1], 0, BS + 1)


def request(status="FINISHED_STOPPED", computed=12, tokens=13):
    return SimpleNamespace(
        request_id="r1",
        status=SimpleNamespace(name=status),
        num_computed_tokens=computed,
        num_tokens=tokens,
        all_token_ids=list(range(100, 100 + tokens)),
    )


def test_a_turn_saves_the_tokens_after_the_loaded_ones_up_to_the_last_with_kv():
    spec = saving.save_spec(request(), "t", {"served": 4}, ([7, 8],))
    assert (spec.start, spec.token_ids, spec.block_ids) == (4, list(range(104, 112)), [7, 8])
    spec = saving.save_spec(request(computed=13), "t", None, [7, 8])
    assert spec.start == 0 and spec.token_ids == list(range(100, 112))  # never the last token
    # vLLM's front end aborts a request that met a stop string: its turn is saved
    assert saving.save_spec(request("FINISHED_ABORTED"), "t", None, [7]).token_ids
    with pytest.raises(KVEditError, match="FINISHED_ERROR"):
        saving.save_spec(request("FINISHED_ERROR"), "t", None, [7])
    with pytest.raises(KVEditError, match="refused"):
        saving.save_spec(request(), "t", {"refused": "corrupt"}, [7])


def test_turns_nobody_took_are_swept(tmp_path):
    import os

    keys, values = [torch.zeros(1, H, D)], [torch.ones(1, H, D)]
    old = turns.write_turn(tmp_path, "e" * 32, 0, [9], keys, values)
    new = turns.write_turn_error(tmp_path, "f" * 32, "gone")
    os.utime(old, (time.time() - 2 * turns.STALE_TURN_SECONDS,) * 2)
    assert turns.sweep_turns(tmp_path) == 1
    assert not old.exists() and new.exists()


def test_a_saved_turn_round_trips_and_an_error_or_a_timeout_is_said(tmp_path):
    keys = [torch.randn(3, H, D) for _ in range(2)]
    values = [torch.randn(3, H, D) for _ in range(2)]
    turns.write_turn(tmp_path, "a" * 32, 5, [1, 2, 3], keys, values)
    got = turns.wait_turn(tmp_path, "a" * 32, 1.0)
    assert (got.start, got.end, got.token_ids) == (5, 8, [1, 2, 3])
    assert all(torch.equal(x, y) for x, y in zip(got.keys + got.values, keys + values))
    turns.remove_turn(tmp_path, "a" * 32)
    assert not list((tmp_path / turns.TURNS).iterdir())
    turns.write_turn_error(tmp_path, "b" * 32, "no blocks")
    with pytest.raises(KVEditError, match="no blocks"):
        turns.wait_turn(tmp_path, "b" * 32, 1.0)
    with pytest.raises(KVEditError, match="saved nothing for turn"):
        turns.wait_turn(tmp_path, "c" * 32, 0.05)


def test_a_turn_written_while_waiting_is_taken(tmp_path):
    keys, values = [torch.zeros(1, H, D)], [torch.ones(1, H, D)]
    later = threading.Timer(0.1, turns.write_turn, (tmp_path, "d" * 32, 0, [9], keys, values))
    later.start()
    t0 = time.monotonic()
    assert turns.wait_turn(tmp_path, "d" * 32, 10.0).token_ids == [9]
    assert time.monotonic() - t0 < 5
