"""Bad arguments of ``ops.quantize``, and ``select`` of a packed state, refused before any
work."""

from __future__ import annotations

import pytest

from kvedit.errors import InvalidInputError, KVEditError
from kvedit.states.capturing import capture_tokens


@pytest.fixture(scope="module")
def long_state(llama):
    """A 288-token capture (9 key groups of 32) of the tiny Llama (head size 16)."""
    model, tok = llama
    ids = tok(" ".join(f"w{i}" for i in range(400)))["input_ids"][:288]
    state = capture_tokens(model, tok, ids)
    assert len(state) == 288
    return state


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(kwargs, id=name)
        for name, kwargs in [
            ("bits-3", {"bits": 3}),
            ("bits-16", {"bits": 16}),
            ("residual-negative", {"residual": -1}),
            ("group-0", {"group": 0}),
            ("group-not-dividing", {"group": 12}),
        ]
    ],
)
def test_quantize_refuses_with_a_kvedit_error(long_state, kwargs):
    from kvedit import ops

    with pytest.raises(KVEditError):
        ops.quantize(long_state, **kwargs)


def test_quantize_with_no_residual_compresses(long_state):
    from kvedit import ops

    out = ops.quantize(long_state, bits=4, residual=0)
    assert out.nbytes < long_state.nbytes / 2
    assert all(layer.packed for layer in out.layers if layer.window is None)
    assert len(out.generate("Question: who?", 3)) > 0  # the last input, kept exact, reruns


def test_select_of_a_packed_state_is_refused_before_any_work(long_state):
    from kvedit import compress, ops

    small = ops.quantize(long_state, 8)
    with pytest.raises(InvalidInputError, match="select the dense state first"):
        compress.select(small, "knorm", 0.5)
    out = ops.quantize(compress.select(long_state, "knorm", 0.5), 8)  # the order that works
    assert out.nbytes < small.nbytes
