"""The app's Memory tab: a chat kept in a :class:`kvedit.Memory` under a byte budget, and the
chart of what it holds (:mod:`.memory_view`), per message and per layer, after every turn.

Each browser session has its own memory (a ``gr.State``), made with the settings in force at
its first message (system message, budget, forgetting policy, bits for older messages); **New
chat** starts over with the settings as they are then. The model is the app's (read only).
Every turn is private: the page's own endpoint, not an API.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass

import gradio as gr

import kvedit
from kvedit.compress import SCORERS
from kvedit.errors import KVEditError

from .memory_view import held_by_message, render_held

__all__ = ["ChatSettings", "MemoryChat", "build_memory_tab"]

log = logging.getLogger("kvedit.apps.highlight")

DEFAULT_SYSTEM = "You are a helpful assistant. Answer in one short sentence."
MAX_MESSAGE_CHARS = 2_000
MAX_BUDGET_KIB = 1 << 20  # 1 GiB
QUANTIZE_CHOICES = ("off", "8", "4", "2")


class ChatInputError(ValueError):
    """A chat request the tab refuses before any work (the message is for the page)."""


@dataclass(frozen=True)
class ChatSettings:
    """A memory's settings, checked: ``budget_kib`` (0: no budget), ``forget`` (None: the
    memory's default), ``quantize`` (None: exact)."""

    system: str
    budget_kib: float
    forget: str | None
    quantize: int | None

    @classmethod
    def parse(cls, system, budget_kib, forget, quantize) -> ChatSettings:
        """Check what the tab's boxes hold.

        Raises:
            ChatInputError: naming the box and its limit.
        """
        if not isinstance(system, str):
            raise ChatInputError(f"The system message must be text, not {type(system).__name__}.")
        if isinstance(budget_kib, bool) or not isinstance(budget_kib, int | float):
            raise ChatInputError("The budget must be a number of KiB (0: no budget).")
        if not math.isfinite(budget_kib) or not 0 <= budget_kib <= MAX_BUDGET_KIB:
            raise ChatInputError(
                f"The budget must be from 0 (no budget) to {MAX_BUDGET_KIB:,} KiB, "
                f"not {budget_kib:g}."
            )
        if forget not in ("default", *SCORERS):
            raise ChatInputError(f"Forgetting policy must be one of {sorted(SCORERS)}.")
        if quantize not in QUANTIZE_CHOICES:
            raise ChatInputError(f"Older messages' bits must be one of {list(QUANTIZE_CHOICES)}.")
        return cls(
            system=system.strip(),
            budget_kib=float(budget_kib),
            forget=None if forget == "default" else forget,
            quantize=None if quantize == "off" else int(quantize),
        )


class MemoryChat:
    """Answers the Memory tab's turns with one model (read only)."""

    def __init__(self, model, tokenizer, model_name: str, max_new_tokens: int = 48):
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_new_tokens = max_new_tokens

    def start(self, settings: ChatSettings) -> kvedit.Memory:
        """A new memory with ``settings`` (its system message computed now)."""
        budget = None if settings.budget_kib == 0 else max(1, round(settings.budget_kib * 1024))
        return kvedit.Memory(
            self.model,
            self.tokenizer,
            system=settings.system or None,
            max_bytes=budget,
            forget=settings.forget,
            quantize=settings.quantize,
        )

    def turn(self, mem: kvedit.Memory | None, settings: ChatSettings, message: str):
        """Ask ``message`` (a new memory when ``mem`` is None): ``(memory, answer)``.

        Raises:
            ChatInputError: an empty or too long message.
        """
        if not isinstance(message, str) or not message.strip():
            raise ChatInputError("Type a message first.")
        if len(message) > MAX_MESSAGE_CHARS:
            raise ChatInputError(
                f"The message is too long: {len(message):,} characters (max {MAX_MESSAGE_CHARS:,})."
            )
        mem = self.start(settings) if mem is None else mem
        answer = mem.ask(message.strip(), max_new_tokens=self.max_new_tokens)
        return mem, answer


def summary(mem: kvedit.Memory) -> str:
    """One line: messages, the transcript's tokens, entries per layer, bytes against budget."""
    rows = held_by_message(mem)
    per_layer = [0.0] * len(rows[0].layers) if rows else []
    for r in rows:
        for j, x in enumerate(r.layers):
            per_layer[j] += x.kept + x.quantized
    entries = (
        f"entries per layer {min(per_layer):.0f} / {statistics.median(per_layer):.0f} / "
        f"{max(per_layer):.0f} (least / median / most)"
        if per_layer
        else "no entries"
    )
    budget = mem.budget
    if budget is None or budget.max_bytes is None:
        held = f"{mem.nbytes / 1024:,.0f} KiB, no budget"
    else:
        held = (
            f"{mem.nbytes / 1024:,.0f} of {budget.max_bytes / 1024:,.0f} KiB "
            f"({100 * mem.nbytes / budget.max_bytes:.0f}%), forgetting by {budget.policy}"
        )
    return (
        f"{len(mem.messages)} messages, {len(mem.state):,} tokens in the transcript; "
        f"{entries}; {held}; {len(mem.forgetting)} forgetting rounds"
    )


