"""Ridge regression from running sums, for one linear map per B layer.

Rows ``x [m, d_in]`` (features) and ``y [m, d_out]`` (targets) are folded into float64 sums
(:class:`RidgeSums`: ``n``, ``Σx``, ``Σy``, ``XᵀX``, ``XᵀY``, ``Σy²``), so memory stays flat in
the number of rows. :class:`LayerFit` buffers one layer's rows, shifts them by the mean of its
first batch (for precision), and keeps training and held-out sums apart. :func:`solve` picks the
ridge strength per output block (keys, values) on the held-out sums, refits on all rows, and
returns ``y ≈ x @ weight + bias`` in the original, unshifted coordinates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "DEFAULT_LAMBDAS",
    "FLUSH_ROWS",
    "LayerFit",
    "LayerMap",
    "RidgeBasis",
    "RidgeSums",
    "ridge_basis",
    "ridge_weights",
    "solve",
]

DEFAULT_LAMBDAS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
"""Ridge strengths tried per layer, in units of a standardised feature's variance."""

FLUSH_ROWS = 1024
"""Rows buffered per layer before they are folded into the running sums."""


class RidgeSums:
    """Running sums of rows ``x [m, d_in]``, ``y [m, d_out]``, in float64 on CPU:
    ``n``, ``sx [d_in]``, ``sy [d_out]``, ``xx [d_in, d_in]``, ``xy [d_in, d_out]``,
    ``yy [d_out]`` (per-output sums of squares)."""

    def __init__(self, d_in: int, d_out: int):
        self.n = 0
        self.sx = torch.zeros(d_in, dtype=torch.float64)
        self.sy = torch.zeros(d_out, dtype=torch.float64)
        self.xx = torch.zeros(d_in, d_in, dtype=torch.float64)
        self.xy = torch.zeros(d_in, d_out, dtype=torch.float64)
        self.yy = torch.zeros(d_out, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Fold rows ``x [m, d_in]``, ``y [m, d_out]`` into the sums."""
        x, y = x.cpu(), y.cpu()
        self.n += x.shape[0]
        self.sx += x.sum(0, dtype=torch.float64)
        self.sy += y.sum(0, dtype=torch.float64)
        self.xx += (x.T @ x).double()
        self.xy += (x.T @ y).double()
        self.yy += (y.double() ** 2).sum(0)

    def __add__(self, other: RidgeSums) -> RidgeSums:
        out = RidgeSums(self.sx.numel(), self.sy.numel())
        out.n = self.n + other.n
        for name in ("sx", "sy", "xx", "xy", "yy"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def sse(self, w: torch.Tensor, b: torch.Tensor, cols: slice) -> torch.Tensor:
        """``[len(cols)]``: sum of squared errors of ``x @ w + b`` (``w [d_in, k]``, ``b [k]``)
        as a prediction of the outputs ``cols``, per output, over the summed rows."""
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
        """``[len(cols)]``: total sum of squares of the outputs ``cols`` around their mean."""
        return self.yy[cols] - self.sy[cols] ** 2 / max(self.n, 1)


class LayerFit:
    """Buffered rows and training / held-out :class:`RidgeSums` of one layer.

    All rows are shifted by the means of the first flushed batch (``shift_x [d_in]``,
    ``shift_y [d_out]``), so the float64 sums do not lose the small variations around a large
    mean.
    """

    def __init__(self) -> None:
        self.shift_x: torch.Tensor | None = None
        self.shift_y: torch.Tensor | None = None
        self.train: RidgeSums | None = None
        self.held: RidgeSums | None = None
        self.buffer: dict[bool, list[tuple[torch.Tensor, torch.Tensor]]] = {False: [], True: []}
        self.buffered = {False: 0, True: 0}

    def add(self, x: torch.Tensor, y: torch.Tensor, held: bool) -> None:
        """Buffer rows ``x [m, d_in]``, ``y [m, d_out]`` for the held-out (``held``) or the
        training sums; flushed every :data:`FLUSH_ROWS` rows."""
        self.buffer[held].append((x.cpu(), y.cpu()))
        self.buffered[held] += x.shape[0]
        if self.buffered[held] >= FLUSH_ROWS:
            self.flush(held)

    def flush(self, held: bool) -> None:
        """Fold the buffered rows of one side into its sums."""
        if not self.buffer[held]:
            return
        x = torch.cat([b[0] for b in self.buffer[held]])
        y = torch.cat([b[1] for b in self.buffer[held]])
        self.buffer[held], self.buffered[held] = [], 0
        if self.shift_x is None:
            self.shift_x, self.shift_y = x.mean(0), y.mean(0)
            self.train = RidgeSums(x.shape[1], y.shape[1])
            self.held = RidgeSums(x.shape[1], y.shape[1])
        sums = self.held if held else self.train
        sums.add(x - self.shift_x, y - self.shift_y)


class RidgeBasis(NamedTuple):
    """The standardised covariance eigenbasis of some :class:`RidgeSums` (:func:`ridge_basis`)."""

    mean_x: torch.Tensor  # [d_in]
    mean_y: torch.Tensor  # [d_out]
    scale: torch.Tensor  # [d_in] standard deviation of each feature (1 where constant)
    evals: torch.Tensor  # [d_in] eigenvalues of the feature correlation matrix
    evecs: torch.Tensor  # [d_in, d_in] its eigenvectors (columns)
    proj: torch.Tensor  # [d_in, d_out] the standardised cross-covariance in that basis


def ridge_basis(sums: RidgeSums) -> RidgeBasis:
    """Decompose ``sums`` once, so that :func:`ridge_weights` is cheap for every strength."""
    n = max(sums.n, 1)
    mx, my = sums.sx / n, sums.sy / n
    cxx = sums.xx / n - torch.outer(mx, mx)
    cxy = sums.xy / n - torch.outer(mx, my)
    var = cxx.diagonal().clamp_min(0)
    scale = torch.where(var > 1e-12 * var.max().clamp_min(1e-30), var.sqrt(), torch.ones_like(var))
    corr = cxx / torch.outer(scale, scale)
    evals, evecs = torch.linalg.eigh((corr + corr.T) / 2)
    proj = evecs.T @ (cxy / scale[:, None])
    return RidgeBasis(mx, my, scale, evals.clamp_min(0), evecs, proj)


def ridge_weights(basis: RidgeBasis, lam: float, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w [d_in, k], b [k])`` of the ridge fit of the outputs ``cols`` with strength ``lam``
    (on standardised features), in the coordinates of the sums ``basis`` came from."""
    w = basis.evecs @ (basis.proj[:, cols] / (basis.evals + lam)[:, None]) / basis.scale[:, None]
    return w, basis.mean_y[cols] - basis.mean_x @ w


@dataclass
class LayerMap:
    """One layer's fitted map ``y ≈ x @ weight + bias`` and how it was chosen."""

    weight: torch.Tensor  # [d_in, d_out] float32
    bias: torch.Tensor  # [d_out] float32
    lambdas: dict[str, float]  # the chosen strength per output block
    heldout_r2: dict[str, float]  # held-out R² per output block at that strength


def solve(fit: LayerFit, lambdas: Sequence[float], blocks: dict[str, slice]) -> LayerMap:
    """Choose a strength from ``lambdas`` per output block by the held-out squared error of the
    map fitted on the training rows, then refit every block on all rows (training and held out)
    and undo the shift.

    ``blocks`` (``{"keys": slice(0, d_k), "values": slice(d_k, 2 * d_k)}``) must cover the
    outputs in column order; ``fit`` must hold flushed training and held-out rows.
    """
    basis = ridge_basis(fit.train)
    chosen, r2 = {}, {}
    for name, cols in blocks.items():
        sst = float(fit.held.sst(cols).sum())
        best_sse, best_lam = None, None
        for lam in lambdas:
            w, b = ridge_weights(basis, lam, cols)
            sse = float(fit.held.sse(w, b, cols).sum())
            if best_sse is None or sse < best_sse:
                best_sse, best_lam = sse, lam
        chosen[name] = best_lam
        r2[name] = 1.0 - best_sse / max(sst, 1e-30)
    basis = ridge_basis(fit.train + fit.held)
    parts = [ridge_weights(basis, chosen[name], cols) for name, cols in blocks.items()]
    w = torch.cat([p[0] for p in parts], dim=1)
    b = torch.cat([p[1] for p in parts])
    # Undo the shift: y - sy = (x - sx) W + b  =>  y = x W + (b + sy - sx W).
    b = b + fit.shift_y.double() - fit.shift_x.double() @ w
    return LayerMap(weight=w.float(), bias=b.float(), lambdas=chosen, heldout_r2=r2)
