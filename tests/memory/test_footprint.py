"""Budgets in the model's own units (#67, item 4): :mod:`kvedit.memory.footprint` counts the
cache a model really holds for ``n`` tokens, its sliding windows included, from a model or from
a configuration alone (no weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig

import kvedit
from kvedit.errors import InvalidInputError, UnsupportedModelError
from kvedit.memory.footprint import (
    config_windows,
    held_entries,
    own_bytes,
    own_entries,
    windows_of,
)
from kvedit.runtime.gate import layer_windows
from kvedit.testing import MATRIX_ARCHS, tiny_config, tiny_model

SMOLLM2_BYTES_PER_TOKEN = 30 * 3 * (64 + 64) * 4  # 30 layers, 3 KV heads of 64, float32
GEMMA3_ENTRY_BYTES = 1 * (256 + 256) * 4  # 1 KV head of 256, float32


def smollm2_shaped() -> LlamaConfig:
    """SmolLM2-135M-Instruct's configuration as its bundled GGUF converts (the fields that
    shape the cache), built without weights."""
    return LlamaConfig(
        num_hidden_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        dtype="float32",
    )


def gemma3_shaped() -> Gemma3TextConfig:
    """Gemma-3 270M's text configuration as its bundled GGUF converts: 18 layers, 5 sliding (a
    window of 512) to 1 global, one KV head of 256."""
    return Gemma3TextConfig(
        num_hidden_layers=18,
        hidden_size=640,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        intermediate_size=2048,
        sliding_window=512,
        dtype="float32",
    )


@pytest.mark.parametrize("n", [0, 1, 100, 512, 513, 4096])
def test_the_bundled_models_own_entries_and_bytes(n):
    assert own_entries(smollm2_shaped(), n) == 30 * n
    assert own_bytes(smollm2_shaped(), n) == n * SMOLLM2_BYTES_PER_TOKEN
    gemma = gemma3_shaped()
    assert config_windows(gemma) == ([512] * 5 + [None]) * 3
    assert own_entries(gemma, n) == 3 * n + 15 * min(n, 512)
    assert own_bytes(gemma, n) == (3 * n + 15 * min(n, 512)) * GEMMA3_ENTRY_BYTES
    assert own_bytes(gemma, n, dtype=torch.bfloat16) * 2 == own_bytes(gemma, n)


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_the_bundled_models_configs_read_before_their_weights_count_so(name):
    from kvedit.evals.configs import peek_config

    config = peek_config(name)
    if config is None:
        pytest.skip(f"{name} is not installed")
    shaped = smollm2_shaped() if name.startswith("smollm2") else gemma3_shaped()
    for n in (10, 600, 5000):
        assert own_entries(config, n) == own_entries(shaped, n)
        # a GGUF's configuration names no dtype: load_model converts it to float32
        assert own_bytes(config, n, dtype=torch.float32) == own_bytes(shaped, n)


@pytest.mark.parametrize("arch", MATRIX_ARCHS)
def test_a_configs_windows_are_the_ones_the_gate_probes(arch):
    """Read from the configuration alone, each layer's window is the window of the cache layer
    transformers builds for it (the gate's probe), on every family of the matrix."""
    model, _ = tiny_model(arch)
    assert config_windows(tiny_config(arch)) == layer_windows(model) == windows_of(model)


@pytest.mark.parametrize("arch", ["llama-4l", "gemma2", "gemma3-6l", "mistral", "gpt_oss"])
def test_a_memory_that_forgets_nothing_holds_the_models_own_cache(arch):
    """A memory without a budget holds exactly the model's own windowed cache; one under a
    budget holds less, counted the same way (all of it on Mistral, whose every layer slides:
    its windows are all it holds)."""
    model, tok = tiny_model(arch)
    text = "Alice's secret number is 4821. Bob's secret number is 7310. " * 2
    mem = kvedit.Memory(model, tok, system="You are terse.")
    mem.add("user", text)
    n = len(mem.state)
    assert n > 24  # past every window of the matrix
    assert held_entries(mem.state) == own_entries(model, n) == own_entries(tiny_config(arch), n)
    assert mem.nbytes == own_bytes(model, n) == own_bytes(tiny_config(arch), n, dtype=torch.float32)
    small = kvedit.Memory(model, tok, system="You are terse.", max_tokens=40, forget="window")
    small.add("user", text)
    kept = held_entries(small.state) / own_entries(model, len(small.state))
    assert kept == 1.0 if arch == "mistral" else kept < 1.0


@pytest.mark.parametrize("arch", ["falcon", "gpt_neox", "deepseek_v3"])
def test_bytes_from_a_config_that_does_not_describe_its_cache_are_refused(arch):
    with pytest.raises(UnsupportedModelError, match=f"own_bytes from a {arch} configuration"):
        own_bytes(tiny_config(arch), 10)
    assert own_entries(tiny_config(arch), 10) == 4 * 10  # the count needs no sizes


@pytest.mark.parametrize("n", [-1, 1.5, True, "3"])
def test_a_bad_token_count_is_refused(n):
    with pytest.raises(InvalidInputError, match="n_tokens must be a whole number"):
        own_entries(smollm2_shaped(), n)


def test_a_config_without_a_dtype_or_with_an_unknown_layer_type_is_refused():
    bare = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    bare.dtype = None
    with pytest.raises(InvalidInputError, match="names no dtype; pass dtype="):
        own_bytes(bare, 10)
    assert own_bytes(bare, 10, dtype=torch.float16) == 2 * 10 * 4 * 2 * 16 * 2
    odd = gemma3_shaped()
    odd.layer_types = ["chunked_attention"] * 18
    with pytest.raises(UnsupportedModelError, match="layer type 'chunked_attention'"):
        own_entries(odd, 10)


def test_the_memory_eval_reports_budgets_in_the_models_own_units():
    """``kvedit eval memory``'s records say the fraction of the model's own windowed cache the
    memory keeps, beside the global-entries count: 1.0 for ``reuse``, below the global
    fraction's share on Gemma-3's shape where the windows hold the rest."""
    from kvedit.evals import memory
    from kvedit.evals.tasks.memory_facts import facts_examples

    model, tok = tiny_model("gemma3")  # 3 sliding layers (window 16), 1 global
    conv = facts_examples(1, seed=0, n_messages=40)[0]
    run = dict(task="facts", max_new_tokens=2)
    reuse = memory.run_conversation(model, tok, conv, memory.parse_memory_spec("reuse"), 1.0, **run)
    window = memory.parse_memory_spec("window")
    kept = memory.run_conversation(model, tok, conv, window, 0.25, **run)
    for r in reuse:
        assert r["own_entries_fraction"] == r["own_bytes_fraction"] == 1.0
    for r, whole in zip(kept, reuse, strict=True):
        assert {"entries", "max_entries", "nbytes"} <= set(r)  # the keys there were, still
        assert 0 < r["own_entries_fraction"] < 1 and 0 < r["own_bytes_fraction"] < 1
        # the sliding layers hold their windows whole: more of the own cache is kept than
        # of the global entries
        assert r["own_entries_fraction"] > r["entries"] / whole["entries"]
    first, whole = kept[0], reuse[0]  # the same tokens: no answer is kept yet
    assert first["own_bytes_fraction"] == pytest.approx(first["nbytes"] / whole["nbytes"], abs=1e-4)


def test_the_memory_summary_and_table_give_the_own_fractions_and_read_older_records():
    from kvedit.evals.memory_report import format_memory_table, summarize_memory

    def row(example, method, budget, own=None):
        held = {} if own is None else {"own_entries_fraction": own, "own_bytes_fraction": own / 2}
        return {
            "id": f"{example}-q0",
            "example": example,
            "method": method,
            "budget": budget,
            "bucket": "early",
            "correct": True,
            "seconds": 1.0,
            "rounds": 1,
            "forget_seconds": 0.1,
            "max_entries": 10,
            **held,
        }

    rows = [row("a", "window", 0.25, 0.5), row("b", "window", 0.25, 0.7), row("a", "old", 0.5)]
    summary = summarize_memory(rows)
    kept = summary["window"]["0.25"]
    assert kept["own_entries_fraction"] == pytest.approx(0.6)
    assert kept["own_bytes_fraction"] == pytest.approx(0.3)
    assert summary["old"]["0.5"]["own_entries_fraction"] is None  # a record written before them
    lines = format_memory_table(summary).splitlines()
    assert lines[0].endswith("rounds  own entries  own bytes")
    assert next(x for x in lines if x.startswith("window")).split()[-2:] == ["0.600", "0.300"]
    assert next(x for x in lines if x.startswith("old")).split()[-2:] == ["-", "-"]
