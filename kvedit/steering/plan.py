"""What a steer applies: its configuration (:class:`SteerConfig`, :class:`FocusRequest`) and the
bias plan that finds the spans in each forward's input ids (:class:`SpanPlan`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import EmptySelectionError, InvalidInputError
from ..focusing.choice import ABSTAIN_THRESHOLD, Focus
from ..focusing.choice import focus as run_focus
from ..focusing.passages import template_ranges
from ..runtime import detached
from ..spans import char_ranges, token_offsets, tokens_in_ranges
from ..states.capturing import capture_tokens

__all__ = ["SCOPES", "FocusRequest", "SpanPlan", "SteerConfig"]


SCOPES = ("all", "decode")


@dataclass(frozen=True)
class FocusRequest:
    """``steer(focus=True)``: the question :func:`kvedit.focus` is asked at each prompt, and
    how its passages are cut (``passages`` as :func:`kvedit.focus` takes them)."""

    question: str
    passages: object = None
    top_k: int = 1
    guard: object = None  # a kvedit.focusing.guard.Guard, or None
    threshold: float | None = ABSTAIN_THRESHOLD
    max_positions: int | None = None  # the captured prompt's limit (KVState.max_positions)


@dataclass(frozen=True)
class SteerConfig:
    """What to steer and how. See :func:`steer`."""

    emphasize: tuple
    suppress: tuple
    strength: float
    layers: tuple[int, ...] | None
    heads: Mapping[int, tuple[int, ...]] | None
    scope: str
    protect_special: bool
    focus: FocusRequest | None = None


class SpanPlan:
    """A :class:`~kvedit.runtime.plans.BiasPlan` that biases the keys of span tokens of the prompt.

    ``token_bias`` ``[batch, prompt_len]`` holds the bias per absolute token index; keys past
    the prompt (generated tokens) get none.
    """

    def __init__(
        self, config: SteerConfig, tokenizer, n_layers: int, n_heads: int, model=None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model = model  # needed by focus, which reads the prompt's cache to bind
        # focus: the bias of each layer; token_bias then holds 1.0 on the chosen tokens
        self.layer_strengths: torch.Tensor | None = None
        self.found = None  # focus: the kvedit.focusing.choice.Focus of the latest bound prompt
        # scope "decode": the first query (absolute index) the bias applies to; default the
        # prompt's last token. Focus sets the last token before the question (the cache edit
        # recomputes it, and the question is read over the edited cache).
        self.first_biased: int | None = None
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.token_bias: torch.Tensor | None = None
        self.fixed = False  # True when bound from a prompt text (wrapper mode)
        self.bound_ids: torch.Tensor | None = None  # the input ids the spans were bound to
        # Absolute length of the sequence in the current forward (cached + new tokens), set by
        # the forward pre-hook. Sliding-window layers hold only their last tokens, so the
        # attention's own key count cannot tell which tokens its keys are.
        self.seq_len: int | None = None
        self._memo_key: tuple[int, int] | None = None  # (k_len, total_len) of the cached bias
        self._memo: torch.Tensor | None = None

    # -- binding spans to tokens -----------------------------------------------------------

    def bind_text(self, text: str, offsets: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
        """Bias per token ``[n_tokens]`` for one sequence, from its text and token offsets."""
        cfg = self.config
        if cfg.focus is not None:
            return self._focus_bias(text, offsets, ids)
        bias = torch.zeros(len(ids), dtype=torch.float32)
        emph = (
            tokens_in_ranges(offsets, char_ranges(text, cfg.emphasize)) if cfg.emphasize else None
        )
        supp = tokens_in_ranges(offsets, char_ranges(text, cfg.suppress)) if cfg.suppress else None
        if emph is not None and supp is not None:
            both = set(emph.tolist()) & set(supp.tolist())
            if both:
                shown = self.tokenizer.convert_ids_to_tokens([int(ids[i]) for i in sorted(both)])
                raise InvalidInputError(
                    f"emphasize and suppress spans overlap on tokens {shown[:10]}; a token "
                    "cannot be both"
                )
        if emph is not None:
            bias[emph] = cfg.strength
        if supp is not None:
            bias[supp] = -cfg.strength
        if cfg.protect_special:
            special = set(self.tokenizer.all_special_ids)
            for i, tid in enumerate(ids):
                if int(tid) in special:
                    bias[i] = 0.0
            bias[0] = 0.0  # the attention sink
        return bias

    def _focus_bias(self, text: str, offsets: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
        """Run :func:`kvedit.focus` on the prompt up to its question's line: ``1.0`` on the
        chosen passages' tokens, the layer strengths in :attr:`layer_strengths`, and the bias
        applies from the last token before the cut on (:attr:`first_biased`), so the answer
        equals :meth:`kvedit.focusing.choice.Focus.generate` on the same cut (the cache edit).

        The cut is where the question's line starts, less the whitespace before it (for the
        evaluation suite's prompt, ``context + "\n\nQuestion: " + question``, the cut of
        :func:`kvedit.focus_text`). Passages come from the turn that asks (after the last
        chat-template line before the cut), never from the template's own lines such as a
        system prompt, so ``steer(focus=True)`` and :func:`kvedit.focus_text` choose among the
        same passages. A prompt with no passage there gets no edit (``plan.found.chosen`` is
        empty, ``plan.found.reason`` says why). ``protect_special`` does not apply (focus
        passages never hold template tokens, and the cache edit protects none)."""
        request = self.config.focus
        if self.model is None:
            raise InvalidInputError("steer(focus=True) needs the model to read the prompt")
        asked = text.rfind(request.question)
        if asked < 0:
            raise InvalidInputError(
                f"steer(focus=True): the question {request.question!r} is not in the prompt"
            )
        line = text.rfind("\n", 0, asked) + 1  # the question's line starts here
        cut = len(text[:line].rstrip())
        ends = offsets[:, 1].tolist()
        # the tokens before the cut: up to the first one that reaches past it
        n_prefix = next((i for i, end in enumerate(ends) if end > cut), len(ends)) if cut else 0
        if n_prefix == 0:
            raise InvalidInputError(
                "steer(focus=True): the prompt has no context before its question"
            )
        ids = [int(t) for t in ids]
        tok, model = self.tokenizer, self.model
        with detached(model):
            state = capture_tokens(model, tok, ids[:n_prefix], max_positions=request.max_positions)
            continuation = tok.decode(ids[n_prefix:], skip_special_tokens=False)
            if state.encode(continuation) != ids[n_prefix:]:
                raise InvalidInputError(
                    "steer(focus=True): the prompt's question part does not tokenize back to "
                    "the same ids; capture the context and call kvedit.focus instead"
                )
            template = [b for a, b in template_ranges(state.text, tok) if b <= len(state.text)]
            region = (max(template, default=0), len(state.text))  # the asking turn only
            try:
                found = run_focus(
                    state,
                    continuation,
                    request.passages,
                    top_k=request.top_k,
                    query=request.question,
                    region=region,
                    threshold=request.threshold,
                    guard=request.guard,
                )
            except EmptySelectionError:  # no passage in the asking turn: nothing to edit
                found = Focus(
                    state,
                    [],
                    [],
                    [],
                    [0.0] * len(state.layers),
                    continuation,
                    reason="no candidate passage before the question in its turn",
                )
        self.found = found
        self.first_biased = n_prefix - 1
        bias = torch.zeros(len(ids), dtype=torch.float32)
        self.layer_strengths = torch.tensor(found.strengths, dtype=torch.float32)
        if found.kept:  # a guard that dropped the edit leaves the prompt unsteered
            for i in found.chosen:
                bias[state.token_indices(found.passages[i])] = 1.0
        return bias

    def bind_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Find the spans in the decoded ``input_ids [batch, seq]`` (left padding skipped)."""
        B, T = input_ids.shape
        if self.config.focus is not None and B != 1:
            raise InvalidInputError(f"steer(focus=True) binds one prompt at a time, not {B}")
        token_bias = torch.zeros(B, T, dtype=torch.float32)
        for b in range(B):
            keep = (
                attention_mask[b].bool().cpu()
                if attention_mask is not None
                else torch.ones(T, dtype=torch.bool)
            )
            where = keep.nonzero().flatten()
            ids = input_ids[b, where].tolist()
            text, offsets = token_offsets(self.tokenizer, ids)
            token_bias[b, where] = self.bind_text(text, offsets, ids)
        self.token_bias = token_bias.to(input_ids.device)
        self.bound_ids = input_ids.detach().clone()
        self._memo_key = None

    def before_forward(self, model, args, kwargs) -> None:
        """The runtime's forward pre-hook: record the sequence length; bind spans to a new
        prompt."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            self.seq_len = None
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        self.seq_len = int(past) + input_ids.shape[1]
        if self.fixed:
            return
        # generate(use_cache=False) re-runs the bound prompt plus the tokens generated so far
        rerun = kwargs.get("use_cache") is False and self.continues(input_ids)
        if (past == 0 and not rerun) or self.token_bias is None:
            self.bind_ids(input_ids, kwargs.get("attention_mask"))

    def continues(self, input_ids: torch.Tensor) -> bool:
        """Whether ``input_ids`` is the bound prompt followed by more tokens."""
        bound = self.bound_ids
        return (
            bound is not None
            and input_ids.shape[0] == bound.shape[0]
            and input_ids.shape[1] > bound.shape[1]
            and torch.equal(input_ids[:, : bound.shape[1]].to(bound.device), bound)
        )

    # -- the BiasPlan protocol -------------------------------------------------------------

    def _layer_heads(self, layer_idx: int) -> tuple[int, ...] | None | bool:
        cfg = self.config
        if cfg.heads is not None:
            return cfg.heads.get(layer_idx, False) or False
        if cfg.layers is not None and layer_idx not in cfg.layers:
            return False
        return None  # every head

    def key_bias(self, layer_idx: int, k_len: int, total_len: int) -> torch.Tensor | None:
        if self.token_bias is None:
            return None
        total_len = self.seq_len if self.seq_len is not None else total_len
        heads = self._layer_heads(layer_idx)
        if heads is False:
            return None
        key = (k_len, total_len)
        if self._memo_key != key:  # the same for every layer of one forward: build it once
            tb = self.token_bias
            B, T = tb.shape
            first = total_len - k_len  # absolute index of key entry 0
            bias = tb.new_zeros(B, k_len)
            lo, hi = max(first, 0), min(T, total_len)
            if hi > lo:
                bias[:, lo - first : hi - first] = tb[:, lo:hi]
            self._memo_key, self._memo = key, bias
        bias = self._memo
        if self.layer_strengths is not None:
            bias = bias * float(self.layer_strengths[layer_idx])
        B = bias.shape[0]
        if heads is None:
            return bias[:, None, :]
        per_head = bias.new_zeros(B, self.n_heads, k_len)
        per_head[:, list(heads)] = bias[:, None, :]
        return per_head

    def unbiased_queries(self, q_len: int, total_len: int) -> int:
        if self.config.scope == "all" or self.token_bias is None:
            return 0
        total_len = self.seq_len if self.seq_len is not None else total_len
        # The prompt's own pass is unbiased, except its last query: it predicts the first
        # generated token (as after a cache edit, which recomputes the last token).
        first = self.token_bias.shape[1] - 1 if self.first_biased is None else self.first_biased
        return max(0, min(q_len, first - (total_len - q_len)))
