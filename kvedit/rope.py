"""Rotary position embeddings of a model, per decoder layer, and moving cached keys in position.

Cached keys are post-RoPE: a key cached at position ``p`` is ``rope(k, p)``. Since RoPE is a
rotation, ``rope(k, p + d) == rotate(rope(k, p), d)``, so a cached passage can be moved to other
positions without recomputing it (:func:`move_keys`), given each layer's rotary inverse
frequencies (:func:`layer_inv_freq`).

transformers 5.x keeps one rotary module on the decoder (``model.model.rotary_emb``). Llama and
Qwen2 use one ``inv_freq`` for every layer; Gemma-3 keeps one per layer type
(``sliding_attention_inv_freq``, base 10k, and ``full_attention_inv_freq``, base 1M with linear
scaling), and each layer uses the one of its ``config.layer_types`` entry. RoPE variants whose
frequencies depend on the sequence length (``dynamic``, ``longrope``) cannot be re-rotated and
are refused.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .compat import text_config
from .errors import UnsupportedModelError

# RoPE types whose inverse frequencies change with the sequence length: a cached key's rotation
# then depends on how long the sequence was when it was cached, which a fixed delta cannot undo.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def _rotary_module(model: PreTrainedModel) -> torch.nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no shared rotary embedding (model.model.rotary_emb) found; "
            "kvedit re-rotates keys of Llama-, Qwen2- and Gemma-3-style models"
        )
    return rotary


def layer_inv_freq(model: PreTrainedModel) -> list[torch.Tensor]:
    """Per decoder layer, the rotary inverse frequencies ``[head_dim // 2]`` (float32).

    Raises:
        UnsupportedModelError: no rotary module, a length-dependent RoPE type, or partial
            rotary embeddings (frequencies that do not cover the whole head dimension).
    """
    cfg = text_config(model)
    rotary = _rotary_module(model)
    n_layers = cfg.num_hidden_layers
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope_type = getattr(rotary, "rope_type", "default")
    out = []
    for layer_type in layer_types:
        kind = rope_type.get(layer_type, "default") if isinstance(rope_type, dict) else rope_type
        if kind in _LENGTH_DEPENDENT:
            raise UnsupportedModelError(
                f"{cfg.model_type}: RoPE type {kind!r} changes its frequencies with the sequence "
                "length, so cached keys cannot be moved by a fixed rotation"
            )
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None)
        if inv_freq is None:
            inv_freq = getattr(rotary, "inv_freq", None)
        if inv_freq is None:
            raise UnsupportedModelError(
                f"{cfg.model_type}: the rotary module has no inv_freq for layer type {layer_type!r}"
            )
        if inv_freq.numel() * 2 != head_dim:
            raise UnsupportedModelError(
                f"{cfg.model_type}: rotary frequencies cover {inv_freq.numel() * 2} of "
                f"{head_dim} head dimensions; partial rotary embeddings are not supported"
            )
        out.append(inv_freq.detach().to(torch.float32))
    return out


def move_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys ``[batch, kv_heads, n, head_dim]`` cached at positions ``p`` -> the same keys at
    ``p + delta`` (``delta``: ``LongTensor[n]``, may be negative).

    Uses the Triton kernel on CUDA when Triton is available, else the torch reference (float32
    angles either way). Returns a new tensor in ``keys.dtype``.
    """
    from . import triton as kt

    delta = delta.to(device=keys.device, dtype=torch.long)
    inv_freq = inv_freq.to(device=keys.device, dtype=torch.float32)
    if keys.is_cuda and kt.is_available():
        return kt.rerotate(keys.contiguous(), delta, inv_freq)
    return kt.rerotate_reference(keys, delta, inv_freq)
