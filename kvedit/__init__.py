"""kvedit: edit a language model's KV cache to change what it pays attention to.

Everything a user needs is reachable from ``import kvedit``: the names below, and the
subpackages ``kvedit.integrations`` (vLLM, imported without vLLM), ``kvedit.ops`` (cache
edits), ``kvedit.compress`` (selection, quantization, merging), ``kvedit.errors``,
``kvedit.store``, ``kvedit.project`` and ``kvedit.testing``.
"""

from __future__ import annotations

from . import compress, errors, integrations, ops, testing
from .cache import LayerKV
from .cache.adapter import dynamic_cache
from .focusing.choice import DEFAULT_GUARD, Focus, choose, focus, focus_text
from .focusing.guard import (
    AgreementGuard,
    AgreementVerdict,
    Guard,
    SupportGuard,
    SupportVerdict,
    Verdict,
)
from .focusing.readout import AttentionShare, attention_share
from .memory.conversation import Memory
from .memory.records import Turn
from .models import load_model
from .project import Projector
from .prompts import chat_prefix, templated_prompt
from .reusing.blending import BlendReport, blend
from .reusing.prefix import ReuseReport, reuse
from .runtime import ModelSpec, prepare, unprepare
from .states.capturing import capture, capture_tokens
from .states.decoding import Answer, Decoder, eos_ids
from .states.files.read import load_state
from .states.state import KVState
from .steering.session import Steering, steer, strength_for_share, strength_from_pasta_alpha
from .store import KVStore
from .version import __version__

__all__ = [
    "DEFAULT_GUARD",
    "AgreementGuard",
    "AgreementVerdict",
    "Answer",
    "AttentionShare",
    "BlendReport",
    "Decoder",
    "Focus",
    "Guard",
    "KVState",
    "KVStore",
    "LayerKV",
    "Memory",
    "ModelSpec",
    "Projector",
    "ReuseReport",
    "Steering",
    "SupportGuard",
    "SupportVerdict",
    "Turn",
    "Verdict",
    "__version__",
    "attention_share",
    "blend",
    "capture",
    "capture_tokens",
    "chat_prefix",
    "choose",
    "compress",
    "dynamic_cache",
    "eos_ids",
    "errors",
    "focus",
    "focus_text",
    "integrations",
    "load_model",
    "load_state",
    "ops",
    "prepare",
    "reuse",
    "steer",
    "strength_for_share",
    "strength_from_pasta_alpha",
    "templated_prompt",
    "testing",
    "unprepare",
]
