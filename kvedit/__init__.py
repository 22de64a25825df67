"""kvedit: edit a language model's KV cache to change what it pays attention to.

Everything a user needs is reachable from ``import kvedit``: the names below, and the
subpackages ``kvedit.integrations`` (vLLM, imported without vLLM), ``kvedit.ops`` (cache
edits), ``kvedit.compress`` (selection, quantization, merging), ``kvedit.errors``,
``kvedit.store``, ``kvedit.project`` and ``kvedit.testing``.

The names are loaded on first use (PEP 562): ``import kvedit`` itself imports neither torch
nor transformers, so the ``kvedit`` command line can print its help at once;
``kvedit.capture`` (or ``from kvedit import capture``) imports what it needs then.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:  # the same names, for type checkers and editors
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

_SUBPACKAGES = ("compress", "errors", "integrations", "ops", "testing")

# Each public name -> the module (relative to this package) that defines it.
_HOMES: dict[str, tuple[str, ...]] = {
    ".cache": ("LayerKV",),
    ".cache.adapter": ("dynamic_cache",),
    ".focusing.choice": ("DEFAULT_GUARD", "Focus", "choose", "focus", "focus_text"),
    ".focusing.guard": (
        "AgreementGuard",
        "AgreementVerdict",
        "Guard",
        "SupportGuard",
        "SupportVerdict",
        "Verdict",
    ),
    ".focusing.readout": ("AttentionShare", "attention_share"),
    ".memory.conversation": ("Memory",),
    ".memory.records": ("Turn",),
    ".models": ("load_model",),
    ".project": ("Projector",),
    ".prompts": ("chat_prefix", "templated_prompt"),
    ".reusing.blending": ("BlendReport", "blend"),
    ".reusing.prefix": ("ReuseReport", "reuse"),
    ".runtime": ("ModelSpec", "prepare", "unprepare"),
    ".states.capturing": ("capture", "capture_tokens"),
    ".states.decoding": ("Answer", "Decoder", "eos_ids"),
    ".states.files.read": ("load_state",),
    ".states.state": ("KVState",),
    ".steering.session": ("Steering", "steer", "strength_for_share", "strength_from_pasta_alpha"),
    ".store": ("KVStore",),
}
_LAZY: dict[str, str] = {name: module for module, names in _HOMES.items() for name in names}


def _load_all() -> None:
    """Import every module the public names live in (what this package imported eagerly before
    it was lazy), so that after the first use of a public name ``kvedit.focusing.choice`` and
    the like are there, as they always were."""
    for module in (*_HOMES, *(f".{sub}" for sub in _SUBPACKAGES)):
        importlib.import_module(module, __name__)


def __getattr__(name: str) -> Any:
    """Load a public name (or a submodule) on first use, then keep it in the module."""
    if name in _LAZY:
        _load_all()
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        # a submodule (``kvedit.store``), alone: the package's own modules import their
        # siblings this way (``from .. import checks``) while others are half initialised
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
