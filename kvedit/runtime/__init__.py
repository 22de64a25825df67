"""kvedit's runtime: one attention seam (:mod:`.seam`), bias plans (:mod:`.plans`), running
(:mod:`.running`), installed once per model, and the gate in front of it (:mod:`.gate`).

**The seam.** :func:`prepare` switches a model, once, to the ``"kvedit"`` attention and mask
functions (registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``).
They look up the :class:`BiasPlan` active for the model *in the current context*
(:mod:`contextvars`): with none, they call the model's original attention and mask functions
with the same arguments, so an unsteered forward is bit-for-bit what it was before kvedit
touched the model; with one, they run kvedit's attention (:func:`kvedit.attention.attend`),
which adds the plan's per-key bias and masks causally, aligned bottom-right. The implementation
is never flipped per call, so a forward in another thread, or in this thread outside an
:func:`activate` block, is never steered. :func:`unprepare` restores the original.

What a prepared model looks like to other code: ``model.config._attn_implementation`` is
``"kvedit"`` (``unprepare`` puts the original back; save a model after ``unprepare`` if the
saved config must name the original); a forward pre-hook is registered on the model; outputs
are unchanged while no plan is active. ``torch.compile`` sees Python control flow in the
attention (a context-variable lookup per layer) and breaks the graph there.

**The gate.** :func:`spec` (called by :func:`prepare`) probes the model once and caches a
:class:`ModelSpec`: the seam really is called by every layer; kvedit's attention reproduces
the model's own (logits of a tiny prefill and decode, with a zero bias, against the original
functions); each layer's sliding window comes from the cache layer transformers builds for it.
Anything kvedit cannot do exactly raises :class:`~kvedit.errors.UnsupportedModelError`
naming the model, the layer and the reason, before any work.
"""

from __future__ import annotations

from .gate import LayerSpec, ModelSpec, is_prepared, layer_windows, prepare, spec, unprepare
from .plans import BiasPlan, active_plan, detached
from .running import activate, forward
from .seam import ATTENTION_NAME, kvedit_attention_forward, kvedit_mask, register

__all__ = [
    "ATTENTION_NAME",
    "BiasPlan",
    "LayerSpec",
    "ModelSpec",
    "activate",
    "active_plan",
    "detached",
    "forward",
    "is_prepared",
    "kvedit_attention_forward",
    "kvedit_mask",
    "layer_windows",
    "prepare",
    "register",
    "spec",
    "unprepare",
]
