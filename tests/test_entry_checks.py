"""Entry points check what they are given before any work: a clear error from
``kvedit.errors`` naming the argument, and nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import RECORDS

import kvedit
from kvedit import ops
from kvedit.cli import main as cli_main
from kvedit.errors import InvalidInputError, InvalidTypeError


@pytest.mark.parametrize("text", ["", None, b"abc"], ids=["empty", "none", "bytes"])
def test_reuse_refuses_a_text_that_is_not_a_non_empty_str(llama, tmp_path, text):
    model, tok = llama
    store = kvedit.KVStore(tmp_path)
    error = InvalidInputError if text == "" else InvalidTypeError
    with pytest.raises(error, match="text"):
        kvedit.reuse(model, tok, text, store)
    assert store.stats()["entries"] == 0


def test_reuse_refuses_a_store_that_is_not_one(llama):
    model, tok = llama
    with pytest.raises(InvalidTypeError, match="store must be a kvedit.KVStore"):
        kvedit.reuse(model, tok, RECORDS, {"not": "a store"})


def test_reread_refuses_a_separator_that_is_not_a_str(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    with pytest.raises(InvalidTypeError, match="separator"):
        ops.reread(state, "Bob", separator=5)


def test_reread_refuses_to_run_past_the_models_positions(llama, monkeypatch):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    monkeypatch.setattr(kvedit.checks, "MAX_POSITIONS", state.next_position + 2)
    with pytest.raises(InvalidInputError, match="re-read"):
        ops.reread(state, RECORDS[:60])


@pytest.mark.parametrize("flag", ["--question", "--focus"])
def test_publish_refuses_an_empty_question(tmp_path, capsys, flag):
    path = tmp_path / "context.txt"
    path.write_text("Some text.")
    args = ["publish", "--root", str(tmp_path / "pub"), "--context", str(path), flag, " "]
    assert cli_main(args) == 2
    assert f"{flag} is empty" in capsys.readouterr().err
    assert not (tmp_path / "pub").exists()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_save_sweeps_what_a_killed_save_of_the_same_file_left(llama, tmp_path):
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    dead = tmp_path / f".state.kv.kvedit-tmp-{_dead_pid()}-0123456789abcdef"
    dead.mkdir()
    (dead / "state.kv").write_bytes(b"half a file")
    alive = tmp_path / f".state.kv.kvedit-tmp-{os.getpid()}-fedcba9876543210"
    alive.mkdir()
    other = tmp_path / f".other.kv.kvedit-tmp-{_dead_pid()}-0123456789abcdef"
    other.mkdir()
    old = time.time() - 120
    for leftover in (dead, alive, other):
        os.utime(leftover, (old, old))
    state.save(tmp_path / "state.kv")
    assert not dead.exists()  # its writer is dead: swept
    assert alive.exists() and other.exists()  # a live writer's, another file's: kept
    assert kvedit.load_state(tmp_path / "state.kv", model, tok).is_plain_capture
