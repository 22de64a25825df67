"""``kvedit chat``: a terminal chat kept in one :class:`kvedit.Memory` file."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path

from ..cache.packed import BITS
from ..errors import KVEditError, TemplateError
from ..memory.budget import RECENT_TOKENS
from ..memory.forgetting import DEFAULT_POLICY, FALLBACK_POLICY, global_entries, policies
from .arguments import byte_size, max_positions_arg, nonempty, positive
from .chat_file import check_memory_path, lock_memory, open_memory, save_copy, target
from .status import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError, exit_status, message

_NAME = "kvedit chat"

_CHAT_EPILOG = """\
Each line read is a question: the answer is printed, then (dimmed on a terminal) what the turn
cost: tokens computed for the question, the answer's tokens kept from decoding, the memory's
size. An empty line is skipped. Lines starting with / are commands:
  /explain  each message: tokens, computed / kept / loaded, bytes (kvedit.Memory.explain)
  /save     write the memory file now; /save PATH writes a copy to PATH (the chat goes on
            with its own file); a save that fails is one error line, the chat going on
  /quit     save and end (as Ctrl-D does)
  /help     this list
A question that starts with / is written with two (//...). Ctrl-D or /quit ends the chat with
the memory saved (exit status 0); Ctrl-C, at the prompt or during an answer, ends it the same
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
after its cost. --quantize holds the messages before the last --recent in fewer bits, with or
without a budget. The file keeps both: a later run goes on under them, and an option given
again replaces the file's (--forget, --recent-tokens and --protect with --max-tokens or
--max-bytes).
"""

_COMMANDS = ("/explain", "/save", "/quit", "/help")


def chat_parser(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="a terminal chat whose conversation is one exact cache, saved in a memory file",
        description="Chat with a model; the conversation is a kvedit.Memory: each message is\n"
        "computed once, answers keep their decoded K/V, and --memory holds it between runs\n"
        "(loaded when the file exists, saved on exit).",
        epilog=_CHAT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument(
        "--memory",
        required=True,
        type=nonempty("--memory"),
        metavar="FILE",
        help="the memory file: loaded when it exists (it must be a memory of --model), "
        "written on exit",
    )
    p.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="the system message of a new memory; with an existing file it must equal the "
        "file's own (a memory's messages are never rewritten)",
    )
    p.add_argument(
        "--prompt",
        default=None,
        choices=["chat", "plain"],
        help="the prompt format of a new memory: chat (the tokenizer's template; the default "
        "when it has one) or plain (User:/Assistant: labels, for base models); with an existing "
        "file it must equal the file's",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive("--max-new-tokens"),
        default=128,
        metavar="N",
        help="the longest answer, in tokens (default 128)",
    )
    p.add_argument(
        "--focus",
        action="store_true",
        help="emphasize, for each answer, the messages the question points at "
        "(kvedit.Memory.ask(focus=True): the memory itself is not edited); a line after the "
        "cost says what focus did",
    )
    max_positions_arg(p)
    _budget_args(p)
    p.set_defaults(run=run_chat)


def _budget_args(p) -> None:
    """The forgetting and quantizing options: ``kvedit.Memory``'s budget keywords."""
    budget = p.add_argument_group(
        "forgetting and quantizing (kvedit.Memory's budget; kept in the file, replaced by an "
        "option given again)"
    )
    held = budget.add_mutually_exclusive_group()
    held.add_argument(
        "--max-tokens",
        type=positive("--max-tokens"),
        default=None,
        metavar="N",
        help="the most entries the memory holds per global-attention layer, on average over "
        "those layers, when a question comes (the question and the answer on top)",
    )
    held.add_argument(
        "--max-bytes",
        type=byte_size("--max-bytes"),
        default=None,
        metavar="SIZE",
        help="the most bytes the memory's cache allocates, every layer in the dtype it holds "
        "(a number of bytes, or with KB, MB, GB, KiB, MiB or GiB): the size each turn prints "
        "never passes it",
    )
    budget.add_argument(
        "--forget",
        default=None,
        choices=policies(),
        metavar="POLICY",
        help=f"which entries go first: {', '.join(policies())} (default {DEFAULT_POLICY} where "
        f"a fit exists for the model, else {FALLBACK_POLICY})",
    )
    budget.add_argument(
        "--recent-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"the last N tokens never forgotten (default {RECENT_TOKENS})",
    )
    budget.add_argument(
        "--recent",
        type=positive("--recent"),
        default=None,
        metavar="N",
        help="the last N messages --quantize holds exact (default 2)",
    )
    budget.add_argument(
        "--protect",
        action="append",
        default=None,
        type=nonempty("--protect"),
        metavar="TEXT",
        help="a text never forgotten where the memory holds it (repeatable)",
    )
    budget.add_argument(
        "--quantize",
        type=int,
        default=None,
        choices=BITS,
        metavar="BITS",
        help="hold the messages before the last --recent in 2, 4 or 8 bits (fewer bytes for "
        "the same entries; with or without a budget)",
    )


