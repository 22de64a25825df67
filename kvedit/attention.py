"""The kvedit attention implementation: attention with an additive per-key logit bias.

kvedit registers one attention function, ``"kvedit"``, with transformers'
``AttentionInterface`` and a mask function under the same name with ``AttentionMaskInterface``.
The mask function only passes the 2D padding mask through: the attention function builds
causal masking itself, aligned bottom-right, so a question on top of a captured document
sees the whole document (torch SDPA's ``is_causal`` aligns top-left, which is wrong there).

Where the bias comes from is a :class:`BiasPlan`, activated per model and per context with
:func:`activate`. Plans live in a :class:`contextvars.ContextVar`, so two threads steering the
same model never see each other's spans, and a model with no active plan in the current
context attends exactly like stock ``sdpa``.

Shapes used throughout: queries ``[batch, heads, q_len, head_dim]``; keys and values
``[batch, kv_heads, k_len, head_dim]``; biases ``[batch, kv_heads or heads, k_len]`` in nats.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

ATTENTION_NAME = "kvedit"

# Bytes allowed for one chunk's float mask in the torch path; prefill is chunked over queries so
# a full [heads, q, k] mask is never materialised.
MASK_CHUNK_BYTES = 16 * 2**20


class BiasPlan(Protocol):
    """Where the additive key bias of one model comes from, for one context."""

    def key_bias(self, layer_idx: int, k_len: int, total_len: int) -> torch.Tensor | None:
        """Bias for the ``k_len`` keys of layer ``layer_idx``: ``[batch, kv_heads|heads, k_len]``.

        ``total_len`` is the absolute length of the sequence including the current queries, so
        key entry ``j`` holds absolute token ``total_len - k_len + j`` (sliding-window caches hold
        only the most recent tokens). Returns None for no bias on this layer.
        """

    def unbiased_queries(self, q_len: int, total_len: int) -> int:
        """How many leading queries of this call attend without the bias (0: all are biased)."""


# Never mutated in place: activate() sets a new dict, so the shared default stays empty.
_NO_PLANS: dict[int, BiasPlan] = {}
_PLANS: contextvars.ContextVar[dict[int, BiasPlan]] = contextvars.ContextVar("kvedit_plans")


def _plans() -> dict[int, BiasPlan]:
    return _PLANS.get(_NO_PLANS)


def _model_key(model_or_module) -> int:
    cfg = model_or_module.config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return id(cfg)


def active_plan(model: PreTrainedModel) -> BiasPlan | None:
    """The plan active for ``model`` in the current context, if any."""
    return _plans().get(_model_key(model))


# --------------------------------------------------------------------------------------------
# Switching a model to the kvedit attention (reference counted, thread safe)
# --------------------------------------------------------------------------------------------

_SWITCH_LOCK = threading.Lock()
_SWITCHED: dict[int, tuple[int, str]] = {}  # model key -> (users, original implementation)


def register() -> None:
    """Register the ``"kvedit"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvedit_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, kvedit_mask)


@contextlib.contextmanager
def use_kvedit_attention(model: PreTrainedModel) -> Iterator[None]:
    """Run ``model`` with the kvedit attention inside the block; restore it afterwards.

    Reference counted: concurrent users share the switch, and the last one out restores the
    original implementation, also when the body raises.
    """
    register()
    key = _model_key(model)
    with _SWITCH_LOCK:
        users, original = _SWITCHED.get(key, (0, model.config._attn_implementation))
        if users == 0 and original != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
        _SWITCHED[key] = (users + 1, original)
    try:
        yield
    finally:
        with _SWITCH_LOCK:
            users, original = _SWITCHED[key]
            if users == 1:
                del _SWITCHED[key]
                if original != ATTENTION_NAME:
                    model.set_attn_implementation(original)
            else:
                _SWITCHED[key] = (users - 1, original)


class NestedSteeringError(RuntimeError):
    """A second plan was activated for a model that already has one in this context."""


@contextlib.contextmanager
def activate(model: PreTrainedModel, plan: BiasPlan) -> Iterator[BiasPlan]:
    """Activate ``plan`` for ``model`` in the current context, with the kvedit attention on."""
    key = _model_key(model)
    plans = _plans()
    if key in plans:
        from .errors import KVEditError

        raise KVEditError(
            "nested steering of one model is not supported: this model already has an active "
            "kvedit plan in this thread/context; leave it first, or combine the spans in one call"
        )
    token = _PLANS.set({**plans, key: plan})
    try:
        with use_kvedit_attention(model):
            yield plan
    finally:
        _PLANS.reset(token)


