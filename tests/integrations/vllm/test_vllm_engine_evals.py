"""``kvedit eval litm --engine vllm`` answers as the transformers engine does.

One run (one engine start), with ``approximate=True`` (``--approximate``): ``auto`` (unguarded) and
``oracle`` emphasize by per-layer or non-``log(r + 1)`` strengths, which vLLM realises only
approximately; their records and the summary say so. ``oracle:edit=scale_keys`` keeps the
plain state's token ids: its file is told from ``none``'s by its digest.
"""

from __future__ import annotations

import json

import pytest

from kvedit.evals.litm import build_examples, evaluate, run

pytestmark = pytest.mark.real
AUTO = "auto:guard=none"  # always its edit (the support guard may answer unedited: exact)
METHODS = ["none", "oracle:edit=scale_keys:factor=0.5", AUTO, "oracle"]
SETTINGS = dict(task="records", n_docs=10, positions=[0, 6], trials=1, seed=0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("litm-vllm")
    evaluate(
        "smollm2-135m-instruct",
        METHODS,
        out,
        **SETTINGS,
        max_new_tokens=16,
        batch=2,
        progress=False,
        engine="vllm",
        approximate=True,
    )
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def reference(smollm2):
    model, tok = smollm2
    examples = build_examples(**SETTINGS)
    records = run(model, tok, examples, METHODS, max_new_tokens=16, progress=False)
    return {(r["id"], r["method"]): r for r in records}


def test_vllm_answers_equal_the_transformers_engine(results, reference):
    got = {(r["id"], r["method"]): r for r in results["examples"]}
    assert got.keys() == reference.keys()
    exact = {k for k, r in got.items() if r["exact"]}
    assert {k for k in got if k[1] in METHODS[:2]} <= exact  # none, scale_keys: exact
    for key in exact:
        assert got[key]["prediction"] == reference[key]["prediction"], key
    agree = sum(got[k]["prediction"] == reference[k]["prediction"] for k in got)
    print(f"{agree}/{len(got)} answers identical ({len(exact)} from exact caches)")


def test_the_edit_reaches_vllm(results, reference):
    """scale_keys(0.5) on the gold record changes kvedit's answer; vLLM follows it."""
    got = {(r["id"], r["method"]): r["prediction"] for r in results["examples"]}
    changed = [
        k
        for k in got
        if k[1] == METHODS[1]
        and reference[k]["prediction"] != reference[(k[0], "none")]["prediction"]
    ]
    assert changed, "pick an edit that changes an answer"
    for key in changed:
        assert got[key] != got[(key[0], "none")]


def test_the_run_records_the_engine(results):
    extra = results["extra"]
    assert extra["engine"] == "vllm" and extra["batch"] == 2 and extra["approximate"] is True
    assert extra["engine_start_seconds"] > 0 and extra["serve_seconds"] > 0
    assert 0 < extra["seconds_per_example_after_start"] < extra["seconds_per_example"]
    auto = [r for r in results["examples"] if r["method"] == AUTO]
    assert all(len(r["chosen"]) == 1 for r in auto)


def test_approximations_are_labelled_in_the_records_and_the_summary(results):
    records = results["examples"]
    for r in records:
        assert ("approximation" in r) == (not r["exact"]), r
        if not r["exact"]:
            assert r["approximation"]["engine"] == "vllm"
    for method, stats in results["methods"].items():
        mine = [r["exact"] for r in records if r["method"] == method]
        assert stats["exact_share"] == pytest.approx(sum(mine) / len(mine))
    assert results["methods"]["none"]["exact_share"] == 1.0
    assert results["methods"][AUTO]["exact_share"] < 1.0  # per-layer strengths
