"""``attention_share``: how much attention a continuation pays to spans of a state."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import RECORDS
from helpers import same, snapshot

import kvedit
import kvedit.attention as ka
from kvedit import ops
from kvedit.errors import SpanNotFoundError
from kvedit.runtime import seam

QUESTION = " Question: What is Carol's secret number? Answer:"
SPAN = "Carol's secret number is 5902"


def token_boundaries(state, n_parts):
    """Character offsets that cut ``state.text`` into ``n_parts`` ranges at token starts."""
    starts = [int(a) for a, b in state.offsets.tolist() if b > a]
    cuts = [starts[len(starts) * i // n_parts] for i in range(1, n_parts)]
    return [0, *cuts, len(state.text)]


def test_shares_have_the_documented_shapes_and_lie_in_0_1(tiny):
    _, model, tok = tiny
    state = kvedit.capture(model, tok, RECORDS)
    before = snapshot(state)
    share = kvedit.attention_share(state, QUESTION, [SPAN, "Frank", "secret"])
    cfg = model.config.get_text_config()
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    assert share.spans == [SPAN, "Frank", "secret"]
    assert share.per_head.shape == (n_layers, n_heads, 3)
    assert share.per_layer.shape == (n_layers, 3)
    assert share.total.shape == (3,)
    assert share.token_share.shape == (len(state),)
    for t in (share.per_head, share.per_layer, share.total, share.token_share):
        assert torch.all((t >= 0) & (t <= 1))
    torch.testing.assert_close(share.per_layer, share.per_head.mean(1))
    torch.testing.assert_close(share.total, share.per_head.mean((0, 1)))
    assert same(snapshot(state), before)
    assert kvedit.runtime.active_plan(model) is None  # no plan left behind


def test_disjoint_spans_covering_the_text_leave_room_for_the_continuation(tiny):
    _, model, tok = tiny
    state = kvedit.capture(model, tok, RECORDS)
    cuts = token_boundaries(state, 3)
    spans = list(zip(cuts[:-1], cuts[1:], strict=True))
    share = kvedit.attention_share(state, QUESTION, spans)
    covered = torch.cat([state.token_indices(s) for s in spans])
    assert sorted(covered.tolist()) == sorted(set(covered.tolist()))  # disjoint
    assert torch.all(share.per_layer.sum(-1) <= 1 + 1e-6)
    total = float(share.total.sum())
    # the spans' shares are exactly their tokens' shares ...
    assert total == pytest.approx(float(share.token_share[covered].sum()), abs=1e-5)
    # ... and what is left goes to the zero-width BOS and to the continuation itself
    to_text = float(share.token_share.sum())
    assert total <= to_text <= 1 + 1e-6
    assert 1 - to_text > 1e-4  # the continuation's own tokens get some attention


def test_emphasize_raises_the_span_share(tiny):
    _, model, tok = tiny
    state = kvedit.capture(model, tok, RECORDS)
    plain = kvedit.attention_share(state, QUESTION, SPAN)
    up = kvedit.attention_share(ops.emphasize(state, SPAN, 2.0), QUESTION, SPAN)
    assert up.total[0] > plain.total[0] + 1e-3
    # the first layer that holds the span (Gemma-3's sliding layers do not) sees unchanged
    # inputs, so every one of its heads gives the span more
    tokens = state.token_indices(SPAN)
    first = next(i for i, layer in enumerate(state.layers) if layer.entries_for(tokens).numel())
    assert torch.all(up.per_head[first, :, 0] > plain.per_head[first, :, 0])
    torch.testing.assert_close(up.per_head[:first], plain.per_head[:first], atol=0, rtol=0)
    down = kvedit.attention_share(ops.suppress(state, SPAN, 2.0), QUESTION, SPAN)
    assert down.total[0] < plain.total[0] - 1e-3


def test_duplicated_and_emphasized_states_read_out_the_same_share(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    dup = kvedit.attention_share(ops.duplicate(state, SPAN, 2), QUESTION, SPAN)
    emph = kvedit.attention_share(ops.emphasize(state, SPAN, math.log(3)), QUESTION, SPAN)
    torch.testing.assert_close(dup.per_head, emph.per_head, atol=1e-5, rtol=0)
    torch.testing.assert_close(dup.token_share, emph.token_share, atol=1e-5, rtol=0)


def softmax_by_hand(q, k, scale, bias, unbiased):
    """Attention probabilities ``[1, H, Sq, Sk]`` written out in float64: GQA by repeating
    KV heads, the stored bias on queries from ``unbiased`` on, bottom-right causal mask."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(heads // kv_heads, dim=1)
    logits = q.double() @ kk.transpose(-1, -2) * scale  # [1, H, Sq, Sk]
    sq, sk = logits.shape[-2:]
    if bias is not None:
        b = bias.double()
        b = b.repeat_interleave(heads // b.shape[1], dim=1) if b.shape[1] > 1 else b
        logits[:, :, unbiased:] += b[:, :, None, :]
    q_pos = torch.arange(sk - sq, sk)[:, None]
    logits = logits.masked_fill(torch.arange(sk)[None, :] > q_pos, float("-inf"))
    return logits.softmax(-1).float()


def test_share_agrees_with_attention_probs_computed_by_hand(llama, monkeypatch):
    model, tok = llama
    state = ops.emphasize(kvedit.capture(model, tok, RECORDS), "Bob", 1.5)  # with a stored bias
    calls = []
    real_probs = ka.attention_probs

    def spy(q, k, **kwargs):
        calls.append((q.clone(), k.clone(), kwargs))
        return real_probs(q, k, **kwargs)

    monkeypatch.setattr(seam, "attention_probs", spy)  # the seam calls it by this name
    share = kvedit.attention_share(state, QUESTION, [SPAN, "Bob"])
    assert len(calls) == len(state.layers)  # one forward, one call per layer
    token_share = torch.zeros(len(state))
    for layer_idx, (q, k, kwargs) in enumerate(calls):
        assert kwargs["padding"] is None and kwargs["window"] is None  # a plain llama
        probs = softmax_by_hand(q, k, kwargs["scale"], kwargs["bias"], kwargs["unbiased_queries"])
        layer = state.layers[layer_idx]
        per_entry = probs[0, :, :, : len(layer)].mean(dim=1)  # [heads, entries], mean over queries
        for i, span in enumerate([SPAN, "Bob"]):
            entries = layer.entries_for(state.token_indices(span))
            torch.testing.assert_close(
                share.per_head[layer_idx, :, i], per_entry[:, entries].sum(-1), atol=1e-6, rtol=0
            )
        token_share.index_add_(0, layer.token_index, per_entry.mean(0))
    torch.testing.assert_close(share.token_share, token_share / len(calls), atol=1e-6, rtol=0)


def test_attention_share_errors(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    with pytest.raises(ValueError, match="continuation"):
        kvedit.attention_share(state, "", SPAN)
    with pytest.raises(SpanNotFoundError, match="Zed"):
        kvedit.attention_share(state, QUESTION, "Zed")
    with pytest.raises(ValueError, match="empty"):
        kvedit.attention_share(state, QUESTION, [SPAN, ""])
