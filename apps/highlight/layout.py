"""The highlight page's layout: the components the events of :mod:`.ui` read and write.

The status line sits under Run and Auto-highlight (in the first screen, beside the buttons
that write it); the answers, the attention views and their difference follow under the
context. Nothing here answers a request: :mod:`.ui` wires the events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gradio as gr

from .samples import ShortExample

__all__ = ["INTRO", "METHOD_NOTE", "Page", "build_page"]

METHOD_NOTE = (
    "**Steering method:** a cache edit. The context is captured once; "
    "`kvedit.ops.emphasize` / `kvedit.ops.suppress` store a ±strength bias (in nats) on the "
    "spans' keys (the decode scope of `kvedit.steer`): the context's own encoding is unchanged, "
    "the question and the answer see the bias. Both answers are greedy and come from the same "
    "captured cache."
)

INTRO = """\
# kvedit highlight
Mark the spans of a context that the model should attend to (or ignore), ask a question, and
compare the model's answer before and after editing its KV cache.
Mark spans by listing them (one per line), by selecting text in the context and pressing
**Emphasize selection** / **Suppress selection**, or inline: `[[emphasize this]]`,
`{{suppress this}}` (the markers are removed before the model reads the context).
Or press **Auto-highlight**: the passages the question points at go into the Emphasize box
(`kvedit.focus` scores every passage), then press **Run**.
"""


@dataclass(frozen=True)
class Page:
    """The components of the page that the events read or write."""

    sample_index: gr.State
    context: gr.Textbox
    add_emphasis: gr.Button
    add_suppression: gr.Button
    load_sample: gr.Button
    examples: tuple[gr.Button, ...]
    hint: gr.Markdown
    emphasize: gr.Textbox
    suppress: gr.Textbox
    strength: gr.Slider
    question: gr.Textbox
    top_k: gr.Number
    auto: gr.Button
    run: gr.Button
    status: gr.Markdown
    scores: gr.HTML
    passages: gr.JSON
    baseline: gr.Textbox
    steered: gr.Textbox
    before: gr.HTML
    after: gr.HTML
    diff: gr.HTML
    cache_file: gr.File

    @property
    def picks(self) -> list[gr.components.Component]:
        """Auto-highlight's outputs besides the Emphasize box: true for one context,
        question and span list."""
        return [self.scores, self.passages]

    @property
    def results(self) -> list[gr.components.Component]:
        """Run's outputs besides the status: true for one request."""
        return [
            self.baseline,
            self.steered,
            self.before,
            self.after,
            self.diff,
            self.cache_file,
        ]


def build_page(lim, examples: Sequence[ShortExample]) -> Page:
    """Lay out the page (inside the app's Blocks) with ``lim``'s context and strength limits
    and a button per one-click example."""
    gr.Markdown(INTRO + "\n" + METHOD_NOTE)
    sample_index = gr.State(0)  # per browser session: the next sample to load
    with gr.Row():
        with gr.Column(scale=3):
            left = _context_column(lim, examples)
        with gr.Column(scale=2):
            right = _controls_column(lim)
    with gr.Row():
        baseline = gr.Textbox(label="Baseline answer", interactive=False, elem_id="baseline")
        steered = gr.Textbox(label="Steered answer", interactive=False, elem_id="steered")
    with gr.Row():
        before = gr.HTML(label="Attention before", elem_id="before")
        after = gr.HTML(label="Attention after", elem_id="after")
    diff = gr.HTML(label="Difference (after minus before)", elem_id="diff")
    cache_file = gr.File(label="Edited cache (kvedit.load_state)", elem_id="cache")
    return Page(
        sample_index=sample_index,
        **left,
        **right,
        baseline=baseline,
        steered=steered,
        before=before,
        after=after,
        diff=diff,
        cache_file=cache_file,
    )


def _context_column(lim, examples: Sequence[ShortExample]) -> dict:
    """The context box, the selection buttons, "Load a sample", the examples and the hint."""
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
    with gr.Row(elem_id="examples"):
        gr.Markdown("**Examples:**", elem_id="examples-label")
        buttons = tuple(
            gr.Button(e.name, size="sm", elem_id=f"example-{i}", min_width=60)
            for i, e in enumerate(examples)
        )
    hint = gr.Markdown(elem_id="hint")
    return {
        "context": context,
        "add_emphasis": add_emphasis,
        "add_suppression": add_suppression,
        "load_sample": load_sample,
        "examples": buttons,
        "hint": hint,
    }


def _controls_column(lim) -> dict:
    """The span boxes, strength, question, passage count, Auto-highlight, Run, the status
    under them and the passage scores."""
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
    status = gr.Markdown("", label="Status", elem_id="status")
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
        "status": status,
        "scores": scores,
        "passages": passages,
    }
