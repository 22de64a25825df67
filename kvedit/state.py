"""KVState: a captured KV cache with everything needed to edit it and continue from it.

``capture(model, tokenizer, text)`` runs the model over ``text`` once and keeps, per layer, the
keys and values ``[batch, kv_heads, seq, head_dim]`` (post-RoPE, exactly what the model cached),
which text token each cache entry encodes, its rotary position, and an additive attention bias
(zeros until an edit sets it). Continuing from a state (``generate``, ``logits``, ``extend``)
feeds the entries back through a plain ``DynamicCache`` and the kvedit attention, which applies
the stored bias and masks causally with bottom-right alignment, so edits that change the cache
length (duplication, re-reading) keep later positions right.

Sliding-window layers (Gemma-3) hold only their last ``window`` tokens (transformers keeps
``window - 1``; kvedit keeps one more so the last token can be recomputed exactly after an edit,
see :func:`recompute_last`); ``LayerKV.token_index`` says which ones, so edits touch only tokens
a layer holds. The attention masks the extra entry for every later query.

Edits reach the next token: every op ends with :func:`recompute_last`, which runs the last
token of the text again over the edited cache, so ``last_logits`` (the first continuation
token's prediction) and the last token's own entries reflect the edit.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, DynamicLayer, PreTrainedModel

from . import checks
from .cache import LayerKV
from .errors import (
    InvalidInputError,
    ModelNotAttachedError,
    StateAlteredError,
)
from .fingerprint import model_fingerprint, tokenizer_fingerprint
from .runtime import forward, layer_windows
from .spans import Spans, char_ranges, token_offsets, tokens_in_ranges
from .statefile import save_state


class StateBias:
    """BiasPlan for continuing from a state: stored bias on cached entries, zeros on new ones."""

    def __init__(self, layers: Sequence[LayerKV]):
        self._bias = [layer.bias for layer in layers]

    def key_bias(self, layer_idx: int, k_len: int, total_len: int) -> torch.Tensor | None:
        b = self._bias[layer_idx]
        if b is None:
            return None
        if k_len < b.shape[-1]:
            raise StateAlteredError("cache shorter than the stored bias: the state was altered")
        return torch.nn.functional.pad(b, (0, k_len - b.shape[-1]))

    def unbiased_queries(self, q_len: int, total_len: int) -> int:
        return 0


@dataclass(frozen=True)
class Answer:
    """A decoded continuation: ``text`` (special tokens skipped), the new ``token_ids``, the
    model's ``logprobs`` of each (one float per token, EOS excluded), and whether it
    ``finished`` at EOS (``False``: cut at the length limit)."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False

    def confidence(self, n: int | None = None) -> float:
        """Mean log-probability of the first ``n`` tokens (all by default); ``0.0`` when the
        answer is empty."""
        lps = self.logprobs if n is None else self.logprobs[:n]
        return sum(lps) / len(lps) if lps else 0.0


