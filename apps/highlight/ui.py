"""The Gradio side of the highlight app: the page, the ``/steer`` and ``/focus`` API endpoints,
the server.

:func:`build_app` lays out the page (context, span lists, strength, question, both answers, the
attention views, the edited cache to download); its Run button is the ``/steer`` endpoint and
its Auto-highlight button the ``/focus`` endpoint, the only public ones. The selection buttons
run in the browser; "Load a sample" is a private endpoint. :func:`serve` loads a model and
launches the app; :func:`main` is ``python -m apps.highlight`` (``kvedit app`` in the installed
package).
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

import kvedit  # noqa: E402
from kvedit.errors import KVEditError  # noqa: E402

from .parse import InputError  # noqa: E402
from .samples import sample_examples, sample_fields  # noqa: E402
from .steer import Highlighter  # noqa: E402

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_MODEL",
    "DEFAULT_PORT",
    "METHOD_NOTE",
    "add_arguments",
    "build_app",
    "build_parser",
    "main",
    "serve",
]

log = logging.getLogger("kvedit.apps.highlight")

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860

METHOD_NOTE = (
    "**Steering method:** a cache edit. The context is captured once; "
    "`kvedit.ops.emphasize` / `kvedit.ops.suppress` store a ±strength bias (in nats) on the "
    "spans' keys (the decode scope of `kvedit.steer`): the context's own encoding is unchanged, "
    "the question and the answer see the bias. Both answers are greedy and come from the same "
    "captured cache."
)

_INTRO = """\
# kvedit highlight
Mark the spans of a context that the model should attend to (or ignore), ask a question, and
compare the model's answer before and after editing its KV cache.
Mark spans by listing them (one per line), by selecting text in the context and pressing
**Emphasize selection** / **Suppress selection**, or inline: `[[emphasize this]]`,
`{{suppress this}}` (the markers are removed before the model reads the context).
Or press **Auto-highlight**: the passages the question points at go into the Emphasize box
(`kvedit.focus` scores every passage), then press **Run**.
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
    """The Gradio Blocks of the app; Run is the ``/steer`` API endpoint, Auto-highlight ``/focus``.

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
        page = _page(lim)
        _wire_steer(page, highlighter)
        _wire_focus(page, highlighter)
        _wire_selection_and_samples(page, samples)
    demo.queue(default_concurrency_limit=concurrency)
    return demo


@dataclass(frozen=True)
class _Page:
    """The components of the page that the events read or write."""

    sample_index: gr.State
    context: gr.Textbox
    add_emphasis: gr.Button
    add_suppression: gr.Button
    load_sample: gr.Button
    hint: gr.Markdown
    emphasize: gr.Textbox
    suppress: gr.Textbox
    strength: gr.Slider
    question: gr.Textbox
    top_k: gr.Number
    auto: gr.Button
    run: gr.Button
    scores: gr.HTML
    passages: gr.JSON
    status: gr.Markdown
    baseline: gr.Textbox
    steered: gr.Textbox
    before: gr.HTML
    after: gr.HTML
    cache_file: gr.File


def _page(lim) -> _Page:
    """Lay out the page (inside the app's Blocks) with ``lim``'s context and strength limits."""
    gr.Markdown(_INTRO + "\n" + METHOD_NOTE)
    sample_index = gr.State(0)  # per browser session: the next sample to load
    with gr.Row():
        with gr.Column(scale=3):
            left = _context_column(lim)
        with gr.Column(scale=2):
            right = _controls_column(lim)
    status = gr.Markdown("", label="Status", elem_id="status")
    with gr.Row():
        baseline = gr.Textbox(label="Baseline answer", interactive=False, elem_id="baseline")
        steered = gr.Textbox(label="Steered answer", interactive=False, elem_id="steered")
    with gr.Row():
        before = gr.HTML(label="Attention before", elem_id="before")
        after = gr.HTML(label="Attention after", elem_id="after")
    cache_file = gr.File(label="Edited cache (kvedit.load_state)", elem_id="cache")
    return _Page(
        sample_index=sample_index,
        **left,
        **right,
        status=status,
        baseline=baseline,
        steered=steered,
        before=before,
        after=after,
        cache_file=cache_file,
    )


def _context_column(lim) -> dict[str, gr.components.Component]:
    """The context box, the selection buttons, "Load a sample" and the hint, by field name."""
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
    return {
        "context": context,
        "add_emphasis": add_emphasis,
        "add_suppression": add_suppression,
        "load_sample": load_sample,
        "hint": hint,
    }


def _controls_column(lim) -> dict[str, gr.components.Component]:
    """The span boxes, strength, question, passage count, Auto-highlight, Run and the passage
    scores, by field name."""
    emphasize = gr.Textbox(label="Emphasize (one span per line)", lines=3, elem_id="emphasize")
    suppress = gr.Textbox(label="Suppress (one span per line)", lines=2, elem_id="suppress")
    strength = gr.Slider(
        0.0,
        lim.max_strength,
        value=2.0,
        step=0.5,
        label="Strength (nats added to the spans' attention logits)",
        elem_id="strength",
    )
    question = gr.Textbox(label="Question", placeholder="What is ...?", lines=1, elem_id="question")
    with gr.Row():
        # precision=None: Gradio's precision=0 would round 2.5 to 2 before
        # parse_focus sees it; parse_focus refuses what is not a whole number.
        top_k = gr.Number(
            value=1,
            precision=None,
            step=1,
            label="Passages to pick",
            min_width=100,
            elem_id="top-k",
        )
        auto = gr.Button("Auto-highlight", elem_id="auto-highlight", min_width=100)
        run = gr.Button("Run", variant="primary", elem_id="run", min_width=100)
    scores = gr.HTML(label="Passage scores", elem_id="focus-scores")
    with gr.Accordion("Passage scores (JSON)", open=False):
        passages = gr.JSON(label="Passages", elem_id="focus-passages")
    return {
        "emphasize": emphasize,
        "suppress": suppress,
        "strength": strength,
        "question": question,
        "top_k": top_k,
        "auto": auto,
        "run": run,
        "scores": scores,
        "passages": passages,
    }


def _wire_steer(page: _Page, highlighter: Highlighter) -> None:
    """Run (the ``/steer`` endpoint) and Enter in the question box answer with ``highlighter``."""

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
        save_dir = Path(page.cache_file.GRADIO_CACHE) / "kvedit-highlight" / uuid.uuid4().hex
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

    inputs = [page.context, page.emphasize, page.suppress, page.strength, page.question]
    outputs = [page.baseline, page.steered, page.before, page.after, page.cache_file, page.status]
    page.run.click(steer, inputs, outputs, api_name="steer", concurrency_id="steer")
    page.question.submit(steer, inputs, outputs, api_visibility="private", concurrency_id="steer")


def _wire_focus(page: _Page, highlighter: Highlighter) -> None:
    """Auto-highlight, and the ``/focus`` endpoint on a hidden button, pick passages with
    ``highlighter``."""

    def focus(context: str, question: str, top_k: int = 1) -> tuple[str, str, list, str]:
        """Pick the passages of the context the question points at (nothing is steered).

        Args:
            context: the text (inline markers are removed, as for a run).
            question: asked after the context.
            top_k: how many passages to pick (1 to the limit on spans).

        Returns:
            the picked passages, one per line (Emphasize-box text), the scores (HTML), one
            ``{"passage", "start", "end", "score", "chosen"}`` dict per passage (``start``
            and ``end``: characters of the context without markers), and a status message
            (errors included; then the text is empty).
        """
        return _focus(context, question, top_k, "")

    def focus_in_page(context: str, question: str, top_k: int) -> tuple:
        """:func:`focus` for the button: an error leaves the Emphasize box as it was."""
        return _focus(context, question, top_k, gr.skip())

    def _focus(context: str, question: str, top_k: int, on_error) -> tuple:
        try:
            r = highlighter.focus(context, question, top_k)
        except InputError as e:
            return on_error, "", [], f"**Not run:** {e}"
        except (KVEditError, ValueError) as e:
            return on_error, "", [], f"**Not run** ({type(e).__name__}): {e}"
        except Exception as e:  # shown in the page; the trace goes to the server log
            log.exception("auto-highlight request failed")
            return on_error, "", [], f"**Internal error** ({type(e).__name__}): {e}"
        return r.emphasize, r.scores_html, r.passages, r.status

    # The button and the /focus endpoint differ only on errors: the page keeps the spans
    # typed in the Emphasize box, an API caller gets "" (a skipped output would reach it
    # as a raw update dict). The endpoint hangs on a button that is never shown.
    focus_inputs = [page.context, page.question, page.top_k]
    focus_outputs = [page.emphasize, page.scores, page.passages, page.status]
    page.auto.click(
        focus_in_page,
        focus_inputs,
        focus_outputs,
        api_visibility="private",
        concurrency_id="steer",
    )
    gr.Button(visible=False, elem_id="focus-api").click(
        focus, focus_inputs, focus_outputs, api_name="focus", concurrency_id="steer"
    )


def _wire_selection_and_samples(page: _Page, samples: Sequence) -> None:
    """The selection buttons (in the browser) and "Load a sample" (a private endpoint)."""

    def next_sample(index: int) -> tuple[str, str, str, str, str, str, list, int]:
        """Load the next sample: context, question, the gold record to emphasize, a hint
        (and clear the previous context's passage scores)."""
        example = samples[index % len(samples)]
        text, ask, note = sample_fields(example)
        return text, ask, example.gold_document or "", "", note, "", [], index + 1

    # Selections are read in the browser when a button is pressed (no server round trip,
    # so the span is exactly what is selected at that moment).
    emphasize, suppress, status = page.emphasize, page.suppress, page.status
    page.add_emphasis.click(
        None, [emphasize, status], [emphasize, status], js=_ADD_SELECTION_JS, queue=False
    )
    page.add_suppression.click(
        None, [suppress, status], [suppress, status], js=_ADD_SELECTION_JS, queue=False
    )
    page.load_sample.click(
        next_sample,
        page.sample_index,
        [
            page.context,
            page.question,
            emphasize,
            suppress,
            page.hint,
            page.scores,
            page.passages,
            page.sample_index,
        ],
        api_visibility="private",
    )


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
    """The parser of ``python -m apps.highlight`` (the options of ``kvedit app``)."""
    parser = argparse.ArgumentParser(prog="kvedit app", description="the kvedit highlight app")
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The app's command-line options (``kvedit app`` declares the same ones)."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name or path")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help="interface to bind (0.0.0.0 exposes the app)"
    )


def main(argv: list[str] | None = None) -> int:
    """Serve the app with the options in ``argv`` (default: the command line)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    serve(args.model, args.host, args.port)
    return 0
