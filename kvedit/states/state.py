"""KVState: a captured KV cache with everything needed to edit it and continue from it.

``capture(model, tokenizer, text)`` runs the model over ``text`` once and keeps, per layer, the
keys and values ``[batch, kv_heads, seq, head_dim]`` (post-RoPE, exactly what the model cached),
which text token each cache entry encodes, its rotary position, and an additive attention bias
(zeros until an edit sets it). Continuing from a state (``generate``, ``logits``, ``extend``)
feeds the entries back through a plain ``DynamicCache`` and the kvedit attention, which applies
the stored bias and masks causally with bottom-right alignment, so edits that change the cache
length (duplication, re-reading) keep later positions right. Those methods say what each does;
their work is done in :mod:`kvedit.states.continuing`.

Sliding-window layers (Gemma-3) hold only their last ``window`` tokens (transformers keeps
``window - 1``; kvedit keeps one more so the last token can be recomputed exactly after an edit,
see :func:`recompute_last`); ``LayerKV.token_index`` says which ones, so edits touch only tokens
a layer holds. The attention masks the extra entry for every later query.

Edits reach the next token: every op ends with :func:`recompute_last`, which runs the state's
last input again over the edited cache, so ``last_logits`` (the first continuation token's
prediction) and the last input's own entries reflect the edit. The last input
(``KVState.last_input``) is the entry ``last_logits`` follow: the last token of the text after
a capture or an extension, the last re-read token after :func:`kvedit.ops.reread`.

Every state carries its provenance (``KVState.history``, :mod:`kvedit.provenance`): how it was
made and each transformation since; ``KVState.digest`` names its content.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from .. import checks
from ..cache import LayerKV
from ..cache.adapter import CacheEntries
from ..errors import ModelNotAttachedError, StateAlteredError
from ..provenance import History, Step, content_digest
from ..spans import Spans, char_ranges, tokens_in_ranges
from . import continuing
from .decoding import Answer, Decoder, Sampling
from .files.write import save_state
from .room import check_room
from .stamps import tensor_stamp
from .view import LastInput

__all__ = ["KVState", "LastInput", "LayerKV"]


@dataclass(eq=False, frozen=True)
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
        history: where the state came from and every transformation applied to it
            (:class:`~kvedit.provenance.History`; ``"unknown"`` unless whoever built the state
            said).
        last_input: the entry ``last_logits`` follow (:class:`LastInput`); when not given,
            the last text token at its position (what a capture or an extension ran last).
        max_positions: the most positions the model attends to, for every call that adds
            tokens (:meth:`check_room`); None: the model config's ``max_position_embeddings``.
            A runtime setting, not content: set by ``capture``/``load_state(...,
            max_positions=)``, kept by every derived state, never saved nor in :attr:`digest`.

    Frozen: setting an attribute raises :class:`dataclasses.FrozenInstanceError`; every
    operation returns a new state (:meth:`replace`, :meth:`with_step`, the ops). The
    attributes are frozen, not the data: tensors are shared between states and not
    write-protected, and no kvedit function writes into them.
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
    history: History = field(default_factory=History.unknown)
    last_input: LastInput | None = None
    max_positions: int | None = field(default=None, compare=False)
    model: PreTrainedModel | None = field(default=None, repr=False, compare=False)
    tokenizer: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # last_input is derived from the other fields when not given, and normalised to ints
        # when given; set once, while the state is built
        n = int(self.token_ids.shape[0])
        last = self.last_input
        if last is None and n:
            last = LastInput(n - 1, int(self.position_ids[n - 1]))
        elif last is not None:
            last = LastInput(*(int(v) for v in last))
        object.__setattr__(self, "last_input", last)
        if self.max_positions is not None:
            object.__setattr__(
                self, "max_positions", checks.count("max_positions", self.max_positions, minimum=1)
            )
        # the tensors' version counters as built: an in-place write after this shows
        object.__setattr__(self, "_stamp", tensor_stamp(self))

    # ---------------------------------------------------------------- basic properties

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the global-attention layers: those without a sliding window (every layer
        of most models; Gemma-3's full-attention layers; empty when every layer slides)."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.window is None)

    @property
    def counted_layers(self) -> tuple[int, ...]:
        """Indices of the layers a length or a memory budget counts: the global-attention
        layers (:attr:`global_layers`), or every layer when every layer slides."""
        return self.global_layers or tuple(range(len(self.layers)))

    @property
    def cache_length(self) -> int:
        """Number of KV entries of the counted layers (:attr:`counted_layers`; edits such as
        duplication change it)."""
        return max(len(self.layers[i]) for i in self.counted_layers)

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

    @property
    def digest(self) -> str:
        """A stable digest of what the state holds: model fingerprint, token ids and history
        (:func:`~kvedit.provenance.content_digest`). Equal digests attend identically."""
        return content_digest(self.model_fingerprint, self.token_ids.tolist(), self.history)

    @property
    def is_plain_capture(self) -> bool:
        """Whether the state is a capture with nothing done to it but exact casts."""
        return self.history.first_change() is None

    def with_step(self, step: Step) -> KVState:
        """This state with ``step`` appended to its history (tensors shared). The step notes
        how many tokens the state had (``at_tokens``): an edit before an extension and the same
        edit after it hold different entries, so their histories differ."""
        params = {**step.params, "at_tokens": len(self)}
        return self.replace(
            history=self.history.then(Step(step.kind, step.name, params, step.exact))
        )

    def __repr__(self) -> str:
        kinds = sorted({layer.kind for layer in self.layers})
        return (
            f"KVState({len(self)} tokens, {len(self.layers)} layers ({'/'.join(kinds)}), "
            f"cache {self.cache_length}, model {self.model_fingerprint[:12]}, "
            f"history: {self.history}, digest {self.digest[:12]})"
        )

    def explain(self) -> str:
        """A readable account of the state: size, origin and each transformation, in order."""
        lines = [
            f"{len(self)} tokens, {len(self.layers)} layers, {self.nbytes / 2**20:.1f} MiB, "
            f"digest {self.digest}",
            f"origin: {self.history.origin.kind}"
            + (f" (read from {self.history.origin.path})" if self.history.origin.path else ""),
        ]
        if not self.history.known:
            lines.append("history: unknown (a file written before kvedit 0.3)")
        for i, step in enumerate(self.history.steps, 1):
            lines.append(f"{i:3d}. {step.kind:13s} {step}")
        if self.history.known and not self.history.steps:
            lines.append("no transformation: a plain capture")
        last = self.last_input
        if last is not None and (last.token_index, last.position) != (
            len(self) - 1,
            int(self.position_ids[-1]),
        ):
            lines.append(
                f"last input: token {last.token_index} at position {last.position} "
                "(the last logits follow it)"
            )
        return "\n".join(lines)

    def replace(self, **changes) -> KVState:
        """A shallow copy with fields replaced (tensors are shared, never mutated).

        Raises:
            StateAlteredError: a tensor of this state was written in place since it was built
                (:meth:`check_unaltered`): nothing is derived from an altered state.
        """
        self.check_unaltered("a new state built from it")
        return dataclasses.replace(self, **changes)

    def check_unaltered(self, what: str = "this use") -> None:
        """Raise :class:`~kvedit.errors.StateAlteredError` if a tensor of this state was
        written in place since the state was built (``s.layers[0].keys.mul_(3)``): its history
        and digest would no longer say what it holds. ``what`` names the use refused.

        The check reads torch's version counters (a few microseconds): it sees every in-place
        torch operation on a tensor or a view of it, not writes that bypass torch's autograd
        bookkeeping (through ``.numpy()`` or ``.data``, DLPack, another process's shared
        memory, raw storage). The store, ``kvedit.reuse``, ``publish`` and ``save`` call it.
        """
        now = tensor_stamp(self)
        if now != self._stamp:
            where = next(
                (name for (name, a), (_, b) in zip(self._stamp, now, strict=True) if a != b),
                "a tensor",
            )
            raise StateAlteredError(
                f"{what} refused: the state's {where} was changed in place after the state was "
                "made, so its history and digest no longer say what it holds; edit with "
                "kvedit.ops (they return new states) or build a new state"
            )

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

    def encode(self, text: str, name: str = "continuation", reserve: int = 0) -> list[int]:
        """Token ids of ``text`` (a continuation: no special tokens added), refused before any
        work when they would run past the model's positions (:meth:`check_room`; ``reserve``:
        the tokens still to come after them, e.g. ``max_new_tokens``)."""
        text = checks.text(name, text)
        model, tok = self.require_model()
        if not text:
            return []
        self.check_room(0, reserve, what=name, n_chars=len(text))
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        self.check_room(len(ids), reserve, what=name)
        return ids

    def check_room(
        self, n_tokens: int, reserve: int = 0, *, what: str = "continuation", n_chars=None
    ) -> None:
        """Refuse (:class:`~kvedit.errors.InvalidInputError`, before any work) ``n_tokens`` new
        tokens and ``reserve`` more after them (tokens to decode) that would run past the
        model's positions (:attr:`max_positions`, else the model config's; see
        :func:`kvedit.checks.positions_limit`): the count starts at :attr:`next_position`, not
        at the cache length (a duplicated entry takes no position; a re-read advances them).
        Whatever the positions, a call adding more than
        :data:`kvedit.checks.MAX_TOKENS_PER_CALL` tokens is refused too (a memory bound).
        ``n_chars``: the text's length, refused (before it is tokenized) when even the most
        characters one token of the state's tokenizer can cover cannot fit it
        (:func:`kvedit.states.room.check_room`)."""
        check_room(self, n_tokens, reserve, what=what, n_chars=n_chars)

    def run(self, ids: Sequence[int], logits_to_keep: int = 0) -> tuple[torch.Tensor, CacheEntries]:
        """Run ``ids`` on top of the state. Returns ``(logits [n|keep, vocab], new K/V per layer)``."""
        return continuing.run_ids(self, ids, logits_to_keep)

    def logits(self, continuation: str) -> torch.Tensor:
        """``[n_tokens, vocab]``: row i is the distribution over continuation token i.

        Row 0 is the stored last logits; row i > 0 is the model's prediction after the state and
        continuation tokens ``< i``. The continuation is tokenized without special tokens.
        """
        return continuing.continuation_logits(self, continuation)

    @torch.no_grad()
    def token_logprobs(self, continuation: str, token_ids: Sequence[int]) -> list[float]:
        """The log-probability of each of ``token_ids`` when they follow the state and
        ``continuation``: how likely the model finds a given answer (e.g. another state's
        :class:`Answer`). One forward pass over ``continuation`` and the tokens."""
        return continuing.token_logprobs(self, continuation, token_ids)

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

        Greedy by default (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``generator``:
        :class:`~kvedit.states.decoding.Sampling`, checked before any work); stops at EOS.
        Returns only the new tokens, decoded with
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
        log-probability the model gave each of them (under its unscaled distribution).

        Raises:
            InvalidTypeError, InvalidInputError: a sampling argument of the wrong type or out
                of range (:class:`~kvedit.states.decoding.Sampling`), before any work.
        """
        sampling = Sampling(do_sample, temperature, top_k, top_p, generator)
        return continuing.answer(self, continuation, max_new_tokens, sampling, eos_token_id)

    def decoder(self, continuation: str = "") -> Decoder:
        """A :class:`Decoder` over the state followed by ``continuation`` (run once, now)."""
        return Decoder(self, continuation)

    @torch.no_grad()
    def extend(self, text: str) -> KVState:
        """A new state with ``text`` appended (tokenized without special tokens)."""
        return continuing.extended(self, text)

    # ---------------------------------------------------------------- storage

    def save(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write the state to one safetensors file, atomically; returns its path (as
        :meth:`kvedit.Projector.save` does). ``dtype`` (a float dtype) down-casts K/V.

        Raises:
            StateAlteredError: a tensor was written in place after the state was built.
        """
        self.check_unaltered("saving it")
        return save_state(self, path, dtype=dtype)

    def check_compatible(self, model: PreTrainedModel, tokenizer) -> None:
        """Raise :class:`CacheMismatchError` unless ``model``/``tokenizer`` made this state and
        its cache fits the model (:func:`kvedit.checks.state_fits_model`)."""
        checks.state_fits_model(self, model, tokenizer)
