"""kvedit's attention math: causal attention with an additive per-key logit bias.

:func:`attend` masks causally with bottom-right alignment, so a question on top of a captured
document sees the whole document (torch SDPA's ``is_causal`` aligns top-left, which is wrong
there), and adds a bias ``[batch, kv_heads or heads, k_len]`` in nats to the logits of the keys.
It also implements sliding windows, Gemma-2-style soft-capping and gpt-oss attention sinks.
The seam transformers calls (and the plans that say where the bias comes from) live in
:mod:`kvedit.runtime`.

Shapes used throughout: queries ``[batch, heads, q_len, head_dim]``; keys and values
``[batch, kv_heads, k_len, head_dim]``; biases ``[batch, kv_heads or heads, k_len]`` in nats.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from . import errors

# Bytes allowed for one chunk's float mask in the torch path; prefill is chunked over queries so
# a full [heads, q, k] mask is never materialised.
MASK_CHUNK_BYTES = 16 * 2**20


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
    sinks: torch.Tensor | None = None,
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
        sinks: ``[H]`` gpt-oss attention sinks: a per-head logit in every query's softmax
            denominator that takes probability mass but adds no value.

    Returns:
        ``[B, H, Sq, D]``.
    """
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if H % Hkv:
        raise errors.InvalidInputError(
            f"query heads ({H}) must be a multiple of key/value heads ({Hkv})"
        )
    scale = D**-0.5 if scale is None else scale
    if bias is None:
        unbiased_queries = Sq
    unbiased_queries = max(0, min(Sq, unbiased_queries))
    plain = padding is None and softcap is None and custom_mask is None and sinks is None
    if _backend() == "triton" and softcap is None and custom_mask is None:  # forced
        return _attend_triton(q, k, v, scale, bias, unbiased_queries, padding, window, sinks)
    if plain and unbiased_queries == Sq and (window is None or Sk <= window):
        if Sq == Sk:  # exactly stock sdpa's prefill call
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        if Sq == 1:  # exactly stock sdpa's decode call
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    use_triton = _use_triton(q)
    if (
        Sq == 1
        and plain
        and unbiased_queries == 0
        and (window is None or Sk <= window)
        and not use_triton
    ):  # biased decode: pack the query group into the query axis, the bias is the whole mask
        G = H // Hkv
        kb = _bias_to_groups(bias.to(q.dtype), Hkv, G)[:, :, :, 0]  # [B, Hkv|1, G|1, Sk]
        kb = kb.clamp_min(torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(q.view(B, Hkv, G, D), k, v, attn_mask=kb, scale=scale)
        return out.view(B, H, 1, -1)
    if use_triton and softcap is None and custom_mask is None:
        return _attend_triton(q, k, v, scale, bias, unbiased_queries, padding, window, sinks)
    return _attend_torch(
        q, k, v, scale, bias, unbiased_queries, padding, window, softcap, custom_mask, sinks
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities ``[B, H, Sq, Sk]`` (fp32), same masking as :func:`attend`.

    Materialises the full matrix: meant for short queries (a question over a cached context).
    """
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = D**-0.5 if scale is None else scale
    # one matmul per KV head over its whole query group (an einsum over the group axis runs
    # several times slower on CPU)
    qg = (q.float() * scale).reshape(B, Hkv, G * Sq, D)
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).view(B, Hkv, G, Sq, Sk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    neg = torch.finfo(torch.float32).min
    qi = torch.arange(Sk - Sq, Sk, device=q.device)[:, None]
    kj = torch.arange(Sk, device=q.device)[None, :]
    allowed = kj <= qi
    if window is not None:
        allowed = allowed & (qi - kj < window)
    scores.masked_fill_(~allowed, neg)  # in place: the scores are this call's own tensor
    if bias is not None and unbiased_queries < Sq:
        kb = _bias_to_groups(bias.float(), Hkv, G)  # [B, Hkv|1, G|1, 1, Sk]
        rows = (torch.arange(Sq, device=q.device) >= unbiased_queries).float()[:, None]
        scores = scores + kb * rows
    if padding is not None:
        scores = scores.masked_fill(~padding[:, None, None, None, :], neg)
    if sinks is None:
        return scores.softmax(-1).view(B, H, Sq, Sk)
    sink = sinks.float().view(1, Hkv, G, 1, 1).expand(B, Hkv, G, Sq, 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :Sk].reshape(B, H, Sq, Sk)


def attend_probs(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention output ``[B, H, Sq, D]`` (``v``'s dtype) of probabilities ``[B, H, Sq, Sk]``
    from :func:`attention_probs` over values ``[B, Hkv, Sk, D]``: what :func:`attend` returns
    for the same masking, without computing the attention a second time."""
    B, H, Sq, Sk = probs.shape
    Hkv, D = v.shape[1], v.shape[3]
    out = torch.matmul(probs.reshape(B, Hkv, (H // Hkv) * Sq, Sk), v.float())
    return out.view(B, H, Sq, D).to(v.dtype)


def _backend() -> str:
    """``KVEDIT_ATTENTION``: ``"triton"`` or ``"torch"`` forces a path; unset is ``"auto"``."""
    choice = os.environ.get("KVEDIT_ATTENTION", "auto").lower() or "auto"
    if choice not in ("auto", "triton", "torch"):
        raise errors.InvalidInputError(
            f"KVEDIT_ATTENTION must be 'triton', 'torch' or unset, not {choice!r}"
        )
    return choice


def _use_triton(q: torch.Tensor) -> bool:
    """Triton on CUDA tensors (auto) or when forced; the torch path otherwise."""
    choice = _backend()
    if choice != "auto":
        return choice == "triton"
    if not q.is_cuda:
        return False
    return _triton_on_cuda()


@functools.cache
def _triton_on_cuda() -> bool:
    """Whether the Triton kernels run on this machine's GPU (asked once per process, not per
    decode step)."""
    from . import triton as kt

    return kt.is_available()


def _fold_padding(bias: torch.Tensor | None, padding: torch.Tensor | None, neg: float):
    """Fold a ``[B, Sk]`` padding mask into a bias ``[B, Hb, Sk]`` (or ``[B, 1, Sk]``)."""
    if padding is None:
        return bias
    pad_bias = torch.zeros(padding.shape, dtype=torch.float32, device=padding.device)
    pad_bias = pad_bias.masked_fill(~padding, neg)[:, None, :]
    return pad_bias if bias is None else bias.float() + pad_bias


def _attend_triton(q, k, v, scale, bias, unbiased, padding, window, sinks=None) -> torch.Tensor:
    """kvedit.triton.attention on the biased and unbiased queries. A decode step without
    padding (one query, biased or not) is one kernel call and no other device work: the bias
    goes in as an ``expand``-ed view, the sinks as they are (the kernel converts them)."""
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
                sinks=sinks,
            )
        )
    if unbiased < Sq:
        parts.append(
            kt.attention(
                q[:, :, unbiased:],
                k,
                v,
                expand(full),
                causal=True,
                window=window,
                scale=scale,
                sinks=sinks,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _attend_torch(q, k, v, scale, bias, unbiased, padding, window, softcap, custom_mask, sinks):
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
            if softcap is None and sinks is None:
                oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale)
            else:
                scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                scores = scores + mask
                if sinks is None:
                    probs = scores.softmax(-1)
                else:  # one extra logit per query head: [B, Hkv, G * c, 1]
                    sink = sinks.to(scores.dtype).view(1, Hkv, G, 1, 1).expand(B, Hkv, G, c, 1)
                    full = torch.cat([scores, sink.reshape(B, Hkv, G * c, 1)], dim=-1)
                    probs = full.softmax(-1)[..., :-1]
                oc = torch.matmul(probs.to(vc.dtype), vc)
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
    raise errors.InvalidInputError(
        f"bias has {Hb} heads; expected 1, {Hkv} (kv heads) or {Hkv * G} (heads)"
    )
