"""``kvedit.atomic``: a symbolic link is written through (the link kept, its file replaced), and
what a killed writer left is swept at once when its process is gone from this machine, never
while it runs (#56)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvedit.atomic import (
    TEMP_MARKER,
    atomic_write,
    host_tag,
    is_temp_name,
    left_by_dead_writer,
    sweep_stale,
    temp_name,
)
from kvedit.errors import InvalidInputError


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _temps(folder: Path) -> list[str]:
    return [n for n in os.listdir(folder) if is_temp_name(n)]


@pytest.mark.parametrize("callback", [False, True], ids=["bytes", "callback"])
def test_a_link_is_written_through_and_stays_a_link(tmp_path, callback):
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    target = there / "memory.kv"
    target.write_bytes(b"old")
    link = here / "chat.kv"
    link.symlink_to(target)
    data = (lambda tmp: Path(tmp).write_bytes(b"new")) if callback else b"new"
    assert atomic_write(link, data) == link
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == b"new"
    assert _temps(here) == [] and _temps(there) == []


def test_a_dangling_link_gets_its_file_and_a_loop_is_refused(tmp_path):
    link = tmp_path / "chat.kv"
    link.symlink_to(tmp_path / "later.kv")
    atomic_write(link, b"first")
    assert link.is_symlink() and (tmp_path / "later.kv").read_bytes() == b"first"
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    with pytest.raises(InvalidInputError, match="symbolic link that loops"):
        atomic_write(a, b"x")
    assert a.is_symlink() and b.is_symlink()


def _leftover(path: Path, tail: str, age: float = 0.0) -> Path:
    made = path.with_name(f".{path.name}{TEMP_MARKER}{tail}")
    made.mkdir()
    (made / path.name).write_bytes(b"x" * 1000)  # a killed save's half-written file
    stamp = time.time() - age
    os.utime(made, (stamp, stamp))
    return made


def test_temporary_names_carry_the_pid_and_this_machine(tmp_path):
    name = temp_name(tmp_path / "s.kv").name
    assert name.startswith(f".s.kv{TEMP_MARKER}{os.getpid()}@{host_tag()}-")
    assert is_temp_name(name)


def test_a_dead_writers_leftover_is_swept_at_once_a_live_ones_never(tmp_path):
    path = tmp_path / "s.kv"
    dead = _leftover(path, f"{_dead_pid()}@{host_tag()}-{'a' * 16}")  # just now
    alive = _leftover(path, f"{os.getpid()}@{host_tag()}-{'b' * 16}")  # this process's
    elsewhere = _leftover(path, f"{_dead_pid()}@0badc0de-{'c' * 16}")  # another machine's
    old_elsewhere = _leftover(path, f"1@0badc0de-{'d' * 16}", age=7200)
    legacy = _leftover(path, f"{_dead_pid()}-{'e' * 16}")  # kvedit 0.2.x: no machine tag
    other_file = _leftover(tmp_path / "t.kv", f"{_dead_pid()}@{host_tag()}-{'f' * 16}")
    assert left_by_dead_writer(dead) and not left_by_dead_writer(alive)
    assert sweep_stale(path) == 2
    assert not dead.exists() and not old_elsewhere.exists()
    assert alive.exists() and elsewhere.exists() and legacy.exists() and other_file.exists()
    # past stale_seconds every other leftover goes, never a running writer's of this machine
    assert sweep_stale(path, stale_seconds=0) == 2
    assert alive.exists() and not elsewhere.exists() and not legacy.exists()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_pid_now_running_a_later_process_is_not_the_writer(tmp_path):
    """A leftover written before the process that now has its pid started: the writer died
    and its pid was given again."""
    path = tmp_path / "s.kv"
    recycled = _leftover(path, f"{os.getpid()}@{host_tag()}-{'a' * 16}", age=10**6)
    assert left_by_dead_writer(recycled)
    assert sweep_stale(path) == 1 and not recycled.exists()


def test_the_leftovers_of_a_link_are_swept_beside_its_file(tmp_path):
    (tmp_path / "there").mkdir()
    target = tmp_path / "there" / "memory.kv"
    link = tmp_path / "chat.kv"
    link.symlink_to(target)
    dead = _leftover(target, f"{_dead_pid()}@{host_tag()}-{'a' * 16}")
    assert sweep_stale(link) == 1 and not dead.exists()


def test_what_a_writer_killed_mid_write_left_is_swept_at_once(tmp_path):
    """kill -9 during a write leaves its temporary directory (safetensors' file half written
    in it); the next sweep removes it without waiting, the old file untouched."""
    path = tmp_path / "state.kv"
    path.write_bytes(b"the old file")
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from kvedit.atomic import atomic_write\n"
        "def write(tmp):\n"
        "    Path(tmp).write_bytes(b'x' * 100000)\n"
        "    print('written', flush=True)\n"
        "    time.sleep(300)\n"
        f"atomic_write({str(path)!r}, write)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    try:
        assert child.stdout.readline() == "written\n"
        (left,) = _temps(tmp_path)
        assert not left_by_dead_writer(tmp_path / left)  # its writer runs: never swept
        assert sweep_stale(path) == 0
    finally:
        child.kill()
        child.wait()
    assert left_by_dead_writer(tmp_path / left)
    assert sweep_stale(path) == 1
    assert _temps(tmp_path) == [] and path.read_bytes() == b"the old file"


def test_loading_a_state_file_sweeps_what_a_killed_save_of_it_left(tmp_path, llama):
    import kvedit

    model, tok = llama
    path = tmp_path / "s.kv"
    kvedit.capture(model, tok, "Hello there.").save(path)
    dead = _leftover(path, f"{_dead_pid()}@{host_tag()}-{'b' * 16}")
    kvedit.load_state(path, model, tok)
    assert not dead.exists()
