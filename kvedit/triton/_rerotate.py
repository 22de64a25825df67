"""Re-rotate cached post-RoPE keys by per-token position deltas (Triton).

RoPE rotations compose, ``R(p + d) = R(d) R(p)``, so moving a cached key from position ``p`` to
``p + d`` only needs the rotation by ``d``; the original key is never recomputed. Uses
transformers' ``rotate_half`` convention: dimension ``i`` pairs with ``i + D/2`` and both use
``inv_freq[i]``. Angles are computed in float32 whatever the key dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvedit.triton._attention import kernels_interpreted
from kvedit.triton._common import KernelInputError, check_rerotate_inputs
from kvedit.triton.counting import record


@triton.jit(do_not_specialize=["S", "HALF"])
def _rerotate_kernel(
    K,
    Out,
    Delta,
    InvFreq,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_delta,
    stride_freq,
    Hkv,
    S,
    HALF,
    BLOCK_S: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Grid ``(cdiv(S, BLOCK_S), B)``: one block of tokens of one batch row, all kv heads.

    The ``[BLOCK_S, D/2]`` cos/sin tile is computed once and reused for every head.
    """
    pid_s = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_f = tl.arange(0, BLOCK_HALF)
    s_ok = offs_s < S
    mask = s_ok[:, None] & (offs_f[None, :] < HALF)

    delta = tl.load(Delta + offs_s * stride_delta, mask=s_ok, other=0).to(tl.float32)
    inv_freq = tl.load(InvFreq + offs_f * stride_freq, mask=offs_f < HALF, other=0.0)
    angle = delta[:, None] * inv_freq.to(tl.float32)[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)

    k_rows = offs_s[:, None] * stride_ks + offs_f[None, :] * stride_kd
    o_rows = offs_s[:, None] * stride_os + offs_f[None, :] * stride_od
    k_base = K + b * stride_kb
    o_base = Out + b * stride_ob
    for _ in range(Hkv):
        x1 = tl.load(k_base + k_rows, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_base + k_rows + HALF * stride_kd, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        tl.store(o_base + o_rows, y1.to(Out.dtype.element_ty), mask=mask)
        tl.store(o_base + o_rows + HALF * stride_od, y2.to(Out.dtype.element_ty), mask=mask)
        k_base += stride_kh  # pointer arithmetic: no 32-bit overflow on huge caches
        o_base += stride_oh


def rerotate(
    keys: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate post-RoPE keys by per-token position deltas: ``rope(k, p) -> rope(k, p + delta)``.

    Args:
        keys: ``[B, Hkv, S, D]`` cached keys (RoPE and any ``attention_scaling`` already in).
        delta: ``[S]`` integer deltas, one per token position (may be negative).
        inv_freq: ``[D // 2]`` the layer's rotary ``inv_freq`` buffer.
        out: optional ``[B, Hkv, S, D]`` tensor of ``keys``' dtype to write into; passing
            ``keys`` itself rotates in place.

    Returns:
        ``[B, Hkv, S, D]`` in ``keys.dtype`` (``out`` if given). No scaling is applied.
    """
    B, Hkv, S, D = check_rerotate_inputs(keys, delta, inv_freq)
    interpreted = kernels_interpreted()
    if keys.device.type != "cuda" and not interpreted:
        raise KernelInputError(
            f"the Triton rerotate kernel needs CUDA tensors, got {keys.device}; to run it on CPU "
            "set TRITON_INTERPRET=1 before kvedit.triton's kernels are first used"
        )
    if out is None:
        out = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
    elif out.shape != keys.shape or out.dtype != keys.dtype or out.device != keys.device:
        raise KernelInputError(
            f"out must match keys ({tuple(keys.shape)} {keys.dtype} on {keys.device}), got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if keys.numel() == 0:
        return out

    src, dst = keys, out
    if interpreted and keys.dtype == torch.bfloat16:
        # Keep the interpreter away from bf16 (numpy has no bfloat16); results are identical
        # because all arithmetic is fp32 anyway.
        src = keys.float()
        dst = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)

    half = D // 2
    block_half = triton.next_power_of_2(half)
    block_s = max(1, min(64, 2048 // block_half))  # ~16 fp32 values a thread per tile
    record("rerotate")
    _rerotate_kernel[(triton.cdiv(S, block_s), B)](
        src, dst, delta, inv_freq,
        *src.stride(), *dst.stride(), delta.stride(0), inv_freq.stride(0),
        Hkv, S, half,
        BLOCK_S=block_s,
        BLOCK_HALF=block_half,
        num_warps=4,
    )  # fmt: skip
    if dst is not out:
        out.copy_(dst)
    return out