def run_chat(args) -> int:
    """Open (or start) the memory, read questions until end of input, save it; the status.
    The memory file is held (:func:`~kvedit.cli.chat_file.lock_memory`) from before the model
    loads until the chat ends: a second chat on it is refused."""
    from ..models import load_model

    if args.system is not None and not args.system.strip():
        raise UsageError("--system is empty: give the system message, or leave --system out")
    path = Path(args.memory)
    check_memory_path(path)
    budget = _budget(args)
    lock = lock_memory(path)
    try:
        model, tok = load_model(args.model)
        memory = open_memory(path, model, tok, args, budget)
        return _Chat(memory, path, args.max_new_tokens, args.focus).run()
    finally:
        lock.release()


def _budget(args) -> dict:
    """``Memory``'s budget keywords from the forgetting and quantizing options; refused,
    before the model loads, where an option needs a budget that is not given."""
    budgeted = args.max_tokens is not None or args.max_bytes is not None
    needs = [("--forget", args.forget), ("--recent-tokens", args.recent_tokens)]
    needs.append(("--protect", args.protect))
    given = [name for name, value in needs if value is not None]
    if given and not budgeted:
        raise UsageError(
            f"{', '.join(given)} without a budget: give --max-tokens or --max-bytes "
            "(nothing is forgotten without one)"
        )
    if args.recent is not None and args.quantize is None:
        raise UsageError("--recent says which messages --quantize holds exact: give --quantize")
    if args.recent_tokens is not None and args.recent_tokens < 0:
        raise UsageError(f"--recent-tokens must be 0 or more, not {args.recent_tokens}")
    keywords = {
        "max_tokens": args.max_tokens,
        "max_bytes": args.max_bytes,
        "forget": args.forget,
        "recent": args.recent,
        "recent_tokens": args.recent_tokens,
        "protect": None if args.protect is None else list(args.protect),
        "quantize": args.quantize,
    }
    return {k: v for k, v in keywords.items() if v is not None}  # Memory's defaults for the rest


