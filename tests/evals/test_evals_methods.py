"""The method registry, prompt splitting, the runner and the CLI (on tiny models)."""

from __future__ import annotations

import json

import pytest
import torch

from kvedit import ops
from kvedit.cli import main as cli_main
from kvedit.errors import InvalidInputError
from kvedit.evals.litm import build_examples, run
from kvedit.evals.methods import (
    METHODS,
    AutoParams,
    ExampleContext,
    Method,
    parse_spec,
    register_method,
    split_prompt,
    split_specs,
)
from kvedit.evals.report import summarize
from kvedit.evals.tasks import Example, records_examples, write_jsonl
from kvedit.focusing import choice
from kvedit.focusing.choice import adaptive_strengths, content_free_question
from kvedit.focusing.guard import AgreementGuard
from kvedit.focusing.readout import attention_share


def small_examples():
    return records_examples(n_records=4, positions=(0, 3), trials=1, seed=0)


def test_parse_spec_params_and_errors():
    m = parse_spec("auto:strength=3:top_k=2:layers=(0.25,0.75)")
    assert isinstance(m.params, AutoParams)
    assert m.params.strength == 3 and m.params.top_k == 2
    assert (
        m.params.layers == (0.25, 0.75) and m.spec == "auto:strength=3:top_k=2:layers=(0.25,0.75)"
    )
    assert parse_spec("oracle:edit=scale_keys:factor=1.5").params.edit == "scale_keys"
    assert parse_spec("auto:target=None:strength=3").params.target is None
    assert parse_spec("oracle:edit=reread:separator='\\t'").params.separator == "\t"
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        parse_spec("nope")
    with pytest.raises(ValueError, match="unknown parameter"):
        parse_spec("auto:strenght=2")
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("auto:2")
    assert split_specs("none,auto:layers=(0.3,1.0),oracle") == [
        "none",
        "auto:layers=(0.3,1.0)",
        "oracle",
    ]


EDIT_DEFAULTS = {
    "edit": "emphasize",
    "strength": 2.0,
    "factor": 1.5,
    "copies": 7,
    "separator": "\n",
}
AUTO_DEFAULTS = {
    **EDIT_DEFAULTS,
    "strength": 5.0,
    "top_k": 1,
    "layers": [0.0, 1.0],
    "target": 0.2,
    "guard": "support",
    "support": 0.5,
    "shared": 0.5,
    "smoothing": 0.5,
    "threshold": 2.5,
    "all_words": True,
}

# What results.json records under extra.params, and --reuse compares, for specs users type: the
# same JSON (keys in this order, ints as ints) as when parameters were literal_eval'd dicts.
RECORDED = {
    "none": {},
    "closedbook": {},
    "repeat": {},
    "oracle": EDIT_DEFAULTS,
    "auto": AUTO_DEFAULTS,
    "reread": {**AUTO_DEFAULTS, "edit": "reread"},
    "auto:target=0.3": {**AUTO_DEFAULTS, "target": 0.3},
    "auto:all_words=False": {**AUTO_DEFAULTS, "all_words": False},
    "auto:target=None:strength=3": {**AUTO_DEFAULTS, "strength": 3, "target": None},
    "auto:layers=(0.25,0.75):top_k=2": {**AUTO_DEFAULTS, "top_k": 2, "layers": [0.25, 0.75]},
    "oracle:edit=scale_keys:factor=1.5": {**EDIT_DEFAULTS, "edit": "scale_keys"},
    "oracle:edit=duplicate:copies=3": {**EDIT_DEFAULTS, "edit": "duplicate", "copies": 3},
    "blend:recompute=0.15": {"recompute": 0.15, "context": "prefix"},
    "snapkv:keep=0.25:observe=window": {
        "keep": 0.25,
        "window": 32,
        "kernel": 5,
        "observe": "window",
    },
    "quantize:bits=4": {"bits": 4, "residual": 32, "group": 32},
}


@pytest.mark.parametrize("spec", RECORDED)
def test_specs_record_their_resolved_parameters(spec):
    recorded = json.loads(json.dumps(parse_spec(spec).param_dict()))
    assert json.dumps(recorded) == json.dumps(RECORDED[spec])


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("auto:top_k=1.5", "'top_k': expected an integer"),
        ("auto:top_k=0", "top_k must be >= 1"),
        ("auto:target=1.0", "target share"),
        ("auto:target=x", "expected a number"),
        ("auto:target=0.3:strength=-1", "strength"),
        ("auto:layers=(0.8,0.2)", "lo <= hi"),
        ("auto:layers=(0.5)", "2 comma-separated values"),
        ("oracle:edit=bogus", "edit must be one of"),
        ("oracle:copies=65", "copies must be <= 64"),
        ("oracle:strength=nan", "finite"),
        ("snapkv:observe=both", "observe"),
        ("snapkv:kernel=4", "odd"),
        ("snapkv:keep=0", "keep must be in"),
        ("quantize:bits=3", "bits must be one of"),
        ("blend:recompute=1.5", "recompute must be in"),
        ("none:x=1", "unknown parameter"),
    ],
)
def test_bad_parameters_are_refused_when_the_spec_is_parsed(spec, problem):
    with pytest.raises(InvalidInputError, match=problem):
        parse_spec(spec)


