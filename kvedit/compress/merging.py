"""``minicache``: merge adjacent deep layers' K/V pairwise (MiniCache, depth compression).

Following MiniCache (Liu et al., 2024), adjacent layers of the deeper half of a model hold
K/V whose *directions* are close, while their magnitudes differ. For a pair of layers
``(l, l + 1)``, every cache entry and KV head's two vectors are split into a magnitude (the
L2 norm) and a unit direction; the two directions are interpolated by SLERP at ``t`` (0.5:
the normalized mean of the two), and each layer keeps its own magnitude, so layer ``l``'s key
becomes ``|k_l| * slerp(k_l/|k_l|, k_{l+1}/|k_{l+1}|, t)``. The entries whose two layers
disagree most (the largest angle between them, averaged over KV heads and over keys and
values) are *retained*: each layer keeps them exactly, a ``retain`` fraction of the merged
entries. The last ``residual`` entries are not merged (they are the exact tail, to which new
entries are appended).

Keys are merged post-RoPE, as cached: both layers of a pair hold the same entries at the same
positions, so their rotations agree. A pair's directions are stored once for both layers
(:class:`~kvedit.cache.directions.SharedDirections`, optionally quantized KIVI-style at ``bits``),
each layer holding its norms, its retained entries and its tail
(:class:`~kvedit.cache.merged.MergedLayerKV`), so ``state.nbytes`` and the saved file drop.

Which layers: from layer ``ceil(start * n_layers)`` on, pairs ``(i, i + 1)`` of global
layers, taken in order (a layer left over stays as it is). Sliding-window layers (Gemma-3) are
never merged, nor paired across: they hold at most ``window`` entries, and they hold
different tokens than a global layer. A layer already merged is left as it is. Two global
layers of a pair that hold different entries (an earlier selection that kept different tokens
per layer) are refused with :class:`~kvedit.errors.InvalidInputError`: merge before selecting.

Composition: every op works on a merged state (a layer whose merged entries an op changes,
``scale_keys`` say, leaves its pair and holds the op's result exactly); ``extend`` and
``generate`` append new entries to the exact tail; the state saves and loads merged. With
``bits`` (2, 4 or 8), the shared directions are quantized and every global layer not merged is
quantized by :func:`~kvedit.compress.quantize` with the same ``bits``, ``residual`` and
``group``: the whole cache at ``bits``, the merged pairs also sharing their directions.
"""

from __future__ import annotations

import math

import torch

from ..cache import LayerKV, MergedLayerKV, refuse_headwise
from ..cache.directions import SharedDirections, new_uid, pack_directions
from ..cache.packed import BITS
from ..errors import InvalidInputError
from ..provenance import Step
from ..states.passes import recompute_last
from ..states.state import KVState
from .quantization import quantize

__all__ = ["merge_layers", "merge_plan", "minicache", "slerp"]

_EPS = 1e-12


