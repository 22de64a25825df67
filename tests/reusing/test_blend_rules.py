"""The rules of kvedit.blend (gradual, leading, rescale): off by default, exact at recompute=1,
each changing the blend as documented, composing; the eval spec (the benchmarks that time
them: tests/benchmarks/test_blend_curve.py, test_reuse_benchmark.py)."""

from __future__ import annotations

import math

import pytest
import torch

import kvedit
from kvedit.errors import InvalidInputError
from kvedit.provenance import token_ranges
from kvedit.states.capturing import capture_tokens, empty_state, extend_ids
from kvedit.states.observer import observed_attention
from kvedit.states.passes import recompute_last
from kvedit.store import KVStore

PARTS = [
    "Records follow.\n",
    "Alice's secret number is 4821. Bob's secret number is 7310. ",
    "Carol's secret number is 5902. Dave's secret number is 1234. ",
    "Eve's secret number is 8080. Frank's secret number is 6611. The quick brown fox.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and a shared machine is not oversubscribed)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def store(tmp_path_factory, llama):
    """A store holding the parts of PARTS (behind the prefix), in its memory tier."""
    model, tok = llama
    store = KVStore(tmp_path_factory.mktemp("blend-rules"), memory_bytes=10**8)
    kvedit.blend(model, tok, PARTS, store, recompute=0.0)
    return store


def blend(llama, store, recompute, **rules):
    model, tok = llama
    return kvedit.blend(model, tok, PARTS, store, recompute=recompute, **rules)


def part_starts(report) -> list[int]:
    starts = [0]
    for part in report.parts:
        starts.append(starts[-1] + part.n_tokens)
    return starts


def leading_tokens(report, k: int) -> torch.Tensor:
    starts = part_starts(report)
    return torch.cat([torch.arange(a, a + k) for a in starts[1:-1]])


# ------------------------------------------------------------------ off by default, exact at 1


def test_rules_are_off_unless_given(llama, store):
    plain, report = blend(llama, store, 0.3)
    same, again = blend(llama, store, 0.3, gradual=None, leading=None, rescale=None)
    assert report.rules == again.rules == () and report.tokens_rescaled == 0
    assert report.recomputed_per_layer == [report.tokens_recomputed] * len(plain.layers)
    assert "rules" not in plain.history.origin.params and not plain.history.steps
    assert same.digest == plain.digest and not plain.has_bias
    assert torch.equal(same.last_logits, plain.last_logits)


RULES_AT_ONE = [
    ("llama", {"gradual": 3}),
    ("llama", {"leading": 3}),
    ("llama", {"rescale": 0.5}),
    ("llama", {"gradual": 3, "leading": 3, "rescale": 2.0}),
    ("gemma3", {"gradual": 3, "leading": 3, "rescale": 2.0}),
]


@pytest.mark.parametrize(("arch", "rules"), RULES_AT_ONE, ids=lambda x: str(x))
def test_every_rule_is_exact_at_full_recompute(arch, rules, request, tmp_path):
    """recompute=1 recomputes every token at every layer: gradual has nothing to narrow,
    leading nothing to add, rescale no reused entry to bias (its step records no tokens)."""
    model, tok = request.getfixturevalue(arch)
    state, report = kvedit.blend(model, tok, PARTS, KVStore(tmp_path), recompute=1.0, **rules)
    ids = state.token_ids.tolist()
    assert report.rules == tuple(k for k in ("gradual", "leading", "rescale") if k in rules)
    assert report.recomputed_per_layer == [len(ids)] * len(state.layers)
    logits = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(state.last_logits, logits, atol=1e-4, rtol=1e-4)
    fresh = extend_ids(empty_state(model, tok), ids, torch.zeros(len(ids), 2), "")
    for a, b in zip(state.layers, fresh.layers, strict=True):
        assert torch.equal(a.token_index, b.token_index)
        torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4)
        assert a.bias is None or not a.bias.any()
    if "rescale" in rules:
        step = state.history.steps[-1]
        assert step.name == "rescale" and step.params["tokens"] == []
        assert report.tokens_rescaled == 0


