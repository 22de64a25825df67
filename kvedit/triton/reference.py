"""Plain-torch references for the Triton kernels: the ground truth the kernels are tested against.

Written for clarity, not speed: every computation is done in float32 and the result is cast to
the input dtype at the end. Both functions take exactly the arguments of their kernels.
"""

from __future__ import annotations

import torch

from kvedit.triton._common import (
    KernelInputError,
    check_attention_inputs,
    check_rerotate_inputs,
)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    chunk_size: int = 256,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention with grouped KV heads, an additive key bias and bottom-right masking.

    Args:
        q: ``[B, H, Sq, D]`` queries.
        k: ``[B, Hkv, Sk, D]`` keys, ``H % Hkv == 0``; query head ``h`` reads kv head
            ``h // (H // Hkv)`` (transformers' ``repeat_kv`` grouping).
        v: ``[B, Hkv, Sk, D]`` values.
        bias: None, ``[B, Hkv, Sk]`` or ``[B, H, Sk]``; added to the logits, in nats. ``-inf``
            hides a key.
        causal: query ``i`` sits at absolute position ``Sk - Sq + i`` and sees key ``j`` only if
            ``j <= Sk - Sq + i``.
        window: with ``causal``, key ``j`` must also satisfy ``(Sk - Sq + i) - j < window``.
        scale: logit scale, default ``D ** -0.5``.
        chunk_size: queries handled per step (bounds the ``[B, H, chunk, Sk]`` score tensor).
        sinks: None or ``[H]`` attention sinks (gpt-oss): one logit per query head in the
            softmax denominator, with no value.

    Returns:
        ``[B, H, Sq, D]`` in ``q.dtype``. A query that sees no key at all (every logit
        ``-inf``) gets a zero output rather than NaN.
    """
    shape = check_attention_inputs(q, k, v, bias, causal, window)
    check_sinks(sinks, q)
    G, Sq, Sk = shape.group, shape.q_len, shape.k_len
    scale = shape.head_dim**-0.5 if scale is None else float(scale)

    qf = q.float()
    kf = k.float().repeat_interleave(G, dim=1)  # [B, H, Sk, D], head h <- kv head h // G
    vf = v.float().repeat_interleave(G, dim=1)
    bf = None
    if bias is not None:
        bf = bias.float()
        if bf.shape[1] != shape.heads:
            bf = bf.repeat_interleave(G, dim=1)  # [B, H, Sk]

    out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
    key_pos = torch.arange(Sk, device=q.device)
    for start in range(0, Sq, max(1, chunk_size)):
        stop = min(Sq, start + max(1, chunk_size))
        scores = torch.einsum("bhqd,bhkd->bhqk", qf[:, :, start:stop], kf) * scale
        if bf is not None:
            scores = scores + bf[:, :, None, :]
        if causal:
            q_pos = (Sk - Sq) + torch.arange(start, stop, device=q.device)
            visible = key_pos[None, :] <= q_pos[:, None]  # [chunk, Sk]
            if window is not None:
                visible &= (q_pos[:, None] - key_pos[None, :]) < window
            scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # an extra logit per head, always visible, with no value
            sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            out[:, :, start:stop] = torch.einsum("bhqk,bhkd->bhqd", probs, vf)
            continue
        dead = (scores == float("-inf")).all(dim=-1, keepdim=True)  # rows that see no key
        probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
        out[:, :, start:stop] = torch.einsum("bhqk,bhkd->bhqd", probs, vf)
    return out.to(q.dtype)


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Validate ``sinks``: None or a float ``[H]`` tensor on ``q``'s device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise KernelInputError(f"sinks must be a float tensor [heads], not {sinks!r}")
    if tuple(sinks.shape) != (q.shape[1],) or sinks.device != q.device:
        raise KernelInputError(
            f"sinks must be [{q.shape[1]}] on {q.device}, got {tuple(sinks.shape)} on "
            f"{sinks.device}"
        )


def rerotate_reference(
    keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """Rotate post-RoPE keys by per-token position deltas (transformers' ``rotate_half`` RoPE).

    Rotating by ``delta`` turns a key cached at position ``p`` into the key at ``p + delta``:
    ``rope(k, p + d) == rerotate(rope(k, p), d)``. No attention scaling is applied (the cached
    keys already carry any ``attention_scaling`` of the rotary embedding).

    Args:
        keys: ``[B, Hkv, S, D]`` keys after RoPE.
        delta: ``[S]`` integer position deltas, one per token (may be negative).
        inv_freq: ``[D // 2]`` the layer's rotary inverse frequencies.

    Returns:
        ``[B, Hkv, S, D]`` in ``keys.dtype``; angles and products are computed in float32.
    """
    check_rerotate_inputs(keys, delta, inv_freq)
    half = keys.shape[-1] // 2
    angle = delta.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [S, D/2]
    cos, sin = angle.cos(), angle.sin()
    x = keys.float()
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(keys.dtype)
