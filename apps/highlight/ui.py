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
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

import kvedit  # noqa: E402
from kvedit.errors import KVEditError  # noqa: E402

from .layout import METHOD_NOTE, Page, build_page  # noqa: E402
from .memory_tab import build_memory_tab  # noqa: E402
from .parse import InputError  # noqa: E402
from .samples import EXAMPLES, ShortExample, sample_examples, sample_fields  # noqa: E402
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

_ADD_SELECTION_JS = """
(spans, status) => {
  const box = document.querySelector('#context textarea');
  const picked = box ? box.value.substring(box.selectionStart, box.selectionEnd).trim() : '';
  if (!picked) return [spans, '**Not added:** select some text in the context first, then press the button.'];
  const lines = (spans || '').split('\\n').map((line) => line.trim()).filter(Boolean);
  if (!lines.includes(picked)) lines.push(picked);
  return [lines.join('\\n'), ''];
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

    with (
        gr.Blocks(
            title="kvedit highlight", analytics_enabled=False, delete_cache=delete_cache
        ) as demo,
        gr.Tabs(),
    ):
        with gr.Tab("Highlight", id="highlight-tab", elem_id="highlight-tab"):
            page = build_page(lim, EXAMPLES)
            _wire_steer(page, highlighter)
            _wire_focus(page, highlighter)
            _wire_selection_and_samples(page, samples)
            _wire_examples(page, EXAMPLES)
            _wire_staleness(page)
        with gr.Tab("Memory", id="memory-tab", elem_id="memory-tab"):
            build_memory_tab(highlighter.model, highlighter.tokenizer, highlighter.model_name)
    demo.queue(default_concurrency_limit=concurrency)
    return demo


def cleared(components: Sequence[gr.components.Component]) -> tuple:
    """What empties each of ``components``: no value (a panel, a file), ``""`` for text."""
    return tuple(
        "" if isinstance(c, gr.Textbox | gr.Markdown | gr.HTML) else None for c in components
    )


def _wire_staleness(page: Page) -> None:
    """Panels true for one request are emptied as soon as its inputs change: a typed context
    empties the hint, the passage scores, the answers, the views and the status; typed spans or
    a typed question all of those but the hint."""
    on_context = [page.hint, *page.picks, *page.results, page.status]
    on_request = [*page.picks, *page.results, page.status]
    page.context.input(
        lambda: cleared(on_context), None, on_context, api_visibility="private", queue=False
    )
    for box in (page.emphasize, page.suppress, page.question):
        box.input(
            lambda: cleared(on_request), None, on_request, api_visibility="private", queue=False
        )


def _wire_steer(page: Page, highlighter: Highlighter) -> None:
    """Run and Enter in the question box answer with ``highlighter`` (the answers, the views,
    their difference); the ``/steer`` endpoint, on a button never shown, gives the same
    without the difference view (its documented six outputs)."""

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
        *shown, _, cache_path, status = steer_in_page(
            context, emphasize, suppress, strength, question
        )
        return *shown, cache_path, status

    def steer_in_page(
        context: str, emphasize: str, suppress: str, strength: float, question: str
    ) -> tuple[str, str, str, str, str, str | None, str]:
        """:func:`steer` with the difference view before the cache file."""
        save_dir = Path(page.cache_file.GRADIO_CACHE) / "kvedit-highlight" / uuid.uuid4().hex
        try:
            r = highlighter.run(context, emphasize, suppress, strength, question, save_dir)
        except InputError as e:
            return "", "", "", "", "", None, f"**Not run:** {e}"
        except (KVEditError, ValueError) as e:
            return "", "", "", "", "", None, f"**Not run** ({type(e).__name__}): {e}"
        except Exception as e:  # shown in the page; the trace goes to the server log
            log.exception("highlight request failed")
            return "", "", "", "", "", None, f"**Internal error** ({type(e).__name__}): {e}"
        views = (r.before_html, r.after_html, r.diff_html)
        return r.baseline, r.steered, *views, r.cache_path, r.status

    inputs = [page.context, page.emphasize, page.suppress, page.strength, page.question]
    outputs = [*page.results, page.status]
    for trigger in (page.run.click, page.question.submit):
        trigger(steer_in_page, inputs, outputs, api_visibility="private", concurrency_id="steer")
    api_outputs = [o for o in outputs if o is not page.diff]
    gr.Button(visible=False, elem_id="steer-api").click(
        steer, inputs, api_outputs, api_name="steer", concurrency_id="steer"
    )


def _wire_focus(page: Page, highlighter: Highlighter) -> None:
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


def _wire_selection_and_samples(page: Page, samples: Sequence) -> None:
    """The selection buttons (in the browser; a span added empties the panels it made stale)
    and "Load a sample" (a private endpoint)."""
    stale = [*page.picks, *page.results, page.status]

    def next_sample(index: int) -> tuple:
        """Load the next sample: context, question, the gold record to emphasize, a hint,
        and empty what the previous request showed."""
        example = samples[index % len(samples)]
        text, ask, note = sample_fields(example)
        return text, ask, example.gold_document or "", "", note, *cleared(stale), index + 1

    def after_selection(status: str) -> tuple:
        """A span added: the panels of the old span list are emptied (nothing added: kept)."""
        if status.startswith("**Not added:**"):
            return tuple(gr.skip() for _ in stale[:-1])
        return cleared(stale[:-1])

    # Selections are read in the browser when a button is pressed (no server round trip,
    # so the span is exactly what is selected at that moment).
    emphasize, suppress, status = page.emphasize, page.suppress, page.status
    for button, box in ((page.add_emphasis, emphasize), (page.add_suppression, suppress)):
        button.click(None, [box, status], [box, status], js=_ADD_SELECTION_JS, queue=False).then(
            after_selection, status, stale[:-1], api_visibility="private", queue=False
        )
    page.load_sample.click(
        next_sample,
        page.sample_index,
        [page.context, page.question, emphasize, suppress, page.hint, *stale, page.sample_index],
        api_visibility="private",
    )


def _wire_examples(page: Page, examples: Sequence[ShortExample]) -> None:
    """Each example's button fills the context, the spans and the question and its note, and
    empties what the previous request showed."""
    fields = [page.context, page.emphasize, page.suppress, page.question, page.hint]
    stale = [*page.picks, *page.results, page.status]
    for button, example in zip(page.examples, examples, strict=True):

        def fill(example: ShortExample = example) -> tuple:
            e = example
            return e.context, e.emphasize, e.suppress, e.question, e.note, *cleared(stale)

        button.click(fill, None, [*fields, *stale], api_visibility="private", queue=False)


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
