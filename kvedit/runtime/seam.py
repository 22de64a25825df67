"""The attention seam: kvedit's attention and mask functions, registered with transformers'
``AttentionInterface`` and ``AttentionMaskInterface`` under the name ``"kvedit"``.

They look up the plan active for the model in the current context (:mod:`.plans`): with none,
they call the model's original functions (recorded in :data:`PREPARED` by
:func:`kvedit.runtime.prepare`) with the same arguments, so an unsteered forward is bit-for-bit
what it was; with one, kvedit's attention (:func:`kvedit.attention.attend`) adds the plan's
per-key bias and masks causally, aligned bottom-right.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import errors
from ..attention import attend, attend_probs, attention_probs
from .plans import active_entry

__all__ = [
    "ATTENTION_NAME",
    "PREPARED",
    "Prepared",
    "kvedit_attention_forward",
    "kvedit_mask",
    "register",
]

ATTENTION_NAME = "kvedit"

# Attention keyword arguments kvedit's attention may ignore: they say nothing it does not
# already know (positions are in the keys, causality is bottom-right by construction).
_IGNORED_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "output_attentions",
        "use_cache",
        "past_key_values",
        "cache",
        "layer_idx",
        "position_embeddings",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
    }
)


@dataclass
class Prepared:
    """What :func:`kvedit.runtime.prepare` changed on a model: its original implementation."""

    original: str
    model: weakref.ref
    hook: object


PREPARED: dict[int, Prepared] = {}  # config key -> what prepare() changed


def register() -> None:
    """Register the ``"kvedit"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvedit_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, kvedit_mask)


def _original(config) -> str | None:
    if config is None:
        return None
    entry = PREPARED.get(id(config))
    return None if entry is None else entry.original


def kvedit_mask(*args, attention_mask: torch.Tensor | None = None, config=None, **kwargs):
    """Mask function for ``AttentionMaskInterface``.

    With a plan active: the 2D padding mask (``[batch, total_len]`` bool, True = attend) or
    None when nothing is padded; causal and window masking happen in the attention. Without
    one: the original implementation's mask function, called with the same arguments.
    """
    key = None if config is None else id(config)
    if key is not None and active_entry(key) is None:
        original = _original(config)
        if original is not None:
            fn = ALL_MASK_ATTENTION_FUNCTIONS[original]
            return fn(*args, attention_mask=attention_mask, config=config, **kwargs)
    if attention_mask is None or (attention_mask.ndim == 2 and bool(attention_mask.all())):
        return None
    return attention_mask


def _original_attention(module: torch.nn.Module, name: str):
    if name == "eager":  # modeling files keep eager attention as a module-level function
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise errors.UnsupportedModelError(
                f"{type(module).__module__}: no eager_attention_forward to delegate to"
            )
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


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
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers' ``AttentionInterface``; returns ``[batch, q_len, heads, dim]``.

    ``query [batch, heads, q_len, dim]``, ``key``/``value [batch, kv_heads, k_len, dim]``.
    Without an active plan for ``module``'s model in this context: the original function.
    """
    active = active_entry(id(module.config))
    if active is None:
        fn = _original_attention(module, _prepared(module).original)
        extra = {} if s_aux is None else {"s_aux": s_aux}
        return fn(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            **extra,
            **kwargs,
        )
    _refuse_unknown(module, kwargs)
    plan = active.plan
    q_len, k_len = query.shape[2], key.shape[2]
    padding, custom_mask, total_len = _masks(attention_mask, k_len)
    bias = plan.key_bias(module.layer_idx, k_len, total_len)
    unbiased = plan.unbiased_queries(q_len, total_len) if bias is not None else q_len
    observe = getattr(plan, "observe", None)
    common = dict(
        scale=scaling,
        bias=bias,
        unbiased_queries=unbiased,
        padding=padding,
        window=sliding_window,
        softcap=softcap,
        sinks=s_aux,
    )
    probs = None
    if observe is not None:
        probs = attention_probs(query, key, **common)
        observe(module.layer_idx, probs)
    # a plan that only scores (its pass's outputs feed nothing but the rest of that scoring) may
    # take the output from the probabilities, equal up to rounding; every other pass computes
    # it as an unobserved one does, bit for bit
    if probs is not None and custom_mask is None and getattr(plan, "output_from_probs", False):
        out = attend_probs(probs, value)
    else:
        out = attend(query, key, value, custom_mask=custom_mask, **common)
    return out.transpose(1, 2).contiguous(), None


def _prepared(module: torch.nn.Module):
    """The entry :func:`kvedit.prepare` made for ``module``'s model; refused if none."""
    entry = PREPARED.get(id(module.config))
    if entry is None:
        raise errors.UnsupportedModelError(
            "the 'kvedit' attention was called for a model kvedit did not prepare; use "
            "kvedit.prepare(model) instead of set_attn_implementation('kvedit')"
        )
    return entry


def _refuse_unknown(module: torch.nn.Module, kwargs: dict) -> None:
    """Refuse attention arguments kvedit's attention does not implement (set, not ignored)."""
    unknown = sorted(
        k
        for k, v in kwargs.items()
        if k not in _IGNORED_KWARGS
        and not k.startswith(("output_", "return_"))
        and v is not None
        and not (k == "is_causal" and v is True)
    )
    if unknown:
        raise errors.UnsupportedModelError(
            f"{getattr(module.config, 'model_type', '?')} layer {module.layer_idx}: attention "
            f"arguments {unknown} are not implemented by kvedit's attention"
        )


def _masks(
    attention_mask: torch.Tensor | None, k_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """``(padding, custom_mask, total_len)`` from the mask transformers passes: a 2D padding
    mask right-aligned to the keys (and the length it spans), or a 4D mask (which already
    encodes causality) cut to the keys."""
    if attention_mask is None:
        return None, None, k_len
    if attention_mask.ndim == 2:
        total_len = max(attention_mask.shape[-1], k_len)
        return _right_align(attention_mask.bool(), k_len), None, total_len
    return None, attention_mask[..., -k_len:], k_len


def _right_align(mask_2d: torch.Tensor, k_len: int) -> torch.Tensor:
    """The last ``k_len`` columns of a ``[batch, total]`` mask (left-padded with True if short)."""
    if mask_2d.shape[-1] >= k_len:
        return mask_2d[:, -k_len:]
    pad = mask_2d.new_ones(mask_2d.shape[0], k_len - mask_2d.shape[-1])
    return torch.cat([pad, mask_2d], dim=-1)
