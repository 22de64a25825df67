"""The learned scorer's fits (:mod:`kvedit.compress.scorers.fits`): sealed, found in order
(the file given, the user's fits, the shipped ones) and listed once per folder version (#65,
#66)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvedit
from kvedit.compress.scorers import fits
from kvedit.compress.scorers.fits import Fitted, fitted_for
from kvedit.compress.scorers.learned import Learned, entry_features
from kvedit.errors import CorruptCacheError
from kvedit.fingerprint import model_fingerprint


@pytest.fixture(scope="module")
def state(llama):
    model, tok = llama
    return kvedit.capture(model, tok, "Hello there, a text to size the features of a fit.")


def _fit(model, state, seed: int = 0, name: str = "tiny") -> Fitted:
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for i in state.global_layers:
        f = entry_features(state, i).shape[1]
        kv = state.layers[i].kv_shape[1]
        layers[i] = (
            torch.zeros(f),
            torch.ones(f),
            torch.randn(f, kv, generator=g),
            torch.zeros(kv),
        )
    return Fitted(layers, {"model": model_fingerprint(model), "model_name": name})


def _header(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8 : 8 + n])


def _rewrite_meta(path: Path, change) -> None:
    """Rewrite the fit's JSON metadata in place (the same header length: padded)."""
    data = path.read_bytes()
    n, header = _header(path)
    meta = json.loads(header["__metadata__"]["kvedit"])
    change(meta)
    header["__metadata__"]["kvedit"] = json.dumps(meta, sort_keys=True)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text.ljust(n) + data[8 + n :])


def test_a_fit_is_sealed_and_a_changed_one_refused_by_name(llama, state, tmp_path):
    model, _ = llama
    fit = _fit(model, state)
    path = fit.save(tmp_path / "fit.safetensors")
    again = Fitted.load(path)
    assert again.meta["digest"] == again.digest == fit.digest and len(fit.digest) == 64
    assert Learned(path=str(path)).fit_digest(state) == fit.digest
    assert _fit(model, state, seed=1).digest != fit.digest

    # a map's bytes changed (the last float of the file: a bias), the metadata untouched
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    (tmp_path / "maps.safetensors").write_bytes(bytes(data))
    with pytest.raises(
        CorruptCacheError, match=r"maps\.safetensors: .* changed since it was sealed"
    ):
        Fitted.load(tmp_path / "maps.safetensors")

    # the metadata changed: another model named (a fit passed off as this model's)
    other = tmp_path / "meta.safetensors"
    other.write_bytes(path.read_bytes())
    _rewrite_meta(other, lambda m: m.update(model_name="tinx"))
    with pytest.raises(CorruptCacheError, match=r"meta\.safetensors: .* changed since it was"):
        Fitted.load(other)

    # the seal removed
    bare = tmp_path / "bare.safetensors"
    bare.write_bytes(path.read_bytes())
    _rewrite_meta(bare, lambda m: m.pop("digest"))
    with pytest.raises(CorruptCacheError, match=r"bare\.safetensors: .* without a seal"):
        Fitted.load(bare)


def test_the_shipped_fits_are_sealed():
    shipped = sorted(fits.FITTED_DIR.glob("*.safetensors"))
    assert shipped
    for path in shipped:
        fit = Fitted.load(path)
        assert fit.meta["digest"] == fit.digest


def test_the_users_fit_wins_over_the_shipped_one(llama, state, tmp_path, monkeypatch):
    """A refit written where ``kvedit memory fit-scorer`` writes (the user's fits) is the one
    ``learned`` uses, not the shipped fit for the same model; a given path wins over both."""
    model, _ = llama
    monkeypatch.setenv("KVEDIT_CACHE", str(tmp_path / "cache"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(fits, "FITTED_DIR", shipped)
    _fit(model, state, seed=0, name="shipped").save(shipped / "a.safetensors")
    assert fitted_for(model).meta["model_name"] == "shipped"
    user = fits.user_dir()
    assert user == tmp_path / "cache" / "scorers" and fits.fit_folders() == [user, shipped]
    user.mkdir(parents=True)
    _fit(model, state, seed=1, name="refit").save(user / "z.safetensors")
    assert fitted_for(model).meta["model_name"] == "refit"
    assert Learned().fit_digest(state) == Fitted.load(user / "z.safetensors").digest
    given = _fit(model, state, seed=2, name="given").save(tmp_path / "given.safetensors")
    assert fitted_for(model, given).meta["model_name"] == "given"


def test_the_fit_listing_is_kept_until_a_folder_changes(llama, state, tmp_path, monkeypatch):
    """Scoring messages lists the fit folders once, not at every message; a fit added to a
    folder (or the one found replaced) is seen at the next message."""
    model, _ = llama
    monkeypatch.setenv("KVEDIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fits, "FITTED_DIR", tmp_path / "none")  # no shipped fit here
    user = fits.user_dir()
    user.mkdir(parents=True)
    for i in range(5):  # fits of other models: each would be read and fingerprinted
        fit = _fit(model, state, seed=i)
        Fitted(fit.layers, {**fit.meta, "model": f"other-{i}"}).save(user / f"b{i}.safetensors")
    _fit(model, state, seed=9, name="mine").save(user / "m.safetensors")
    globs, loads = [], []
    real_glob, real_load = Path.glob, Fitted.load
    monkeypatch.setattr(Path, "glob", lambda self, p: globs.append(self) or real_glob(self, p))
    monkeypatch.setattr(Fitted, "load", classmethod(lambda c, p: loads.append(p) or real_load(p)))
    scorer = Learned()
    layers = list(state.global_layers)
    for _ in range(4):
        scorer.score_tokens(state, 0, 4, layers)
    assert len(globs) == 1 and len(loads) == 6  # one listing, each file read once
    assert fitted_for(model).meta["model_name"] == "mine"
    _fit(model, state, seed=3, name="newer").save(user / "a.safetensors")  # sorts first
    assert fitted_for(model).meta["model_name"] == "newer"
    assert len(globs) == 2
    _fit(model, state, seed=4, name="replaced").save(user / "a.safetensors")
    assert fitted_for(model).meta["model_name"] == "replaced"
