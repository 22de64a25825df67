"""``load_jsonl`` names the file and the line of what it cannot read."""

from __future__ import annotations

import gzip

import pytest

from kvedit.errors import InvalidExampleError
from kvedit.evals.jsonl import load_jsonl

GOOD_LINE = (
    '{"id": "a", "instruction": "Answer.", "documents": ["x"], "separator": "\\n", '
    '"question": "q?", "answers": ["x"], "gold_index": 0}\n'
)


@pytest.mark.parametrize(
    "name,data,message",
    [
        ("missing.jsonl", None, "no such file"),
        ("dir.jsonl", "dir", "is a directory"),
        ("binary.jsonl", b"ok\n\xff", ":2: not UTF-8"),
        ("empty.jsonl", b"", "no examples"),
        ("broken.jsonl", (GOOD_LINE + "{").encode(), ":2: bad JSON"),
        ("bad.jsonl.gz", b"nope", "not a complete gzip"),
        ("cut.jsonl.gz", gzip.compress(GOOD_LINE.encode())[:-6], "not a complete gzip"),
    ],
)
def test_load_jsonl_names_the_file_and_line(tmp_path, name, data, message):
    path = tmp_path / name
    if data == "dir":
        path.mkdir()
    elif data is not None:
        path.write_bytes(data)
    with pytest.raises(InvalidExampleError, match=message) as info:
        load_jsonl(path)
    assert str(path) in str(info.value)
