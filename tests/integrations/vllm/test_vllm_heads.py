"""Tensor-parallel KV-head slicing (kvedit.integrations.vllm.heads), without vLLM.

The connector loads a published file, which holds all KV heads, on every tensor-parallel rank
and keeps that rank's heads. vLLM's rule (``QKVParallelLinear`` in vLLM 0.32): ``H`` KV heads on
``T`` ranks are split evenly when ``T < H`` and replicated, one head per rank, when ``T >= H``;
other combinations are refused. Checked here three ways: against tables written out by hand,
against a transcription of vLLM's weight-loader code, and by simulating each rank's paged cache
and attention, whose outputs must together equal the unsharded attention.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from kvedit.errors import InvalidInputError
from kvedit.integrations.vllm import heads
from kvedit.integrations.vllm.heads import (
    kv_head_replicas,
    kv_heads_per_rank,
    rank_kv_heads,
    slice_for_rank,
)

# (total KV heads, tp size) -> each rank's heads, written out by hand
TABLES = {
    (3, 1): [[0, 1, 2]],  # SmolLM2 on one rank
    (3, 3): [[0], [1], [2]],  # SmolLM2 on TP=3
    (8, 2): [[0, 1, 2, 3], [4, 5, 6, 7]],  # Llama-3-8B on TP=2
    (6, 3): [[0, 1], [2, 3], [4, 5]],
    (1, 2): [[0], [0]],  # Gemma-3-270M on TP=2: the head replicated
    (1, 4): [[0], [0], [0], [0]],
    (3, 6): [[0], [0], [1], [1], [2], [2]],  # consecutive ranks share a head
    (2, 8): [[0], [0], [0], [0], [1], [1], [1], [1]],
    (8, 8): [[h] for h in range(8)],
}

# every (total KV heads, tp size) up to 16 that vLLM accepts, and every one it refuses
VALID = [(h, t) for h in range(1, 17) for t in range(1, 17) if (h % t == 0 or t % h == 0)]
INVALID = [(h, t) for h in range(1, 17) for t in range(1, 17) if h % t and t % h]


def _vllm_reference(total_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """vLLM 0.32's code, transcribed: QKVParallelLinear.__init__ and the "k"/"v" branch of its
    weight_loader (``divide`` asserts divisibility), applied to a weight whose rows are heads."""

    def divide(a: int, b: int) -> int:
        assert a % b == 0, f"{a} is not divisible by {b}"
        return a // b

    if tp_size >= total_kv_heads:
        num_kv_heads = 1
        num_kv_head_replicas = divide(tp_size, total_kv_heads)
    else:
        num_kv_heads = divide(total_kv_heads, tp_size)
        num_kv_head_replicas = 1
    shard_size = num_kv_heads  # in heads (vLLM's is in rows: heads x head_size)
    shard_rank = rank // num_kv_head_replicas
    start_idx = shard_rank * shard_size
    weight = torch.arange(total_kv_heads)  # row h of the full k_proj belongs to head h
    return weight.narrow(0, start_idx, shard_size).tolist()


@pytest.mark.parametrize(("total", "tp"), list(TABLES))
def test_each_rank_gets_the_heads_in_the_table(total, tp):
    got = [list(range(total))[rank_kv_heads(total, tp, r)] for r in range(tp)]
    assert got == TABLES[(total, tp)]
    assert kv_heads_per_rank(total, tp) == len(TABLES[(total, tp)][0])
    assert kv_head_replicas(total, tp) == max(1, tp // total)


def test_each_rank_matches_vllms_weight_loader():
    for total, tp in VALID:
        for r in range(tp):
            got = list(range(total))[rank_kv_heads(total, tp, r)]
            assert got == _vllm_reference(total, tp, r), (total, tp, r)


def test_the_ranks_slices_give_back_the_whole_tensor():
    """Concatenated in rank order, replicas dropped, the slices are the file's tensor exactly;
    every replica of a head is the same."""
    for total, tp in VALID:
        rows = torch.randn(5, total, 4)
        parts = [slice_for_rank(rows, tp, r) for r in range(tp)]
        replicas = kv_head_replicas(total, tp)
        for r, part in enumerate(parts):
            assert part.shape == (5, kv_heads_per_rank(total, tp), 4), (total, tp, r)
            assert torch.equal(part, parts[r - r % replicas]), (total, tp, r)  # a replica
        assert torch.equal(torch.cat(parts[::replicas], dim=1), rows), (total, tp)


def test_combinations_vllm_refuses_raise():
    assert len(INVALID) > 100
    for total, tp in INVALID:
        with pytest.raises(AssertionError):  # the reference refuses them too
            _vllm_reference(total, tp, 0)
        for fn in (kv_head_replicas, kv_heads_per_rank):
            with pytest.raises(InvalidInputError, match="KV heads"):
                fn(total, tp)
        with pytest.raises(InvalidInputError):
            rank_kv_heads(total, tp, 0)
        with pytest.raises(InvalidInputError):
            slice_for_rank(torch.zeros(2, total, 4), tp, 0)


@pytest.mark.parametrize(
    ("total", "tp", "rank"),
    [(3, 3, 3), (3, 3, -1), (1, 2, 2), (3, 1, 1), (0, 1, 0), (3, 0, 0), (3, True, 0), (3, 3, 1.0)],
)
def test_bad_arguments_raise(total, tp, rank):
    with pytest.raises(InvalidInputError):
        rank_kv_heads(total, tp, rank)


def test_a_layer_holding_another_head_count_is_refused():
    rows = torch.zeros(4, 3, 8)
    assert slice_for_rank(rows, 3, 2, heads_per_rank=1).shape == (4, 1, 8)
    with pytest.raises(InvalidInputError, match="the layer holds 3"):
        slice_for_rank(rows, 3, 0, heads_per_rank=3)  # e.g. a file of another model
    with pytest.raises(InvalidInputError, match="the layer holds 2"):
        slice_for_rank(rows, 1, 0, heads_per_rank=2)
    with pytest.raises(InvalidInputError, match="shape"):
        slice_for_rank(torch.zeros(4, 24), 1, 0)


def test_a_slice_is_a_view_of_the_file_tensor():
    rows = torch.randn(6, 8, 4)
    part = slice_for_rank(rows, 4, 1)
    assert part.data_ptr() == rows[:, 2:4].data_ptr()


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal-free GQA attention of ``q [heads, d]`` (one new token) over ``k, v [tokens,
    kv_heads, d]``: query head ``j`` reads KV head ``j // (heads / kv_heads)``."""
    group = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [tokens, heads, d]
    v = v.repeat_interleave(group, dim=1)
    w = torch.einsum("hd,thd->ht", q, k) / math.sqrt(q.shape[1])
    return torch.einsum("ht,thd->hd", w.softmax(-1), v)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "tp"),
    [(9, 3, 3), (4, 1, 2), (4, 1, 4), (32, 8, 2), (32, 8, 4), (32, 8, 16), (6, 3, 6), (12, 3, 6)],
)
def test_each_rank_attends_with_its_query_heads_kv_heads(q_heads, kv_heads, tp):
    """Simulates the connector's write per rank: each rank writes its slice of the published
    rows into its own paged cache (scattered blocks, a partial last block), reads them back by
    its block table and attends with its own query heads (vLLM gives rank r the query heads
    ``[r*Q/T, (r+1)*Q/T)``). The ranks' outputs, concatenated, equal unsharded attention, so
    every rank's query heads found the KV heads they attend to in the full model."""
    torch.manual_seed(0)
    tokens, d, block_size = 13, 8, 4
    keys, values = torch.randn(tokens, kv_heads, d), torch.randn(tokens, kv_heads, d)
    q = torch.randn(q_heads, d)
    want = _attention(q, keys, values)
    block_ids = torch.tensor([7, 2, 5, 9])  # the request's blocks, in no order
    token = torch.arange(tokens)
    slots = block_ids[token // block_size] * block_size + token % block_size
    per_rank_q = q_heads // tp
    outs = []
    for r in range(tp):
        n = kv_heads_per_rank(kv_heads, tp)
        k_cache = torch.full((10 * block_size, n, d), float("nan"))  # flattened paged cache
        v_cache = torch.full((10 * block_size, n, d), float("nan"))
        k_cache[slots] = slice_for_rank(keys, tp, r, heads_per_rank=n)
        v_cache[slots] = slice_for_rank(values, tp, r, heads_per_rank=n)
        q_r = q[r * per_rank_q : (r + 1) * per_rank_q]
        outs.append(_attention(q_r, k_cache[slots], v_cache[slots]))
    torch.testing.assert_close(torch.cat(outs), want, rtol=0, atol=1e-6)


def test_heads_does_not_import_vllm():
    """It must stay importable (and testable) without vLLM."""
    tree = ast.parse(Path(heads.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] == "vllm"], names
