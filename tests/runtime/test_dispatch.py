"""The kvedit attention dispatches to the Triton kernel (interpreted on CPU) or to torch, and
both give the same greedy generations."""

from __future__ import annotations

import math

import pytest
from conftest import RECORDS

import kvedit
from kvedit.testing import tiny_model


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_triton_and_torch_paths_generate_the_same(monkeypatch, arch):
    model, tok = tiny_model(arch)
    state = kvedit.capture(model, tok, RECORDS)
    edited = kvedit.ops.emphasize(state, "Carol's secret number is 5902.", math.log(3))
    question = " What is Carol's secret number?"
    monkeypatch.setenv("KVEDIT_ATTENTION", "torch")
    torch_out = [s.generate(question, max_new_tokens=6) for s in (state, edited)]
    torch_logits = edited.logits(question)
    monkeypatch.setenv("KVEDIT_ATTENTION", "triton")
    triton_out = [s.generate(question, max_new_tokens=6) for s in (state, edited)]
    triton_logits = edited.logits(question)
    assert triton_out == torch_out
    assert (triton_logits - torch_logits).abs().max() < 1e-3


def test_forced_triton_is_used(monkeypatch):
    import kvedit.triton as kt

    calls = []
    real = kt.attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kt, "attention", spy)
    model, tok = tiny_model("llama")
    state = kvedit.capture(model, tok, "Alice's secret number is 4821.")
    monkeypatch.setenv("KVEDIT_ATTENTION", "triton")
    state.generate(" What", max_new_tokens=2)
    assert calls, "KVEDIT_ATTENTION=triton did not reach the Triton kernel"
    monkeypatch.setenv("KVEDIT_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="KVEDIT_ATTENTION"):
        state.generate(" What", max_new_tokens=1)
