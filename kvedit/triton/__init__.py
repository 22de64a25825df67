"""Triton kernels of kvedit: biased GQA attention and RoPE re-rotation of cached keys.

Public API:

* :func:`attention` / :func:`attention_reference`: ``softmax(q k^T * scale + bias) v`` with
  grouped KV heads, bottom-right causal alignment and an optional sliding window.
* :func:`rerotate` / :func:`rerotate_reference`: move cached post-RoPE keys by per-token
  position deltas.
* :func:`is_available`: whether the Triton versions can run here.

Importing this package never needs Triton: the references work with torch alone, and the Triton
functions raise :class:`TritonUnavailableError` (an ``ImportError``) when Triton is missing.
To run the kernels on CPU through Triton's interpreter, set ``TRITON_INTERPRET=1`` before
``triton`` is first imported, which in practice means before importing kvedit or transformers.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from kvedit.errors import KernelInputError, TritonUnavailableError
from kvedit.triton._common import interpreter_requested
from kvedit.triton.reference import attention_reference, rerotate_reference

__all__ = [
    "KernelInputError",
    "TritonUnavailableError",
    "attention",
    "attention_reference",
    "is_available",
    "rerotate",
    "rerotate_reference",
]

_INSTALL_HINT = "install it with `pip install triton` (or `pip install kvedit[dev]`)"


def _triton_import_error() -> BaseException | None:
    try:
        importlib.import_module("triton")
    except Exception as error:  # ImportError, or a broken install raising something else
        return error
    return None


def is_available() -> bool:
    """True when Triton imports and there is a CUDA device or ``TRITON_INTERPRET=1`` is set."""
    if _triton_import_error() is not None:
        return False
    return torch.cuda.is_available() or interpreter_requested()


def _kernels(name: str) -> ModuleType:
    """Import a kernel module (``_attention`` or ``_rerotate``), explaining a missing Triton."""
    error = _triton_import_error()
    if error is not None:
        raise TritonUnavailableError(
            f"kvedit's Triton kernels need Triton, which failed to import ({error}); "
            f"{_INSTALL_HINT}. The torch references (attention_reference, rerotate_reference) "
            "work without it."
        ) from error
    return importlib.import_module(f"kvedit.triton.{name}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlashAttention-style forward with grouped KV heads and an additive per-key bias.

    Args:
        q: ``[B, H, Sq, D]`` queries (float32, float16 or bfloat16; ``D <= 256``).
        k: ``[B, Hkv, Sk, D]`` keys, ``H % Hkv == 0``; query head ``h`` reads kv head
            ``h // (H // Hkv)``, as transformers' ``repeat_kv``.
        v: ``[B, Hkv, Sk, D]`` values.
        bias: None, ``[B, Hkv, Sk]`` or ``[B, H, Sk]`` added to the logits, in nats, any float
            dtype and any strides (an ``expand``-ed view is fine). ``-inf`` hides a key.
        causal: query ``i`` sits at absolute position ``Sk - Sq + i`` (bottom-right alignment)
            and sees key ``j`` iff ``j <= Sk - Sq + i``.
        window: with ``causal``, key ``j`` must also satisfy ``(Sk - Sq + i) - j < window``
            (transformers' sliding window). Not supported with ``causal=False``.
        scale: logit scale, default ``D ** -0.5``.
        sinks: None or ``[H]`` attention sinks (gpt-oss): a logit per query head in every
            row's softmax denominator that adds no value.

    Returns:
        ``[B, H, Sq, D]`` in ``q.dtype``. A query that sees no key (all logits ``-inf``, or
        ``Sq > Sk`` with ``causal``) gets zeros. Forward only (no autograd).

    Raises:
        KernelInputError: bad shapes/dtypes/devices.
        TritonUnavailableError: Triton is not installed.
    """
    impl = _kernels("_attention")
    return impl.attention(q, k, v, bias, causal=causal, window=window, scale=scale, sinks=sinks)


def rerotate(
    keys: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate cached post-RoPE keys by per-token position deltas (``rope(k,p) -> rope(k,p+d)``).

    Args:
        keys: ``[B, Hkv, S, D]`` keys after RoPE (float32, float16 or bfloat16, ``D`` even).
        delta: ``[S]`` integer position deltas, may be negative.
        inv_freq: ``[D // 2]`` the layer's rotary ``inv_freq``.
        out: optional output tensor like ``keys``; ``out=keys`` rotates in place.

    Returns:
        ``[B, Hkv, S, D]`` in ``keys.dtype``. Pure rotation: no ``attention_scaling``.

    Raises:
        KernelInputError: bad shapes/dtypes/devices.
        TritonUnavailableError: Triton is not installed.
    """
    impl = _kernels("_rerotate")
    return impl.rerotate(keys, delta, inv_freq, out=out)