# --------------------------------------------------------------------------------------------
# The mask function and the attention function transformers calls
# --------------------------------------------------------------------------------------------


def kvedit_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask function for ``AttentionMaskInterface``: pass the 2D padding mask through.

    Returns ``attention_mask`` (``[batch, total_len]`` bool, True = attend) or None when nothing
    is padded. Causal and sliding-window masking are done in :func:`kvedit_attention_forward`.
    """
    if attention_mask is None or (attention_mask.ndim == 2 and bool(attention_mask.all())):
        return None
    return attention_mask


def kvedit_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers' ``AttentionInterface``; returns ``[batch, q_len, heads, dim]``."""
    q_len, k_len = query.shape[2], key.shape[2]
    padding = None
    custom_mask = None
    total_len = k_len
    if attention_mask is not None:
        if attention_mask.ndim == 2:
            total_len = max(attention_mask.shape[-1], k_len)
            padding = _right_align(attention_mask.bool(), k_len)
        else:  # a 4D mask prepared by the caller already encodes causality
            custom_mask = attention_mask[..., -k_len:]
    plan = _plans().get(_model_key(module))
    bias, unbiased = None, q_len
    if plan is not None:
        bias = plan.key_bias(module.layer_idx, k_len, total_len)
        unbiased = plan.unbiased_queries(q_len, total_len) if bias is not None else q_len
    observe = getattr(plan, "observe", None)
    if observe is not None:
        observe(
            module.layer_idx,
            attention_probs(
                query,
                key,
                scale=scaling,
                bias=bias,
                unbiased_queries=unbiased,
                padding=padding,
                window=sliding_window,
                softcap=softcap,
            ),
        )
    out = attend(
        query,
        key,
        value,
        scale=scaling,
        bias=bias,
        unbiased_queries=unbiased,
        padding=padding,
        window=sliding_window,
        softcap=softcap,
        custom_mask=custom_mask,
    )
    return out.transpose(1, 2).contiguous(), None


def _right_align(mask_2d: torch.Tensor, k_len: int) -> torch.Tensor:
    """The last ``k_len`` columns of a ``[batch, total]`` mask (left-padded with True if short)."""
    if mask_2d.shape[-1] >= k_len:
        return mask_2d[:, -k_len:]
    pad = mask_2d.new_ones(mask_2d.shape[0], k_len - mask_2d.shape[-1])
    return torch.cat([pad, mask_2d], dim=-1)


