"""Bad inputs of focus's entry points and helpers, named."""

from __future__ import annotations

import pytest
import torch

from kvedit.errors import InvalidInputError, InvalidTypeError
from kvedit.focusing.choice import best_covered, stands_out
from kvedit.states.capturing import capture


def test_focus_refuses_an_edit_that_is_not_a_function(llama):
    import kvedit

    model, tok = llama
    state = capture(model, tok, "Alice's secret number is 4821.\n\nBob's is 7310.")
    with pytest.raises(InvalidTypeError, match="edit must be a function"):
        kvedit.focus(state, " Whose is 7310?", edit="reread")


@pytest.mark.parametrize(
    "call",
    [
        lambda: best_covered(
            "Who is Cy?", ["Cy is 1.", "Bo is 2."], torch.ones(3, dtype=torch.bool)
        ),
        lambda: stands_out(torch.zeros(4), None, 2.5, torch.ones(2, dtype=torch.bool)),
        lambda: stands_out(torch.zeros(4), [True, False, True, True]),
    ],
    ids=["best_covered-candidates", "stands_out-eligible", "stands_out-candidates-list"],
)
def test_focus_masks_of_the_wrong_shape_are_named(call):
    with pytest.raises(InvalidInputError, match=r"(candidates|eligible) must be a mask of the"):
        call()