# ------------------------------------------------------------------ gradual


def test_gradual_narrows_the_recomputed_tokens_layer_by_layer(llama, store):
    """Tiny Llama: 3 layers, deviation layer 1. Layers 0-1 recompute the wide set (as the
    default with that many tokens does), layer 2 keeps the k that deviated most at layer 1:
    their entries are the wide recompute's (layer-2 K/V come from layer-1 outputs), the others'
    are the reused ones, and every query of layer 2 read exactly the final cache."""
    state, report = blend(llama, store, 0.3, gradual=2)
    n = len(state)
    k = math.ceil(0.3 * n)
    assert report.rules == ("gradual",) and report.recomputed_per_layer == [2 * k, 2 * k, k]
    assert report.tokens_recomputed == 2 * k
    wide, wide_report = blend(llama, store, (2 * k - 0.5) / n)
    placed, _ = blend(llama, store, 0.0)
    default, _ = blend(llama, store, 0.3)
    assert torch.equal(wide_report.recomputed_tokens, report.recomputed_tokens)
    for i in (0, 1):
        torch.testing.assert_close(state.layers[i].keys, wide.layers[i].keys)
        torch.testing.assert_close(state.layers[i].values, wide.layers[i].values)
    last, kept = state.layers[2], []
    for t in report.recomputed_tokens.tolist():
        if not torch.equal(last.keys[:, :, t], placed.layers[2].keys[:, :, t]):
            kept.append(t)
            torch.testing.assert_close(last.keys[:, :, t], wide.layers[2].keys[:, :, t])
    assert len(kept) == k and kept[-1] == n - 1
    others = [t for t in range(n) if t not in set(report.recomputed_tokens.tolist())]
    assert torch.equal(last.keys[:, :, others], placed.layers[2].keys[:, :, others])
    # the last token read the final cache at every layer, and narrowing changed what it read
    torch.testing.assert_close(recompute_last(state).last_logits, state.last_logits)
    assert not torch.allclose(state.last_logits, wide.last_logits, atol=1e-3)
    assert not torch.allclose(state.last_logits, default.last_logits, atol=1e-3)
    recorded = state.history.origin.params["rules"]["gradual"]
    assert recorded == {"factor": 2.0, "layers": [2 * k, 2 * k, k]}


# ------------------------------------------------------------------ leading


def test_leading_recomputes_the_first_tokens_of_every_passage(llama, store):
    model, tok = llama
    state, report = blend(llama, store, 0.3, leading=3)
    n = len(state)
    forced = leading_tokens(report, 3)
    assert set(forced.tolist()) <= set(report.recomputed_tokens.tolist())
    assert report.tokens_recomputed == math.ceil(0.3 * n) + len(forced)  # in addition
    default, _ = blend(llama, store, 0.3)
    assert not torch.allclose(state.last_logits, default.last_logits, atol=1e-3)
    # EPIC alone: no deviation pass, the leading tokens and the last one
    epic, epic_report = blend(llama, store, 0.0, leading=2)
    forced = leading_tokens(epic_report, 2)
    assert epic_report.recomputed_tokens.tolist() == [*forced.tolist(), n - 1]
    assert epic_report.deviation_layer is None and epic_report.rules == ("leading",)
    # recomputed: their layer-1 entries are a prefill's (layer 0 is exact after the move)
    true_k = capture_tokens(model, tok, epic.token_ids.tolist()).layers[1].keys
    placed, _ = blend(llama, store, 0.0)
    later = forced[forced >= part_starts(epic_report)[2]]  # part 1 reads right after the prefix
    torch.testing.assert_close(epic.layers[1].keys[:, :, forced], true_k[:, :, forced])
    assert (placed.layers[1].keys[:, :, later] - true_k[:, :, later]).abs().amax() > 1e-3
    assert epic.history.origin.params["rules"] == {"leading": 2}


# ------------------------------------------------------------------ rescale


