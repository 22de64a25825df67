"""Forgetting under a budget: never past it (entries when a question comes, or the bytes the cache
allocates), never a protected token, each round a history step, arrival scores computed once,
each KV head its own entries, refusals before any work."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit.cache import is_headwise
from kvedit.errors import (
    CorruptCacheError,
    InvalidInputError,
    InvalidTypeError,
    NotACaptureError,
    UnsupportedModelError,
)
from kvedit.memory.budget import RECENT_TOKENS
from kvedit.memory.forgetting import SINK_TOKENS, global_entries

CHAT = [
    ("user", "My locker code is 4821 and my badge is 77."),
    ("assistant", "Noted."),
    ("user", "The weather is nice today, the river is calm near the old bridge."),
    ("assistant", "It is sunny."),
]
POLICIES = ["window", "knorm", "tova", "snapkv", "kvzip", "learned", "reconstruct"]


def held_by_each_head(state, layer) -> list[set[int]]:
    """The tokens each KV head of a layer holds."""
    held = state.layers[layer]
    if is_headwise(held):
        return [set(row[row >= 0].tolist()) for row in held.head_index]
    return [set(held.token_index.tolist())] * held.kv_shape[1]


def _memory(request, arch, policy, learned_fit, **kw):
    model, tok = request.getfixturevalue(arch)
    if policy == "learned":
        learned_fit(model, tok)
    return kvedit.Memory(model, tok, system="You are terse.", forget=policy, **kw)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_budget_is_never_exceeded_and_protected_tokens_stay(arch, policy, request, learned_fit):
    mem = _memory(request, arch, policy, learned_fit, max_tokens=120, protect="4821")
    system = mem.turns[0]
    for _ in range(5):
        for role, content in CHAT:
            mem.add(role, content)
            assert global_entries(mem.state) <= 120
            n = len(mem.state)
            must = set(range(system.start, system.end)) | set(range(SINK_TOKENS))
            must |= set(range(max(n - RECENT_TOKENS, 0), n))
            must |= set(mem.state.token_indices("4821").tolist())
            for layer in mem.state.global_layers:
                for held in held_by_each_head(mem.state, layer):
                    assert must <= held
    assert mem.forgetting and len(mem.state) > 120  # the transcript is longer than held
    rounds, before = len(mem.forgetting), mem.state.digest
    mem.ask("What is my locker code?", max_new_tokens=4, remember=False)
    assert (len(mem.forgetting), mem.state.digest) == (rounds, before)  # on top, not kept
    mem.ask("What is my locker code?", max_new_tokens=4)
    assert len(mem.forgetting) == rounds + 1  # a kept answer is followed by a round
    assert global_entries(mem.state) <= 120
    assert "forgetting (budget 120 entries per layer)" in mem.explain()
    assert "holds per global layer" in mem.explain()


@pytest.mark.parametrize(
    "arch, quantize, per_head",
    [("llama", None, None), ("llama", 4, None), ("llama", None, True), ("gemma3", None, None),
     ("gemma3", 4, None)],
)  # fmt: skip
def test_max_bytes_bounds_what_the_cache_allocates(arch, quantize, per_head, request):
    """Every layer counts, sliding-window ones included, in the dtype the memory holds
    (float32 here), packed or not, the padding of per-head layers included: never above it,
    after every message and every answer."""
    model, tok = request.getfixturevalue(arch)
    whole = kvedit.Memory(model, tok, system="You are terse.")
    for role, content in CHAT * 4:
        whole.add(role, content)
    budget = whole.nbytes // 3
    mem = kvedit.Memory(
        model,
        tok,
        system="You are terse.",
        forget="kvzip",
        max_bytes=budget,
        quantize=quantize,
        per_head=per_head,
    )
    for role, content in CHAT * 4:
        mem.add(role, content)
        assert mem.nbytes <= budget
    mem.ask("What is my locker code?", max_new_tokens=6)
    assert mem.nbytes <= budget and mem.forgetting
    # by default a byte budget keeps the same entries on every head (no padding to pay for)
    assert mem.budget.per_head == bool(per_head)


def test_a_forgetting_memory_is_no_plain_capture(llama, tmp_path):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=120)
    for role, content in CHAT * 3:
        mem.add(role, content)
    assert mem.forgetting and mem.budget.policy == "kvzip"  # no fit for a tiny model
    assert not mem.state.is_plain_capture
    assert "forget" in [step.name for step in mem.state.history.steps]
    with pytest.raises(NotACaptureError):
        kvedit.KVStore(tmp_path / "store").put(mem.state)
    # it still grows append-only: the next message checks against the whole transcript
    mem.add("user", "One more thing.")
    assert mem.state.token_ids.tolist() == mem.renderer.render(mem.messages).ids


def test_each_kv_head_keeps_its_own_entries_or_all_the_same(llama):
    """An arrival policy ranks (layer, KV head, entry) together: heads keep different entries
    and the bytes are freed; per_head=False keeps the same on every head (dense layers)."""
    model, tok = llama
    kw = dict(system="You are terse.", max_tokens=100, forget="kvzip")
    heads, same = kvedit.Memory(model, tok, **kw), kvedit.Memory(model, tok, per_head=False, **kw)
    for role, content in CHAT * 3:
        heads.add(role, content)
        same.add(role, content)
    assert heads.budget.per_head and not same.budget.per_head
    assert any(is_headwise(heads.state.layers[i]) for i in heads.state.global_layers)
    assert not any(is_headwise(layer) for layer in same.state.layers)
    glob = heads.state.global_layers  # as many head-entries in all as the budget gives
    assert sum(heads.state.layers[i].head_entries() for i in glob) <= 2 * 100 * len(glob)
    assert "each KV head its own" in heads.explain()
    with pytest.raises(InvalidInputError, match="per head"):
        heads.ask("Code?", max_new_tokens=2, focus=True)


@pytest.mark.parametrize("policy", ["kvzip", "knorm"])
def test_per_layer_false_keeps_the_same_tokens_on_every_layer_and_saves_so(llama, tmp_path, policy):
    """per_layer=False: one choice of tokens for every global layer (what a stock serving kernel
    holds), under the budget; the file keeps it; with per_head=True it is refused."""
    model, tok = llama
    kw = dict(system="You are terse.", max_tokens=60, forget=policy, per_head=False)
    mem, layered = kvedit.Memory(model, tok, per_layer=False, **kw), kvedit.Memory(model, tok, **kw)
    for role, content in CHAT * 3:
        mem.add(role, content)
        layered.add(role, content)
    glob = mem.state.global_layers
    first = mem.state.layers[glob[0]].token_index
    assert all(torch.equal(mem.state.layers[i].token_index, first) for i in glob)
    assert len(first) <= 60 and mem.forgetting
    if policy == "kvzip":  # a shared ranking keeps other tokens on other layers
        held = [layered.state.layers[i].token_index for i in glob]
        assert not all(torch.equal(h, held[0]) for h in held)
    loaded = kvedit.Memory.load(mem.save(tmp_path / "m.kvstate"), model, tok)
    assert loaded.budget.per_layer is False
    with pytest.raises(InvalidInputError, match="per_head=False"):
        kvedit.Memory(model, tok, max_tokens=60, forget="kvzip", per_head=True, per_layer=False)


def test_arrival_scores_are_made_once_per_message_never_by_a_re_read(llama, monkeypatch):
    from kvedit.compress.scorers.kvzip import KVzip

    model, tok = llama
    seen = []
    real = KVzip.score_tokens

    def spy(self, state, start, end, layers):
        seen.append((start, end))
        return real(self, state, start, end, layers)

    def no_reread(self, state, layers):
        raise AssertionError("a round re-read the memory")

    monkeypatch.setattr(KVzip, "score_tokens", spy)
    monkeypatch.setattr(KVzip, "score", no_reread)
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=100, forget="kvzip")
    for role, content in CHAT * 3:
        mem.add(role, content)
    mem.ask("What is my code?", max_new_tokens=3)
    assert mem.forgetting
    assert seen == [(t.start, t.end) for t in mem.turns[:-2]] + [
        (mem.turns[-2].start, mem.turns[-1].end)
    ]


def _snapshot(mem):
    return (mem.state.digest, len(mem), len(mem.turns), len(mem.forgetting))


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda m, t: kvedit.Memory(m, t, max_tokens=100, forget="lru"), InvalidInputError),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=0), InvalidInputError),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=10, max_bytes=10), InvalidInputError),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=10, recent_tokens=-1), InvalidInputError),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=10, protect=[3.5]), InvalidTypeError),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=10, protect=""), InvalidInputError),
        (
            lambda m, t: kvedit.Memory(m, t, max_tokens=10, forget="knorm", per_head=True),
            InvalidInputError,
        ),
        (
            lambda m, t: kvedit.Memory(m, t, max_tokens=10, per_head=True, quantize=4),
            InvalidInputError,
        ),
        (lambda m, t: kvedit.Memory(m, t, max_tokens=10, forget="learned"), UnsupportedModelError),
    ],
    ids=[
        "unknown-policy",
        "zero-budget",
        "both-budgets",
        "recent-tokens",
        "protect-not-a-span",
        "protect-empty",
        "per-head-round-policy",
        "per-head-quantize",
        "learned-without-a-fit",
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
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=60, protect="word")
    mem.add("user", "Hi.")
    mem.add("user", "A long message, then another. " * 8)  # over the budget: it forgets
    before = _snapshot(mem)
    with pytest.raises(InvalidInputError, match="protected part"):
        mem.add("user", "word " * 80)  # the protected words alone are over it
    assert _snapshot(mem) == before
    with pytest.raises(InvalidInputError, match="protected part"):  # refused at once (#65)
        kvedit.Memory(model, tok, max_bytes=1000)


@pytest.mark.parametrize("policy", ["kvzip", "learned", "knorm"])
def test_a_forgetting_memory_saves_loads_and_continues_alike(llama, tmp_path, policy, learned_fit):
    model, tok = llama
    if policy == "learned":
        learned_fit(model, tok)
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=90, forget=policy)
    for role, content in CHAT * 2:
        mem.add(role, content)
    assert mem.forgetting
    loaded = kvedit.Memory.load(mem.save(tmp_path / "m.kv"), model, tok)
    assert loaded.state.digest == mem.state.digest and loaded.forgetting == mem.forgetting
    assert loaded.budget == mem.budget
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
    budget = dict(
        max_tokens=200, forget="knorm", recent=3, recent_tokens=8, protect=protect, quantize=4
    )
    mem = kvedit.Memory(model, tok, system="You are terse.", **budget)
    for role, content in CHAT * 2:
        mem.add(role, content)
    path = mem.save(tmp_path / "m.kv")
    loaded = kvedit.Memory.load(path, model, tok)  # no keyword: the file's budget holds
    assert loaded.budget == mem.budget and loaded.budget.protect == ("4821", protect[1], (0, 5))
    assert (loaded.exact_messages, loaded.quantize, loaded.budget.recent_tokens) == (3, 4, 8)
    rounds = len(loaded.forgetting)
    for role, content in CHAT * 2:
        mem.add(role, content)
        loaded.add(role, content)
        assert loaded.state.digest == mem.state.digest and global_entries(loaded.state) <= 200
    assert len(loaded.forgetting) > rounds  # it forgot under the file's budget
    # a keyword given replaces the file's, the others stay; max_tokens=None: no budget
    bigger = kvedit.Memory.load(path, model, tok, max_bytes=10**7)
    assert (bigger.budget.max_bytes, bigger.budget.max_tokens) == (10**7, None)
    assert bigger.budget.policy == "knorm"
    assert kvedit.Memory.load(path, model, tok, max_tokens=None).budget is None
    # a file written without the keywords loads without a budget
    plain = tmp_path / "plain.kv"
    old = memory_attachment(mem.prompt, mem.messages, mem.turns, mem.forgetting)
    save_state(mem.state, plain, attachment=old)
    assert kvedit.Memory.load(plain, model, tok).budget is None
    # one whose kept keywords are malformed is refused as a damaged memory
    bad_ones = ({"max_tokens": "many"}, {"protect": [{"glob": "*"}]}, {"size": 3})
    for bad in (*bad_ones, {"per_head": "yes"}, {"recent_tokens": -2}):
        save_state(mem.state, plain, attachment={**old, "budget": bad})
        with pytest.raises(CorruptCacheError, match="plain.kv: the memory.s budget"):
            kvedit.Memory.load(plain, model, tok)


def test_a_file_whose_scores_do_not_fit_its_layers_is_refused(llama, tmp_path):
    from kvedit.memory.files import memory_attachment
    from kvedit.states.files.write import save_file_version

    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=90, forget="kvzip")
    for role, content in CHAT * 2:
        mem.add(role, content)
    held = mem._held.scores
    layers = sorted(held)
    att = memory_attachment(
        mem.prompt, mem.messages, mem.turns, mem.forgetting, None, held, "kvzip"
    )
    path = tmp_path / "s.kv"
    wrong = {f"scores.{i}": held[i][:, :-1].contiguous() for i in layers}
    save_file_version(mem.state, path, attachment=att, attached=wrong)
    with pytest.raises(CorruptCacheError, match="scores of layer"):
        kvedit.Memory.load(path, model, tok)
    nan = {f"scores.{i}": torch.full_like(held[i], float("nan")) for i in layers}
    save_file_version(mem.state, path, attachment=att, attached=nan)
    with pytest.raises(CorruptCacheError, match="not finite"):
        kvedit.Memory.load(path, model, tok)


def _saved_per_head_memory(model, tok, tmp_path):
    """The path of a saved kvzip memory that forgot per KV head (some global layer headwise)."""
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=90, forget="kvzip")
    for role, content in CHAT * 2:
        mem.add(role, content)
    assert any(is_headwise(mem.state.layers[i]) for i in mem.state.global_layers)
    return mem.save(tmp_path / "m.kv")


def test_a_per_head_memory_loaded_under_learned_is_refused_not_scored_from_mixed_slots(
    llama, tmp_path, learned_fit
):
    """A headwise layer's slot holds other tokens on other heads: learned's features of a slot
    (every head's key and value) would mix tokens, so a per-head memory loaded with a policy
    that must score it whole is refused (as kvzip's whole-state scoring refuses it)."""
    model, tok = llama
    learned_fit(model, tok)
    path = _saved_per_head_memory(model, tok, tmp_path)
    with pytest.raises(InvalidInputError, match="per head"):
        kvedit.Memory.load(path, model, tok, forget="learned")
    assert kvedit.Memory.load(path, model, tok).budget.policy == "kvzip"  # its own scores


@pytest.mark.parametrize("policy", ["window", "knorm"])
def test_a_per_head_memory_loaded_under_a_round_policy_is_refused(llama, tmp_path, policy):
    """A policy that scores at each round scores a headwise layer's slots, each holding other
    tokens on other heads (window: -1, the shared token_index, where they differ), so a
    per-head memory loaded with one is refused, not ranked by mixed slots."""
    model, tok = llama
    path = _saved_per_head_memory(model, tok, tmp_path)
    with pytest.raises(InvalidInputError, match="forgot per KV head"):
        kvedit.Memory.load(path, model, tok, forget=policy, per_head=False)


def test_a_model_whose_every_layer_slides_keeps_its_arrival_scores_aligned():
    """Every layer of the tiny Mistral slides: its window drops a layer's oldest entries as new
    tokens come, and the kept arrival scores drop theirs with them (the window's, not a cache
    altered behind the memory's back); per_head is off by default and refused when asked (a
    sliding layer holds the same entries on every KV head)."""
    from kvedit.testing import tiny_model

    model, tok = tiny_model("mistral")
    assert not kvedit.capture(model, tok, "Hi.").global_layers
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=20, forget="kvzip")
    assert not mem.budget.per_head
    for role, content in CHAT * 2:
        mem.add(role, content)
        assert global_entries(mem.state) <= 20
    mem.ask("What is my locker code?", max_new_tokens=3)
    assert mem.forgetting
    for i, scores in mem._held.scores.items():
        assert scores.shape == (mem.state.layers[i].kv_shape[1], len(mem.state.layers[i]))
    with pytest.raises(InvalidInputError, match="slides"):
        kvedit.Memory(model, tok, max_tokens=20, per_head=True)


def test_a_shared_ranking_keeps_the_best_entries_of_all_layers(llama):
    """A shared policy's round ranks every global layer's entries together: the layer whose
    entries score higher keeps more; the layers hold the budget on average, and every layer
    keeps the protected tokens."""
    from kvedit.memory.forgetting import forget

    model, tok = llama
    state = kvedit.capture(model, tok, " ".join(c for _, c in CHAT * 2))
    n, layers = len(state), len(state.layers)
    protected = torch.zeros(n, dtype=torch.bool)
    protected[10:14] = True
    protected[:SINK_TOKENS] = True
    protected[-1] = True
    g = torch.Generator().manual_seed(0)
    scores = {  # layer 0 reads everything, the others little
        i: torch.rand(2, n, generator=g) + (1.0 if i == 0 else 0.0) for i in range(layers)
    }
    target = 30
    out, _, rnd = forget(state, scores, protected, "kvzip", target)
    sizes = [len(layer) for layer in out.layers]
    assert sum(sizes) == target * layers and global_entries(out) == target == rnd.after
    assert sizes[0] == min(n, target * layers - (layers - 1) * int(protected.sum()))
    for i in range(layers):
        assert set(protected.nonzero().flatten().tolist()) <= held_by_each_head(out, i)[0]
    # a per-layer policy: every layer keeps the same count
    flat, _, _ = forget(state, None, protected, "knorm", target)
    assert [len(layer) for layer in flat.layers] == [target] * layers


def test_reconstruct_keeps_or_forgets_a_word_whole(llama):
    """reconstruct's score of an entry is the best of its word's entries (per head), so the
    tokens of a code or a name are kept or forgotten together."""
    from kvedit.memory import forgetting
    from kvedit.spans import word_index

    model, tok = llama
    state = kvedit.capture(model, tok, " ".join(c for _, c in CHAT))
    words = word_index(state.text, state.offsets)
    assert len(words.unique()) < len(state)  # some words take several tokens
    g = torch.Generator().manual_seed(1)
    raw = {i: torch.rand(2, len(state), generator=g) for i in state.global_layers}
    got = forgetting._word_max(raw, state)
    for i in state.global_layers:
        w = words[state.layers[i].token_index]
        for h in range(2):
            want = torch.stack([raw[i][h][w == w[j]].max() for j in range(len(w))])
            assert torch.equal(got[i][h], want)
        assert not torch.equal(got[i], raw[i])  # the grouping changes the scores


def test_an_ask_not_remembered_answers_from_what_a_remembered_one_keeps(llama):
    model, tok = llama
    budget = dict(system="You are terse.", max_tokens=120, forget="knorm")
    kept, asked = kvedit.Memory(model, tok, **budget), kvedit.Memory(model, tok, **budget)
    for role, content in CHAT * 3:
        kept.add(role, content)
        asked.add(role, content)
    before = _snapshot(asked)
    answer = asked.ask("What is my locker code?", max_new_tokens=8, remember=False)
    assert _snapshot(asked) == before
    assert kept.ask("What is my locker code?", max_new_tokens=8) == answer


@pytest.mark.parametrize("policy", ["kvzip", "learned", "window"])
def test_a_memory_under_a_budget_that_forgot_nothing_is_a_plain_capture(llama, policy, learned_fit):
    """Scoring arrivals leaves the cache alone: until a round runs, the memory is what a fresh
    capture of its transcript holds (the same digest), and the store takes it."""
    model, tok = llama
    if policy == "learned":
        learned_fit(model, tok)
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=10_000, forget=policy)
    for role, content in CHAT:
        mem.add(role, content)
    assert not mem.forgetting and mem.state.is_plain_capture
    fresh = kvedit.capture_tokens(model, tok, mem.renderer.render(mem.messages).ids)
    assert mem.state.digest == fresh.digest


