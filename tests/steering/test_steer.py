"""``kvedit.steer``: biasing a model's attention toward (or away from) spans of its prompt."""

from __future__ import annotations

import concurrent.futures
import importlib
import math
import re
import threading

import pytest
import torch
from conftest import RECORDS
from transformers import LogitsProcessor, LogitsProcessorList

import kvedit
from kvedit.errors import KVEditError, SpanNotFoundError
from kvedit.runtime import active_plan
from kvedit.testing import TINY_SLIDING_WINDOW, tiny_model

steer_module = importlib.import_module(
    "kvedit.steering.session"
)  # ``kvedit.steer`` is the function

PROMPT = RECORDS + "Question: What is Carol's secret number? Answer:"


# ------------------------------------------------------------------------------------ helpers


def encode(tok, text, **kwargs):
    return tok(text, return_tensors="pt", **kwargs)


def span_token_indices(tok, text, substring, add_special_tokens=True):
    """Indices of the tokens of ``tok(text)`` whose characters overlap any occurrence."""
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=add_special_tokens)
    ranges = [(m.start(), m.end()) for m in re.finditer(re.escape(substring), text)]
    return [
        i
        for i, (a, b) in enumerate(enc["offset_mapping"])
        if b > a and any(a < end and b > start for start, end in ranges)
    ]


def greedy(model, enc, n=12, **kwargs):
    """``(sequences, logits [batch, n, vocab])`` of greedy ``model.generate``."""
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=n,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )
    return out.sequences, torch.stack(out.logits, dim=1)


def hidden_states(model, enc):
    with torch.no_grad():
        return model(**enc, output_hidden_states=True).hidden_states


def bound_plans(monkeypatch, steering, prompt, **gen_kwargs):
    """Run the wrapper ``steering.generate(prompt)``; return (text, the plans it activated)."""
    plans = []
    real_activate = steer_module.activate

    def spy(model, plan, owner=None):
        plans.append(plan)
        return real_activate(model, plan, owner=owner)

    with monkeypatch.context() as patch:
        patch.setattr(steer_module, "activate", spy)
        text = steering.generate(prompt, **gen_kwargs)
    return text, plans


def observed_probs(model, tok, enc, **steer_kwargs):
    """Per layer, the attention probabilities ``[batch, heads, q, k]`` of one steered forward."""
    probs = {}
    with kvedit.steer(model, tok, **steer_kwargs) as s:
        s.plan.observe = lambda layer, p: probs.__setitem__(layer, p.clone())
        with torch.no_grad():
            model(**enc)
    return probs


def assert_restored(model):
    assert model.config._attn_implementation == "kvedit"  # prepared once, never flipped back
    assert active_plan(model) is None


# ----------------------------------------------------------------------- the two ways to steer


def test_context_manager_steers_model_generate(tiny):
    arch, model, tok = tiny
    enc = encode(tok, PROMPT)
    plain_seq, plain_logits = greedy(model, enc)
    with kvedit.steer(model, tok, emphasize="5902", strength=3.0) as s:
        assert model.config._attn_implementation == "kvedit"
        seq, logits = greedy(model, enc)
    assert_restored(model)
    expected = span_token_indices(tok, PROMPT, "5902")
    assert expected
    assert s.plan.token_bias.shape == enc["input_ids"].shape
    assert (s.plan.token_bias[0] != 0).nonzero().flatten().tolist() == expected
    assert torch.all(s.plan.token_bias[0, expected] == 3.0)
    assert (logits - plain_logits).abs().amax() > 1e-3
    again_seq, again_logits = greedy(model, enc)  # and the model is back to normal
    assert torch.equal(again_seq, plain_seq)
    torch.testing.assert_close(again_logits, plain_logits, atol=0, rtol=0)


def test_wrapper_generate_defaults_to_32_greedy_new_tokens(llama, monkeypatch):
    model, tok = llama
    monkeypatch.setattr(model.generation_config, "do_sample", True)  # the wrapper stays greedy
    s = kvedit.steer(model, tok, emphasize="Carol", strength=2.0)
    text = s.generate(PROMPT)
    assert_restored(model)
    enc = encode(tok, PROMPT)
    with s, torch.no_grad():
        out = model.generate(**enc, max_new_tokens=32, do_sample=False)
    assert out.shape[1] == enc["input_ids"].shape[1] + 32  # tiny models never stop early
    assert text == tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert s.generate(PROMPT) == text  # deterministic
    assert kvedit.steer(model, tok, emphasize="Frank", strength=2.0).generate(PROMPT) != text


