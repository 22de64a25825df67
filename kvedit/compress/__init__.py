"""Cache compression, in one place: selection, quantization and merging.

==========================  ==================================================================
``select``                  keep per KV head the entries a scorer ranks best (:mod:`.selection`)
``snapkv``                  ``select`` with the SnapKV scorer, biased entries not protected
``quantize``                KIVI-style 2/4/8-bit keys (per channel) and values (per token)
                            (:mod:`.quantization`)
``minicache``               merge adjacent deep layers' K/V pairwise (shared directions, own
                            norms; :mod:`.merging`)
==========================  ==================================================================

Selection: a scorer is one small class whose ``score`` gives ``[batch, kv_heads, n]`` scores per
layer (:mod:`.scorers`: ``snapkv``, ``knorm``, ``tova``, ``h2o``, ``reconstruct``, ``kvzip``,
``learned``, ``window``, registered by name; :func:`rank_keep` ranks entries of several layers
under one budget);
:class:`AdaKV` wraps any scorer to share a layer's budget among its heads by score mass
(:mod:`.adakv`). Kept entries are stored as a masked union (:mod:`.masking`); the attention
read-outs that score them are in :mod:`.observe`::

    from kvedit.compress import AdaKV, KNorm, select

    small = select(state, AdaKV(KNorm()), keep=0.5, protect="Carol's secret number")

Quantized and merged states hold packed layers (:mod:`kvedit.cache.quantized`,
:mod:`kvedit.cache.merged`). Every function here is also in :mod:`kvedit.ops`.
"""

from __future__ import annotations

from .adakv import AdaKV, adaptive_budgets
from .allocation import rank_keep
from .masking import DROPPED, live_entries, masked_union
from .merging import merge_layers, merge_plan, minicache, slerp
from .quantization import quantize
from .scorers import (
    H2O,
    SCORERS,
    TOVA,
    KNorm,
    KVzip,
    Learned,
    Reconstruct,
    Scorer,
    SnapKV,
    Window,
    make_scorer,
    register_scorer,
)
from .selection import keep_mask, protected_tokens, select, snapkv

__all__ = [
    "DROPPED",
    "H2O",
    "SCORERS",
    "TOVA",
    "AdaKV",
    "KNorm",
    "KVzip",
    "Learned",
    "Reconstruct",
    "Scorer",
    "SnapKV",
    "Window",
    "adaptive_budgets",
    "keep_mask",
    "live_entries",
    "make_scorer",
    "masked_union",
    "merge_layers",
    "merge_plan",
    "minicache",
    "protected_tokens",
    "quantize",
    "rank_keep",
    "register_scorer",
    "select",
    "slerp",
    "snapkv",
]
