"""A budget a memory can never hold is refused where it enters, before any message runs
(#65): :func:`kvedit.memory.smallest.smallest_budget` from the model's layers alone (the
sliding windows once full, the protected part on the global layers, one token more), checked by
``Memory(max_tokens=, max_bytes=)``, ``Memory.load(..., max_bytes=)`` and ``kvedit chat``."""

from __future__ import annotations

import pytest

import kvedit
from kvedit.errors import InvalidInputError
from kvedit.memory.forgetting import entry_bytes
from kvedit.memory.smallest import smallest_budget, system_head

SYSTEM = "You are terse."


def _runs(model, monkeypatch) -> list[int]:
    """Counts the model's forward passes (appended to the returned list)."""
    calls: list[int] = []
    forward = model.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    return calls


def test_the_smallest_budget_is_the_windows_and_the_protected_part(gemma3):
    """Gemma-3's sliding layers hold their windows once full; the global layer holds the sinks,
    the system message, the recent tokens, the last token and one more."""
    model, tok = gemma3
    state = kvedit.Memory(model, tok).state
    least = smallest_budget(model, system_tokens=10, recent_tokens=16)
    windows = sum(lay.window * entry_bytes(lay) for lay in state.layers if lay.window is not None)
    (g,) = state.global_layers
    assert least.window_bytes == windows > 0
    assert least.max_tokens == 10 + 16 + 1 and least.protected_tokens == 26
    assert least.max_bytes == windows + 27 * entry_bytes(state.layers[g])
    assert smallest_budget(state, system_tokens=10) == least  # a memory's state alike
    packed = smallest_budget(model, system_tokens=10, quantize=4)
    assert packed.max_bytes < least.max_bytes and packed.max_tokens == least.max_tokens


@pytest.mark.parametrize(
    "budget", [dict(max_bytes=100), dict(max_bytes=1), dict(max_tokens=10), dict(max_tokens=1)]
)
def test_a_budget_under_one_token_or_the_protected_part_is_refused_before_any_work(
    llama, monkeypatch, budget
):
    model, tok = llama
    least = smallest_budget(
        model, system_tokens=system_head(kvedit.Memory(model, tok).renderer, SYSTEM)
    )
    calls = _runs(model, monkeypatch)  # the model probed already (kvedit.Memory above)
    with pytest.raises(InvalidInputError, match="can never hold") as refused:
        kvedit.Memory(model, tok, system=SYSTEM, forget="knorm", **budget)
    said = str(refused.value)
    smallest = (
        f"{least.max_bytes:,} bytes" if "max_bytes" in budget else f"{least.max_tokens} entries"
    )
    assert f"the smallest budget that holds is {smallest}" in said
    assert "the protected part" in said and "raise max_" in said
    assert calls == []  # refused before the system message ran
    kvedit.Memory(model, tok, system=SYSTEM, forget="knorm", max_tokens=least.max_tokens)


def test_a_byte_budget_under_the_sliding_windows_is_refused_at_construction(gemma3, monkeypatch):
    """Below Gemma-3's windows every message past them would be refused: refused at once,
    naming the windows' bytes."""
    model, tok = gemma3
    least = smallest_budget(
        model, system_tokens=system_head(kvedit.Memory(model, tok).renderer, SYSTEM)
    )
    calls = _runs(model, monkeypatch)
    with pytest.raises(InvalidInputError, match="sliding-window layers alone hold") as refused:
        kvedit.Memory(model, tok, system=SYSTEM, forget="kvzip", max_bytes=least.window_bytes)
    assert "once their windows are full" in str(refused.value) and calls == []
    mem = kvedit.Memory(model, tok, system=SYSTEM, forget="kvzip", max_bytes=least.max_bytes)
    for i in range(6):  # the smallest budget holds: messages past the windows are kept
        mem.add("user", f"Message {i}: the river is calm near the old bridge today.")
    assert mem.nbytes <= least.max_bytes and len(mem) == 7


def test_load_refuses_a_budget_the_files_memory_can_never_hold(llama, tmp_path):
    """``Memory.load(max_bytes=)`` counts the file's own system message: under the smallest
    that holds it, refused at load (the memory forgets nothing, the file is unchanged)."""
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse. " * 6)
    mem.add("user", "My locker code is 4821.")
    path = mem.save(tmp_path / "m.kv")
    before = path.read_bytes()
    head = system_head(mem.renderer, mem.messages[0].content)
    least = smallest_budget(model, system_tokens=head)
    assert least.max_tokens > smallest_budget(model).max_tokens  # the system message counts
    with pytest.raises(InvalidInputError, match="can never hold"):
        kvedit.Memory.load(path, model, tok, max_tokens=least.max_tokens - 1)
    with pytest.raises(InvalidInputError, match="can never hold"):
        kvedit.Memory.load(path, model, tok, max_bytes=least.max_bytes - 1)
    assert path.read_bytes() == before
    loaded = kvedit.Memory.load(path, model, tok, max_bytes=least.max_bytes)
    loaded.add("user", "The river is calm.")  # within the smallest budget: it forgets
    assert loaded.nbytes <= least.max_bytes
