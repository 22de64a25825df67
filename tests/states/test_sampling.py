"""One sampling validator for every decoding path: a bad ``do_sample``, ``temperature``,
``top_k``, ``top_p`` or ``generator`` is refused before any work (not a torch error mid-decode,
nor greedy decoding in silence), whether given to ``KVState.generate``/``answer``, a primed
state, ``Memory.ask`` or ``Steering.generate``."""

from __future__ import annotations

import pytest
import torch
from conftest import RECORDS

import kvedit
from kvedit.errors import InvalidInputError, InvalidTypeError
from kvedit.states.decoding import Sampling

BAD = {
    "do_sample-str": (dict(do_sample="False"), InvalidTypeError),
    "do_sample-int": (dict(do_sample=1), InvalidTypeError),
    "temperature-negative": (dict(do_sample=True, temperature=-1), InvalidInputError),
    "temperature-zero": (dict(do_sample=True, temperature=0), InvalidInputError),
    "temperature-nan": (dict(temperature=float("nan")), InvalidInputError),
    "temperature-str": (dict(temperature="hot"), InvalidTypeError),
    "top_k-zero": (dict(do_sample=True, top_k=0), InvalidInputError),
    "top_k-negative": (dict(do_sample=True, top_k=-1), InvalidInputError),
    "top_k-float": (dict(do_sample=True, top_k=2.0), InvalidTypeError),
    "top_p-negative": (dict(do_sample=True, top_p=-0.5), InvalidInputError),
    "top_p-above-one": (dict(do_sample=True, top_p=1.5), InvalidInputError),
    "generator-str": (dict(do_sample=True, generator="x"), InvalidTypeError),
}


def test_good_sampling_arguments_are_held_canonical():
    s = Sampling(True, 1, 5, 1, torch.Generator())
    assert (s.temperature, s.top_k, s.top_p) == (1.0, 5, 1.0)
    assert isinstance(s.temperature, float)
    assert Sampling(temperature=0).do_sample is False  # greedy: no temperature is read


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_sampling_argument_is_refused_by_generate_and_answer(llama, case):
    model, tok = llama
    kw, error = BAD[case]
    state = kvedit.capture(model, tok, RECORDS)
    with pytest.raises(error):
        state.generate(" Q:", max_new_tokens=3, **kw)
    with pytest.raises(error):
        state.answer("", max_new_tokens=3, **kw)


@pytest.mark.parametrize("case", sorted(c for c in BAD if "generator" not in c))
def test_a_bad_sampling_argument_is_refused_by_steering(llama, case):
    """(model.generate takes no generator.)"""
    model, tok = llama
    kw, error = BAD[case]
    with pytest.raises(error):
        kvedit.steer(model, tok, emphasize="Bob").generate(RECORDS, max_new_tokens=2, **kw)


def test_a_generator_of_another_device_than_the_logits_is_refused():
    """A CPU generator for a model on CUDA (torch would fail at the first sampled token)."""
    cpu = Sampling(True, generator=torch.Generator())
    cpu.check_device("cpu")
    with pytest.raises(InvalidInputError, match="generator is on cpu, the model's logits on cuda"):
        cpu.check_device("cuda")
    Sampling(False, generator=torch.Generator()).check_device("cuda")  # greedy: never drawn


def test_a_primed_state_checks_them_before_its_fast_path(llama):
    """A primed state answers its primed continuation greedily without a pass; a falsy but not
    boolean ``do_sample`` (0) or a bad temperature must not slip through that path."""
    from kvedit.focusing.primed import Continued, PrimedState

    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    ids = state.encode(" Q:")
    logits, kv = state.run(ids, logits_to_keep=1)
    primed = PrimedState.of(state, Continued.from_run(state, " Q:", ids, logits, kv))
    assert primed.answer(" Q:", 3).text == state.answer(" Q:", 3).text
    with pytest.raises(InvalidTypeError):
        primed.answer(" Q:", 3, do_sample=0)
    with pytest.raises(InvalidInputError):
        primed.answer(" Q:", 3, temperature=-1.0)
