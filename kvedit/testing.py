"""Tiny, deterministic random models for tests and CLI smoke runs.

``tiny_model(arch)`` builds a small causal LM from a config (no download, no hub) together with
a byte-level BPE tokenizer trained locally on a fixed corpus, so every test can run offline in
a fraction of a second. The same ``arch`` always gives the same weights and tokenizer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from .errors import UnsupportedModelError

TINY_ARCHS = ("llama", "qwen2", "gemma3")

# Sliding window of the tiny Gemma-3: small, so tests can use prompts longer than the window.
TINY_SLIDING_WINDOW = 16

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = (
    """
Below are some records. Answer the question using the records. Answer with the number only.
Alice's secret number is 4821. Bob's secret number is 7310. Carol's secret number is 5902.
What is Dave's secret number? The answer is 1234. Question: Answer: Document [1](Title: Paris)
The capital of France is Paris. The quick brown fox jumps over the lazy dog.
Write a high-quality answer for the given question using only the provided search results.
0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 - , . ; : ! ? ' " ( ) [ ] { } < > / = + * # @ & %
Eve Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil Trent Victor Walter
the of and to in is was for on that with as by at from his her it an are which or be this
"""
    * 4
)

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


@functools.cache
def _tokenizer_json() -> str:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A",
        pair="<|endoftext|> $A <|endoftext|> $B",
        special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))],
    )
    return tok.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (vocab 512) built locally, with BOS and a chat template.

    Byte-level, so every string round-trips; it prepends BOS (``<|endoftext|>``) by default.
    """
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = _CHAT_TEMPLATE
    tok.name_or_path = "kvedit-tiny-tokenizer"
    return tok


def _common(tok: PreTrainedTokenizerFast, vocab: int, **overrides) -> dict:
    """Keyword arguments most configs share: tiny sizes, the tiny tokenizer's special ids."""
    kw = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    kw.update(overrides)
    return kw


def _llama_config(vocab: int, tok: PreTrainedTokenizerFast):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(tok, vocab, num_hidden_layers=3, tie_word_embeddings=False))


def _qwen2_config(vocab: int, tok: PreTrainedTokenizerFast):
    from transformers import Qwen2Config

    sizes = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6)
    return Qwen2Config(**_common(tok, vocab, tie_word_embeddings=True, **sizes))


def _gemma3_config(vocab: int, tok: PreTrainedTokenizerFast):
    from transformers import Gemma3TextConfig

    layer_types = ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
    return Gemma3TextConfig(
        **_common(
            tok,
            vocab,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=TINY_SLIDING_WINDOW,
            layer_types=layer_types,
        )
    )


_CONFIGS: dict[str, Callable] = {
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "gemma3": _gemma3_config,
}


# -------------------------------------------------------------------- the architecture matrix
#
# One tiny config per decoder architecture, for tests/test_architectures.py. Each keeps its
# architecture's default layer pattern (sliding/global interleaving, NoPE layers, partial or
# interleaved RoPE, MLA, MoE, attention sinks, soft-capping, ...) with at least 4 decoder layers
# and small sliding windows (MATRIX_SLIDING_WINDOW), so that sliding really happens on prompts
# of a few dozen tokens. "llama-4l", "qwen2-4l" and "gemma3-6l" are the matrix's versions of
# the three TINY_ARCHS models above (which stay as they are: other tests depend on them).

# Sliding window of the matrix models that have one.
MATRIX_SLIDING_WINDOW = 8


def _config(class_name: str, **fixed) -> Callable:
    """A config builder: ``transformers.<class_name>(**_common(...) | fixed)``."""

    def build(vocab: int, tok: PreTrainedTokenizerFast):
        import transformers

        return getattr(transformers, class_name)(**_common(tok, vocab, **fixed))

    build.__name__ = f"_{class_name}"
    return build


def _gpt2_style(class_name: str, **fixed) -> Callable:
    """Builder for GPT-2-style configs (``n_embd``, ``n_layer``, ``n_head``, ``n_positions``)."""

    def build(vocab: int, tok: PreTrainedTokenizerFast):
        import transformers

        return getattr(transformers, class_name)(
            vocab_size=vocab,
            n_embd=64,
            n_layer=4,
            n_head=4,
            n_inner=128,
            n_positions=4096,
            initializer_range=0.2,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **fixed,
        )

    build.__name__ = f"_{class_name}"
    return build


_W = MATRIX_SLIDING_WINDOW
_MOE = dict(num_experts_per_tok=2)  # top-2 of 4 experts everywhere

