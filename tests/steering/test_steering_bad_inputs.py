"""Bad inputs of a steering session's ``generate``: one prompt, room left to answer."""

from __future__ import annotations

import pytest

from kvedit.errors import InvalidInputError, InvalidTypeError


@pytest.mark.parametrize(
    "prompt,error",
    [
        (["a prompt", "a prompt"], InvalidTypeError),
        (None, InvalidTypeError),
        (b"bytes", InvalidTypeError),
        ("", InvalidInputError),
    ],
    ids=["list", "none", "bytes", "empty"],
)
def test_steering_generate_takes_one_prompt(llama, prompt, error):
    from kvedit.steering.session import steer

    model, tok = llama
    with pytest.raises(error, match="prompt"):
        steer(model, tok, emphasize="a").generate(prompt)


def test_steering_generate_refuses_a_prompt_without_room_to_answer(short_llama):
    from kvedit.steering.session import steer

    model, tok = short_llama
    with pytest.raises(InvalidInputError, match="kept for what follows"):
        steer(model, tok, emphasize="Alice").generate("Alice's number?", max_new_tokens=15)
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        steer(model, tok, emphasize="Alice").generate("Alice?", max_new_tokens=0)
