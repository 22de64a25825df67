"""The app's Memory tab (#69): what a :class:`kvedit.Memory` holds per message and per layer
(kept, quantized, forgotten), its chart, and a chat turn by turn. On the tiny random Llama
(``kvedit.testing``): the answers are noise, the bookkeeping is the real memory's."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("gradio")  # the app's extra

import kvedit  # noqa: E402
from apps.highlight.memory_tab import (  # noqa: E402
    ChatInputError,
    ChatSettings,
    MemoryChat,
    answer_turn,
)
from apps.highlight.memory_view import held_by_message, render_held  # noqa: E402

SYSTEM = "You are a helpful assistant."
TURNS = [
    "My dog's name is Biscuit and I live in Paris.",
    "My locker code is 4821.",
    "What is my dog's name?",
]


def _chat(llama, **settings) -> kvedit.Memory:
    model, tok = llama
    mem = kvedit.Memory(model, tok, system=SYSTEM, **settings)
    for text in TURNS:
        mem.ask(text, max_new_tokens=8)
    return mem


def _held_per_layer(rows) -> list[float]:
    return [
        sum(r.layers[j].kept + r.layers[j].quantized for r in rows)
        for j in range(len(rows[0].layers))
    ]


def test_without_a_budget_every_message_is_kept(llama):
    mem = _chat(llama)
    rows = held_by_message(mem)
    assert [r.index for r in rows] == list(range(len(mem.messages)))
    assert [r.role for r in rows] == [m.role for m in mem.messages]
    assert {r.state for r in rows} == {"kept"} and all(r.held_share == 1.0 for r in rows)
    assert len(rows[0].layers) == len(mem.state.counted_layers)
    assert _held_per_layer(rows) == [len(mem.state.layers[i]) for i in mem.state.counted_layers]


def test_a_forgotten_message_is_drawn_as_forgotten(llama):
    mem = _chat(llama, max_bytes=60 * 1024, forget="window")
    assert mem.forgetting  # the budget made rounds
    rows = held_by_message(mem)
    # Every entry the layers hold is counted once, against the message of its token.
    assert _held_per_layer(rows) == [len(mem.state.layers[i]) for i in mem.state.counted_layers]
    assert rows[0].state == "kept"  # the system message is never forgotten
    forgotten = [r.index for r in rows if r.state == "forgotten"]
    assert 1 in forgotten  # the first user message, the oldest: window drops it first
    assert rows[-1].state in ("kept", "partial")
    chart = render_held(rows, "summary <line>")
    classes = re.findall(r'<tr class="message (\w+)" data-index="(\d+)"', chart)
    assert [int(i) for state, i in classes if state == "forgotten"] == forgotten
    assert "tr.forgotten td.label{text-decoration:line-through" in chart
    assert "summary &lt;line&gt;" in chart and chart.count('class="cell') == len(rows) * len(
        rows[0].layers
    )


def test_older_messages_in_low_bits_are_drawn_as_quantized(llama):
    mem = _chat(llama, quantize=4)
    rows = held_by_message(mem)
    per_layer = [sum(r.layers[j].quantized for r in rows) for j in range(len(rows[0].layers))]
    packed = [mem.state.layers[i].n_packed for i in mem.state.counted_layers]
    assert per_layer == packed and all(packed)
    assert rows[0].state == "quantized" and rows[-1].state == "kept"
    assert "cell quantized" in render_held(rows)


def test_each_kv_head_keeping_its_own_is_averaged_over_the_heads(llama):
    mem = _chat(llama, max_tokens=60, forget="kvzip", per_head=True)
    rows = held_by_message(mem)
    layers = [mem.state.layers[i] for i in mem.state.counted_layers]
    assert any(getattr(layer, "head_index", None) is not None for layer in layers)
    want = [layer.head_entries() / layer.kv_shape[1] for layer in layers]
    assert _held_per_layer(rows) == pytest.approx(want)


def test_three_turns_update_the_chart_after_each(llama):
    model, tok = llama
    chat = MemoryChat(model, tok, "tiny-llama", max_new_tokens=8)
    boxes = (SYSTEM, 60, "window", "off")
    history, mem, charts = [], None, []
    for n, text in enumerate(TURNS, 1):
        box, history, mem, chart, explained, status = answer_turn(chat, text, history, mem, *boxes)
        assert box == "" and len(history) == 2 * n and history[-2]["content"] == text
        assert status.startswith(f"**Turn {n}:** {2 * n + 1} messages")
        assert "KiB" in status and "forgetting by window" in status
        assert chart.count('<tr class="message') == 2 * n + 1 and chart not in charts
        assert explained == mem.explain()
        charts.append(chart)
    assert 'class="message forgotten"' in charts[-1]
    # A refused turn leaves the conversation, the memory and the chart as they were.
    box, same, kept, chart, _, status = answer_turn(chat, "  ", history, mem, *boxes)
    assert (same, kept) == (history, mem) and status == "**Not sent:** Type a message first."
    assert len(mem.messages) == 7


@pytest.mark.parametrize(
    ("boxes", "message"),
    [
        ((SYSTEM, -1, "default", "off"), "from 0 (no budget) to 1,048,576 KiB, not -1"),
        ((SYSTEM, float("nan"), "default", "off"), "not nan"),
        ((SYSTEM, "big", "default", "off"), "must be a number of KiB"),
        ((SYSTEM, None, "default", "off"), "must be a number of KiB"),
        ((SYSTEM, 64, "nope", "off"), "Forgetting policy must be one of"),
        ((SYSTEM, 64, "default", "3"), "bits must be one of ['off', '8', '4', '2']"),
        ((3, 64, "default", "off"), "system message must be text, not int"),
    ],
)
def test_bad_settings_are_refused_by_name(boxes, message):
    with pytest.raises(ChatInputError, match=re.escape(message)):
        ChatSettings.parse(*boxes)


def test_a_budget_too_small_for_the_system_message_is_said_in_the_page(llama):
    model, tok = llama
    chat = MemoryChat(model, tok, "tiny-llama", max_new_tokens=8)
    _, history, mem, _, _, status = answer_turn(chat, "Hi", [], None, SYSTEM, 1, "window", "off")
    assert (history, mem) == ([], None)
    assert status.startswith("**Not answered** ("), status


def test_the_memory_tab_is_in_the_app_and_private(llama):
    from apps import highlight

    model, tok = llama
    demo = highlight.build_app(highlight.Highlighter(model, tok, "tiny-llama"))
    ids = {c["props"].get("elem_id") for c in demo.config["components"]}
    assert {"memory-tab", "mem-chat", "mem-chart", "mem-send", "mem-budget"} <= ids
    public = {f.api_name for f in demo.fns.values() if f.api_visibility == "public"}
    assert public == {"steer", "focus"}
