"""The forgetting diagnosis' budget counts, baselines and protected structure (no model)."""

from types import SimpleNamespace

import torch

from benchmarks.forget_diagnosis import allocate, baseline_scores, own_per_layer, structure


class _S(SimpleNamespace):
    def __len__(self) -> int:
        return self.n


def test_own_count_keeps_sliding_layers_whole_and_gives_globals_the_rest():
    # Gemma-3's shape: 3 global layers, 15 sliding layers of 512, a 2,000-token transcript
    windows = [None if i % 6 == 5 else 512 for i in range(18)]
    state = _S(
        n=2000, layers=[SimpleNamespace(window=w) for w in windows], global_layers=[5, 11, 17]
    )
    own = 3 * 2000 + 15 * 512
    assert own_per_layer(state, 0.8, 10) == round((0.8 * own - 15 * 512) / 3) == 1088
    assert own_per_layer(state, 0.25, 10) == 10  # the sliding layers take it all: the floor
    flat = _S(n=2000, layers=[SimpleNamespace(window=None)] * 4, global_layers=[0, 1, 2, 3])
    assert own_per_layer(flat, 0.25, 10) == 500  # no sliding layer: the global count


def test_baselines_random_is_seeded_and_recency_keeps_the_newest():
    layer = _S(n=6, kv_shape=(1, 2, 6, 4))
    state = _S(n=6, layers=[layer], global_layers=[0])
    a, b = baseline_scores("random", state, 3), baseline_scores("random", state, 3)
    assert torch.equal(a[0], b[0]) and a[0].shape == (2, 6)
    r = baseline_scores("recency", state, 3)[0]
    assert r[0].argmax() == 5 and torch.equal(r[0], r[1])


def test_structure_firsts_and_template():
    turns = [SimpleNamespace(start=0, end=3), SimpleNamespace(start=3, end=10)]
    # tokens 0-2 a turn's markup and content, offsets per token; contents [2, 6) and [10, 20)
    offsets = torch.tensor(
        [[0, 1], [1, 2], [2, 6], [6, 7], [7, 8], [8, 10], [10, 14], [14, 20], [20, 21], [21, 21]]
    )
    rendering = SimpleNamespace(offsets=offsets, contents=[(2, 6), (10, 20)])
    memory = SimpleNamespace(
        turns=turns, messages=[], renderer=SimpleNamespace(render=lambda messages: rendering)
    )
    firsts = structure(memory, "firsts", 10)
    assert firsts.tolist() == [True] * 3 + [True] * 4 + [False] * 3
    template = structure(memory, "template", 10)
    assert template.tolist() == [True, True, False, True, True, True, False, False, True, True]
    assert not structure(memory, "none", 10).any()


def test_the_tokens_allocation_keeps_one_choice_on_every_layer_and_head():
    scores = {
        0: torch.tensor([[5.0, 0.5, 0, 1], [0, 0, 0, 0]]),
        1: torch.tensor([[0.0, 0, 4, 0], [0, 0, 4, 0]]),
    }
    protected = torch.tensor([False, False, False, True])
    kept = allocate(scores, protected, 3, "tokens")
    want = [True, False, True, True]  # the protected one, then the best over layers and heads
    assert all(k[h].tolist() == want for k in kept.values() for h in range(2))
