"""Conversations from files (``kvedit eval memory --conversations FILE``, #70): the shipped
example, how turns become messages, every malformed file refused naming the file, the line and
the field, the scores, and a run through the CLI on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvedit.evals.conversation_files as cf
from kvedit.cli import main as cli_main
from kvedit.errors import InvalidExampleError
from kvedit.evals.conversation_scores import age_bin, exact_match, token_f1

EXAMPLE = Path(cf.__file__).parent / "data" / "example_conversation.json"


@pytest.fixture
def data() -> dict:
    return json.loads(EXAMPLE.read_text())


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def _line(path: Path, marker: str) -> int:
    """The line of the only line of ``path`` holding ``marker``."""
    lines = [k + 1 for k, text in enumerate(path.read_text().splitlines()) if marker in text]
    assert len(lines) == 1, (marker, lines)
    return lines[0]


# ------------------------------------------------------------------------ the example


def test_the_example_is_read_and_rendered_with_speakers_and_dates():
    (conv,) = cf.read_conversations(EXAMPLE)
    assert conv.id == "ines-tomas" and conv.speakers == ("Ines", "Tomas")
    assert len(conv.turns) == 30 and len({t.session for t in conv.turns}) == 3
    assert len(conv.questions) == 6 and all(q.evidence and q.category for q in conv.questions)
    (memory,) = cf.load_conversations(EXAMPLE)
    assert memory.messages[0][0] == "system" and len(memory.messages) == 31
    assert memory.messages[1] == (
        "user",
        "[2024-03-02] Ines: Tomas! I finally adopted a dog this morning. A grey whippet from "
        "the shelter on Carver Street.",
    )
    assert {role for role, _ in memory.messages[1:]} == {"user"}
    (alternate,) = cf.load_conversations(EXAMPLE, "alternate")
    roles = [role for role, _ in alternate.messages[1:]]
    assert roles[:2] == ["user", "assistant"]
    assert all(
        role == ("user" if t.speaker == "Ines" else "assistant")
        for role, t in zip(roles, conv.turns)
    )
    assert [m[1] for m in alternate.messages] == [m[1] for m in memory.messages]
    multi = memory.probes[4]  # evidence D1:1 and D2:2: the oldest is the first turn
    assert multi.where == 1 and multi.bucket == "early" and multi.age_turns == 29
    assert multi.category == "multi-hop" and multi.evidence == ("D1:1", "D2:2")
    assert memory.probes[3].bucket == "late" and memory.probes[3].age_turns == 8  # D3:2


def test_a_turns_own_date_a_default_id_one_conversation_alone_and_no_evidence(tmp_path, data):
    conv = data["conversations"][0]
    turn = conv["sessions"][1]["turns"][0]
    turn["date"] = "2024-03-17"
    del turn["id"]
    conv["questions"][1]["evidence"] = ["D2:1"]
    del conv["questions"][0]["evidence"], conv["id"], conv["system"]
    (memory,) = cf.load_conversations(_write(tmp_path, conv))
    assert memory.id == "conv-1"
    assert memory.messages[10] == ("user", "[2024-03-17] Tomas: How is Pebble settling in?")
    assert memory.probes[1].where == 10 and memory.probes[1].bucket == "middle"
    first = memory.probes[0]
    assert first.bucket is None and first.where is None and first.age_turns is None


def test_alternate_refuses_a_third_speaker_and_an_unknown_mode(tmp_path, data):
    conv = data["conversations"][0]
    conv["speakers"].append("Marta")
    path = _write(tmp_path, data)
    assert len(cf.load_conversations(path, "user")) == 1
    with pytest.raises(InvalidExampleError, match="3 speakers .*use --speakers user"):
        cf.load_conversations(path, "alternate")
    with pytest.raises(InvalidExampleError, match="one of user, alternate"):
        cf.load_conversations(path, "both")


# ---------------------------------------------------------------------- malformed files


def _turn(data, s=0, t=2):
    return data["conversations"][0]["sessions"][s]["turns"][t]


def _unknown_key(data):
    _turn(data)["spaker"] = "Ines"
    return '"spaker"', "conversations[0].sessions[0].turns[2].spaker: unknown key"


def _missing_text(data):
    del _turn(data)["text"]
    _turn(data)["id"] = "MISSING"
    return None, "conversations[0].sessions[0].turns[2].text: missing"  # the turn's line


def _speaker_not_listed(data):
    _turn(data)["speaker"] = "Inez"
    return '"Inez"', "turns[2].speaker: 'Inez' is not one of the speakers (Ines, Tomas)"


def _empty_text(data):
    _turn(data)["text"] = "  "
    return '"text": "  "', "turns[2].text: must be a non-empty text"


def _id_twice(data):
    _turn(data, 1, 3)["id"] = "D1:2"
    return '"id": "D1:2"\n', None


def _evidence_unknown(data):
    data["conversations"][0]["questions"][2]["evidence"] = ["D2:5", "D9:9"]
    return '"D9:9"', "questions[2].evidence[1]: 'D9:9' is no turn's id"


def _answers_not_a_list(data):
    data["conversations"][0]["questions"][0]["answers"] = "Pebble"
    return '"answers": "Pebble"', "questions[0].answers: must be a JSON array"


def _session_without_date(data):
    del data["conversations"][0]["sessions"][2]["date"]
    return None, "conversations[0].sessions[2].date: missing"


def _date_with_newline(data):
    data["conversations"][0]["sessions"][1]["date"] = "2024-03-16\nlater"
    return "2024-03-16\\nlater", "sessions[1].date: must be one line"


def _speaker_twice(data):
    data["conversations"][0]["speakers"] = ["Ines", "Ines"]
    return None, "conversations[0].speakers: a name is given twice"


def _conversation_not_an_object(data):
    data["conversations"].append(["a list"])
    return None, "conversations[1]: a conversation must be a JSON object"


BREAKS = [
    _unknown_key,
    _missing_text,
    _speaker_not_listed,
    _empty_text,
    _id_twice,
    _evidence_unknown,
    _answers_not_a_list,
    _session_without_date,
    _date_with_newline,
    _speaker_twice,
    _conversation_not_an_object,
]


@pytest.mark.parametrize("breaks", BREAKS, ids=[b.__name__.strip("_") for b in BREAKS])
def test_a_malformed_file_is_refused_naming_the_file_the_line_and_the_field(tmp_path, data, breaks):
    marker, says = breaks(data)
    path = _write(tmp_path, data)
    with pytest.raises(InvalidExampleError) as err:
        cf.read_conversations(path)
    message = str(err.value)
    if breaks is _id_twice:  # the second turn with that id: the line of its "id"
        lines = [k + 1 for k, t in enumerate(path.read_text().splitlines()) if '"D1:2"' in t]
        assert message.startswith(f"{path}:{lines[1]}: ") and "another turn's id" in message
        return
    if marker is not None:
        assert message.startswith(f"{path}:{_line(path, marker)}: "), message
    else:
        assert message.startswith(f"{path}:") and message.split(":")[1].isdigit(), message
    assert says in message


def test_the_line_of_an_object_lacking_a_field_is_the_objects(tmp_path, data):
    _missing_text(data)
    path = _write(tmp_path, data)
    with pytest.raises(InvalidExampleError) as err:
        cf.read_conversations(path)
    opens = _line(path, '"MISSING"') - 1  # the turn object opens on the line before its "id"
    assert str(err.value).startswith(f"{path}:{opens}: ")


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ('{"conversations": [\n  {"id": "a",\n  "id": "b"}\n]}', 2, "'id' is given twice"),
        ('{"conversations": [\n  1,\n  NaN\n]}', 3, "NaN is not a JSON number"),
        ('{"conversations": [\n  {"id": "a",}\n]}', 2, "not JSON"),
        ('{"conversations": []}\n\n{}', 3, "extra data"),
    ],
)
def test_json_errors_name_the_line(tmp_path, text, line, says):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidExampleError, match=says) as err:
        cf.read_conversations(path)
    assert str(err.value).startswith(f"{path}:{line}: ")


def test_not_utf8_missing_and_empty_files_are_refused(tmp_path):
    path = tmp_path / "latin.json"
    path.write_bytes(b'{"conversations": [\n"caf\xe9"]}')
    with pytest.raises(InvalidExampleError, match=r"latin.json:2: not UTF-8"):
        cf.read_conversations(path)
    with pytest.raises(InvalidExampleError, match="cannot read it"):
        cf.read_conversations(tmp_path / "none.json")
    (tmp_path / "empty.json").write_text('{"conversations": []}')
    with pytest.raises(InvalidExampleError, match="conversations: must not be empty"):
        cf.read_conversations(tmp_path / "empty.json")


@pytest.mark.parametrize(
    ("limit", "value", "says"),
    [
        ("turns", 25, "over the limit of 25 turns in a conversation"),
        ("turn_chars", 100, "over the limit of 100 (turn_chars)"),
        ("questions", 5, "6 items, over the limit of 5 questions"),
        ("file_bytes", 1000, "bytes, over the limit of 1,000 (file_bytes)"),
    ],
)
def test_limits_are_named(monkeypatch, limit, value, says):
    monkeypatch.setitem(cf.LIMITS, limit, value)
    with pytest.raises(InvalidExampleError, match=says.replace("(", r"\(").replace(")", r"\)")):
        cf.read_conversations(EXAMPLE)


# ------------------------------------------------------------------------------ scores


def test_exact_match_and_token_f1_normalise_as_squad():
    assert exact_match("The Pebble.", ["pebble"]) == 1.0
    assert exact_match("Pebble the dog", ["pebble"]) == 0.0
    assert token_f1("a grey whippet dog", ["grey whippet"]) == pytest.approx(0.8)
    assert token_f1("Lisbon", ["Porto", "Lisbon"]) == 1.0
    assert token_f1("", ["Lisbon"]) == 0.0 and token_f1("no", ["yes"]) == 0.0
    assert [age_bin(a) for a in (0, 300, 5000, 20000, None)] == [
        "<256",
        "256-1K",
        "4K-16K",
        "16K+",
        "no evidence",
    ]


# -------------------------------------------------------------------------------- CLI

RUN = ["eval", "memory", "--model", "tiny-llama", "--conversations", str(EXAMPLE)]
RUN += ["--max-new-tokens", "2", "--no-progress"]


def test_a_run_on_the_example_scores_by_category_and_age(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*RUN, "--methods", "reuse,window", "--budgets", "1.0,0.5", "--out", str(out)]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "by category" in printed and "single-hop" in printed and "by age" in printed
    data = json.loads((out / "results.json").read_text())
    assert data["task"] == "conversations"
    assert data["extra"]["conversations"] == str(EXAMPLE) and data["extra"]["speakers"] == "user"
    assert len(data["examples"]) == 3 * 6  # reuse, window@1 (as reuse), window@0.5
    r = data["examples"][4]
    assert r["category"] == "multi-hop" and r["evidence"] == ["D1:1", "D2:2"]
    assert r["age_turns"] == 29 and r["age_tokens"] > 0 and r["bucket"] == "early"
    assert r["age_tokens"] < r["full_entries"]
    ages = {x["question"]: x["age_tokens"] for x in data["examples"]}
    assert ages["What breed is the dog that chewed Ines's pottery bowl?"] > max(
        ages["How long did Tomas take to finish the half marathon?"], 0
    )
    window = data["methods"]["window"]["0.5"]
    assert set(window["by_category"]) == {"single-hop", "multi-hop", "temporal"}
    assert window["by_category"]["single-hop"]["n"] == 4
    assert sum(s["n"] for s in window["by_age"].values()) == 6
    assert 0 <= window["f1"] <= 1 and 0 <= window["em"] <= 1
    assert all(0 <= x["f1"] <= 1 for x in data["examples"])


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--task", "facts"], "takes no --task"),
        (["--seed", "3", "--size", "40"], "takes no --seed, --size"),
        (["--speakers", "alternate", "--conversations", "BAD"], "turns[2].spaker: unknown key"),
    ],
)
def test_refusals_exit_2_before_the_model_loads_and_write_nothing(
    tmp_path, data, no_model, capsys, extra, says
):
    _unknown_key(data)
    bad = _write(tmp_path, data)
    out = tmp_path / "out"
    extra = [str(bad) if e == "BAD" else e for e in extra]
    assert cli_main([*RUN, "--methods", "reuse", "--out", str(out), *extra]) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()


def test_speakers_without_conversations_is_refused(tmp_path, no_model, capsys):
    args = ["eval", "memory", "--model", "tiny-llama", "--speakers", "user"]
    assert cli_main([*args, "--out", str(tmp_path / "o")]) == 2
    assert "--speakers is for --conversations" in capsys.readouterr().err
