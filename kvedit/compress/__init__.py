"""Cache compression by selection: a scorer protocol, per-head budgets, protected spans.

``select(state, scorer, keep)`` keeps, per KV head of every global layer, the entries a scorer
ranks best (:mod:`.select`); a scorer is one small class whose ``score`` gives
``[batch, kv_heads, n]`` scores per layer (:mod:`.scorers`: ``snapkv``, ``knorm``, ``tova``,
``h2o``, registered by name); :class:`AdaKV` wraps any scorer to share a layer's budget among
its heads by score mass (:mod:`.adakv`). Kept entries are stored as a masked union
(:mod:`.masking`); the attention read-outs that score them are in :mod:`.observe`::

    from kvedit.compress import AdaKV, KNorm, select

    small = select(state, AdaKV(KNorm()), keep=0.5, protect="Carol's secret number")
"""

from __future__ import annotations

from .adakv import AdaKV, adaptive_budgets
from .masking import DROPPED, live_entries, masked_union
from .scorers import H2O, SCORERS, TOVA, KNorm, Scorer, SnapKV, make_scorer, register_scorer
from .select import keep_mask, protected_tokens, select

__all__ = [
    "DROPPED",
    "H2O",
    "SCORERS",
    "TOVA",
    "AdaKV",
    "KNorm",
    "Scorer",
    "SnapKV",
    "adaptive_budgets",
    "keep_mask",
    "live_entries",
    "make_scorer",
    "masked_union",
    "protected_tokens",
    "register_scorer",
    "select",
]
