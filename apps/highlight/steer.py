"""The model side of the highlight app: one request in, one :class:`SteerResult` out.

The context is captured once with :func:`kvedit.capture`; :func:`kvedit.ops.emphasize` /
:func:`kvedit.ops.suppress` store a ±strength bias on the spans' keys (the decode scope of
:func:`kvedit.steer`). Both answers are greedy and come from the same captured cache; the
attention views come from :func:`kvedit.attention_share` on each cache.

Auto-highlight (:meth:`Highlighter.focus`, a :class:`FocusResult`) scores the context's passages
with :func:`kvedit.choose` (the scoring half of :func:`kvedit.focus`: the same choice, no edit)
and returns the best ones as Emphasize-box text; the steering is left to :meth:`Highlighter.run`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import kvedit
from kvedit.focusing.choice import ABSTAIN_THRESHOLD
from kvedit.focusing.passages import split_passages
from kvedit.spans import tokens_in_ranges

from .parse import (
    FocusRequest,
    InputError,
    Limits,
    PromptSplit,
    Request,
    parse_focus_request,
    parse_request,
    split_prompt,
)
from .render import (
    GroupShare,
    context_pieces,
    render_difference,
    render_focus_status,
    render_scores,
    render_status,
    render_views,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["FocusResult", "Highlighter", "SteerResult"]


@dataclass(frozen=True)
class SteerResult:
    """What one request shows: both answers, the attention views, the cache file, a status."""

    baseline: str
    steered: str
    before_html: str
    after_html: str
    cache_path: str | None
    status: str
    diff_html: str = ""
    """The context coloured by each token's change of attention share (after minus before)."""


@dataclass(frozen=True)
class FocusResult:
    """What Auto-highlight shows: the passages picked, every passage's score, a status.

    Attributes:
        emphasize: the picked passages' text, one per line, best first (what the Emphasize box
            takes).
        passages: one dict per passage, in context order: ``passage`` (its text), ``start`` and
            ``end`` (characters of the context, inline markers removed), ``score`` (higher:
            the question points at it more) and ``chosen``.
        scores_html: the passages' scores as a bar list (HTML).
        status: a Markdown status line.
    """

    emphasize: str
    passages: list[dict]
    scores_html: str
    status: str


