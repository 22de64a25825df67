"""kvedit: edit a language model's KV cache to change what it pays attention to."""

from __future__ import annotations

from . import errors, ops, testing
from .blend import BlendReport, blend
from .focus import Focus, focus, focus_text
from .models import load_model
from .project import Projector
from .readout import AttentionShare, attention_share
from .reuse import ReuseReport, reuse
from .runtime import ModelSpec, prepare, unprepare
from .state import KVState, LayerKV, capture, chat_prefix
from .steer import Steering, steer, strength_for_share, strength_from_pasta_alpha
from .storage import load_state
from .store import KVStore

__version__ = "0.2.0"

__all__ = [
    "attention_share",
    "AttentionShare",
    "blend",
    "BlendReport",
    "capture",
    "chat_prefix",
    "errors",
    "focus",
    "Focus",
    "focus_text",
    "KVState",
    "KVStore",
    "LayerKV",
    "load_model",
    "load_state",
    "ModelSpec",
    "ops",
    "prepare",
    "Projector",
    "reuse",
    "ReuseReport",
    "steer",
    "Steering",
    "unprepare",
    "strength_for_share",
    "strength_from_pasta_alpha",
    "testing",
    "__version__",
]
