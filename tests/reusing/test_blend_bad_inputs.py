"""``kvedit.blend`` refuses a bad rule, and more than the model attends to, before any work
(nothing stored)."""

from __future__ import annotations

import pytest

from kvedit.errors import InvalidInputError


@pytest.mark.parametrize(
    "rule,problem",
    [
        ({"gradual": 0.5}, "gradual must be a number >= 1"),
        ({"leading": 0}, "leading must be an int >= 1"),
        ({"rescale": 0}, "rescale must be a factor in"),
        ({"rescale": 2e4}, "rescale must be a factor in"),
        ({"previous": "  "}, "previous must be a non-empty passage text"),
        ({"previous": "Notes.", "context": "alone"}, 'previous needs context="prefix"'),
        ({"previous": "word " * 40_000}, r"previous passage and longest later part is \d+ tokens"),
    ],
    ids=[
        "gradual-below-1",
        "leading-0",
        "rescale-0",
        "rescale-over-limit",
        "previous-blank",
        "previous-without-prefix",
        "previous-over-the-context",
    ],  # fmt: skip
)
def test_blend_refuses_a_bad_rule_before_any_work(llama, tmp_path, rule, problem):
    import kvedit
    from kvedit.store import KVStore

    model, tok = llama
    store_dir = tmp_path / "store"
    with pytest.raises(InvalidInputError, match=problem):
        kvedit.blend(model, tok, ["Prefix.", " A passage."], KVStore(store_dir), **rule)
    assert not store_dir.exists() or not any(store_dir.rglob("*.safetensors"))  # nothing stored


@pytest.mark.parametrize(
    "parts,previous,problem",
    [
        (["Prefix."] + [" word" * 1500] * 4, None, r"the blend is \d+ tokens long"),
        (["Prefix.", " A.", " word" * 1000], " word" * 1000, r"and longest later part is \d+ tok"),
    ],
    ids=["blend-over-the-context", "part-behind-previous-over-the-context"],
)
def test_blend_refuses_more_than_the_model_attends_to_before_any_work(
    llama, tmp_path, parts, previous, problem
):
    import kvedit
    from kvedit.store import KVStore

    model, tok = llama  # 4096 positions
    store_dir = tmp_path / "store"
    with pytest.raises(InvalidInputError, match=problem) as refused:
        kvedit.blend(model, tok, parts, KVStore(store_dir), previous=previous)
    assert not store_dir.exists() or not any(store_dir.rglob("*.safetensors"))  # nothing stored
    # blend takes max_positions=, so its message offers it
    assert "pass max_positions=" in str(refused.value)