_MATRIX_CONFIGS: dict[str, Callable] = {
    # plain global attention, full RoPE
    "llama-4l": _config("LlamaConfig"),
    "qwen2-4l": _config("Qwen2Config", hidden_size=48, num_attention_heads=6),
    # sliding_window on every layer, no layer_types (the model masks with the window). The
    # window is wider than the others (still shorter than the tests' prompts) because Mistral
    # has no global layer: a span in the middle of a prompt must stay within reach.
    "mistral": _config("MistralConfig", sliding_window=3 * _W),
    "mixtral": _config("MixtralConfig", num_local_experts=4, **_MOE),
    "qwen2_moe": _config(
        "Qwen2MoeConfig",
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        **_MOE,
    ),
    "qwen3": _config("Qwen3Config", head_dim=16),  # q/k RMSNorm per head
    "qwen3_moe": _config(
        "Qwen3MoeConfig", head_dim=16, num_experts=4, moe_intermediate_size=32, **_MOE
    ),
    "gemma": _config("GemmaConfig", head_dim=16),
    # alternating sliding/global layers, attention and final logit soft-capping
    "gemma2": _config("Gemma2Config", head_dim=16, query_pre_attn_scalar=16, sliding_window=_W),
    # Gemma-3's default 5:1 sliding/global pattern (6 layers), per-type RoPE
    "gemma3-6l": _config(
        "Gemma3TextConfig",
        num_hidden_layers=6,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=_W,
    ),
    "phi": _config("PhiConfig"),  # partial RoPE (half the head dimension), parallel block
    "phi3": _config("Phi3Config"),
    "olmo": _config("OlmoConfig"),
    "olmo2": _config("Olmo2Config"),  # q/k RMSNorm over all heads
    "olmo3": _config("Olmo3Config", sliding_window=_W),  # 3 sliding : 1 global
    # non-default attention scale (1 / head_dim), embedding/residual/logit multipliers
    "granite": _config(
        "GraniteConfig",
        attention_multiplier=1 / 16,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        logits_scaling=8.0,
    ),
    "cohere": _config("CohereConfig"),  # interleaved RoPE, parallel block, logit_scale
    # 3 sliding (RoPE) : 1 global (no RoPE)
    "cohere2": _config("Cohere2Config", sliding_window=_W),
    "starcoder2": _config("Starcoder2Config"),
    "stablelm": _config("StableLmConfig"),  # partial RoPE (a quarter)
    "gpt_neox": _config("GPTNeoXConfig"),  # partial RoPE (a quarter), fused QKV
    # Falcon-7B style (multi-query, parallel attention, RoPE)
    "falcon": _config("FalconConfig", num_key_value_heads=None),
    "gptj": _gpt2_style("GPTJConfig", rotary_dim=8),  # interleaved partial RoPE
    "gpt2": _gpt2_style("GPT2Config"),  # learned absolute positions, no RoPE
    # NoPE every second layer
    "smollm3": _config("SmolLM3Config", no_rope_layer_interval=2),
    "glm": _config("GlmConfig", head_dim=16),  # interleaved partial RoPE
    "glm4": _config("Glm4Config", head_dim=16),
    # multi-head latent attention: keys [nope | rope] of 16 + 8, values of 16, MoE from layer 1
    "deepseek_v3": _config(
        "DeepseekV3Config",
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        **_MOE,
    ),
    "minicpm3": _config(
        "MiniCPM3Config",
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        head_dim=24,
    ),
    # attention sinks, alternating sliding/global layers, YaRN RoPE, MoE
    "gpt_oss": _config(
        "GptOssConfig",
        head_dim=16,
        intermediate_size=64,
        sliding_window=_W,
        num_local_experts=4,
        **_MOE,
    ),
}

# Architectures whose transformers 5.24 implementation has no sdpa path; they run "eager".
_EAGER = {
    "gemma2": "sdpa does not support its attention logit soft-capping",
    "gpt_oss": "sdpa does not support its attention sinks",
}

MATRIX_ARCHS: tuple[str, ...] = tuple(_MATRIX_CONFIGS)
"""Every architecture of the matrix (``tiny_model`` accepts each)."""


def tiny_config(arch: str):
    """The transformers configuration :func:`tiny_model` builds for ``arch`` (no weights), or
    None for an architecture it does not know."""
    builder = _CONFIGS.get(arch) or _MATRIX_CONFIGS.get(arch)
    if builder is None:
        return None
    tok = tiny_tokenizer()
    return builder(len(tok), tok)


def tiny_model(
    arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build a tiny random causal LM and its tokenizer.

    Args:
        arch: ``"llama"``, ``"qwen2"`` or ``"gemma3"`` (the latter mixes sliding-window layers,
            window :data:`TINY_SLIDING_WINDOW`, with a global layer), or one of
            :data:`MATRIX_ARCHS` (one tiny model per decoder architecture, window
            :data:`MATRIX_SLIDING_WINDOW`).
        seed: weights are drawn from this seed without touching the global RNG.
        dtype: parameter dtype.

    Returns:
        ``(model, tokenizer)``, the model in eval mode on CPU with ``sdpa`` attention
        (``eager`` for the architectures transformers runs without sdpa: gemma2, gpt_oss).
    """
    builder = _CONFIGS.get(arch) or _MATRIX_CONFIGS.get(arch)
    if builder is None:
        raise UnsupportedModelError(
            f"tiny_model: unknown arch {arch!r}; choose from {TINY_ARCHS + MATRIX_ARCHS}"
        )
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    config = builder(len(tok), tok)
    attn = "eager" if arch in _EAGER else "sdpa"
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
        except ValueError:  # an older transformers without sdpa for this arch (gptj in 5.19)
            if attn != "sdpa":
                raise
            config._attn_implementation = "eager"
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="eager"
            )
    with torch.no_grad():
        # Random heads put EOS at the top too often; silence special tokens' output rows so
        # test generations run their full length.
        model.get_output_embeddings().weight[tok.all_special_ids] = 0.0
    model.eval()
    model.name_or_path = f"tiny-{arch}"
    model.config.name_or_path = f"tiny-{arch}"
    return model, tok
