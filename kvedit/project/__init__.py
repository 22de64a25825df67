"""Cross-model KV projection: turn model A's cache of a text into a cache for model B.

A :class:`Projector` is fitted once per model pair on calibration text and then maps any
:class:`~kvedit.KVState` of model A to a state for model B, without B reading the text:

* **Tokens** are aligned by characters (:mod:`.align`): B tokenizes the state's text, and each B
  token takes A's K/V at the last A token that starts at or before the B token's last character
  (the A token that holds that character, when one does). B's special tokens (BOS, chat
  markers), which have no counterpart in A, are computed by B itself (at the start of the text
  that is exact: BOS sees nothing before it).
* **RoPE** is undone on A's keys (rotation by ``-position`` with A's per-layer frequencies), the
  map works on position-free keys, and B's RoPE is applied at B's positions (:mod:`.features`).
* **The map** is one ridge regression per B layer (:mod:`.ridge`), from A's keys and values (all
  KV heads, flattened) at the ``depth_window`` A layers nearest to the same relative depth, plus
  an indicator of A's first token (A's attention sink), to B's position-free keys and values.
  It is fitted (:mod:`.fit`) from running sums ``XᵀX``, ``XᵀY`` (float64, on shifted data), so
  memory stays flat in the amount of text. Features are standardised; the ridge strength is
  chosen per layer, separately for keys and values, on held-out calibration text (every
  ``heldout_every``-th text), then the map is refitted on all text.
* **The last token(s)** (``own_last``, default 1) are run through B on top of the projected
  cache (:mod:`.projector`), so ``last_logits`` are B's honest prediction after the projected
  prefix, and the state continues exactly like a captured one. Sliding-window layers keep only
  the entries B's own captured cache keeps.

A projector is stored as one safetensors file with JSON metadata (no pickles), written
atomically, and checks the fingerprints of both models and tokenizers (:mod:`.io`): applying it
to another pair raises :class:`~kvedit.errors.CacheMismatchError`.
"""

from __future__ import annotations

from .align import align_tokens, depth_matched_layers, special_token_mask
from .features import stacked_inv_freq
from .io import FORMAT, FORMAT_VERSION
from .projector import Projector

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Projector",
    "align_tokens",
    "depth_matched_layers",
    "special_token_mask",
    "stacked_inv_freq",
]
