"""Every persisted record has one serializer: ``to_json()`` (a JSON-ready dict) and
``from_json(data)`` (the record it wrote), the same convention as
:class:`kvedit.provenance.History`.

Each kind goes through JSON text and back to an equal record, and a record as the files written
before this convention hold it (the literal dicts below) reads back and writes out the same
keys and values: the file formats did not change.
"""

from __future__ import annotations

import json
import re

import pytest

from kvedit.evals.schema import Example
from kvedit.memory.budget import Budget
from kvedit.memory.forgetting import Round
from kvedit.memory.records import Turn
from kvedit.memory.rendering import Message
from kvedit.store.records import EntryMeta

RECORDS = {
    "turn": Turn(2, "assistant", "4821.", 30, 41, "decoded", 3, 8, 1, "re-run", 4096),
    "round": Round(5, "learned", 900, 700, 0.25),
    "budget": Budget(None, 2**20, "kvzip", 8, ("locker", re.compile("code", re.I), (3, 9)), "head"),
    "budget keep=token": Budget(512, None, "learned", 16, (), "token"),
    "message": Message("user", "My locker code is 4821."),
    "entry": EntryMeta(
        "a" * 32, 40, "model-fp", "tok-fp", ("h1", "h2"), True, 1234, 1.5e9, None, True
    ),
    "example": Example("ex-1", "Read.", ("a doc", "b doc"), "\n", "Which?", ("b",), 1),
}

# As memory files (their attachment), store records (KEY.json) and example files (a JSONL line)
# held them before #58.
OLD_FILES = {
    "turn": (
        Turn,
        {
            "index": 0,
            "role": "user",
            "content": "hi",
            "start": 0,
            "end": 5,
            "source": "computed",
            "computed": 5,
            "kept": 0,
            "recomputed": 0,
            "note": "",
            "nbytes": 640,
        },
    ),
    "round": (
        Round,
        {"at_message": 3, "policy": "kvzip", "before": 120, "after": 96, "seconds": 0.5},
    ),
    "budget": (
        Budget,
        {
            "max_tokens": 512,
            "max_bytes": None,
            "forget": "learned",
            "recent_tokens": 16,
            "per_head": False,
            "protect": [{"text": "4821"}, {"pattern": "code \\d+", "flags": 34}, {"chars": [0, 9]}],
        },
    ),
    "message": (Message, {"role": "system", "content": "You are terse."}),
    "example": (
        Example,
        {
            "id": "nq-s0-q8-p0",
            "instruction": "Write a high-quality answer.",
            "documents": ["Document [1](Title: A) a", "Document [2](Title: B) b"],
            "separator": "\n",
            "question": "who?",
            "answers": ["b"],
            "gold_index": 1,
            "metric": "subspan_em",
        },
    ),
    "entry": (
        EntryMeta,
        {
            "format": "kvedit.store.entry",
            "key": "b" * 32,
            "n_tokens": 300,
            "model_fingerprint": "m",
            "tokenizer_fingerprint": "t",
            "chunk_hashes": ["h1"],
            "cuttable": False,
            "file_bytes": 99,
            "created": 1700000000.0,
            "expires": 1800000000.0,
            "pinned": False,
        },
    ),
}


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_a_record_goes_through_json_and_back_equal(kind: str):
    record = RECORDS[kind]
    text = json.dumps(record.to_json())
    assert type(record).from_json(json.loads(text)) == record


@pytest.mark.parametrize("kind", sorted(OLD_FILES))
def test_a_record_as_older_files_hold_it_reads_and_writes_the_same(kind: str):
    cls, held = OLD_FILES[kind]
    assert json.loads(json.dumps(cls.from_json(held).to_json())) == held


def test_the_store_record_is_written_as_before():
    """``KEY.json``: the record's ``to_json`` with sorted keys, byte for byte."""
    meta = OLD_FILES["entry"][0].from_json(OLD_FILES["entry"][1])
    assert json.dumps(meta.to_json(), sort_keys=True) == json.dumps(
        OLD_FILES["entry"][1], sort_keys=True
    )


@pytest.mark.parametrize("bad", [[1, 2], "text", None, 7, {"format": "other"}, {}])
def test_a_malformed_store_record_is_a_value_error(bad):
    with pytest.raises(ValueError):
        EntryMeta.from_json(bad)
