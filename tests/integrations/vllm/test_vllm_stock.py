"""kvedit.integrations.vllm without vLLM: stock-kernel realization, files, lookup, errors.

These run in the main suite too (no vLLM needed). The stock cache is checked by *emulating* a
stock kernel in kvedit itself: a plain state holding the stock K/V in slots ``0..n_slots-1``,
no bias, the first new token at ``n_slots`` (what vLLM does) must continue exactly as the edited
state does, on the tiny Llama (GQA), Qwen2 and Gemma-3 (sliding-window layers).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import kvedit
from kvedit.cache import LayerKV
from kvedit.errors import CorruptCacheError, InvalidInputError, KVEditError
from kvedit.integrations.vllm import (
    REMOVE_AT,
    VLLMUnavailableError,
    engine,
    files,
    publish,
    publish_stock,
    to_stock,
)
from kvedit.integrations.vllm.stock import nearest_copies

TEXT = (
    "Alice's secret number is 4821. Bob's secret number is 7310. Carol's secret number is 5902. "
    "Eve Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil Trent Victor Walter."
)
SPAN = "Bob's secret number is 7310."
QUESTION = " Question: What is Bob's secret number? Answer:"


def emulate(stock, state: kvedit.KVState) -> kvedit.KVState:
    """The stock cache as a plain kvedit state: slots 0..n-1, no bias, next token at n."""
    n = stock.n_slots
    layers = []
    for i, layer in enumerate(state.layers):
        k, v = stock.keys[i], stock.values[i]  # [n_i, kv_heads, head_dim]
        m = k.shape[0]
        slots = torch.arange(n - m, n)
        layers.append(
            LayerKV(
                k.transpose(0, 1)[None].contiguous(),
                v.transpose(0, 1)[None].contiguous(),
                slots.clone(),
                slots.clone(),
                None,
                layer.window,
            )
        )
    return state.replace(
        layers=layers,
        token_ids=torch.tensor(stock.token_ids),
        offsets=torch.zeros(n, 2, dtype=torch.long),
        text="",
        position_ids=torch.arange(n),
        next_position=n,
    )


def edits(state: kvedit.KVState) -> dict[str, kvedit.KVState]:
    ops = kvedit.ops
    return {
        "plain": state,
        "scale_keys": ops.scale_keys(state, SPAN, 1.5),
        "duplicate": ops.duplicate(state, SPAN, 3),
        "suppress_full": ops.suppress(state, "Alice's secret number is 4821.", 1e4),
        "emphasize_log4": ops.emphasize(state, SPAN, math.log(4)),
    }


@pytest.mark.parametrize(
    "name", ["plain", "scale_keys", "duplicate", "suppress_full", "emphasize_log4"]
)
def test_a_stock_kernel_continues_exactly_as_kvedit(tiny, name):
    arch, model, tok = tiny
    state = edits(kvedit.capture(model, tok, TEXT))[name]
    stock = to_stock(state)
    assert stock.exact, stock.report()
    if name in ("plain", "scale_keys"):
        assert stock.shift == 0 and stock.n_slots == len(state)
    if name == "duplicate" and arch != "gemma3":  # gemma3's sliding layers get no copies
        assert stock.shift > 0
    if name == "suppress_full":
        assert stock.shift < 0
    want = state.answer(QUESTION, 12)
    got = emulate(stock, state).answer(QUESTION, 12)
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_the_plain_state_is_published_bit_for_bit(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    stock = to_stock(state)
    assert stock.token_ids == state.token_ids.tolist()
    for layer, k, v in zip(state.layers, stock.keys, stock.values, strict=True):
        assert torch.equal(k, layer.keys[0].transpose(0, 1))
        assert torch.equal(v, layer.values[0].transpose(0, 1))


def test_biases_are_realised_by_copies_or_removal_and_reported(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    n_span = int(state.token_indices(SPAN).numel())
    emph = to_stock(kvedit.ops.emphasize(state, SPAN, 2.0))
    assert not emph.exact
    (r,) = {(x.asked, x.realized, x.how, x.copies) for x in emph.realizations}
    assert r == (2.0, pytest.approx(math.log(7)), "copies", 6)  # e^2 - 1 = 6.39 -> 6 copies
    assert emph.n_slots == len(state) + 6 * n_span
    assert "approximate" in emph.report()

    partial = to_stock(kvedit.ops.suppress(state, SPAN, 2.0))
    assert {x.how for x in partial.realizations} == {"unrealized"}
    assert partial.n_slots == len(state)
    removed = to_stock(kvedit.ops.suppress(state, SPAN, 2.0), remove_at=2.0)
    assert {(x.how, x.realized) for x in removed.realizations} == {("removed", -math.inf)}
    assert removed.n_slots == len(state) - n_span
    assert not removed.exact  # kvedit still gives e^-2 of the weight
    assert to_stock(kvedit.ops.suppress(state, SPAN, REMOVE_AT)).n_slots == len(state) - n_span


def test_per_layer_strengths_share_one_copy_count(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    n = len(state.layers)
    stock = to_stock(kvedit.ops.emphasize(state, SPAN, [math.log(3)] + [0.0] * (n - 1)))
    assert not any(stock.null_entries) and len({k.shape[0] for k in stock.keys}) == 1
    got = {(r.layer, round(r.asked, 6), round(r.realized, 6)) for r in stock.realizations}
    log3 = round(math.log(3), 6)
    assert (0, log3, log3) in got
    assert (1, 0.0, log3) in got  # asked nothing, got the shared count
    assert not stock.exact


def test_nearest_copies_is_nearest_in_log_space():
    bias = torch.tensor([-1.0, 0.0, 0.3, 0.5, math.log(2), 2.0, math.log(4), 100.0])
    assert nearest_copies(bias).tolist() == [0, 0, 0, 1, 1, 6, 3, 64]


def test_per_head_removal_is_refused(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    layer = state.layers[0]
    bias = layer.dense_bias().clone()
    bias[:, 0, 3] = -1e4  # one KV head only
    bad = state.replace(
        layers=[layer.__class__(**{**vars(layer), "bias": bias})] + state.layers[1:]
    )
    with pytest.raises(InvalidInputError, match="some KV heads only"):
        to_stock(bad)


def test_a_shift_without_the_model_is_refused(llama):
    model, tok = llama
    state = kvedit.ops.duplicate(kvedit.capture(model, tok, TEXT), SPAN, 1)
    with pytest.raises(kvedit.errors.ModelNotAttachedError):
        to_stock(state.replace(model=None))
    assert to_stock(kvedit.capture(model, tok, TEXT).replace(model=None)).exact  # no shift


def test_publish_writes_one_verified_file_that_the_index_finds(llama, tmp_path):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    short = kvedit.capture(model, tok, TEXT[:40])
    ids = publish(state, tmp_path)
    ids_short, stock, path = publish_stock(short, tmp_path)
    assert path.name == files.file_name(ids_short, short.digest) and ids_short == stock.token_ids
    assert ids_short.digest == short.digest and ids_short.plain_capture and ids_short.exact
    meta, tensors = files.read(path)
    assert meta["n_slots"] == len(ids_short) and meta["exact"] is True
    assert meta["digest"] == short.digest and meta["plain_capture"] is True
    assert torch.equal(tensors["layer.0.keys"], stock.keys[0])
    index = files.PublishedIndex(tmp_path)
    question = [5, 6, 7]
    want = tmp_path / files.file_name(ids, state.digest)
    assert index.find(ids + question, state.digest) == (want, len(ids))
    assert index.candidates(ids + question) == (len(ids), {state.digest: want})
    if ids[: len(ids_short)] == ids_short:  # the longest published prefix wins
        assert index.candidates(ids_short + question)[0] == len(ids_short)
    assert index.candidates(question) is None and index.find(question, state.digest) is None
    assert not list(tmp_path.glob(".*kvedit-tmp*"))  # no temporary file left


def test_a_corrupt_file_is_refused_by_name(tmp_path):
    path = tmp_path / files.file_name([1, 2, 3], "0" * 32)
    path.write_bytes(b"\x80\x04not a safetensors file")
    with pytest.raises(CorruptCacheError):
        files.read(path)
    with pytest.raises(CorruptCacheError):
        files.read_header(path)


def test_publish_refuses_what_is_not_a_state(tmp_path):
    with pytest.raises(InvalidInputError):
        publish("not a state", tmp_path)


def test_engine_without_vllm_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(VLLMUnavailableError, match=r"kvedit\[vllm\]") as err:
        engine("smollm2-135m-instruct", tmp_path)
    assert isinstance(err.value, KVEditError) and isinstance(err.value, ImportError)


def test_importing_the_integration_does_not_import_vllm():
    code = "import sys, kvedit.integrations.vllm; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_heads_that_want_fewer_copies_get_null_entries(llama):
    model, tok = llama
    state = kvedit.capture(model, tok, TEXT)
    layers = []
    for layer in state.layers:
        bias = layer.dense_bias().clone()
        bias[:, 0, 3] = math.log(3)  # 2 copies on KV head 0 only, on every layer
        layers.append(layer.__class__(**{**vars(layer), "bias": bias}))
    stock = to_stock(state.replace(layers=layers))
    keys = stock.keys[0]  # [slots, kv_heads, head_dim]: entry 3 is followed by its 2 copies
    assert stock.null_entries[0] == 2 * (keys.shape[1] - 1)
    assert stock.shift == 2  # so the keys are rotated, all alike
    assert torch.equal(keys[4, 0], keys[3, 0]) and torch.equal(keys[5, 0], keys[3, 0])
    assert keys[3].abs().sum(-1).min() > 0
    assert not keys[4:6, 1:].any()  # the other heads: null
    assert not stock.exact
