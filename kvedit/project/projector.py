"""The :class:`Projector`: a fitted map from model A's KV caches to model B's, and applying it.

``projector(state_a, model_b, tok_b)`` builds B's state of ``state_a.text``: B tokenizes the
text, every B token with a counterpart in A gets projected K/V (:meth:`Projector.project_layers`),
and B computes its special tokens and the last ``own_last`` tokens itself on top of them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import checks
from ..cache import LayerKV
from ..errors import CacheMismatchError, InvalidInputError
from ..fingerprint import model_fingerprint, tokenizer_fingerprint
from ..provenance import History, Origin
from ..states.passes import run_model
from ..states.state import KVState, LastInput
from .align import align_tokens, special_token_mask
from .features import Features, rotate
from .fit import fit_fields
from .io import read_projector, write_projector
from .ridge import DEFAULT_LAMBDAS

__all__ = ["Projector"]


def _empty_layers(
    kv_shape: tuple[int, int],
    windows: Sequence[int | None],
    device: torch.device,
    dtype: torch.dtype,
) -> list[LayerKV]:
    """One empty layer per window, keys and values ``[1, kv_heads, 0, head_dim]``."""
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


@dataclass
class Projector:
    """A fitted map from model A's KV caches to model B's (see :mod:`kvedit.project`).

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
    _digest: str | None = field(default=None, repr=False, compare=False)

    # --------------------------------------------------------------------------- building

    @classmethod
    def fit(
        cls,
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
    ) -> Projector:
        """Fit a projector from ``model_a`` to ``model_b`` on calibration ``texts``.

        Both models read every text; every ``heldout_every``-th text is held out to choose the
        ridge strength (from ``lambdas``) per B layer, separately for keys and values, then the
        map is refitted on all texts. ``progress`` shows a tqdm bar. See
        :func:`kvedit.project.fit.fit_fields` for the details, ``info`` and errors
        (:class:`~kvedit.errors.InvalidInputError` for bad parameters or too little text).
        """
        return cls(
            **fit_fields(
                model_a,
                tok_a,
                model_b,
                tok_b,
                texts,
                depth_window=depth_window,
                heldout_every=heldout_every,
                lambdas=lambdas,
                progress=progress,
            )
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Projector:
        """Read a projector written by :meth:`save` (:func:`kvedit.project.io.read_projector`).

        Raises:
            CorruptCacheError: truncated, corrupted, not a projector file, or a pickle.
        """
        return cls(**read_projector(path))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the projector to one safetensors file (JSON metadata, CRC-32), atomically
        (:func:`kvedit.project.io.write_projector`); returns the path."""
        return write_projector(self, path)

    @property
    def digest(self) -> str:
        """A stable hex digest of the fitted map (weights, biases, layer groups, frequencies
        and the model pair); computed once per projector. A projected state's history names
        it, so states projected by different maps have different digests."""
        found = self._digest
        if found is None:
            h = hashlib.sha256()
            h.update(
                json.dumps(
                    [self.a_model, self.a_tokenizer, self.b_model, self.b_tokenizer, self.a_layers]
                ).encode()
            )
            for t in (*self.weights, *self.biases, self.a_inv_freq, self.b_inv_freq):
                t = t.detach().to("cpu").contiguous()
                h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
                h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            found = self._digest = h.hexdigest()[:32]
        return found

    # --------------------------------------------------------------------------- applying

    def check(
        self, state_a: KVState, model_b: PreTrainedModel, tok_b: PreTrainedTokenizerBase
    ) -> None:
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
        tfp_b = tokenizer_fingerprint(tok_b)
        if tfp_b != self.b_tokenizer:
            problems.append(
                f"tokenizer B has fingerprint {tfp_b}, not the projector's {self.b_tokenizer}"
            )
        if problems:
            raise CacheMismatchError(
                "this projector was fitted on another model pair: " + "; ".join(problems)
            )

    def _params(
        self, device: torch.device
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Weights, biases and B's frequencies on ``device`` (copied once per device)."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = (
                [w.to(device) for w in self.weights],
                [b.to(device) for b in self.biases],
                self.b_inv_freq.to(device),
            )
        return self._on_device[key]

    def project_layers(
        self,
        state_a: KVState,
        offsets_b: torch.Tensor,
        align: torch.Tensor,
        device: torch.device,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Projected B ``(keys, values)`` per B layer, each ``[1, kv_heads_b, n_b, head_dim_b]``
        (keys with B's RoPE at positions ``0..n_b-1``), for every B token.

        ``offsets_b [n_b, 2]`` are B's token ranges and ``align [n_b]`` the A token of each
        (:func:`~kvedit.project.align_tokens`); rows of tokens with ``align < 0`` are
        meaningless (B computes those tokens itself).
        """
        weights, biases, inv_b = self._params(device)
        needed = {a for group in self.a_layers for a in group}
        feats = Features(state_a.layers, state_a.offsets, self.a_inv_freq, needed)
        n_b = offsets_b.shape[0]
        h, d = self.b_kv_shape
        positions = torch.arange(n_b, device=device)
        out = []
        for layer_b, group in enumerate(self.a_layers):
            x = feats.gather(group, align.clamp_min(0)).to(device)
            y = x @ weights[layer_b] + biases[layer_b]
            keys = y[:, : h * d].reshape(n_b, h, d).permute(1, 0, 2)[None]
            values = y[:, h * d :].reshape(n_b, h, d).permute(1, 0, 2)[None]
            out.append((rotate(keys.contiguous(), positions, inv_b[layer_b]), values.contiguous()))
        return out

    @torch.no_grad()
    def __call__(
        self,
        state_a: KVState,
        model_b: PreTrainedModel,
        tok_b: PreTrainedTokenizerBase,
        *,
        own_last: int = 1,
    ) -> KVState:
        """A state of model B for ``state_a.text``, projected from A's cache.

        B tokenizes the text with its default special tokens. Every B token gets projected K/V,
        except B's special tokens and the last ``own_last`` tokens (at least 1), which B computes
        itself on top of the projected cache, in order; so ``last_logits`` are B's prediction
        after the projected prefix. A's attention biases (edits) are ignored; A's K/V are
        taken from each token's last entry. Sliding-window layers keep the entries B's own
        captured cache keeps. The state's history has a ``"projection"`` origin (A's model and
        tokenizer, A's state's digest, this projector's :attr:`digest`, ``own_last``): it is
        no capture, so :class:`~kvedit.KVStore` refuses it.

        Raises:
            CacheMismatchError: ``state_a`` is not from the projector's model A, or
                ``model_b``/``tok_b`` are not its model B.
            InvalidInputError: ``own_last`` < 1, or the text tokenizes to nothing in B.
        """
        own_last = checks.count("own_last", own_last, minimum=1)
        self.check(state_a, model_b, tok_b)
        text = state_a.text
        enc = tok_b(text, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        if not ids:
            raise InvalidInputError("the text tokenizes to nothing in model B's tokenizer")
        offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
        n = len(ids)
        align = align_tokens(offsets, state_a.offsets, special_token_mask(tok_b, ids))
        own = align < 0
        own[max(0, n - own_last) :] = True
        param = next(model_b.parameters())
        device, dtype = param.device, param.dtype
        projected = self.project_layers(state_a, offsets, align, device)
        layers, last_logits = self._fill(model_b, ids, own, projected, device, dtype)
        origin = Origin(
            "projection",
            {
                "source_model": self.a_model,
                "source_tokenizer": self.a_tokenizer,
                "source": state_a.digest,
                "projector": self.digest,
                "own_last": own_last,
                "dtype": dtype,
            },
        )
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
            history=History(origin),
            last_input=LastInput(n - 1, n - 1),
            model=model_b,
            tokenizer=tok_b,
        )

    def _fill(
        self,
        model_b: PreTrainedModel,
        ids: list[int],
        own: torch.Tensor,
        projected: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[list, torch.Tensor | None]:
        """B's layers for ``ids``, run by run: the tokens marked in ``own`` computed by B on top
        of what is held so far, the others appended from ``projected``; with the last logits B
        computed (``None`` if it computed none)."""
        layers = _empty_layers(self.b_kv_shape, self.b_windows, device, dtype)
        last_logits = None
        for start, stop in _runs(own):
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
        return layers, last_logits


def _runs(flags: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of equal values in the 1-d bool tensor ``flags``."""
    runs, start, n = [], 0, len(flags)
    while start < n:
        stop = start + 1
        while stop < n and bool(flags[stop]) == bool(flags[start]):
            stop += 1
        runs.append((start, stop))
        start = stop
    return runs
