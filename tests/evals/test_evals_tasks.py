"""Tests of kvedit.evals.tasks: examples, the records and NQ generators, custom data files."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvedit.errors import KVEditError
from kvedit.evals.metrics import best_subspan_em, normalize_answer
from kvedit.evals.tasks import (
    NAMES,
    NQ_CLOSED_BOOK_INSTRUCTION,
    NQ_INSTRUCTION,
    RECORDS_INSTRUCTION,
    TASKS,
    Example,
    InvalidExampleError,
    load_jsonl,
    load_nq,
    nq_examples,
    records_examples,
    register_task,
    write_jsonl,
)


def make_example(**overrides) -> Example:
    fields = dict(
        id="ex-1",
        instruction="Read these.",
        documents=("first doc", "second doc", "third doc"),
        separator="\n",
        question="Which?",
        answers=("second",),
        gold_index=1,
    )
    fields.update(overrides)
    return Example(**fields)


# -- Example ----------------------------------------------------------------------------------


def test_user_message_is_the_documented_concatenation() -> None:
    ex = make_example()
    assert ex.user_message() == (
        "Read these.\n\nfirst doc\nsecond doc\nthird doc\n\nQuestion: Which?"
    )
    assert (
        ex.user_message()[: ex.documents_end()] == "Read these.\n\nfirst doc\nsecond doc\nthird doc"
    )
    assert ex.user_message()[ex.documents_end() :] == "\n\nQuestion: Which?"


def test_lists_become_tuples_and_metric_defaults_to_subspan_em() -> None:
    ex = make_example(documents=["a", "b"], answers=["b"])
    assert ex.documents == ("a", "b") and ex.answers == ("b",)
    assert ex.metric == "subspan_em"
    assert hash(ex) == hash(make_example(documents=("a", "b"), answers=("b",)))


@settings(max_examples=150, deadline=None)
@given(
    instruction=st.text(max_size=20),
    documents=st.lists(st.text(max_size=15), max_size=6),
    separator=st.sampled_from(["\n", "\n\n", " | ", ""]),
    question=st.text(min_size=1, max_size=10),
)
def test_document_spans_cover_exactly_the_documents(
    instruction: str, documents: list[str], separator: str, question: str
) -> None:
    ex = Example(
        id="p",
        instruction=instruction,
        documents=tuple(documents),
        separator=separator,
        question=question,
        answers=("x",),
        gold_index=0 if documents else -1,
    )
    message = ex.user_message()
    spans = ex.document_spans()
    assert [message[start:end] for start, end in spans] == documents
    # The spans are in order and only separators lie between them.
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert message[end:start] == separator
    if documents:
        assert spans[-1][1] == ex.documents_end()
        assert message[: spans[0][0]] == (instruction + "\n\n" if instruction else "")
    assert message.endswith("Question: " + question)
    assert message[ex.documents_end() :] in ("\n\nQuestion: " + question, "Question: " + question)
    if instruction and documents:
        expected = instruction + "\n\n" + separator.join(documents) + "\n\nQuestion: " + question
        assert message == expected


def test_empty_instruction_and_no_documents_leave_no_blank_lines() -> None:
    ex = make_example(instruction="")
    assert ex.user_message() == "first doc\nsecond doc\nthird doc\n\nQuestion: Which?"
    assert ex.document_spans()[0] == (0, len("first doc"))
    bare = make_example(instruction="", documents=(), gold_index=-1)
    assert bare.user_message() == "Question: Which?"
    assert bare.documents_end() == 0
    assert bare.gold_document is None


def test_closed_book_and_gold_only_variants() -> None:
    ex = make_example()
    closed = ex.closed_book()
    assert closed.documents == () and closed.gold_index == -1
    assert closed.id == "ex-1-closed" and closed.instruction == ex.instruction
    assert closed.user_message() == "Read these.\n\nQuestion: Which?"
    assert closed.documents_end() == len("Read these.")
    assert ex.closed_book(instruction="Answer.").instruction == "Answer."

    gold = ex.gold_only()
    assert gold.documents == ("second doc",) and gold.gold_index == 0
    assert gold.id == "ex-1-gold" and gold.answers == ex.answers
    with pytest.raises(InvalidExampleError):
        closed.gold_only()


def test_nq_variants_use_liu_et_al_conventions() -> None:
    ex = nq_examples(n_docs=5, positions=(3,), trials=1, seed=2)[0]
    closed = ex.closed_book()
    assert closed.instruction == NQ_CLOSED_BOOK_INSTRUCTION
    gold = ex.gold_only()
    assert gold.documents[0].startswith("Document [1](Title: ")
    assert gold.documents[0].split(")", 1)[1] == ex.documents[3].split(")", 1)[1]


def test_with_documents() -> None:
    ex = make_example().with_documents(["x", "y"], 0, id="other")
    assert ex.documents == ("x", "y") and ex.gold_index == 0 and ex.id == "other"


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"gold_index": 3}, "out of range"),
        ({"gold_index": -1}, "out of range"),
        ({"documents": (), "gold_index": 0}, "gold_index -1"),
        ({"gold_index": True}, "integer"),
        ({"metric": "bleu"}, "unknown metric"),
        ({"answers": ()}, "answers"),
        ({"answers": "second"}, "answers"),
        ({"question": ""}, "question"),
        ({"id": ""}, "id"),
        ({"metric": "first_number", "answers": ("second",)}, "number"),
    ],
)
def test_invalid_examples_are_rejected(overrides: dict, problem: str) -> None:
    with pytest.raises(InvalidExampleError, match=problem) as info:
        make_example(**overrides)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KVEditError)


# -- records ----------------------------------------------------------------------------------

_RECORD = re.compile(r"^(\w+)'s secret number is ([0-9]{4})\.$")


def test_builtin_names_are_distinct_and_not_prefixes() -> None:
    assert len(NAMES) >= 60 and len(set(NAMES)) == len(NAMES)
    assert not [(a, b) for a in NAMES for b in NAMES if a != b and b.startswith(a)]


def test_records_counts_ids_and_prompt() -> None:
    examples = records_examples(n_records=20, positions=(0, 5, 19), trials=4, seed=1)
    assert len(examples) == 12
    assert [ex.gold_index for ex in examples] == [0] * 4 + [5] * 4 + [19] * 4
    assert len({ex.id for ex in examples}) == 12
    assert examples[5].id == "records-s1-t1-p5"
    for ex in examples:
        assert ex.instruction == RECORDS_INSTRUCTION
        assert ex.separator == "\n" and ex.metric == "first_number"
        assert len(ex.documents) == 20


def test_records_place_the_gold_record_and_nothing_else_holds_the_answer() -> None:
    for ex in records_examples(n_records=12, positions=(0, 6, 11), trials=5, seed=7):
        parsed = [_RECORD.match(doc).groups() for doc in ex.documents]
        names = [name for name, _ in parsed]
        numbers = [number for _, number in parsed]
        assert len(set(names)) == len(names) and len(set(numbers)) == len(numbers)
        assert all(not number.startswith("0") for number in numbers)
        (answer,) = ex.answers
        gold_name, gold_number = parsed[ex.gold_index]
        assert gold_number == answer
        assert ex.question == f"What is {gold_name}'s secret number?"
        distractors = [d for i, d in enumerate(ex.documents) if i != ex.gold_index]
        assert not any(answer in d or gold_name in d for d in distractors)


def test_records_trial_uses_the_same_records_at_every_position() -> None:
    examples = records_examples(n_records=10, positions=(0, 4, 9), trials=3, seed=0)
    for trial in range(3):
        same = [ex for ex in examples if f"-t{trial}-" in ex.id]
        assert len(same) == 3
        assert len({ex.question for ex in same} | {ex.answers for ex in same}) == 2
        others = [ex.documents[: ex.gold_index] + ex.documents[ex.gold_index + 1 :] for ex in same]
        assert others[0] == others[1] == others[2]
        assert len({ex.documents[ex.gold_index] for ex in same}) == 1
    # Different trials draw different records.
    assert examples[0].documents != examples[1].documents


def test_records_are_deterministic_per_seed() -> None:
    assert records_examples(trials=3, seed=5) == records_examples(trials=3, seed=5)
    assert records_examples(trials=3, seed=5) != records_examples(trials=3, seed=6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_records": 10, "positions": (10,)},
        {"positions": ()},
        {"positions": (1, 1)},
        {"n_records": len(NAMES) + 1, "positions": (0,)},
        {"trials": -1},
    ],
)
def test_records_reject_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        records_examples(**kwargs)


# -- NQ ---------------------------------------------------------------------------------------


def test_nq_data_ships_with_the_package() -> None:
    data = resources.files("kvedit").joinpath("evals/data")
    assert data.joinpath("nq-open-oracle.jsonl.gz").is_file()
    attribution = data.joinpath("ATTRIBUTION.md").read_text(encoding="utf-8")
    for needle in ("Lost in the Middle", "MIT", "CC BY-SA 3.0", "Natural Questions"):
        assert needle in attribution
    items = load_nq()
    assert len(items) == 2655
    assert all(item.answers and item.text and item.title for item in items[:50])


def test_nq_counts_prompt_and_gold_placement() -> None:
    examples = nq_examples(n_docs=6, positions=(0, 2, 5), trials=4, seed=3)
    assert len(examples) == 12
    by_position = {p: [ex for ex in examples if ex.gold_index == p] for p in (0, 2, 5)}
    assert all(len(group) == 4 for group in by_position.values())
    questions = [[ex.question for ex in group] for group in by_position.values()]
    assert questions[0] == questions[1] == questions[2]
    items = load_nq()
    for ex in examples:
        assert ex.instruction == NQ_INSTRUCTION and ex.separator == "\n"
        assert ex.metric == "subspan_em" and len(ex.documents) == 6
        row = int(re.fullmatch(r"nq-s3-q(\d+)-p\d", ex.id).group(1))
        item = items[row]
        assert (ex.question, ex.answers) == (item.question, item.answers)
        for i, doc in enumerate(ex.documents, start=1):
            assert doc.startswith(f"Document [{i}](Title: ")
        assert (
            ex.documents[ex.gold_index]
            == f"Document [{ex.gold_index + 1}](Title: {item.title}) {item.text}"
        )
        assert best_subspan_em(ex.documents[ex.gold_index], ex.answers) == 1.0
        answers = [f" {normalize_answer(a)} " for a in ex.answers if normalize_answer(a)]
        for i, doc in enumerate(ex.documents):
            if i != ex.gold_index:
                assert not any(a in f" {normalize_answer(doc)} " for a in answers)
                assert item.text not in doc
        assert len(set(ex.documents)) == 6


def test_nq_distractors_keep_their_order_across_positions() -> None:
    first, last = nq_examples(n_docs=4, positions=(0, 3), trials=1, seed=0)

    def passages(ex: Example) -> list[str]:
        return [doc.split("](", 1)[1] for doc in ex.documents]

    assert passages(first)[1:] == passages(last)[:3]
    assert passages(first)[0] == passages(last)[3]


def test_nq_is_deterministic_per_seed_and_limit_bounds_the_pool() -> None:
    assert nq_examples(n_docs=5, trials=3, positions=(0, 4), seed=1) == nq_examples(
        n_docs=5, trials=3, positions=(0, 4), seed=1
    )
    assert nq_examples(n_docs=5, trials=3, positions=(0,), seed=1) != nq_examples(
        n_docs=5, trials=3, positions=(0,), seed=2
    )
    limited = nq_examples(n_docs=5, positions=(0, 4), limit=7)
    assert len(limited) == 14
    assert {ex.id.split("-")[2] for ex in limited} == {f"q{i}" for i in range(7)}
    assert len(nq_examples(n_docs=3, positions=(1,), trials=2, limit=7)) == 2


@pytest.mark.parametrize(
    "kwargs",
    [{"positions": (10,)}, {"n_docs": 0}, {"trials": 8, "limit": 7}, {"limit": -1}],
)
def test_nq_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        nq_examples(**kwargs)


def test_nq_reads_another_file(tmp_path: Path) -> None:
    rows = [
        {
            "question": f"q{i}",
            "answers": [f"answer{i}"],
            "ctxs": [{"title": f"T{i}", "text": f"is answer{i}"}],
        }
        for i in range(4)
    ]
    path = tmp_path / "nq.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    examples = nq_examples(n_docs=3, positions=(2,), path=path)
    assert [ex.question for ex in examples] == ["q0", "q1", "q2", "q3"]
    assert examples[1].documents[2] == "Document [3](Title: T1) is answer1"


def test_nq_distractors_are_distinct_and_never_hold_the_answer(tmp_path: Path) -> None:
    def row(question: str, answer: str, title: str, text: str) -> str:
        ctxs = [{"title": title, "text": text}]
        return json.dumps({"question": question, "answers": [answer], "ctxs": ctxs}) + "\n"

    lines = [row("where do zebras live", "the Savanna", "Zebra", "Zebras live in the savanna.")]
    lines += [row(f"h{i}", "x", f"Holder {i}", f"The savanna, part {i}.") for i in range(10)]
    lines += [row(f"t{i}", "x", "Savanna", "Grassland.") for i in range(5)]  # answer in title
    lines += [row(f"c{i}", "x", "Zebra", "Zebras live in the savanna.") for i in range(5)]
    lines += [row(f"d{i}", "x", "Copy", "Same text.") for i in range(5)]  # one passage
    lines += [row(f"o{i}", "x", f"Other {i}", f"Savannah, Georgia {i}.") for i in range(8)]
    path = tmp_path / "nq.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    allowed = {"Same text."} | {f"Savannah, Georgia {i}." for i in range(8)}
    for seed in range(5):
        (ex,) = nq_examples(n_docs=10, positions=(0,), seed=seed, limit=1, path=path)
        distractors = [doc.split(") ", 1)[1] for doc in ex.documents[1:]]
        assert len(set(distractors)) == 9 and set(distractors) == allowed
    with pytest.raises(ValueError, match="could not find 10 distractors"):
        nq_examples(n_docs=11, positions=(0,), limit=1, path=path)


# -- custom data ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["examples.jsonl", "examples.jsonl.gz"])
def test_jsonl_round_trip(tmp_path: Path, name: str) -> None:
    examples = [
        *records_examples(n_records=5, positions=(0, 4), trials=2),
        make_example(id="custom", instruction="Ünïcode ✓"),
        make_example(id="closed").closed_book(),
    ]
    path = write_jsonl(examples, tmp_path / name)
    assert path == tmp_path / name
    assert load_jsonl(path) == examples
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left behind
    if name.endswith(".gz"):
        assert gzip.decompress(path.read_bytes()).startswith(b'{"id": "records-')


def test_jsonl_metric_is_optional_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    line = make_example().to_json()
    del line["metric"]
    path = tmp_path / "a.jsonl"
    path.write_text("\n" + json.dumps(line) + "\n\n", encoding="utf-8")
    (loaded,) = load_jsonl(path)
    assert loaded == make_example()


def _bad(**changes) -> str:
    data = make_example().to_json()
    for key, value in changes.items():
        if value is KeyError:
            del data[key]
        else:
            data[key] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"id": "x", ', "bad JSON"),
        ("[1, 2]", "JSON object"),
        (_bad(question=KeyError), "missing key.*question"),
        (_bad(gold_idx=1), "unknown key.*gold_idx"),
        (_bad(gold_index=3), "gold_index 3 is out of range"),
        (_bad(gold_index="1"), "gold_index must be an integer"),
        (_bad(metric="rouge"), "unknown metric 'rouge'"),
        (_bad(documents="one string"), "documents must be a list"),
        (_bad(answers=[1]), "answers"),
        (_bad(id="ex-0"), "duplicate id 'ex-0'"),
    ],
)
def test_jsonl_errors_name_file_line_and_problem(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "custom.jsonl"
    good = json.dumps(make_example(id="ex-0").to_json())
    path.write_text(f"{good}\n\n{line}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"custom\.jsonl:3: .*{problem}") as info:
        load_jsonl(path)
    assert isinstance(info.value, InvalidExampleError)


def test_jsonl_without_examples_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(InvalidExampleError, match="no examples"):
        load_jsonl(path)


# -- registry ---------------------------------------------------------------------------------


def test_registry() -> None:
    assert TASKS["records"].make is records_examples and TASKS["nq"].make is nq_examples
    assert TASKS["records"].keywords == {"n_docs": "n_records"}
    with pytest.raises(ValueError, match="already registered"):
        register_task("records")(nq_examples)
    # Registering the same function again (as a module reload does) is fine.
    assert register_task("records", n_docs="n_records")(records_examples) is records_examples

    @register_task("test-tiny")
    def tiny() -> list[Example]:
        return [make_example()]

    try:
        assert TASKS["test-tiny"].examples() == [make_example()]
    finally:
        del TASKS["test-tiny"]


# -- a task is one module (#66) ----------------------------------------------------------------

CALLED: list[dict] = []


def few_records(n_items: int = 3, positions=(0,), trials: int = 1, seed: int = 0) -> list[Example]:
    """A task defined here: the records task under its own keyword for the documents."""
    CALLED.append({"n_items": n_items, "positions": positions, "trials": trials, "seed": seed})
    return records_examples(n_records=n_items, positions=positions, trials=trials, seed=seed)


def few_facts(n_examples: int = 1, seed: int = 0, messages: int = 40, facts: int = 3):
    """A memory task defined here: facts under its own keywords."""
    from kvedit.evals.tasks import facts_examples

    CALLED.append({"n_examples": n_examples, "messages": messages, "facts": facts})
    return [
        dataclasses.replace(c, id=c.id.replace("facts", "few"))
        for c in facts_examples(n_examples, seed, n_messages=messages, n_facts=facts)
    ]


@pytest.fixture
def own_tasks():
    from kvedit.evals.tasks import MEMORY_TASKS, register_memory_task

    CALLED.clear()
    register_task("test-few", n_docs="n_items")(few_records)
    register_memory_task("test-few-facts", size="messages", questions="facts")(few_facts)
    yield
    del TASKS["test-few"]
    del MEMORY_TASKS["test-few-facts"]


def test_a_task_registered_here_runs_through_kvedit_eval_litm(own_tasks, tmp_path, capsys):
    """A task defined in this module, registered, is a ``--task`` choice of ``kvedit eval
    litm`` and is run with the options as its own keywords: no list of tasks to extend."""
    from kvedit.cli.main import build_parser
    from kvedit.cli.main import main as cli_main

    args = ["eval", "litm", "--task", "test-few", "--model", "tiny-llama", "--methods", "none"]
    args += ["--n-docs", "4", "--positions", "0,3", "--max-new-tokens", "2", "--no-progress"]
    assert build_parser().parse_args([*args, "--out", "x"]).task == "test-few"
    assert cli_main([*args, "--out", str(tmp_path / "few")]) == 0
    assert CALLED[-1] == {"n_items": 4, "positions": (0, 3), "trials": 1, "seed": 0}
    data = json.loads((tmp_path / "few" / "results.json").read_text())
    assert data["task"] == "test-few" and len(data["examples"]) == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "litm", "--task", "test-none"])
    assert "test-few" in capsys.readouterr().err  # the choices are the registry's


def test_a_memory_task_registered_here_runs_through_kvedit_eval_memory(own_tasks, tmp_path):
    from kvedit.cli.main import build_parser
    from kvedit.cli.main import main as cli_main

    args = ["eval", "memory", "--task", "test-few-facts", "--model", "tiny-llama", "--size"]
    args += ["40", "--n-examples", "1", "--methods", "reuse", "--max-new-tokens", "2"]
    args += ["--no-progress", "--questions", "3"]
    assert build_parser().parse_args([*args, "--out", "x"]).task == "test-few-facts"
    assert cli_main([*args, "--out", str(tmp_path / "few")]) == 0
    assert CALLED[-1] == {"n_examples": 1, "messages": 40, "facts": 3}
    data = json.loads((tmp_path / "few" / "results.json").read_text())
    assert data["task"] == "test-few-facts"
    assert {r["example"] for r in data["examples"]} == {"few-s0-e0"}


def test_an_option_a_task_does_not_take_is_refused_by_name(own_tasks):
    from kvedit.errors import InvalidInputError
    from kvedit.evals.tasks import MEMORY_TASKS

    with pytest.raises(InvalidInputError, match="task 'test-few' takes no questions"):
        TASKS["test-few"].examples(seed=0, questions=3)
    assert len(MEMORY_TASKS["test-few-facts"].examples(n_examples=1, size=None)) == 1
