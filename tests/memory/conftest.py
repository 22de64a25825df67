"""Fixtures of the memory tests: a learned scorer fit for the tiny models."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def learned_fit(tmp_path, monkeypatch):
    """``fit(model, tok)``: a random learned-scorer fit for the model, written where
    ``forget="learned"`` looks for the user's fits (``$KVEDIT_CACHE/scorers``); returns its
    path. The maps' values do not matter to what these tests check."""
    import kvedit
    from kvedit.compress.scorers.learned import USER_DIR, Fitted, entry_features
    from kvedit.fingerprint import model_fingerprint

    monkeypatch.setenv("KVEDIT_CACHE", str(tmp_path / "cache"))

    def fit(model, tok, seed: int = 0):
        state = kvedit.capture(model, tok, "Hello there, a text to size the features.")
        g = torch.Generator().manual_seed(seed)
        layers = {}
        for i in state.counted_layers:
            f = entry_features(state, i).shape[1]
            kv = state.layers[i].kv_shape[1]
            layers[i] = (
                torch.zeros(f),
                torch.ones(f),
                torch.randn(f, kv, generator=g) * 0.1,
                torch.zeros(kv),
            )
        meta = {"model": model_fingerprint(model), "model_name": "tiny"}
        folder = tmp_path / "cache" / USER_DIR
        folder.mkdir(parents=True, exist_ok=True)
        return Fitted(layers, meta).save(folder / f"tiny-{seed}.safetensors")

    return fit
