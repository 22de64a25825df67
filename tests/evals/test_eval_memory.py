"""``kvedit eval memory``: the task generators, the method specs, a run that forgets, the CLI's
results folder and its refusals (#42)."""

from __future__ import annotations

import json
import os
from collections import Counter

import filelock
import pytest

from kvedit.cli import main as cli_main
from kvedit.errors import InvalidInputError
from kvedit.evals import memory, memory_specs
from kvedit.evals.metrics import normalize_answer
from kvedit.evals.tasks.memory_facts import facts_examples
from kvedit.evals.tasks.memory_nq import nq_shared_examples
from kvedit.evals.tasks.memory_schema import BUCKETS
from kvedit.store.lock import WriterLock

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


def test_the_methods_are_every_registered_scorer(monkeypatch):
    """A policy is any registered scorer: one registered later is a method, one removed is
    not."""
    from dataclasses import dataclass

    from kvedit.compress import scorers

    assert set(memory.memory_methods()) == {"reuse", "snapkv-first", *scorers.SCORERS}
    monkeypatch.delitem(scorers.SCORERS, "tova")
    with pytest.raises(InvalidInputError, match="unknown memory method 'tova'"):
        memory.parse_memory_spec("tova")

    @dataclass(frozen=True)
    class Fresh(scorers.Scorer):
        def score(self, state, layers):
            return {i: state.layers[i].keys.float().norm(dim=-1) for i in layers}

    monkeypatch.setitem(scorers.SCORERS, "fresh", Fresh)
    assert memory.parse_memory_spec("fresh:budget=0.5").name == "fresh"


# ------------------------------------------------------------------------------ forgetting


@pytest.fixture(scope="module")
def conversation():
    return facts_examples(1, seed=0, n_messages=40)[0]


def test_a_budget_in_bytes_bounds_what_the_memory_allocates(llama, conversation):
    """``in_bytes=True``: the budget is that fraction of the bytes a memory forgetting nothing
    allocates; every record's bytes are at most it, and each says what each layer held."""
    model, tok = llama
    reuse = memory.run_conversation(
        model, tok, conversation, memory.parse_memory_spec("reuse"), 1.0, task="facts",
        max_new_tokens=2,
    )  # fmt: skip
    method = memory.parse_memory_spec("kvzip:in_bytes=True")
    records = memory.run_conversation(
        model, tok, conversation, method, 0.3, task="facts", max_new_tokens=2
    )
    whole = reuse[0]["nbytes"]
    for r in records:
        assert r["max_entries"] is None and r["max_bytes"] == round(0.3 * whole)
        assert r["nbytes"] <= r["max_bytes"]
        assert len(r["entries_per_layer"]) == len(model.model.layers)  # tiny llama: all global


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


def _settings(methods=("reuse",), budgets=(1.0, 0.5, 0.25, 0.1)) -> dict:
    """The settings of a run of :data:`RUN` with ``methods`` at ``budgets``."""
    parsed = [memory.parse_memory_spec(m) for m in methods]
    sizes = {"seed": 0, "n_examples": 2, "size": 40, "questions": None, "max_new_tokens": 2}
    return memory.run_settings("tiny-llama", "facts", parsed, budgets, **sizes)


def test_resume_keeps_whole_conversations_and_drops_a_cut_line(finished, tmp_path, capsys):
    data = json.loads((finished / "results.json").read_text())
    out = tmp_path / "cut"
    out.mkdir()
    settings = _settings()
    (out / "partial.settings.json").write_text(json.dumps(settings))
    kept = [r for r in data["examples"] if r["method"] == "reuse"]
    lines = "".join(json.dumps(r) + "\n" for r in kept)
    (out / "partial.jsonl").write_text(lines + json.dumps(kept[0])[:20])
    conversations = memory.build_conversations("facts", 2, 0, 40)
    asked = {("reuse", 1.0)}
    resumed = memory.resumed_records(out, settings, conversations, asked)
    assert resumed == kept
    assert "last line is cut" in capsys.readouterr().err
    short = "".join(json.dumps(r) + "\n" for r in kept[:-1])  # one conversation incomplete
    (out / "partial.jsonl").write_text(short)
    assert memory.resumed_records(out, settings, conversations, asked) == kept[:6]
    with pytest.raises(InvalidInputError, match="another run"):
        memory.resumed_records(out, {**settings, "seed": 1}, conversations, asked)


# ------------------------------------------------------------------------------ hardening (#56)


@pytest.mark.parametrize("recent", [0, 16, 40])
def test_entries_needed_is_what_the_memory_refuses_below(llama, conversation, recent):
    """The budget check before a run mirrors ``Memory``: at ``needed`` entries every message
    and question fits, one fewer is refused by the memory itself."""
    from kvedit.memory.conversation import Memory

    model, tok = llama
    needed, full = memory_specs.entries_needed(
        memory.default_renderer(tok), conversation, recent, 2
    )
    assert full == memory.full_entries(memory.default_renderer(tok), conversation) and needed < full
    for max_tokens, refused in ((needed, False), (needed - 1, True)):
        mem = Memory(model, tok, max_tokens=max_tokens, forget="window", recent_tokens=recent)
        try:
            for role, content in conversation.messages:
                mem.add(role, content)
            for probe in conversation.probes:
                mem.ask(probe.question, 2, remember=False)
        except InvalidInputError as e:
            assert refused, e
            assert "protected part" in str(e)
        else:
            assert not refused, f"max_tokens={max_tokens} was not refused"


