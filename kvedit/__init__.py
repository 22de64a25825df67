"""kvedit: edit a language model's KV cache to change what it pays attention to."""

from __future__ import annotations

from . import errors, ops
from .attention import register as _register_attention
from .blend import BlendReport, blend
from .models import load_model
from .ops.project import Projector
from .readout import AttentionShare, attention_share
from .reuse import ReuseReport, reuse
from .state import KVState, LayerKV, capture, chat_prefix
from .steer import Steering, steer, strength_for_share, strength_from_pasta_alpha
from .storage import load_state
from .store import KVStore

__version__ = "0.1.0"

_register_attention()

__all__ = [
    "attention_share",
    "AttentionShare",
    "blend",
    "BlendReport",
    "capture",
    "chat_prefix",
    "errors",
    "KVState",
    "KVStore",
    "LayerKV",
    "load_model",
    "load_state",
    "ops",
    "Projector",
    "reuse",
    "ReuseReport",
    "steer",
    "Steering",
    "strength_for_share",
    "strength_from_pasta_alpha",
    "__version__",
]
