"""The rules of kvedit.blend (gradual, leading, rescale): off by default, exact at recompute=1,
each changing the blend as documented, composing; the eval spec; the two benchmark scripts."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_benchmark

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


# ------------------------------------------------------------------ the benchmark scripts


def test_blend_curve_runs_on_a_tiny_model(tmp_path, monkeypatch):
    curve = load_benchmark("blend_curve", monkeypatch)
    args = ["--model", "tiny-llama", "--limit", "2", "--n-docs", "2", "--fractions", "0,1"]
    args += ["--rules", "default,leading=2:rescale=0.5", "--max-new-tokens", "2"]
    assert curve.main([*args, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "blend_curve.png").read_bytes()[:4] == b"\x89PNG"
    payload = json.loads((tmp_path / "blend_curve.json").read_text())
    points = {(r["rule"], r["recompute"]) for r in payload["rows"]}
    assert points == {(None, 1.0)} | {
        (rule, f) for rule in ("default", "leading=2:rescale=0.5") for f in (0.0, 1.0)
    }
    assert all(r["n"] == 2 for r in payload["rows"])
    for r in payload["records"]:
        assert r["rule"] != "leading=2:rescale=0.5" or r["rules"] == ["leading", "rescale"]
    full = {r["id"]: r["prediction"] for r in payload["records"] if r["rule"] is None}
    for r in payload["records"]:
        if r["rule"] is not None and r["recompute"] == 1.0:  # exact: the prefill's answer
            assert r["prediction"] == full[r["id"]]
    assert "| full prefill |" in (tmp_path / "blend_curve.md").read_text()


def test_blend_curve_passes_previous_to_every_blend(tmp_path, monkeypatch):
    curve = load_benchmark("blend_curve", monkeypatch)
    real, seen = kvedit.blend, []

    def recording(*a, **kw):
        seen.append(kw.get("previous"))
        return real(*a, **kw)

    monkeypatch.setattr(kvedit, "blend", recording)
    args = ["--model", "tiny-llama", "--limit", "1", "--n-docs", "3", "--fractions", "0.5"]
    args += ["--rules", "default", "--max-new-tokens", "2", "--previous", "Notes. "]
    assert curve.main([*args, "--out", str(tmp_path)]) == 0
    assert seen and set(seen) == {"Notes. "}
    payload = json.loads((tmp_path / "blend_curve.json").read_text())
    assert payload["settings"]["previous"] == "Notes. "


def test_blend_curve_resumes_an_interrupted_run(tmp_path, monkeypatch):
    curve = load_benchmark("blend_curve", monkeypatch)
    args = ["--model", "tiny-llama", "--n-docs", "2", "--fractions", "0", "--rules", "default"]
    args += ["--max-new-tokens", "2", "--limit", "2", "--out", str(tmp_path)]
    real, calls = curve.run_example, []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(curve, "run_example", interrupted)
    with pytest.raises(KeyboardInterrupt):
        curve.main(args)
    partial = tmp_path / "partial.jsonl"
    kept = [json.loads(line) for line in partial.read_text().splitlines()]
    assert len(kept) == 2 and {r["rule"] for r in kept} == {None, "default"}  # example 1 only
    partial.write_text("".join(json.dumps({**r, "prediction": "KEPT"}) + "\n" for r in kept))
    with pytest.raises(InvalidInputError, match="came from another run: seed 0"):
        curve.main([*args, "--seed", "1", "--resume"])
    settings = tmp_path / "partial.settings.json"
    saved = settings.read_text()
    settings.write_text(json.dumps({**json.loads(saved), "source": "0" * 64}))
    with pytest.raises(InvalidInputError, match="came from another run: source"):
        curve.main([*args, "--resume"])  # kvedit's code changed since
    settings.write_text(saved)
    monkeypatch.setattr(curve, "run_example", real)
    keep = partial.read_text()  # the same id over other distractors (another --limit) is refused
    partial.write_text("".join(json.dumps({**r, "example": "0" * 16}) + "\n" for r in kept))
    with pytest.raises(InvalidInputError, match="another example than this run's"):
        curve.main([*args, "--resume"])
    settings.write_text(saved)
    partial.write_text(keep)
    assert curve.main([*args, "--resume"]) == 0
    records = json.loads((tmp_path / "blend_curve.json").read_text())["records"]
    assert [r["prediction"] == "KEPT" for r in records] == [True, True, False, False]
    assert not partial.exists() and not (tmp_path / "partial.settings.json").exists()
    with pytest.raises(InvalidInputError, match="holds no partial"):
        curve.main([*args, "--resume"])


def test_blend_curve_merges_runs_split_by_position_and_pairs_them(tmp_path, monkeypatch):
    curve = load_benchmark("blend_curve", monkeypatch)
    args = ["--model", "tiny-llama", "--n-docs", "2", "--fractions", "0", "--rules", "default"]
    args += ["--max-new-tokens", "2"]
    for name, positions in (("a", "0"), ("b", "1")):
        out = tmp_path / name
        assert curve.main([*args, "--limit", "2", "--positions", positions, "--out", str(out)]) == 0
    a, b = str(tmp_path / "a" / "blend_curve.json"), str(tmp_path / "b" / "blend_curve.json")
    assert curve.main(["--merge", a, b, "--out", str(tmp_path / "m")]) == 0
    payload = json.loads((tmp_path / "m" / "blend_curve.json").read_text())
    assert len({r["id"] for r in payload["records"]}) == 4
    assert payload["settings"]["source"] and payload["settings"]["merged"] == [a, b]
    by_position = {r["position"]: r for r in payload["paired"]}
    assert set(by_position) == {0, 1} and all(r["n"] == 2 for r in by_position.values())
    full = {r["id"]: r["correct"] for r in payload["records"] if r["rule"] is None}
    lost = sum(full[r["id"]] > r["correct"] for r in payload["records"] if r["rule"])
    assert sum(r["lost"] for r in payload["paired"]) == lost
    assert "| default | 0 | 1 | 2 |" in (tmp_path / "m" / "paired.md").read_text()
    with pytest.raises(InvalidInputError, match="repeats 2 examples"):
        curve.main(["--merge", a, a, "--out", str(tmp_path / "m2")])
    other = json.loads(Path(b).read_text())
    other["settings"]["seed"] = 5
    Path(b).write_text(json.dumps(other))
    with pytest.raises(InvalidInputError, match="differs from .*seed 5"):
        curve.main(["--merge", a, b, "--out", str(tmp_path / "m3")])
    with pytest.raises(InvalidInputError, match="not a finished"):
        curve.main(["--merge", str(tmp_path / "nope.json"), "--out", str(tmp_path / "m4")])


def test_reuse_benchmark_times_a_blend_with_the_rules_given(tmp_path, monkeypatch):
    load_benchmark("blend_curve", monkeypatch)  # what reuse.py imports
    bench = load_benchmark("reuse", monkeypatch)
    out = tmp_path / "reuse.json"
    argv = ["reuse.py", "--model", "tiny-llama", "--lengths", "128", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--rule", "leading=2:rescale=0.5", "--json", str(out)])
    seen = []
    real = kvedit.blend

    def spy(*args, **kw):
        seen.append({k: kw[k] for k in ("leading", "rescale") if k in kw})
        return real(*args, **kw)

    monkeypatch.setattr(bench.kvedit, "blend", spy)
    bench.main()
    (row,) = json.loads(out.read_text())
    assert row["rule"] == "leading=2:rescale=0.5" and row["blend_s"] > 0
    assert seen and all(kw == {"leading": 2, "rescale": 0.5} for kw in seen)


def test_blend_diagnosis_runs_on_a_tiny_model(tmp_path, monkeypatch):
    load_benchmark("blend_curve", monkeypatch)  # what blend_diagnosis imports, removed after
    diagnosis = load_benchmark("blend_diagnosis", monkeypatch)
    args = ["--model", "tiny-llama", "--n-docs", "2", "--recompute", "0"]  # EPIC
    args += ["--rule", "leading=2", "--max-new-tokens", "2", "--out", str(tmp_path)]
    assert diagnosis.main(args) == 0
    records = json.loads((tmp_path / "blend_diagnosis.json").read_text())["records"]
    assert [r["gold_index"] for r in records] == [0, 1]
    for r in records:
        n_layers, n_parts = 3, len(r["part_tokens"])  # tiny Llama; instruction + 2 documents
        assert n_parts == 3 and r["rules"] == ["leading"]
        for name in ("full", "blend"):
            shares = torch.tensor(r["attention"][name])
            assert shares.shape == (n_layers, n_parts) and (shares.sum(-1) <= 1 + 1e-4).all()
        deviation = torch.tensor(r["deviation"])
        assert deviation.shape == (n_layers, r["tokens"])
        assert deviation[:, : r["part_tokens"][0]].abs().max() < 1e-6  # the prefix is exact
        assert deviation[1:, r["part_tokens"][0] + r["part_tokens"][1] :].max() > 1e-3
    assert "| gold position |" in (tmp_path / "blend_diagnosis.md").read_text()
