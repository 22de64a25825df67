"""``kvedit chat --focus`` focuses for lines that ask, not for statements (a statement pointed
focus at an unrelated old message)."""

from __future__ import annotations

import pytest

from kvedit.cli.chat_focus import asks


@pytest.mark.parametrize(
    "line",
    [
        "What is my locker code?",
        "what's my dog's name",
        "Remind me of the code",
        "Tell me where I parked.",
        "my code, again?",
        'Did I say "blue"?"',
        "  Which city  ",
    ],
)
def test_lines_that_ask(line):
    assert asks(line)


@pytest.mark.parametrize(
    "line",
    ["My dog's name is Biscuit.", "the river is calm", "Thanks!", "", "4821", "Whatever works."],
)
def test_statements_ask_nothing(line):
    assert not asks(line)