@dataclass(eq=False)
class KVState:
    """A captured KV cache of ``text`` plus what is needed to edit and continue from it.

    Attributes:
        layers: one :class:`LayerKV` per decoder layer.
        token_ids: ``[n_tokens]`` token ids of ``text`` (with the tokenizer's special tokens).
        offsets: ``[n_tokens, 2]`` character range of each token in ``text``.
        text: the captured text.
        position_ids: ``[n_tokens]`` rotary position of each token.
        next_position: the position the next token gets.
        last_logits: ``[vocab]`` logits after the last entry, the first continuation
            token's prediction.
        model_fingerprint, tokenizer_fingerprint: identify the model and tokenizer.
    """

    layers: list[LayerKV]
    token_ids: torch.Tensor
    offsets: torch.Tensor
    text: str
    position_ids: torch.Tensor
    next_position: int
    last_logits: torch.Tensor
    model_fingerprint: str
    tokenizer_fingerprint: str
    model: PreTrainedModel | None = field(default=None, repr=False, compare=False)
    tokenizer: object | None = field(default=None, repr=False, compare=False)

    # ---------------------------------------------------------------- basic properties

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def cache_length(self) -> int:
        """Number of KV entries of the global layers (edits such as duplication change it)."""
        global_layers = [len(layer) for layer in self.layers if layer.window is None]
        return max(global_layers or [len(layer) for layer in self.layers])

    @property
    def nbytes(self) -> int:
        """Bytes held by keys, values and biases (the sum of every layer's ``nbytes``)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def has_bias(self) -> bool:
        return any(layer.bias is not None for layer in self.layers)

    def replace(self, **changes) -> KVState:
        """A shallow copy with fields replaced (tensors are shared, never mutated)."""
        return dataclasses.replace(self, **changes)

    def copy(self) -> KVState:
        """A deep copy: no tensor is shared with ``self``."""
        return self.replace(
            layers=[layer.map(torch.clone) for layer in self.layers],
            token_ids=self.token_ids.clone(),
            offsets=self.offsets.clone(),
            position_ids=self.position_ids.clone(),
            last_logits=self.last_logits.clone(),
        )

    def to(self, device: torch.device | str) -> KVState:
        """A copy on ``device`` (token metadata stays on CPU)."""
        return self.replace(
            layers=[
                dataclasses.replace(
                    layer,
                    keys=layer.keys.to(device),
                    values=layer.values.to(device),
                    bias=None if layer.bias is None else layer.bias.to(device),
                )
                for layer in self.layers
            ],
            last_logits=self.last_logits.to(device),
        )

    def token_indices(self, spans: Spans) -> torch.Tensor:
        """Indices of the tokens of ``text`` that overlap ``spans`` (``LongTensor[k]``, sorted).

        A span is a substring (every occurrence), a compiled regex (every match) or a
        ``(start, end)`` character range; ``spans`` is one span or a list. Raises
        :class:`~kvedit.errors.SpanNotFoundError` when a span is not in the text.
        """
        return tokens_in_ranges(self.offsets, char_ranges(self.text, spans))

    # ---------------------------------------------------------------- continuing

    def require_model(self) -> tuple[PreTrainedModel, object]:
        """``(model, tokenizer)`` attached to this state; raises ModelNotAttachedError if none."""
        if self.model is None or self.tokenizer is None:
            raise ModelNotAttachedError(
                "this state has no model attached; use load_state(path, model, tok)"
            )
        return self.model, self.tokenizer

    def checked_model(self) -> tuple[PreTrainedModel, object]:
        """The attached model and tokenizer, after checking the state fits them (fingerprints
        and cache shapes; cheap: the fingerprints are memoized)."""
        model, tok = self.require_model()
        checks.state_fits_model(self, model, tok)
        return model, tok

    def encode(self, text: str, name: str = "continuation") -> list[int]:
        """Token ids of ``text`` (a continuation: no special tokens added)."""
        text = checks.text(name, text)
        _, tok = self.require_model()
        return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def run(self, ids: Sequence[int], logits_to_keep: int = 0):
        """Run ``ids`` on top of the state. Returns ``(logits [n|keep, vocab], new K/V per layer)``."""
        model, _ = self.checked_model()
        n = len(ids)
        device = self.device
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        positions = torch.arange(self.next_position, self.next_position + n, device=device)[None]
        logits, full_kv = run_model(model, self.layers, input_ids, positions, logits_to_keep)
        return logits[0], full_kv

    def logits(self, continuation: str) -> torch.Tensor:
        """``[n_tokens, vocab]``: row i is the distribution over continuation token i.

        Row 0 is the stored last logits; row i > 0 is the model's prediction after the state and
        continuation tokens ``< i``. The continuation is tokenized without special tokens.
        """
        ids = self.encode(continuation)
        if not ids:
            return self.last_logits[None, :0].new_zeros(0, self.last_logits.shape[-1])
        rows = [self.last_logits.float()[None]]
        if len(ids) > 1:
            logits, _ = self.run(ids[:-1])
            rows.append(logits.float())
        return torch.cat(rows, dim=0)

    @torch.no_grad()
    def token_logprobs(self, continuation: str, token_ids: Sequence[int]) -> list[float]:
        """The log-probability of each of ``token_ids`` when they follow the state and
        ``continuation``: how likely the model finds a given answer (e.g. another state's
        :class:`Answer`). One forward pass over ``continuation`` and the tokens."""
        prompt = self.encode(continuation)
        vocab = self.last_logits.shape[-1]
        token_ids = [checks.count("token id", t, maximum=vocab - 1) for t in token_ids]
        if not token_ids:
            return []
        ids = prompt + token_ids[:-1]
        rows = [self.last_logits.float()[None]] if not prompt else []
        if ids:
            logits, _ = self.run(ids, logits_to_keep=len(token_ids) - (0 if prompt else 1))
            rows.append(logits.float())
        logp = torch.cat(rows, dim=0)[-len(token_ids) :].log_softmax(-1)
        return logp[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()

    @torch.no_grad()
    def generate(
        self,
        continuation: str = "",
        max_new_tokens: int = 32,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> str:
        """Continue from the state with ``continuation`` and decode up to ``max_new_tokens``.

        Greedy by default; stops at EOS. Returns only the new tokens, decoded with
        ``skip_special_tokens=True``. The state itself is never mutated. :meth:`answer` does
        the same and also returns each token's log-probability.
        """
        return self.answer(
            continuation,
            max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            eos_token_id=eos_token_id,
        ).text

    @torch.no_grad()
    def answer(
        self,
        continuation: str = "",
        max_new_tokens: int = 32,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> Answer:
        """:meth:`generate`, returning an :class:`Answer`: the text, the new token ids and the
        log-probability the model gave each of them (under its unscaled distribution)."""
        max_new_tokens = checks.count("max_new_tokens", max_new_tokens)
        dec = self.decoder(continuation)
        eos = eos_ids(dec.model, dec.tokenizer, eos_token_id)
        new_tokens: list[int] = []
        logprobs: list[float] = []
        finished = False
        for step in range(max_new_tokens):
            token = _sample(dec.next_logits, do_sample, temperature, top_k, top_p, generator)
            if token in eos:
                finished = True
                break
            new_tokens.append(token)
            logprobs.append(float(dec.next_logits.float().log_softmax(-1)[token]))
            if step < max_new_tokens - 1:
                dec.push(token)
        text = dec.tokenizer.decode(new_tokens, skip_special_tokens=True)
        return Answer(text, new_tokens, logprobs, finished)

    def decoder(self, continuation: str = "") -> Decoder:
        """A :class:`Decoder` over the state followed by ``continuation`` (run once, now)."""
        return Decoder(self, continuation)

    @torch.no_grad()
    def extend(self, text: str) -> KVState:
        """A new state with ``text`` appended (tokenized without special tokens)."""
        ids = self.encode(text, "text")
        if not ids:
            return self.replace(text=self.text + text)
        _, tok = self.require_model()
        logits, full_kv = self.run(ids, logits_to_keep=1)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2) + len(
            self.text
        )
        positions = torch.arange(self.next_position, self.next_position + len(ids))
        return self.replace(
            layers=appended_layers(
                self.layers, full_kv, ids, self.next_position, first_index=len(self)
            ),
            token_ids=torch.cat([self.token_ids, torch.tensor(ids, dtype=torch.long)]),
            offsets=torch.cat([self.offsets, offsets]),
            text=self.text + text,
            position_ids=torch.cat([self.position_ids, positions]),
            next_position=self.next_position + len(ids),
            last_logits=logits[-1].float(),
        )

    # ---------------------------------------------------------------- storage

    def save(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write the state to one safetensors file, atomically; returns its path (as
        :meth:`kvedit.Projector.save` does). ``dtype`` (a float dtype) down-casts K/V."""
        return save_state(self, path, dtype=dtype)

    def check_compatible(self, model: PreTrainedModel, tokenizer) -> None:
        """Raise :class:`CacheMismatchError` unless ``model``/``tokenizer`` made this state and
        its cache fits the model (:func:`kvedit.checks.state_fits_model`)."""
        checks.state_fits_model(self, model, tokenizer)