def test_parameters_are_checked_when_made_in_python():
    assert METHODS["auto"](top_k=2).params == AutoParams(top_k=2)
    with pytest.raises(InvalidInputError, match="top_k must be an int"):
        AutoParams(top_k="2")
    with pytest.raises(InvalidInputError, match="unknown parameter"):
        METHODS["auto"](strenght=2)
    with pytest.raises(InvalidInputError, match="takes AutoParams"):
        METHODS["auto"](object())


def test_split_prompt_locates_the_documents(llama):
    _, tok = llama
    ex = small_examples()[0]
    prefix, cont, spans = split_prompt(tok, ex)
    assert prefix.endswith(ex.documents[-1])
    assert cont.lstrip().startswith("Question: " + ex.question)
    assert [prefix[a:b] for a, b in spans] == list(ex.documents)


def test_content_free_question_drops_distinctive_words():
    docs = tuple(f"{n}'s secret number is {i}." for n, i in [("Ann", 1), ("Bo", 2), ("Cy", 3)])
    assert content_free_question("What is Bo's secret number?", docs) == "What is 's secret number?"
    assert content_free_question("Tell me", docs) == "?"


def test_runner_scores_every_method_and_is_deterministic(llama):
    model, tok = llama
    examples = small_examples()
    methods = [
        "none",
        "oracle",
        "auto:strength=3:threshold=None",
        "reread:threshold=None",
        "repeat",
        "oracle:edit=duplicate:copies=3",
    ]
    recs = run(model, tok, examples, methods, max_new_tokens=4, progress=False)
    assert len(recs) == len(examples) * len(methods)
    assert {r["method"] for r in recs} == set(methods)
    assert all(set(r) >= {"id", "method", "gold_index", "prediction", "correct"} for r in recs)
    again = run(model, tok, examples, methods, max_new_tokens=4, progress=False)
    assert [r["prediction"] for r in recs] == [r["prediction"] for r in again]
    # auto and reread record the document they chose (top_k=1; none when focus abstains).
    # Where they chose one they answer from an edit of it, which on this tiny model changes
    # the answer (an auto that answered from the unedited capture would answer as none does);
    # where they chose none they answer as none does.
    by = {(r["id"], r["method"]): r for r in recs}
    edited = set()
    for ex in examples:
        unedited = by[(ex.id, "none")]["prediction"]
        for spec in ("auto:strength=3:threshold=None", "reread:threshold=None"):
            rec = by[(ex.id, spec)]
            chosen = rec["chosen"]
            assert len(chosen) <= 1 and all(0 <= i < len(ex.documents) for i in chosen)
            if chosen:
                # the default guard's verdict is recorded: the edit stood, on this support
                assert rec["kept"] is True and 0.0 <= rec["support"] < 0.5, rec
                assert rec["prediction"] != unedited, f"{spec} answered {ex.id} without an edit"
                edited.add(spec)
            else:
                assert rec["prediction"] == unedited
                assert "kept" not in rec and "support" not in rec
    assert edited == {"auto:strength=3:threshold=None", "reread:threshold=None"}, (
        "each must edit some example for this test"
    )


def test_auto_calls_kvedit_focus_on_the_documents(llama, monkeypatch):
    """``auto`` is a thin call of :func:`kvedit.focus`: the documents are the passages, the
    example's question the calibration query (the scoring is tested in tests/focusing/test_focus.py)."""
    model, tok = llama
    ex = small_examples()[0]
    ctx = ExampleContext(model, tok, ex, max_new_tokens=2)
    calls = []
    real_focus = choice.focus

    def spy(state, question, passages, **kw):
        calls.append((question, passages, kw))
        return real_focus(state, question, passages, **kw)

    monkeypatch.setattr(choice, "focus", spy)
    parse_spec("auto").predict(ctx)
    ((question, passages, kw),) = calls
    assert question == ctx.continuation and passages == ctx.doc_spans
    assert kw["query"] == ex.question and kw["target"] == 0.2 and kw["max_strength"] == 5.0
    assert list(kw["layers"]) == list(range(len(ctx.state.layers))) and kw["top_k"] == 1


def test_adaptive_strengths_reach_the_target_and_clip():
    share = torch.tensor([0.01, 0.2, 0.5, 0.9, 0.0])
    b = adaptive_strengths(share, target=0.5, max_strength=20.0)
    moved = share * b.exp() / (share * b.exp() + 1 - share)
    assert torch.allclose(moved[:3], torch.full((3,), 0.5), atol=1e-5)
    assert b[2] == 0 and b[3] == 0  # at or above the target: no bias, never a negative one
    assert 0 < b[4] <= 20.0  # a share of 0 is clamped, not an error
    assert adaptive_strengths(share, 0.5, max_strength=2.0)[0] == 2.0
    with pytest.raises(InvalidInputError, match="target share"):
        parse_spec("auto:target=1.0")


