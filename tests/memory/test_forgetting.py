"""Forgetting under a budget: never past it, never a protected token, each round a history step,
refusals before any work."""

from __future__ import annotations

import pytest

import kvedit
from kvedit.errors import (
    CorruptCacheError,
    InvalidInputError,
    InvalidTypeError,
    NotACaptureError,
    UnsupportedModelError,
)
from kvedit.memory.forgetting import SINK_TOKENS, entry_bytes_bf16, global_entries

CHAT = [
    ("user", "My locker code is 4821 and my badge is 77."),
    ("assistant", "Noted."),
    ("user", "The weather is nice today, the river is calm near the old bridge."),
    ("assistant", "It is sunny."),
]
POLICIES = ["window", "knorm", "tova", "snapkv"]


def held_tokens(state, layer) -> set[int]:
    return set(state.layers[layer].token_index.tolist())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_budget_is_never_exceeded_and_protected_tokens_stay(arch, policy, request):
    model, tok = request.getfixturevalue(arch)
    mem = kvedit.Memory(
        model, tok, system="You are terse.", max_tokens=120, forget=policy, protect="4821"
    )
    system = mem.turns[0]
    for _ in range(6):
        for role, content in CHAT:
            mem.add(role, content)
            assert global_entries(mem.state) <= 120
            for layer in mem.state.global_layers:
                held = held_tokens(mem.state, layer)
                # the system message, the sinks, the last two messages, the protected span
                assert set(range(system.start, system.end)) <= held
                assert set(range(SINK_TOKENS)) <= held
                for t in mem.turns[-2:]:
                    assert set(range(t.start, t.end)) <= held
                assert set(mem.state.token_indices("4821").tolist()) <= held
    mem.ask("What is my locker code?", max_new_tokens=4)
    assert global_entries(mem.state) <= 120
    assert mem.forgetting and all(r.after <= 0.8 * 120 for r in mem.forgetting)
    assert len(mem.state) > 120  # the transcript is longer than what is held
    assert "forgetting (" in mem.explain()


def test_a_forgetting_memory_is_no_plain_capture(llama, tmp_path):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=120)
    for role, content in CHAT * 3:
        mem.add(role, content)
    assert mem.forgetting
    assert not mem.state.is_plain_capture
    assert "forget" in [step.name for step in mem.state.history.steps]
    with pytest.raises(NotACaptureError):
        kvedit.KVStore(tmp_path / "store").put(mem.state)
    # it still grows append-only: the next message checks against the whole transcript
    mem.add("user", "One more thing.")
    assert mem.state.token_ids.tolist() == mem.renderer.render(mem.messages).ids


def test_max_bytes_counts_global_entries_in_bfloat16(gemma3):
    model, tok = gemma3
    per_entry = entry_bytes_bf16(kvedit.Memory(model, tok).state)
    mem = kvedit.Memory(model, tok, max_bytes=per_entry * 100 + 5)
    assert mem.budget.max_entries == 100


def _snapshot(mem):
    return (mem.state.digest, len(mem), len(mem.turns), len(mem.forgetting))


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda m, t: kvedit.Memory(m, t, max_tokens=100, forget="lru"), InvalidInputError),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=0), InvalidInputError),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=10, max_bytes=10), InvalidInputError),
        (lambda m, t: kvedit.Memory(m, t, max_bytes=3), InvalidInputError),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=10, recent=-1), InvalidInputError),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=10, protect=[3.5]), InvalidTypeError),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=10, protect=""), InvalidInputError),
    ],
    ids=[
        "unknown-policy",
        "zero-budget",
        "both-budgets",
        "bytes-below-one-entry",
        "recent",
        "protect-not-a-span",
        "protect-empty",
    ],
)
def test_bad_budgets_are_refused(llama, make, error):
    with pytest.raises(error):
        make(*llama)


def test_h2o_on_a_sliding_window_model_is_refused_before_any_work(gemma3, llama):
    with pytest.raises(UnsupportedModelError, match="h2o"):
        kvedit.Memory(*gemma3, max_tokens=100, forget="h2o")
    kvedit.Memory(*llama, max_tokens=100, forget="h2o")  # a model it serves


def test_a_protected_part_over_the_budget_is_refused_at_the_add_that_causes_it(llama):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=60, recent=2)
    mem.add("user", "Hi.")
    before = _snapshot(mem)
    with pytest.raises(InvalidInputError, match="protected part"):
        mem.add("user", "word " * 80)
    assert _snapshot(mem) == before


def test_a_forgetting_memory_saves_loads_and_continues_alike(llama, tmp_path):
    model, tok = llama
    budget = dict(max_tokens=90, forget="knorm")
    mem = kvedit.Memory(model, tok, system="You are terse.", **budget)
    for role, content in CHAT * 2:
        mem.add(role, content)
    assert mem.forgetting
    loaded = kvedit.Memory.load(mem.save(tmp_path / "m.kv"), model, tok, **budget)
    assert loaded.state.digest == mem.state.digest and loaded.forgetting == mem.forgetting
    for role, content in CHAT:
        mem.add(role, content)
        loaded.add(role, content)
        assert loaded.state.digest == mem.state.digest
    assert mem.ask("Code?", max_new_tokens=4) == loaded.ask("Code?", max_new_tokens=4)


