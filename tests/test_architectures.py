"""The architecture matrix: kvedit's core properties on one tiny model per decoder architecture.

``kvedit.testing.MATRIX_ARCHS`` names one tiny random causal LM per decoder architecture of
transformers (Llama, Mistral, Mixtral, Qwen2/3 and their MoE versions, Gemma 1/2/3, Phi,
Phi-3, OLMo 1/2/3, Granite, Cohere 1/2, StarCoder2, StableLM, GPT-NeoX, Falcon, GPT-J, GPT-2,
SmolLM3, GLM, GLM-4, DeepSeek-V3, MiniCPM3, gpt-oss), each in its default layer pattern with at
least 4 layers and sliding windows shorter than the prompts below (8 tokens; 24 for Mistral,
whose layers all slide, so that the span in the middle of the prefix stays within reach). Every
property below runs on every architecture:

a. continuation identity: a captured prefix continues exactly like the plain model
   (``generate`` token for token, ``logits`` within 1e-4 of a full forward);
b. an edit changes the answer (all rows, and separately row 0, the first prediction) and an
   edit of strength 0 does not;
c. ``duplicate(span, 1)`` is a ``log 2`` emphasis on the global layers (no change at all when
   there is none);
d. save/load identity;
e. key re-rotation: ``kvedit.rope.rerotate`` moves a layer's cached keys from positions
   ``0..n-1`` to ``d..d+n-1`` exactly as a forward at those positions caches them (and a layer
   whose values depend on the position, e.g. an MLA latent cache, must be refused).

Each check passes, or is refused with :class:`~kvedit.errors.UnsupportedModelError` where
:data:`EXPECTED_REFUSALS` lists the refusal (the architecture, the check, a part of the
message). A refusal not listed fails, so does a listed one that no longer happens (remove it
from the list, and say why in the commit); any other exception, or a wrong number, is a
failure: kvedit must never silently compute something wrong for a model.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math

import pytest
import torch
from helpers import reference_generate
from transformers import DynamicCache

import kvedit
from kvedit.errors import UnsupportedModelError
from kvedit.testing import MATRIX_ARCHS, MATRIX_SLIDING_WINDOW, tiny_model

# ~33 tokens: longer than the matrix's sliding windows, so sliding layers drop the span.
PREFIX = (
    "Below are some records. Alice's secret number is 4821. Bob's secret number is 7310. "
    "Carol's secret number is 5902."
)
SPAN = "Bob's secret number is 7310"  # in the middle of the prefix
QUESTION = " Question: What is Bob's secret number? Answer:"
NEW_TOKENS = 8
SHIFT = 5  # positions the re-rotation test moves the keys by

LOGITS_TOL = 1e-4  # kvedit's path vs the model's own
EXACT_TOL = 1e-6  # the same computation on the same path
CHANGED = 1e-3  # an edit must move some logit by more than this
KEYS_TOL = 1e-4

pytestmark = pytest.mark.parametrize("arch", MATRIX_ARCHS)

# The refusals kvedit makes on purpose: (architecture, check) -> a part of the message of the
# UnsupportedModelError (for ``rerotate_keys``: of every layer's). No other check refuses.
MOVED_VALUES = "cached values change with the position"  # learned positions, MLA latents
EXPECTED_REFUSALS = {
    # GPT-J rotates pairs of interleaved channels of part of each head: no rotation of the
    # rotary module's frequencies reproduces its keys at another position
    ("gptj", "rerotate_keys"): "no rotation of the rotary module's frequencies reproduces",
    ("gpt2", "rerotate_keys"): MOVED_VALUES,  # learned absolute position embeddings
    ("deepseek_v3", "rerotate_keys"): MOVED_VALUES,  # an MLA latent cache
    ("minicpm3", "rerotate_keys"): MOVED_VALUES,  # an MLA latent cache
}


def test_every_expected_refusal_names_an_architecture_and_a_check(arch):
    if arch == MATRIX_ARCHS[0]:  # once: the list is the module's, not the architecture's
        assert {a for a, _ in EXPECTED_REFUSALS} <= set(MATRIX_ARCHS)
        assert all(callable(globals().get(f"test_{check}")) for _, check in EXPECTED_REFUSALS)


@functools.cache
def _model(arch: str):
    return tiny_model(arch)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@contextlib.contextmanager
def _refusals(arch: str, check: str):
    """The check passes as written where no refusal is expected; where one is, the block must
    raise kvedit's UnsupportedModelError with the expected message (the check then passes, its
    numbers unchecked). Anything else propagates."""
    expected = EXPECTED_REFUSALS.get((arch, check))
    try:
        yield
    except UnsupportedModelError as err:
        if expected is None:
            pytest.fail(f"{arch}: {check} refused, and no refusal is expected: {err}")
        assert expected in str(err), f"{arch}: {check} refused for another reason: {err}"
        return
    if expected is not None:
        pytest.fail(f"{arch}: {check} was expected to be refused ({expected!r}), and ran")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return float((a.float() - b.float()).abs().max())


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    diff = _max_diff(got, want)
    assert diff <= tol, f"{what}: max abs diff {diff:.3g} > {tol:g}"


def _assert_differs(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = _max_diff(a, b)
    assert diff > CHANGED, f"{what}: max abs diff {diff:.3g} <= {CHANGED:g}, the edit did nothing"


def _cache_kwarg(model) -> str:
    # transformers 5.24 renamed forward's ``past_key_values`` to ``cache``.
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _ids(tok, text: str, special: bool) -> list[int]:
    return list(tok(text, add_special_tokens=special)["input_ids"])


# ------------------------------------------------------------------ a. continuation identity


def test_continuation_generate(arch):
    model, tok = _model(arch)
    want = reference_generate(model, tok, _ids(tok, PREFIX, True), QUESTION, NEW_TOKENS)
    with _refusals(arch, "continuation_generate"):
        got = kvedit.capture(model, tok, PREFIX).generate(QUESTION, max_new_tokens=NEW_TOKENS)
    assert got == want


def test_continuation_logits(arch):
    model, tok = _model(arch)
    prefix_ids, q_ids = _ids(tok, PREFIX, True), _ids(tok, QUESTION, False)
    full = model(input_ids=torch.tensor([prefix_ids + q_ids])).logits[0].float()
    n = len(prefix_ids)
    want = full[n - 1 : n - 1 + len(q_ids)]  # row 0: the prediction after the prefix
    with _refusals(arch, "continuation_logits"):
        got = kvedit.capture(model, tok, PREFIX).logits(QUESTION)
    _assert_close(got, want, LOGITS_TOL, "state logits vs a full forward")


# ------------------------------------------------------------------ b. edits change the answer


def test_emphasize_changes_logits(arch):
    model, tok = _model(arch)
    with _refusals(arch, "emphasize_changes_logits"):
        st = kvedit.capture(model, tok, PREFIX)
        base = st.logits(QUESTION)
        edited = kvedit.ops.emphasize(st, SPAN, 3.0).logits(QUESTION)
    _assert_differs(edited, base, "emphasize(3.0) vs no edit, all rows")


def test_emphasize_changes_first_prediction(arch):
    # Row 0 is the prediction right after the prefix: an edit must reach it too.
    model, tok = _model(arch)
    with _refusals(arch, "emphasize_changes_first_prediction"):
        st = kvedit.capture(model, tok, PREFIX)
        base = st.logits(QUESTION)
        edited = kvedit.ops.emphasize(st, SPAN, 3.0).logits(QUESTION)
    _assert_differs(edited[0], base[0], "emphasize(3.0) vs no edit, row 0")


def test_emphasize_zero_is_identity(arch):
    model, tok = _model(arch)
    with _refusals(arch, "emphasize_zero_is_identity"):
        st = kvedit.capture(model, tok, PREFIX)
        base = st.logits(QUESTION)
        edited = kvedit.ops.emphasize(st, SPAN, 0.0).logits(QUESTION)
    _assert_close(edited, base, EXACT_TOL, "emphasize(0.0) vs no edit")


# ------------------------------------------------------------------ c. duplicate == log 2 bias


def test_duplicate_is_log2_emphasis(arch):
    model, tok = _model(arch)
    with _refusals(arch, "duplicate_is_log2_emphasis"):
        st = kvedit.capture(model, tok, PREFIX)
        global_layers = st.global_layers
        dup = kvedit.ops.duplicate(st, SPAN, 1).logits(QUESTION)
        if global_layers:
            emph = kvedit.ops.emphasize(st, SPAN, math.log(2), layers=global_layers)
        else:  # only sliding layers (Mistral): nothing to duplicate onto
            emph = st
        emph = emph.logits(QUESTION)
    _assert_close(dup, emph, LOGITS_TOL, "duplicate(1) vs emphasize(log 2) on global layers")


# ------------------------------------------------------------------ d. save/load identity


def test_save_load_identity(arch, tmp_path):
    model, tok = _model(arch)
    path = tmp_path / "s.kv"
    with _refusals(arch, "save_load_identity"):
        st = kvedit.capture(model, tok, PREFIX)
        st.save(path)
        loaded = kvedit.load_state(path, model, tok)
        _assert_close(
            loaded.logits(QUESTION), st.logits(QUESTION), EXACT_TOL, "loaded vs saved logits"
        )
        assert loaded.generate(QUESTION, max_new_tokens=NEW_TOKENS) == st.generate(
            QUESTION, max_new_tokens=NEW_TOKENS
        )


# ------------------------------------------------------------------ e. key re-rotation


def _plain_cache(model, ids: list[int], start: int) -> DynamicCache:
    """The model's own cache of ``ids`` encoded at positions ``start..start+n-1``."""
    cache = DynamicCache(config=model.config)
    model(
        input_ids=torch.tensor([ids]),
        position_ids=torch.arange(start, start + len(ids))[None],
        use_cache=True,
        **{_cache_kwarg(model): cache},
    )
    return cache


