"""``attention_share``: how much attention a continuation gives each span of a state.

The continuation (say, the question) is run on top of the state with the one attention observer
(:mod:`kvedit.states.observer`), which reads each layer's attention probabilities
``[batch, heads, q_len, k_len]``; the share of a span is the probability mass on the cache
entries of its tokens, averaged over the continuation's tokens (:func:`span_shares`). The
stored bias of an edited state is included, so the readout shows what an edit does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spans import Span, Spans, as_span_list
from ..states.observer import Observer
from ..states.passes import run_model
from ..states.state import KVState
from .primed import Continued

__all__ = ["AttentionShare", "attention_share", "continued_share", "span_shares"]


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


def attention_share(state: KVState, continuation: str, spans: Spans) -> AttentionShare:
    """The share of attention ``continuation``'s tokens give each span of ``state``.

    Args:
        state: a captured (possibly edited) state.
        continuation: text that follows the state, e.g. the question.
        spans: one span or a list (substring, regex or character range of ``state.text``).

    Returns:
        An :class:`AttentionShare` with per-head, per-layer and total shares.
    """
    return continued_share(state, continuation, spans)[0]


@torch.no_grad()
def continued_share(
    state: KVState, continuation: str, spans: Spans
) -> tuple[AttentionShare, Continued]:
    """:func:`attention_share`, and the pass it read kept as a
    :class:`~kvedit.focusing.primed.Continued` (the continuation's K/V and the logits after
    it: the first pass of ``state``'s answer to ``continuation``)."""
    items = as_span_list(spans)
    span_tokens = [state.token_indices(s) for s in items]
    ids = state.encode(continuation)
    if not ids:
        raise ValueError("attention_share needs a non-empty continuation")
    # one observed run, as kvedit.states.observer.observed_attention makes it, keeping its K/V
    observer = Observer(state.layers, reduce="mean")
    device = state.layers[0].device
    positions = torch.arange(state.next_position, state.next_position + len(ids))
    logits, entries = run_model(
        state.model,
        state.layers,
        torch.tensor([ids], device=device),
        positions[None].to(device),
        logits_to_keep=1,
        plan=observer,
    )
    per_head, token_share = span_shares(state, observer.probs, span_tokens)
    continued = Continued.from_run(state, continuation, ids, logits, entries)
    return AttentionShare(items, per_head, token_share), continued


def span_shares(
    state: KVState, probs: dict[int, torch.Tensor], span_tokens: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spans' and tokens' shares of observed attention (first batch row).

    Args:
        state: the state the attention was read over.
        probs: layer index -> ``[batch, heads, k]`` attention averaged over the observing
            queries (:func:`~kvedit.states.observer.observed_attention` with ``reduce="mean"``); its
            first ``len(layer)`` keys are the layer's entries.
        span_tokens: per span, the token indices ``LongTensor[t]`` of ``state`` it covers.

    Returns:
        ``(per_head [layers, heads, n_spans], token_share [n_tokens])``: the attention on the
        entries of each span, per observed layer and head; the share each text token gets (all
        its entries), averaged over layers and heads.
    """
    n_layers, n_tok = len(state.layers), len(state)
    per_head = []
    token_share = torch.zeros(n_layers, n_tok)
    for i, layer in enumerate(state.layers):
        if i not in probs:
            continue
        p = probs[i][0, :, : len(layer)].cpu()  # [heads, n]
        per_head.append(torch.stack([p[:, layer.entries_for(t)].sum(-1) for t in span_tokens], -1))
        valid = layer.token_index >= 0
        token_share[i].index_add_(0, layer.token_index[valid], p.mean(0)[valid.to(p.device)])
    return torch.stack(per_head), token_share.mean(0)
