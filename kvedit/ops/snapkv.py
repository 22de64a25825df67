"""``snapkv``: keep, per KV head, the cache entries an observation window attends to most.

SnapKV (Li et al., 2024) scores every cached entry by the attention an *observation window*
gives it, summed over the window's queries (and over the query heads that share a KV head),
smooths the scores with a 1D max-pool of width ``kernel`` over neighbouring entries (so whole
phrases survive, not isolated tokens), and keeps the top ``keep`` fraction per KV head. The
window is the text of ``query`` when given (say, the question: it is run on top of the state to
read its attention, and not added to the cache), else the state's own last ``window`` tokens
(run again at their positions on top of the rest). The last ``window`` tokens are always kept.

Storage. SnapKV keeps *different* tokens per KV head, while a layer's entries
(``token_index``, ``positions``) are shared by its heads. kvedit therefore keeps, physically,
the union of the entries any head keeps, and masks each head's dropped entries with a ``-1e30``
bias (a ``[batch, kv_heads, n]`` stored bias): attention is exactly per-head SnapKV, and every
other op and the storage format keep working. The memory it really saves is
``1 - union / n`` (plus the bias, 4 bytes per entry and KV head), less than the nominal
``1 - keep`` when heads disagree; compare ``state.nbytes`` before and after. Sliding-window
layers (Gemma-3) are kept whole: they hold at most ``window`` entries already.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..state import KVState, LayerKV, StateBias, recompute_last, run_model

# Bias of an entry a head dropped: exp(-1e30) is exactly 0 in every float type, and unlike -inf
# it stays finite under arithmetic (0 * bias is 0, not NaN).
DROPPED = -1e30


class _Observer(StateBias):
    """The state's bias plan, recording each layer's attention ``[batch, heads, q, k]``."""

    def __init__(self, layers):
        super().__init__(layers)
        self.probs: dict[int, torch.Tensor] = {}

    def observe(self, layer_idx: int, probs: torch.Tensor) -> None:
        self.probs[layer_idx] = probs.sum(dim=2).float()  # [batch, heads, k] over queries


def _observe(
    layers: list[LayerKV], model, ids: list[int], positions: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Summed attention of ``ids`` (run at ``positions`` on top of ``layers``) per layer."""
    observer = _Observer(layers)
    device = layers[0].keys.device
    run_model(
        model,
        layers,
        torch.tensor([ids], device=device),
        positions[None].to(device),
        logits_to_keep=1,
        plan=observer,
    )
    return observer.probs


def _prior_layers(state: KVState, first: int) -> tuple[list[LayerKV], list[torch.Tensor]]:
    """Each layer without the entries of tokens ``>= first``, and the kept entry indices."""
    layers, kept = [], []
    for layer in state.layers:
        keep = (layer.token_index < first).nonzero().flatten()
        layers.append(
            # window=None: keep every entry for the observation pass
            dataclasses.replace(layer.select(keep), window=None)
        )
        kept.append(keep)
    return layers, kept


@torch.no_grad()
def snapkv(
    state: KVState,
    keep: float = 0.5,
    query: str | None = None,
    window: int = 32,
    kernel: int = 5,
) -> KVState:
    """A new state keeping, per KV head of every global layer, ``keep`` of the entries.

    Args:
        state: the state to compress (not modified); needs its model.
        keep: fraction of each layer's entries each KV head keeps, in ``(0, 1]``.
        query: text whose attention scores the entries (e.g. the question), or None to use
            the state's last ``window`` tokens.
        window: observation window (when ``query`` is None); the last ``window`` tokens are
            always kept.
        kernel: odd width of the max-pool over neighbouring entries' scores.

    Returns:
        A state holding, per layer, the union of the entries any head keeps, with a ``-1e30``
        bias (masked) on the entries a head dropped (see the module doc for the memory this saves).
    """
    if not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be a fraction in (0, 1], not {keep!r}")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, not {window!r}")
    if not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be a positive odd int, not {kernel!r}")
    model, _ = state.require_model()
    n_tokens = len(state)
    recent = max(0, n_tokens - window)  # tokens >= recent are always kept
    if keep == 1.0 or recent == 0:
        return state

    if query is not None:
        ids = state.encode(query)
        if not ids:
            raise ValueError("snapkv: the query tokenizes to nothing")
        positions = torch.arange(state.next_position, state.next_position + len(ids))
        probs = _observe(state.layers, model, ids, positions)
        scores = {i: p[..., : len(state.layers[i])] for i, p in probs.items()}
    else:
        prior, kept = _prior_layers(state, recent)
        ids = state.token_ids[recent:].tolist()
        probs = _observe(prior, model, ids, state.position_ids[recent:])
        scores = {}
        for i, layer in enumerate(state.layers):
            full = torch.zeros(*probs[i].shape[:2], len(layer), device=probs[i].device)
            full[..., kept[i].to(full.device)] = probs[i][..., : len(kept[i])]
            scores[i] = full

    new_layers = []
    for i, layer in enumerate(state.layers):
        if layer.window is not None:
            new_layers.append(layer)
            continue
        new_layers.append(_compress(layer, scores[i], keep, recent, kernel))
    return recompute_last(state.replace(layers=new_layers))


def _compress(
    layer: LayerKV, probs: torch.Tensor, keep: float, recent: int, kernel: int
) -> LayerKV:
    """Keep the top entries per KV head; store the union, masking per head by bias.

    ``probs``: ``[batch, heads, n]`` attention summed over the observation queries.
    """
    b, kv_heads, n, _ = layer.keys.shape
    heads = probs.shape[1]
    per_kv = probs.reshape(b, kv_heads, heads // kv_heads, n).sum(dim=2)  # [b, kv_heads, n]
    pooled = F.max_pool1d(per_kv.reshape(-1, 1, n), kernel, stride=1, padding=kernel // 2)
    pooled = pooled.reshape(b, kv_heads, n)
    budget = max(1, round(keep * n))
    protected = (layer.token_index >= recent).nonzero().flatten()[-budget:]
    pooled[..., protected.to(pooled.device)] = float("inf")
    top = pooled.topk(budget, dim=-1).indices  # [b, kv_heads, budget]
    kept = torch.zeros(b, kv_heads, n, dtype=torch.bool, device=pooled.device)
    kept.scatter_(-1, top, True)
    union = kept.any(dim=1).any(dim=0).nonzero().flatten().cpu()  # [m] entries, in order
    u = union.to(layer.keys.device)
    bias_heads = layer.bias.shape[1] if layer.bias is not None else kv_heads
    bias = layer.dense_bias(bias_heads)[..., u].clone()
    dropped = ~kept[..., u.to(kept.device)]  # [b, kv_heads, m]
    if bias_heads != kv_heads:
        dropped = dropped.repeat_interleave(bias_heads // kv_heads, dim=1)
    bias = bias.masked_fill(dropped.to(bias.device), DROPPED)
    return LayerKV(
        keys=layer.keys[:, :, u],
        values=layer.values[:, :, u],
        token_index=layer.token_index[union],
        positions=layer.positions[union],
        bias=bias,
        window=None,
    )
