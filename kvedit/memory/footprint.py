"""Budgets in the model's own units: the cache a model really holds for a conversation, its
sliding windows included (#67).

A budget counted over the global layers (``max_tokens``, :func:`~kvedit.memory.forgetting.
global_entries`) does not compare across families: on Gemma-3 the same fraction of the global
entries leaves a very different share of what the model holds than on SmolLM2, whose every
layer is global. Counted against the model's own windowed cache, a number compares across
families, and with kvpress:

* :func:`own_entries`: the entries the model's own cache holds after ``n_tokens`` tokens, one a
  token on a layer (all its KV heads): ``n_tokens`` on a global layer, ``min(n_tokens, window)``
  on a sliding-window one. Gemma-3 270M: ``3 * N + 15 * min(N, 512)``; SmolLM2: ``30 * N``.
* :func:`own_bytes`: those entries' keys and values, in bytes.
* :func:`held_entries`: the same count for what a state (a memory's) holds, so that
  ``held_entries(state) / own_entries(model, len(state))`` is the fraction a memory keeps.

Each takes a model (its layers as the gate probed them: :func:`kvedit.runtime.gate.spec`, the
windows of :func:`~kvedit.runtime.gate.layer_windows`) or a transformers configuration (no
weights: the windows from its ``layer_types`` and ``sliding_window``, :func:`config_windows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidInputError, UnsupportedModelError

__all__ = [
    "config_windows",
    "held_entries",
    "own_bytes",
    "own_entries",
    "windows_of",
]

# Configurations whose KV-head and head-size fields do not describe the cache the model makes
# (GPT-NeoX: no grouped-query attention whatever num_key_value_heads says; Falcon: one KV head
# for multi-query; GPT-J and GPT-2: n_head; MLA models: a latent cache): their bytes are read
# from the model only.
_BYTES_NEED_THE_MODEL = {
    "gpt_neox": "it keeps a KV head per attention head, whatever num_key_value_heads says",
    "falcon": "its multi-query attention keeps one KV head the fields do not name",
    "gptj": "its config names no KV heads",
    "gpt2": "its config names no KV heads",
    "deepseek_v3": "its multi-head latent attention caches sizes no head_dim names",
    "minicpm3": "its multi-head latent attention caches sizes no head_dim names",
}

_SLIDING = "sliding_attention"
_GLOBAL = ("full_attention", "attention")


def _is_model(thing: Any) -> bool:
    return hasattr(thing, "parameters") and hasattr(thing, "config")


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def config_windows(config: Any) -> list[int | None]:
    """Per decoder layer of a transformers configuration, its sliding window (None: global
    attention): ``layer_types`` where the config has them (``"sliding_attention"`` takes
    ``sliding_window``), else ``sliding_window`` on every layer when it is set and
    ``use_sliding_window`` is not False (Mistral), else every layer global.

    Raises:
        UnsupportedModelError: a layer type kvedit holds no cache for, or a sliding layer
            without a ``sliding_window``.
    """
    text = _text(config)
    n = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None)
    if not kinds:
        on = window and getattr(text, "use_sliding_window", True) is not False
        return [int(window) if on else None] * n
    out: list[int | None] = []
    for i, kind in enumerate(kinds):
        if kind == _SLIDING and not window:
            raise UnsupportedModelError(
                f"{text.model_type} layer {i} is a sliding-window layer, but the config's "
                f"sliding_window is {window!r}"
            )
        if kind != _SLIDING and kind not in _GLOBAL:
            raise UnsupportedModelError(
                f"{text.model_type} layer {i}: layer type {kind!r} has no KV cache kvedit "
                f"counts (known: {_SLIDING}, {', '.join(_GLOBAL)})"
            )
        out.append(int(window) if kind == _SLIDING else None)
    return out


def windows_of(config_or_model: Any) -> list[int | None]:
    """Each layer's window (None: global): a model's as the gate probed it
    (:func:`kvedit.runtime.gate.layer_windows`), a configuration's by :func:`config_windows`."""
    if _is_model(config_or_model):
        from ..runtime.gate import layer_windows

        return list(layer_windows(config_or_model))
    return config_windows(config_or_model)


def _count(n_tokens: int) -> int:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise InvalidInputError(f"n_tokens must be a whole number >= 0, not {n_tokens!r}")
    return n_tokens


def _layer_counts(windows: Sequence[int | None], n: int) -> list[int]:
    return [n if w is None else min(n, w) for w in windows]


def own_entries(config_or_model: Any, n_tokens: int) -> int:
    """The entries the model's own cache holds after ``n_tokens`` tokens: on each layer
    ``n_tokens``, or ``min(n_tokens, window)`` on a sliding-window layer (an entry: a token on
    one layer, all its KV heads).

    Raises:
        InvalidInputError: ``n_tokens`` not a whole number >= 0.
        UnsupportedModelError: a configuration whose layers cannot be read
            (:func:`config_windows`).
    """
    n = _count(n_tokens)
    return sum(_layer_counts(windows_of(config_or_model), n))


def _entry_sizes(config_or_model: Any, dtype: torch.dtype | None) -> list[int]:
    """Bytes one entry (keys and values, every KV head, batch 1) takes on each layer."""
    if _is_model(config_or_model):
        from ..runtime.gate import spec

        size = (dtype or next(config_or_model.parameters()).dtype).itemsize
        return [s.kv_heads * (s.key_dim + s.value_dim) * size for s in spec(config_or_model).layers]
    text = _text(config_or_model)
    why = _BYTES_NEED_THE_MODEL.get(text.model_type)
    if why is not None:
        raise UnsupportedModelError(
            f"own_bytes from a {text.model_type} configuration: {why}; pass the model"
        )
    dtype = dtype or _config_dtype(text)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return [int(heads) * 2 * int(head_dim) * dtype.itemsize] * int(text.num_hidden_layers)


def _config_dtype(text: Any) -> torch.dtype:
    held = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)
    if isinstance(held, str):
        held = getattr(torch, held, None)
    if not isinstance(held, torch.dtype):
        raise InvalidInputError(
            f"own_bytes: the {text.model_type} configuration names no dtype; pass dtype="
        )
    return held


def own_bytes(config_or_model: Any, n_tokens: int, *, dtype: torch.dtype | None = None) -> int:
    """The bytes of the model's own cache after ``n_tokens`` tokens (:func:`own_entries`'
    entries, keys and values of every KV head), in ``dtype`` (None: the model's parameters',
    or the configuration's ``dtype``).

    Raises:
        InvalidInputError: ``n_tokens`` not a whole number >= 0, or a configuration without a
            dtype and none given.
        UnsupportedModelError: a configuration whose fields do not describe its cache (MLA,
            multi-query Falcon, GPT-NeoX, GPT-2/GPT-J): pass the model.
    """
    n = _count(n_tokens)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InvalidInputError(f"dtype must be a torch.dtype, not {dtype!r}")
    counts = _layer_counts(windows_of(config_or_model), n)
    sizes = _entry_sizes(config_or_model, dtype)
    return sum(c * s for c, s in zip(counts, sizes, strict=True))


def held_entries(state) -> float:
    """The entries ``state`` holds, counted as :func:`own_entries` counts them: on each layer
    the entries per KV head, on average over its heads."""
    from .forgetting import layer_entries

    return float(sum(layer_entries(state, i) for i in range(len(state.layers))))
