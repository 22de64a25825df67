"""``benchmarks.kvpress_peer``: the parts that need no kvpress (the budget mapping, the export of
kvedit's conversations, the ids ``--keep`` appends, resuming, the score table). The kvpress
run itself needs ``.venv-kvpress`` (``make kvpress-setup``) and is not run here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import kvpress_peer as peer

REPO = Path(__file__).resolve().parents[2]


def test_a_budget_kept_is_the_ratio_kvpress_removes():
    assert peer.compression_ratio(0.25) == 0.75
    assert peer.compression_ratio(0.1) == 0.9
    assert peer.compression_ratio(1.0) == 0.0
    assert peer.parse_budgets("0.25, 0.1,0.25") == [0.25, 0.1]
    for bad in ("1", "0", "x", ""):
        with pytest.raises(SystemExit):
            peer.parse_budgets(bad)


def test_the_module_imports_neither_kvedit_nor_torch():
    # `run` executes in kvpress's venv, where kvedit is not installed
    code = (
        "import sys, benchmarks.kvpress_peer; print(sorted({'kvedit', 'torch'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("peer") / "conversations.json"
    args = ["export", "--model", "tiny-llama", "--n-examples", "1", "--size", "3"]
    assert peer.main([*args, "--questions", "3", "--seed", "1", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_export_holds_kvedits_rendering_of_the_conversation(exported):
    from kvedit.evals.memory_specs import build_conversations, full_entries
    from kvedit.memory.rendering import Message, renderer_for
    from kvedit.models import load_model

    (conv,) = build_conversations("nq-shared", 1, 1, 3, 3)
    _, tok = load_model("tiny-llama")
    renderer = renderer_for("chat", tok)
    (item,) = exported["conversations"]
    assert exported["format"] == peer.FORMAT and item["id"] == conv.id
    # the folder kvedit loads the model from, for `run` in kvpress's venv (a test model is
    # built in memory: none)
    assert exported["model_dir"] is None
    assert item["digest"] == conv.digest()
    assert item["full_entries"] == full_entries(renderer, conv) == len(item["context_ids"])
    messages = [Message(r, c) for r, c in conv.messages]
    for probe, got in zip(conv.probes, item["probes"], strict=True):
        asked = renderer.render([*messages, Message("user", probe.question)], True)
        assert item["context_ids"] + got["question_ids"] == asked.ids
        assert item["context_text"] + got["question_text"] == asked.text
        assert (got["bucket"], got["answers"]) == (probe.bucket, list(probe.answers))
    # what `run --keep` appends for the first question is the exported question
    chat = [{"role": r, "content": c} for r, c in conv.messages]
    asked = [*chat, {"role": "user", "content": conv.probes[0].question}]
    first = peer.tail_ids(tok, asked, item["context_text"], True)
    assert first == item["probes"][0]["question_ids"]


def _records(example: str, press: str, budget: float, right: list[bool]) -> list[dict]:
    buckets = ["early", "middle", "late"]
    return [
        {
            "id": f"{example}-q{k}",
            "example": example,
            "press": press,
            "budget": budget,
            "keep": False,
            "bucket": buckets[k % 3],
            "answers": ["Paris"],
            "prediction": "It is Paris." if ok else "London",
            "seconds": 1.0,
            "full_entries": 1000,
        }
        for k, ok in enumerate(right)
    ]


def test_export_takes_the_facts_task(tmp_path):
    from kvedit.evals.memory_specs import build_conversations

    out = tmp_path / "facts.json"
    args = ["export", "--task", "facts", "--model", "tiny-llama", "--n-examples", "1"]
    assert peer.main([*args, "--size", "40", "--questions", "3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (conv,) = build_conversations("facts", 1, 1, 40, 3)
    (item,) = data["conversations"]
    assert data["task"] == "facts" and item["id"] == conv.id and item["digest"] == conv.digest()
    assert [p["answers"] for p in item["probes"]] == [list(p.answers) for p in conv.probes]


def test_resume_keeps_whole_passes_only():
    done = _records("e0", "SnapKVPress", 0.25, [True] * 3)
    cut = _records("e1", "SnapKVPress", 0.25, [True] * 2)
    kept = peer.complete_groups(done + cut, {"e0": 3, "e1": 3})
    assert kept == done


def test_score_prints_kvedits_table_per_press_and_budget(tmp_path, capsys):
    records = _records("e0", "SnapKVPress", 0.25, [True, False, True])
    records += _records("e0", "KVzipPress", 0.1, [False, False, True])
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert peer.main(["score", str(path), "--json", str(tmp_path / "s.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    snap = next(line for line in lines if line.startswith("kvpress-SnapKVPress"))
    assert snap.split()[1:6] == ["0.25", "1.000", "0.000", "1.000", "0.667"]
    zipped = next(line for line in lines if line.startswith("kvpress-KVzipPress"))
    assert zipped.split()[1:6] == ["0.1", "0.000", "0.000", "1.000", "0.333"]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["kvpress-SnapKVPress"]["0.25"]["max_entries"] == 250


def test_score_adds_kvedit_runs_a_later_one_replacing_a_method(tmp_path, capsys):
    path = tmp_path / "records.jsonl"
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in _records("e0", "KVzipPress", 0.25, [True]))
    )

    def kvedit_run(name: str, correct: float) -> str:
        row = {
            "id": "e0-q0",
            "example": "e0",
            "digest": "d",
            "method": "reconstruct",
            "budget": 0.25,
            "bucket": "early",
            "correct": correct,
            "seconds": 1.0,
            "rounds": 2,
            "forget_seconds": 0.5,
            "max_entries": 250,
        }
        other = {**row, "id": "e9-q0", "example": "e9"}  # not in the kvpress records: left out
        folder = tmp_path / name
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps({"examples": [row, other]}))
        return str(folder)

    old, new = kvedit_run("old", 0.0), kvedit_run("new", 1.0)
    assert peer.main(["score", str(path), "--kvedit", old, new]) == 0
    lines = capsys.readouterr().out.splitlines()
    (row,) = [line for line in lines if line.startswith("reconstruct ")]
    assert row.split()[1:6] == ["0.25", "1.000", "-", "-", "1.000"] and row.split()[8] == "1"