# -------------------------------------------------------------------- helpers


class Decoder:
    """Token-by-token decoding from a state, for loops that choose their own tokens (two
    states in lockstep, say). The state is never mutated.

    ``Decoder(state, continuation)`` runs the continuation over the state; then
    :attr:`next_logits` ``[vocab]`` predicts the next token and :meth:`push` feeds one token
    (one forward pass over the cache, with the state's stored bias).
    """

    @torch.no_grad()
    def __init__(self, state: KVState, continuation: str = "") -> None:
        ids = state.encode(continuation)
        # run() checks the state against its model; without a continuation, check here
        self.model, self.tokenizer = state.require_model() if ids else state.checked_model()
        self.device = state.device
        self.eos_ids = eos_ids(self.model, self.tokenizer, None)
        """The token ids that end an answer (the model's and tokenizer's EOS)."""
        layers = state.layers
        self.position = state.next_position
        if ids:
            logits, full_kv = state.run(ids, logits_to_keep=1)
            layers = appended_layers(layers, full_kv, ids, self.position)
            self.position += len(ids)
            self.next_logits = logits[-1]
        else:
            self.next_logits = state.last_logits
        self._cache = dynamic_cache(layers)
        self._plan = StateBias(layers)

    @torch.no_grad()
    def push(self, token: int) -> torch.Tensor:
        """Feed ``token``; returns (and keeps in :attr:`next_logits`) the next prediction."""
        self.next_logits = forward(
            self.model,
            torch.tensor([[int(token)]], device=self.device),
            torch.tensor([[self.position]], device=self.device),
            self._cache,
            plan=self._plan,
        )[0, -1]
        self.position += 1
        return self.next_logits


