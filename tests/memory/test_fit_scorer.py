"""``kvedit memory fit-scorer``: a learned scorer's fit is made, written where
``forget="learned"`` finds it, and refused for another model."""

from __future__ import annotations

import pytest

import kvedit
from kvedit.cli.main import main
from kvedit.compress.scorers.learned import Fitted, Learned
from kvedit.errors import CacheMismatchError


def test_a_fit_is_made_found_and_refused_for_another_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVEDIT_CACHE", str(tmp_path / "cache"))
    status = main(["memory", "fit-scorer", "--model", "tiny-llama", "--facts", "2", "--nq", "0",
                   "--size", "40"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    assert "held-out R2" in out
    path = tmp_path / "cache" / "scorers" / "tiny-llama.safetensors"
    fit = Fitted.load(path)
    r2 = fit.meta["fit"]["held_out_r2"]
    assert 0.0 < r2 <= 1.0  # the maps predict held-out scores better than their mean
    assert fit.meta["fit"]["held_out"] and len(fit.meta["fit"]["transcripts"]) == 4
    model, tok = kvedit.load_model("tiny-llama")
    mem = kvedit.Memory(model, tok, system="Hi.", max_tokens=100)
    assert mem.budget.policy == "learned"  # the default, now that a fit exists
    for i in range(6):
        mem.add("user", f"My locker code is {4821 + i}, the river is calm.")
    assert mem.forgetting
    other, tok2 = kvedit.load_model("tiny-gemma3")
    with pytest.raises(CacheMismatchError, match="another model"):
        Learned(path=str(path)).score(kvedit.capture(other, tok2, "Hi."), [0])


def test_no_transcript_within_the_models_positions_is_refused_in_words(llama, monkeypatch):
    """Every transcript past the model's positions (a short-context model): fit_scorer says
    there is nothing to fit on (InvalidInputError), not a bare StopIteration."""
    from kvedit.errors import InvalidInputError
    from kvedit.evals import fitting

    monkeypatch.setattr(fitting, "REREAD_ROOM", 10**9)  # no transcript leaves room enough
    with pytest.raises(InvalidInputError, match="nothing to fit on"):
        fitting.fit_scorer(*llama, model_name="tiny", n_facts=2, n_nq=0, seeds=(0,), size=40)


# ------------------------------------------------------------------------------ refusals (#65)

FIT = ["memory", "fit-scorer", "--facts", "2", "--nq", "0"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--model", ""], "--model is empty: name a model (a bundled name or a path)"),
        (["--model", " "], "--model is empty: name a model (a bundled name or a path)"),
        (
            ["--model", "tiny-llama", "--out", ""],
            "--out is empty: name the fit's file (or leave --out out)",
        ),
        (
            ["--model", "tiny-llama", "--size", "3"],
            "--size must be an even number of messages in [40, 200], not 3",
        ),
        (
            ["--model", "tiny-llama", "--size", "41"],
            "--size must be an even number of messages in [40, 200], not 41",
        ),
        (["--model", "tiny-llama", "--nq", "-1"], "--nq must be 0 or more, not -1"),
    ],
)
def test_fit_scorer_refuses_bad_options_before_the_model_loads(
    tmp_path, monkeypatch, no_model, capsys, extra, says
):
    monkeypatch.setenv("KVEDIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main([*FIT, *extra]) == 2
    assert capsys.readouterr().err.splitlines() == [f"kvedit memory fit-scorer: error: {says}"]
    assert not (tmp_path / "cache" / "scorers").exists() or not any(
        (tmp_path / "cache" / "scorers").iterdir()
    )


def test_fit_scorer_refuses_an_out_under_a_file_before_any_work(
    tmp_path, monkeypatch, no_model, capsys
):
    """``--out afile/x`` ran the whole fit, then failed writing: now refused before the model
    loads, naming the file in the way; so is a folder given as the fit's file."""
    monkeypatch.setenv("KVEDIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "afile").write_text("x")
    for out, says in (
        (tmp_path / "afile" / "x", f"--out {tmp_path / 'afile' / 'x'}: {tmp_path / 'afile'} is a "),
        (tmp_path / "afile" / "d" / "x", f"{tmp_path / 'afile'} is a file, not a folder"),
        (tmp_path, f"--out {tmp_path} is a folder: give the fit's file"),
    ):
        assert main([*FIT, "--model", "tiny-llama", "--out", str(out)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("kvedit memory fit-scorer: error: ") and says in line
    assert (tmp_path / "afile").read_text() == "x"