def test_a_byte_budget_with_quantize_prices_the_older_messages_packed(llama):
    """Under max_bytes, the older messages are priced as they will be held (packed): the
    memory fills its budget with more entries than the same bytes hold exact (a round priced
    them exact and packed after, leaving a third of the budget unused)."""
    model, tok = llama
    whole = kvedit.Memory(model, tok, system="You are terse.")
    for role, content in CHAT * 5:
        whole.add(role, content)
    budget = whole.nbytes // 4
    kw = dict(system="You are terse.", forget="kvzip", max_bytes=budget, per_head=False)
    packed, exact = kvedit.Memory(model, tok, quantize=4, **kw), kvedit.Memory(model, tok, **kw)
    for role, content in CHAT * 5:
        packed.add(role, content)
        exact.add(role, content)
        assert packed.nbytes <= budget and exact.nbytes <= budget
    assert packed.forgetting and packed.nbytes >= 0.85 * budget
    assert global_entries(packed.state) > 1.5 * global_entries(exact.state)


def test_a_byte_budget_the_windows_and_the_protected_part_fill_names_both(gemma3):
    """A byte budget above what Gemma-3's sliding windows hold, but under that plus the
    protected part, is refused naming the windows' bytes (now and once full) beside the
    protected part: the protected part alone is far under the budget, so naming only it (as
    the refusal did) sent the user to protect less when the windows were what filled it."""
    model, tok = gemma3
    system = "You are terse and keep every fact the user tells you."
    with pytest.raises(InvalidInputError) as refused:
        mem = kvedit.Memory(
            model, tok, system=system, forget="kvzip", max_bytes=24_000, recent_tokens=8
        )
        for i in range(40):
            mem.add("user", f"Message {i}: the river is calm near the old bridge today.")
    said = str(refused.value)  # refused at once now (#65): it can never hold
    assert "can never hold" in said and "the sliding-window layers alone hold" in said
    assert "once their windows are full" in said and "the protected part" in said


def test_a_byte_budget_below_the_sliding_windows_is_refused_in_its_own_words(gemma3):
    """Gemma-3's sliding-window layers hold their windows whatever a round does: a byte budget
    they alone fill is refused saying so, the memory unchanged."""
    model, tok = gemma3
    with pytest.raises(InvalidInputError, match="sliding-window layers alone hold"):
        kvedit.Memory(model, tok, forget="kvzip", max_bytes=12_000, recent_tokens=0)
