"""The model side of the highlight app: one request in, one :class:`SteerResult` out.

The context is captured once with :func:`kvedit.capture`; :func:`kvedit.ops.emphasize` /
:func:`kvedit.ops.suppress` store a ±strength bias on the spans' keys (the decode scope of
:func:`kvedit.steer`). Both answers are greedy and come from the same captured cache; the
attention views come from :func:`kvedit.attention_share` on each cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import kvedit
from kvedit.spans import tokens_in_ranges

from .parse import InputError, Limits, Request, parse_request, split_prompt
from .render import GroupShare, context_pieces, render_status, render_views

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["Highlighter", "SteerResult"]


@dataclass(frozen=True)
class SteerResult:
    """What one request shows: both answers, the attention views, the cache file, a status."""

    baseline: str
    steered: str
    before_html: str
    after_html: str
    cache_path: str | None
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
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits or Limits()

    def parse(
        self, context: str, emphasize: str, suppress: str, strength: float, question: str
    ) -> Request:
        """Validate a request (arguments as for :meth:`run`; see :func:`.parse.parse_request`).

        Raises:
            InputError: with a message for the page.
        """
        return parse_request(context, emphasize, suppress, strength, question, self.limits)

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

        enc = tok(split.prefix, return_offsets_mapping=True)
        n_tokens = len(enc["input_ids"])
        if n_tokens > lim.max_context_tokens:
            raise InputError(
                f"The context is too long: {n_tokens:,} tokens with the chat template "
                f"(max {lim.max_context_tokens:,})."
            )
        offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
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
        before_html, after_html = render_views(
            req.context,
            context_pieces(state, split, before),
            context_pieces(edited, split, after),
            req.emphasize,
            req.suppress,
        )
        return SteerResult(
            baseline=baseline,
            steered=steered,
            before_html=before_html,
            after_html=after_html,
            cache_path=cache_path,
            status=render_status(self.model_name, seconds, n_tokens, strength, groups),
        )
