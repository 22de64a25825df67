"""``Memory(quantize=)``: the messages before the last ``recent`` held in low bits, alone or
with forgetting; the recent messages exact; bytes down, entries as the budget counts them."""

from __future__ import annotations

import pytest

import kvedit
from kvedit.errors import InvalidInputError
from kvedit.memory.forgetting import global_entries
from kvedit.memory.quantizing import GROUP, REQUANTIZE_AFTER

CHAT = [
    ("user", "My locker code is 4821 and my badge is 77."),
    ("assistant", "Noted."),
    ("user", "The weather is nice today, the river is calm near the old bridge."),
    ("assistant", "It is sunny."),
]


def _global(state):
    return [layer for layer in state.layers if layer.window is None]


def _check_held(mem, forgot=False):
    """The recent messages exact, everything older packed but for fewer than
    REQUANTIZE_AFTER entries (between packings), or a partial key group after a forgetting
    round (which packs again what it made dense)."""
    exact_from = mem.turns[-mem.exact_messages].start
    for layer in _global(mem.state):
        old = int((layer.token_index < exact_from).sum())
        packed = layer.n_packed if layer.packed else 0
        assert packed % GROUP == 0 and packed <= old
        assert old - packed < (GROUP if forgot else REQUANTIZE_AFTER)
        # the recent messages are in the exact tail
        assert all(t < exact_from for t in layer.token_index[:packed].tolist())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_older_messages_are_packed_and_the_recent_ones_stay_exact(arch, request):
    model, tok = request.getfixturevalue(arch)
    mem = kvedit.Memory(model, tok, system="You are terse.", quantize=4)
    plain = kvedit.Memory(model, tok, system="You are terse.")
    for _ in range(5):
        for role, content in CHAT:
            mem.add(role, content)
            plain.add(role, content)
            _check_held(mem)
    assert any(layer.packed for layer in _global(mem.state))
    assert mem.nbytes < 0.5 * plain.nbytes
    assert global_entries(mem.state) == global_entries(plain.state)  # entries, not bytes
    assert "quantize" in [s.name for s in mem.state.history.steps]
    assert not mem.state.is_plain_capture
    # the first layer's keys depend on the tokens alone: the last message's are held as an
    # exact memory holds them, the oldest ones are not
    start = mem.turns[-1].start
    a, b = _global(mem.state)[0], _global(plain.state)[0]
    assert (a.keys[:, :, -(len(a) - start) :] - b.keys[:, :, start:]).abs().max() < 1e-5
    assert (a.keys[:, :, :GROUP] - b.keys[:, :, :GROUP]).abs().max() > 1e-3
    mem.ask("What is my locker code?", max_new_tokens=4)
    _check_held(mem)


@pytest.mark.parametrize("policy", ["window", "knorm", "reconstruct"])
def test_with_a_budget_the_entries_stay_within_it_and_the_older_part_packed(llama, policy):
    model, tok = llama
    mem = kvedit.Memory(model, tok, system="Hi.", max_tokens=150, forget=policy, quantize=4)
    exact = kvedit.Memory(model, tok, system="Hi.", max_tokens=150, forget=policy)
    for _ in range(6):
        for role, content in CHAT:
            rounds = len(mem.forgetting)
            mem.add(role, content)
            exact.add(role, content)
            assert global_entries(mem.state) <= 150
            _check_held(mem, forgot=len(mem.forgetting) > rounds)
            assert mem.nbytes <= exact.nbytes
    assert mem.forgetting and mem.nbytes < 0.9 * exact.nbytes


def test_quantize_saves_loads_and_continues_alike(llama, tmp_path):
    model, tok = llama
    kw = dict(max_tokens=150, forget="knorm", quantize=4)
    mem = kvedit.Memory(model, tok, system="Hi.", **kw)
    for role, content in CHAT * 3:
        mem.add(role, content)
    loaded = kvedit.Memory.load(mem.save(tmp_path / "m.kv"), model, tok, **kw)
    assert loaded.state.digest == mem.state.digest
    for role, content in CHAT:
        mem.add(role, content)
        loaded.add(role, content)
        assert loaded.state.digest == mem.state.digest


@pytest.mark.parametrize("bits", [3, 16, True, "4"])
def test_bad_bits_are_refused(llama, bits):
    with pytest.raises(InvalidInputError, match="quantize"):
        kvedit.Memory(*llama, quantize=bits)


def test_layers_holding_the_recent_messages_unequally_keep_each_its_own_exact(llama):
    """The exact tail is counted per global layer: a layer holding fewer of the last messages'
    entries (a forgetting round dropped some) keeps those exact, and no older entry."""
    import torch

    from kvedit.memory.quantizing import hold_older_quantized

    model, tok = llama
    mem = kvedit.Memory(model, tok, system="Hi.")
    for role, content in CHAT * 2:
        mem.add(role, content)
    state = mem.state
    starts = [t.start for t in mem.turns]
    exact_from = starts[-2]
    layers = list(state.layers)
    gone = (layers[0].token_index == exact_from).nonzero().flatten()
    keep = torch.tensor([j for j in range(len(layers[0])) if j not in gone.tolist()])
    layers[0] = layers[0].select(keep)  # one recent entry gone on layer 0
    out = hold_older_quantized(state.replace(layers=layers), 4, starts, recent=2, forgot=True)
    for layer in out.layers:
        packed = layer.n_packed if layer.packed else 0
        assert bool((layer.token_index[:packed] < exact_from).all())
        assert bool((layer.token_index[packed:] >= exact_from).sum() > 0)


def test_a_quantized_file_loaded_per_head_without_quantize_forgets_per_head(llama, tmp_path):
    """A file quantize held, loaded with quantize=None and per_head=True: its packed layers are
    cut per head (dequantized, as a round dequantizes what it cuts), within the budget and
    keeping the protected tokens, not refused at every round by the headwise cut."""
    from kvedit.cache import is_headwise
    from kvedit.memory.forgetting import SINK_TOKENS

    model, tok = llama
    mem = kvedit.Memory(model, tok, system="You are terse.", max_tokens=150, quantize=4)
    for role, content in CHAT * 3:
        mem.add(role, content)
    assert any(layer.packed for layer in _global(mem.state))
    path = mem.save(tmp_path / "q.kv")
    loaded = kvedit.Memory.load(path, model, tok, quantize=None, per_head=True)
    rounds = len(loaded.forgetting)
    for role, content in CHAT * 2:
        loaded.add(role, content)
        assert global_entries(loaded.state) <= 150
    assert len(loaded.forgetting) > rounds
    assert any(is_headwise(layer) for layer in _global(loaded.state))
    for layer in _global(loaded.state):
        rows = layer.head_index if is_headwise(layer) else layer.token_index[None]
        assert all(set(range(SINK_TOKENS)) <= set(row.tolist()) for row in rows)