def test_auto_with_a_target_biases_each_layer_to_reach_it(llama):
    model, tok = llama
    ctx = ExampleContext(model, tok, small_examples()[0], max_new_tokens=2)
    method = parse_spec("auto:target=0.6:strength=50:threshold=None")
    method.predict(ctx)
    (chosen,) = ctx.notes["auto_choice"]
    strengths = ctx.notes["auto_strengths"]
    assert strengths.shape == (len(ctx.state.layers),) and (strengths >= 0).all()
    edited = ctx.state
    for layer, b in enumerate(strengths.tolist()):
        edited = ops.emphasize(edited, [ctx.doc_spans[chosen]], b, layers=[layer])
    after = attention_share(edited, ctx.continuation, ctx.doc_spans).per_layer[:, chosen]
    before = attention_share(ctx.state, ctx.continuation, ctx.doc_spans).per_layer[:, chosen]
    lifted = strengths > 0
    assert lifted.any() and (before[lifted] < 0.6).all()
    # the share is a mean over heads and question tokens, so the target is approached, not hit
    assert ((after[lifted] - 0.6).abs() < (before[lifted] - 0.6).abs()).all()


class _Answer:
    """What a spied-on op returns: a state whose answer names the op."""

    nbytes = 1

    def __init__(self, op: str):
        self.op = op

    def generate(self, text: str, max_new_tokens: int) -> str:
        return f"{self.op}|{text}|{max_new_tokens}"


def test_compression_methods_answer_from_the_compressed_cache(llama, monkeypatch):
    """``snapkv`` and ``quantize`` hand their parameters to the op and answer from its state
    (replaces tests/compress/test_compress.py::test_compression_eval_methods)."""
    model, tok = llama
    calls = []

    def spy(op):
        def edit(state, **kwargs):
            calls.append((op, state, kwargs))
            return _Answer(op)

        return edit

    import kvedit.evals.methods.quantize as quantize_method
    import kvedit.evals.methods.snapkv as snapkv_method

    monkeypatch.setattr(snapkv_method, "snapkv", spy("snapkv"))
    monkeypatch.setattr(quantize_method, "quantize", spy("quantize"))
    ctx = ExampleContext(model, tok, small_examples()[0], max_new_tokens=3)
    assert parse_spec("snapkv:keep=0.25").predict(ctx) == f"snapkv|{ctx.continuation}|3"
    op, state, kwargs = calls[-1]
    assert op == "snapkv" and state is ctx.state
    assert kwargs == {"keep": 0.25, "query": ctx.continuation, "window": 32, "kernel": 5}
    parse_spec("snapkv:keep=0.5:observe=window:window=8:kernel=3").predict(ctx)
    assert calls[-1][2] == {"keep": 0.5, "query": None, "window": 8, "kernel": 3}
    assert parse_spec("quantize:bits=4:residual=0:group=16").predict(ctx).startswith("quantize|")
    op, state, kwargs = calls[-1]
    assert op == "quantize" and state is ctx.state
    assert kwargs == {"bits": 4, "residual": 0, "group": 16}


def test_compression_methods_run_end_to_end(llama):
    model, tok = llama
    examples = records_examples(n_records=4, positions=(0,), trials=1, seed=0)
    specs = ["none", "snapkv:keep=0.5", "snapkv:keep=0.25:observe=window", "quantize:bits=8"]
    specs += ["select:scorer=knorm:keep=0.5", "select:scorer=knorm:keep=0.5:bits=8"]
    records = run(model, tok, examples, specs, max_new_tokens=4, progress=False)
    assert [r["method"] for r in records] == specs
    assert all(isinstance(r["prediction"], str) for r in records)
    # every compression method records its cache's bytes, as a fraction of the full cache's
    full = ExampleContext(model, tok, examples[0]).state
    sizes = {r["method"]: r.get("bytes") for r in records}
    assert sizes["none"] is None
    selected = ops.select(full, "knorm", 0.5)
    assert sizes["select:scorer=knorm:keep=0.5"] == round(selected.nbytes / full.nbytes, 4)
    packed = ops.quantize(selected, bits=8).nbytes / full.nbytes
    assert sizes["select:scorer=knorm:keep=0.5:bits=8"] == round(packed, 4)
    assert summarize(records)["quantize:bits=8"]["bytes"] == sizes["quantize:bits=8"] < 1
    with pytest.raises(InvalidInputError, match="observe"):
        run(model, tok, examples, ["snapkv:observe=both"], progress=False)


def test_custom_method_via_registry(llama):
    model, tok = llama

    @register_method("echo_gold")
    class EchoGold(Method):
        needs_documents = True

        def predict(self, ctx):
            return ctx.example.answers[0]

    try:
        recs = run(model, tok, small_examples(), ["echo_gold"], progress=False)
        assert all(r["correct"] for r in recs)
    finally:
        METHODS.pop("echo_gold")


def test_methods_needing_documents_skip_closed_book(llama):
    model, tok = llama
    ex = Example("cb", "Answer.", (), "\n", "What is 2+2?", ("4",), -1, "first_number")
    recs = run(model, tok, [ex], ["none", "oracle"], max_new_tokens=3, progress=False)
    assert [r["method"] for r in recs] == ["none"]


