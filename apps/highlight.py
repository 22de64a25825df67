"""The highlight app: mark spans of a context, steer the model's attention, compare the answers.

Paste a context (or load a lost-in-the-middle sample), mark spans to emphasize or suppress,
set a strength and ask a question. The app answers twice from the same captured cache of the
context: as captured (baseline) and after a cache edit (steered), and colours the context by
the share of attention each token gets from the question, before and after the edit.

Steering is a cache-level edit: the context is captured once with :func:`kvedit.capture`, then
:func:`kvedit.ops.emphasize` / :func:`kvedit.ops.suppress` store a ±strength bias on the spans'
keys. That is the decode scope of :func:`kvedit.steer`: the context's own encoding is unchanged,
the question and answer tokens see the bias. The edited cache can be downloaded and reloaded
with :func:`kvedit.load_state`.

Prompt: the model's chat template around ``<context>\\n\\nQuestion: <question>``, cut where the
context ends. The captured state is everything up to the end of the context (template header
included); the continuation is the question, the end of the user turn and the assistant header.

Start it with ``kvedit app [--model NAME] [--port P] [--host H]`` or
``python -m apps.highlight``. It binds to 127.0.0.1 unless told otherwise. Scripts call the
``/steer`` endpoint with ``gradio_client``::

    from gradio_client import Client
    baseline, steered, *_ = Client("http://127.0.0.1:7860/").predict(
        context, "span to emphasize", "", 2.0, "the question?", api_name="/steer")

Every request is handled on its own: the model and tokenizer are shared read-only, and nothing
module-level changes per request (kvedit keeps each thread's attention plan apart).
"""

from __future__ import annotations

import argparse
import html
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import torch  # noqa: E402

import kvedit  # noqa: E402
from kvedit.errors import KVEditError  # noqa: E402
from kvedit.evals.tasks import Example, records_examples  # noqa: E402
from kvedit.spans import tokens_in_ranges  # noqa: E402
from kvedit.state import KVState, templated_prompt  # noqa: E402

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_MODEL",
    "DEFAULT_PORT",
    "Highlighter",
    "InputError",
    "Limits",
    "Marked",
    "PromptSplit",
    "Request",
    "SteerResult",
    "build_app",
    "main",
    "serve",
    "span_lines",
    "split_prompt",
    "strip_markers",
]

log = logging.getLogger("kvedit.apps.highlight")

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860

QUESTION_SEPARATOR = "\n\nQuestion: "
"""Put between the context and the question in the user message."""

METHOD_NOTE = (
    "**Steering method:** a cache edit. The context is captured once; "
    "`kvedit.ops.emphasize` / `kvedit.ops.suppress` store a ±strength bias (in nats) on the "
    "spans' keys (the decode scope of `kvedit.steer`): the context's own encoding is unchanged, "
    "the question and the answer see the bias. Both answers are greedy and come from the same "
    "captured cache."
)

# Samples: 20 records with the asked-about one in the middle, where small models lose it.
SAMPLE_RECORDS = 20
SAMPLE_POSITION = 10
SAMPLE_TRIALS = 50

# Colours of the attention view.
_HEAT_RGB = "234, 88, 12"  # orange
_EMPHASIZE_COLOR = "#16a34a"  # green underline
_SUPPRESS_COLOR = "#dc2626"  # red dashed underline

_MARKER = re.compile(r"\[\[(.*?)\]\]|\{\{(.*?)\}\}", re.DOTALL)
_STRAY_MARKER = re.compile(r"\[\[|\]\]|\{\{|\}\}")

Range = tuple[int, int]


class InputError(ValueError):
    """A request the app refuses. The message is written for the page, not for a log."""


@dataclass(frozen=True)
class Limits:
    """Input size limits (a CPU answers a 1,500-token context in a few seconds).

    Attributes:
        max_context_chars: characters of the context, markers removed.
        max_context_tokens: tokens of the captured prompt (chat template and context).
        max_question_chars: characters of the question.
        max_spans: spans per request (listed and inline, emphasized and suppressed).
        max_strength: the largest strength in nats.
        max_new_tokens: tokens generated per answer.
    """

    max_context_chars: int = 12_000
    max_context_tokens: int = 1_536
    max_question_chars: int = 500
    max_spans: int = 32
    max_strength: float = 10.0
    max_new_tokens: int = 48


