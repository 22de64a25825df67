"""What the top-level ``kvedit --help`` says of ``kvedit chat`` without importing
:mod:`kvedit.cli.chat` (whose imports reach torch): the parser itself is
:func:`kvedit.cli.chat.chat_parser`'s, built only when a command line names ``chat``."""

from __future__ import annotations

CHAT_SUMMARY = "a terminal chat whose conversation is one exact cache, saved in a memory file"
"""``kvedit chat``'s line in ``kvedit --help`` (the same as :func:`~kvedit.cli.chat.chat_parser`
gives: a test compares the two)."""
