"""One writer per memory file in the library, as in the chat (#65): processes that each
``Memory.load`` the same version of a file, ``add`` a message and ``save`` at the same instant
never both succeed, so no saved message is lost: at most one save per loaded version (the check
of the version and the write hold the file's saving lock, :func:`kvedit.memory.files.saving_lock`).

Real processes, a tiny random model. ``python tests/memory/test_memory_writers.py ROUNDS`` runs
the measurement (the issue's target, met: 0 lost messages over 100 rounds of two processes)."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

WORKERS = 2


def _worker(name: str, path: str, rounds: int, barrier, results) -> None:
    """Each round: load the file (every worker the same version), add one message, wait for
    the others, then save at once; report ``(round, name, saved or the refusal's class)``."""
    import kvedit
    from kvedit.errors import KVEditError
    from kvedit.testing import tiny_model

    model, tok = tiny_model("llama")
    for r in range(rounds):
        barrier.wait()  # the last round's saves are done: every worker reads the same version
        mem = kvedit.Memory.load(path, model, tok)
        mem.add("user", f"{name} round {r}")
        barrier.wait()  # all loaded and added: save together
        try:
            mem.save(path)
            results.put((r, name, "saved"))
        except KVEditError as e:
            results.put((r, name, type(e).__name__))


def race(path: Path, rounds: int) -> tuple[list[str], list[tuple[int, str, str]]]:
    """Run :data:`WORKERS` processes for ``rounds`` rounds on the memory file ``path``;
    ``(the file's user messages at the end, every worker's result)``."""
    import kvedit
    from kvedit.testing import tiny_model

    model, tok = tiny_model("llama")
    kvedit.Memory(model, tok, system="You are terse.").save(path)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(f"w{i}", str(path), rounds, barrier, results))
        for i in range(WORKERS)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in range(rounds * WORKERS)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    final = kvedit.Memory.load(path, model, tok)
    return [m.content for m in final.messages if m.role == "user"], got


def lost(kept: list[str], results: list[tuple[int, str, str]]) -> list[str]:
    """The messages of saves that succeeded but are not in the file."""
    saved = [f"{name} round {r}" for r, name, outcome in results if outcome == "saved"]
    return [m for m in saved if m not in kept]


def test_two_processes_saving_one_loaded_version_never_both_succeed(tmp_path):
    rounds = 20
    kept, results = race(tmp_path / "m.kv", rounds)
    assert lost(kept, results) == []
    for r in range(rounds):  # exactly one save per round: the others told the file changed
        outcomes = sorted(outcome for rr, _, outcome in results if rr == r)
        assert outcomes == ["FileChangedError"] * (WORKERS - 1) + ["saved"], (r, outcomes)
    assert len(kept) == rounds
    assert not [p.name for p in tmp_path.iterdir() if p.name != "m.kv"]  # no lock left


if __name__ == "__main__":
    import tempfile

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    with tempfile.TemporaryDirectory() as d:
        kept, results = race(Path(d) / "m.kv", n)
    both = sum(
        1 for r in range(n) if sum(o == "saved" for rr, _, o in results if rr == r) == WORKERS
    )
    print(
        f"{n} rounds, {WORKERS} processes: {len(lost(kept, results))} lost messages, {both} rounds both saved"
    )
