"""Position-free K/V rows: what the projection map reads (from A) and writes (for B).

Keys are un-rotated to position 0 (:func:`rotate` by ``-position`` with the layer's RoPE
frequencies, :func:`stacked_inv_freq`); a row is one entry's keys then values, all KV heads
flattened (:func:`kv_rows`). :class:`Features` gathers A's rows at the A tokens B's tokens
align to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers import PreTrainedModel

from ..cache import LayerKV
from ..rope import layer_inv_freq

__all__ = ["Features", "dense_rows", "kv_rows", "rotate", "stacked_inv_freq"]


def stacked_inv_freq(model: PreTrainedModel) -> torch.Tensor:
    """``[n_layers, head_dim // 2]`` float32 RoPE inverse frequencies of each decoder layer, on
    CPU (:func:`kvedit.rope.layer_inv_freq`: Gemma-3's sliding and global layers differ)."""
    return torch.stack([f.to("cpu", torch.float32) for f in layer_inv_freq(model)])


def rotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``rope(k, p + delta)`` from ``rope(k, p)`` (transformers' ``rotate_half`` convention).

    Args:
        keys: ``[batch, heads, n, head_dim]`` float32.
        delta: ``[n]`` the position shift of each entry.
        inv_freq: ``[head_dim // 2]`` the layer's RoPE inverse frequencies.

    Returns:
        ``[batch, heads, n, head_dim]`` float32.
    """
    half = keys.shape[-1] // 2
    angle = delta.to(keys.device, torch.float32)[:, None] * inv_freq.to(keys.device)[None, :]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = keys[..., :half], keys[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def kv_rows(layer: LayerKV, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[n_entries, 2 * kv_heads * head_dim]`` float32: each entry's position-free keys, then
    its values (KV heads flattened), from a layer with ``inv_freq [head_dim // 2]``."""
    keys = rotate(layer.keys.float(), -layer.positions, inv_freq)[0]  # [H, n, D]
    values = layer.values.float()[0]
    n = keys.shape[1]
    return torch.cat(
        [keys.permute(1, 0, 2).reshape(n, -1), values.permute(1, 0, 2).reshape(n, -1)], dim=1
    )


def dense_rows(layer: LayerKV, inv_freq: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """``[n_tokens, 2 * kv_heads * head_dim]``: per token of the text, the :func:`kv_rows` row
    of its (last) entry in ``layer``; zeros for tokens the layer does not hold."""
    rows = kv_rows(layer, inv_freq)
    dense = rows.new_zeros(n_tokens, rows.shape[1])
    index = layer.token_index.to(rows.device)
    ok = (index >= 0) & (index < n_tokens)
    dense[index[ok]] = rows[ok]
    return dense


class Features:
    """A's K/V of one text, ready to be gathered at aligned A tokens.

    Args:
        layers: A's layers (a state's ``layers``).
        offsets: ``[n_a, 2]`` character ranges of A's tokens.
        inv_freq_a: ``[n_layers_a, head_dim_a // 2]`` A's RoPE frequencies.
        needed: the A layers to keep rows of.
    """

    def __init__(
        self,
        layers: Sequence[LayerKV],
        offsets: torch.Tensor,
        inv_freq_a: torch.Tensor,
        needed: Iterable[int],
    ):
        n = offsets.shape[0]
        device = layers[0].keys.device
        self.rows = {a: dense_rows(layers[a], inv_freq_a[a].to(device), n) for a in sorted(needed)}
        valid = (offsets[:, 1] > offsets[:, 0]).nonzero().flatten()
        self.first = int(valid[0]) if len(valid) else 0

    def gather(self, a_layers: Sequence[int], a_index: torch.Tensor) -> torch.Tensor:
        """``[m, len(a_layers) * d_row + 1]``: the concatenated rows of ``a_layers`` at the A
        tokens ``a_index [m]``, then the indicator of A's first (non-special) token."""
        idx = a_index.to(next(iter(self.rows.values())).device)
        parts = [self.rows[a][idx] for a in a_layers]
        parts.append((idx == self.first).float()[:, None])
        return torch.cat(parts, dim=1)