class Highlighter:
    """Answers highlight requests with one model.

    The model and tokenizer are only read; :meth:`run` keeps everything it computes in local
    variables, so requests may run in parallel threads.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        limits: Limits | None = None,
        focus_threshold: float | None = ABSTAIN_THRESHOLD,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits or Limits()
        self.focus_threshold = focus_threshold
        """Auto-highlight picks only passages that stand out (kvedit.focus's abstain rule);
        None: always the best ``top_k``."""

    def parse(
        self, context: str, emphasize: str, suppress: str, strength: float, question: str
    ) -> Request:
        """Validate a request (arguments as for :meth:`run`; see :func:`.parse.parse_request`).

        Raises:
            InputError: with a message for the page.
        """
        return parse_request(context, emphasize, suppress, strength, question, self.limits)

    def _prefix_offsets(self, split: PromptSplit) -> torch.Tensor:
        """``[n_tokens, 2]`` character offsets of the captured prompt's tokens.

        Raises:
            InputError: the prompt has more tokens than ``limits.max_context_tokens``.
        """
        enc = self.tokenizer(split.prefix, return_offsets_mapping=True)
        n_tokens = len(enc["input_ids"])
        if n_tokens > self.limits.max_context_tokens:
            raise InputError(
                f"The context is too long: {n_tokens:,} tokens with the chat template "
                f"(max {self.limits.max_context_tokens:,})."
            )
        return torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)

    def parse_focus(self, context: str, question: str, top_k: int | float | str) -> FocusRequest:
        """Validate an Auto-highlight request (see :func:`.parse.parse_focus_request`).

        Raises:
            InputError: with a message for the page.
        """
        return parse_focus_request(context, question, top_k, self.limits)

    def focus(self, context: str, question: str, top_k: int | float | str = 1) -> FocusResult:
        """Auto-highlight: pick the ``top_k`` passages of the context the question points at.

        The context is captured in the same chat-templated prompt as :meth:`run` and cut into
        passages (:func:`kvedit.focusing.passages.split_passages`, default rule, inside the context
        only: paragraphs, the lines of multi-line ones; sentences when that gives a single
        passage). :func:`kvedit.choose` scores them (the attention the question gives
        each, against a content-free version of the question) without editing the cache;
        nothing is steered. Inline markers are removed first.

        Raises:
            InputError: the request is invalid (the message says why).
        """
        t0 = time.perf_counter()
        req = self.parse_focus(context, question, top_k)
        split = split_prompt(self.tokenizer, req.context, req.question)
        n_tokens = len(self._prefix_offsets(split))
        state = kvedit.capture(self.model, self.tokenizer, split.prefix)
        region = (split.context_start, len(split.prefix))
        ranges = split_passages(state, None, region)
        if len(ranges) < 2:  # one paragraph of one line: its sentences are the passages
            ranges = split_passages(state, "sentences", region)
        k = min(req.top_k, len(ranges))
        found = kvedit.choose(
            state,
            split.continuation,
            ranges,
            top_k=k,
            query=req.question,
            threshold=self.focus_threshold,
        )

        lo = split.context_start
        chosen = set(found.chosen)
        passages = [
            {
                "passage": req.context[a - lo : b - lo],
                "start": a - lo,
                "end": b - lo,
                "score": float(score),
                "chosen": i in chosen,
            }
            for i, ((a, b), score) in enumerate(zip(found.passages, found.scores, strict=True))
        ]
        emphasize = "\n".join(passages[i]["passage"] for i in found.chosen)
        seconds = time.perf_counter() - t0
        return FocusResult(
            emphasize=emphasize,
            passages=passages,
            scores_html=render_scores(passages),
            status=render_focus_status(
                self.model_name,
                seconds,
                n_tokens,
                len(passages),
                len(found.chosen),
                req.top_k,
                found.reason,
            ),
        )

    def run(
        self,
        context: str,
        emphasize: str,
        suppress: str,
        strength: float,
        question: str,
        save_dir: Path | None = None,
    ) -> SteerResult:
        """Answer one request: baseline and steered answers, attention views, the edited cache.

        ``emphasize`` and ``suppress`` hold one span per line (every occurrence in the context
        counts); ``[[...]]`` and ``{{...}}`` in ``context`` mark spans inline. The edited cache is
        saved under ``save_dir`` when given.

        Raises:
            InputError: the request is invalid (the message says why).
        """
        t0 = time.perf_counter()
        req = self.parse(context, emphasize, suppress, strength, question)
        tok, lim, strength = self.tokenizer, self.limits, req.strength
        split = split_prompt(tok, req.context, req.question)
        emph, supp = split.shift(req.emphasize), split.shift(req.suppress)

        offsets = self._prefix_offsets(split)
        n_tokens = len(offsets)
        emph_tokens = tokens_in_ranges(offsets, emph) if emph else torch.empty(0, dtype=torch.long)
        supp_tokens = tokens_in_ranges(offsets, supp) if supp else torch.empty(0, dtype=torch.long)
        shared = set(emph_tokens.tolist()) & set(supp_tokens.tolist())
        if shared:
            a, b = offsets[min(shared)].tolist()
            raise InputError(
                f"An emphasized and a suppressed span share the token “{split.prefix[a:b]}”; "
                "move them apart or drop one."
            )

        state = kvedit.capture(self.model, tok, split.prefix)
        edited = state
        if emph:
            edited = kvedit.ops.emphasize(edited, emph, strength)
        if supp:
            edited = kvedit.ops.suppress(edited, supp, strength)
        baseline = state.generate(split.continuation, lim.max_new_tokens).strip()
        steered = edited.generate(split.continuation, lim.max_new_tokens).strip()

        spans = emph + supp
        before = kvedit.attention_share(state, split.continuation, spans).token_share
        after = kvedit.attention_share(edited, split.continuation, spans).token_share
        groups = [
            GroupShare(name, len(tokens), float(before[tokens].sum()), float(after[tokens].sum()))
            for name, tokens in (("emphasized", emph_tokens), ("suppressed", supp_tokens))
            if len(tokens)
        ]

        cache_path = None
        if save_dir is not None:
            save_dir.mkdir(parents=True, exist_ok=True)
            cache_path = str(save_dir / "edited-cache.kv")
            edited.save(cache_path)

        seconds = time.perf_counter() - t0
        pieces = context_pieces(state, split, before), context_pieces(edited, split, after)
        before_html, after_html = render_views(req.context, *pieces, req.emphasize, req.suppress)
        diff_html = render_difference(req.context, *pieces, req.emphasize, req.suppress)
        return SteerResult(
            baseline=baseline,
            steered=steered,
            before_html=before_html,
            after_html=after_html,
            cache_path=cache_path,
            status=render_status(self.model_name, seconds, n_tokens, strength, groups),
            diff_html=diff_html,
        )