def test_build_examples_limit_and_custom_data(tmp_path):
    assert len(build_examples("records", trials=2, positions=[0, 4], n_docs=5, limit=3)) == 3
    path = tmp_path / "d.jsonl"
    write_jsonl(small_examples(), path)
    assert build_examples(data=str(path)) == small_examples()
    with pytest.raises(ValueError, match="unknown task"):
        build_examples("bogus")


def test_cli_litm_writes_results_and_plot(tmp_path, capsys):
    data = tmp_path / "custom.jsonl"
    docs = [
        f"The locker code for {n} is {c}."
        for n, c in [("Ada", 51234), ("Ben", 62345), ("Cal", 73456)]
    ]
    examples = [
        Example(
            f"lock-{g}",
            "Find the code.",
            tuple(docs),
            " ",
            f"Which code opens {n}'s locker?",
            (str(c),),
            g,
            "first_number",
        )
        for g, (n, c) in enumerate([("Ada", 51234), ("Ben", 62345), ("Cal", 73456)])
    ]
    write_jsonl(examples, data)
    args = [
        "eval",
        "litm",
        "--data",
        str(data),
        "--methods",
        "none,auto,oracle",
        "--model",
        "tiny-llama",
        "--out",
        str(tmp_path / "out"),
        "--max-new-tokens",
        "4",
        "--no-progress",
    ]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "auto" in printed and "curve.png" in printed
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(res) >= {"model", "task", "methods", "examples"}
    assert set(res["methods"]) == {"none", "auto", "oracle"}
    for summary in res["methods"].values():
        assert set(summary) >= {"mean", "worst", "by_position", "n", "ci95"}
        assert summary["n"] == 3 and set(summary["by_position"]) == {"0", "1", "2"}
    assert (tmp_path / "out" / "curve.png").stat().st_size > 1000
    first = [e["prediction"] for e in res["examples"]]
    assert cli_main([*args, "--overwrite"]) == 0  # same seed, same results
    res2 = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [e["prediction"] for e in res2["examples"]] == first


def test_cli_rejects_bad_method_before_loading(tmp_path, capsys):
    args = ["eval", "litm", "--methods", "none,bogus", "--model", "tiny-llama"]
    assert cli_main([*args, "--out", str(tmp_path / "out")]) == 2
    assert "kvedit eval litm: error: unknown method" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_examples_interleave_positions_so_a_limit_covers_all():
    examples = build_examples("records", n_docs=6, positions=[0, 2, 5], trials=4, limit=6)
    assert [e.gold_index for e in examples] == [0, 2, 5, 0, 2, 5]
    full = build_examples("records", n_docs=6, positions=[0, 2, 5], trials=4)
    assert sorted(e.id for e in full) == sorted(e.id for e in records_examples(6, (0, 2, 5), 4))


def _interrupted(litm, monkeypatch, **kwargs):
    """Run evaluate until its records are written, then fail (partial.jsonl is left)."""

    def boom(records):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(litm, "summarize", boom)
        with pytest.raises(KeyboardInterrupt):
            litm.evaluate(**kwargs)


