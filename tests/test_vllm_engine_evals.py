"""``kvedit eval litm --engine vllm`` answers as the transformers engine does.

One run through the command line (one engine start). ``oracle:edit=scale_keys`` keeps the
plain state's token ids, so its published file has the name ``none``'s has: the engine must
answer ``none`` before replacing the file (see ``VLLMAnswerer.submit``).
"""

from __future__ import annotations

import json

import pytest

from kvedit.cli import main as cli_main
from kvedit.evals.litm import build_examples, run

pytestmark = pytest.mark.real
METHODS = ["none", "oracle:edit=scale_keys:factor=0.5", "auto", "oracle"]
SETTINGS = dict(task="records", n_docs=10, positions=[0, 6], trials=1, seed=0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("litm-vllm")
    args = ["eval", "litm", "--engine", "vllm", "--methods", ",".join(METHODS)]
    args += ["--task", "records", "--n-docs", "10", "--positions", "0,6", "--trials", "1"]
    args += ["--max-new-tokens", "16", "--batch", "2", "--no-progress", "--out", str(out)]
    assert cli_main(args) == 0
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
    assert extra["engine"] == "vllm" and extra["batch"] == 2
    assert extra["engine_start_seconds"] > 0 and extra["serve_seconds"] > 0
    assert 0 < extra["seconds_per_example_after_start"] < extra["seconds_per_example"]
    auto = [r for r in results["examples"] if r["method"] == "auto"]
    assert all(len(r["chosen"]) == 1 for r in auto)
