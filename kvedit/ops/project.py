"""Cross-model KV projection: turn model A's cache of a text into a cache for model B.

A :class:`Projector` is fitted once per model pair on calibration text and then maps any
:class:`~kvedit.KVState` of model A to a state for model B, without B reading the text:

* **Tokens** are aligned by characters: B tokenizes the state's text, and each B token takes A's
  K/V at the last A token that starts at or before the B token's last character (the A token
  that holds that character, when one does). B's special tokens (BOS, chat markers), which have
  no counterpart in A, are computed by B itself (at the start of the text that is exact: BOS
  sees nothing before it).
* **RoPE** is undone on A's keys (rotation by ``-position`` with A's per-layer frequencies), the
  map works on position-free keys, and B's RoPE is applied at B's positions.
* **The map** is one ridge regression per B layer, from A's keys and values (all KV heads,
  flattened) at the ``depth_window`` A layers nearest to the same relative depth, plus an
  indicator of A's first token (A's attention sink), to B's position-free keys and values. It
  is fitted from running sums ``XᵀX``, ``XᵀY`` (float64, on shifted data), so memory stays flat
  in the amount of text. Features are standardised; the ridge strength is chosen per layer,
  separately for keys and values, on held-out calibration text (every ``heldout_every``-th
  text), then the map is refitted on all text.
* **The last token(s)** (``own_last``, default 1) are run through B on top of the projected
  cache, so ``last_logits`` are B's honest prediction after the projected prefix, and the state
  continues exactly like a captured one. Sliding-window layers keep only their last
  ``window - 1`` entries, as B's own cache does.

A projector is stored as one safetensors file with JSON metadata (no pickles), written
atomically, and checks the fingerprints of both models and tokenizers: applying it to another
pair raises :class:`~kvedit.errors.CacheMismatchError`.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..compat import text_config
from ..errors import CacheMismatchError, CorruptCacheError
from ..fingerprint import model_fingerprint, tokenizer_fingerprint
from ..rope import layer_inv_freq
from ..runtime import layer_windows
from ..state import KVState, LayerKV, run_model

__all__ = ["Projector", "align_tokens", "depth_matched_layers"]

FORMAT = "kvedit.projector"
FORMAT_VERSION = 1

# Ridge strengths tried per layer, in units of a standardised feature's variance.
DEFAULT_LAMBDAS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)

# Rows buffered per B layer before they are folded into the running sums.
_FLUSH_ROWS = 1024


# ------------------------------------------------------------------------------- RoPE


def _stacked_inv_freq(model: PreTrainedModel) -> torch.Tensor:
    """``[n_layers, head_dim // 2]`` float32 RoPE inverse frequencies of each decoder layer, on
    CPU (:func:`kvedit.rope.layer_inv_freq`: Gemma-3's sliding and global layers differ)."""
    return torch.stack([f.to("cpu", torch.float32) for f in layer_inv_freq(model)])


def _rotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``rope(k, p + delta)`` from ``rope(k, p)`` (transformers' ``rotate_half`` convention).

    ``keys [B, H, S, D]`` float32, ``delta [S]``, ``inv_freq [D // 2]``.
    """
    half = keys.shape[-1] // 2
    angle = delta.to(keys.device, torch.float32)[:, None] * inv_freq.to(keys.device)[None, :]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = keys[..., :half], keys[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ------------------------------------------------------------------------------- alignment


def align_tokens(
    offsets_b: torch.Tensor,
    offsets_a: torch.Tensor,
    special_b: Sequence[bool] | None = None,
) -> torch.Tensor:
    """For each B token, the index of the A token whose K/V it takes (``LongTensor[n_b]``).

    B token ``j`` with character range ``[s, e)`` takes the last A token that starts at or
    before character ``e - 1`` (so the A token holding that character, or the nearest one
    before a gap). When several tokens cover exactly the same characters (byte-level pieces of
    one character), the ``r``-th such B token takes the ``r``-th such A token (the last one if
    A has fewer), so identical tokenizations align one to one. Zero-width tokens on either side
    (special tokens) and B tokens flagged in ``special_b`` get ``-1``: they have no counterpart.
    """
    oa = offsets_a.tolist()
    valid = [i for i, (s, e) in enumerate(oa) if e > s]
    starts = [oa[i][0] for i in valid]
    same_range: dict[tuple[int, int], list[int]] = {}
    for i in valid:
        same_range.setdefault((oa[i][0], oa[i][1]), []).append(i)
    seen: dict[tuple[int, int], int] = {}
    out = []
    for j, (s, e) in enumerate(offsets_b.tolist()):
        if e <= s or not valid or (special_b is not None and special_b[j]):
            out.append(-1)
            continue
        rank = seen.get((s, e), 0)
        seen[(s, e)] = rank + 1
        twins = same_range.get((s, e))
        if twins:
            out.append(twins[min(rank, len(twins) - 1)])
            continue
        k = bisect.bisect_right(starts, e - 1) - 1
        out.append(valid[max(k, 0)])
    return torch.tensor(out, dtype=torch.long)


def depth_matched_layers(n_a: int, n_b: int, width: int) -> list[list[int]]:
    """For each of ``n_b`` layers, the ``width`` layers of ``n_a`` nearest its relative depth."""
    width = max(1, min(width, n_a))
    out = []
    for layer in range(n_b):
        center = (layer + 0.5) * n_a / n_b - 0.5
        start = int(math.floor(center - (width - 1) / 2 + 0.5))
        start = min(max(start, 0), n_a - width)
        out.append(list(range(start, start + width)))
    return out


def _special_mask(tokenizer, ids: Sequence[int]) -> list[bool]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    return [int(i) in special for i in ids]


# ------------------------------------------------------------------------------- features


def _kv_rows(layer: LayerKV, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[n_entries, 2 * kv_heads * head_dim]``: position-free keys then values of each entry."""
    keys = _rotate(layer.keys.float(), -layer.positions, inv_freq)[0]  # [H, n, D]
    values = layer.values.float()[0]
    n = keys.shape[1]
    return torch.cat(
        [keys.permute(1, 0, 2).reshape(n, -1), values.permute(1, 0, 2).reshape(n, -1)], dim=1
    )


def _dense_rows(layer: LayerKV, inv_freq: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Per token of the text, the K/V row of its (last) entry in ``layer``; zeros if none."""
    rows = _kv_rows(layer, inv_freq)
    dense = rows.new_zeros(n_tokens, rows.shape[1])
    index = layer.token_index.to(rows.device)
    ok = (index >= 0) & (index < n_tokens)
    dense[index[ok]] = rows[ok]
    return dense


class _Features:
    """A's K/V of one text (``layers`` and token ``offsets``), gathered at aligned A tokens."""

    def __init__(
        self,
        layers: Sequence[LayerKV],
        offsets: torch.Tensor,
        inv_freq_a: torch.Tensor,
        needed: Iterable[int],
    ):
        n = offsets.shape[0]
        device = layers[0].keys.device
        self.rows = {a: _dense_rows(layers[a], inv_freq_a[a].to(device), n) for a in sorted(needed)}
        valid = (offsets[:, 1] > offsets[:, 0]).nonzero().flatten()
        self.first = int(valid[0]) if len(valid) else 0

    def gather(self, a_layers: Sequence[int], a_index: torch.Tensor) -> torch.Tensor:
        """``[m, d_in]``: the concatenated K/V of ``a_layers`` at A tokens ``a_index``, then the
        indicator of A's first token."""
        idx = a_index.to(next(iter(self.rows.values())).device)
        parts = [self.rows[a][idx] for a in a_layers]
        parts.append((idx == self.first).float()[:, None])
        return torch.cat(parts, dim=1)


_TOKENIZER_FP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tokenizer_fp(tokenizer) -> str:
    """:func:`~kvedit.fingerprint.tokenizer_fingerprint`, memoised per tokenizer object and
    vocabulary size (hashing a 262k-token vocabulary takes about a second)."""
    try:
        size, fp = _TOKENIZER_FP.get(tokenizer, (None, None))
    except TypeError:  # not weak-referenceable
        return tokenizer_fingerprint(tokenizer)
    if size != len(tokenizer):
        size, fp = len(tokenizer), tokenizer_fingerprint(tokenizer)
        _TOKENIZER_FP[tokenizer] = (size, fp)
    return fp


def _empty_layers(kv_shape, windows, device, dtype) -> list[LayerKV]:
    h, d = kv_shape
    return [
        LayerKV(
            keys=torch.zeros(1, h, 0, d, device=device, dtype=dtype),
            values=torch.zeros(1, h, 0, d, device=device, dtype=dtype),
            token_index=torch.zeros(0, dtype=torch.long),
            positions=torch.zeros(0, dtype=torch.long),
            window=window,
        )
        for window in windows
    ]


def _read(model: PreTrainedModel, tokenizer, text: str):
    """The model's cache of ``text`` (default special tokens) as ``(layers, ids, offsets,
    last_logits)``: :func:`~kvedit.capture` without hashing fingerprints."""
    enc = tokenizer(text, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if not ids:
        raise ValueError("the text tokenizes to nothing")
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
    cfg = text_config(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    param = next(model.parameters())
    layers = _empty_layers(
        (cfg.num_key_value_heads, head_dim), layer_windows(model), param.device, param.dtype
    )
    index = torch.arange(len(ids))
    logits, full_kv = run_model(
        model,
        layers,
        torch.tensor([ids], device=param.device),
        index[None].to(param.device),
        logits_to_keep=1,
    )
    layers = [
        layer.extended(k, v, index, index.clone())
        for layer, (k, v) in zip(layers, full_kv, strict=True)
    ]
    return layers, ids, offsets, logits[0, -1].float()


# ------------------------------------------------------------------------------- ridge sums


class _Sums:
    """Running sums of shifted rows: ``n``, ``Σx``, ``Σy``, ``XᵀX``, ``XᵀY``, ``Σy²`` (float64)."""

    def __init__(self, d_in: int, d_out: int):
        self.n = 0
        self.sx = torch.zeros(d_in, dtype=torch.float64)
        self.sy = torch.zeros(d_out, dtype=torch.float64)
        self.xx = torch.zeros(d_in, d_in, dtype=torch.float64)
        self.xy = torch.zeros(d_in, d_out, dtype=torch.float64)
        self.yy = torch.zeros(d_out, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.cpu(), y.cpu()
        self.n += x.shape[0]
        self.sx += x.sum(0, dtype=torch.float64)
        self.sy += y.sum(0, dtype=torch.float64)
        self.xx += (x.T @ x).double()
        self.xy += (x.T @ y).double()
        self.yy += (y.double() ** 2).sum(0)

    def __add__(self, other: _Sums) -> _Sums:
        out = _Sums(self.sx.numel(), self.sy.numel())
        out.n = self.n + other.n
        for name in ("sx", "sy", "xx", "xy", "yy"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def sse(self, w: torch.Tensor, b: torch.Tensor, cols: slice) -> torch.Tensor:
        """Sum of squared errors of ``x @ w + b`` as a prediction of the outputs ``cols``, per
        output, over the summed rows."""
        sy = self.sy[cols]
        return (
            self.yy[cols]
            - 2 * (w * self.xy[:, cols]).sum(0)
            - 2 * b * sy
            + (w * (self.xx @ w)).sum(0)
            + 2 * b * (self.sx @ w)
            + self.n * b**2
        )

    def sst(self, cols: slice) -> torch.Tensor:
        """Total sum of squares of the outputs ``cols`` around their mean, per output."""
        return self.yy[cols] - self.sy[cols] ** 2 / max(self.n, 1)


class _LayerFit:
    """Buffered rows and train / held-out sums of one B layer (data shifted by its first rows)."""

    def __init__(self):
        self.shift_x: torch.Tensor | None = None
        self.shift_y: torch.Tensor | None = None
        self.train: _Sums | None = None
        self.held: _Sums | None = None
        self.buffer: dict[bool, list[tuple[torch.Tensor, torch.Tensor]]] = {False: [], True: []}
        self.buffered = {False: 0, True: 0}

    def add(self, x: torch.Tensor, y: torch.Tensor, held: bool) -> None:
        self.buffer[held].append((x.cpu(), y.cpu()))
        self.buffered[held] += x.shape[0]
        if self.buffered[held] >= _FLUSH_ROWS:
            self.flush(held)

    def flush(self, held: bool) -> None:
        if not self.buffer[held]:
            return
        x = torch.cat([b[0] for b in self.buffer[held]])
        y = torch.cat([b[1] for b in self.buffer[held]])
        self.buffer[held], self.buffered[held] = [], 0
        if self.shift_x is None:
            self.shift_x, self.shift_y = x.mean(0), y.mean(0)
            self.train = _Sums(x.shape[1], y.shape[1])
            self.held = _Sums(x.shape[1], y.shape[1])
        sums = self.held if held else self.train
        sums.add(x - self.shift_x, y - self.shift_y)


def _ridge_basis(sums: _Sums):
    """Standardised covariance eigenbasis of ``sums``: what :func:`_ridge_weights` needs."""
    n = max(sums.n, 1)
    mx, my = sums.sx / n, sums.sy / n
    cxx = sums.xx / n - torch.outer(mx, mx)
    cxy = sums.xy / n - torch.outer(mx, my)
    var = cxx.diagonal().clamp_min(0)
    scale = torch.where(var > 1e-12 * var.max().clamp_min(1e-30), var.sqrt(), torch.ones_like(var))
    corr = cxx / torch.outer(scale, scale)
    evals, evecs = torch.linalg.eigh((corr + corr.T) / 2)
    proj = evecs.T @ (cxy / scale[:, None])
    return mx, my, scale, evals.clamp_min(0), evecs, proj


def _ridge_weights(basis, lam: float, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    mx, my, scale, evals, evecs, proj = basis
    w = evecs @ (proj[:, cols] / (evals + lam)[:, None]) / scale[:, None]
    return w, my[cols] - mx @ w


# ------------------------------------------------------------------------------- the projector


@dataclass
class Projector:
    """A fitted map from model A's KV caches to model B's (see the module docstring).

    Build one with :meth:`fit` or :meth:`load`; apply it with ``projector(state_a, model_b,
    tok_b)``.

    Attributes:
        weights, biases: per B layer, ``[d_in, 2 * kv_heads_b * head_dim_b]`` and ``[d_out]``
            float32; rows are A's position-free keys then values of ``a_layers[l]`` (KV heads
            flattened), then A's first-token indicator; columns B's keys then values.
        a_layers: per B layer, the A layers it reads.
        a_inv_freq, b_inv_freq: ``[n_layers, head_dim // 2]`` RoPE frequencies of A and B.
        a_kv_shape, b_kv_shape: ``(kv_heads, head_dim)`` of A and B.
        b_windows: B's sliding window per layer (None: global).
        a_model, a_tokenizer, b_model, b_tokenizer: fingerprints of the pair it was fitted on.
        info: fit diagnostics (ridge strengths and held-out R² per layer, token counts, time).
    """

    weights: list[torch.Tensor]
    biases: list[torch.Tensor]
    a_layers: list[list[int]]
    a_inv_freq: torch.Tensor
    b_inv_freq: torch.Tensor
    a_kv_shape: tuple[int, int]
    b_kv_shape: tuple[int, int]
    b_windows: list[int | None]
    a_model: str
    a_tokenizer: str
    b_model: str
    b_tokenizer: str
    info: dict = field(default_factory=dict)
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)

    # --------------------------------------------------------------------------- fitting

    @classmethod
    @torch.no_grad()
    def fit(
        cls,
        model_a: PreTrainedModel,
        tok_a,
        model_b: PreTrainedModel,
        tok_b,
        texts: Iterable[str],
        *,
        depth_window: int = 3,
        heldout_every: int = 10,
        lambdas: Sequence[float] = DEFAULT_LAMBDAS,
        progress: bool | Callable[[int], None] = False,
    ) -> Projector:
        """Fit a projector from ``model_a`` to ``model_b`` on calibration ``texts``.

        Both models read every text (with their tokenizers' default special tokens); every
        ``heldout_every``-th text is held out to choose the ridge strength (from ``lambdas``)
        per B layer, separately for keys and values, and the map is then refitted on all texts.

        Args:
            depth_window: how many A layers (nearest the same relative depth) each B layer
                reads.
            progress: True to print progress to stderr, or a callable given the texts done.

        Returns:
            The fitted :class:`Projector`; ``info`` holds held-out R² per layer.
        """
        t0 = time.perf_counter()
        windows_b = layer_windows(model_b)
        inv_a, inv_b = _stacked_inv_freq(model_a), _stacked_inv_freq(model_b)
        n_a, n_b = inv_a.shape[0], inv_b.shape[0]
        a_layers = depth_matched_layers(n_a, n_b, depth_window)
        needed = sorted({a for group in a_layers for a in group})
        fits = [_LayerFit() for _ in range(n_b)]
        a_shape = b_shape = None
        n_texts = n_tokens = 0
        for i, text in enumerate(texts):
            if not text:
                continue
            held = heldout_every > 0 and i % heldout_every == heldout_every - 1
            layers_a, _, offsets_a, _ = _read(model_a, tok_a, text)
            layers_b, ids_b, offsets_b, _ = _read(model_b, tok_b, text)
            a_shape = tuple(layers_a[0].keys.shape[1::2])
            b_shape = tuple(layers_b[0].keys.shape[1::2])
            align = align_tokens(offsets_b, offsets_a, _special_mask(tok_b, ids_b))
            feats = _Features(layers_a, offsets_a, inv_a, needed)
            for layer_b, (layer, group) in enumerate(zip(layers_b, a_layers, strict=True)):
                index = layer.token_index.cpu()
                ok = (index >= 0) & (align[index.clamp_min(0)] >= 0)
                if not bool(ok.any()):
                    continue
                x = feats.gather(group, align[index[ok]])
                y = _kv_rows(layer, inv_b[layer_b].to(layer.keys.device))[ok.to(layer.keys.device)]
                fits[layer_b].add(x.float(), y.float(), held)
            n_texts += 1
            n_tokens += len(ids_b)
            if progress is True and n_texts % 50 == 0:
                print(
                    f"  projector fit: {n_texts} texts, {n_tokens} B tokens, "
                    f"{time.perf_counter() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            elif callable(progress):
                progress(n_texts)
        if a_shape is None or b_shape is None:
            raise ValueError("Projector.fit: no calibration text")
        for f in fits:
            f.flush(False)
            f.flush(True)
            if f.train is None or f.train.n == 0:
                raise ValueError("Projector.fit: a B layer got no calibration tokens")
            if f.held.n == 0:
                raise ValueError(
                    "Projector.fit: no held-out text (give at least heldout_every texts)"
                )

        d_k = b_shape[0] * b_shape[1]
        weights, biases, info_layers = [], [], []
        for layer_b, f in enumerate(fits):
            basis = _ridge_basis(f.train)
            chosen, r2 = {}, {}
            for part, cols in (("keys", slice(0, d_k)), ("values", slice(d_k, 2 * d_k))):
                sst = float(f.held.sst(cols).sum())
                best = None
                for lam in lambdas:
                    w, b = _ridge_weights(basis, lam, cols)
                    sse = float(f.held.sse(w, b, cols).sum())
                    if best is None or sse < best[0]:
                        best = (sse, lam)
                chosen[part] = best[1]
                r2[part] = 1.0 - best[0] / max(sst, 1e-30)
            basis = _ridge_basis(f.train + f.held)
            w_k, b_k = _ridge_weights(basis, chosen["keys"], slice(0, d_k))
            w_v, b_v = _ridge_weights(basis, chosen["values"], slice(d_k, 2 * d_k))
            w = torch.cat([w_k, w_v], dim=1)
            b = torch.cat([b_k, b_v])
            # Undo the shift: y - sy = (x - sx) W + b  =>  y = x W + (b + sy - sx W).
            b = b + f.shift_y.double() - f.shift_x.double() @ w
            weights.append(w.float())
            biases.append(b.float())
            info_layers.append(
                {
                    "a_layers": a_layers[layer_b],
                    "lambda_keys": chosen["keys"],
                    "lambda_values": chosen["values"],
                    "heldout_r2_keys": r2["keys"],
                    "heldout_r2_values": r2["values"],
                    "train_rows": f.train.n,
                    "heldout_rows": f.held.n,
                }
            )
        info = {
            "texts": n_texts,
            "b_tokens": n_tokens,
            "depth_window": depth_window,
            "heldout_every": heldout_every,
            "lambdas": list(lambdas),
            "fit_seconds": time.perf_counter() - t0,
            "layers": info_layers,
            "a_name": getattr(model_a, "name_or_path", None),
            "b_name": getattr(model_b, "name_or_path", None),
        }
        return cls(
            weights=weights,
            biases=biases,
            a_layers=a_layers,
            a_inv_freq=inv_a,
            b_inv_freq=inv_b,
            a_kv_shape=(int(a_shape[0]), int(a_shape[1])),
            b_kv_shape=(int(b_shape[0]), int(b_shape[1])),
            b_windows=list(windows_b),
            a_model=model_fingerprint(model_a),
            a_tokenizer=_tokenizer_fp(tok_a),
            b_model=model_fingerprint(model_b),
            b_tokenizer=_tokenizer_fp(tok_b),
            info=info,
        )

    # --------------------------------------------------------------------------- applying

    def check(self, state_a: KVState, model_b: PreTrainedModel, tok_b) -> None:
        """Raise :class:`CacheMismatchError` unless ``state_a`` comes from this projector's
        model A (and tokenizer) and ``model_b``/``tok_b`` are its model B."""
        problems = []
        if state_a.model_fingerprint != self.a_model:
            problems.append(
                f"the state's model fingerprint {state_a.model_fingerprint} is not the "
                f"projector's model A {self.a_model}"
            )
        if state_a.tokenizer_fingerprint != self.a_tokenizer:
            problems.append(
                f"the state's tokenizer fingerprint {state_a.tokenizer_fingerprint} is not the "
                f"projector's tokenizer A {self.a_tokenizer}"
            )
        fp_b = model_fingerprint(model_b)
        if fp_b != self.b_model:
            problems.append(
                f"model B {getattr(model_b, 'name_or_path', '?')!r} has fingerprint {fp_b}, "
                f"not the projector's model B {self.b_model}"
            )
        tfp_b = _tokenizer_fp(tok_b)
        if tfp_b != self.b_tokenizer:
            problems.append(
                f"tokenizer B has fingerprint {tfp_b}, not the projector's {self.b_tokenizer}"
            )
        if problems:
            raise CacheMismatchError(
                "this projector was fitted on another model pair: " + "; ".join(problems)
            )

    def _params(self, device: torch.device):
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = (
                [w.to(device) for w in self.weights],
                [b.to(device) for b in self.biases],
                self.b_inv_freq.to(device),
            )
        return self._on_device[key]

    def project_layers(
        self, state_a: KVState, offsets_b: torch.Tensor, align: torch.Tensor, device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Projected B ``(keys, values)`` ``[1, kv_heads_b, n_b, head_dim_b]`` (post-RoPE at
        positions ``0..n_b-1``) for every B token; rows of tokens with ``align < 0`` are
        meaningless (B computes those tokens itself)."""
        weights, biases, inv_b = self._params(device)
        needed = {a for group in self.a_layers for a in group}
        feats = _Features(state_a.layers, state_a.offsets, self.a_inv_freq, needed)
        n_b = offsets_b.shape[0]
        h, d = self.b_kv_shape
        positions = torch.arange(n_b, device=device)
        out = []
        for layer_b, group in enumerate(self.a_layers):
            x = feats.gather(group, align.clamp_min(0)).to(device)
            y = x @ weights[layer_b] + biases[layer_b]
            keys = y[:, : h * d].reshape(n_b, h, d).permute(1, 0, 2)[None]
            values = y[:, h * d :].reshape(n_b, h, d).permute(1, 0, 2)[None]
            out.append((_rotate(keys.contiguous(), positions, inv_b[layer_b]), values.contiguous()))
        return out

    @torch.no_grad()
    def __call__(
        self, state_a: KVState, model_b: PreTrainedModel, tok_b, *, own_last: int = 1
    ) -> KVState:
        """A state of model B for ``state_a.text``, projected from A's cache.

        B tokenizes the text with its default special tokens. Every B token gets projected K/V,
        except B's special tokens and the last ``own_last`` tokens (at least 1), which B computes
        itself on top of the projected cache, in order; so ``last_logits`` are B's prediction
        after the projected prefix. A's attention biases (edits) are ignored; A's K/V are
        taken from each token's last entry.

        Raises:
            CacheMismatchError: ``state_a`` is not from the projector's model A, or
                ``model_b``/``tok_b`` are not its model B.
        """
        self.check(state_a, model_b, tok_b)
        if own_last < 1:
            raise ValueError("own_last must be >= 1 (B computes at least the last token)")
        text = state_a.text
        enc = tok_b(text, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        if not ids:
            raise ValueError("the text tokenizes to nothing in model B's tokenizer")
        offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
        n = len(ids)
        align = align_tokens(offsets, state_a.offsets, _special_mask(tok_b, ids))
        own = align < 0
        own[max(0, n - own_last) :] = True
        device = next(model_b.parameters()).device
        dtype = next(model_b.parameters()).dtype
        projected = self.project_layers(state_a, offsets, align, device)
        layers = _empty_layers(self.b_kv_shape, self.b_windows, device, dtype)
        last_logits = None
        start = 0
        while start < n:
            stop = start + 1
            while stop < n and bool(own[stop]) == bool(own[start]):
                stop += 1
            index = torch.arange(start, stop)
            if bool(own[start]):
                logits, full_kv = run_model(
                    model_b,
                    layers,
                    torch.tensor([ids[start:stop]], device=device),
                    index[None].to(device),
                    logits_to_keep=1,
                )
                layers = [
                    layer.extended(k, v, index, index.clone())
                    for layer, (k, v) in zip(layers, full_kv, strict=True)
                ]
                last_logits = logits[0, -1].float()
            else:
                layers = [
                    layer.append(
                        k[:, :, start:stop].to(dtype), v[:, :, start:stop].to(dtype), index, index
                    )
                    for layer, (k, v) in zip(layers, projected, strict=True)
                ]
            start = stop
        return KVState(
            layers=layers,
            token_ids=torch.tensor(ids, dtype=torch.long),
            offsets=offsets,
            text=text,
            position_ids=torch.arange(n),
            next_position=n,
            last_logits=last_logits,
            model_fingerprint=self.b_model,
            tokenizer_fingerprint=self.b_tokenizer,
            model=model_b,
            tokenizer=tok_b,
        )

    # --------------------------------------------------------------------------- storage

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "a_inv_freq": self.a_inv_freq.float().contiguous(),
            "b_inv_freq": self.b_inv_freq.float().contiguous(),
        }
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            out[f"layer.{i}.weight"] = w.float().cpu().contiguous()
            out[f"layer.{i}.bias"] = b.float().cpu().contiguous()
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write the projector to one safetensors file (JSON metadata, CRC-32), atomically."""
        from safetensors.torch import save_file

        from .. import __version__
        from ..storage import atomic_write, crc32_of

        tensors = self._tensors()
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kvedit_version": __version__,
            "a_model": self.a_model,
            "a_tokenizer": self.a_tokenizer,
            "b_model": self.b_model,
            "b_tokenizer": self.b_tokenizer,
            "a_layers": self.a_layers,
            "a_kv_shape": list(self.a_kv_shape),
            "b_kv_shape": list(self.b_kv_shape),
            "b_windows": self.b_windows,
            "info": self.info,
            "checksum": crc32_of(tensors),
        }
        header = {"kvedit": json.dumps(meta, ensure_ascii=False)}
        return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=header))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Projector:
        """Read a projector written by :meth:`save`.

        Raises:
            CorruptCacheError: truncated, corrupted, not a projector file, or a pickle.
        """
        from ..storage import read_verified

        meta, tensors = read_verified(path, FORMAT, FORMAT_VERSION, what="projector format")
        try:
            n = len(meta["a_layers"])
            return cls(
                weights=[tensors[f"layer.{i}.weight"] for i in range(n)],
                biases=[tensors[f"layer.{i}.bias"] for i in range(n)],
                a_layers=[list(map(int, g)) for g in meta["a_layers"]],
                a_inv_freq=tensors["a_inv_freq"],
                b_inv_freq=tensors["b_inv_freq"],
                a_kv_shape=tuple(meta["a_kv_shape"]),
                b_kv_shape=tuple(meta["b_kv_shape"]),
                b_windows=list(meta["b_windows"]),
                a_model=meta["a_model"],
                a_tokenizer=meta["a_tokenizer"],
                b_model=meta["b_model"],
                b_tokenizer=meta["b_tokenizer"],
                info=meta.get("info", {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCacheError(f"{path}: projector file lacks tensor or field {e}") from e