@dataclass(frozen=True)
class Marked:
    """A context with its inline markers removed.

    Attributes:
        context: the text without ``[[``/``]]``/``{{``/``}}``.
        emphasize: character ranges in ``context`` that were marked ``[[...]]``.
        suppress: character ranges in ``context`` that were marked ``{{...}}``.
    """

    context: str
    emphasize: tuple[Range, ...]
    suppress: tuple[Range, ...]


@dataclass(frozen=True)
class Request:
    """A validated request.

    Attributes:
        context: the context, markers removed.
        emphasize: character ranges of ``context`` to emphasize (listed and inline spans).
        suppress: character ranges of ``context`` to suppress.
        strength: nats, in ``[0, Limits.max_strength]``.
        question: the question, stripped.
    """

    context: str
    emphasize: tuple[Range, ...]
    suppress: tuple[Range, ...]
    strength: float
    question: str


@dataclass(frozen=True)
class PromptSplit:
    """The chat-templated prompt, cut where the context ends.

    Attributes:
        prefix: the text to capture (template header and context).
        continuation: the question, the end of the user turn and the assistant header.
        context_start: where the context starts in ``prefix``; it ends at ``len(prefix)``.
    """

    prefix: str
    continuation: str
    context_start: int

    def shift(self, ranges: Sequence[Range]) -> list[Range]:
        """Character ranges of the context as ranges of :attr:`prefix`."""
        return [(a + self.context_start, b + self.context_start) for a, b in ranges]


@dataclass(frozen=True)
class SteerResult:
    """What one request shows: both answers, the attention views, the cache file, a status."""

    baseline: str
    steered: str
    before_html: str
    after_html: str
    cache_path: str | None
    status: str


# ---------------------------------------------------------------------------------------------
# Parsing the request
# ---------------------------------------------------------------------------------------------


def _excerpt(text: str, at: int, width: int = 30) -> str:
    """A short quoted excerpt of ``text`` around character ``at`` for messages."""
    lo, hi = max(0, at - width), min(len(text), at + width)
    snippet = text[lo:hi].replace("\n", " ")
    return f"“{'…' if lo else ''}{snippet}{'…' if hi < len(text) else ''}”"


def strip_markers(text: str) -> Marked:
    """Remove inline ``[[emphasize]]`` and ``{{suppress}}`` markers, keeping where they were.

    Raises:
        InputError: a marker without its pair, nested markers, or an empty marked span.
    """
    parts: list[str] = []
    emphasize: list[Range] = []
    suppress: list[Range] = []
    length = 0
    last = 0

    def plain(piece: str, offset: int) -> None:
        stray = _STRAY_MARKER.search(piece)
        if stray:
            raise InputError(
                f"Unmatched `{stray.group()}` near {_excerpt(text, offset + stray.start())}: "
                "inline markers come in pairs, `[[like this]]` to emphasize and "
                "`{{like this}}` to suppress."
            )

    for match in _MARKER.finditer(text):
        before = text[last : match.start()]
        plain(before, last)
        parts.append(before)
        length += len(before)
        is_emphasis = match.group(1) is not None
        inner = match.group(1) if is_emphasis else match.group(2)
        if _STRAY_MARKER.search(inner):
            raise InputError(
                f"Nested markers near {_excerpt(text, match.start())}: a span is marked "
                "either `[[...]]` or `{{...}}`, once."
            )
        if not inner.strip():
            raise InputError(f"Empty marked span near {_excerpt(text, match.start())}.")
        (emphasize if is_emphasis else suppress).append((length, length + len(inner)))
        parts.append(inner)
        length += len(inner)
        last = match.end()
    plain(text[last:], last)
    parts.append(text[last:])
    return Marked("".join(parts), tuple(emphasize), tuple(suppress))


def span_lines(text: str | None) -> list[str]:
    """The spans of a one-span-per-line text box (stripped; blank lines skipped)."""
    return [line.strip() for line in (text or "").splitlines() if line.strip()]