# --------------------------------------------------------------------------------------------
# The attention itself
# --------------------------------------------------------------------------------------------


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    unbiased_queries: int = 0,
    padding: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    custom_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention with an additive key bias, aligned bottom-right.

    Args:
        q: ``[B, H, Sq, D]``; query ``i`` sits at absolute index ``Sk - Sq + i``.
        k, v: ``[B, Hkv, Sk, D]`` with ``H % Hkv == 0``.
        scale: logit scale, default ``D ** -0.5``.
        bias: ``[B, Hkv, Sk]`` or ``[B, H, Sk]`` nats added to the logits of every query
            from ``unbiased_queries`` on.
        unbiased_queries: leading queries that get no bias (``scope="decode"``).
        padding: ``[B, Sk]`` bool, False for padded keys.
        window: sliding window; key ``j`` is visible to query ``i`` iff ``i_abs - j < window``.
        softcap: Gemma-2-style logit soft-capping.
        custom_mask: a caller's 4D mask ``[B, 1|H, Sq, Sk]`` (bool or additive) replacing causal
            and window masking.

    Returns:
        ``[B, H, Sq, D]``.
    """
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    scale = D**-0.5 if scale is None else scale
    if bias is None:
        unbiased_queries = Sq
    unbiased_queries = max(0, min(Sq, unbiased_queries))
    plain = padding is None and softcap is None and custom_mask is None
    if _backend() == "triton" and softcap is None and custom_mask is None:  # forced
        return _attend_triton(q, k, v, scale, bias, unbiased_queries, padding, window)
    if plain and unbiased_queries == Sq and (window is None or Sk <= window):
        if Sq == Sk:  # exactly stock sdpa's prefill call
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        if Sq == 1:  # exactly stock sdpa's decode call
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    if (
        Sq == 1
        and plain
        and unbiased_queries == 0
        and (window is None or Sk <= window)
        and not _use_triton(q)
    ):  # biased decode: pack the query group into the query axis, the bias is the whole mask
        G = H // Hkv
        kb = _bias_to_groups(bias.to(q.dtype), Hkv, G)[:, :, :, 0]  # [B, Hkv|1, G|1, Sk]
        kb = kb.clamp_min(torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(q.view(B, Hkv, G, D), k, v, attn_mask=kb, scale=scale)
        return out.view(B, H, 1, -1)
    if _use_triton(q) and softcap is None and custom_mask is None:
        return _attend_triton(q, k, v, scale, bias, unbiased_queries, padding, window)
    return _attend_torch(
        q, k, v, scale, bias, unbiased_queries, padding, window, softcap, custom_mask
    )


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    unbiased_queries: int = 0,
    padding: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention probabilities ``[B, H, Sq, Sk]`` (fp32), same masking as :func:`attend`.

    Materialises the full matrix: meant for short queries (a question over a cached context).
    """
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = D**-0.5 if scale is None else scale
    scores = torch.einsum("bkgqd,bksd->bkgqs", q.float().view(B, Hkv, G, Sq, D), k.float()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    neg = torch.finfo(torch.float32).min
    qi = torch.arange(Sk - Sq, Sk, device=q.device)[:, None]
    kj = torch.arange(Sk, device=q.device)[None, :]
    allowed = kj <= qi
    if window is not None:
        allowed = allowed & (qi - kj < window)
    scores = scores.masked_fill(~allowed, neg)
    if bias is not None and unbiased_queries < Sq:
        kb = _bias_to_groups(bias.float(), Hkv, G)  # [B, Hkv|1, G|1, 1, Sk]
        rows = (torch.arange(Sq, device=q.device) >= unbiased_queries).float()[:, None]
        scores = scores + kb * rows
    if padding is not None:
        scores = scores.masked_fill(~padding[:, None, None, None, :], neg)
    return scores.softmax(-1).view(B, H, Sq, Sk)


def _backend() -> str:
    """``KVEDIT_ATTENTION``: ``"triton"`` or ``"torch"`` forces a path; unset is ``"auto"``."""
    choice = os.environ.get("KVEDIT_ATTENTION", "auto").lower() or "auto"
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"KVEDIT_ATTENTION must be 'triton', 'torch' or unset, not {choice!r}")
    return choice


def _use_triton(q: torch.Tensor) -> bool:
    """Triton on CUDA tensors (auto) or when forced; the torch path otherwise."""
    choice = _backend()
    if choice != "auto":
        return choice == "triton"
    if not q.is_cuda:
        return False
    from . import triton as kt

    return kt.is_available()


def _fold_padding(bias: torch.Tensor | None, padding: torch.Tensor | None, neg: float):
    """Fold a ``[B, Sk]`` padding mask into a bias ``[B, Hb, Sk]`` (or ``[B, 1, Sk]``)."""
    if padding is None:
        return bias
    pad_bias = torch.zeros(padding.shape, dtype=torch.float32, device=padding.device)
    pad_bias = pad_bias.masked_fill(~padding, neg)[:, None, :]
    return pad_bias if bias is None else bias.float() + pad_bias


