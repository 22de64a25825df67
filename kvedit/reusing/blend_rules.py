"""The selection and correction rules of :func:`kvedit.blend`, one keyword each.

:func:`~kvedit.reusing.blending.blend` selects tokens by their K/V deviation at one early layer and
recomputes them over every layer (CacheBlend's basic rule). These rules change what is
recomputed, or correct what is reused; each is off unless its keyword is given, and with none
given ``blend`` is exactly what it was. They compose: every combination is valid.

``gradual=g`` (:class:`Gradual`, CacheBlend's layer-wise gradual filtering)
    The deviation layer (and every layer before it) recomputes ``ceil(g * k)`` tokens chosen by
    deviation, ``k = ceil(recompute * n)`` being the default's count; every later layer keeps the
    tokens of the layer before that deviated most *there* (fresh entries against reused ones),
    their count falling geometrically to ``k`` at the last layer. A token dropped at layer ``l``
    keeps its reused entries from layer ``l`` on, and later queries see them, not its fresh ones.
    ``recompute`` is thus the fraction of the last layer. Cost: kvedit drives the model only
    through its public forward, so the first set runs through every layer and each layer keeps
    the fresh entries of its own set (a bias hides the others); the compute is that of the first
    set, CacheBlend's saving in the later layers needs a per-layer runner. On a model whose
    deviation layer is its last (a 2-layer model) there is nothing to narrow: no effect.
``leading=k`` (:class:`Leading`, EPIC's LegoLink)
    The first ``k`` tokens of every part after part 0 are recomputed, *in addition to* the
    ``ceil(recompute * n)`` tokens chosen by deviation among the others (and the last token,
    always recomputed when anything is). ``recompute=0, leading=k`` is EPIC's rule alone: no
    deviation pass, only the passages' leading tokens and the last one. Part 0 (the prefix) was
    cached in its real place and is never forced. With ``gradual`` they are kept at every layer.
``rescale=s`` (:class:`Rescale`, an APE-style rescaling)
    Every *reused* entry of a passage (parts after part 0; an entry of a token that was not
    recomputed at that layer) gets a stored bias of ``ln s`` nats, so every later query (the
    question, the answer) gives it ``s`` times the attention weight before normalisation; the
    last input is then recomputed over the biased cache (as :func:`kvedit.ops.emphasize` does)
    and the state's history records a ``rescale`` step (the factor, the nats, the tokens).
    Recomputed entries are a real prefill's and are left alone.

Exactness at ``recompute=1``: every token is recomputed at every layer, so ``gradual`` has
nothing to narrow, ``leading`` nothing to add, and ``rescale`` no reused entry to bias (its step
records no tokens): the state is a full prefill of the blended ids, with every rule on.

Keywords and their classes are registered in :data:`BLEND_RULES`; :class:`BlendRules` holds the
rules of one call and answers the orchestrator's questions (forced tokens, the selection and
its narrowing, the correction).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .. import checks
from ..cache import LayerKV
from ..errors import InvalidInputError, UnsupportedModelError
from ..provenance import Step, token_ranges
from ..registry import Registry

__all__ = [
    "BLEND_RULES",
    "BlendRules",
    "Gradual",
    "Leading",
    "Narrowing",
    "NarrowingPlan",
    "Rescale",
    "deviation_scores",
    "select_tokens",
]

HIDDEN = float(torch.finfo(torch.float32).min)
"""The bias that hides an entry from every query (the attention clamps it to its dtype's
lowest value, so a row that sees nothing else stays finite)."""


def deviation_scores(
    keys: torch.Tensor, values: torch.Tensor, true_keys: torch.Tensor, true_values: torch.Tensor
) -> torch.Tensor:
    """``[t]`` float32 normalised deviation of ``t`` entries from the true ones:
    ``|dK|^2 / mean |K|^2 + |dV|^2 / mean |V|^2`` over heads and dimensions (the means over the
    true entries). Every tensor is ``[batch, kv_heads, t, head_dim]``."""
    true_keys, true_values = true_keys.float(), true_values.float()
    dk = (keys.float() - true_keys).pow(2).sum(dim=(0, 1, 3))
    dv = (values.float() - true_values).pow(2).sum(dim=(0, 1, 3))
    k_norm = true_keys.pow(2).sum(dim=(0, 1, 3)).mean().clamp_min(1e-12)
    v_norm = true_values.pow(2).sum(dim=(0, 1, 3)).mean().clamp_min(1e-12)
    return dk / k_norm + dv / v_norm


def select_tokens(deviation: torch.Tensor, count: int, forced: torch.Tensor) -> torch.Tensor:
    """``LongTensor`` ascending: the ``forced`` tokens and the ``count`` others of largest
    ``deviation [n]`` (all the others if fewer)."""
    if forced.numel() == 0:
        return deviation.topk(count).indices.sort().values
    others = deviation.clone()
    others[forced] = -float("inf")
    top = others.topk(min(count, len(deviation) - len(forced))).indices
    return torch.cat([forced, top]).unique()


# -------------------------------------------------------------------- the rules

BLEND_RULES: Registry[type] = Registry("blend rule")
"""Keyword of :func:`kvedit.blend` -> the rule class its value builds (a
:class:`kvedit.registry.Registry`; each class registers under its ``keyword``)."""


def _register_rule(cls: type) -> type:
    """Class decorator: register a rule class under its ``keyword`` in :data:`BLEND_RULES`."""
    return BLEND_RULES.register(cls.keyword, cls)


@_register_rule
@dataclass(frozen=True)
class Gradual:
    """CacheBlend's gradual filtering: the deviation layer recomputes ``factor`` times the
    final count, later layers narrow it down (see the module doc). ``factor >= 1``."""

    factor: float
    keyword: ClassVar[str] = "gradual"

    def __post_init__(self) -> None:
        value = checks.real("gradual", self.factor)
        if value < 1:
            raise InvalidInputError(
                "gradual must be a number >= 1 (tokens recomputed at the deviation layer over "
                f"those of the last layer; None: off), not {self.factor!r}"
            )
        object.__setattr__(self, "factor", value)

    def first_count(self, count: int, n: int, deviation_layer: int, n_layers: int) -> int:
        """Tokens to choose by deviation at the deviation layer, for ``count`` at the last."""
        if deviation_layer >= n_layers - 1:
            return count  # no later layer to narrow in
        return min(n, math.ceil(self.factor * count))

    @staticmethod
    def layer_counts(first: int, last: int, deviation_layer: int, n_layers: int) -> list[int]:
        """Tokens recomputed at each layer: ``first`` up to the deviation layer, then falling
        geometrically to ``last`` at the last layer (never rising)."""
        counts = [first] * (deviation_layer + 1)
        span = n_layers - 1 - deviation_layer
        for step in range(1, span + 1):
            c = math.ceil(first * (last / first) ** (step / span) - 1e-9)
            counts.append(last if step == span else max(last, min(counts[-1], c)))
        return counts


@_register_rule
@dataclass(frozen=True)
class Leading:
    """EPIC's LegoLink: the first ``tokens`` tokens of every part after part 0 are always
    recomputed (in addition to the deviation budget). ``tokens >= 1``."""

    tokens: int
    keyword: ClassVar[str] = "leading"

    def __post_init__(self) -> None:
        value = checks.count("leading", self.tokens)
        if value < 1:
            raise InvalidInputError(
                "leading must be an int >= 1 (tokens recomputed at the start of every passage; "
                f"None: off), not {self.tokens!r}"
            )
        object.__setattr__(self, "tokens", value)

    def forced(self, starts: Sequence[int]) -> torch.Tensor:
        """``LongTensor`` ascending: the leading tokens of parts ``1..``; ``starts`` is each
        part's first token, then the blend's length."""
        runs = [
            torch.arange(a, min(a + self.tokens, b))
            for a, b in zip(starts[1:-1], starts[2:], strict=True)
        ]
        return torch.cat(runs) if runs else torch.empty(0, dtype=torch.long)


@_register_rule
@dataclass(frozen=True)
class Rescale:
    """APE-style rescaling: every reused entry of a passage gets ``ln(factor)`` nats of stored
    bias, so later queries weigh it ``factor`` times (see the module doc).
    ``0 < factor <= MAX_SCALE_FACTOR``."""

    factor: float
    keyword: ClassVar[str] = "rescale"

    def __post_init__(self) -> None:
        value = checks.real("rescale", self.factor)
        if not 0 < value <= checks.MAX_SCALE_FACTOR:
            raise InvalidInputError(
                f"rescale must be a factor in (0, {checks.MAX_SCALE_FACTOR:g}] (the attention "
                f"weight of reused passage entries is multiplied by it; None: off), "
                f"not {self.factor!r}"
            )
        object.__setattr__(self, "factor", value)

    @property
    def nats(self) -> float:
        return math.log(self.factor)

    def apply(
        self, layers: Sequence[LayerKV], recomputed: Sequence[torch.Tensor], first_passage: int
    ) -> tuple[list[LayerKV], torch.Tensor]:
        """``layers`` with ``ln(factor)`` added to the bias of every entry of a token
        ``>= first_passage`` that is not in ``recomputed[i]`` (``LongTensor``, layer ``i``'s
        recomputed tokens). Returns the layers and the tokens biased on some layer, ascending."""
        out, biased = [], []
        for layer, fresh in zip(layers, recomputed, strict=True):
            tokens = layer.token_index
            stale = (tokens >= first_passage) & ~torch.isin(tokens, fresh.to(tokens.device))
            if not bool(stale.any()):
                out.append(layer)
                continue
            bias = layer.dense_bias().clone()
            bias[:, :, stale.nonzero().flatten().to(bias.device)] += self.nats
            out.append(dataclasses.replace(layer, bias=bias))
            biased.append(tokens[stale])
        tokens = torch.cat(biased).unique() if biased else torch.empty(0, dtype=torch.long)
        return out, tokens.cpu()

    def step(self, tokens: torch.Tensor) -> Step:
        """The history step of a rescale that biased ``tokens`` (none at ``recompute=1``)."""
        params = {"factor": self.factor, "nats": self.nats, "tokens": token_ranges(tokens)}
        return Step("edit", "rescale", params)


# -------------------------------------------------------------------- gradual narrowing


@dataclass
class Narrowing:
    """What a gradual recompute keeps, layer by layer.

    Attributes:
        counts: tokens recomputed at each layer (the first is the whole selection).
        keep: ``BoolTensor[n]`` tokens kept at every layer (leading tokens, the last token).
        kept: filled by the recompute: each layer's recomputed tokens, ``LongTensor`` ascending.
    """

    counts: list[int]
    keep: torch.Tensor
    kept: list[torch.Tensor] = field(default_factory=list)

    def plan(self, layers: Sequence[LayerKV], cache, selected: torch.Tensor) -> NarrowingPlan:
        """The bias plan of a recompute of ``selected`` over ``layers`` in ``cache``."""
        return NarrowingPlan(self, layers, cache, selected)


class NarrowingPlan:
    """BiasPlan of a gradual recompute: ``selected`` (``LongTensor[s]``) run as one forward over
    ``layers`` (a ``DynamicCache`` ``cache`` of them, the fresh entries appended), each layer
    counting only the fresh entries of its own set.

    At layer ``l`` the set is the previous layer's, narrowed to ``counts[l]`` by the deviation
    of its tokens' fresh entries at layer ``l - 1`` from their reused ones (read from the cache,
    which holds them by then). The bias hides, for every query, the reused entries of the set's
    tokens and the fresh entries of the other selected tokens; the 4D mask lets every query see
    reused entries of every earlier token, and fresh ones of earlier selected tokens.
    """

    def __init__(
        self, narrowing: Narrowing, layers: Sequence[LayerKV], cache, selected: torch.Tensor
    ):
        self._narrowing = narrowing
        self._layers = layers
        self._cache = cache
        self._selected = selected
        self._keep = narrowing.keep[selected]
        self._n = len(narrowing.keep)
        self._active: list[torch.Tensor] = []  # per layer: BoolTensor[s] over selected
        narrowing.kept = []

    def key_bias(self, layer_idx: int, k_len: int, total_len: int) -> torch.Tensor:
        if layer_idx != len(self._active):
            raise UnsupportedModelError(
                f"gradual blend: layer {layer_idx} attended out of order "
                f"(expected layer {len(self._active)})"
            )
        layer = self._layers[layer_idx]
        m, s = len(layer), len(self._selected)
        if k_len != m + s:
            raise UnsupportedModelError(
                f"gradual blend: layer {layer_idx} attends to {k_len} entries, not {m} + {s}"
            )
        active = self._active[-1] if layer_idx else torch.ones(s, dtype=torch.bool)
        if layer_idx and self._narrowing.counts[layer_idx] < int(active.sum()):
            active = self._narrowed(layer_idx - 1, active, self._narrowing.counts[layer_idx])
        self._active.append(active)
        self._narrowing.kept.append(self._selected[active])
        recomputed = torch.zeros(self._n, dtype=torch.bool)
        recomputed[self._selected[active]] = True
        bias = torch.zeros(k_len, dtype=torch.float32)
        bias[:m][recomputed[layer.positions]] = HIDDEN  # stale entries of the set's tokens
        bias[m:][~active] = HIDDEN  # fresh entries of tokens no longer recomputed
        bias = bias[None, None].to(layer.device)
        if layer.bias is not None:
            bias = bias + torch.nn.functional.pad(layer.bias, (0, s))
        return bias

    def unbiased_queries(self, q_len: int, total_len: int) -> int:
        return 0

    def _narrowed(self, prev: int, active: torch.Tensor, count: int) -> torch.Tensor:
        """``active`` narrowed to ``count`` tokens by their deviation at layer ``prev``."""
        free = (active & ~self._keep).nonzero().flatten()  # indices into selected
        keep = max(0, count - int((active & self._keep).sum()))
        if keep >= len(free):
            return active
        layer = self._layers[prev]
        m = len(layer)
        entry_of = torch.full((self._n,), -1, dtype=torch.long)
        entry_of[layer.positions] = torch.arange(m)
        entries = entry_of[self._selected[free]]
        held = entries >= 0
        score = torch.full((len(free),), float("inf"))  # no reused entry: nothing to fall back on
        if bool(held.any()):
            keys, values = self._cache.layers[prev].keys, self._cache.layers[prev].values
            stale, fresh = entries[held].to(keys.device), (free[held] + m).to(keys.device)
            score[held] = deviation_scores(
                keys[:, :, stale], values[:, :, stale], keys[:, :, fresh], values[:, :, fresh]
            ).cpu()
        out = active & self._keep
        out[free[score.topk(keep).indices]] = True
        return out


# -------------------------------------------------------------------- one call's rules


@dataclass(frozen=True)
class BlendRules:
    """The rules of one :func:`kvedit.blend` call (None: off)."""

    gradual: Gradual | None = None
    leading: Leading | None = None
    rescale: Rescale | None = None

    @classmethod
    def from_values(cls, **values: Any) -> BlendRules:
        """The rules of ``blend``'s keywords (``gradual=2.0, leading=None, ...``); a None
        value is a rule left off. Raises InvalidInputError for an unknown keyword or a bad
        value."""
        unknown = sorted(set(values) - set(BLEND_RULES))
        if unknown:
            raise InvalidInputError(f"unknown blend rules {unknown}; known: {sorted(BLEND_RULES)}")
        return cls(**{k: BLEND_RULES[k](v) for k, v in values.items() if v is not None})

    @property
    def names(self) -> tuple[str, ...]:
        """The keywords of the rules that are on, in :data:`BLEND_RULES` order."""
        return tuple(k for k in BLEND_RULES if getattr(self, k) is not None)

    def forced_tokens(self, starts: Sequence[int]) -> torch.Tensor:
        """``LongTensor`` of the tokens recomputed whatever their deviation (``leading``)."""
        if self.leading is None:
            return torch.empty(0, dtype=torch.long)
        return self.leading.forced(starts)

    def selection(
        self,
        deviation: torch.Tensor,
        count: int,
        forced: torch.Tensor,
        deviation_layer: int | None,
        n_layers: int,
    ) -> tuple[torch.Tensor, Narrowing | None]:
        """``(selected, narrowing)``: the tokens to recompute (``forced`` and the ``count``
        others of largest ``deviation [n]``, widened by ``gradual``) and how a gradual
        recompute narrows them per layer (None: every layer recomputes them all)."""
        selected = select_tokens(deviation, count, forced)
        if self.gradual is None or deviation_layer is None:
            return selected, None
        n = len(deviation)
        first = self.gradual.first_count(count, n, deviation_layer, n_layers)
        wide = select_tokens(deviation, first, forced)
        if len(wide) == len(selected):
            return selected, None
        keep = torch.zeros(n, dtype=torch.bool)
        keep[forced] = True
        keep[-1] = True  # its logits start the continuation
        counts = self.gradual.layer_counts(len(wide), len(selected), deviation_layer, n_layers)
        return wide, Narrowing(counts, keep)

    def origin_params(self, recomputed_per_layer: Sequence[int]) -> dict[str, Any]:
        """What the blend's origin records of its rules: ``{"rules": {...}}``, or ``{}`` with
        none on (the origin of a blend without rules is what it always was)."""
        rules: dict[str, Any] = {}
        if self.gradual is not None:
            layers = list(recomputed_per_layer)
            rules["gradual"] = {"factor": self.gradual.factor, "layers": layers}
        if self.leading is not None:
            rules["leading"] = self.leading.tokens
        if self.rescale is not None:
            rules["rescale"] = self.rescale.factor
        return {"rules": rules} if rules else {}
