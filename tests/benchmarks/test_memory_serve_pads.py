"""benchmarks.memory_serve_pads on a tiny random model: the forward over a cache of per-layer
counts is the model's own, pads under the mask change nothing, and null pads do change the
logits (zero keys take attention at logit 0)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.memory_serve_pads import (
    Runner,
    check_budgets,
    generate,
    padded,
    per_head_top,
    slots_of,
)
from kvedit.errors import InvalidInputError
from kvedit.states.capturing import capture
from kvedit.testing import tiny_model

TEXT = "the quick brown fox jumps over the lazy dog and then it naps in the warm sun all day"


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_model("llama")
    state = capture(model, tok, TEXT)
    return model, tok, state, Runner(model)


def first_logits(runner, layers, state, masked=False) -> torch.Tensor:
    ids = [5, 17, 42]
    return generate(runner, layers, ids, state.next_position, masked, 1, set())[1]


def cut(state) -> list:
    """Each layer its own count (and each KV head its own entries), unequal across layers."""
    n = len(state)
    protected = torch.zeros(n, dtype=torch.bool)
    protected[:2] = True
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, layer in enumerate(state.layers):
        scores = torch.rand(layer.keys.shape[1], n, generator=gen)
        out.append(per_head_top(layer, scores, protected, k=n // 2 - 3 * i))
    return out


def test_a_whole_cache_answers_as_the_model_over_the_whole_text(setup):
    model, tok, state, runner = setup
    got = first_logits(runner, [slots_of(layer) for layer in state.layers], state)
    ids = torch.cat([state.token_ids.reshape(-1), torch.tensor([5, 17, 42])])
    with torch.no_grad():
        want = model(input_ids=ids[None]).logits[0, -1]
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


def test_masked_pads_equal_no_pads_and_null_pads_do_not(setup):
    _, _, state, runner = setup
    layers = cut(state)
    assert len({s.keys.shape[2] for s in layers}) > 1  # the counts differ across layers
    longest = max(s.keys.shape[2] for s in layers)
    pads = [padded(s, longest) for s in layers]
    plain = first_logits(runner, layers, state)
    masked = first_logits(runner, pads, state, masked=True)
    null = first_logits(runner, pads, state, masked=False)
    assert torch.allclose(masked, plain, atol=1e-5), float((masked - plain).abs().max())
    assert float((null - plain).abs().max()) > 1e-3


def test_pad_weight_is_measured_only_where_pads_take_attention(setup):
    _, _, state, runner = setup
    layers = cut(state)
    longest = max(s.keys.shape[2] for s in layers)
    pads = [padded(s, longest) for s in layers]
    weights = []
    for masked in (True, False):
        runner.watch, runner.pad_weight = True, 0.0
        first_logits(runner, pads, state, masked=masked)
        weights.append(runner.pad_weight)
    runner.watch = False
    assert weights[0] == 0.0 and weights[1] > 1e-3


@pytest.mark.parametrize("bad", ["", "0", "1.5", "0.25,-1", "quarter"])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(InvalidInputError, match="--budgets"):
        check_budgets(bad)
