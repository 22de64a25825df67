"""kvedit: edit a language model's KV cache to change what it pays attention to."""

from __future__ import annotations

from . import errors
from .attention import register as _register_attention
from .models import load_model
from .state import KVState, LayerKV, capture, chat_prefix
from .storage import load_state

__version__ = "0.1.0"

_register_attention()

__all__ = [
    "KVState",
    "LayerKV",
    "__version__",
    "capture",
    "chat_prefix",
    "errors",
    "load_model",
    "load_state",
]