def slerp(u0: torch.Tensor, u1: torch.Tensor, t: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Spherical interpolation of unit vectors ``u0``, ``u1`` ``[..., d]`` at ``t``.

    Returns ``(direction [..., d], angle [...])``: the unit vector at fraction ``t`` of the
    great-circle arc from ``u0`` to ``u1`` (at ``t = 0.5``, ``(u0 + u1) / |u0 + u1|``) and the
    angle between them, in radians. Where the vectors (nearly) coincide it is the normalized
    linear interpolation; where they are opposite (no unique arc) or zero, ``u0``.
    """
    u0, u1 = u0.float(), u1.float()
    cos = (u0 * u1).sum(-1).clamp(-1.0, 1.0)
    theta = torch.arccos(cos)
    sin = torch.sin(theta)
    small = sin < 1e-6
    safe = torch.where(small, torch.ones_like(sin), sin)
    w0 = torch.where(small, torch.full_like(sin, 1 - t), torch.sin((1 - t) * theta) / safe)
    w1 = torch.where(small, torch.full_like(sin, t), torch.sin(t * theta) / safe)
    out = w0[..., None] * u0 + w1[..., None] * u1
    norm = out.norm(dim=-1, keepdim=True)
    degenerate = norm < 1e-6
    out = torch.where(degenerate, u0, out / norm.clamp_min(_EPS))
    return out, theta


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., d]`` -> ``(norms [...], unit directions [..., d])`` in float32 (zero: zero)."""
    x = x.float()
    norms = x.norm(dim=-1)
    return norms, x / norms.clamp_min(_EPS)[..., None]


def merge_layers(
    a: LayerKV,
    b: LayerKV,
    *,
    retain: float = 0.05,
    t: float = 0.5,
    residual: int = 32,
    bits: int = 0,
    group: int = 32,
) -> tuple[MergedLayerKV, MergedLayerKV]:
    """Merge two global layers holding the same entries into a :class:`MergedLayerKV` pair.

    The first ``max(0, n - residual)`` entries are merged (see the module doc); the rest, and
    every retained entry, stay exact. ``bits`` (0, 2, 4, 8) quantizes the shared directions
    (keys per channel over groups of ``group`` entries, values per entry over groups of
    ``min(group, head_dim)`` channels). Raises :class:`InvalidInputError` for layers that are
    not global or hold different entries, and for bad arguments.
    """
    _check_args(retain, t, residual, bits, group)
    if a.window is not None or b.window is not None:
        raise InvalidInputError("sliding-window layers are not merged")
    if a.kv_shape != b.kv_shape or not (
        torch.equal(a.token_index, b.token_index) and torch.equal(a.positions, b.positions)
    ):
        raise InvalidInputError(
            "the two layers hold different entries (token_index/positions or shapes differ); "
            "merge before an op that selects entries per layer"
        )
    ka, va = a.dense_kv()
    kb, vb = b.dense_kv()
    n, d, dv = ka.shape[-2], ka.shape[-1], va.shape[-1]
    m = max(0, n - residual)
    if bits and (d % min(group, d) or dv % min(group, dv) or (d * bits) % 8):
        raise InvalidInputError(f"group {group} must divide the head dimension {d} (or exceed it)")
    nk_a, uk_a = _split(ka[:, :, :m])
    nk_b, uk_b = _split(kb[:, :, :m])
    nv_a, uv_a = _split(va[:, :, :m])
    nv_b, uv_b = _split(vb[:, :, :m])
    dir_k, angle_k = slerp(uk_a, uk_b, t)
    dir_v, angle_v = slerp(uv_a, uv_b, t)
    r = min(m, round(retain * m))
    if r:
        score = (angle_k + angle_v).mean(dim=(0, 1))  # [m]: mean over batch and KV heads
        retained = score.topk(r).indices.sort().values.to(torch.long)
    else:
        retained = torch.zeros(0, dtype=torch.long, device=ka.device)
    shared = SharedDirections(
        new_uid(),
        pack_directions(dir_k.to(ka.dtype), bits, group, "channel"),
        pack_directions(dir_v.to(va.dtype), bits, min(group, dv), "token"),
        retained,
        bits,
    )
    out = []
    for member, (layer, k, v, nk, nv) in enumerate(
        ((a, ka, va, nk_a, nv_a), (b, kb, vb, nk_b, nv_b))
    ):
        out.append(
            MergedLayerKV(
                token_index=layer.token_index,
                positions=layer.positions,
                bias=layer.bias,
                shared=shared,
                member=member,
                key_norms=nk.to(k.dtype),
                value_norms=nv.to(v.dtype),
                retained_keys=k[:, :, retained].clone(),
                retained_values=v[:, :, retained].clone(),
                tail_keys=k[:, :, m:].clone(),
                tail_values=v[:, :, m:].clone(),
            )
        )
    return out[0], out[1]


def _check_args(retain: float, t: float, residual: int, bits: int, group: int) -> None:
    for name, value in (("retain", retain), ("t", t)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise InvalidInputError(f"{name} must be a number in [0, 1], not {value!r}")
    for name, value, low in (("residual", residual, 1), ("group", group, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidInputError(f"{name} must be an int >= {low}, not {value!r}")
    if bits not in (0, *BITS):
        raise InvalidInputError(f"bits must be 0 (exact) or one of {BITS}, not {bits!r}")


def merge_plan(state: KVState, start: float) -> list[tuple[int, int]]:
    """The layer pairs :func:`minicache` merges: ``(i, i + 1)`` from ``ceil(start * n_layers)``
    on, both global and not yet merged, taken in order."""
    if isinstance(start, bool) or not isinstance(start, (int, float)) or not 0 <= start <= 1:
        raise InvalidInputError(f"start must be a fraction of the depth in [0, 1], not {start!r}")
    layers = state.layers
    i = math.ceil(start * len(layers))
    pairs = []
    while i + 1 < len(layers):
        a, b = layers[i], layers[i + 1]
        if all(x.window is None and x.kind != MergedLayerKV.kind for x in (a, b)):
            pairs.append((i, i + 1))
            i += 2
        else:
            i += 1
    return pairs


@torch.no_grad()
def minicache(
    state: KVState,
    start: float = 0.5,
    retain: float = 0.05,
    *,
    t: float = 0.5,
    residual: int = 32,
    bits: int = 0,
    group: int = 32,
) -> KVState:
    """A new state whose adjacent global layers from depth ``start`` on are merged pairwise.

    Args:
        state: the state (not modified); needs its model (the last token is recomputed).
        start: first merged layer, as a fraction of the depth (0.5: the second half).
        retain: fraction of each pair's merged entries kept exactly in both layers (those
            whose layers' directions differ most), in ``[0, 1]``.
        t: SLERP interpolation between the two layers' directions (0.5: halfway).
        residual: the most recent entries (at least 1) left unmerged, exact.
        bits: 0 (the shared directions exact) or 2, 4, 8: the shared directions quantized, and
            every global layer not merged quantized by :func:`~kvedit.compress.quantize`.
        group: quantization group (see :func:`~kvedit.compress.quantize`).

    Returns:
        A state whose merged layers are :class:`MergedLayerKV` (``nbytes`` counts the shared
        directions once per pair); its history records a ``minicache`` step. With nothing to
        merge (and ``bits`` 0), ``state`` itself.

    Raises:
        InvalidInputError: a pair's two layers hold different entries.
        InvalidInputError: an argument out of range (also a ``ValueError``).
    """
    refuse_headwise(state.layers, "minicache")
    _check_args(retain, t, residual, bits, group)
    pairs = merge_plan(state, start)
    layers: list[LayerKV] = list(state.layers)
    merged: set[int] = set()
    for i, j in pairs:
        if max(0, len(layers[i]) - residual) == 0:
            continue  # nothing before the residual
        try:
            layers[i], layers[j] = merge_layers(
                layers[i], layers[j], retain=retain, t=t, residual=residual, bits=bits, group=group
            )
        except InvalidInputError as e:
            raise InvalidInputError(f"minicache: layers {i} and {j}: {e}") from None
        merged.update((i, j))
    if bits:
        # only the plain (dense) layers: earlier merges and quantized layers are left as they are
        others = quantize(state, bits=bits, residual=residual, group=group).layers
        layers = [
            others[i] if i not in merged and x.kind == LayerKV.kind else layers[i]
            for i, x in enumerate(state.layers)
        ]
    elif not merged:
        return state
    step = Step(
        "compression",
        "minicache",
        {
            "start": start,
            "retain": retain,
            "t": t,
            "residual": residual,
            "bits": bits,
            "group": group,
            "merged": sorted(merged),
        },
        exact=False,
    )
    return recompute_last(state.replace(layers=layers)).with_step(step)
