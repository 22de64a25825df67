"""Spans and token offsets: the text a span is searched in, and which tokens it selects.

``token_offsets`` is tested with three locally built tokenizers: the byte-level BPE of
``kvedit.testing``, a SentencePiece-style BPE (Metaspace pre-tokenizer and decoder, as Mistral
and Gemma) and one with Llama-2's legacy decoder (``Replace``, ``Fuse``, ``Strip`` of one
leading space). The last two drop a leading space when they decode a sequence that starts
with a ``▁`` token, which shifted spans when offsets were rebuilt by re-decoding runs of
tokens that restarted after special tokens and every 256 tokens.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from kvedit.errors import InvalidInputError, InvalidTypeError, SpanNotFoundError
from kvedit.spans import (
    _offsets_from_pieces,
    _pieces_from_stream,
    as_span_list,
    char_ranges,
    token_offsets,
    tokens_in_ranges,
)
from kvedit.testing import tiny_tokenizer

NAMES = ("Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy")
_CORPUS = [
    " ".join(f"{n}'s secret number is {1000 + 37 * i}." for i, n in enumerate(NAMES)) * 3
    + " Question: Answer: user assistant The quick brown fox jumps over the lazy dog.\n"
] * 4
_SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
_ALPHABET = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;'?!\n▁-()")


@functools.cache
def _sentencepiece_json(legacy: bool) -> str:
    tok = Tokenizer(models.BPE(unk_token=None))
    if legacy:  # Llama-2: the normalizer prepends and replaces, the decoder strips one space
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:  # Metaspace pre-tokenizer and decoder (Mistral, Gemma, Llama-2 non-legacy)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=_SPECIAL, initial_alphabet=_ALPHABET, show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok.to_str()


def sentencepiece_tokenizer(legacy: bool = False) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE tokenizer built offline (BOS ``<s>`` added by default)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_sentencepiece_json(legacy)),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


TOKENIZERS = {
    "bytelevel": tiny_tokenizer,
    "metaspace": sentencepiece_tokenizer,
    "llama2-legacy": functools.partial(sentencepiece_tokenizer, legacy=True),
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


class WithoutBackend:
    """A tokenizer seen through ``decode`` only, as a slow (Python) tokenizer would be."""

    is_fast = False

    def __init__(self, tok):
        self._tok = tok
        self.all_special_ids = tok.all_special_ids

    def decode(self, ids, **kwargs):
        return self._tok.decode(ids, **kwargs)


def long_text() -> str:
    """~600+ tokens of distinct records, with chat-template special tokens in the middle."""
    parts = []
    for i in range(160):
        name = NAMES[i % len(NAMES)]
        parts.append(f"{name}'s secret number is {1000 + 37 * i}.")
        if i in (7, 31, 90):
            parts.append("<|im_end|>\n<|im_start|>user\nThe quick brown fox.")
    return " ".join(parts)


def decoded(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def expected_tokens(tok, text: str, span: str) -> list[int]:
    """The tokens ``span`` selects, from the tokenizer's own offsets into the original text."""
    enc = tok(text, return_offsets_mapping=True)
    offsets = torch.tensor(enc["offset_mapping"]).reshape(-1, 2)
    special = set(tok.all_special_ids)
    for i, tid in enumerate(enc["input_ids"]):
        if tid in special:
            offsets[i, 1] = offsets[i, 0]
    return tokens_in_ranges(offsets, char_ranges(text, span)).tolist()


def boundary_spans(tok, text: str) -> list[str]:
    """Substrings of ``text`` (each occurring once) around token boundaries that broke before:
    just after special tokens and across the 256th and 512th tokens."""
    enc = tok(text, return_offsets_mapping=True)
    offsets, ids = enc["offset_mapping"], enc["input_ids"]
    assert len(ids) > 520, len(ids)
    special = set(tok.all_special_ids)
    cuts = [offsets[k][0] for k in (255, 256, 257, 511, 512)]
    # after special tokens, except a leading BOS: there the decoded text gains the space that
    # SentencePiece prepends, so the original text's offsets are not comparable
    cuts += [offsets[i + 1][0] for i, t in enumerate(ids[:-1]) if t in special and i > 0]
    spans = []
    for cut in cuts:
        for width in (12, 20, 30):
            span = text[max(0, cut - width) : cut + width].strip()
            if span and "<" not in span and ">" not in span and text.count(span) == 1:
                spans.append(span)
                break
    assert len(spans) >= 5, spans
    return spans