def locate(context: str, spans: Sequence[str], action: str) -> list[Range]:
    """Every occurrence of each span in ``context``, as character ranges.

    Raises:
        InputError: some span does not occur in the context (all missing ones are named).
    """
    ranges: list[Range] = []
    missing: list[str] = []
    for span in spans:
        found = [(m.start(), m.end()) for m in re.finditer(re.escape(span), context)]
        if not found:
            missing.append(span)
        ranges.extend(found)
    if missing:
        shown = "; ".join(f"“{s[:80]}{'…' if len(s) > 80 else ''}”" for s in missing)
        noun = "Span" if len(missing) == 1 else "Spans"
        raise InputError(
            f"{noun} to {action} not found in the context: {shown}. A span must appear in the "
            "context exactly (case, spaces and punctuation count)."
        )
    return ranges


def split_prompt(tokenizer, context: str, question: str) -> PromptSplit:
    """Template ``context + QUESTION_SEPARATOR + question`` and cut it after the context."""
    user = context + QUESTION_SEPARATOR + question
    full = templated_prompt(tokenizer, user)
    start = full.find(user)
    if start < 0:  # the template rewrote the message: fall back to the plain text
        full, start = user, 0
    cut = start + len(context)
    return PromptSplit(full[:cut], full[cut:], start)


def _overlap(a: Sequence[Range], b: Sequence[Range]) -> Range | None:
    for a0, a1 in a:
        for b0, b1 in b:
            if a0 < b1 and b0 < a1:
                return max(a0, b0), min(a1, b1)
    return None


# ---------------------------------------------------------------------------------------------
# The attention view
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    start: int  # character range in the context
    end: int
    share: float  # share of the question's attention on the token(s)


def _context_pieces(state: KVState, split: PromptSplit, token_share: torch.Tensor) -> list[_Piece]:
    """The context's tokens as character ranges of the context, with their attention share.

    Tokens are clipped to the context; tokens sharing characters (a character split over
    byte-level tokens) are merged and their shares added.
    """
    lo, hi = split.context_start, len(split.prefix)
    pieces: list[_Piece] = []
    for (a, b), share in zip(state.offsets.tolist(), token_share.tolist(), strict=True):
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if pieces and a < pieces[-1].end + lo:
            last = pieces.pop()
            pieces.append(_Piece(last.start, max(last.end, b - lo), last.share + share))
        else:
            pieces.append(_Piece(a - lo, b - lo, share))
    return pieces


def _marks(start: int, end: int, emphasize: Sequence[Range], suppress: Sequence[Range]) -> str:
    if any(a < end and start < b for a, b in emphasize):
        return f"border-bottom:3px solid {_EMPHASIZE_COLOR};"
    if any(a < end and start < b for a, b in suppress):
        return f"border-bottom:3px dashed {_SUPPRESS_COLOR};"
    return ""


def render_attention(
    title: str,
    context: str,
    pieces: Sequence[_Piece],
    scale: float,
    emphasize: Sequence[Range],
    suppress: Sequence[Range],
) -> str:
    """HTML of the context with each token's background as strong as its attention share.

    ``scale`` is the share drawn at full strength (the same for "before" and "after", so the two
    views compare); intensity grows with the square root of the share so small shares show.
    """
    out: list[str] = []
    cursor = 0
    for piece in pieces:
        if piece.start > cursor:
            out.append(html.escape(context[cursor : piece.start]))
        alpha = 0.9 * math.sqrt(max(piece.share, 0.0) / scale) if scale > 0 else 0.0
        style = f"background:rgba({_HEAT_RGB},{alpha:.3f});" + _marks(
            piece.start, piece.end, emphasize, suppress
        )
        text = html.escape(context[piece.start : piece.end])
        out.append(f'<span style="{style}" title="{100 * piece.share:.2f}%">{text}</span>')
        cursor = piece.end
    out.append(html.escape(context[cursor:]))
    return (
        '<div class="kvedit-attention" style="padding:2px 4px">'
        f'<div style="font-weight:600;margin-bottom:4px">'
        f"{html.escape(title)}</div>"
        '<div style="white-space:pre-wrap;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;'
        "font-size:13px;line-height:1.8;max-height:420px;overflow-y:auto;padding:8px;"
        'border:1px solid #d1d5db;border-radius:8px">' + "".join(out) + "</div></div>"
    )