def eos_ids(model, tok, override: int | Sequence[int] | None = None) -> set[int]:
    """The token ids greedy decoding stops at: ``override``, else the model's generation
    config's ``eos_token_id``, else the tokenizer's (empty when none is known)."""
    if override is not None:
        return {override} if isinstance(override, int) else set(override)
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tok.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def _sample(logits, do_sample, temperature, top_k, top_p, generator) -> int:
    if not do_sample:
        return int(torch.argmax(logits))
    logits = logits.float() / max(temperature, 1e-6)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p is not None:
        sorted_p, order = probs.sort(descending=True)
        cut = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p[cut] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


class PackedCacheLayer(DynamicLayer):
    """A transformers cache layer over a packed kvedit layer (``layer.packed``: quantized,
    merged): the layer's dense K/V exist only while its attention runs.

    :meth:`update` (what the model's attention calls with the new tokens' K/V) expands the
    stored entries with ``source.dense_kv(new)`` (stored entries, then every new entry so far,
    ``[batch, kv_heads, n + k, head_dim]``), returns them to the attention and keeps nothing
    of them: the layer holds only the packed source and the new entries (``new_keys`` /
    ``new_values``, full precision). Reading ``.keys`` / ``.values`` expands the layer on each
    access; assigning them (transformers' crop or beam reordering) turns it into a plain
    dense layer holding what was assigned.
    """

    def __init__(self, source: LayerKV) -> None:
        self._source: LayerKV | None = source
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        super().__init__()  # sets keys/values to None (no-ops here)
        b, h, _, d = source.kv_shape
        self.device = source.device
        dv = d  # values may have another head size (MLA); refined on the first update
        self.new_keys = torch.zeros(b, h, 0, d, device=self.device)
        self.new_values = torch.zeros(b, h, 0, dv, device=self.device)
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor | None:
        if self._source is None:
            return self._keys
        return self._source.dense_kv(self.new_keys, self.new_values)[0]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._assign("_keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        if self._source is None:
            return self._values
        return self._source.dense_kv(self.new_keys, self.new_values)[1]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._assign("_values", value)

    def _assign(self, name: str, value: torch.Tensor | None) -> None:
        if value is None and self._source is not None:
            return  # DynamicLayer.__init__; reset() below drops the source too
        if self._source is not None:  # keep the side not assigned as it is now
            other = "_values" if name == "_keys" else "_keys"
            k, v = self._source.dense_kv(self.new_keys, self.new_values)
            setattr(self, other, v if other == "_values" else k)
            self._source = None
        setattr(self, name, value)

    def reset(self) -> None:
        self._source = None
        super().reset()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new entries; return the whole layer, expanded for this call only."""
        if self._source is None:
            return super().update(key_states, value_states, *args, **kwargs)
        if self.new_keys.shape[-2] == 0:
            self.new_keys = key_states[:, :, :0].to(self.device)
            self.new_values = value_states[:, :, :0].to(self.device)
        self.new_keys = torch.cat([self.new_keys, key_states], dim=-2)
        self.new_values = torch.cat([self.new_values, value_states], dim=-2)
        return self._source.dense_kv(self.new_keys, self.new_values)

    def get_seq_length(self) -> int:
        if self._source is None:
            return super().get_seq_length()
        return len(self._source) + self.new_keys.shape[-2]

    @property
    def packed_source(self) -> LayerKV | None:
        """The packed layer this cache layer expands (None once it holds dense K/V)."""
        return self._source


def dynamic_cache(layers: Sequence[LayerKV]) -> DynamicCache:
    """A plain (all-global) ``DynamicCache`` holding the entries, without copying them.

    A dense layer is initialised through ``update`` with zero entries, then given the stored
    tensors through the ``layers[i].keys/.values`` seam. The model's own ``update``
    concatenates into new tensors, so stored tensors are never mutated. A packed layer
    (``layer.packed``) gets a :class:`PackedCacheLayer`, which expands it only while its
    attention runs: a forward over a quantized or merged state holds one layer's dense K/V
    at a time.
    """
    cache = DynamicCache()
    for i, layer in enumerate(layers):
        if layer.packed:
            cache.layers.append(PackedCacheLayer(layer))
            continue
        cache.update(layer.keys[:, :, :0], layer.values[:, :, :0], i)
        cache.layers[i].keys = layer.keys
        cache.layers[i].values = layer.values
    return cache


class CacheEntries(Sequence):
    """Each layer's entries after a forward over :func:`dynamic_cache`: item ``i`` is
    ``(keys, values)`` ``[batch, kv_heads, len + n, head_dim]`` (stored entries, then the ``n``
    new ones), expanded on access for a packed layer; :meth:`new_entries` gives only the new
    ones without expanding anything."""

    def __init__(self, cache: DynamicCache, n_layers: int, n_new: int) -> None:
        self._cache = cache
        self._n = n_layers
        self._new = n_new

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(self._n)[i]]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        layer = self._cache.layers[i % self._n]
        source = getattr(layer, "packed_source", None)
        if source is not None:  # expanded once for both
            return source.dense_kv(layer.new_keys, layer.new_values)
        return layer.keys, layer.values

    def new_entries(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[batch, kv_heads, n, head_dim]`` of the new entries of layer ``i``."""
        layer = self._cache.layers[i]
        if getattr(layer, "packed_source", None) is not None:
            keys, values = layer.new_keys, layer.new_values
        else:
            keys, values = layer.keys, layer.values
        first = keys.shape[-2] - self._new
        return keys[:, :, first:], values[:, :, first:]


def run_model(
    model: PreTrainedModel,
    layers: Sequence[LayerKV],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int = 0,
    plan=None,
) -> tuple[torch.Tensor, CacheEntries]:
    """Run ``input_ids [1, n]`` at ``position_ids [1, n]`` on top of ``layers``.

    Returns ``(logits [1, n|keep, vocab], entries)``: ``entries[i]`` is layer ``i``'s
    ``(keys, values)``, the stored entries followed by the ``n`` new ones
    (``[batch, kv_heads, len + n, dim]``; a packed layer is expanded on access), and
    ``entries.new_entries(i)`` only the new ones (:class:`CacheEntries`).
    The stored bias applies to every new query (or ``plan``, a BiasPlan, decides); ``layers``
    is left untouched.
    """
    cache = dynamic_cache(layers)
    plan = StateBias(layers) if plan is None else plan
    logits = forward(
        model, input_ids, position_ids, cache, plan=plan, logits_to_keep=logits_to_keep
    )
    return logits, CacheEntries(cache, len(layers), input_ids.shape[-1])


def appended_layers(layers, full_kv, ids, first_position, first_index=-1) -> list[LayerKV]:
    """Layers extended to ``full_kv`` (stored + new entries, from :func:`run_model`).

    ``first_index < 0`` marks the new entries as not being tokens of the state's text.
    """
    n = len(ids)
    positions = torch.arange(first_position, first_position + n)
    index = torch.arange(first_index, first_index + n) if first_index >= 0 else torch.full((n,), -1)
    if len(layers) != len(full_kv):
        raise ValueError(f"{len(full_kv)} layers of entries for {len(layers)} layers")
    out = []
    for i, layer in enumerate(layers):
        if layer.packed:  # the new entries only: the packed part is never expanded
            k, v = full_kv.new_entries(i)
            out.append(layer.append(k, v, index, positions))
        else:
            k, v = full_kv[i]
            out.append(layer.extended(k, v, index, positions))
    return out


@torch.no_grad()
def capture(model: PreTrainedModel, tokenizer, text: str) -> KVState:
    """Run ``model`` over ``text`` (with the tokenizer's default special tokens) and keep its cache.

    Returns a :class:`KVState` whose continuation matches ``model.generate`` token for token.
    Raises :class:`~kvedit.errors.UnsupportedModelError` for caches kvedit cannot hold.
    """
    text = checks.text("text", text)
    enc = tokenizer(text, return_offsets_mapping=True)
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
    return _capture(model, tokenizer, list(enc["input_ids"]), text, offsets)


def capture_tokens(model: PreTrainedModel, tokenizer, token_ids: Sequence[int]) -> KVState:
    """:func:`capture` of a token sequence as given (e.g. ``model.generate``'s ``input_ids``,
    special tokens included). ``state.text`` is the ids decoded with their special tokens, and
    each token's character range comes from :func:`kvedit.spans.token_offsets`."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1:
            raise InvalidInputError(
                f"capture_tokens takes one sequence ([n] or [1, n]), not {tuple(token_ids.shape)}"
            )
        token_ids = token_ids.tolist()
    ids = [checks.count("token id", t) for t in token_ids]
    text, offsets = token_offsets(tokenizer, ids)
    return _capture(model, tokenizer, ids, text, offsets)


def _capture(model, tokenizer, ids: list[int], text: str, offsets: torch.Tensor) -> KVState:
    windows = layer_windows(model)  # the gate: refuses what kvedit cannot run exactly
    if not ids:
        raise InvalidInputError("capture: the text tokenizes to nothing")
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device)[None]
    cache = DynamicCache()  # every entry; sliding layers are trimmed to their window below
    logits = forward(model, input_ids, positions, cache, logits_to_keep=1)
    n = len(ids)
    index = torch.arange(n)
    layers = [
        LayerKV(cl.keys, cl.values, index.clone(), index.clone(), None, window).trimmed()
        for cl, window in zip(cache.layers, windows, strict=True)
    ]
    return KVState(
        layers=layers,
        token_ids=torch.tensor(ids, dtype=torch.long),
        offsets=offsets,
        text=text,
        position_ids=torch.arange(n),
        next_position=n,
        last_logits=logits[0, -1].float(),
        model_fingerprint=model_fingerprint(model),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        model=model,
        tokenizer=tokenizer,
    )


@torch.no_grad()
def recompute_last(
    state: KVState, edit: Callable[[int, LayerKV, torch.Tensor], LayerKV] | None = None
) -> KVState:
    """``state`` with its last text token run again over the (edited) rest of the cache.

    Every entry of the last token (one per layer, more where it was duplicated) is replaced by
    the token's fresh K/V, keeping each entry's bias, and ``last_logits`` become the fresh
    prediction, so an edit reaches the first continuation token. ``edit(layer, entries)``, when
    given, is applied to layer ``i``'s fresh entries afterwards (an op whose span covers the last token).
    Key or value edits an *earlier* op made to the last token's own entries are recomputed
    away; biases are kept. Needs the state's model; a state with no tokens is returned as is.

    Raises:
        KVEditError: a layer no longer holds the last token.
    """
    if len(state) == 0:
        return state
    model, _ = state.checked_model()
    t = len(state) - 1
    pos = int(state.position_ids[t])
    bases, counts, biases = [], [], []
    for i, layer in enumerate(state.layers):
        mine = layer.token_index == t
        if not bool(mine.any()):
            raise StateAlteredError(
                f"layer {i} no longer holds the last token; cannot recompute it"
            )
        keep = (~mine).nonzero().flatten()
        bases.append(layer.select(keep))
        counts.append(int(mine.sum()))
        entries = mine.nonzero().flatten().to(layer.keys.device)
        biases.append(None if layer.bias is None else layer.bias[..., entries])
    device = state.device
    logits, full_kv = run_model(
        model,
        bases,
        torch.tensor([[int(state.token_ids[t])]], device=device),
        torch.tensor([[pos]], device=device),
        logits_to_keep=1,
    )
    layers = []
    for i, (base, count, bias) in enumerate(zip(bases, counts, biases, strict=True)):
        fresh_k, fresh_v = full_kv.new_entries(i)
        layer = base.append(
            fresh_k.repeat(1, 1, count, 1),
            fresh_v.repeat(1, 1, count, 1),
            torch.full((count,), t, dtype=torch.long),
            torch.full((count,), pos, dtype=torch.long),
            bias,
        )
        if edit is not None:
            entries = (layer.token_index == t).nonzero().flatten().to(layer.keys.device)
            layer = edit(i, layer, entries)
        layers.append(layer)
    return state.replace(layers=layers, last_logits=logits[0, -1].float())


def templated_prompt(tokenizer, user_message: str) -> str:
    """``user_message`` in the tokenizer's chat template (as is when it has none).

    The tokenizer's BOS text is left out when the tokenizer adds BOS itself, so capturing the
    result does not double it.
    """
    if getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True
        )
    else:
        full = user_message
    bos = getattr(tokenizer, "bos_token", None)
    if bos and full.startswith(bos):
        probe = tokenizer("x")["input_ids"]
        if probe and probe[0] == tokenizer.bos_token_id:
            full = full[len(bos) :]
    return full


def chat_prefix(tokenizer, user_message: str, split_at: str) -> tuple[str, str]:
    """Cut the chat-templated prompt of ``user_message`` where ``split_at`` first occurs.

    Returns ``(prefix, continuation)`` texts, e.g. to capture a document and ask about it
    afterwards: ``capture(model, tok, prefix).generate(continuation)``.
    """
    split_at = checks.text("split_at", split_at, allow_empty=False)
    full = templated_prompt(tokenizer, user_message)
    cut = full.find(split_at)
    if cut < 0:
        from .errors import SpanNotFoundError

        raise SpanNotFoundError(f"split_at {split_at!r} not found in the templated prompt {full!r}")
    return full[:cut], full[cut:]
