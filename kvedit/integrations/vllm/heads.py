"""Which KV heads a tensor-parallel rank of vLLM holds (pure torch: no vLLM import).

vLLM 0.32 shards attention over tensor-parallel ranks in ``QKVParallelLinear``
(``vllm/model_executor/layers/linear.py``)::

    if tp_size >= self.total_num_kv_heads:
        self.num_kv_heads = 1
        self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
    else:
        self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
        self.num_kv_head_replicas = 1
    ...
    shard_rank = self.tp_rank // self.num_kv_head_replicas   # for the "k" and "v" shards
    start_idx = shard_rank * shard_size                        # shard_size = num_kv_heads heads

So with ``H`` KV heads on ``T`` ranks: when ``T < H``, ``T`` must divide ``H`` and rank ``r``
holds heads ``[r*H/T, (r+1)*H/T)``; when ``T >= H``, ``H`` must divide ``T`` and rank ``r``
holds the single head ``r // (T/H)`` (each head replicated on ``T/H`` consecutive ranks).
``divide`` asserts divisibility, so vLLM refuses every other combination. The query heads are
split evenly (``T`` must divide them too), which keeps every rank's query heads with the KV
heads they attend to. The connector slices a published file, which holds all ``H`` heads, with
:func:`slice_for_rank`.
"""

from __future__ import annotations

import torch

from ...errors import InvalidInputError

__all__ = ["kv_head_replicas", "kv_heads_per_rank", "rank_kv_heads", "slice_for_rank"]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{name} must be a positive int, not {value!r}")
    return value


def kv_head_replicas(total_kv_heads: int, tp_size: int) -> int:
    """On how many tensor-parallel ranks each KV head lives (1 unless ``tp_size`` exceeds the
    head count).

    Raises:
        InvalidInputError: vLLM refuses the combination (neither count divides the other, or
            either is not a positive int).
    """
    total_kv_heads = _positive("total_kv_heads", total_kv_heads)
    tp_size = _positive("tp_size", tp_size)
    if tp_size >= total_kv_heads:
        if tp_size % total_kv_heads:
            raise InvalidInputError(
                f"tensor-parallel size {tp_size} is not a multiple of the {total_kv_heads} KV "
                "heads (vLLM replicates KV heads only evenly)"
            )
        return tp_size // total_kv_heads
    if total_kv_heads % tp_size:
        raise InvalidInputError(
            f"{total_kv_heads} KV heads cannot be split evenly over tensor-parallel size {tp_size}"
        )
    return 1


def kv_heads_per_rank(total_kv_heads: int, tp_size: int) -> int:
    """How many KV heads each rank holds (vLLM's ``num_kv_heads`` of the attention layer).

    Raises:
        InvalidInputError: vLLM refuses the combination (see :func:`kv_head_replicas`).
    """
    kv_head_replicas(total_kv_heads, tp_size)
    return max(1, total_kv_heads // tp_size)


def rank_kv_heads(total_kv_heads: int, tp_size: int, rank: int) -> slice:
    """The KV heads (a ``slice`` of ``range(total_kv_heads)``) that tensor-parallel ``rank``
    of ``tp_size`` holds, by vLLM's rule (see the module doc).

    Raises:
        InvalidInputError: vLLM refuses the combination, or ``rank`` is not in
            ``range(tp_size)``.
    """
    replicas = kv_head_replicas(total_kv_heads, tp_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise InvalidInputError(f"rank must be an int in range({tp_size}), not {rank!r}")
    n = kv_heads_per_rank(total_kv_heads, tp_size)
    first = (rank // replicas) * n
    return slice(first, first + n)


def slice_for_rank(
    rows: torch.Tensor, tp_size: int, rank: int, heads_per_rank: int | None = None
) -> torch.Tensor:
    """The part of ``rows`` (``[tokens, total_kv_heads, head_dim]``, all heads) that
    tensor-parallel ``rank`` of ``tp_size`` holds: ``[tokens, kv_heads_per_rank, head_dim]``
    (a view).

    ``heads_per_rank``: the head count the rank's attention layer reports (vLLM's
    ``layer.num_kv_heads``); it must agree with the rule.

    Raises:
        InvalidInputError: ``rows`` is not 3-D, vLLM refuses the combination, or the layer's
            head count is not the one the rule gives (the file belongs to another model or
            sharding).
    """
    if rows.dim() != 3:
        raise InvalidInputError(
            f"expected rows [tokens, kv_heads, head_dim], got shape {tuple(rows.shape)}"
        )
    heads = rank_kv_heads(int(rows.shape[1]), tp_size, rank)
    n = heads.stop - heads.start
    if heads_per_rank is not None and heads_per_rank != n:
        raise InvalidInputError(
            f"{rows.shape[1]} KV heads on tensor-parallel size {tp_size} give {n} per rank, "
            f"the layer holds {heads_per_rank}"
        )
    part = rows[:, heads]
    if part.shape[1] != n:  # cannot happen by the rule; a loud error beats an empty write
        raise InvalidInputError(f"rank {rank} of {tp_size}: heads {heads} of {rows.shape[1]}")
    return part
