"""Fitting a :class:`~kvedit.project.Projector` from model A to model B on calibration text.

:func:`fit_fields` returns the projector's fields (``Projector(**fit_fields(...))``, which
:meth:`Projector.fit <kvedit.project.Projector.fit>` does), so this module does not import the
class and :mod:`.projector` can import this one.

Both models read every text (:func:`kvedit.capture`, the tokenizers' default special tokens).
Each B cache entry whose token has a counterpart in A gives one row: A's position-free K/V at
the depth-matched A layers (:class:`~kvedit.project.features.Features`) as features, B's
position-free K/V as targets. Rows go into one :class:`~kvedit.project.ridge.LayerFit` per B
layer; every ``heldout_every``-th text is held out to choose the ridge strengths
(:func:`~kvedit.project.ridge.solve`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import checks
from ..errors import InvalidInputError
from ..fingerprint import model_fingerprint, tokenizer_fingerprint
from ..runtime import layer_windows
from ..states.capturing import capture
from .align import align_tokens, depth_matched_layers, special_token_mask
from .features import Features, kv_rows, stacked_inv_freq
from .ridge import DEFAULT_LAMBDAS, LayerFit, solve

__all__ = ["fit_fields"]


def _check_lambdas(lambdas: Sequence[float]) -> tuple[float, ...]:
    if isinstance(lambdas, (str, bytes)) or not isinstance(lambdas, Iterable):
        raise InvalidInputError(f"lambdas must be a sequence of numbers, not {lambdas!r}")
    out = tuple(checks.real(f"lambdas[{i}]", lam) for i, lam in enumerate(lambdas))
    if not out:
        raise InvalidInputError("lambdas is empty: give at least one ridge strength")
    if min(out) <= 0:
        raise InvalidInputError(f"every ridge strength must be > 0, not {min(out)!r}")
    return out


@torch.no_grad()
def fit_fields(
    model_a: PreTrainedModel,
    tok_a: PreTrainedTokenizerBase,
    model_b: PreTrainedModel,
    tok_b: PreTrainedTokenizerBase,
    texts: Iterable[str],
    *,
    depth_window: int = 3,
    heldout_every: int = 10,
    lambdas: Sequence[float] = DEFAULT_LAMBDAS,
    progress: bool = False,
) -> dict[str, Any]:
    """Fit a projector from ``model_a`` to ``model_b`` on calibration ``texts``.

    Args:
        texts: calibration texts (empty ones are skipped); both models read each once.
        depth_window: how many A layers (nearest the same relative depth) each B layer reads.
        heldout_every: every ``heldout_every``-th text (>= 2) is held out to choose the ridge
            strength per B layer, separately for keys and values; the map is then refitted on
            all texts.
        lambdas: the ridge strengths tried (> 0, in units of a standardised feature's
            variance).
        progress: show a tqdm progress bar (texts read, B tokens) on stderr.

    Returns:
        The fitted :class:`~kvedit.project.Projector`'s fields (keyword arguments); ``info``
        holds the chosen strengths and held-out R² per B layer, token counts and the fit time.

    Raises:
        InvalidInputError: a bad parameter, no calibration text, no held-out text (fewer than
            ``heldout_every`` texts), or a B layer that got no calibration rows.
    """
    depth_window = checks.count("depth_window", depth_window, minimum=1)
    heldout_every = checks.count("heldout_every", heldout_every, minimum=2)
    lambdas = _check_lambdas(lambdas)
    t0 = time.perf_counter()
    windows_b = layer_windows(model_b)
    inv_a, inv_b = stacked_inv_freq(model_a), stacked_inv_freq(model_b)
    a_layers = depth_matched_layers(inv_a.shape[0], inv_b.shape[0], depth_window)
    fits, a_shape, b_shape, n_texts, n_tokens = _read_texts(
        model_a, tok_a, model_b, tok_b, texts, a_layers, inv_a, inv_b, heldout_every, progress
    )
    _check_fits(fits, a_shape, b_shape)

    d_k = b_shape[0] * b_shape[1]
    blocks = {"keys": slice(0, d_k), "values": slice(d_k, 2 * d_k)}
    maps = [solve(f, lambdas, blocks) for f in fits]
    info = {
        "texts": n_texts,
        "b_tokens": n_tokens,
        "depth_window": depth_window,
        "heldout_every": heldout_every,
        "lambdas": list(lambdas),
        "fit_seconds": time.perf_counter() - t0,
        "layers": [
            {
                "a_layers": group,
                "lambda_keys": m.lambdas["keys"],
                "lambda_values": m.lambdas["values"],
                "heldout_r2_keys": m.heldout_r2["keys"],
                "heldout_r2_values": m.heldout_r2["values"],
                "train_rows": f.train.n,
                "heldout_rows": f.held.n,
            }
            for group, m, f in zip(a_layers, maps, fits, strict=True)
        ],
        "a_name": getattr(model_a, "name_or_path", None),
        "b_name": getattr(model_b, "name_or_path", None),
    }
    return {
        "weights": [m.weight for m in maps],
        "biases": [m.bias for m in maps],
        "a_layers": a_layers,
        "a_inv_freq": inv_a,
        "b_inv_freq": inv_b,
        "a_kv_shape": (int(a_shape[0]), int(a_shape[1])),
        "b_kv_shape": (int(b_shape[0]), int(b_shape[1])),
        "b_windows": list(windows_b),
        "a_model": model_fingerprint(model_a),
        "a_tokenizer": tokenizer_fingerprint(tok_a),
        "b_model": model_fingerprint(model_b),
        "b_tokenizer": tokenizer_fingerprint(tok_b),
        "info": info,
    }


def _read_texts(
    model_a: PreTrainedModel,
    tok_a: PreTrainedTokenizerBase,
    model_b: PreTrainedModel,
    tok_b: PreTrainedTokenizerBase,
    texts: Iterable[str],
    a_layers: Sequence[Sequence[int]],
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    heldout_every: int,
    progress: bool,
) -> tuple[list[LayerFit], tuple | None, tuple | None, int, int]:
    """Both models read every non-empty text; each B layer's fit gets one row per B entry whose
    token has an A counterpart (features from A's ``a_layers`` group, B's K/V as targets),
    held out on every ``heldout_every``-th text.

    Returns ``(fits, a_shape, b_shape, n_texts, n_tokens)``: one fit per B layer, A's and B's
    ``(kv_heads, head_dim)`` (None when no text was read), the texts read and B's tokens.
    """
    needed = sorted({a for group in a_layers for a in group})
    fits = [LayerFit() for _ in a_layers]
    a_shape = b_shape = None
    n_texts = n_tokens = 0
    bar = tqdm(texts, desc="projector fit", unit="text", disable=not progress)
    for i, text in enumerate(bar):
        if not text:
            continue
        held = i % heldout_every == heldout_every - 1
        state_a = capture(model_a, tok_a, text)
        state_b = capture(model_b, tok_b, text)
        a_shape = tuple(state_a.layers[0].keys.shape[1::2])  # (kv_heads, head_dim)
        b_shape = tuple(state_b.layers[0].keys.shape[1::2])
        special = special_token_mask(tok_b, state_b.token_ids.tolist())
        align = align_tokens(state_b.offsets, state_a.offsets, special)
        feats = Features(state_a.layers, state_a.offsets, inv_a, needed)
        for layer_b, (layer, group) in enumerate(zip(state_b.layers, a_layers, strict=True)):
            index = layer.token_index.cpu()
            ok = (index >= 0) & (align[index.clamp_min(0)] >= 0)
            if not bool(ok.any()):
                continue
            x = feats.gather(group, align[index[ok]])
            y = kv_rows(layer, inv_b[layer_b].to(layer.keys.device))[ok.to(layer.keys.device)]
            fits[layer_b].add(x.float(), y.float(), held)
        n_texts += 1
        n_tokens += len(state_b)
        bar.set_postfix(b_tokens=n_tokens, refresh=False)
    bar.close()
    return fits, a_shape, b_shape, n_texts, n_tokens


def _check_fits(fits: Sequence[LayerFit], a_shape: tuple | None, b_shape: tuple | None) -> None:
    """Flush every fit; refuse a fit with no text read, a B layer with no training row, or no
    held-out row."""
    if a_shape is None or b_shape is None:
        raise InvalidInputError("Projector.fit: no calibration text")
    for f in fits:
        f.flush(False)
        f.flush(True)
        if f.train is None or f.train.n == 0:
            raise InvalidInputError("Projector.fit: a B layer got no calibration tokens")
        if f.held.n == 0:
            raise InvalidInputError(
                "Projector.fit: no held-out text (give at least heldout_every texts)"
            )