def test_rescale_scales_the_questions_attention_to_reused_passages(llama, store):
    model, tok = llama
    base, base_report = blend(llama, store, 0.3)
    state, report = blend(llama, store, 0.3, rescale=2.0)
    assert torch.equal(report.recomputed_tokens, base_report.recomputed_tokens)
    n, first = len(state), part_starts(report)[1]
    recomputed = set(report.recomputed_tokens.tolist())
    stale = torch.tensor([t for t in range(first, n) if t not in recomputed])
    assert report.rules == ("rescale",) and report.tokens_rescaled == len(stale)
    for layer in state.layers:
        expected = torch.zeros(n)
        expected[stale] = math.log(2.0)
        torch.testing.assert_close(layer.bias[0, 0], expected)
        assert (layer.bias == layer.bias[:, :1]).all()  # every head alike
    step = state.history.steps[-1]
    assert step.name == "rescale" and step.params["tokens"] == token_ranges(stale)
    assert step.params["factor"] == 2.0 and not state.is_plain_capture
    assert state.digest != base.digest
    # a later query weighs the rescaled entries twice as much, relative to the others (layer 0:
    # the question token's query and the entries' keys are the same in both states)
    question = tok(" What", add_special_tokens=False)["input_ids"][:1]
    where = torch.tensor([n])
    p = observed_attention(model, base.layers, question, where)[0][0]  # [heads, n + 1]
    q = observed_attention(model, state.layers, question, where)[0][0]
    is_stale = torch.zeros(n + 1, dtype=torch.bool)
    is_stale[stale] = True
    ratio = lambda a: a[:, is_stale].sum(-1) / a[:, ~is_stale].sum(-1)  # noqa: E731
    torch.testing.assert_close(ratio(q), 2.0 * ratio(p), atol=1e-4, rtol=1e-4)
    # the last input was recomputed over the rescaled entries
    assert not torch.allclose(state.last_logits, base.last_logits, atol=1e-3)
    torch.testing.assert_close(recompute_last(state).last_logits, state.last_logits)


# ------------------------------------------------------------------ together, and bad values


def test_rules_compose(llama, store):
    state, report = blend(llama, store, 0.3, gradual=2, leading=2, rescale=0.5)
    n, starts = len(state), part_starts(report)
    k, forced = math.ceil(0.3 * n), leading_tokens(report, 2)
    assert report.rules == ("gradual", "leading", "rescale")
    assert report.recomputed_per_layer[-1] == k + len(forced)
    assert report.recomputed_per_layer[0] > report.recomputed_per_layer[-1]
    assert set(forced.tolist()) <= set(report.recomputed_tokens.tolist())
    placed, _ = blend(llama, store, 0.0)
    later = forced[forced >= starts[2]]
    moved = (state.layers[-1].keys - placed.layers[-1].keys)[:, :, later]
    assert (moved.abs().amax(dim=(0, 1, 3)) > 1e-3).all()  # recomputed at the last layer too
    # rescale follows the narrowing: a passage token recomputed at layers 0-1 but dropped at
    # layer 2 is rescaled on layer 2 only
    unbiased = [int((layer.bias[0, 0, starts[1] :] == 0).sum()) for layer in state.layers]
    assert unbiased[0] == unbiased[1] > unbiased[2]
    assert report.tokens_rescaled == (n - starts[1]) - unbiased[2]
    assert set(state.history.origin.params["rules"]) == {"gradual", "leading", "rescale"}


# ------------------------------------------------------------------ previous (a neutral passage)

NEUTRAL = "Notes follow. "


