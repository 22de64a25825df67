"""The compression protocol: scorers, ``select``, AdaKV budgets, protected spans (kvedit.compress)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import RECORDS
from helpers import check_halved_globals, snapshot

import kvedit
from kvedit import ops
from kvedit.compress import (
    DROPPED,
    H2O,
    SCORERS,
    TOVA,
    AdaKV,
    KNorm,
    Scorer,
    SnapKV,
    adaptive_budgets,
    keep_mask,
    make_scorer,
    register_scorer,
    select,
)
from kvedit.compress.observe import question_attention, window_attention
from kvedit.errors import InvalidInputError, SpanNotFoundError, UnsupportedModelError
from kvedit.evals.litm import run
from kvedit.evals.methods import ExampleContext, parse_spec
from kvedit.evals.tasks import records_examples
from kvedit.testing import TINY_SLIDING_WINDOW, tiny_model

TEXT = RECORDS * 3
SPAN = "Carol's secret number is 5902"
OTHER = "Eve's secret number is 8080"
QUESTION = " Question: What is Carol's secret number?"
ALL_SCORERS = [SnapKV(), SnapKV(query=QUESTION), KNorm(), TOVA(), H2O(chunk=40)]


@pytest.fixture(scope="module")
def llama():
    model, tok = tiny_model("llama")
    return model, tok, kvedit.capture(model, tok, TEXT)


@pytest.fixture(scope="module")
def eager_attention(llama):
    """Per layer ``[heads, n, n]``: the causal attention of the captured text, from a second
    copy of the model run by transformers' own eager attention (an independent reference)."""
    _, _, state = llama
    model, _ = tiny_model("llama")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(state.token_ids[None], output_attentions=True)
    return [a[0].float() for a in out.attentions]


def kept_per_head(layer) -> torch.Tensor:
    """``[batch, kv_heads, n]`` bool: entries a head still attends to."""
    return layer.dense_bias() > DROPPED / 2


def kept_tokens(layer, head: int) -> set[int]:
    return set(layer.token_index[kept_per_head(layer)[0, head]].tolist())


