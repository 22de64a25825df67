"""``kvedit.store.lock.WriterLock``: one writer per file, the one refused told who holds it, a
lock left by a killed holder not blocking (#56)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvedit.store.lock import Holder, WriterLock

REPO = Path(__file__).resolve().parents[2]


def test_a_second_writer_is_refused_and_told_the_holder(tmp_path):
    path = tmp_path / "chat.kv.lock"
    first, second = WriterLock(path, "kvedit chat"), WriterLock(path, "kvedit chat")
    assert first.acquire() is None and first.held
    record = json.loads(path.read_text())
    assert record["pid"] == os.getpid() and record["what"] == "kvedit chat"
    holder = second.acquire()  # another descriptor: refused even in the same process
    assert isinstance(holder, Holder) and holder.pid == os.getpid() and not second.held
    assert str(holder).startswith(f"kvedit chat {os.getpid()}, since ")
    assert second.holder() == holder  # a look without taking it
    first.release()
    assert not path.exists()  # a released lock leaves no file
    assert second.holder() is None and not path.exists()  # looking makes none
    assert second.acquire() is None
    second.release()


def test_a_lock_left_by_a_killed_holder_does_not_block(tmp_path):
    path = tmp_path / "out" / ".lock"
    path.parent.mkdir()
    code = (
        "import sys, time\n"
        "from kvedit.store.lock import WriterLock\n"
        f"assert WriterLock({str(path)!r}, 'holder').acquire() is None\n"
        "print('held', flush=True)\n"
        "time.sleep(300)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout.readline() == "held\n"
        holder = WriterLock(path).acquire()
        assert holder is not None and holder.pid == child.pid and holder.what == "holder"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert json.loads(path.read_text())["pid"] == child.pid  # its file is left...
    lock = WriterLock(path, "next")
    assert lock.acquire() is None  # ...and does not block
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()


def test_a_holder_that_wrote_nothing_is_named_as_such(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text("not json")
    assert Holder.from_text(path.read_text()) == Holder()
    assert str(Holder()) == "another process (its lock file names no process)"
    assert Holder.from_text('{"pid": true, "host": 3}') == Holder()
    with WriterLock(path):  # a file nobody holds: taken
        assert json.loads(path.read_text())["pid"] == os.getpid()