def test_a_budget_below_what_the_memory_never_forgets_is_refused_and_writes_nothing(
    finished, capsys
):
    before = _snapshot(finished)
    args = [*RUN, "--methods", "reuse,window", "--budgets", "1.0,0.001", "--out", str(finished)]
    capsys.readouterr()
    assert cli_main([*args, "--overwrite"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvedit eval memory: error: window at budget 0.001: its memory would ")
    assert "fewer than the " in line and "give a budget of at least 0." in line
    assert _snapshot(finished) == before  # no partial files: the next run is not refused


def test_an_empty_out_is_refused(tmp_path, monkeypatch, no_model, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main([*RUN, "--methods", "reuse", "--out", ""]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kvedit eval memory: error: --out is empty: name the folder the results go to"
    ]
    assert os.listdir(tmp_path) == []


def _partial(out, data, methods=("reuse",), budgets=(1.0, 0.5, 0.25, 0.1), **changes) -> None:
    """``out`` holding an interrupted run's files (the records of ``data`` of ``methods``)."""
    out.mkdir(exist_ok=True)
    (out / "partial.settings.json").write_text(json.dumps(_settings(methods, budgets)))
    kept = [{**r, **changes} for r in data["examples"] if r["method"] in methods]
    (out / "partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))


@pytest.mark.parametrize("holder", ["kvedit", "filelock"])
def test_a_second_run_on_a_running_out_is_told_another_run_holds_it(
    finished, tmp_path, no_model, capsys, holder
):
    out = tmp_path / "running"
    _partial(out, json.loads((finished / "results.json").read_text()))  # a run at work
    lock = (
        WriterLock(out / ".lock", "kvedit eval memory")
        if holder == "kvedit"
        else filelock.FileLock(out / ".lock", thread_local=False)  # kvedit eval litm's
    )
    with lock:
        before = _snapshot(out)
        capsys.readouterr()
        assert cli_main([*RUN, "--methods", "reuse", "--out", str(out)]) == 2
        assert _snapshot(out) == before
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvedit eval memory: error: --out {out}: another kvedit eval run is ")
    held = f"kvedit eval memory {os.getpid()}, since " if holder == "kvedit" else "another process"
    assert f"writing there ({held}" in line and "--resume" not in line


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"budget": "x"}, "a memory record's 'budget' must be a number in (0, 1], not 'x'"),
        ({"budget": None}, "a memory record's 'budget' must be a number in (0, 1], not None"),
        (
            {"bucket": "soon"},
            "a memory record's 'bucket' must be one of early, middle, late or null (a "
            "question without evidence), not 'soon'",
        ),
        ({"correct": "yes"}, "a memory record's 'correct' must be a number, not 'yes'"),
        ({"example": 3}, "a memory record's 'example' must be text, not 3"),
    ],
)
def test_resume_refuses_a_record_it_cannot_read_naming_the_line(
    finished, tmp_path, no_model, capsys, change, says
):
    out = tmp_path / "bad"
    _partial(out, json.loads((finished / "results.json").read_text()), **change)
    before = _snapshot(out)
    capsys.readouterr()
    assert cli_main([*RUN, "--methods", "reuse", "--out", str(out), "--resume"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"kvedit eval memory: error: --resume {out / 'partial.jsonl'}:1: {says}"
    assert _snapshot(out) == before


def test_resume_refuses_settings_that_lack_keys(finished, tmp_path, no_model, capsys):
    out = tmp_path / "bad"
    _partial(out, json.loads((finished / "results.json").read_text()))
    (out / "partial.settings.json").write_text('{"model": "tiny-llama"}')
    before = _snapshot(out)
    capsys.readouterr()
    assert cli_main([*RUN, "--methods", "reuse", "--out", str(out), "--resume"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"kvedit eval memory: error: --resume {out / 'partial.settings.json'}: it lacks task, seed"
    )
    assert _snapshot(out) == before


def test_a_refusal_after_the_model_loads_writes_nothing(finished, monkeypatch, capsys):
    """The partial files are written with the first records: a run refused before them (here
    by its first conversation) leaves the folder as it was, and the next run is not refused."""

    def refuse(*args, **kwargs):
        raise InvalidInputError("the first conversation cannot be run")

    monkeypatch.setattr(memory, "_records", refuse)
    before = _snapshot(finished)
    args = [*RUN, "--methods", "reuse", "--out", str(finished), "--overwrite"]
    capsys.readouterr()
    assert cli_main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kvedit eval memory: error: the first conversation cannot be run"
    ]
    assert _snapshot(finished) == before


# ------------------------------------------------------------------------------ hardening (#65)


@pytest.mark.parametrize(
    ("now", "says"),
    [
        (["--methods", "reuse"], "methods ['reuse', 'window'] (now ['reuse'])"),
        (["--methods", "reuse,knorm"], "methods ['reuse', 'window'] (now ['knorm', 'reuse'])"),
        (["--methods", "reuse,window", "--budgets", "1.0"], "budgets [1.0, 0.5] (now [1.0])"),
    ],
)
def test_resume_with_other_methods_or_budgets_is_refused_naming_what_differs(
    finished, tmp_path, no_model, capsys, now, says
):
    """A killed run of reuse and window resumed with fewer or other methods, or other budgets,
    is refused (exit 2, before the model loads): its records would be reported as this run's."""
    out = tmp_path / "killed"
    data = json.loads((finished / "results.json").read_text())
    _partial(out, data, methods=("reuse", "window"), budgets=(1.0, 0.5))
    before = _snapshot(out)
    capsys.readouterr()
    assert cli_main([*RUN, *now, "--out", str(out), "--resume"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvedit eval memory: error: --resume: {out / 'partial.jsonl'} came ")
    assert says in line and "params" not in line.split(says)[0]
    assert _snapshot(out) == before


def test_resume_refuses_a_record_of_a_method_not_asked(finished, tmp_path, no_model, capsys):
    """An edited record whose method (or budget) the run does not ask is refused by its line,
    never reported as a result."""
    out = tmp_path / "edited"
    data = json.loads((finished / "results.json").read_text())
    _partial(out, data)
    lines = (out / "partial.jsonl").read_text().splitlines(keepends=True)
    for line_no, change in ((3, {"method": "knorm"}), (2, {"budget": 0.5})):
        edited = list(lines)
        edited[line_no - 1] = json.dumps({**json.loads(lines[line_no - 1]), **change}) + "\n"
        (out / "partial.jsonl").write_text("".join(edited))
        capsys.readouterr()
        assert cli_main([*RUN, "--methods", "reuse", "--out", str(out), "--resume"]) == 2
        (said,) = capsys.readouterr().err.splitlines()
        value = change.get("method", change.get("budget"))
        assert said.startswith(
            f"kvedit eval memory: error: --resume {out / 'partial.jsonl'}:{line_no}: a record "
        )
        assert f"{value!r}" in said and "which this run does not ask (methods reuse)" in said


def test_resume_with_the_same_methods_reports_only_them(finished, tmp_path, capsys):
    """The killed run's records are kept (not recomputed) and results.json holds only the
    methods asked."""
    out = tmp_path / "again"
    data = json.loads((finished / "results.json").read_text())
    _partial(out, data, methods=("reuse", "window"), budgets=(1.0, 0.5))
    args = [*RUN, "--methods", "window,reuse", "--budgets", "0.5,1.0", "--out", str(out)]
    assert cli_main([*args, "--resume"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert set(again["methods"]) == {"reuse", "window"}
    assert sorted(json.dumps(r, sort_keys=True) for r in again["examples"]) == sorted(
        json.dumps(r, sort_keys=True) for r in data["examples"]
    )


def test_h2o_on_a_sliding_window_model_is_refused_before_the_model_loads(
    tmp_path, no_model, capsys
):
    """h2o cannot serve Gemma-3's sliding-window layers: refused from the model's
    configuration (exit 2, nothing written), no longer once the model is loaded (exit 1)."""
    out = tmp_path / "h2o"
    args = ["eval", "memory", "--model", "tiny-gemma3", "--task", "facts", "--size", "40"]
    assert cli_main([*args, "--methods", "reuse,h2o", "--out", str(out), "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "kvedit eval memory: error: --methods h2o on tiny-gemma3: cannot serve a model with "
        "sliding-window layers"
    )
    assert not out.exists()


def test_a_scorers_config_rule_agrees_with_its_state_rule(tiny):
    """What ``refuses_config`` says before the weights load is what ``refuses`` says of a
    state of the model, for every scorer (so the early check refuses nothing the memory would
    take), and it does say it for h2o on the model with sliding-window layers."""
    import kvedit
    from kvedit.compress import SCORERS
    from kvedit.evals.configs import peek_config

    arch, model, tok = tiny
    state = kvedit.capture(model, tok, "The river is calm near the old bridge. " * 4)
    config = peek_config(f"tiny-{arch}")
    assert config is not None
    for name, cls in SCORERS.items():
        if name == "learned":  # its rule is a fit file, which no configuration tells
            continue
        early = cls().refuses_config(config)
        assert early is None or early == cls().refuses(state), name
    h2o = [memory.parse_memory_spec("h2o")]
    if arch == "gemma3":
        assert SCORERS["h2o"]().refuses_config(config) is not None
        with pytest.raises(InvalidInputError, match="sliding-window layers"):
            memory_specs.check_model_serves("tiny-gemma3", h2o)
    else:
        memory_specs.check_model_serves(f"tiny-{arch}", h2o)