def _attend_triton(q, k, v, scale, bias, unbiased, padding, window) -> torch.Tensor:
    from . import triton as kt

    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    pad_only = _fold_padding(None, padding, -1e30)
    full = _fold_padding(bias, padding, -1e30)

    def expand(b):  # the kernel takes [B, Hkv|H, Sk]
        return None if b is None else b.expand(B, max(b.shape[1], k.shape[1]), b.shape[-1])

    parts = []
    if unbiased > 0:  # leading queries: keys beyond the last of them are invisible anyway
        kv_end = Sk - Sq + unbiased
        pb = expand(pad_only[..., :kv_end]) if pad_only is not None else None
        parts.append(
            kt.attention(
                q[:, :, :unbiased],
                k[:, :, :kv_end],
                v[:, :, :kv_end],
                pb,
                causal=True,
                window=window,
                scale=scale,
            )
        )
    if unbiased < Sq:
        parts.append(
            kt.attention(
                q[:, :, unbiased:], k, v, expand(full), causal=True, window=window, scale=scale
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _attend_torch(q, k, v, scale, bias, unbiased, padding, window, softcap, custom_mask):
    """Chunked over queries; GQA by folding each KV head's query group into the query axis."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = H // Hkv
    neg = torch.finfo(q.dtype).min
    q5 = q.view(B, Hkv, G, Sq, D)
    out5 = q.new_empty(B, Hkv, G, Sq, v.shape[-1])
    biased = _fold_padding(bias, padding, neg)
    unbiased_bias = _fold_padding(None, padding, neg)
    if custom_mask is not None and custom_mask.dtype == torch.bool:
        custom_mask = torch.zeros(custom_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~custom_mask, neg
        )
    rows = max(1, MASK_CHUNK_BYTES // max(1, B * H * Sk * q.element_size()))
    offset = Sk - Sq  # absolute index of query 0
    bounds = [(0, unbiased, unbiased_bias), (unbiased, Sq, biased)]
    for start, stop, key_bias in bounds:
        for a in range(start, stop, rows):
            b = min(stop, a + rows)
            k_hi = offset + b if custom_mask is None else Sk  # keys after the last query: masked
            k_lo = 0
            if window is not None and custom_mask is None:
                k_lo = max(0, offset + a - window + 1)
            k_hi = max(k_hi, k_lo + 1)
            mask = _chunk_mask(
                a, b, k_lo, k_hi, offset, window, key_bias, custom_mask, q.dtype, Hkv, G, neg
            )
            c = b - a
            qc = q5[:, :, :, a:b].reshape(B, Hkv, G * c, D)
            kc, vc = k[:, :, k_lo:k_hi], v[:, :, k_lo:k_hi]
            mask = mask.expand(B, Hkv, G, c, k_hi - k_lo).reshape(B, Hkv, G * c, k_hi - k_lo)
            if softcap is None:
                oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale)
            else:
                scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale
                scores = torch.tanh(scores / softcap) * softcap + mask
                oc = torch.matmul(scores.softmax(-1), vc)
            out5[:, :, :, a:b] = oc.view(B, Hkv, G, c, -1)
    return out5.view(B, H, Sq, -1)


def _chunk_mask(a, b, k_lo, k_hi, offset, window, key_bias, custom_mask, dtype, Hkv, G, neg):
    """The additive mask of queries ``[a, b)`` over keys ``[k_lo, k_hi)``: ``[B|1, Hkv|1, G|1, c, kw]``."""
    device = key_bias.device if key_bias is not None else None
    if custom_mask is not None:
        base = custom_mask[:, :, a:b, k_lo:k_hi].to(dtype)  # [B, 1|H, c, kw]
        base = base[:, :, None] if base.shape[1] == 1 else base.unflatten(1, (-1, G))
    else:
        qi = torch.arange(offset + a, offset + b, device=device)[:, None]
        kj = torch.arange(k_lo, k_hi, device=device)[None, :]
        allowed = kj <= qi
        if window is not None:
            allowed = allowed & (qi - kj < window)
        base = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, neg)
        base = base[None, None, None]  # [1, 1, 1, c, kw]
    if key_bias is None:
        return base
    kb = key_bias[..., k_lo:k_hi].to(dtype).clamp_min(neg)  # [B, 1|Hkv|H, kw]
    kb = _bias_to_groups(kb, Hkv, G)  # [B, Hkv|1, G|1, 1, kw]
    return torch.maximum(base + kb, torch.tensor(neg, dtype=dtype, device=kb.device))


def _bias_to_groups(kb: torch.Tensor, Hkv: int, G: int) -> torch.Tensor:
    """``[B, Hb, kw]`` -> broadcastable ``[B, Hkv|1, G|1, 1, kw]``.

    ``Hb`` is 1 (shared), ``Hkv`` (per KV head) or ``H = Hkv * G`` (per query head; query head
    ``h`` belongs to KV head ``h // G``, as in transformers' ``repeat_kv``).
    """
    B, Hb, kw = kb.shape
    if Hb == 1:
        return kb.view(B, 1, 1, 1, kw)
    if Hb == Hkv:
        return kb.view(B, Hkv, 1, 1, kw)
    if Hb == Hkv * G:
        return kb.view(B, Hkv, G, 1, kw)
    raise ValueError(f"bias has {Hb} heads; expected 1, {Hkv} (kv heads) or {Hkv * G} (heads)")
