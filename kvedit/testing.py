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


def _llama_config(vocab: int, tok: PreTrainedTokenizerFast):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )


def _qwen2_config(vocab: int, tok: PreTrainedTokenizerFast):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )


def _gemma3_config(vocab: int, tok: PreTrainedTokenizerFast):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=TINY_SLIDING_WINDOW,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


_CONFIGS: dict[str, Callable] = {
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "gemma3": _gemma3_config,
}


def tiny_model(
    arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build a tiny random causal LM and its tokenizer.

    Args:
        arch: ``"llama"``, ``"qwen2"`` or ``"gemma3"`` (the latter mixes sliding-window layers,
            window :data:`TINY_SLIDING_WINDOW`, with a global layer).
        seed: weights are drawn from this seed without touching the global RNG.
        dtype: parameter dtype.

    Returns:
        ``(model, tokenizer)``, the model in eval mode on CPU with ``sdpa`` attention.
    """
    if arch not in _CONFIGS:
        raise UnsupportedModelError(f"tiny_model: unknown arch {arch!r}; choose from {TINY_ARCHS}")
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    config = _CONFIGS[arch](len(tok), tok)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        # Random heads put EOS at the top too often; silence special tokens' output rows so
        # test generations run their full length.
        model.get_output_embeddings().weight[tok.all_special_ids] = 0.0
    model.eval()
    model.name_or_path = f"tiny-{arch}"
    model.config.name_or_path = f"tiny-{arch}"
    return model, tok