def test_rerotate_keys(arch):
    from kvedit import rope

    model, tok = _model(arch)
    ids = _ids(tok, PREFIX, True)
    # Masks follow the cache index, not position_ids, so both runs hold the same entries, also
    # on sliding layers (their last window - 1 tokens); the prefix is longer than the window.
    assert len(ids) > MATRIX_SLIDING_WINDOW
    at_0, at_d = _plain_cache(model, ids, 0), _plain_cache(model, ids, SHIFT)
    assert len(at_0.layers) == len(at_d.layers)
    refused, wrong = [], []
    for i, (l0, ld) in enumerate(zip(at_0.layers, at_d.layers, strict=True)):
        keys, want = l0.keys, ld.keys
        assert keys.shape == want.shape, f"layer {i}: the two runs hold different entries"
        delta = torch.full((keys.shape[-2],), SHIFT, dtype=torch.long)
        try:
            moved = rope.rerotate(model, i, keys, delta)
        except UnsupportedModelError as err:
            refused.append(f"layer {i}: {err}")
            continue
        if moved.shape != want.shape:
            wrong.append(f"layer {i}: shape {tuple(moved.shape)} != {tuple(want.shape)}")
            continue
        diff = _max_diff(moved, want)
        if diff > KEYS_TOL:
            wrong.append(f"layer {i}: keys off by {diff:.3g}")
        # Moving an entry by re-rotating its key is only right when its value carries no
        # position (not so for MLA latent caches or learned absolute positions).
        vdiff = _max_diff(l0.values, ld.values)
        if vdiff > KEYS_TOL:
            wrong.append(f"layer {i}: values depend on the position ({vdiff:.3g}), not refused")
    assert not wrong, "; ".join(wrong)
    expected = EXPECTED_REFUSALS.get((arch, "rerotate_keys"))
    if expected is None:
        assert not refused, f"{arch}: refusals not expected: " + "; ".join(refused)
    else:
        assert len(refused) == len(at_0.layers), f"{arch}: expected every layer refused"
        other = [r for r in refused if expected not in r]
        assert not other, f"{arch}: refused for another reason: " + "; ".join(other)