# ------------------------------------------------------------------------ token_offsets


def test_offsets_are_the_tokenizers_own(tok):
    text = long_text()
    ids = tok(text)["input_ids"]
    got_text, offsets = token_offsets(tok, ids)
    assert got_text == decoded(tok, ids)
    assert offsets.shape == (len(ids), 2) and offsets.dtype == torch.long
    special = set(tok.all_special_ids)
    for i, tid in enumerate(ids):
        a, b = offsets[i].tolist()
        assert 0 <= a <= b <= len(got_text)
        if tid in special:
            assert a == b  # zero width at its place
            assert got_text[a:].startswith(tok.convert_ids_to_tokens(tid))
    for span in boundary_spans(tok, text):
        assert span in got_text
        got = tokens_in_ranges(offsets, char_ranges(got_text, span)).tolist()
        assert got == expected_tokens(tok, text, span), span


@pytest.mark.parametrize("path", ["stream", "windows"])
def test_incremental_decoding_agrees_with_the_offsets(tok, path):
    """Both fallbacks give the same text as decode and select the same tokens."""
    text = long_text()
    ids = tok(text)["input_ids"]
    if path == "stream":
        got_text, offsets = token_offsets_without_encoding(tok, ids)
    else:
        got_text, offsets = token_offsets(WithoutBackend(tok), ids)
    assert got_text == decoded(tok, ids)
    for span in boundary_spans(tok, text):
        got = tokens_in_ranges(offsets, char_ranges(got_text, span)).tolist()
        assert got == expected_tokens(tok, text, span), span


def token_offsets_without_encoding(tok, ids):
    pieces = _pieces_from_stream(tok, ids)
    assert pieces is not None
    got_text, offsets = _offsets_from_pieces(pieces)
    special = set(tok.all_special_ids)
    for i, tid in enumerate(ids):
        if tid in special:
            offsets[i, 1] = offsets[i, 0]
    return got_text, offsets


def test_ids_that_do_not_round_trip_are_decoded_incrementally(tok):
    """A word spelled one character per token (not what the tokenizer would produce)."""
    vocab = tok.get_vocab()
    prefix = tok("The secret number of")["input_ids"]
    letters = [vocab[c] for c in "Zebra" if c in vocab]
    assert len(letters) == 5
    suffix = tok(" is 4821.", add_special_tokens=False)["input_ids"]
    ids = prefix + letters + suffix
    for view in (tok, WithoutBackend(tok)):
        got_text, offsets = token_offsets(view, ids)
        assert got_text == decoded(tok, ids)
        assert "Zebra" in got_text and got_text.rstrip().endswith("is 4821.")
        start = got_text.index("Zebra")
        for k, i in enumerate(range(len(prefix), len(prefix) + 5)):
            a, b = offsets[i].tolist()
            assert got_text[a:b].strip() == "Zebra"[k]
            assert a <= start + k < b
        assert tokens_in_ranges(offsets, char_ranges(got_text, "bra")).tolist() == list(
            range(len(prefix) + 2, len(prefix) + 5)
        )


def test_a_different_split_of_the_same_length_is_not_taken_for_the_canonical_one():
    """``a|bc`` decodes to the text ``ab|c`` encodes to: same count, other ids, other offsets."""
    vocab = {"<s>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "bc": 5, " ": 6}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>")
    assert tok("abc", add_special_tokens=False)["input_ids"] == [4, 3]
    text, offsets = token_offsets(tok, [1, 5, 6, 4, 3])  # a|bc ab|c
    assert text == "abc abc"
    assert offsets.tolist() == [[0, 1], [1, 3], [3, 4], [4, 6], [6, 7]]


