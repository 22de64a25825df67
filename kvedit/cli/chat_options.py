"""What ``kvedit --help`` and ``kvedit chat --help`` say of ``kvedit chat``, apart from the
modules that run it (:mod:`kvedit.cli.chat_loop` imports torch): the parser is
:func:`kvedit.cli.chat.chat_parser`'s, built only when a command line names ``chat``."""

from __future__ import annotations

CHAT_SUMMARY = "a terminal chat whose conversation is one exact cache, saved in a memory file"
"""``kvedit chat``'s line in ``kvedit --help`` (the same as :func:`~kvedit.cli.chat.chat_parser`
gives: a test compares the two)."""

CHAT_HELP = """\
Each line read is a question: the answer is printed as it is decoded ([cut at N tokens] after
it when it took --max-new-tokens), then (dimmed on a terminal) what the turn cost and what the memory holds:
tokens computed for the question, the answer's tokens kept from decoding, the transcript's
tokens, the entries each global layer holds (an entry: one token's K/V in one layer; least /
median / most over the layers: fewer than the transcript's tokens once it forgot) and its
bytes (of a --max-bytes budget, as a percentage). An empty line is skipped. Lines starting with / are commands:
  /explain  each message: tokens, computed / kept / loaded, bytes (kvedit.Memory.explain),
            then how much of it each global layer still holds
  /save     write the memory file now; /save PATH writes a copy to PATH (the chat goes on
            with its own file); a save that fails is one error line, the chat going on
  /undo     take back the last question and its answer (again: the one before, up to the
            last 4 of this chat: kvedit.Memory.undo)
  /retry    /undo, then ask that question again (with --temperature, another answer)
  /clear    back to the memory this chat started with (a new memory: its system message)
  /quit     save and end (as Ctrl-D does)
  /help     a short list of the commands
A question that starts with / is written with two (//...). Ctrl-D or /quit ends the chat with
the memory saved (exit status 0; without --memory the conversation is held in RAM only and
nothing is written: /save PATH writes a copy); Ctrl-C, at the prompt or during an answer, ends it the same
way (exit status 130), and an interrupted answer is not kept: the memory is as it was before
that question. A line the model cannot take (too long for its positions) gets one error line
and the chat goes on. Lines may be piped in (one question a line).

One chat per memory file: while a chat runs it holds FILE.lock beside the file, and a second
chat on the same file is refused (exit status 2) with the process that holds it; a lock file
left by a chat that was killed does not block. A --memory that is a symbolic link is the file
it leads to: that file is read, locked and replaced, and the link stays a link.

With --max-tokens or --max-bytes the memory forgets, without knowing the next question, when it
would hold more (kvedit.Memory's budget: the first tokens, the system message, the last
--recent-tokens tokens and the --protect texts are never forgotten); a turn that forgot says so
after its cost. --quantize holds the messages before the last --exact-messages in fewer bits,
with or without a budget. With --focus under a budget each global layer keeps one choice of
tokens for all its KV heads (what focus reads). The file keeps both: a later run goes on under
them, and an option given again replaces the file's (--forget, --recent-tokens, --protect and
--layer-floor with --max-tokens or --max-bytes). A budget the memory can never hold (under its sliding
windows, its protected part and one token more) is refused at start.
"""
"""The epilog of ``kvedit chat --help`` (:mod:`kvedit.cli.chat_loop`'s commands)."""
