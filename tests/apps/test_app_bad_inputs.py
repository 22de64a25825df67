"""The highlight app hands what was typed to the validators as typed."""

from __future__ import annotations

import pytest


def test_the_app_hands_top_k_to_the_validator_unrounded(llama):
    """2.5 typed in the Passages box reaches /focus as 2.5 and is refused (a box that rounded,
    as Gradio's ``precision=0`` does, would hand on 2 and pick two passages)."""
    pytest.importorskip("gradio")  # the app's extra; not in the vLLM environment
    from apps.highlight import Highlighter, build_app

    model, tok = llama
    demo = build_app(Highlighter(model, tok, "tiny-llama", focus_threshold=None))
    endpoint = next(f for f in demo.fns.values() if f.api_name == "focus")
    context, question, top_k = endpoint.inputs
    assert top_k.elem_id == "top-k"
    typed = top_k.preprocess(2.5)
    assert typed == 2.5
    picked, _, passages, status = endpoint.fn(
        "Alice's number is 1. Bob's number is 2. Carol's number is 3.", "Whose?", typed
    )
    assert (picked, passages) == ("", [])
    assert status.startswith("**Not run:**") and "whole number" in status
