"""The scorers, one module each, registered by name (:data:`SCORERS`).

===============  ============================================================================
``snapkv``       pooled attention of an observation window or a query (:mod:`.snapkv`)
``knorm``        minus the key's L2 norm (:mod:`.knorm`)
``tova``         the last token's attention, averaged over heads (:mod:`.tova`)
``h2o``          attention accumulated over the whole text, plus a recent window (:mod:`.h2o`)
``reconstruct``  the most attention an entry gets while the model repeats the text (KVzip,
                 query-agnostic; :mod:`.reconstruct`)
``kvzip``        the same, normalized over the entry's own chunk as KVzip's code does, so
                 scores made as entries arrive compare (:mod:`.kvzip`)
``learned``      ``kvzip``'s scores predicted from each entry's own key and value by a map
                 fit once per model (KVzap's idea; :mod:`.learned`)
``window``       recency: the newest entries first (:mod:`.window`)
===============  ============================================================================
"""

from __future__ import annotations

from .base import SCORERS, Scorer, make_scorer, register_scorer
from .h2o import H2O
from .knorm import KNorm
from .kvzip import KVzip
from .learned import Learned
from .reconstruct import Reconstruct
from .snapkv import SnapKV, pool_scores
from .tova import TOVA
from .window import Window

__all__ = [
    "H2O",
    "SCORERS",
    "TOVA",
    "Window",
    "KNorm",
    "KVzip",
    "Learned",
    "Reconstruct",
    "Scorer",
    "SnapKV",
    "make_scorer",
    "pool_scores",
    "register_scorer",
]