def grouped(probs: torch.Tensor, kv_heads: int = 2) -> torch.Tensor:
    """``[heads, n]`` -> ``[1, kv_heads, n]`` summed over each KV head's query heads."""
    heads, n = probs.shape
    return probs.reshape(1, kv_heads, heads // kv_heads, n).sum(dim=2)


# ------------------------------------------------------------------ each scorer, by hand


def test_knorm_keeps_the_lowest_norm_keys(llama):
    _, _, state = llama
    n, keep = len(state), 0.3
    budget = round(keep * n)
    out = select(state, KNorm(), keep)
    for layer, orig in zip(out.layers, state.layers, strict=True):
        norms = orig.keys[0].norm(dim=-1)  # [kv_heads, n]
        for h in range(norms.shape[0]):
            # the last token is always kept; the rest of the budget goes to the smallest norms
            # (repeated tokens have equal norms: RoPE keeps norms, so compare norms, not ids)
            kept = torch.tensor(sorted(kept_tokens(layer, h) - {n - 1}))
            dropped = torch.tensor(sorted(set(range(n - 1)) - set(kept.tolist())))
            assert len(kept) == budget - 1
            assert norms[h, kept].max() <= norms[h, dropped].min()
    scores = KNorm().score(state, [0])[0]
    torch.testing.assert_close(scores, -state.layers[0].keys.norm(dim=-1))


def test_tova_is_the_last_tokens_attention_averaged_over_heads(llama, eager_attention):
    _, _, state = llama
    n = len(state)
    scores = TOVA().score(state, range(3))
    for i, attn in enumerate(eager_attention):
        expected = attn[:, -1, : n - 1].mean(dim=0)  # [n - 1] over the 4 query heads
        for h in range(2):  # the same scores for both KV heads
            torch.testing.assert_close(scores[i][0, h, :-1], expected, atol=1e-5, rtol=1e-4)
        assert torch.isposinf(scores[i][..., -1]).all()


def test_h2o_is_the_accumulated_attention(llama, eager_attention):
    _, _, state = llama
    n, window = len(state), 8
    for chunk in (40, 1000):  # chunked re-reading sums to the same as one pass
        scores = H2O(window=window, chunk=chunk).score(state, range(3))
        for i, attn in enumerate(eager_attention):
            expected = grouped(attn.sum(dim=1))  # column sums over every query
            torch.testing.assert_close(
                scores[i][..., : n - window], expected[..., : n - window], atol=1e-4, rtol=1e-4
            )
            assert torch.isposinf(scores[i][..., n - window :]).all()


def test_snapkv_window_scores_are_the_pooled_window_attention(llama, eager_attention):
    _, _, state = llama
    n, window, kernel = len(state), 8, 3
    scores = SnapKV(window=window, kernel=kernel).score(state, range(3))
    for i, attn in enumerate(eager_attention):
        seen = grouped(attn[:, n - window :, :].sum(dim=1))  # [1, 2, n], the window's rows
        seen[..., n - window :] = 0.0  # the window's own entries are not scored
        pooled = F.max_pool1d(seen.reshape(2, 1, n), kernel, 1, kernel // 2).reshape(1, 2, n)
        torch.testing.assert_close(
            scores[i][..., : n - window], pooled[..., : n - window], atol=1e-4, rtol=1e-4
        )
        assert torch.isposinf(scores[i][..., n - window :]).all()


def test_question_attention_is_the_questions_rows(llama):
    model, tok, state = llama
    ids = state.encode(QUESTION)
    reference, _ = tiny_model("llama")
    reference.set_attn_implementation("eager")
    full = torch.cat([state.token_ids, torch.tensor(ids)])[None]
    with torch.no_grad():
        attentions = reference(full, output_attentions=True).attentions
    n = len(state)
    observed = question_attention(state, QUESTION)
    for i, attn in enumerate(attentions):
        expected = attn[0, :, n:, :n].sum(dim=1)[None]  # [1, heads, n]
        torch.testing.assert_close(observed[i], expected, atol=1e-4, rtol=1e-4)
    assert window_attention(state, 4)[0][..., -4:].abs().sum() == 0  # own entries unscored


# ------------------------------------------------------------------ snapkv through the protocol


def old_snapkv_kept(probs: torch.Tensor, n_tokens: int, keep: float, window: int, kernel: int):
    """The selection ``ops.snapkv`` made before the protocol existed (kept per head)."""
    b, heads, n = probs.shape
    per_kv = probs.reshape(b, 2, heads // 2, n).sum(dim=2)
    pooled = F.max_pool1d(per_kv.reshape(-1, 1, n), kernel, 1, kernel // 2).reshape(b, 2, n)
    budget = max(1, round(keep * n))
    protected = torch.arange(n)[torch.arange(n) >= n_tokens - window][-budget:]
    pooled[..., protected] = float("inf")
    kept = torch.zeros(b, 2, n, dtype=torch.bool)
    kept.scatter_(-1, pooled.topk(budget, dim=-1).indices, True)
    return kept


@pytest.mark.parametrize(
    ("keep", "query", "window", "kernel", "bias"),
    [
        (0.25, QUESTION, 32, 5, 0.0),
        (0.5, None, 8, 3, 0.0),
        (0.03, None, 32, 5, 0.0),  # fewer entries than the window: its latest ones
        (0.1, QUESTION, 4, 1, 0.0),
        (0.1, None, 4, 3, 1.0),  # snapkv ranks emphasized entries like any other
    ],
)
def test_snapkv_keeps_the_same_entries_as_before(llama, keep, query, window, kernel, bias):
    _, _, state = llama
    if bias:
        state = ops.emphasize(state, [SPAN, OTHER], bias)
    n = len(state)
    probs = question_attention(state, query) if query else window_attention(state, window)
    out = ops.snapkv(state, keep=keep, query=query, window=window, kernel=kernel)
    for i, layer in enumerate(out.layers):
        kept = old_snapkv_kept(probs[i], n, keep, window, kernel)
        union = kept.any(dim=1)[0].nonzero().flatten()
        assert torch.equal(layer.token_index, union)
        assert torch.equal(kept_per_head(layer), kept[..., union])
    # and snapkv is exactly select with the SnapKV scorer, bias unprotected
    same = select(state, SnapKV(query, window, kernel), keep, protect_bias=False)
    for a, b in zip(out.layers, same.layers, strict=True):
        assert torch.equal(a.token_index, b.token_index) and torch.equal(a.bias, b.bias)


# ------------------------------------------------------------------ select


@pytest.mark.parametrize("scorer", ALL_SCORERS + [AdaKV(KNorm())], ids=lambda s: s.name)
def test_select_keeps_a_budget_per_head(llama, scorer):
    _, _, state = llama
    before = snapshot(state)
    out = select(state, scorer, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(state), before, strict=True))
    n = len(state)
    for layer in out.layers:
        kept = kept_per_head(layer)
        assert kept.sum() == 2 * round(0.25 * n)  # the layer's budget, over its two heads
        assert kept.any(dim=1).all() and kept[..., -1].all()  # no dead entry; the last token
    assert out.nbytes < state.nbytes
    assert isinstance(out.generate(QUESTION, 4), str)


def test_select_masks_per_head(llama):
    """An entry a head dropped has no effect on that head: garbage there changes nothing."""
    _, _, state = llama
    out = select(state, AdaKV(KNorm()), 0.3)
    spoiled = []
    for layer in out.layers:
        dropped = ~kept_per_head(layer)
        assert dropped.any()
        values = layer.values.clone()
        values[dropped] = 1e4
        spoiled.append(dataclasses.replace(layer, values=values))
    torch.testing.assert_close(
        out.replace(layers=spoiled).logits(QUESTION), out.logits(QUESTION), atol=1e-4, rtol=1e-4
    )


def test_keep_one_is_the_identity(llama):
    _, _, state = llama
    for scorer in ALL_SCORERS:
        assert select(state, scorer, 1.0) is state
    assert select(state, "knorm", 1) is state


@pytest.mark.parametrize("scorer", ALL_SCORERS + [AdaKV(SnapKV())], ids=lambda s: s.name)
def test_protected_spans_survive(llama, scorer):
    _, _, state = llama
    out = select(state, scorer, 0.1, protect=[SPAN, OTHER])
    tokens = state.token_indices([SPAN, OTHER])
    assert len(tokens) > round(0.1 * len(state)) // 2  # a real share of the budget
    for layer in out.layers:
        e = torch.isin(layer.token_index, tokens)
        assert e.sum() == len(tokens) and kept_per_head(layer)[..., e].all()


@pytest.mark.parametrize("scorer", [KNorm(), H2O(chunk=64), AdaKV(SnapKV(query=QUESTION))])
def test_emphasized_entries_survive(llama, scorer):
    """A positive stored bias (an emphasized or focus-chosen passage) protects its tokens on
    every layer, also where a per-layer strength left a layer without bias."""
    _, _, state = llama
    edited = ops.emphasize(state, SPAN, [2.0, 0.0, 1.0])  # layer 1: no bias
    tokens = state.token_indices(SPAN)
    out = select(edited, scorer, 0.1)
    for layer in out.layers:
        e = torch.isin(layer.token_index, tokens)
        assert e.sum() == len(tokens) and kept_per_head(layer)[..., e].all()
    bare = select(edited, scorer, 0.1, protect_bias=False)
    assert not all(
        torch.isin(tokens, layer.token_index[kept_per_head(layer)[0, h]]).all()
        for layer in bare.layers
        for h in range(2)
    )  # unprotected, some head drops some of them


def test_emphasized_entries_that_are_no_text_token_survive(llama):
    """A positive bias on entries of no text token (a re-read's separator) protects them."""
    _, _, state = llama
    reread = ops.reread(state, SPAN, separator=" Note: ")
    layers = []
    for layer in reread.layers:
        bias = torch.zeros(1, 2, len(layer))
        bias[..., layer.token_index < 0] = 1.0
        layers.append(dataclasses.replace(layer, bias=bias))
    biased = reread.replace(layers=layers)
    assert all((layer.token_index < 0).any() for layer in layers)
    for protect_bias in (True, False):
        out = select(biased, KNorm(), 0.05, protect_bias=protect_bias)
        kept = [kept_per_head(layer)[..., layer.token_index < 0] for layer in out.layers]
        n_sep = [int((layer.token_index < 0).sum()) for layer in layers]
        if protect_bias:
            assert all(k.all() and k.shape[-1] == m for k, m in zip(kept, n_sep, strict=True))
        else:
            assert sum(int(k.sum()) for k in kept) < 2 * sum(n_sep)


def test_protection_past_the_budget(llama):
    """More protected tokens than the budget: all kept, nothing else but the last token."""
    _, _, state = llama
    out = select(state, KNorm(), 0.02, protect=RECORDS[:60])
    tokens = state.token_indices(RECORDS[:60])
    assert len(tokens) > round(0.02 * len(state))
    for layer in out.layers:
        assert set(layer.token_index.tolist()) == set(tokens.tolist()) | {len(state) - 1}
        assert kept_per_head(layer).all()


def test_selecting_twice_keeps_dropped_entries_dropped(llama):
    _, _, state = llama
    once = select(state, SnapKV(), 0.5)
    twice = select(once, KNorm(), 0.6)
    n = len(state)
    for a, b in zip(once.layers, twice.layers, strict=True):
        alive_before = {
            (h, t) for h in range(2) for t in a.token_index[kept_per_head(a)[0, h]].tolist()
        }
        alive_after = {
            (h, t) for h in range(2) for t in b.token_index[kept_per_head(b)[0, h]].tolist()
        }
        assert alive_after <= alive_before
        assert kept_per_head(b).sum(-1).max() <= round(0.6 * len(a)) and len(b) < len(a) < n


def test_a_head_never_keeps_what_it_dropped(llama):
    """Entries a head already dropped are not counted as kept, even when its budget is larger
    than what it has left."""
    _, _, state = llama
    layer = state.layers[0]
    n = len(layer)
    bias = torch.zeros(1, 2, n)
    bias[0, 0, : n // 2] = DROPPED  # head 0 dropped the first half
    masked = dataclasses.replace(layer, bias=bias)
    scores = torch.rand(1, 2, n, generator=torch.Generator().manual_seed(0))
    must = torch.zeros(n, dtype=torch.bool)
    kept = keep_mask(masked, scores, 0.8, must, KNorm())
    assert not kept[0, 0, : n // 2].any() and kept[0, 0].sum() == n - n // 2
    assert kept[0, 1].sum() == round(0.8 * n)


def test_gemma3_sliding_layers_stay_whole(gemma3):
    model, tok = gemma3
    state = kvedit.capture(model, tok, TEXT)
    assert len(state) > TINY_SLIDING_WINDOW
    with pytest.raises(UnsupportedModelError, match="sliding-window layer"):
        select(state, H2O(), 0.5)  # the re-read would lack its context on sliding layers
    out = select(state, AdaKV(SnapKV(query=QUESTION)), 0.5, protect=SPAN)
    check_halved_globals(out, state)


def test_layers_argument(llama):
    _, _, state = llama
    out = select(state, KNorm(), 0.3, layers=[1])
    assert out.layers[0].bias is None and len(out.layers[0]) == len(state)
    assert len(out.layers[1]) < len(state)


def test_save_and_load_a_selected_state(llama, tmp_path):
    model, tok, state = llama
    out = select(ops.emphasize(state, SPAN, 1.5), AdaKV(SnapKV(query=QUESTION)), 0.3)
    loaded = kvedit.load_state(out.save(tmp_path / "selected.kv"), model, tok)
    for a, b in zip(out.layers, loaded.layers, strict=True):
        assert torch.equal(a.token_index, b.token_index)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.bias, b.bias)
    assert loaded.nbytes == out.nbytes
    assert loaded.generate(QUESTION, 8) == out.generate(QUESTION, 8)


def test_bad_input_is_refused(llama):
    _, _, state = llama
    for keep in (0, 1.5, -0.1, True, float("nan")):
        with pytest.raises(InvalidInputError, match="keep"):
            select(state, KNorm(), keep)
    with pytest.raises(InvalidInputError, match="unknown scorer 'nope'"):
        select(state, "nope", 0.5)
    with pytest.raises(SpanNotFoundError):
        select(state, KNorm(), 0.5, protect="not in the text")
    with pytest.raises(InvalidInputError, match="kernel"):
        SnapKV(kernel=4)
    with pytest.raises(InvalidInputError, match="floor"):
        AdaKV(KNorm(), floor=1.5)
    with pytest.raises(InvalidInputError, match="unknown parameter"):
        make_scorer("knorm", window=3)

    class Flat(Scorer):
        name = "flat"

        def score(self, state, layers):
            return {i: torch.zeros(1, 2, 3) for i in layers}

    with pytest.raises(InvalidInputError, match="layer 0 scores"):
        select(state, Flat(), 0.5)


def test_scorer_registry():
    assert set(SCORERS) >= {"snapkv", "knorm", "tova", "h2o"}
    assert make_scorer("snapkv", window=4) == SnapKV(window=4)
    assert isinstance(make_scorer("h2o"), H2O)
    with pytest.raises(InvalidInputError, match="already registered"):

        @register_scorer("knorm")
        @dataclasses.dataclass(frozen=True)
        class Other(Scorer):
            pass


# ------------------------------------------------------------------ AdaKV


def test_adaptive_budgets_follow_score_mass():
    # head 0 spreads its mass over many entries, head 1 puts it on two: the spread head needs
    # (and gets) more of the layer's budget; the sum stays 2 * budget, the floor holds
    spread = torch.full((10,), 0.1)
    peaked = torch.tensor([0.45, 0.45] + [0.0125] * 8)
    scores = torch.stack([spread, peaked])[None]  # [1, 2, 10]
    budgets = adaptive_budgets(scores, budget=4, floor=0.0)
    assert budgets.tolist() == [[6, 2]]  # the 8 best entries of the layer: 2 peaks + 6
    assert adaptive_budgets(scores, budget=4, floor=1.0).tolist() == [[4, 4]]
    budgets = adaptive_budgets(scores, budget=5, floor=0.5)
    assert budgets.sum() == 10 and budgets.min() >= 2 and budgets.tolist() == [[8, 2]]
    # a head whose scores are all larger takes everything past the floor
    assert adaptive_budgets(torch.stack([spread, spread / 10])[None], 5, 0.2).tolist() == [[9, 1]]
    # the same scores on every head (TOVA): the uniform split
    assert adaptive_budgets(torch.stack([peaked, peaked])[None], 3, 0.0).tolist() == [[3, 3]]


def test_adakv_budgets_in_select(llama):
    _, _, state = llama
    n = len(state)
    out = select(state, AdaKV(H2O(window=4), floor=0.2), 0.25)
    counts = torch.stack([kept_per_head(layer).sum(-1)[0] for layer in out.layers])
    assert (counts.sum(-1) == 2 * round(0.25 * n)).all()  # each layer keeps its total budget
    assert (counts.min() >= int(0.2 * round(0.25 * n))) and (counts[:, 0] != counts[:, 1]).any()
    tova = select(state, AdaKV(TOVA()), 0.25)  # identical scores per head: uniform budgets
    assert all((kept_per_head(layer).sum(-1) == round(0.25 * n)).all() for layer in tova.layers)


# ------------------------------------------------------------------ the eval method


def test_select_method_spec():
    m = parse_spec("select:scorer=knorm:keep=0.5:adaptive=1")
    assert m.param_dict() == {
        "scorer": "knorm",
        "keep": 0.5,
        "adaptive": True,
        "floor": 0.2,
        "observe": "question",
        "window": 32,
        "kernel": 5,
        "protect": "none",
        "bits": 0,
    }
    assert parse_spec("select:bits=8").params.bits == 8
    with pytest.raises(InvalidInputError, match="bits"):
        parse_spec("select:bits=3")
    assert parse_spec("select:adaptive=True").params.adaptive is True
    assert parse_spec("select:adaptive=1").params.adaptive is True  # recorded as a bool
    assert parse_spec("select:adaptive=0").params.adaptive is False
    assert parse_spec("select:protect=gold").needs_documents
    assert not parse_spec("select").needs_documents
    for spec, problem in [
        ("select:scorer=nope", "scorer must be one of"),
        ("select:keep=0", "keep must be in"),
        ("select:adaptive=2", "adaptive"),
        ("select:kernel=4", "odd"),
        ("select:protect=all", "protect must be one of"),
    ]:
        with pytest.raises(InvalidInputError, match=problem):
            parse_spec(spec)


def test_select_method_answers_from_the_selected_cache(llama, monkeypatch):
    model, tok, _ = llama
    example = records_examples(n_records=4, positions=(1,), trials=1, seed=0)[0]
    ctx = ExampleContext(model, tok, example, max_new_tokens=3)
    calls = []
    import kvedit.evals.methods.select as method_module
    from kvedit.focusing.choice import choose

    def spy(state, scorer, keep, *, protect=None):
        calls.append((scorer, keep, protect))
        return select(state, scorer, keep, protect=protect)

    monkeypatch.setattr(method_module, "select", spy)
    parse_spec("select:scorer=snapkv:keep=0.25").predict(ctx)
    assert calls[-1] == (SnapKV(query=ctx.continuation), 0.25, None)
    parse_spec("select:scorer=h2o:window=4:adaptive=1:floor=0.5:protect=gold").predict(ctx)
    assert calls[-1] == (AdaKV(H2O(window=4), 0.5), 0.5, [ctx.gold_span()])
    parse_spec("select:scorer=snapkv:observe=window:protect=focus").predict(ctx)
    scorer, _, protect = calls[-1]
    found = choose(ctx.state, ctx.continuation, ctx.doc_spans, query=ctx.example.question)
    expected = [ctx.doc_spans[i] for i in found.chosen] or None  # an abstention protects nothing
    assert scorer == SnapKV(query=None) and protect == expected


def test_select_method_runs_end_to_end(llama):
    """A run of the ``select`` method answers from the state ``select`` gives for its spec
    (scorer, AdaKV budgets, protected gold document) and records the bytes that state kept."""
    model, tok, _ = llama
    examples = records_examples(n_records=4, positions=(0,), trials=1, seed=0)
    specs = ["select:scorer=knorm:keep=0.5:adaptive=1", "select:scorer=tova:protect=gold"]
    records = run(model, tok, examples, specs, max_new_tokens=4, progress=False)
    assert [r["method"] for r in records] == specs
    ctx = ExampleContext(model, tok, examples[0], max_new_tokens=4)
    full = ctx.state

    def answer(state):
        return state.generate(ctx.continuation, 4)

    expected = [
        select(full, AdaKV(KNorm()), 0.5),
        select(full, TOVA(), 0.5, protect=[ctx.gold_span()]),
    ]
    for record, state in zip(records, expected, strict=True):
        assert record["bytes"] == round(state.nbytes / full.nbytes, 4) < 0.8
        assert record["prediction"] == answer(state)
    # the answers tell apart the full cache, the uniform budget and the unprotected selection
    assert records[0]["prediction"] not in (answer(full), answer(select(full, KNorm(), 0.5)))
    assert records[1]["prediction"] not in (answer(full), answer(select(full, TOVA(), 0.5)))
