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
