"""Which documents a question points at: bias-corrected attention scores (``auto``, ``reread``).

The question's attention share of each document is read once per example, for the real
question and for its content-free version (:func:`content_free_question`); their log ratio
scores the documents (:func:`document_scores`), and :func:`choose_documents` takes the best.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from kvedit.evals.methods.context import ExampleContext
from kvedit.readout import attention_share

__all__ = [
    "choose_documents",
    "content_free_question",
    "document_scores",
    "layer_slice",
    "question_shares",
]


def content_free_question(question: str, documents: Sequence[str]) -> str:
    """The question with its *distinctive* words removed: words that occur in some documents
    but not most of them (names, entities). What is left keeps the question's form and
    position, and serves as a calibration query for positional bias. Task-agnostic: it uses
    only the question and the documents, never the task's wording. ``"?"`` when nothing was
    removed.
    """
    words = re.findall(r"\w+|\W+", question)
    lowered = [d.lower() for d in documents]
    n = max(1, len(documents))
    kept = []
    for w in words:
        if w.strip() and w[0].isalnum():
            df = sum(1 for d in lowered if re.search(r"\b" + re.escape(w.lower()) + r"\b", d))
            if 0 < df <= max(1, n // 2):
                continue
        kept.append(w)
    out = "".join(kept)
    out = re.sub(r"\s+", " ", out).strip()
    return out if out != question.strip() else "?"


def question_shares(ctx: ExampleContext) -> tuple[torch.Tensor, torch.Tensor]:
    """``(real, calib)``: ``[layers, n_docs]`` attention shares of each document, from the real
    question and from its content-free version (see :func:`content_free_question`), computed
    once per example (``ctx.notes["shares"]``)."""

    def compute() -> tuple[torch.Tensor, torch.Tensor]:
        ex = ctx.example
        spans = ctx.doc_spans
        question_cont = ctx.continuation
        calib_question = content_free_question(ex.question, ex.documents)
        calib_cont = question_cont.replace(ex.question, calib_question, 1)
        real = attention_share(ctx.state, question_cont, spans).per_layer  # [L, n_docs]
        calib = attention_share(ctx.state, calib_cont, spans).per_layer
        return real, calib

    return ctx.memo("shares", compute)


def layer_slice(layers: tuple[float, float], n_layers: int) -> slice:
    """The layers ``[lo, hi)`` as fractions of the depth, at least one layer."""
    lo, hi = layers
    return slice(int(lo * n_layers), max(int(lo * n_layers) + 1, int(hi * n_layers)))


def document_scores(ctx: ExampleContext, layers: tuple[float, float] = (0.0, 1.0)) -> torch.Tensor:
    """Per-document relevance ``[n_docs]`` from the question's attention, bias-corrected.

    ``share(question) / share(content-free question)`` per document and layer, averaged in log
    space over the layers ``layers`` (fractions of the depth): positional bias (lost in the
    middle, recency, the sink) appears in both queries and cancels; the question's content
    does not.
    """
    real, calib = question_shares(ctx)
    eps = 1e-6
    lift = torch.log(real + eps) - torch.log(calib + eps)  # [L, n_docs]
    return lift[layer_slice(layers, lift.shape[0])].mean(0)


def choose_documents(ctx: ExampleContext, layers: tuple[float, float], top_k: int) -> list[int]:
    """The indices of the ``top_k`` best-scored documents (:func:`document_scores`), best first."""
    scores = document_scores(ctx, layers)
    k = max(1, min(top_k, scores.numel()))
    return scores.topk(k).indices.tolist()
