"""``attention_share``: how much attention a continuation gives each span of a state.

The continuation (say, the question) is run on top of the state with the kvedit attention, which
reports each layer's attention probabilities ``[batch, heads, q_len, k_len]``; the share of a
span is the probability mass on the cache entries of its tokens, averaged over the continuation's
tokens. The stored bias of an edited state is included, so the readout shows what an edit does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spans import Span, Spans, as_span_list
from .state import KVState, StateBias, run_model


@dataclass
class AttentionShare:
    """Attention shares of a continuation over spans of a state.

    Attributes:
        spans: the spans, in the order given.
        per_head: ``[layers, heads, n_spans]`` mean over continuation tokens.
        token_share: ``[n_tokens]`` share each text token gets (all its entries), averaged over
            layers, heads and continuation tokens.
    """

    spans: list[Span]
    per_head: torch.Tensor
    token_share: torch.Tensor

    @property
    def per_layer(self) -> torch.Tensor:
        """``[layers, n_spans]``: mean over heads."""
        return self.per_head.mean(dim=1)

    @property
    def total(self) -> torch.Tensor:
        """``[n_spans]``: mean over layers and heads."""
        return self.per_head.mean(dim=(0, 1))


class _Observer(StateBias):
    """The state's bias plan, plus a per-layer record of attention to each span's entries."""

    def __init__(self, state: KVState, span_tokens: list[torch.Tensor], skip_queries: int = 0):
        super().__init__(state.layers)
        self.state = state
        self.span_tokens = span_tokens
        self.skip = skip_queries
        n_layers, n_tok = len(state.layers), len(state)
        self.per_head: list[torch.Tensor | None] = [None] * n_layers
        self.token_share = torch.zeros(n_layers, n_tok)

    def observe(self, layer_idx: int, probs: torch.Tensor) -> None:
        layer = self.state.layers[layer_idx]
        n = len(layer)
        p = probs[0, :, self.skip :, :n].float().mean(dim=1).cpu()  # [heads, n] over queries
        cols = []
        for tokens in self.span_tokens:
            entries = layer.entries_for(tokens)
            cols.append(p[:, entries].sum(-1))
        self.per_head[layer_idx] = torch.stack(cols, dim=-1)
        valid = layer.token_index >= 0
        self.token_share[layer_idx].index_add_(
            0, layer.token_index[valid], p.mean(0)[valid.to(p.device)]
        )


@torch.no_grad()
def attention_share(state: KVState, continuation: str, spans: Spans) -> AttentionShare:
    """The share of attention ``continuation``'s tokens give each span of ``state``.

    Args:
        state: a captured (possibly edited) state.
        continuation: text that follows the state, e.g. the question.
        spans: one span or a list (substring, regex or character range of ``state.text``).

    Returns:
        An :class:`AttentionShare` with per-head, per-layer and total shares.
    """
    items = as_span_list(spans)
    span_tokens = [state.token_indices(s) for s in items]
    ids = state.encode(continuation)
    if not ids:
        raise ValueError("attention_share needs a non-empty continuation")
    observer = _Observer(state, span_tokens)
    device = state.device
    positions = torch.arange(state.next_position, state.next_position + len(ids), device=device)
    run_model(
        state.model,
        state.layers,
        torch.tensor([ids], device=device),
        positions[None],
        logits_to_keep=1,
        plan=observer,
    )
    per_head = torch.stack([h for h in observer.per_head if h is not None])
    return AttentionShare(items, per_head, observer.token_share.mean(0))
