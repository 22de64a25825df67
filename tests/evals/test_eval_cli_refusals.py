"""``kvedit eval``: every refusal comes before the model loads (or, for a prompt too long, before
anything is written or answered), exits 2 with a message naming the problem, and writes
nothing: an earlier run's files are left as they were (#40)."""

from __future__ import annotations

import json
import os

import filelock
import pytest

from kvedit.cli import main as cli_main
from kvedit.evals import litm
from kvedit.store.lock import WriterLock

RUN = [
    "eval",
    "litm",
    "--model",
    "tiny-llama",
    "--n-docs",
    "4",
    "--positions",
    "0,3",
    "--trials",
    "1",
    "--max-new-tokens",
    "3",
    "--no-progress",
]


def _cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    status = cli_main([*RUN, *args])
    return status, capsys.readouterr().err


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the refusal must come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(litm, "load_model", refuse)


@pytest.fixture
def finished(tmp_path):
    """An --out holding a finished run: (folder, the text of its results.json)."""
    out = tmp_path / "done"
    assert cli_main([*RUN, "--methods", "none", "--out", str(out)]) == 0
    return out, (out / "results.json").read_text()


@pytest.fixture
def killed(tmp_path, monkeypatch):
    """An --out holding an interrupted run's partial files (killed before results.json)."""
    out = tmp_path / "killed"

    def kill(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(litm, "write_results", kill)
        assert cli_main([*RUN, "--methods", "none", "--out", str(out)]) == 130
    assert (out / "partial.jsonl").read_text().count("\n") == 2
    return out


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("methods", ["", ",", " , "])
def test_no_methods_is_refused_before_loading_and_keeps_the_results(
    methods, finished, no_model, capsys
):
    out, text = finished
    status, err = _cli(capsys, "--methods", methods, "--out", str(out), "--overwrite")
    assert status == 2 and "--methods names no method" in err
    assert (out / "results.json").read_text() == text
    assert not (out / "partial.jsonl").exists()


def test_a_method_named_twice_is_refused_before_loading(tmp_path, no_model, capsys):
    status, err = _cli(capsys, "--methods", "none,none", "--out", str(tmp_path / "out"))
    assert status == 2 and "--methods names 'none' twice" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args",
    [["--task", "nq", "--n-docs", "200"], ["--n-docs", "4", "--max-positions", "20"]],
    ids=["nq-200-docs", "max-positions-20"],
)
def test_a_prompt_too_long_is_refused_before_anything_is_written(args, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["eval", "litm", "--model", "tiny-llama", "--positions", "0", "--trials", "1"]
    assert cli_main([*argv, "--methods", "none", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "--max-positions" in err and "max_positions=" not in err
    assert not out.exists()


def test_an_out_holding_results_is_refused_unless_overwrite(finished, no_model, capsys):
    out, text = finished
    status, err = _cli(capsys, "--methods", "none", "--out", str(out))
    assert status == 2 and f"--out {out}: holds an earlier run's results.json" in err
    assert "--overwrite" in err and (out / "results.json").read_text() == text
    status, err = _cli(capsys, "--methods", "none", "--out", str(out), "--resume")
    assert status == 2 and "nothing to --resume" in err
    assert (out / "results.json").read_text() == text and not (out / "partial.jsonl").exists()


def test_overwrite_replaces_the_results_with_the_same_answers(finished, capsys):
    out, text = finished
    status, _ = _cli(capsys, "--methods", "none", "--out", str(out), "--overwrite")
    assert status == 0
    old = [r["prediction"] for r in json.loads(text)["examples"]]
    new = json.loads((out / "results.json").read_text())["examples"]
    assert [r["prediction"] for r in new] == old


def test_an_interrupted_run_is_refused_without_resume(killed, no_model, capsys):
    out = killed
    before = _snapshot(out)
    status, err = _cli(capsys, "--methods", "none", "--out", str(out))
    assert status == 2 and "partial.jsonl; pass --resume" in err
    assert _snapshot(out) == before


def test_an_out_that_is_a_file_is_refused(tmp_path, no_model, capsys):
    out = tmp_path / "file"
    out.write_text("mine")
    status, err = _cli(capsys, "--methods", "none", "--out", str(out))
    assert status == 2 and f"--out {out}: is a file, not a folder" in err
    assert out.read_text() == "mine"


def test_resume_drops_a_cut_last_line_with_a_warning(killed, capsys):
    out = killed
    partial = out / "partial.jsonl"
    first = partial.read_text().splitlines()[0]
    partial.write_text(first + "\n" + '{"id": "records-s0-t0-p3", "meth')  # killed mid-line
    status, err = _cli(capsys, "--methods", "none", "--out", str(out), "--resume")
    assert status == 0
    assert f"warning: --resume {partial}:2: the last line is cut" in err
    records = json.loads((out / "results.json").read_text())["examples"]
    assert len(records) == 2 and json.dumps(records[0]) == first
    assert not partial.exists()


def test_resume_refuses_a_bad_line_that_is_not_the_last(killed, no_model, capsys):
    out = killed
    partial = out / "partial.jsonl"
    lines = partial.read_text().splitlines()
    partial.write_text('{"id": "x", "met\n' + lines[1] + "\n")
    before = _snapshot(out)
    status, err = _cli(capsys, "--methods", "none", "--out", str(out), "--resume")
    assert status == 2 and f"--resume {partial}:1: bad JSON" in err
    assert _snapshot(out) == before


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]", '{"params": 3}'])
def test_resume_refuses_a_corrupt_settings_file(text, killed, no_model, capsys):
    out = killed
    (out / "partial.settings.json").write_text(text)
    before = _snapshot(out)
    status, err = _cli(capsys, "--methods", "none", "--out", str(out), "--resume")
    assert status == 2 and f"--resume {out / 'partial.settings.json'}" in err
    assert _snapshot(out) == before


def test_a_second_run_on_the_same_out_is_refused(killed, no_model, capsys):
    out = killed
    with filelock.FileLock(out / ".lock", thread_local=False, preserve_lock_file=True):
        before = _snapshot(out)  # another run, holding the folder
        status, err = _cli(capsys, "--methods", "none", "--out", str(out), "--resume")
        assert _snapshot(out) == before
    assert status == 2 and f"--out {out}: another kvedit eval run is writing there" in err


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"\x00\x01\x02binary", "bad JSON"),
        (b"", "the file is empty"),
        (b"just some words\n", ":1: bad JSON"),
        (b"[1, 2]", "expected a JSON object, not a list"),
        (b'{"model": "tiny-llama", "extra": {}}', "not a kvedit eval results.json"),
        (b'{"extra": {}, "examples": [{"method": "none"}]}', "examples[0]: a result record needs"),
        (b'{"extra": {}, "examples": [7]}', "examples[0]: a result record must be"),
    ],
    ids=["binary", "empty", "text", "list", "no-examples", "no-id", "not-a-record"],
)
def test_reuse_refuses_a_file_that_is_not_results(content, problem, tmp_path, no_model, capsys):
    bad = tmp_path / "old.json"
    bad.write_bytes(content)
    out = tmp_path / "out"
    status, err = _cli(capsys, "--methods", "none", "--out", str(out), "--reuse", str(bad))
    assert status == 2 and f"--reuse {bad}" in err and problem in err
    assert not out.exists()


