"""Per-layer key movers, found by probing each model's own rotary function."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit import rope
from kvedit.errors import UnsupportedModelError
from kvedit.testing import tiny_model

PARTS = ["Alice's secret number is 4821.", " Bob's secret number is 7310."]


@pytest.mark.parametrize(
    ("arch", "expected"),
    [
        ("llama-4l", ["half"] * 4),
        ("cohere", ["interleaved"] * 4),  # pairs (2i, 2i+1)
        ("phi", ["half"] * 4),  # partial rotary: the first dims only
        ("smollm3", ["half", "none", "half", "none"]),  # no-RoPE layers
        ("gpt2", ["refused"] * 4),  # learned absolute positions
        ("deepseek_v3", ["refused"] * 4),  # MLA caches the latent
    ],
)
def test_each_layer_kind_is_found_by_probing(arch, expected):
    model, _ = tiny_model(arch)
    movers = rope.movers(model)
    assert [m.kind for m in movers] == expected
    assert rope.movers(model) is movers  # decided once
    if arch == "phi":
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        assert 2 * movers[0].inv_freq.numel() < head_dim
    if "refused" in expected:
        with pytest.raises(UnsupportedModelError, match=f"{model.config.model_type} layer 0"):
            rope.rerotate(model, 0, torch.zeros(1, 1, 3, 8), torch.zeros(3, dtype=torch.long))


def test_no_rope_layers_keep_their_keys():
    model, _ = tiny_model("smollm3")
    keys = torch.randn(1, 2, 5, 16)
    assert rope.rerotate(model, 1, keys, torch.full((5,), 7)) is keys


def test_blend_refuses_a_model_whose_keys_cannot_move_before_any_work(tmp_path):
    model, tok = tiny_model("gpt2")
    store = kvedit.KVStore(tmp_path / "store")
    with pytest.raises(UnsupportedModelError, match="blend cannot move cached keys: gpt2 layer 0"):
        kvedit.blend(model, tok, PARTS, store, recompute=0.0)
    assert store.stats()["entries"] == 0  # nothing was captured or stored


def test_the_projector_needs_half_split_rope_on_every_layer():
    model, _ = tiny_model("cohere")
    with pytest.raises(UnsupportedModelError, match="half-split"):
        rope.layer_inv_freq(model)