def test_resume_keeps_finished_pairs(tmp_path, monkeypatch):
    from kvedit.evals import litm

    out = tmp_path / "run"
    kwargs = dict(
        model_name="tiny-llama",
        methods=["none", "oracle"],
        out=out,
        n_docs=4,
        positions=[0, 3],
        trials=1,
        max_new_tokens=3,
        progress=False,
    )
    litm.evaluate(**kwargs)
    first = json.loads((out / "results.json").read_text())["examples"]
    assert not (out / "partial.settings.json").exists()
    _interrupted(litm, monkeypatch, **kwargs)
    # the interrupted run left half of the pairs, marked so we can see they are reused
    kept = [dict(r, prediction="KEPT") for r in first[:2]]
    (out / "partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    computed = []
    real_run = litm.run

    def counting_run(*a, **k):
        recs = real_run(*a, **k)
        computed.extend(r for r in recs if r["prediction"] != "KEPT")
        return recs

    monkeypatch.setattr(litm, "run", counting_run)
    litm.evaluate(**kwargs, resume=True)
    again = json.loads((out / "results.json").read_text())["examples"]
    assert [r["prediction"] for r in again[:2]] == ["KEPT", "KEPT"]
    assert len(again) == len(first) and len(computed) == len(first) - 2
    assert not (out / "partial.jsonl").exists()


def test_resume_refuses_a_partial_run_made_otherwise(tmp_path, monkeypatch):
    from kvedit.evals import litm

    out = tmp_path / "run"
    kwargs = dict(
        model_name="tiny-llama", out=out, n_docs=4, positions=[0, 3], trials=1, progress=False
    )
    _interrupted(litm, monkeypatch, methods=["none", "oracle"], max_new_tokens=3, **kwargs)
    for change, match in (
        (dict(max_new_tokens=4), "max_new_tokens 3"),
        (dict(max_new_tokens=3, prompt="plain"), "prompt 'chat'"),
    ):
        with pytest.raises(InvalidInputError, match=match):
            litm.evaluate(methods=["none", "oracle"], resume=True, **change, **kwargs)
    # a method whose parameters changed is recomputed; the others are kept
    partial = [json.loads(line) for line in (out / "partial.jsonl").read_text().splitlines()]
    (out / "partial.jsonl").write_text(
        "".join(json.dumps(dict(r, prediction="KEPT")) + "\n" for r in partial)
    )
    _interrupted(
        litm,
        monkeypatch,
        methods=["none", "oracle:strength=3.0"],
        max_new_tokens=3,
        resume=True,
        **kwargs,
    )
    again = [json.loads(line) for line in (out / "partial.jsonl").read_text().splitlines()]
    kept = {r["method"] for r in again if r["prediction"] == "KEPT"}
    assert kept == {"none"}
    (out / "partial.settings.json").unlink()
    with pytest.raises(InvalidInputError, match="cannot be checked"):
        litm.evaluate(methods=["none"], resume=True, max_new_tokens=3, **kwargs)


def test_reuse_takes_an_earlier_runs_results_and_checks_its_origin(tmp_path, monkeypatch):
    from kvedit.evals import litm

    kwargs = dict(model_name="tiny-llama", n_docs=4, positions=[0, 3], trials=1, max_new_tokens=3)
    litm.evaluate(methods=["none"], out=tmp_path / "a", progress=False, **kwargs)
    earlier = tmp_path / "a" / "results.json"
    res = json.loads(earlier.read_text())
    for r in res["examples"]:
        r["prediction"] = "FROM-EARLIER"
    earlier.write_text(json.dumps(res))
    litm.evaluate(
        methods=["none", "oracle"], out=tmp_path / "b", progress=False, reuse=earlier, **kwargs
    )
    got = json.loads((tmp_path / "b" / "results.json").read_text())["examples"]
    by_method = {m: [r["prediction"] for r in got if r["method"] == m] for m in ("none", "oracle")}
    assert by_method["none"] == ["FROM-EARLIER"] * 2
    assert all(p != "FROM-EARLIER" for p in by_method["oracle"]) and len(by_method["oracle"]) == 2
    # a spec whose parameters differ from the recorded ones is recomputed, not reused
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    res["extra"]["params"]["oracle"]["strength"] = 99.0
    for r in res["examples"]:
        r["prediction"] = "STALE"
    earlier.write_text(json.dumps(res))
    litm.evaluate(
        methods=["none", "oracle"], out=tmp_path / "d", progress=False, reuse=earlier, **kwargs
    )
    got = json.loads((tmp_path / "d" / "results.json").read_text())["examples"]
    assert [r["prediction"] == "STALE" for r in got] == [r["method"] == "none" for r in got]
    with pytest.raises(ValueError, match="model/task/seed"):
        litm.evaluate(
            methods=["none"],
            out=tmp_path / "c",
            progress=False,
            reuse=earlier,
            seed=1,
            **kwargs,
        )


def test_reuse_across_a_change_of_kvedit_source_takes_only_the_named_methods(tmp_path):
    """An earlier run by other code may hold answers this code would not give (a method whose
    parameters are the same but whose code changed): reuse refuses it unless the caller names
    the methods the change left alone, and records what it took."""
    from kvedit.evals import litm
    from kvedit.version import source_digest

    kwargs = dict(model_name="tiny-llama", n_docs=4, positions=[0, 3], trials=1, max_new_tokens=3)
    litm.evaluate(methods=["none", "oracle"], out=tmp_path / "a", progress=False, **kwargs)
    earlier = tmp_path / "a" / "results.json"
    res = json.loads(earlier.read_text())
    assert res["extra"]["kvedit"]["source"] == source_digest()
    res["extra"]["kvedit"]["source"] = "0" * 64  # as if made before a code change
    for r in res["examples"]:
        r["prediction"] = "OLD-CODE"
    earlier.write_text(json.dumps(res))
    methods = ["none", "oracle"]
    with pytest.raises(InvalidInputError, match="other kvedit code.*--reuse-methods"):
        litm.evaluate(methods=methods, out=tmp_path / "b", progress=False, reuse=earlier, **kwargs)
    del res["extra"]["kvedit"]  # a file from before sources were recorded
    earlier.write_text(json.dumps(res))
    with pytest.raises(InvalidInputError, match="did not record"):
        litm.evaluate(methods=methods, out=tmp_path / "b", progress=False, reuse=earlier, **kwargs)
    with pytest.raises(InvalidInputError, match="--reuse-methods auto: not among"):
        litm.evaluate(
            methods=methods, out=tmp_path / "b", progress=False, reuse=earlier,
            reuse_methods=["auto"], **kwargs,
        )  # fmt: skip
    litm.evaluate(
        methods=methods, out=tmp_path / "b", progress=False, reuse=earlier,
        reuse_methods=["none"], **kwargs,
    )  # fmt: skip
    got = json.loads((tmp_path / "b" / "results.json").read_text())
    assert [r["prediction"] == "OLD-CODE" for r in got["examples"]] == [
        r["method"] == "none" for r in got["examples"]
    ]
    assert got["extra"]["reused"] == {"from": str(earlier), "methods": ["none"], "unchecked": False}
    with pytest.raises(InvalidInputError, match="--reuse-methods names methods"):
        litm.evaluate(methods=methods, out=tmp_path / "e", reuse_methods=["none"], **kwargs)
    # --resume across a change of source is refused too
    out = tmp_path / "c"
    litm.evaluate(methods=["none"], out=out, progress=False, **kwargs)
    (out / "partial.jsonl").write_text("")
    settings = {**json.loads(json.dumps(_settings_of(out, kwargs))), "source": "0" * 64}
    (out / "partial.settings.json").write_text(json.dumps(settings))
    with pytest.raises(InvalidInputError, match="kvedit's source"):
        litm.evaluate(methods=["none"], out=out, progress=False, resume=True, **kwargs)


def test_reuse_and_resume_take_a_record_only_for_the_same_example(tmp_path, monkeypatch):
    """An id names the question and the gold position, not the documents: a run with other
    --n-docs asks other prompts under the same ids. Its answers must not be taken for them."""
    from kvedit.evals import litm

    kwargs = dict(model_name="tiny-llama", positions=[0, 3], trials=1, max_new_tokens=3)
    litm.evaluate(methods=["none"], out=tmp_path / "a", progress=False, n_docs=4, **kwargs)
    earlier = tmp_path / "a" / "results.json"
    res = json.loads(earlier.read_text())
    assert all(len(r["example"]) == 16 for r in res["examples"])
    for r in res["examples"]:
        r["prediction"] = "FROM-EARLIER"
    earlier.write_text(json.dumps(res))
    five = litm.build_examples("records", None, 5, [0, 3], 1, 0, None)
    assert {e.id for e in five} == {r["id"] for r in res["examples"]}  # the same ids
    with pytest.raises(InvalidInputError, match="another example than this run's.*--n-docs"):
        litm.evaluate(
            methods=["none"], out=tmp_path / "b", progress=False, reuse=earlier, n_docs=5,
            **kwargs,
        )  # fmt: skip
    # a file from before records named their example: refused, unless the caller vouches
    for r in res["examples"]:
        del r["example"]
    earlier.write_text(json.dumps(res))
    with pytest.raises(InvalidInputError, match="name no example digest.*--reuse-unchecked"):
        litm.evaluate(
            methods=["none"], out=tmp_path / "c", progress=False, reuse=earlier, n_docs=4,
            **kwargs,
        )  # fmt: skip
    litm.evaluate(
        methods=["none"], out=tmp_path / "c", progress=False, reuse=earlier, n_docs=4,
        reuse_unchecked=True, **kwargs,
    )  # fmt: skip
    got = json.loads((tmp_path / "c" / "results.json").read_text())
    assert [r["prediction"] for r in got["examples"]] == ["FROM-EARLIER"] * 2
    assert got["extra"]["reused"]["unchecked"] is True
    # --resume: a partial record of another example is refused as well
    out = tmp_path / "d"
    _interrupted(litm, monkeypatch, methods=["none"], out=out, progress=False, n_docs=4, **kwargs)
    partial = [json.loads(line) for line in (out / "partial.jsonl").read_text().splitlines()]
    assert partial, "the interrupted run kept nothing to resume"
    (out / "partial.jsonl").write_text(
        "".join(json.dumps(dict(r, example="0" * 16)) + "\n" for r in partial)
    )
    with pytest.raises(InvalidInputError, match="--resume.*another example"):
        litm.evaluate(methods=["none"], out=out, progress=False, resume=True, n_docs=4, **kwargs)


def _settings_of(out, kwargs) -> dict:
    """The partial.settings.json an ``evaluate`` of ``none`` with ``kwargs`` writes."""
    return {
        "model": kwargs["model_name"],
        "task": "records",
        "seed": 0,
        "prompt": "chat",
        "max_new_tokens": kwargs["max_new_tokens"],
        "engine": "transformers",
        "params": {"none": {}},
    }


# -- prompt formats (--prompt chat|plain) ------------------------------------------------------


def _untemplated(tok):
    """A copy of ``tok`` without a chat template (like a base model's tokenizer)."""
    import copy

    bare = copy.deepcopy(tok)
    bare.chat_template = None
    return bare


def test_plain_and_chat_prompts_put_the_same_message_in_their_formats(llama):
    from kvedit.evals.prompts import ANSWER_CUE
    from kvedit.prompts import templated_prompt

    model, tok = llama
    ex = small_examples()[0]
    user = ex.user_message()
    chat = split_prompt(tok, ex, "chat")
    assert chat == split_prompt(tok, ex)  # chat is the default
    assert chat[0] + chat[1] == templated_prompt(tok, user)
    assert chat[1].startswith("\n\nQuestion: " + ex.question) and "<|im_start|>assistant" in chat[1]
    prefix, cont, spans = split_prompt(tok, ex, "plain")
    assert ANSWER_CUE == "\nAnswer:"
    assert prefix + cont == user + "\nAnswer:"
    assert cont == "\n\nQuestion: " + ex.question + "\nAnswer:"
    assert not prefix.startswith(tok.bos_token)  # capture adds BOS (the tokenizer adds it)
    assert [prefix[a:b] for a, b in spans] == list(ex.documents)
    ctx = ExampleContext(model, tok, ex, prompt_format="plain")
    assert ctx.prompt == user + "\nAnswer:" and ex.question in ctx.continuation
    assert ctx.state.text == prefix


def test_chat_prompt_without_a_chat_template_is_an_error(llama):
    model, tok = llama
    bare = _untemplated(tok)
    ex = small_examples()[0]
    with pytest.raises(InvalidInputError, match="needs a chat template.*--prompt plain"):
        split_prompt(bare, ex, "chat")
    with pytest.raises(InvalidInputError, match="needs a chat template"):
        run(model, bare, [ex], ["none"], max_new_tokens=2, progress=False)
    with pytest.raises(InvalidInputError, match="unknown prompt format 'bogus'"):
        split_prompt(tok, ex, "bogus")
    # plain needs no template: the same prompt with and without one
    assert split_prompt(bare, ex, "plain") == split_prompt(tok, ex, "plain")


def test_a_template_that_rewrites_the_message_is_an_error(llama):
    _, tok = llama
    odd = _untemplated(tok)
    odd.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(InvalidInputError, match="rewrote the user message"):
        split_prompt(odd, small_examples()[0], "chat")


def test_a_record_holds_the_support_only_of_a_support_verdict():
    from kvedit.evals.engines import result_record
    from kvedit.focusing.guard import AgreementVerdict, SupportVerdict, Verdict
    from kvedit.states.decoding import Answer

    ex, answer = small_examples()[0], Answer("x", [1], [-0.5], True)
    verdicts = [
        (SupportVerdict(False, "supported", answer, 0.756789), {"kept": False, "support": 0.7568}),
        (AgreementVerdict(True, "edit", answer, 0, 1.5), {"kept": True}),
        (Verdict(True, "mine", answer), {"kept": True}),  # a guard of one's own
    ]
    for verdict, expected in verdicts:
        record = result_record(ex, "auto", "1", 0.1, {"auto_verdict": verdict}, "chat")
        assert {k: record[k] for k in ("kept", "support") if k in record} == expected


def test_runner_answers_every_method_in_the_plain_format(llama):
    model, tok = llama
    seen = []

    @register_method("see_prompt")
    class SeePrompt(Method):
        def predict(self, ctx):
            seen.append(ctx.continuation)
            return ctx.state.generate(ctx.continuation, ctx.max_new_tokens)

    methods = ["see_prompt", "none", "oracle", "auto", "reread", "closedbook", "gold_only"]
    try:
        examples = small_examples()
        recs = run(model, tok, examples, methods, 2, progress=False, prompt="plain")
    finally:
        METHODS.pop("see_prompt")
    assert len(recs) == len(examples) * len(methods)
    assert seen == ["\n\nQuestion: " + ex.question + "\nAnswer:" for ex in examples]


def test_evaluate_records_the_prompt_format_and_reuse_refuses_another(tmp_path, monkeypatch):
    from kvedit.evals import litm

    kwargs = dict(n_docs=4, positions=[0, 3], trials=1, max_new_tokens=2, progress=False)
    litm.evaluate("tiny-llama", ["none"], tmp_path / "chat", **kwargs)  # auto: chat
    chat = tmp_path / "chat" / "results.json"
    assert json.loads(chat.read_text())["extra"]["prompt"] == "chat"
    args = ["eval", "litm", "--model", "tiny-llama", "--methods", "none", "--n-docs", "4"]
    args += ["--positions", "0,3", "--trials", "1", "--max-new-tokens", "2", "--no-progress"]
    formats = []

    class SpyContext(ExampleContext):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            formats.append(self.prompt_format)

    from kvedit.evals import engines  # both engines' pairs come from engines.example_pairs

    monkeypatch.setattr(engines, "ExampleContext", SpyContext)
    assert cli_main([*args, "--prompt", "plain", "--out", str(tmp_path / "plain")]) == 0
    assert formats == ["plain", "plain"]
    plain = tmp_path / "plain" / "results.json"
    assert json.loads(plain.read_text())["extra"]["prompt"] == "plain"
    with pytest.raises(InvalidInputError, match="prompt format 'plain', not 'chat'"):
        litm.evaluate("tiny-llama", ["none"], tmp_path / "x", reuse=plain, **kwargs)
    with pytest.raises(InvalidInputError, match="prompt format 'chat', not 'plain'"):
        litm.evaluate("tiny-llama", ["none"], tmp_path / "x", reuse=chat, prompt="plain", **kwargs)
    # a file from before the format was recorded was made with chat
    old = json.loads(chat.read_text())
    del old["extra"]["prompt"]
    chat.write_text(json.dumps(old))
    with pytest.raises(InvalidInputError, match="prompt format 'chat', not 'plain'"):
        litm.evaluate("tiny-llama", ["none"], tmp_path / "x", reuse=chat, prompt="plain", **kwargs)
    litm.evaluate("tiny-llama", ["none"], tmp_path / "y", reuse=chat, prompt="chat", **kwargs)
    assert not (tmp_path / "x").exists()
    # a chat run on a tokenizer without a template stops before writing anything
    model, tok = litm.load_model("tiny-llama")
    monkeypatch.setattr(litm, "load_model", lambda name: (model, _untemplated(tok)))
    with pytest.raises(InvalidInputError, match="needs a chat template"):
        litm.evaluate("tiny-llama", ["none"], tmp_path / "z", **kwargs)
    assert not (tmp_path / "z").exists()


def test_plain_answers_end_at_their_first_line(llama):
    from kvedit.evals.prompts import plain_answer

    assert plain_answer(" 6451\nQuestion: What is Bo's number?\nAnswer: 3044") == " 6451"
    assert plain_answer("\n\n  4821.\nmore") == "\n\n  4821."
    assert plain_answer("one line") == "one line"
    model, tok = llama
    ex = small_examples()[0]
    (plain,) = run(model, tok, [ex], ["none"], max_new_tokens=12, progress=False, prompt="plain")
    ctx = ExampleContext(model, tok, ex, 12, prompt_format="plain")
    assert plain["prediction"] == plain_answer(ctx.state.generate(ctx.continuation, 12))
    assert "\n" not in plain["prediction"].strip()


def test_auto_refuses_a_guard_without_a_cache_edit_and_zero_smoothing():
    with pytest.raises(
        InvalidInputError, match="needs a cache edit to compare: with edit='steer' use guard=none"
    ):
        parse_spec("auto:edit=steer:guard=True")
    with pytest.raises(InvalidInputError, match="smoothing"):
        parse_spec("auto:smoothing=0.0")
    assert parse_spec("auto:guard=True").params.guard == "agreement"
    assert parse_spec("auto:guard=False").params.guard == "none"
    assert parse_spec("auto").params.guard == "support"
    assert parse_spec("auto:guard=none:edit=steer").params.guard == "none"
    with pytest.raises(InvalidInputError, match="guard must be one of support, agreement, none"):
        parse_spec("auto:guard=maybe")
    with pytest.raises(InvalidInputError, match="support"):
        parse_spec("auto:support=1.5")
    with pytest.raises(InvalidInputError, match="shared must be in"):
        parse_spec("auto:shared=1.5")


def test_the_support_guard_reads_a_plain_prompts_answer_as_the_eval_does(llama):
    from kvedit.evals.methods.focus import guard_of
    from kvedit.evals.prompts import plain_answer

    model, tok = llama
    ex = small_examples()[0]
    params = parse_spec("auto").params
    chat = guard_of(params, ExampleContext(model, tok, ex, max_new_tokens=6))
    plain = guard_of(params, ExampleContext(model, tok, ex, 6, prompt_format="plain"))
    assert chat.read is None and plain.read is plain_answer
    assert (chat.threshold, chat.max_new_tokens) == (params.support, 6)
    assert chat.shared == params.shared == 0.5
    ctx = ExampleContext(model, tok, ex, max_new_tokens=6)
    assert guard_of(parse_spec("auto:shared=1").params, ctx).shared == 1.0
    assert guard_of(parse_spec("auto:guard=none").params, None) is None


def test_reread_with_a_guard_answers_from_the_state_the_guard_keeps(llama, monkeypatch):
    from kvedit.evals.methods import focus as example_focus_module

    model, tok = llama
    ex = small_examples()[0]
    ctx = ExampleContext(model, tok, ex, max_new_tokens=6)
    reread = parse_spec("reread:threshold=None").predict(ctx)
    none = ctx.state.generate(ctx.continuation, 6)
    assert reread != none, "the edit must change the answer for this test"
    for margin, expected in ((-1e9, reread), (1e9, none)):
        guard = AgreementGuard(margin, max_new_tokens=32)
        monkeypatch.setattr(example_focus_module, "AGREEMENT_GUARD", guard)
        assert parse_spec("reread:guard=True:threshold=None").predict(ctx) == expected


def test_max_positions_above_the_config_reaches_every_capture_of_the_run(tmp_path, monkeypatch):
    """The run's own model gets the limit: the shared capture and each method read it."""
    from kvedit.compat import text_config
    from kvedit.errors import InvalidInputError
    from kvedit.evals import litm
    from kvedit.testing import tiny_model

    def short_config(name):
        model, tok = tiny_model("llama")
        text_config(model).max_position_embeddings = 24  # understated: prompts are longer
        return model, tok

    monkeypatch.setattr(litm, "load_model", short_config)
    kwargs = dict(
        model_name="tiny-llama",
        methods=["none", "oracle"],
        n_docs=3,
        positions=[0],
        trials=1,
        max_new_tokens=2,
        progress=False,
    )
    with pytest.raises(InvalidInputError, match="24 positions"):
        litm.evaluate(out=tmp_path / "refused", **kwargs)
    summary = litm.evaluate(out=tmp_path / "run", max_positions=4096, **kwargs)
    assert summary