def test_wrapper_passes_generate_kwargs_through(llama):
    model, tok = llama
    s = kvedit.steer(model, tok, emphasize="Carol")
    short = s.generate(PROMPT, max_new_tokens=5)
    longer = s.generate(PROMPT, max_new_tokens=12)
    assert longer.startswith(short) and len(longer) > len(short)


def test_span_forms_select_the_same_tokens(llama, monkeypatch):
    model, tok = llama
    start = PROMPT.index("5902")
    forms = ["5902", ["5902"], re.compile(r"59\d2"), (start, start + 4), [(start, start + 2)]]
    expected = span_token_indices(tok, PROMPT, "5902")
    texts = set()
    for span in forms:
        text, plans = bound_plans(monkeypatch, kvedit.steer(model, tok, emphasize=span), PROMPT)
        (plan,) = plans
        assert (plan.token_bias[0] != 0).nonzero().flatten().tolist() == expected, span
        texts.add(text)
    assert len(texts) == 1
    both = span_token_indices(tok, PROMPT, "5902") + span_token_indices(tok, PROMPT, "Frank")
    _, (plan,) = bound_plans(
        monkeypatch, kvedit.steer(model, tok, emphasize=["5902", "Frank"]), PROMPT
    )
    assert (plan.token_bias[0] != 0).nonzero().flatten().tolist() == sorted(both)
    every = span_token_indices(tok, PROMPT, "secret")  # a substring counts every occurrence
    assert len(every) >= 6
    _, (plan,) = bound_plans(monkeypatch, kvedit.steer(model, tok, suppress="secret"), PROMPT)
    assert (plan.token_bias[0] < 0).nonzero().flatten().tolist() == every


def test_context_manager_binds_spans_per_row_of_a_padded_batch(llama):
    model, tok = llama
    texts = [PROMPT, "Carol's secret number is 5902. Question: What is it? Answer:"]
    singles = []
    for text in texts:
        with kvedit.steer(model, tok, emphasize="5902", strength=3.0):
            singles.append(greedy(model, encode(tok, text), n=8)[0][0])
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((2, width), tok.pad_token_id)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    with kvedit.steer(model, tok, emphasize="5902", strength=3.0) as s:
        batch, _ = greedy(model, {"input_ids": ids, "attention_mask": mask}, n=8)
    for i, r in enumerate(rows):
        marked = (s.plan.token_bias[i] != 0).nonzero().flatten() - (width - len(r))
        assert marked.tolist() == span_token_indices(tok, texts[i], "5902")
        assert batch[i, width:].tolist() == singles[i][len(r) :].tolist()


# ------------------------------------------------------------------------------------ strength


def test_strength_moves_attention_share_exactly_as_predicted(llama):
    """At layer 0 (inputs unaffected by steering) a bias ``s`` maps share ``p`` to
    ``p e^s / (p e^s + 1 - p)``; ``strength_for_share`` inverts that."""
    model, tok = llama
    enc = encode(tok, PROMPT)
    span = span_token_indices(tok, PROMPT, "Carol's secret number is 5902")

    def layer0_share(strength, key="emphasize"):
        probs = observed_probs(
            model, tok, enc, **{key: "Carol's secret number is 5902"}, strength=strength
        )
        return probs[0][0, :, -1, span].sum(-1).double()  # last query, per head

    p = layer0_share(0.0)
    assert torch.all((p > 0.01) & (p < 0.99))
    for s in (1.0, 3.0):
        expected = p * math.exp(s) / (p * math.exp(s) + 1 - p)
        torch.testing.assert_close(layer0_share(s), expected, atol=1e-5, rtol=0)
        expected = p * math.exp(-s) / (p * math.exp(-s) + 1 - p)
        torch.testing.assert_close(layer0_share(s, "suppress"), expected, atol=1e-5, rtol=0)
    target = 0.5
    s = kvedit.strength_for_share(float(p[0]), target)
    assert float(layer0_share(s)[0]) == pytest.approx(target, abs=1e-5)


