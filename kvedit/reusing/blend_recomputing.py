"""Step 4 of :func:`~kvedit.reusing.blending.blend`: recompute the selected tokens.

The selected tokens run through every layer on top of the placed cache, at their own positions.
A selected token sees the reused entries of unselected earlier tokens and the fresh entries of
selected earlier ones (never a stale entry of a selected token): :func:`selection_mask`, one 4D
mask per layer type, with the sliding window on sliding layers. :func:`recompute_selected` runs
them and puts the fresh entries in place of the reused ones (with a gradual
:class:`~kvedit.reusing.blend_rules.Narrowing`, on each layer only those it kept there).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..cache import LayerKV
from ..cache.adapter import dynamic_cache
from ..compat import text_config
from ..errors import UnsupportedModelError
from ..runtime import forward
from ..states.passes import StateBias
from .blend_rules import Narrowing


def selection_mask(
    layer: LayerKV, selected: torch.Tensor, n: int, dtype: torch.dtype, every_reused: bool = False
) -> torch.Tensor:
    """``[1, 1, s, len(layer) + s]`` additive mask (0 or the dtype's lowest value): what
    selected token ``q`` may attend to.

    Reused entries of unselected tokens (of every token with ``every_reused``: a gradual
    recompute's plan hides them per layer) at positions ``<= q``, and recomputed entries of
    selected tokens ``<= q``; within the window on a sliding layer.
    """
    is_selected = torch.zeros(n, dtype=torch.bool)
    if not every_reused:
        is_selected[selected] = True
    q = selected[:, None]
    reused = (~is_selected[layer.positions])[None, :] & (layer.positions[None, :] <= q)
    fresh = selected[None, :] <= q
    if layer.window is not None:
        reused &= q - layer.positions[None, :] < layer.window
        fresh &= q - selected[None, :] < layer.window
    allowed = torch.cat([reused, fresh], dim=-1)[None, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def recompute_selected(
    model: PreTrainedModel,
    layers: list[LayerKV],
    ids: torch.Tensor,
    selected: torch.Tensor,
    narrowing: Narrowing | None = None,
) -> tuple[list[LayerKV], torch.Tensor]:
    """Run the selected tokens through every layer on top of ``layers``; replace their entries
    (with ``narrowing``, on each layer only those of the tokens it kept there).

    Returns the new layers and the logits ``[vocab]`` after the last selected token.
    """
    n = len(ids)
    device = layers[0].keys.device
    kinds = getattr(text_config(model), "layer_types", None) or ["full_attention"] * len(layers)
    masks: dict[str, torch.Tensor] = {}
    held: dict[str, torch.Tensor] = {}  # the transformers mask is per layer type, not per layer
    for layer, kind in zip(layers, kinds, strict=True):
        if kind in held:
            if not torch.equal(held[kind], layer.positions):
                raise UnsupportedModelError(f"{kind} layers hold different entries")
            continue
        held[kind] = layer.positions
        masks[kind] = selection_mask(
            layer, selected, n, layers[0].keys.dtype, narrowing is not None
        )
        masks[kind] = masks[kind].to(device)
    # one layer type: a plain 4D mask (Llama takes no dict); several: one per type (Gemma-3)
    attention_mask = masks if len(masks) > 1 else masks[kinds[0]]

    cache = dynamic_cache(layers)
    logits = forward(
        model,
        ids[selected][None].to(device),
        selected[None].to(device),
        cache,
        plan=StateBias(layers) if narrowing is None else narrowing.plan(layers, cache, selected),
        logits_to_keep=1,
        attention_mask=attention_mask,
    )
    slot = torch.full((n,), -1, dtype=torch.long)  # token -> its fresh entry, or -1
    slot[selected] = torch.arange(len(selected))
    new_layers = []
    for i, layer in enumerate(layers):
        # the cache's tensors are new (reused entries, then fresh ones): edit them in place
        keys, values = cache.layers[i].keys, cache.layers[i].values
        m = len(layer)
        src = slot[layer.positions]  # entry e holds token layer.positions[e]
        if narrowing is not None:  # a token this layer did not keep keeps its reused entry
            src = torch.where(torch.isin(layer.positions, narrowing.kept[i]), src, -1)
        hit = (src >= 0).nonzero().flatten()
        dst, fresh = hit.to(device), (src[hit] + m).to(device)
        keys[:, :, dst] = keys[:, :, fresh]
        values[:, :, dst] = values[:, :, fresh]
        new_layers.append(  # a copy: a view would keep the fresh entries' storage alive
            LayerKV(
                keys[:, :, :m].clone(),
                values[:, :, :m].clone(),
                layer.token_index,
                layer.positions,
                None,
                layer.window,
            )
        )
    return new_layers, logits[0, -1].float()
