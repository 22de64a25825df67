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

Auto-highlight picks the spans for you: the context is captured in the same prompt, cut into
passages (paragraphs, the lines of multi-line ones; sentences when that gives one passage) and
:func:`kvedit.choose` (:func:`kvedit.focus`'s scoring, no edit) scores each by the attention the question gives it against a
content-free version of the question. The best ``top_k`` go into the Emphasize box and the
scores are drawn as bars; nothing is steered until Run.

Prompt: the model's chat template around ``<context>\\n\\nQuestion: <question>``, cut where the
context ends. The captured state is everything up to the end of the context (template header
included); the continuation is the question, the end of the user turn and the assistant header.

Modules:

- :mod:`.parse`: spans from the boxes and the ``[[emphasize]]`` / ``{{suppress}}`` markup,
  validation and limits (no model, no Gradio);
- :mod:`.steer`: :class:`Highlighter`, the model side (capture, edit, answer, attention shares,
  Auto-highlight's passage scores);
- :mod:`.render`: the attention-coloured HTML of the context, the difference view (after
  minus before), the passage-score bars and the status lines;
- :mod:`.samples`: the lost-in-the-middle samples and the one-click examples;
- :mod:`.layout`: the Highlight tab's components (the status under Run);
- :mod:`.ui`: the Gradio page, its events (panels of an old request emptied when its inputs
  change), the ``/steer`` and ``/focus`` endpoints, :func:`serve` and :func:`main`;
- :mod:`.memory_view` and :mod:`.memory_tab`: the Memory tab, a chat in a
  :class:`kvedit.Memory` under a byte budget and the chart of what it holds, per message and
  per layer (kept, quantized, forgotten), after every turn.

In a checkout this package is ``apps.highlight``; the wheel installs the same files as
``kvedit_apps.highlight``, which ``kvedit app`` imports. Start it with
``kvedit app [--model NAME] [--port P] [--host H]`` or ``python -m apps.highlight``. It binds
to 127.0.0.1 unless told otherwise. Scripts call the ``/steer`` endpoint with
``gradio_client``::

    from gradio_client import Client
    baseline, steered, *_ = Client("http://127.0.0.1:7860/").predict(
        context, "span to emphasize", "", 2.0, "the question?", api_name="/steer")

and the ``/focus`` endpoint (Auto-highlight: context, question, ``top_k`` passages to pick,
default 1) returns the Emphasize-box text, the scores as HTML, one
``{"passage", "start", "end", "score", "chosen"}`` dict per passage (``start``/``end``:
characters of the context, inline markers removed) and a status line; on bad input the text is
empty and the status says why::

    client = Client("http://127.0.0.1:7860/")
    emphasize, _, passages, status = client.predict(
        context, "the question?", 1, api_name="/focus")
    baseline, steered, *_ = client.predict(
        context, emphasize, "", 2.0, "the question?", api_name="/steer")

Every request is handled on its own: the model and tokenizer are shared read-only, and nothing
module-level changes per request (kvedit keeps each thread's attention plan apart).
"""

from __future__ import annotations

from .parse import (
    QUESTION_SEPARATOR,
    FocusRequest,
    InputError,
    Limits,
    Marked,
    PromptSplit,
    Range,
    Request,
    locate,
    parse_focus_request,
    parse_request,
    span_lines,
    split_prompt,
    strip_markers,
)
from .render import (
    GroupShare,
    Piece,
    context_pieces,
    legend,
    render_attention,
    render_difference,
    render_focus_status,
    render_scores,
    render_status,
)
from .samples import (
    EXAMPLES,
    SAMPLE_POSITION,
    SAMPLE_RECORDS,
    SAMPLE_TRIALS,
    ShortExample,
    sample_examples,
    sample_fields,
)
from .steer import FocusResult, Highlighter, SteerResult
from .ui import (
    DEFAULT_HOST,
    DEFAULT_MODEL,
    DEFAULT_PORT,
    METHOD_NOTE,
    add_arguments,
    build_app,
    build_parser,
    main,
    serve,
)

_Piece = Piece  # the name before the split into modules

__all__ = [
    "DEFAULT_HOST",
    "EXAMPLES",
    "DEFAULT_MODEL",
    "DEFAULT_PORT",
    "METHOD_NOTE",
    "QUESTION_SEPARATOR",
    "SAMPLE_POSITION",
    "SAMPLE_RECORDS",
    "SAMPLE_TRIALS",
    "FocusRequest",
    "FocusResult",
    "GroupShare",
    "Highlighter",
    "InputError",
    "Limits",
    "Marked",
    "Piece",
    "PromptSplit",
    "Range",
    "Request",
    "ShortExample",
    "SteerResult",
    "add_arguments",
    "build_app",
    "build_parser",
    "context_pieces",
    "legend",
    "locate",
    "main",
    "parse_focus_request",
    "parse_request",
    "render_attention",
    "render_difference",
    "render_focus_status",
    "render_scores",
    "render_status",
    "sample_examples",
    "sample_fields",
    "serve",
    "span_lines",
    "split_prompt",
    "strip_markers",
]