def test_strength_zero_changes_nothing(llama):
    model, tok = llama
    enc = encode(tok, PROMPT)
    plain = greedy(model, enc)[1]
    with kvedit.steer(model, tok, emphasize="5902", strength=0.0):
        torch.testing.assert_close(greedy(model, enc)[1], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.real
def test_emphasis_raises_the_likelihood_of_the_emphasized_fact(smollm2):
    model, tok = smollm2
    prompt = RECORDS + "Somebody's secret number is"
    fact, answer = "Frank's secret number is 6611", " 6611."
    ids = encode(tok, prompt + answer)
    n = encode(tok, prompt)["input_ids"].shape[1]

    def answer_logprob(**steer_kwargs):
        with torch.no_grad():
            if steer_kwargs:
                with kvedit.steer(model, tok, **steer_kwargs):
                    logits = model(**ids).logits
            else:
                logits = model(**ids).logits
        logp = logits[0, n - 1 : -1].log_softmax(-1)
        return float(logp.gather(1, ids["input_ids"][0, n:, None]).sum())

    plain = answer_logprob()
    weak = answer_logprob(emphasize=fact, strength=1.0)
    strong = answer_logprob(emphasize=fact, strength=2.0)
    assert plain < weak < strong
    assert strong - plain > 1.0
    assert answer_logprob(suppress=fact, strength=2.0) < plain


# ------------------------------------------------------------------------------------ scope


def test_decode_scope_leaves_the_prompt_pass_unchanged_but_its_last_query(tiny):
    arch, model, tok = tiny
    enc = encode(tok, PROMPT)
    plain_seq, plain_logits = greedy(model, enc)
    with torch.no_grad():
        plain_prefill = model(**enc).logits
    with kvedit.steer(model, tok, emphasize="5902", strength=3.0, scope="decode"):
        with torch.no_grad():
            prefill = model(**enc).logits
        seq, logits = greedy(model, enc)
    # the prompt's own pass is untouched, but its last query predicts the first new token
    torch.testing.assert_close(prefill[:, :-1], plain_prefill[:, :-1], atol=0, rtol=0)
    assert (prefill[:, -1] - plain_prefill[:, -1]).abs().amax() > 1e-3
    torch.testing.assert_close(logits[:, 0], prefill[:, -1], atol=1e-5, rtol=1e-5)
    assert (logits[:, 1:] - plain_logits[:, 1:]).abs().amax() > 1e-3
    with kvedit.steer(model, tok, emphasize="5902", strength=3.0, scope="all"), torch.no_grad():
        prefill_all = model(**enc).logits
    assert (prefill_all[0, -1] - plain_prefill[0, -1]).abs().amax() > 1e-3
    # tokens before the span see no biased key even in scope="all"
    first = span_token_indices(tok, PROMPT, "5902")[0]
    torch.testing.assert_close(prefill_all[0, :first], plain_prefill[0, :first], atol=1e-5, rtol=0)


def test_decode_scope_equals_emphasizing_the_captured_prompt(tiny):
    """``steer(scope="decode")`` is ``ops.emphasize`` on the prompt's cache, token for token.

    The span sits at the end of a prompt longer than Gemma-3's sliding window, so the sliding
    layers (which keep only the last window of the cache) must bias the right entries too.
    """
    arch, model, tok = tiny
    prompt = RECORDS * 2
    span = "Frank's secret number is 6611"
    assert len(tok(prompt)["input_ids"]) > 4 * TINY_SLIDING_WINDOW
    for strength in (3.0, -3.0):
        state = kvedit.ops.emphasize(kvedit.capture(model, tok, prompt), span, strength)
        expected = state.generate("", max_new_tokens=16)
        steered = kvedit.steer(model, tok, emphasize=span, strength=strength, scope="decode")
        assert steered.generate(prompt, max_new_tokens=16) == expected, (arch, strength)


@pytest.mark.parametrize("scope", ["all", "decode"])
def test_cached_decoding_equals_recomputing_without_cache(tiny, scope):
    """``use_cache=False`` re-runs the whole sequence each step; steering must not change.

    The span is early in a prompt longer than Gemma-3's window: on the sliding layers the cache
    no longer holds it, so a decode step must not bias whatever entries it holds instead.
    """
    arch, model, tok = tiny
    enc = encode(tok, RECORDS * 2)
    kwargs = dict(emphasize="Alice's secret number is 4821", strength=3.0, scope=scope)
    plain_seq, plain_logits = greedy(model, enc, n=6)
    runs = []
    for use_cache in (True, False):
        with kvedit.steer(model, tok, **kwargs):
            runs.append(greedy(model, enc, n=6, use_cache=use_cache))
    (cached_seq, cached), (recomputed_seq, recomputed) = runs
    assert (cached[:, 1:] - plain_logits[:, 1:]).abs().amax() > 1e-3  # steering does something
    torch.testing.assert_close(recomputed, cached, atol=1e-4, rtol=1e-4)
    assert torch.equal(recomputed_seq, cached_seq)


# ------------------------------------------------------------------------ layers and heads


def test_layers_restrict_the_effect(llama):
    model, tok = llama
    enc = encode(tok, PROMPT)
    plain = hidden_states(model, enc)
    with kvedit.steer(model, tok, emphasize="5902", strength=3.0, layers=[1]):
        steered = hidden_states(model, enc)
    assert len(plain) == 4  # embeddings + 3 layers
    for i in (0, 1):  # embeddings and the output of layer 0: below the first steered layer
        torch.testing.assert_close(steered[i], plain[i], atol=0, rtol=0)
    assert (steered[2] - plain[2]).abs().amax() > 1e-3
    with kvedit.steer(model, tok, emphasize="5902", strength=3.0, layers=[2]):
        last_only = hidden_states(model, enc)
    for i in (0, 1, 2):
        torch.testing.assert_close(last_only[i], plain[i], atol=0, rtol=0)
    assert (last_only[3] - plain[3]).abs().amax() > 1e-3


def test_heads_restrict_the_effect_to_chosen_query_heads(llama):
    model, tok = llama
    enc = encode(tok, PROMPT)
    plain = observed_probs(model, tok, enc, emphasize="5902", strength=0.0)
    steered = observed_probs(model, tok, enc, emphasize="5902", strength=3.0, heads={1: [1]})
    torch.testing.assert_close(steered[0], plain[0], atol=0, rtol=0)
    # head 0 shares its KV head with head 1 (GQA 4:2) and must still be untouched
    for h in (0, 2, 3):
        torch.testing.assert_close(steered[1][:, h], plain[1][:, h], atol=1e-6, rtol=0)
    tokens = span_token_indices(tok, PROMPT, "5902")
    assert (steered[1][0, 1, -1, tokens].sum() > plain[1][0, 1, -1, tokens].sum() + 1e-3).item()
    with kvedit.steer(model, tok, emphasize="5902", strength=3.0, heads={1: [1]}):
        h = hidden_states(model, enc)
    plain_h = hidden_states(model, enc)
    torch.testing.assert_close(h[1], plain_h[1], atol=0, rtol=0)
    assert (h[2] - plain_h[2]).abs().amax() > 1e-4


# ---------------------------------------------------------------------------- special tokens


def test_protect_special_keeps_the_first_token_unbiased(llama):
    model, tok = llama
    text = "Alice's secret number is 4821. Question: Answer:"
    enc = encode(tok, text, add_special_tokens=False)  # token 0 is an ordinary token
    first = span_token_indices(tok, text, "Alice's", add_special_tokens=False)
    assert first[0] == 0 and len(first) > 1
    for protect, bias0 in ((True, 0.0), (False, 2.0)):
        steering = kvedit.steer(model, tok, emphasize="Alice's", protect_special=protect)
        with steering as s, torch.no_grad():
            model(**enc)
        assert float(s.plan.token_bias[0, 0]) == bias0
        assert torch.all(s.plan.token_bias[0, first[1:]] == 2.0)


def test_protect_special_keeps_chat_markers_unbiased(llama, monkeypatch):
    model, tok = llama
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": RECORDS}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(prompt)["input_ids"]
    special = [i for i, t in enumerate(ids) if t in tok.all_special_ids]
    assert len(special) >= 4  # BOS, <|im_start|> twice, <|im_end|>
    everything = re.compile(r"[\s\S]+")
    _, (plan,) = bound_plans(monkeypatch, kvedit.steer(model, tok, emphasize=everything), prompt)
    bias = plan.token_bias[0]
    assert torch.all(bias[special] == 0)
    assert torch.all(bias[[i for i in range(len(ids)) if i not in special]] == 2.0)
    _, (plan,) = bound_plans(
        monkeypatch, kvedit.steer(model, tok, emphasize=everything, protect_special=False), prompt
    )
    marked = [i for i in special if i > 0 and float(plan.token_bias[0, i]) == 2.0]
    assert marked  # chat markers typed in the prompt are biased when not protected


# -------------------------------------------------------------------- restoring and errors


class Explode(LogitsProcessor):
    def __call__(self, input_ids, scores):
        raise RuntimeError("mid-generation failure")


def test_attention_implementation_restored_when_the_body_raises(llama):
    model, tok = llama
    with pytest.raises(RuntimeError, match="boom"), kvedit.steer(model, tok, emphasize="Carol"):
        assert model.config._attn_implementation == "kvedit"
        raise RuntimeError("boom")
    assert_restored(model)
    s = kvedit.steer(model, tok, emphasize="Carol")
    with pytest.raises(RuntimeError, match="mid-generation"):
        s.generate(PROMPT, max_new_tokens=4, logits_processor=LogitsProcessorList([Explode()]))
    assert_restored(model)


def test_missing_span_raises_span_not_found_with_the_text(llama):
    model, tok = llama
    s = kvedit.steer(model, tok, emphasize="Zed's number")
    with pytest.raises(SpanNotFoundError, match="Zed's number") as err:
        s.generate(PROMPT, max_new_tokens=2)
    assert "Carol's secret number" in str(err.value)  # shows the text it searched
    assert_restored(model)
    with pytest.raises(SpanNotFoundError, match="Carol's secret number"), s:
        model.generate(**encode(tok, PROMPT), max_new_tokens=2, do_sample=False)
    assert_restored(model)
    with pytest.raises(SpanNotFoundError):
        kvedit.steer(model, tok, emphasize=(0, len(PROMPT) + 1)).generate(PROMPT)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(emphasize=""), "empty"),
        (dict(emphasize=["Carol", ""]), "empty"),
        (dict(suppress=re.compile("")), "empty"),
        (dict(emphasize=(5, 5)), "range"),
        (dict(emphasize="Carol", strength=float("nan")), "strength"),
        (dict(emphasize="Carol", strength=float("inf")), "strength"),
        (dict(emphasize="Carol", strength=-float("inf")), "strength"),
        (dict(emphasize="Carol", scope="prefill"), "scope"),
        (dict(emphasize="Carol", layers=[3]), "range"),
        (dict(emphasize="Carol", layers=[-1]), "range"),
        (dict(emphasize="Carol", heads={0: [4]}), "range"),
        (dict(emphasize="Carol", heads={3: [0]}), "range"),
        (dict(), "nothing to steer"),
        (dict(emphasize=[], suppress=[]), "nothing to steer"),
    ],
    ids=lambda x: repr(x) if isinstance(x, dict) else "",
)
def test_bad_arguments_raise_value_error(llama, kwargs, match):
    model, tok = llama
    with pytest.raises(ValueError, match=match):
        kvedit.steer(model, tok, **kwargs)
    assert_restored(model)