def _legend(scale: float) -> str:
    return (
        f"Darker = more of the question's attention (mean over layers, heads and question "
        f"tokens; full colour = {100 * scale:.1f}% on one token, same scale before and after). "
        f"Green underline: emphasized; red dashed: suppressed. Hover a token for its share."
    )


# ---------------------------------------------------------------------------------------------
# The model side: one request in, one result out
# ---------------------------------------------------------------------------------------------


class Highlighter:
    """Answers highlight requests with one model.

    The model and tokenizer are only read; :meth:`run` keeps everything it computes in local
    variables, so requests may run in parallel threads.
    """

    def __init__(self, model, tokenizer, model_name: str, limits: Limits | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits or Limits()

    # -- validation ----------------------------------------------------------------------------

    def parse(
        self, context: str, emphasize: str, suppress: str, strength: float, question: str
    ) -> Request:
        """Validate a request (arguments as for :meth:`run`).

        Raises:
            InputError: with a message for the page.
        """
        lim = self.limits
        if not context or not context.strip():
            raise InputError("The context is empty: paste a text or load a sample.")
        marked = strip_markers(context)
        if len(marked.context) > lim.max_context_chars:
            raise InputError(
                f"The context is too long: {len(marked.context):,} characters "
                f"(max {lim.max_context_chars:,})."
            )
        question = (question or "").strip()
        if not question:
            raise InputError("Ask a question about the context.")
        if len(question) > lim.max_question_chars:
            raise InputError(
                f"The question is too long: {len(question):,} characters "
                f"(max {lim.max_question_chars:,})."
            )
        try:
            strength = float(strength)
        except (TypeError, ValueError):
            raise InputError(f"Strength must be a number of nats, not {strength!r}.") from None
        if not math.isfinite(strength) or not 0 <= strength <= lim.max_strength:
            raise InputError(f"Strength must be between 0 and {lim.max_strength:g} nats.")
        listed_emph, listed_supp = span_lines(emphasize), span_lines(suppress)
        n_spans = len(listed_emph) + len(listed_supp) + len(marked.emphasize) + len(marked.suppress)
        if n_spans == 0:
            raise InputError(
                "Mark at least one span: list it under Emphasize or Suppress, select it in the "
                "context and press a button, or write `[[span]]` / `{{span}}` in the context."
            )
        if n_spans > lim.max_spans:
            raise InputError(f"Too many spans: {n_spans} (max {lim.max_spans}).")
        emph = [*marked.emphasize, *locate(marked.context, listed_emph, "emphasize")]
        supp = [*marked.suppress, *locate(marked.context, listed_supp, "suppress")]
        both = _overlap(emph, supp)
        if both:
            raise InputError(
                f"“{marked.context[both[0] : both[1]][:80]}” is marked both to emphasize and to "
                "suppress; a token can only be one."
            )
        return Request(marked.context, tuple(emph), tuple(supp), strength, question)

    # -- the request ---------------------------------------------------------------------------

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
        before_pieces = _context_pieces(state, split, before)
        after_pieces = _context_pieces(edited, split, after)
        scale = max([p.share for p in before_pieces + after_pieces] + [1e-9])

        def group_share(shares: torch.Tensor, tokens: torch.Tensor) -> str:
            return f"{100 * float(shares[tokens].sum()):.1f}%"

        lines = []
        for name, tokens in (("emphasized", emph_tokens), ("suppressed", supp_tokens)):
            if len(tokens):
                lines.append(
                    f"{name} spans ({len(tokens)} token{'s' * (len(tokens) != 1)}): "
                    f"{group_share(before, tokens)} → **{group_share(after, tokens)}**"
                )

        cache_path = None
        if save_dir is not None:
            save_dir.mkdir(parents=True, exist_ok=True)
            cache_path = str(save_dir / "edited-cache.kv")
            edited.save(cache_path)

        seconds = time.perf_counter() - t0
        status = (
            f"**Done** in {seconds:.1f} s on `{self.model_name}` ({n_tokens:,} context tokens, "
            f"strength {strength:g} nats). Share of the question's attention, before → after: "
            + "; ".join(lines)
            + "."
        )

        def view(title: str, pieces: list[_Piece]) -> str:
            return render_attention(title, req.context, pieces, scale, req.emphasize, req.suppress)

        legend = (
            '<div style="font-size:12px;opacity:.8;margin-top:4px">'
            f"{html.escape(_legend(scale))}</div>"
        )
        return SteerResult(
            baseline=baseline,
            steered=steered,
            before_html=view("Before: the captured cache", before_pieces),
            after_html=view("After: the edited cache", after_pieces) + legend,
            cache_path=cache_path,
            status=status,
        )


# ---------------------------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------------------------


def sample_examples() -> list[Example]:
    """Lost-in-the-middle samples: 20 records, the asked-about record in the middle."""
    return records_examples(
        n_records=SAMPLE_RECORDS, positions=(SAMPLE_POSITION,), trials=SAMPLE_TRIALS, seed=0
    )


def sample_fields(example: Example) -> tuple[str, str, str]:
    """``(context, question, hint markdown)`` of a sample."""
    context = example.user_message()[: example.documents_end()]
    gold = example.gold_document or ""
    hint = (
        f"**Sample** `{example.id}`: {len(example.documents)} records; the question asks about "
        f"record {example.gold_index + 1}, in the middle, where small models often lose it. "
        f"Gold record (the hint): `{gold}` It is in the Emphasize box; press **Run** and "
        f"compare the answers (expected: {example.answers[0]})."
    )
    return context, example.question, hint


# ---------------------------------------------------------------------------------------------
# The Gradio app
# ---------------------------------------------------------------------------------------------

_INTRO = """\
# kvedit highlight
Mark the spans of a context that the model should attend to (or ignore), ask a question, and
compare the model's answer before and after editing its KV cache.
Mark spans by listing them (one per line), by selecting text in the context and pressing
**Emphasize selection** / **Suppress selection**, or inline: `[[emphasize this]]`,
`{{suppress this}}` (the markers are removed before the model reads the context).
"""


_ADD_SELECTION_JS = """
(spans, status) => {
  const box = document.querySelector('#context textarea');
  const picked = box ? box.value.substring(box.selectionStart, box.selectionEnd).trim() : '';
  if (!picked) return [spans, '**Not added:** select some text in the context first, then press the button.'];
  const lines = (spans || '').split('\\n').map((line) => line.trim()).filter(Boolean);
  if (!lines.includes(picked)) lines.push(picked);
  return [lines.join('\\n'), status];
}
"""
"""Append the text selected in the context box to a span list (runs in the browser)."""


def build_app(
    highlighter: Highlighter,
    concurrency: int = 2,
    delete_cache: tuple[int, int] | None = (600, 3600),
) -> gr.Blocks:
    """The Gradio Blocks of the app; the Run button is the ``/steer`` API endpoint.

    Args:
        highlighter: answers the requests.
        concurrency: requests answered at the same time (the rest wait in the queue).
        delete_cache: ``(every, age)`` in seconds: every ``every`` seconds, edited-cache files
            older than ``age`` are deleted (``None`` keeps them until the server stops).
    """
    samples = sample_examples()
    lim = highlighter.limits

    with gr.Blocks(
        title="kvedit highlight", analytics_enabled=False, delete_cache=delete_cache
    ) as demo:
        gr.Markdown(_INTRO + "\n" + METHOD_NOTE)
        sample_index = gr.State(0)  # per browser session: the next sample to load
        with gr.Row():
            with gr.Column(scale=3):
                context = gr.Textbox(
                    label=f"Context (max {lim.max_context_chars:,} characters)",
                    lines=12,
                    max_lines=24,
                    placeholder="Paste a text. Mark [[spans to emphasize]] and {{spans to "
                    "suppress}} inline, or select text and press a button below.",
                    elem_id="context",
                )
                with gr.Row():
                    add_emphasis = gr.Button("Emphasize selection", size="sm")
                    add_suppression = gr.Button("Suppress selection", size="sm")
                    load_sample = gr.Button("Load a sample", size="sm", elem_id="load-sample")
                hint = gr.Markdown(elem_id="hint")
            with gr.Column(scale=2):
                emphasize = gr.Textbox(
                    label="Emphasize (one span per line)", lines=3, elem_id="emphasize"
                )
                suppress = gr.Textbox(
                    label="Suppress (one span per line)", lines=2, elem_id="suppress"
                )
                strength = gr.Slider(
                    0.0,
                    lim.max_strength,
                    value=2.0,
                    step=0.5,
                    label="Strength (nats added to the spans' attention logits)",
                    elem_id="strength",
                )
                question = gr.Textbox(
                    label="Question", placeholder="What is ...?", lines=1, elem_id="question"
                )
                run = gr.Button("Run", variant="primary", elem_id="run")
        status = gr.Markdown("", label="Status", elem_id="status")
        with gr.Row():
            baseline = gr.Textbox(label="Baseline answer", interactive=False, elem_id="baseline")
            steered = gr.Textbox(label="Steered answer", interactive=False, elem_id="steered")
        with gr.Row():
            before = gr.HTML(label="Attention before", elem_id="before")
            after = gr.HTML(label="Attention after", elem_id="after")
        cache_file = gr.File(label="Edited cache (kvedit.load_state)", elem_id="cache")

        def steer(
            context: str, emphasize: str, suppress: str, strength: float, question: str
        ) -> tuple[str, str, str, str, str | None, str]:
            """Answer the question from the captured context, then from the edited cache.

            Args:
                context: the text; ``[[...]]`` marks a span to emphasize, ``{{...}}`` one to
                    suppress (markers are removed).
                emphasize: spans to emphasize, one per line (every occurrence counts).
                suppress: spans to suppress, one per line.
                strength: nats added to (subtracted from) the spans' attention logits.
                question: asked after the context.

            Returns:
                baseline answer, steered answer, attention before (HTML), attention after
                (HTML), the edited cache file, and a status message (errors included).
            """
            save_dir = Path(cache_file.GRADIO_CACHE) / "kvedit-highlight" / uuid.uuid4().hex
            try:
                r = highlighter.run(context, emphasize, suppress, strength, question, save_dir)
            except InputError as e:
                return "", "", "", "", None, f"**Not run:** {e}"
            except (KVEditError, ValueError) as e:
                return "", "", "", "", None, f"**Not run** ({type(e).__name__}): {e}"
            except Exception as e:  # shown in the page; the trace goes to the server log
                log.exception("highlight request failed")
                return "", "", "", "", None, f"**Internal error** ({type(e).__name__}): {e}"
            return r.baseline, r.steered, r.before_html, r.after_html, r.cache_path, r.status

        inputs = [context, emphasize, suppress, strength, question]
        outputs = [baseline, steered, before, after, cache_file, status]
        run.click(steer, inputs, outputs, api_name="steer", concurrency_id="steer")
        question.submit(steer, inputs, outputs, api_visibility="private", concurrency_id="steer")

        def next_sample(index: int) -> tuple[str, str, str, str, str, int]:
            """Load the next sample: context, question, the gold record to emphasize, a hint."""
            example = samples[index % len(samples)]
            text, ask, note = sample_fields(example)
            return text, ask, example.gold_document or "", "", note, index + 1

        # Selections are read in the browser when a button is pressed (no server round trip,
        # so the span is exactly what is selected at that moment).
        add_emphasis.click(
            None, [emphasize, status], [emphasize, status], js=_ADD_SELECTION_JS, queue=False
        )
        add_suppression.click(
            None, [suppress, status], [suppress, status], js=_ADD_SELECTION_JS, queue=False
        )
        load_sample.click(
            next_sample,
            sample_index,
            [context, question, emphasize, suppress, hint, sample_index],
            api_visibility="private",
        )
    demo.queue(default_concurrency_limit=concurrency)
    return demo


def serve(
    model_name: str = DEFAULT_MODEL,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    concurrency: int = 2,
) -> None:
    """Load ``model_name`` and serve the app on ``host:port`` until interrupted."""
    model, tok = kvedit.load_model(model_name)
    demo = build_app(Highlighter(model, tok, model_name), concurrency=concurrency)
    demo.launch(server_name=host, server_port=port, ssr_mode=False, show_error=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvedit app", description="the kvedit highlight app")
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The app's command-line options (shared with ``kvedit app``)."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name or path")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help="interface to bind (0.0.0.0 exposes the app)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    serve(args.model, args.host, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
