"""Input checks and errors shared by the Triton kernels and their torch references.

Kept free of any ``triton`` import so that the references (and these checks) work on a machine
without Triton.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# The error classes live in kvedit.errors; importing them from here keeps working.
from kvedit.errors import KernelInputError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256

_TRUE_WORDS = {"1", "true", "on", "yes", "y"}


def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (read like Triton does)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE_WORDS


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one ``attention`` call.

    ``group`` is the number of query heads that share one key/value head (``H // Hkv``);
    ``bias_per_query_head`` is True for a ``[B, H, Sk]`` bias and False for ``[B, Hkv, Sk]``
    (when ``H == Hkv`` both read the same, and it is False).
    """

    batch: int
    heads: int
    kv_heads: int
    group: int
    q_len: int
    k_len: int
    head_dim: int
    bias_per_query_head: bool


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    window: int | None,
) -> AttentionShape:
    """Validate the arguments of ``attention``/``attention_reference``; return their sizes.

    Args:
        q: ``[B, H, Sq, D]``.
        k: ``[B, Hkv, Sk, D]`` with ``H % Hkv == 0``.
        v: ``[B, Hkv, Sk, D]``.
        bias: None, ``[B, Hkv, Sk]`` or ``[B, H, Sk]``, a floating dtype.
        causal: whether keys after a query's position are hidden.
        window: None, or a positive sliding-window length (needs ``causal=True``).

    Raises:
        KernelInputError: on any mismatch; the message names the offending tensor.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dim() != 4:
            raise KernelInputError(
                f"{name} must have 4 dims ([batch, heads, seq, head_dim]), got {_describe(t)}"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise KernelInputError(
                f"{name} must be float32, float16 or bfloat16, got {_describe(t)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise KernelInputError(
            f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise KernelInputError(
            f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}"
        )
    B, H, Sq, D = q.shape
    if k.shape != v.shape:
        raise KernelInputError(
            f"k and v must have the same shape, got {_describe(k)} and {_describe(v)}"
        )
    Bk, Hkv, Sk, Dk = k.shape
    if Bk != B:
        raise KernelInputError(f"q has batch {B} but k/v have batch {Bk}")
    if Dk != D:
        raise KernelInputError(f"q has head_dim {D} but k/v have head_dim {Dk}")
    if Hkv == 0 or H % Hkv != 0:
        raise KernelInputError(
            f"query heads ({H}) must be divisible by key/value heads ({Hkv}) for grouped-query "
            "attention"
        )
    if D == 0 or D > MAX_HEAD_DIM:
        raise KernelInputError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {D}")
    per_q_head = False
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise KernelInputError(
                f"bias must be a torch.Tensor or None, not {type(bias).__name__}"
            )
        if not bias.is_floating_point():
            raise KernelInputError(f"bias must have a floating dtype (nats), got {_describe(bias)}")
        if bias.device != q.device:
            raise KernelInputError(f"bias is on {bias.device} but q is on {q.device}")
        ok_heads = (Hkv, H)
        if (
            bias.dim() != 3
            or bias.shape[0] != B
            or bias.shape[2] != Sk
            or bias.shape[1] not in ok_heads
        ):
            raise KernelInputError(
                f"bias must be [batch={B}, heads={Hkv} (kv) or {H} (query), k_len={Sk}], got "
                f"{_describe(bias)} (use .expand() to broadcast a smaller bias)"
            )
        per_q_head = bias.shape[1] == H and Hkv != H
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise KernelInputError(f"window must be a positive int or None, got {window!r}")
        if not causal:
            raise KernelInputError("window is only supported with causal=True")
    return AttentionShape(
        batch=B,
        heads=H,
        kv_heads=Hkv,
        group=H // Hkv,
        q_len=Sq,
        k_len=Sk,
        head_dim=D,
        bias_per_query_head=per_q_head,
    )


def check_rerotate_inputs(
    keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[int, int, int, int]:
    """Validate the arguments of ``rerotate``/``rerotate_reference``.

    Args:
        keys: ``[B, Hkv, S, D]`` post-RoPE keys, ``D`` even, a floating dtype.
        delta: ``[S]`` integer position deltas.
        inv_freq: ``[D // 2]`` rotary inverse frequencies.

    Returns:
        ``(B, Hkv, S, D)``.

    Raises:
        KernelInputError: on any mismatch.
    """
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        raise KernelInputError(
            "keys must be a 4-dim tensor [batch, kv_heads, seq, head_dim], got "
            + (_describe(keys) if isinstance(keys, torch.Tensor) else type(keys).__name__)
        )
    if keys.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"keys must be float32, float16 or bfloat16, got {_describe(keys)}")
    B, Hkv, S, D = keys.shape
    if D % 2:
        raise KernelInputError(f"keys' head_dim must be even for rotate_half RoPE, got {D}")
    if not isinstance(delta, torch.Tensor) or delta.dim() != 1 or delta.shape[0] != S:
        raise KernelInputError(
            f"delta must be a 1-dim tensor of {S} position deltas (one per key), got "
            + (_describe(delta) if isinstance(delta, torch.Tensor) else type(delta).__name__)
        )
    if delta.is_floating_point() or delta.is_complex() or delta.dtype == torch.bool:
        raise KernelInputError(f"delta must have an integer dtype, got {_describe(delta)}")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or inv_freq.shape[0] != D // 2:
        raise KernelInputError(
            f"inv_freq must be a 1-dim tensor of head_dim // 2 = {D // 2} frequencies, got "
            + (
                _describe(inv_freq)
                if isinstance(inv_freq, torch.Tensor)
                else type(inv_freq).__name__
            )
        )
    if not inv_freq.is_floating_point():
        raise KernelInputError(f"inv_freq must have a floating dtype, got {_describe(inv_freq)}")
    if not (keys.device == delta.device == inv_freq.device):
        raise KernelInputError(
            f"keys, delta and inv_freq must be on one device, got {keys.device}, {delta.device} "
            f"and {inv_freq.device}"
        )
    return B, Hkv, S, D
