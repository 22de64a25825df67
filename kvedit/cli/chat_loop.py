"""The read-ask-print loop of ``kvedit chat`` (:class:`ChatLoop`): a line read is a question
asked of the :class:`kvedit.Memory` (the answer printed, then what the turn cost) or a command
(:data:`COMMANDS`); the memory saved at the end, with Ctrl-C held off while it is written.

The command's options, and the memory file opened and locked before the loop runs:
:mod:`kvedit.cli.chat`, :mod:`kvedit.cli.chat_file`.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import sys
from pathlib import Path

from ..errors import KVEditError, TemplateError
from ..memory.forgetting import global_entries
from .chat_file import save_copy, target
from .chat_focus import asks
from .chat_held import answer_cut, held_now, held_summary
from .chat_held import size as _size
from .chat_options import CHAT_HELP
from .chat_sampling import with_generator
from .status import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, exit_status, message

__all__ = ["CHAT_HELP", "COMMANDS", "ChatLoop"]

_NAME = "kvedit chat"

SHORT_HELP = """\
/explain      what each message cost and how much of it is still held
/save [PATH]  write the memory file now (PATH: a copy there)
/undo         take back the last question and answer;  /retry  ask it again
/clear        back to how this chat started;  /quit  save and end (Ctrl-D)
A question that starts with / is written //...; kvedit chat --help says more.
"""
"""What ``/help`` prints."""

COMMANDS = ("/explain", "/save", "/undo", "/retry", "/clear", "/quit", "/help")
"""The commands a line may start with (:data:`CHAT_HELP` says what each does)."""


class ChatLoop:
    """The read-ask-print loop over one memory and its file."""

    def __init__(
        self,
        memory,
        path: Path | None,
        max_new_tokens: int,
        focus: bool = False,
        sampling: dict | None = None,
    ) -> None:
        self.memory = memory
        self.path = path  # None: held in RAM only
        self.max_new_tokens = max_new_tokens
        self.focus = focus
        self.sampling = with_generator(sampling or {}, getattr(memory.model, "device", "cpu"))
        self.existed = path is not None and path.exists()
        self.changes = 0  # questions kept, undone or cleared in this chat
        self.saved_at = 0 if self.existed else None  # self.changes when last saved
        self.asked: list[str] = []  # the questions kept in this chat, in order
        self.start = copy.copy(memory)  # what /clear goes back to (Memory replaces, never edits)
        self.line_no = 0
        self.abandoned = False
        self.tty_in = sys.stdin.isatty()
        self.tty_out = sys.stdout.isatty()
        if self.tty_in:
            with contextlib.suppress(ImportError):  # line editing and history at the prompt
                import readline  # noqa: F401

    def run(self) -> int:
        status = EXIT_OK
        self._start_line()
        try:
            status = self._loop()
        except KeyboardInterrupt:
            print(file=sys.stdout)
            status = EXIT_INTERRUPTED
        finally:
            self._save_at_exit()
        return status

    def _loop(self) -> int:
        while True:
            line = self._read()
            if line is None:
                if self.tty_in:
                    print(file=sys.stdout)
                return EXIT_OK
            text = line.strip()
            if not text:
                continue
            if text.startswith("/") and not text.startswith("//"):
                if self._command(text) == "/quit":
                    return EXIT_OK
                continue
            self._ask(line[1:] if text.startswith("//") else line)

    def _read(self) -> str | None:
        """The next line (without its newline), or None at end of input."""
        self.line_no += 1
        if self.tty_in:
            try:
                return input("> ")
            except EOFError:
                return None
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:
            line = sys.stdin.readline()
            return line.rstrip("\r\n") if line else None
        data = stream.readline()
        if not data:
            return None
        try:
            return data.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            self._error(
                f"stdin:{self.line_no}: not UTF-8 text (byte 0x{data[e.start]:02x}); "
                "the line is skipped"
            )
            return ""

    def _command(self, text: str) -> str:
        word = text.split()[0]
        if word == "/explain":
            print(self.memory.explain(), held_now(self.memory), sep="\n", flush=True)
        elif word == "/save":
            self._save(text[len(word) :].strip())
        elif word in ("/undo", "/retry", "/clear"):
            self._take_back(word)
        elif word == "/help":
            print(SHORT_HELP, end="", flush=True)
        elif word != "/quit":
            self._error(
                f"unknown command {word!r}: the commands are {', '.join(COMMANDS)} "
                "(a question that starts with / is written //...)"
            )
        return word

    def _take_back(self, word: str) -> None:
        """``/undo``, ``/retry`` (``/undo``, then the question again): :meth:`Memory.undo
        <kvedit.Memory.undo>`; ``/clear``: the memory this chat started with. Nothing is
        recomputed."""
        if not self.asked:
            self._error(f"{word}: no question asked in this chat to take back")
            return
        if word == "/clear":
            n, question = len(self.asked), self.asked[0]
            self.asked.clear()
            self.memory = copy.copy(self.start)
        elif not self.memory.undoable:
            self._error(
                f"{word}: the memory keeps only its last few changes to take back "
                "(kvedit.Memory.undo), and they were taken back already; /clear goes back to "
                "where this chat started"
            )
            return
        else:
            n, question = 1, self.asked.pop()
            self.memory.undo()
        self.changes += 1
        what = "the last question and its answer" if n == 1 else f"{n} questions and answers"
        self._dim(f"[{word[1:]}: {what} taken back; the memory holds {self._counts()}]")
        if word == "/retry":
            self._ask(question)

    def _asked(self, question: str) -> None:
        """``question`` was kept: /undo takes it back (:meth:`kvedit.Memory.undo`)."""
        self.asked.append(question)
        self.changes += 1

    def _ask(self, question: str) -> None:
        before = self._mark()
        rounds = len(self.memory.forgetting)
        printer = _Streamed()
        try:
            answer = self.memory.ask(
                question,
                max_new_tokens=self.max_new_tokens,
                focus=self.focus and asks(question),
                on_text=printer.write,
                **self.sampling,
            )
        except KeyboardInterrupt:
            printer.break_line()
            if self._interrupted(before):
                self._asked(question)
            raise
        except KVEditError as e:
            printer.break_line()
            if exit_status(e) != EXIT_USAGE and not isinstance(e, TemplateError):
                raise
            self._error(f"{message(e)}; the question was not kept")
            return
        self._asked(question)
        printer.end(answer)
        cut = answer_cut(self.memory)
        if cut is not None:
            self._dim(f"[cut at {cut:,} tokens: --max-new-tokens]")
        self._dim(self._cost(self.memory.forgetting[rounds:]))
        if self.focus and not asks(question):
            self._dim("[focus: off, the line asks nothing]")
        elif self.focus:
            said = self.memory.focus_said() or "no earlier message to emphasize"
            self._dim(f"[focus: {_printable(said)}]")

    def _interrupted(self, before: tuple[int, int]) -> bool:
        """After Ctrl-C during an answer: say whether the question was kept (it is not, unless
        the answer had been committed already: True), and refuse to save a memory caught
        midway."""
        now = self._mark()
        if now == before:
            self._dim("[interrupted: the question and its partial answer were not kept]")
            return False
        if now[0] == before[0] + 2 and self._consistent():
            self._dim("[interrupted after the answer was kept]")
            return True
        self.abandoned = True  # caught between two fields: not written
        raise KVEditError(
            f"interrupted while the memory was being updated ({before[0]} -> {now[0]} "
            f"messages, {before[1]} -> {now[1]} tokens); {self.path or 'nothing'} is left as "
            "it was"
        )

    def _consistent(self) -> bool:
        turns = self.memory.turns
        return len(turns) == len(self.memory) and (
            not turns or turns[-1].end == len(self.memory.state)
        )

    def _cost(self, rounds) -> str:
        """The last turn's cost; ``rounds``: the forgetting rounds it ran."""
        q, a = self.memory.turns[-2:]
        answer = f"answer {a.n_tokens:,} tok ({a.kept:,} kept from decoding"
        answer += f", {a.computed:,} computed)" if a.computed else ")"
        forgot = ""
        if rounds:
            dropped = sum(r.before - r.after for r in rounds)
            seconds = sum(r.seconds for r in rounds)
            forgot = f", forgot {dropped:,} entries ({rounds[-1].policy}, {seconds:.1f} s)"
        held = ""
        budget = self.memory.budget
        if budget is not None and budget.max_tokens is not None:
            # the budget counts what was held when the question came
            entries = global_entries(self.memory.state) - q.n_tokens - a.n_tokens
            held = (
                f" ({entries:,} of {budget.max_tokens:,} entries held, question and answer on top)"
            )
        return (
            f"[{q.start:,} tok reused, question {q.computed:,} tok computed, {answer}, "
            f"{held_summary(self.memory)}{held}{forgot}]"
        )

    def _mark(self) -> tuple[int, int]:
        return len(self.memory), len(self.memory.state)

    def _save(self, where: str = "") -> None:
        """``/save`` (the chat's own file) or ``/save PATH`` (a copy there); a save that fails
        is one error line, and the chat goes on with its messages."""
        copy = Path(where).expanduser() if where else None
        if copy is None and self.path is None:
            self._error("/save: this chat has no --memory file (held in RAM only); give /save PATH")
            return
        try:
            if (
                copy is not None
                and self.path is not None
                and target(copy, None) == target(self.path)
            ):
                copy = None  # another name of the chat's own file
            if copy is None:
                self.memory.save(self.path)
            else:
                save_copy(self.memory, copy)
        except (KVEditError, OSError) as e:
            self._error(
                f"/save {copy or self.path}: {message(e)}; nothing was saved, and the chat goes "
                "on with its messages"
            )
            return
        if copy is not None:
            goes_on = "in RAM only" if self.path is None else f"with {self.path}"
            self._dim(f"[saved a copy {copy}: {self._counts()}; the chat goes on {goes_on}]")
            return
        self.saved_at, self.existed = self.changes, True
        self._dim(f"[saved {self._summary()}]")

    def _save_at_exit(self) -> None:
        """Save unless nothing changed; SIGINT is held off while the file is written."""
        if self.abandoned:
            return
        if self.path is None:
            print(f"memory held in RAM only, not written: {self._counts()}", flush=True)
            return
        if self.saved_at == self.changes or (not self.existed and len(self.memory) == 0):
            what = "unchanged" if self.existed else "not written: no messages"
            print(f"memory {self.path} {what}: {self._counts()}", flush=True)
            return
        held = _hold_interrupts()
        try:
            self.memory.save(self.path)
        finally:
            _release_interrupts(held)
        self.saved_at = self.changes
        print(f"saved {self._summary()}", flush=True)

    def _summary(self) -> str:
        return f"{self.path}: {self._counts()}, {_size(self.memory.nbytes)}"

    def _counts(self) -> str:
        return f"{len(self.memory):,} messages, {len(self.memory.state):,} tok"

    def _start_line(self) -> None:
        if self.path is None:
            head = f"[new memory held in RAM only (no --memory), prompt {self.memory.prompt!r}"
        elif self.existed:
            head = f"[memory {self.path}: {self._counts()}, prompt {self.memory.prompt!r}"
        else:
            head = f"[new memory {self.path}, prompt {self.memory.prompt!r}"
        budget = self.memory.budget
        if budget is not None:
            most = (
                f"{_size(budget.max_bytes)}"
                if budget.max_bytes is not None
                else f"{budget.max_tokens:,} entries a global layer on average"
            )
            heads = ", each KV head its own" if budget.per_head else ""
            if budget.layer_floor:
                heads += f", {budget.layer_floor:g} of each round's room shared among the layers"
            head += (
                f", holds at most {most} (forgets by {budget.policy}{heads}, the last "
                f"{budget.recent_tokens} tokens kept)"
            )
        if self.memory.quantize is not None:
            head += (
                f", messages before the last {self.memory.exact_messages} held in "
                f"{self.memory.quantize} bits"
            )
        if self.memory.forgetting:
            head += f"; it forgot in {len(self.memory.forgetting)} rounds before"
            if budget is None:
                head += ", and without --max-tokens or --max-bytes nothing more is forgotten"
        self._dim(head + "]")
        if self.tty_in:
            self._dim("[/help lists the commands; Ctrl-D ends the chat, saved]")

    def _dim(self, text: str) -> None:
        print(f"\x1b[2m{text}\x1b[0m" if self.tty_out else text, flush=True)

    def _error(self, text: str) -> None:
        print(f"{_NAME}: error: {text}", file=sys.stderr, flush=True)


class _Streamed:
    """The answer printed as :meth:`kvedit.Memory.ask` hands on its pieces (``on_text``),
    stdout flushed after each; :meth:`end` prints what was not streamed (all of it, from an
    ``ask`` that streams nothing) and ends the line."""

    def __init__(self) -> None:
        self.sent = ""

    def write(self, piece: str) -> None:
        sys.stdout.write(_printable(piece))
        sys.stdout.flush()
        self.sent += piece

    def break_line(self) -> None:
        """End a partly printed answer's line (before an error or interruption line)."""
        if self.sent:
            print(flush=True)

    def end(self, answer: str) -> None:
        rest = answer[len(self.sent) :] if answer.startswith(self.sent) else "\n" + answer
        print(_printable(rest), flush=True)


def _printable(text: str) -> str:
    """``text`` with control characters (a terminal's escape sequences) written as escapes."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def _hold_interrupts():
    """Ignore SIGINT (in the main thread) and return the handler to restore, else None."""
    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals cannot be set there
        return None


def _release_interrupts(held) -> None:
    if held is not None:
        signal.signal(signal.SIGINT, held)