def test_a_memory_file_keeps_its_budget_and_a_keyword_given_replaces_it(llama, tmp_path):
    import re

    from kvedit.memory.files import memory_attachment
    from kvedit.states.files.write import save_state

    model, tok = llama
    protect = ["4821", re.compile(r"badge is \d+"), (0, 5)]
    budget = dict(max_tokens=200, forget="knorm", recent=3, protect=protect, quantize=4)
    mem = kvedit.Memory(model, tok, system="You are terse.", **budget)
    for role, content in CHAT * 2:
        mem.add(role, content)
    path = mem.save(tmp_path / "m.kv")
    loaded = kvedit.Memory.load(path, model, tok)  # no keyword: the file's budget holds
    assert loaded.budget == mem.budget and loaded.budget.protect == ("4821", protect[1], (0, 5))
    assert (loaded.recent, loaded.quantize) == (3, 4)
    rounds = len(loaded.forgetting)
    for role, content in CHAT * 2:
        mem.add(role, content)
        loaded.add(role, content)
        assert loaded.state.digest == mem.state.digest and global_entries(loaded.state) <= 200
    assert len(loaded.forgetting) > rounds  # it forgot under the file's budget
    # a keyword given replaces the file's, the others stay; max_tokens=None: no budget
    per_entry = entry_bytes_bf16(mem.state)
    bigger = kvedit.Memory.load(path, model, tok, max_bytes=240 * per_entry)
    assert (bigger.budget.max_entries, bigger.budget.policy) == (240, "knorm")
    assert kvedit.Memory.load(path, model, tok, max_tokens=None).budget is None
    # a file written without the keywords loads without a budget
    plain = tmp_path / "plain.kv"
    old = memory_attachment(mem.prompt, mem.messages, mem.turns, mem.forgetting)
    save_state(mem.state, plain, attachment=old)
    assert kvedit.Memory.load(plain, model, tok).budget is None
    # one whose kept keywords are malformed is refused as a damaged memory
    for bad in ({"max_tokens": "many"}, {"protect": [{"glob": "*"}]}, {"size": 3}):
        save_state(mem.state, plain, attachment={**old, "budget": bad})
        with pytest.raises(CorruptCacheError, match="plain.kv: the memory.s budget"):
            kvedit.Memory.load(plain, model, tok)


def test_a_shared_target_keeps_the_best_entries_of_all_layers(llama):
    """reconstruct's round shares the target among the global layers: the layer whose entries
    score higher keeps more, the layers hold ``target`` entries each on average, and every
    layer keeps the protected tokens."""
    import torch

    from kvedit.memory.forgetting import SHARED_POLICIES, forget

    model, tok = llama
    state = kvedit.capture(model, tok, " ".join(c for _, c in CHAT * 2))
    n, layers = len(state), len(state.layers)
    protected = torch.zeros(n, dtype=torch.bool)
    protected[10:14] = True

    def scores(policy, st, chosen):  # layer 0 reads everything, the others little
        return {i: torch.rand(n) + (1.0 if i == 0 else 0.0) for i in chosen}

    target = 30
    assert "reconstruct" in SHARED_POLICIES
    out, rnd = forget(state, target, protected, "reconstruct", scores=scores)
    sizes = [len(layer) for layer in out.layers]
    assert sum(sizes) == target * layers and global_entries(out) == target == rnd.after
    assert sizes[0] == min(n, target * layers - (layers - 1) * (SINK_TOKENS + 4 + 1))
    for i in range(layers):
        assert set(range(10, 14)) | set(range(SINK_TOKENS)) | {n - 1} <= held_tokens(out, i)
    # the same scores with a per-layer target: every layer keeps the same count
    flat, _ = forget(state, target, protected, "tova", scores=scores)
    assert [len(layer) for layer in flat.layers] == [target] * layers


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_reconstruct_stays_within_the_budget_on_average(arch, request):
    model, tok = request.getfixturevalue(arch)
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=90, forget="reconstruct")
    per_entry = entry_bytes_bf16(mem.state)
    for role, content in CHAT * 4:
        mem.add(role, content)
        held = sum(len(mem.state.layers[i]) for i in mem.state.global_layers)
        assert held <= 90 * len(mem.state.global_layers)
        assert global_entries(mem.state) * per_entry <= 90 * per_entry
    assert mem.forgetting


def test_reconstruct_keeps_or_forgets_a_word_whole(llama):
    """A round's reconstruct score of an entry is the best of its word's entries (max over KV
    heads first), so the tokens of a code or a name are kept or forgotten together."""
    import torch

    from kvedit.compress.scorers import make_scorer
    from kvedit.memory.forgetting import policy_scores
    from kvedit.spans import word_index

    model, tok = llama
    state = kvedit.capture(model, tok, " ".join(c for _, c in CHAT))
    words = word_index(state.text, state.offsets)
    assert len(words.unique()) < len(state)  # some words take several tokens
    layers = [0, len(state.layers) - 1]
    raw = make_scorer("reconstruct").score(state, layers)
    got = policy_scores("reconstruct", state, layers)
    for i in layers:
        per_entry = raw[i].float().amax(dim=(0, 1))
        w = words[state.layers[i].token_index]
        want = torch.stack([per_entry[w == w[j]].max() for j in range(len(w))])
        assert torch.equal(got[i], want)
        assert not torch.equal(got[i], per_entry)  # the grouping changes the scores


def test_an_ask_not_remembered_answers_from_what_a_remembered_one_keeps(llama):
    model, tok = llama
    budget = dict(system="You are terse.", max_tokens=120, forget="knorm")
    kept, asked = kvedit.Memory(model, tok, **budget), kvedit.Memory(model, tok, **budget)
    for role, content in CHAT * 3:
        kept.add(role, content)
        asked.add(role, content)
    before = _snapshot(asked)
    answer = asked.ask("What is my locker code?", max_new_tokens=8, remember=False)
    assert _snapshot(asked) == before  # the round that made room is dropped with the answer
    rounds = len(kept.forgetting)
    assert kept.ask("What is my locker code?", max_new_tokens=8) == answer
    assert len(kept.forgetting) == rounds + 1  # the remembered ask forgot to make room
