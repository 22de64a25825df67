"""Fingerprints that tie a stored cache to the model and tokenizer that made it.

A model fingerprint hashes the architecture-defining config fields and a sample of every
parameter (first and last 2,048 values), so two random initialisations of one config differ, while
loading the same weights twice agrees. It is cached per model object.
"""

from __future__ import annotations

import hashlib
import json
import weakref

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

_MODEL_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SAMPLE = 2048

# Config fields that change the meaning of a KV cache. Names, dtypes and versions do not.
_CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "layer_types",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "rope_local_base_freq",
    "query_pre_attn_scalar",
)


def model_config_summary(model: PreTrainedModel) -> dict:
    """The config fields that define a cache's layout and meaning, as a JSON-able dict."""
    cfg = model.config.get_text_config()
    out = {}
    for key in _CONFIG_KEYS:
        value = getattr(cfg, key, None)
        if value is not None:
            out[key] = value
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short hex digest identifying ``model``'s config and weights."""
    cached = _MODEL_CACHE.get(model)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    h.update(json.dumps(model_config_summary(model), sort_keys=True).encode())
    with torch.no_grad():
        for name, param in model.state_dict().items():
            flat = param.detach().reshape(-1)
            sample = torch.cat([flat[:_SAMPLE], flat[-_SAMPLE:]]).to("cpu", torch.float32)
            h.update(name.encode())
            h.update(str(tuple(param.shape)).encode())
            h.update(sample.numpy().tobytes())
    digest = h.hexdigest()[:32]
    _MODEL_CACHE[model] = digest
    return digest


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hex digest of the tokenizer's vocabulary and special tokens."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    h.update(str(getattr(tokenizer, "bos_token", None)).encode())
    return h.hexdigest()[:32]
