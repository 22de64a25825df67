"""``kvedit eval memory``: the task generators, the method specs, a run that forgets, the CLI's
results folder and its refusals (#42)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kvedit.cli import main as cli_main
from kvedit.errors import InvalidInputError
from kvedit.evals import memory
from kvedit.evals.metrics import normalize_answer
from kvedit.evals.tasks.memory_facts import facts_examples
from kvedit.evals.tasks.memory_nq import nq_shared_examples
from kvedit.evals.tasks.memory_schema import BUCKETS

# ------------------------------------------------------------------------------ generators


def test_facts_are_deterministic_balanced_and_each_stated_only_in_its_pair():
    a, b = facts_examples(4, seed=3, n_messages=40), facts_examples(4, seed=3, n_messages=40)
    assert a == b
    assert a != facts_examples(4, seed=4, n_messages=40)
    for conv in a:
        assert conv.remember is False
        assert len(conv.messages) == 41 and conv.messages[0][0] == "system"
        assert Counter(p.bucket for p in conv.probes) == {b: 2 for b in BUCKETS}
        text = f" {normalize_answer(' '.join(c for _, c in conv.messages))} "
        for probe in conv.probes:
            (answer,) = probe.answers
            assert text.count(f" {normalize_answer(answer)} ") == 2, answer
            stated, echoed = conv.messages[probe.where], conv.messages[probe.where + 1]
            assert stated[0] == "user" and answer in stated[1]
            assert echoed[0] == "assistant" and echoed[1].startswith("Noted: ")
            assert answer in echoed[1]
        assert len({p.question for p in conv.probes}) == len(conv.probes)


def test_facts_draw_values_again_until_each_is_stated_only_in_its_pair(monkeypatch):
    from kvedit.evals.tasks import memory_facts

    _, subjects = memory_facts.KINDS["code"]
    monkeypatch.setattr(memory_facts, "KINDS", {"code": (lambda rng: "1234", subjects)})
    with pytest.raises(InvalidInputError, match="could not draw 3 distinct"):
        facts_examples(1, n_messages=40, n_facts=3)


def test_facts_refuse_bad_sizes():
    for kwargs in ({"n_messages": 38}, {"n_messages": 41}, {"n_messages": 202}, {"n_facts": 4}):
        with pytest.raises(InvalidInputError):
            facts_examples(1, **kwargs)


def test_nq_shared_is_deterministic_balanced_and_each_answer_in_its_gold_document():
    a = nq_shared_examples(2, seed=1, n_docs=12, n_questions=6)
    assert a == nq_shared_examples(2, seed=1, n_docs=12, n_questions=6)
    for conv in a:
        assert conv.remember is True
        docs = [c for role, c in conv.messages if role == "tool"]
        assert len(docs) == 12
        assert Counter(p.bucket for p in conv.probes) == {b: 2 for b in BUCKETS}
        for probe in conv.probes:
            answers = [f" {normalize_answer(x)} " for x in probe.answers if normalize_answer(x)]
            holding = [
                i
                for i, d in enumerate(docs)
                if any(x in f" {normalize_answer(d)} " for x in answers)
            ]
            assert holding == [probe.where]


# ------------------------------------------------------------------------------ specs


def test_specs_and_budgets_are_parsed_and_refused_clearly():
    m = memory.parse_memory_spec("window:budget=0.25:recent=1")
    assert (m.name, m.params.budget, m.params.recent) == ("window", 0.25, 1)
    assert m.budgets([1.0, 0.5]) == [0.25]
    assert memory.parse_memory_spec("reuse").budgets([0.5, 0.1]) == [1.0]
    assert memory.parse_budgets("1.0,0.5,0.25,0.1") == [1.0, 0.5, 0.25, 0.1]
    assert memory.parse_memory_spec("window:quantize=4").params.quantize == 4
    with pytest.raises(InvalidInputError, match="quantize must be one of"):
        memory.parse_memory_spec("window:quantize=3")
    with pytest.raises(InvalidInputError, match="unknown memory method"):
        memory.parse_memory_spec("forgetful")
    with pytest.raises(InvalidInputError, match="budget"):
        memory.parse_memory_spec("tova:budget=1.5")
    for bad in ("0", "1.5", "0.5,0.5", "x", ""):
        with pytest.raises(InvalidInputError, match="--budgets"):
            memory.parse_budgets(bad)


def test_a_policy_without_its_scorer_is_refused(monkeypatch):
    from kvedit.compress import scorers

    monkeypatch.delitem(scorers.SCORERS, "tova")
    with pytest.raises(InvalidInputError, match="not registered.*not built yet"):
        memory.parse_memory_spec("tova")


# ------------------------------------------------------------------------------ forgetting


@pytest.fixture(scope="module")
def conversation():
    return facts_examples(1, seed=0, n_messages=40)[0]


def test_a_budget_below_one_forgets(llama, conversation):
    model, tok = llama
    method = memory.parse_memory_spec("window")
    records = memory.run_conversation(
        model, tok, conversation, method, 0.5, task="facts", max_new_tokens=2
    )
    assert len(records) == len(conversation.probes)
    full = records[0]["full_entries"]
    for r in records:
        assert r["max_entries"] == round(0.5 * full)
        assert r["entries"] <= r["max_entries"] < full
        assert r["rounds"] >= 1 and r["forget_seconds"] > 0
        assert r["budget"] == 0.5 and r["bucket"] in BUCKETS


@pytest.mark.parametrize("spec", ["window:quantize=4", "snapkv-first:quantize=4"])
def test_quantize_holds_fewer_bytes_for_the_same_entries(llama, conversation, spec):
    model, tok = llama
    runs = {
        s: memory.run_conversation(
            model,
            tok,
            conversation,
            memory.parse_memory_spec(s),
            0.5,
            task="facts",
            max_new_tokens=2,
        )
        for s in (spec, spec.split(":")[0])
    }
    for q, plain in zip(runs[spec], runs[spec.split(":")[0]], strict=True):
        assert q["entries"] == plain["entries"] and q["nbytes"] < 0.6 * plain["nbytes"]


def test_quantize_at_budget_one_is_not_reuse(llama, conversation):
    """At budget 1.0 a policy is ``reuse`` (computed once), but with ``quantize`` it is its own
    run: nothing forgotten, the older messages held in 4 bits."""
    model, tok = llama
    shared: dict = {}
    runs = {
        spec: memory._records(
            model,
            tok,
            conversation,
            memory.parse_memory_spec(spec),
            1.0,
            shared,
            "facts",
            2,
            None,
        )
        for spec in ("knorm", "knorm:quantize=4")
    }
    assert all(r["as"] == "reuse" for r in runs["knorm"])
    for q, plain in zip(runs["knorm:quantize=4"], runs["knorm"], strict=True):
        assert "as" not in q and q["rounds"] == 0
        assert q["entries"] == plain["entries"] and q["nbytes"] < 0.6 * plain["nbytes"]


def test_snapkv_first_compresses_once_and_reuse_keeps_everything(llama, conversation):
    model, tok = llama
    first = memory.run_conversation(
        model,
        tok,
        conversation,
        memory.parse_memory_spec("snapkv-first"),
        0.5,
        task="facts",
        max_new_tokens=2,
    )
    full = first[0]["full_entries"]
    assert all(r["entries"] < full and r["rounds"] == 0 for r in first)
    whole = memory.run_conversation(
        model,
        tok,
        conversation,
        memory.parse_memory_spec("reuse"),
        1.0,
        task="facts",
        max_new_tokens=2,
    )
    assert all(r["entries"] == full and r["max_entries"] is None for r in whole)


# ------------------------------------------------------------------------------ the CLI

RUN = ["eval", "memory", "--model", "tiny-llama", "--task", "facts", "--size", "40"]
RUN += ["--n-examples", "2", "--max-new-tokens", "2", "--no-progress"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory") / "done"
    args = [*RUN, "--methods", "reuse,window", "--budgets", "1.0,0.5", "--out", str(out)]
    assert cli_main(args) == 0
    return out


def test_a_run_writes_results_table_and_plot(finished, capsys):
    data = json.loads((finished / "results.json").read_text())
    assert set(data["methods"]) == {"reuse", "window"}
    assert set(data["methods"]["window"]) == {"1", "0.5"}
    assert set(data["methods"]["reuse"]) == {"1"}
    assert len(data["examples"]) == 3 * 2 * 6  # reuse, window@1 (as reuse), window@0.5
    forgot = [r for r in data["examples"] if r["budget"] == 0.5]
    assert forgot and all(r["rounds"] >= 1 and r["max_entries"] for r in forgot)
    assert all(
        r["as"] == "reuse" for r in data["examples"] if r["method"] == "window" and r["budget"] == 1
    )
    assert data["extra"]["reread"]["turns"] == memory.REREAD_TURNS
    assert not (finished / "partial.jsonl").exists()
    if memory.plotting_available():
        assert (finished / "curve.png").stat().st_size > 0
    table = memory.format_memory_table(data["methods"])
    assert "early" in table and "window" in table


@pytest.fixture
def no_model(monkeypatch):
    import kvedit.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(kvedit.models, "load_model", refuse)


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--methods", "window:quantize=5"], "quantize must be one of"),
        (["--methods", "bogus"], "unknown memory method"),
        (["--methods", ","], "names no method"),
        (["--budgets", "0"], "not in (0, 1]"),
        (["--budgets", "1.5"], "not in (0, 1]"),
        (["--size", "39"], "n_messages"),
        ([], "holds an earlier run's results.json"),
    ],
)
def test_refusals_exit_2_before_loading_and_write_nothing(finished, no_model, capsys, extra, says):
    before = _snapshot(finished)
    args = [*RUN, "--methods", "reuse", "--budgets", "0.5", "--out", str(finished)]
    capsys.readouterr()
    leave = [] if says.startswith("holds") else ["--overwrite"]  # only the --out refusal
    assert cli_main([*args, *extra, *leave]) == 2
    assert says in capsys.readouterr().err
    assert _snapshot(finished) == before


def test_a_refused_run_makes_no_folder(tmp_path, no_model, capsys):
    out = tmp_path / "new"
    assert cli_main([*RUN, "--methods", "tova:budget=0", "--out", str(out)]) == 2
    assert "budget" in capsys.readouterr().err
    assert not out.exists()


def test_resume_keeps_whole_conversations_and_drops_a_cut_line(finished, tmp_path, capsys):
    data = json.loads((finished / "results.json").read_text())
    out = tmp_path / "cut"
    out.mkdir()
    settings = {
        "model": "tiny-llama",
        "task": "facts",
        "seed": 0,
        "n_examples": 2,
        "size": 40,
        "max_new_tokens": 2,
        "source": data["extra"]["kvedit"]["source"],
    }
    (out / "partial.settings.json").write_text(json.dumps(settings))
    kept = [r for r in data["examples"] if r["method"] == "reuse"]
    lines = "".join(json.dumps(r) + "\n" for r in kept)
    (out / "partial.jsonl").write_text(lines + json.dumps(kept[0])[:20])
    conversations = memory.build_conversations("facts", 2, 0, 40)
    resumed = memory.resumed_records(out, settings, conversations)
    assert resumed == kept
    assert "last line is cut" in capsys.readouterr().err
    short = "".join(json.dumps(r) + "\n" for r in kept[:-1])  # one conversation incomplete
    (out / "partial.jsonl").write_text(short)
    assert memory.resumed_records(out, settings, conversations) == kept[:6]
    with pytest.raises(InvalidInputError, match="another run"):
        memory.resumed_records(out, {**settings, "seed": 1}, conversations)
