"""A load reads one version of a file: header and tensors through one open, so a writer that
atomically replaces the file meanwhile (another chat saving the same memory) cannot make it
read a mix of two versions and report a whole file corrupt."""

from __future__ import annotations

import builtins
import os

from conftest import RECORDS

import kvedit


class _ReplacedAfterFirstRead:
    """A file object whose file is replaced on disk (``os.replace(other, path)``, as an atomic
    writer does) right after its first read: whatever is read later through the same object
    must still be the version opened."""

    def __init__(self, f, other, path, done: list) -> None:
        self._f, self._other, self._path, self._done = f, other, path, done

    def read(self, *args):
        out = self._f.read(*args)
        if not self._done:
            os.replace(self._other, self._path)
            self._done.append(True)
        return out

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def test_a_file_replaced_while_it_is_read_loads_as_the_version_opened(llama, tmp_path, monkeypatch):
    model, tok = llama
    first = kvedit.capture(model, tok, RECORDS)
    second = kvedit.capture(model, tok, RECORDS + " Dave's secret number is 1234.")
    path, other = tmp_path / "s.kv", tmp_path / "other.kv"
    first.save(path)
    second.save(other)
    real_open, done = builtins.open, []

    def opening(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        if os.fspath(file) == os.fspath(path) and not done:
            return _ReplacedAfterFirstRead(f, other, path, done)
        return f

    monkeypatch.setattr(builtins, "open", opening)
    loaded = kvedit.load_state(path, model, tok)
    monkeypatch.undo()
    assert done  # the file was replaced after the first read
    assert loaded.text == first.text and loaded.digest == first.digest
    assert kvedit.load_state(path, model, tok).digest == second.digest  # the next load: new
