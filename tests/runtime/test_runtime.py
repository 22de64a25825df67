"""The runtime seam: installed once, bit-for-bit stock without a plan, plans scoped to a context.

Every model here is compared with a twin built from the same seed that kvedit never touched.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import RECORDS

import kvedit
from kvedit import runtime
from kvedit.errors import NestedSteeringError, UnsupportedModelError
from kvedit.testing import TINY_SLIDING_WINDOW, tiny_model

FP32_TOL = 2e-5


class ConstantBias:
    """A BiasPlan adding ``value`` nats to key entry ``entry`` of every layer.

    With ``value=0`` it changes nothing, but every layer then runs kvedit's own attention
    instead of delegating to the original implementation.
    """

    def __init__(self, entry: int = 0, value: float = 0.0):
        self.entry, self.value = entry, value

    def key_bias(self, layer_idx, k_len, total_len):
        bias = torch.zeros(1, 1, k_len)
        bias[..., self.entry] = self.value
        return bias

    def unbiased_queries(self, q_len, total_len):
        return 0


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def twins(request):
    """``(arch, prepared model, untouched twin, tokenizer)``."""
    model, tok = tiny_model(request.param)
    stock, _ = tiny_model(request.param)
    kvedit.prepare(model)
    return request.param, model, stock, tok


def logits(model, ids, mask=None, plan=None):
    with torch.no_grad():
        if plan is None:
            return model(input_ids=ids, attention_mask=mask).logits
        with runtime.activate(model, plan):
            return model(input_ids=ids, attention_mask=mask).logits


def left_padded_batch(tok, texts):
    rows = [tok(t)["input_ids"] for t in texts]
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), tok.pad_token_id)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, n - len(r) :] = torch.tensor(r)
        mask[i, n - len(r) :] = 1
    return ids, mask


def test_unsteered_forward_is_bit_for_bit_stock(twins):
    arch, model, stock, tok = twins
    assert model.config._attn_implementation == "kvedit"
    ids = torch.tensor([tok(RECORDS * 2)["input_ids"]])
    if arch == "gemma3":
        assert ids.shape[1] > 3 * TINY_SLIDING_WINDOW  # the window must bite
    assert torch.equal(logits(model, ids), logits(stock, ids))
    padded, mask = left_padded_batch(tok, [RECORDS * 2, "Bob's secret number is 7310."])
    assert torch.equal(logits(model, padded, mask), logits(stock, padded, mask))


def test_zero_bias_plan_matches_stock_on_plain_and_padded_batches(twins):
    arch, model, stock, tok = twins
    ids = torch.tensor([tok(RECORDS * 2)["input_ids"]])
    ours = logits(model, ids, plan=ConstantBias(value=0.0))
    torch.testing.assert_close(ours, logits(stock, ids), atol=FP32_TOL, rtol=FP32_TOL)
    padded, mask = left_padded_batch(tok, [RECORDS * 2, "Bob's secret number is 7310.", RECORDS])
    real = mask.bool()
    ours = logits(model, padded, mask, plan=ConstantBias(value=0.0))
    theirs = logits(stock, padded, mask)
    torch.testing.assert_close(ours[real], theirs[real], atol=FP32_TOL, rtol=FP32_TOL)


def greedy(model, ids, mask, n=12):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
    return out[:, ids.shape[1] :]


def test_generate_is_identical_unsteered_and_with_a_zero_plan(twins):
    arch, model, stock, tok = twins
    ids, mask = left_padded_batch(tok, [RECORDS * 2, "Carol's secret number is"])
    expected = greedy(stock, ids, mask)
    assert torch.equal(greedy(model, ids, mask), expected)
    with runtime.activate(model, ConstantBias(value=0.0)):
        assert torch.equal(greedy(model, ids, mask), expected)


def test_a_plan_changes_the_forward_only_inside_activate():
    model, tok = tiny_model("llama")
    stock, _ = tiny_model("llama")
    ids = torch.tensor([tok(RECORDS)["input_ids"]])
    plain = logits(stock, ids)
    with runtime.activate(model, ConstantBias(entry=3, value=4.0)) as plan:
        assert runtime.active_plan(model) is plan
        with torch.no_grad():
            biased = model(ids).logits
    assert runtime.active_plan(model) is None
    torch.testing.assert_close(biased[0, :3], plain[0, :3], atol=FP32_TOL, rtol=0)  # causal
    assert (biased[0, 3:] - plain[0, 3:]).abs().amax() > 1e-2
    assert torch.equal(logits(model, ids), plain)  # and stock again afterwards


def test_prepare_is_idempotent_and_unprepare_restores_the_original():
    model, tok = tiny_model("qwen2")
    model.set_attn_implementation("eager")
    stock, _ = tiny_model("qwen2")
    stock.set_attn_implementation("eager")
    spec = kvedit.prepare(model)
    assert kvedit.prepare(model) is spec and spec.original_attention == "eager"
    assert spec.windows == [None, None] and not spec.sinks
    assert model.config._attn_implementation == "kvedit"
    ids = torch.tensor([tok(RECORDS)["input_ids"]])
    assert torch.equal(logits(model, ids), logits(stock, ids))  # delegates to eager
    kvedit.unprepare(model)
    assert model.config._attn_implementation == "eager" and not runtime.is_prepared(model)
    kvedit.unprepare(model)  # idempotent
    assert torch.equal(logits(model, ids), logits(stock, ids))


def test_the_gate_reads_windows_from_the_cache_transformers_builds():
    model, _ = tiny_model("gemma3")
    assert kvedit.prepare(model).windows == [TINY_SLIDING_WINDOW] * 2 + [None] + [
        TINY_SLIDING_WINDOW
    ]


def test_a_forward_in_another_thread_is_not_steered_unless_carried():
    model, tok = tiny_model("llama")
    stock, _ = tiny_model("llama")
    ids = torch.tensor([tok(RECORDS)["input_ids"]])
    plain = logits(stock, ids)
    with kvedit.steer(model, tok, emphasize="Carol", strength=4.0) as s:
        results = {}

        def run(name):
            results[name] = logits(model, ids)

        t = threading.Thread(target=run, args=("plain",))
        t.start()
        t.join()
        carried = s.thread(run, "carried")
        carried.start()
        carried.join()
        steered = logits(model, ids)
    assert torch.equal(results["plain"], plain)
    torch.testing.assert_close(results["carried"], steered, atol=0, rtol=0)
    assert (steered - plain).abs().amax() > 1e-2


def test_a_handle_may_reenter_itself_but_not_another():
    model, tok = tiny_model("llama")
    s = kvedit.steer(model, tok, emphasize="Carol", strength=3.0)
    prompt = RECORDS + " What is Carol's secret number?"
    alone = s.generate(prompt, max_new_tokens=6)
    with s:
        assert s.generate(prompt, max_new_tokens=6) == alone
        other = kvedit.steer(model, tok, emphasize="Bob", strength=3.0)
        with pytest.raises(NestedSteeringError), other:
            pass
    assert runtime.active_plan(model) is None


def test_the_mask_passes_only_padding_through_under_a_plan():
    model, _ = tiny_model("llama")
    kvedit.prepare(model)
    cfg = model.config
    full = torch.ones(2, 20, dtype=torch.bool)
    padded = full.clone()
    padded[0, 0] = False
    with runtime.activate(model, ConstantBias()):
        assert runtime.kvedit_mask(attention_mask=full, config=cfg) is None
        assert runtime.kvedit_mask(attention_mask=padded, config=cfg) is padded


def test_unknown_attention_arguments_are_refused_under_a_plan():
    model, _ = tiny_model("llama")
    kvedit.prepare(model)
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 16)
    kv = torch.zeros(1, 2, 3, 16)
    with runtime.activate(model, ConstantBias()):
        with pytest.raises(UnsupportedModelError, match="alibi"):
            runtime.kvedit_attention_forward(attn, q, kv, kv, None, alibi=torch.zeros(1))
        out, _ = runtime.kvedit_attention_forward(attn, q, kv, kv, None, position_ids=None)
    assert out.shape == (1, 3, 4, 16)


def test_an_unprepared_model_calling_the_seam_gets_a_clear_error():
    model, tok = tiny_model("llama")
    runtime.register()
    model.set_attn_implementation("kvedit")
    ids = torch.tensor([tok(RECORDS)["input_ids"]])
    with pytest.raises(UnsupportedModelError, match="prepare"), torch.no_grad():
        model(ids)


def test_a_streamer_thread_started_with_steering_thread_is_steered():
    from transformers import TextIteratorStreamer

    model, tok = tiny_model("llama")
    prompt = RECORDS + " What is Carol's secret number?"
    s = kvedit.steer(model, tok, emphasize="Carol", strength=4.0)
    expected = s.generate(prompt, max_new_tokens=8)
    ids = tok(prompt, return_tensors="pt")
    kwargs = dict(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)

    def streamed(start_thread) -> str:
        streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        t = start_thread(model.generate, kwargs={**kwargs, "streamer": streamer})
        t.start()
        text = "".join(streamer)
        t.join()
        return text

    with s:
        carried = streamed(lambda fn, kwargs: s.thread(fn, **kwargs))
        plain = streamed(lambda fn, kwargs: threading.Thread(target=fn, kwargs=kwargs))
    assert carried == expected
    assert plain != expected  # a plain thread is not steered (this prompt's answer differs)


def test_the_public_seams_are_reachable_and_compare_by_identity(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import kvedit; print(kvedit.testing.tiny_model.__name__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "tiny_model"  # no separate `import kvedit.testing` needed
    model, tok = tiny_model("llama")
    state = kvedit.capture(model, tok, RECORDS)
    assert state == state and state != state.copy()  # identity, never "ambiguous tensor"
    assert state.layers[0] == state.layers[0] and state.layers[0] != state.copy().layers[0]
    assert state.save(tmp_path / "s.kv") == tmp_path / "s.kv"  # save returns the path