def test_multibyte_characters_split_across_tokens():
    """Byte-level tokens that each hold part of one character all get the character."""
    tok = tiny_tokenizer()
    text = "Zoë's number 😀 is 4821. Ünïcödé ok"
    ids = tok(text)["input_ids"]
    assert len(ids) > len(tok(text.encode("ascii", "ignore").decode())["input_ids"])
    emoji_ids = tok("😀", add_special_tokens=False)["input_ids"]
    assert len(emoji_ids) == 4  # one byte per token in this small vocabulary
    shuffled = ids[:1] + emoji_ids + ids[1:]  # not a canonical encoding: the fallbacks run
    for view, seq in ((tok, ids), (tok, shuffled), (WithoutBackend(tok), shuffled)):
        got_text, offsets = token_offsets(view, seq)
        assert got_text == decoded(tok, seq)
        hit = tokens_in_ranges(offsets, char_ranges(got_text, "😀"))
        assert len(hit) >= 4
        for i in hit.tolist():
            a, b = offsets[i].tolist()
            assert "😀" in got_text[a:b] or got_text[a:b] in " 😀"
    got_text, offsets = token_offsets(tok, ids)
    assert tokens_in_ranges(offsets, char_ranges(got_text, "ë")).numel() >= 1


def test_empty_ids():
    text, offsets = token_offsets(tiny_tokenizer(), [])
    assert text == "" and offsets.shape == (0, 2)


def test_ids_may_be_a_tensor():
    tok = sentencepiece_tokenizer(legacy=True)
    ids = tok(long_text())["input_ids"]
    text, offsets = token_offsets(tok, ids)
    text_t, offsets_t = token_offsets(tok, torch.tensor(ids))
    assert text_t == text and torch.equal(offsets_t, offsets)


# ------------------------------------------------------------------------ spans


@pytest.mark.parametrize(
    "spans,error,match",
    [
        (None, InvalidTypeError, "not None"),
        (3, InvalidTypeError, "not 3"),
        ({"Alice": 1}, InvalidTypeError, "dict"),
        (b"Alice", InvalidTypeError, "bytes"),
        (["Alice", None], InvalidTypeError, "not None"),
        (["Alice", 3], InvalidTypeError, "not 3"),
        ([(0, 2.5)], InvalidTypeError, "ints"),
        ((True, 3), InvalidTypeError, "True"),
        ("", InvalidInputError, "empty"),
        (re.compile(""), InvalidInputError, "empty"),
        ((5, 5), InvalidInputError, "range"),
        ((-1, 5), InvalidInputError, "range"),
    ],
    ids=lambda x: repr(x) if not isinstance(x, type) else "",
)
def test_bad_spans_raise_kvedit_errors(spans, error, match):
    with pytest.raises(error, match=match):
        as_span_list(spans)
    with pytest.raises(ValueError):  # every one is also a ValueError, as before
        as_span_list(spans)


def test_good_spans():
    import numpy as np

    pattern = re.compile(r"\d+")
    assert as_span_list("Alice") == ["Alice"]
    assert as_span_list((0, 5)) == [(0, 5)]
    assert as_span_list((np.int64(0), torch.tensor(5))) == [(0, 5)]
    assert as_span_list(["Alice", pattern, (1, 2)]) == ["Alice", pattern, (1, 2)]
    assert as_span_list(s for s in ("a", "b")) == ["a", "b"]
    assert as_span_list([]) == []
    assert char_ranges("Alice and Alice", "Alice") == [(0, 5), (10, 15)]
    with pytest.raises(SpanNotFoundError):
        char_ranges("Alice", (0, 6))


def test_tokens_of_one_word_share_its_number():
    """word_index: the tokens of a whitespace-separated word share its number (punctuation
    and digits included), whitespace-only and zero-width tokens get numbers of their own."""
    from kvedit.spans import word_index

    text = "My code is SZ-611. ok"
    # "My" " code" " is" " SZ" "-" "611" "." " " "ok" and a zero-width special at the end
    cuts = [(0, 2), (2, 7), (7, 10), (10, 13), (13, 14), (14, 17), (17, 18), (18, 19), (19, 21)]
    offsets = torch.tensor([*cuts, (21, 21)])
    words = word_index(text, offsets).tolist()
    assert words[:3] == [0, 1, 2]
    assert words[3:7] == [3, 3, 3, 3]  # SZ-611. is one word
    assert words[8] == 4
    assert len(set(words)) == 7 and words[7] not in words[:7] + words[8:]
    assert words[9] not in words[:9]
