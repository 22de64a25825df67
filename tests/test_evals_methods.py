"""The method registry, prompt splitting, the runner and the CLI (on tiny models)."""

from __future__ import annotations

import json

import pytest
import torch

from kvedit import ops
from kvedit.cli import main as cli_main
from kvedit.evals.litm import build_examples, run
from kvedit.evals.methods import (
    METHODS,
    ExampleContext,
    Method,
    _content_free,
    document_scores,
    parse_spec,
    register_method,
    split_prompt,
    split_specs,
    strength_for_share,
)
from kvedit.evals.tasks import Example, records_examples, write_jsonl
from kvedit.readout import attention_share


def small_examples():
    return records_examples(n_records=4, positions=(0, 3), trials=1, seed=0)


def test_parse_spec_params_and_errors():
    m = parse_spec("auto:strength=3:top_k=2:layers=(0.25,0.75)")
    assert m.params["strength"] == 3 and m.params["top_k"] == 2
    assert (
        m.params["layers"] == (0.25, 0.75)
        and m.spec == "auto:strength=3:top_k=2:layers=(0.25,0.75)"
    )
    assert parse_spec("oracle:edit=scale_keys:factor=1.5").params["edit"] == "scale_keys"
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


def test_split_prompt_locates_the_documents(llama):
    _, tok = llama
    ex = small_examples()[0]
    prefix, cont, spans = split_prompt(tok, ex)
    assert prefix.endswith(ex.documents[-1])
    assert cont.lstrip().startswith("Question: " + ex.question)
    assert [prefix[a:b] for a, b in spans] == list(ex.documents)


def test_content_free_question_drops_distinctive_words():
    docs = tuple(f"{n}'s secret number is {i}." for n, i in [("Ann", 1), ("Bo", 2), ("Cy", 3)])
    assert _content_free("What is Bo's secret number?", docs) == "What is 's secret number?"
    assert _content_free("Tell me", docs) == "?"


def test_runner_scores_every_method_and_is_deterministic(llama):
    model, tok = llama
    examples = small_examples()
    methods = [
        "none",
        "oracle",
        "auto:strength=3",
        "reread",
        "repeat",
        "oracle:edit=duplicate:copies=3",
    ]
    recs = run(model, tok, examples, methods, max_new_tokens=4, progress=False)
    assert len(recs) == len(examples) * len(methods)
    assert {r["method"] for r in recs} == set(methods)
    assert all(set(r) >= {"id", "method", "gold_index", "prediction", "correct"} for r in recs)
    again = run(model, tok, examples, methods, max_new_tokens=4, progress=False)
    assert [r["prediction"] for r in recs] == [r["prediction"] for r in again]


def test_document_scores_prefer_a_document_with_the_question_content(llama):
    model, tok = llama
    ex = small_examples()[0]
    ctx = ExampleContext(model, tok, ex)
    scores = document_scores(ctx, {"layers": (0.0, 1.0)})
    assert scores.shape == (len(ex.documents),)
    shares = ctx.memo("shares", lambda: None)  # the two attention readouts, computed once
    assert shares is not None and shares[0].shape == (len(ctx.state.layers), len(ex.documents))
    assert torch.equal(document_scores(ctx, {"layers": (0.0, 1.0)}), scores)


def test_strength_for_share_reaches_the_target_and_clips():
    share = torch.tensor([0.01, 0.2, 0.5, 0.9])
    b = strength_for_share(share, target=0.5, max_strength=10.0)
    moved = share * b.exp() / (share * b.exp() + 1 - share)
    assert torch.allclose(moved[:3], torch.full((3,), 0.5), atol=1e-5)
    assert b[2] == 0 and b[3] == 0  # at or above the target: no bias
    assert strength_for_share(share, 0.5, max_strength=2.0)[0] == 2.0
    with pytest.raises(ValueError, match="target share"):
        strength_for_share(share, 1.0, 3.0)


def test_auto_with_a_target_biases_each_layer_to_reach_it(llama):
    model, tok = llama
    ctx = ExampleContext(model, tok, small_examples()[0], max_new_tokens=2)
    method = parse_spec("auto:target=0.6:strength=50")
    method.predict(ctx)
    (chosen,) = ctx._cache["auto_choice"]
    strengths = ctx._cache["auto_strengths"]
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
    assert cli_main(args) == 0  # same seed, same results
    res2 = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [e["prediction"] for e in res2["examples"]] == first


def test_cli_rejects_bad_method_before_loading(tmp_path):
    with pytest.raises(ValueError, match="unknown method"):
        cli_main(
            [
                "eval",
                "litm",
                "--methods",
                "none,bogus",
                "--model",
                "tiny-llama",
                "--out",
                str(tmp_path),
            ]
        )


def test_examples_interleave_positions_so_a_limit_covers_all():
    examples = build_examples("records", n_docs=6, positions=[0, 2, 5], trials=4, limit=6)
    assert [e.gold_index for e in examples] == [0, 2, 5, 0, 2, 5]
    full = build_examples("records", n_docs=6, positions=[0, 2, 5], trials=4)
    assert sorted(e.id for e in full) == sorted(e.id for e in records_examples(6, (0, 2, 5), 4))


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
    # an interrupted run left half of the pairs, one of them marked so we can see it is reused
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
