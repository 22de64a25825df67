"""Cache layers and the packed data they hold are frozen: setting an attribute raises, every
change builds a new object (the tensors' data is not write-protected)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvedit.cache import LayerKV, MergedLayerKV, PackedKV, QuantizedLayerKV, SharedDirections
from kvedit.cache.directions import pack_directions

B, H, N, D = 1, 2, 64, 8


def bookkeeping(n: int = N) -> dict[str, torch.Tensor]:
    return {"token_index": torch.arange(n), "positions": torch.arange(n)}


def dense() -> LayerKV:
    return LayerKV(torch.randn(B, H, N, D), torch.randn(B, H, N, D), **bookkeeping())


def quantized() -> QuantizedLayerKV:
    x = torch.randn(B, H, N, D)
    return QuantizedLayerKV(
        packed_keys=PackedKV.quantize(x, 4, 32, 32, "channel"),
        packed_values=PackedKV.quantize(x, 4, 8, N, "token"),
        **bookkeeping(),
    )


def shared(m: int = 16) -> SharedDirections:
    x = torch.nn.functional.normalize(torch.randn(B, H, m, D), dim=-1)
    return SharedDirections(
        "pair",
        pack_directions(x, 0, 8, "channel"),
        pack_directions(x, 0, 8, "token"),
        torch.zeros(0, dtype=torch.long),
    )


def merged() -> MergedLayerKV:
    m = 16
    return MergedLayerKV(
        shared=shared(m),
        key_norms=torch.ones(B, H, m),
        value_norms=torch.ones(B, H, m),
        retained_keys=torch.zeros(B, H, 0, D),
        retained_values=torch.zeros(B, H, 0, D),
        tail_keys=torch.randn(B, H, N - m, D),
        tail_values=torch.randn(B, H, N - m, D),
        **bookkeeping(),
    )


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (dense, ["keys", "values", "token_index", "positions", "bias", "window"]),
        (quantized, ["packed_keys", "packed_values", "token_index", "bias", "keys"]),
        (merged, ["shared", "tail_keys", "key_norms", "member", "token_index", "values"]),
    ],
    ids=["dense", "quantized", "merged"],
)
def test_setting_a_layer_attribute_raises(build, names):
    layer = build()
    for name in names:
        before = getattr(layer, name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(layer, name, None)
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(layer, name)
        after = getattr(layer, name)
        assert after is before or torch.equal(after, before)  # keys/values are rebuilt


def test_packed_data_and_shared_directions_are_frozen():
    pk = quantized().packed_keys
    with pytest.raises(dataclasses.FrozenInstanceError):
        pk.residual = torch.zeros(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        shared().retained = torch.zeros(1, dtype=torch.long)


@pytest.mark.parametrize("build", [dense, quantized, merged], ids=["dense", "quantized", "merged"])
def test_edits_return_new_layers_and_leave_the_old_one_as_it_was(build):
    layer = build()
    keys, index = layer.keys.clone(), layer.token_index.clone()
    changed = layer.keys.clone()
    changed[:, :, -1] *= 2  # the exact tail of a packed layer
    out = dataclasses.replace(layer, keys=changed)
    appended = layer.append(
        torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), *[torch.tensor([N])] * 2
    )
    assert out is not layer and appended is not layer
    assert torch.equal(out.keys, changed) and len(appended) == N + 1
    assert torch.equal(layer.keys, keys) and torch.equal(layer.token_index, index)