def test_overlapping_emphasize_and_suppress_raise(llama):
    model, tok = llama
    s = kvedit.steer(model, tok, emphasize="Carol's secret", suppress="secret number is 5902")
    with pytest.raises(ValueError, match="overlap"):
        s.generate(PROMPT)
    assert_restored(model)
    # disjoint spans are fine
    kvedit.steer(model, tok, emphasize="Carol", suppress="Frank").generate(PROMPT, max_new_tokens=2)


def test_nested_steering_of_one_model_raises(llama):
    model, tok = llama
    enc = encode(tok, PROMPT)
    with kvedit.steer(model, tok, emphasize="5902", strength=3.0) as outer:
        with (
            pytest.raises(KVEditError, match="nested"),
            kvedit.steer(model, tok, emphasize="Frank"),
        ):
            pass
        with pytest.raises(KVEditError, match="nested"):
            kvedit.steer(model, tok, emphasize="Frank").generate(PROMPT)
        assert active_plan(model) is outer.plan  # the outer steering is still in force
        seq, _ = greedy(model, enc)
    assert_restored(model)
    with kvedit.steer(model, tok, emphasize="5902", strength=3.0):
        again, _ = greedy(model, enc)
    assert torch.equal(seq, again)


def run_in_lockstep(model, fn, jobs):
    """``fn(job)`` for both ``jobs`` in two threads whose forward passes interleave layer by layer
    (each decoder layer waits until the other thread reaches it too)."""
    lockstep = threading.Barrier(2, timeout=30)

    def wait_for_the_other_thread(module, args):
        lockstep.wait()

    handles = [
        layer.register_forward_pre_hook(wait_for_the_other_thread) for layer in model.model.layers
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return list(pool.map(fn, jobs))
    finally:
        for handle in handles:
            handle.remove()


def assert_same_runs(results, expected):
    for (seq, logits), (ref_seq, ref_logits) in zip(results, expected, strict=True):
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(logits, ref_logits, atol=0, rtol=0)


def test_concurrent_threads_get_their_serial_results(llama):
    """Two threads steer one model with different spans at the same time; each gets exactly
    what it gets alone."""
    model, tok = llama
    enc = encode(tok, PROMPT)
    jobs = [dict(emphasize="5902", strength=3.0), dict(suppress="Carol", strength=2.0)]

    def run(kwargs):
        with kvedit.steer(model, tok, **kwargs):
            return greedy(model, enc, n=10)

    serial = [run(kwargs) for kwargs in jobs]
    assert not torch.equal(serial[0][1], serial[1][1])
    for _ in range(3):
        assert_same_runs(run_in_lockstep(model, run, jobs), serial)
    assert_restored(model)


def test_one_handle_entered_by_two_threads_at_once():
    """``Steering`` is documented as re-entrant across threads: one handle, used as a context
    manager by two threads at the same time, binds each thread's own prompt."""
    model, tok = tiny_model("llama")  # its own model: a failure here must not leak into others
    prompts = [PROMPT, RECORDS + "Question: Whose number is 5902? Answer:"]
    handle = kvedit.steer(model, tok, emphasize="5902", strength=3.0)

    def run(prompt):
        with handle:
            return greedy(model, encode(tok, prompt), n=8)

    serial = [run(p) for p in prompts]
    for _ in range(3):
        assert_same_runs(run_in_lockstep(model, run, prompts), serial)
    assert_restored(model)


# ------------------------------------------------------------------------- strength helpers


@pytest.mark.parametrize("current,target", [(0.1, 0.5), (0.5, 0.1), (0.3, 0.3), (0.01, 0.99)])
def test_strength_for_share_reaches_the_target(current, target):
    s = kvedit.strength_for_share(current, target)
    reached = current * math.exp(s) / (current * math.exp(s) + 1 - current)
    assert reached == pytest.approx(target, rel=1e-12)
    assert (s > 0) == (target > current)


@pytest.mark.parametrize("current,target", [(0, 0.5), (1, 0.5), (0.5, 0), (0.5, 1), (-0.1, 2)])
def test_strength_for_share_rejects_shares_outside_0_1(current, target):
    with pytest.raises(ValueError):
        kvedit.strength_for_share(current, target)


def test_strength_from_pasta_alpha():
    from kvedit.steering.session import strength_from_pasta_alpha

    assert strength_from_pasta_alpha(0.01) == pytest.approx(4.60517, abs=1e-5)
    assert strength_from_pasta_alpha(1.0) == 0.0
    # PASTA scales the other tokens' weights by alpha and renormalises: same distribution
    logits = torch.tensor([0.3, -1.2, 2.0, 0.5], dtype=torch.float64)
    emphasized = torch.tensor([False, True, False, True])
    alpha = 0.2
    w = logits.softmax(-1) * torch.where(emphasized, 1.0, alpha)
    pasta = w / w.sum()
    ours = (logits + emphasized * strength_from_pasta_alpha(alpha)).softmax(-1)
    torch.testing.assert_close(ours, pasta)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError):
            strength_from_pasta_alpha(bad)


def test_strength_helpers_are_reachable_from_the_package():
    assert kvedit.strength_for_share is steer_module.strength_for_share
    assert kvedit.strength_from_pasta_alpha is steer_module.strength_from_pasta_alpha


def test_empty_layer_or_head_selection_is_an_error(llama):
    model, tok = llama
    with pytest.raises(ValueError, match="layers is empty"):
        kvedit.steer(model, tok, emphasize="5902", layers=[])
    with pytest.raises(ValueError, match="heads is empty"):
        kvedit.steer(model, tok, emphasize="5902", heads={})
    with pytest.raises(ValueError, match="finite"):
        kvedit.steer(model, tok, emphasize="5902", strength=True)