@dataclass(frozen=True)
class _Tab:
    """The Memory tab's components."""

    memory: gr.State
    system: gr.Textbox
    budget: gr.Number
    forget: gr.Dropdown
    quantize: gr.Dropdown
    chatbot: gr.Chatbot
    message: gr.Textbox
    send: gr.Button
    new: gr.Button
    status: gr.Markdown
    chart: gr.HTML
    explained: gr.Code


def _layout() -> _Tab:
    gr.Markdown(
        "Chat with the model under a byte budget: a `kvedit.Memory` keeps the conversation as "
        "one KV cache and forgets what is over the budget. The chart shows, after every turn, "
        "what it holds of each message in each layer. The settings apply from the next "
        "**New chat**."
    )
    memory = gr.State(None)  # per browser session: the Memory, made at the first message
    with gr.Row():
        system = gr.Textbox(DEFAULT_SYSTEM, label="System message", elem_id="mem-system", scale=3)
        budget = gr.Number(
            2048, label="Budget (KiB; 0: no budget)", precision=None, elem_id="mem-budget"
        )
        forget = gr.Dropdown(
            ["default", *sorted(SCORERS)],
            value="default",
            label="Forgetting policy",
            elem_id="mem-forget",
        )
        quantize = gr.Dropdown(
            list(QUANTIZE_CHOICES),
            value="off",
            label="Older messages in bits",
            elem_id="mem-quantize",
        )
    with gr.Row():
        with gr.Column(scale=2):
            chatbot = gr.Chatbot(label="Conversation", elem_id="mem-chat", height=360)
            with gr.Row():
                message = gr.Textbox(
                    label="Message",
                    placeholder="Tell it something, or ask...",
                    scale=4,
                    elem_id="mem-message",
                )
                send = gr.Button("Send", variant="primary", elem_id="mem-send", min_width=80)
                new = gr.Button("New chat", elem_id="mem-new", min_width=80)
            status = gr.Markdown("", elem_id="mem-status")
        with gr.Column(scale=3):
            chart = gr.HTML(render_held([]), label="What the memory holds", elem_id="mem-chart")
            with gr.Accordion("Memory.explain()", open=False):
                explained = gr.Code(label="explain", elem_id="mem-explain")
    return _Tab(
        memory,
        system,
        budget,
        forget,
        quantize,
        chatbot,
        message,
        send,
        new,
        status,
        chart,
        explained,
    )


def answer_turn(chat: MemoryChat, text, history, mem, *boxes) -> tuple:
    """One Send: ``(message box, history, memory, chart, explain, status)``; a refused turn
    leaves the conversation, the memory and the chart as they were and says why."""
    history = list(history or [])
    try:
        settings = ChatSettings.parse(*boxes)
        mem, answer = chat.turn(mem, settings, text)
    except ChatInputError as e:
        said = f"**Not sent:** {e}"
    except KVEditError as e:
        said = f"**Not answered** ({type(e).__name__}): {e}"
    except Exception as e:  # shown in the page; the trace goes to the server log
        log.exception("memory turn failed")
        said = f"**Internal error** ({type(e).__name__}): {e}"
    else:
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        line = summary(mem)
        chart = render_held(held_by_message(mem), line)
        return "", history, mem, chart, mem.explain(), f"**Turn {len(history) // 2}:** {line}"
    return gr.skip(), history, mem, gr.skip(), gr.skip(), said


def build_memory_tab(model, tokenizer, model_name: str) -> None:
    """Lay out and wire the Memory tab (inside the app's Blocks)."""
    chat = MemoryChat(model, tokenizer, model_name)
    tab = _layout()

    def on_send(text, history, mem, system, budget, forget, quantize):
        return answer_turn(chat, text, history, mem, system, budget, forget, quantize)

    def on_new():
        return [], None, render_held([]), "", "New chat: the settings above apply."

    outputs = [tab.message, tab.chatbot, tab.memory, tab.chart, tab.explained, tab.status]
    inputs = [tab.message, tab.chatbot, tab.memory, tab.system, tab.budget, tab.forget]
    for trigger in (tab.send.click, tab.message.submit):
        trigger(
            on_send,
            [*inputs, tab.quantize],
            outputs,
            api_visibility="private",
            concurrency_id="memory",
        )
    tab.new.click(
        on_new,
        None,
        [tab.chatbot, tab.memory, tab.chart, tab.explained, tab.status],
        api_visibility="private",
        queue=False,
    )