def test_without_matplotlib_the_results_are_written_and_the_plot_skipped(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    out = tmp_path / "out"
    status, err = _cli(capsys, "--methods", "none", "--out", str(out))
    assert status == 0 and "curve.png not drawn" in err and "kvedit[plot]" in err
    assert (out / "results.json").exists() and not (out / "curve.png").exists()


PROJECT = ["eval", "project", "--a", "tiny-llama", "--b", "tiny-gemma3", "--no-progress"]


def test_eval_project_refuses_a_missing_projector_and_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [*PROJECT, "--projector", str(tmp_path / "missing"), "--out", str(out)]
    assert cli_main(argv) == 2
    assert f"--projector {tmp_path / 'missing'}: no such file" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--n-fit", "-5"], "--n-fit: must be in 1..2000, not -5"),
        (["--n-fit", "2650"], "--n-fit: must be in 1..2000"),
        (["--n-passages", "0"], "--n-passages: must be at least 2, not 0"),
        (["--prefix-fraction", "1.5"], "--prefix-fraction: must be between 0 and 1"),
        (["--own-last", "0"], "--own-last: must be at least 1"),
    ],
)
def test_eval_project_refuses_out_of_range_counts(args, problem, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main([*PROJECT, *args, "--out", str(out)]) == 2
    assert problem in capsys.readouterr().err
    assert not out.exists()


def test_eval_project_refuses_an_out_holding_results(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")
    assert cli_main([*PROJECT, "--out", str(out)]) == 2
    assert f"--out {out}: holds an earlier run's results.json" in capsys.readouterr().err
    assert _snapshot(out) == {"results.json": b"{}"}


@pytest.mark.parametrize("command", [["eval", "litm", "--methods", "none"], ["demo"]])
def test_an_empty_out_is_refused(command, tmp_path, monkeypatch, no_model, capsys):
    monkeypatch.chdir(tmp_path)  # an empty --out would write (the demo: replace) here
    assert cli_main([*command, "--model", "tiny-llama", "--out", ""]) == 2
    name = " ".join(["kvedit", *command[:2]]) if command[0] == "eval" else "kvedit demo"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{name}: error: --out is empty: name the folder the results go to"
    )
    assert os.listdir(tmp_path) == []


def test_a_second_run_on_a_running_out_is_told_who_holds_it(killed, no_model, capsys):
    """A running run's folder holds its partial.jsonl: a second run is told another run holds
    the folder (which), not to --resume it."""
    out = killed
    with WriterLock(out / ".lock", "kvedit eval litm"):
        before = _snapshot(out)
        status, err = _cli(capsys, "--methods", "none", "--out", str(out))
        assert _snapshot(out) == before
    (line,) = err.splitlines()
    assert status == 2 and "--resume" not in line
    assert line.startswith(
        f"kvedit eval litm: error: --out {out}: another kvedit eval run is writing there "
        f"(kvedit eval litm {os.getpid()}, since "
    )
    assert not (out / ".lock").exists()  # the holder's lock file went with it
