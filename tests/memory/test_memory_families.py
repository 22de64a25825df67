"""Every family kvedit supports forgets without error (#67, item 3).

On each tiny architecture of the architecture matrix (``kvedit.testing.MATRIX_ARCHS``: Llama,
Qwen2/3, Mistral whose layers all slide, Gemma 2/3's sliding and global layers, Phi-3, gpt-oss's
attention sinks, MLA latent caches...), a :class:`kvedit.Memory` under a budget:

a. holds it after every add and every ask, under ``max_tokens`` with the default policy and
   under ``max_bytes`` with ``window`` (a policy that reads no attention), forgetting once the
   conversation is past it;
b. with a budget nothing reaches, is the memory without one: the same logits after every
   message and the same answer (exactly: scoring arrivals leaves the cache alone);
c. refuses a policy that cannot forget on the family by its name, in the constructor, before
   the system message runs (``h2o`` on a model with sliding-window layers; ``learned`` where
   no fit exists for the model), and takes every other registered policy.

Kept small: four layers, a few short messages, answers of two tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch

import kvedit
from kvedit.errors import UnsupportedModelError
from kvedit.memory.forgetting import global_entries, policies
from kvedit.memory.smallest import smallest_budget, system_head
from kvedit.runtime.gate import layer_windows
from kvedit.testing import MATRIX_ARCHS, tiny_model

SYSTEM = "You are terse."
MESSAGES = (
    "My locker code is 4821 and my badge is 77.",
    "The river is calm near the old bridge today. Alice's secret number is 5902.",
)
QUESTION = "What is my locker code?"
ANSWER_TOKENS = 2

# The families with sliding-window layers (h2o re-reads the text over the cache: refused there).
SLIDING = {"mistral", "gemma2", "gemma3-6l", "olmo3", "cohere2", "gpt_oss"}


pytestmark = pytest.mark.parametrize("arch", MATRIX_ARCHS)


@functools.cache
def _model(arch: str):
    return tiny_model(arch)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread is faster than several waiting on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _plain(arch: str) -> tuple[list, int, int]:
    """The conversation in a memory without a budget: :func:`_converse`'s logits and answer,
    the global entries and the bytes it holds at the end."""
    model, tok = _model(arch)
    mem = kvedit.Memory(model, tok, system=SYSTEM)
    seen = _converse(mem, lambda mem: None)
    return seen, global_entries(mem.state), mem.nbytes


def _least(arch: str):
    model, tok = _model(arch)
    head = system_head(kvedit.Memory(model, tok).renderer, SYSTEM)
    return smallest_budget(model, system_tokens=head)


def _converse(mem: kvedit.Memory, check) -> list:
    """The messages added and the question asked, ``check(mem)`` after each; the last logits
    after each message and the answer."""
    seen = []
    for content in MESSAGES:
        mem.add("user", content)
        check(mem)
        seen.append(mem.state.last_logits.clone())
    seen.append(mem.ask(QUESTION, max_new_tokens=ANSWER_TOKENS))
    check(mem)
    return seen


def test_a_budget_is_held_after_every_add_and_ask(arch):
    model, tok = _model(arch)
    first = kvedit.Memory(model, tok, system=SYSTEM)
    first.add("user", MESSAGES[0])
    least = _least(arch)
    max_tokens = least.max_tokens + 4
    max_bytes = max(first.nbytes, least.max_bytes)

    def entries_held(mem):
        assert global_entries(mem.state) <= max_tokens, f"{arch}: {global_entries(mem.state)}"

    def bytes_held(mem):
        assert mem.nbytes <= max_bytes, f"{arch}: {mem.nbytes:,} > {max_bytes:,}"

    by_entries = kvedit.Memory(model, tok, system=SYSTEM, max_tokens=max_tokens)
    by_bytes = kvedit.Memory(model, tok, system=SYSTEM, max_bytes=max_bytes, forget="window")
    _converse(by_entries, entries_held)
    _converse(by_bytes, bytes_held)
    _, plain_entries, plain_bytes = _plain(arch)
    # forgotten where the conversation is past the budget: on every family with a global
    # layer, not on Mistral (its windows of 24 tokens never hold more than either budget)
    assert bool(by_entries.forgetting) == (plain_entries > max_tokens)
    assert bool(by_bytes.forgetting) == (plain_bytes > max_bytes)
    assert bool(by_bytes.forgetting) == any(w is None for w in layer_windows(model))


def test_a_budget_nothing_reaches_changes_nothing(arch):
    model, tok = _model(arch)
    plain = _plain(arch)[0]
    for budget in (dict(max_tokens=10_000), dict(max_bytes=2**40, forget="knorm")):
        mem = kvedit.Memory(model, tok, system=SYSTEM, **budget)
        got = _converse(mem, lambda mem: None)
        assert not mem.forgetting
        for i, (a, b) in enumerate(zip(got[:-1], plain[:-1], strict=True)):
            assert torch.equal(a, b), f"{arch} {budget}: message {i}'s logits differ"
        assert got[-1] == plain[-1], f"{arch} {budget}: the answer differs"


def test_a_policy_that_cannot_forget_on_the_family_is_refused_by_name_before_any_work(
    arch, monkeypatch
):
    model, tok = _model(arch)
    kvedit.Memory(model, tok, system=SYSTEM).add("user", MESSAGES[0])  # probed, and it runs
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    refused = {}
    for policy in policies():
        try:  # no system message: a memory taken runs nothing
            kvedit.Memory(model, tok, max_tokens=10_000, forget=policy)
        except UnsupportedModelError as err:
            refused[policy] = str(err)
            assert str(err).startswith(f"forget={policy!r}: "), err
            with pytest.raises(UnsupportedModelError):
                kvedit.Memory(model, tok, system=SYSTEM, max_tokens=10_000, forget=policy)
            assert calls == [], f"{arch}: forget={policy!r} ran the model, then refused"
    kvedit.Memory(model, tok, system=SYSTEM, max_tokens=10_000, forget="window")
    assert calls  # the spy sees the model run a system message
    expected = {"learned"} | ({"h2o"} if arch in SLIDING else set())  # no fit for a tiny model
    assert set(refused) == expected, f"{arch}: refused {refused}"
    if "h2o" in refused:
        assert "sliding" in refused["h2o"]