class _Chat:
    """The read-ask-print loop over one memory and its file."""

    def __init__(self, memory, path: Path, max_new_tokens: int, focus: bool = False) -> None:
        self.memory = memory
        self.path = path
        self.max_new_tokens = max_new_tokens
        self.focus = focus
        self.existed = path.exists()
        self.saved_at = self._mark() if self.existed else None
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
            print(self.memory.explain(), flush=True)
        elif word == "/save":
            self._save(text[len(word) :].strip())
        elif word == "/help":
            print(_CHAT_EPILOG, end="", flush=True)
        elif word != "/quit":
            self._error(
                f"unknown command {word!r}: the commands are {', '.join(_COMMANDS)} "
                "(a question that starts with / is written //...)"
            )
        return word

    def _ask(self, question: str) -> None:
        before = self._mark()
        rounds = len(self.memory.forgetting)
        try:
            answer = self.memory.ask(question, max_new_tokens=self.max_new_tokens, focus=self.focus)
        except KeyboardInterrupt:
            self._interrupted(before)
            raise
        except KVEditError as e:
            if exit_status(e) != EXIT_USAGE and not isinstance(e, TemplateError):
                raise
            self._error(f"{message(e)}; the question was not kept")
            return
        print(_printable(answer), flush=True)
        self._dim(self._cost(self.memory.forgetting[rounds:]))
        if self.focus:
            said = self.memory.focus_said() or "no earlier message to emphasize"
            self._dim(f"[focus: {_printable(said)}]")

    def _interrupted(self, before: tuple[int, int]) -> None:
        """After Ctrl-C during an answer: say whether the question was kept (it is not, unless
        the answer had been committed already), and refuse to save a memory caught midway."""
        now = self._mark()
        if now == before:
            self._dim("[interrupted: the question and its partial answer were not kept]")
        elif now[0] == before[0] + 2 and self._consistent():
            self._dim("[interrupted after the answer was kept]")
        else:
            self.abandoned = True  # caught between two fields: not written
            raise KVEditError(
                f"interrupted while the memory was being updated ({before[0]} -> {now[0]} "
                f"messages, {before[1]} -> {now[1]} tokens); {self.path} is left as it was"
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
        if budget is not None and budget.max_bytes is not None:
            held = f" (budget {_size(budget.max_bytes)})"
        elif budget is not None:  # the budget counts what was held when the question came
            entries = global_entries(self.memory.state) - q.n_tokens - a.n_tokens
            held = (
                f" ({entries:,} of {budget.max_entries:,} entries held, question and answer on top)"
            )
        return (
            f"[{q.start:,} tok reused, question {q.computed:,} tok computed, {answer}, "
            f"memory {len(self.memory.state):,} tok{held}, {_size(self.memory.nbytes)}{forgot}]"
        )

    def _mark(self) -> tuple[int, int]:
        return len(self.memory), len(self.memory.state)

    def _save(self, where: str = "") -> None:
        """``/save`` (the chat's own file) or ``/save PATH`` (a copy there); a save that fails
        is one error line, and the chat goes on with its messages."""
        copy = Path(where).expanduser() if where else None
        try:
            if copy is not None and target(copy, None) == target(self.path):
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
            self._dim(f"[saved a copy {copy}: {self._counts()}; the chat goes on with {self.path}]")
            return
        self.saved_at, self.existed = self._mark(), True
        self._dim(f"[saved {self._summary()}]")

    def _save_at_exit(self) -> None:
        """Save unless nothing changed; SIGINT is held off while the file is written."""
        if self.abandoned:
            return
        if self.saved_at == self._mark() or (not self.existed and len(self.memory) == 0):
            what = "unchanged" if self.existed else "not written: no messages"
            print(f"memory {self.path} {what}: {self._counts()}", flush=True)
            return
        held = _hold_interrupts()
        try:
            self.memory.save(self.path)
        finally:
            _release_interrupts(held)
        self.saved_at = self._mark()
        print(f"saved {self._summary()}", flush=True)

    def _summary(self) -> str:
        return f"{self.path}: {self._counts()}, {_size(self.memory.nbytes)}"

    def _counts(self) -> str:
        return f"{len(self.memory):,} messages, {len(self.memory.state):,} tok"

    def _start_line(self) -> None:
        if self.existed:
            head = f"[memory {self.path}: {self._counts()}, prompt {self.memory.prompt!r}"
        else:
            head = f"[new memory {self.path}, prompt {self.memory.prompt!r}"
        budget = self.memory.budget
        if budget is not None:
            most = (
                f"{_size(budget.max_bytes)}"
                if budget.max_bytes is not None
                else f"{budget.max_entries:,} entries a global layer on average"
            )
            heads = ", each KV head its own" if budget.per_head else ""
            head += (
                f", holds at most {most} (forgets by {budget.policy}{heads}, the last "
                f"{budget.recent_tokens} tokens kept)"
            )
        if self.memory.quantize is not None:
            head += (
                f", messages before the last {self.memory.recent} held in "
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


def _printable(text: str) -> str:
    """``text`` with control characters (a terminal's escape sequences) written as escapes."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} B"


def _hold_interrupts():
    """Ignore SIGINT (in the main thread) and return the handler to restore, else None."""
    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals cannot be set there
        return None


def _release_interrupts(held) -> None:
    if held is not None:
        signal.signal(signal.SIGINT, held)
