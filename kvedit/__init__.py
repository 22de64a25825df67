"""kvedit: edit a language model's KV cache to change what it pays attention to."""

from __future__ import annotations

from . import errors, ops
from .attention import register as _register_attention
from .models import load_model
from .readout import AttentionShare, attention_share
from .state import KVState, LayerKV, capture, chat_prefix
from .steer import Steering, steer, strength_for_share, strength_from_pasta_alpha
from .storage import load_state

__version__ = "0.1.0"

_register_attention()

__all__ = [
    "AttentionShare",
    "BlendReport",
    "KVStore",
    "ReuseReport",
    "blend",
    "reuse",
    "Steering",
    "attention_share",
    "ops",
    "steer",
    "strength_for_share",
    "strength_from_pasta_alpha",
    "KVState",
    "LayerKV",
    "__version__",
    "capture",
    "chat_prefix",
    "errors",
    "load_model",
    "load_state",
]