def test_previous_caches_later_passages_behind_a_neutral_passage(llama, tmp_path):
    model, tok = llama
    store = KVStore(tmp_path, memory_bytes=10**8)
    state, report = kvedit.blend(model, tok, PARTS, store, recompute=0.0, previous=NEUTRAL)
    assert report.previous == NEUTRAL and state.history.origin.params["previous"] == NEUTRAL
    assert state.text == "".join(PARTS)  # the neutral passage is not in the blend
    ids = tok(PARTS[0])["input_ids"]
    neutral = tok(NEUTRAL, add_special_tokens=False)["input_ids"]
    first = tok(PARTS[1], add_special_tokens=False)["input_ids"]
    later = tok(PARTS[2], add_special_tokens=False)["input_ids"]
    # part 1 is stored right after the prefix (exact in the blend), later parts behind both
    assert store.fetch(store.key_for(model, tok, ids + first), model, tok)[0] is not None
    assert store.fetch(store.key_for(model, tok, ids + neutral + later), model, tok)[0] is not None
    assert store.fetch(store.key_for(model, tok, ids + later), model, tok)[0] is None
    # part 2's entries are those of the prefilled prefix + neutral + part 2, moved into place
    whole = model(torch.tensor([ids + neutral + later])).logits[0, -1]
    start = len(ids) + len(first)
    alone = kvedit.blend(model, tok, PARTS[:3], store, recompute=0.0, previous=NEUTRAL)[0]
    torch.testing.assert_close(alone.last_logits, whole, atol=1e-4, rtol=1e-4)
    plain, _ = kvedit.blend(model, tok, PARTS, store, recompute=0.0)
    k, p = state.layers[1], plain.layers[1]
    assert torch.equal(k.values[:, :, :start], p.values[:, :, :start])  # prefix, part 1: exact
    assert not torch.allclose(k.values[:, :, start:], p.values[:, :, start:])  # later: moved
    # a blend with recompute changes its answer logits too, and is exact at 1.0
    partial, _ = kvedit.blend(model, tok, PARTS, store, recompute=0.3, previous=NEUTRAL)
    other, _ = kvedit.blend(model, tok, PARTS, store, recompute=0.3)
    assert not torch.allclose(partial.last_logits, other.last_logits)
    full, _ = kvedit.blend(model, tok, PARTS, store, recompute=1.0, previous=NEUTRAL)
    logits = model(full.token_ids[None]).logits[0, -1]
    torch.testing.assert_close(full.last_logits, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"previous": "Notes. ", "context": "alone"}, 'previous needs context="prefix"'),
        ({"previous": "  "}, "previous must be a non-empty passage text"),
        ({"previous": 3}, "previous must be a non-empty passage text"),
    ],
)
def test_bad_previous_is_refused(llama, store, kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        blend(llama, store, 0.3, **kwargs)


@pytest.mark.parametrize(
    ("rule", "value", "message"),
    [
        ("gradual", 0.5, "gradual must be a number >= 1"),
        ("gradual", float("nan"), "gradual must be a finite number"),
        ("gradual", "2", "gradual must be a finite number"),
        ("leading", 0, "leading must be an int >= 1"),
        ("leading", 1.5, "leading must be an int"),
        ("leading", True, "leading must be an int"),
        ("rescale", 0, r"rescale must be a factor in \(0, 10000\]"),
        ("rescale", -2.0, r"rescale must be a factor in \(0, 10000\]"),
        ("rescale", 1e5, r"rescale must be a factor in \(0, 10000\]"),
    ],
)
def test_bad_rule_values_are_refused(llama, store, rule, value, message):
    with pytest.raises(InvalidInputError, match=message):
        blend(llama, store, 0.3, **{rule: value})


def test_the_blend_method_takes_the_rules(llama):
    from kvedit.evals.methods import ExampleContext, parse_spec
    from kvedit.evals.tasks import records_examples

    model, tok = llama
    assert parse_spec("blend:recompute=0.15").param_dict() == {
        "recompute": 0.15,
        "context": "prefix",
    }  # as recorded before the rules existed
    method = parse_spec("blend:recompute=0:leading=2:rescale=0.5")
    assert method.param_dict() == {
        "recompute": 0,
        "context": "prefix",
        "leading": 2,
        "rescale": 0.5,
    }
    with pytest.raises(InvalidInputError, match="leading must be an int >= 1"):
        parse_spec("blend:leading=0")
    example = records_examples(n_records=3, positions=(0,), trials=1, seed=0)[0]
    ctx = ExampleContext(model, tok, example, max_new_tokens=2)
    method.predict(ctx)
    assert ctx.notes["blend_report"].rules == ("leading", "rescale")
