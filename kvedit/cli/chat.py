"""``kvedit chat``: a terminal chat kept in one :class:`kvedit.Memory` file: the command's options
and its run (the options checked, the memory file locked and opened, then the read-ask-print
loop of :mod:`kvedit.cli.chat_loop`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import byte_size, max_positions_arg, nonempty, positive
from .chat_options import CHAT_HELP, CHAT_SUMMARY
from .chat_sampling import sampling_args, sampling_of
from .names import DEFAULT_POLICY, FALLBACK_POLICY, QUANTIZE_BITS, RECENT_TOKENS, policies
from .status import UsageError


def chat_parser(sub) -> None:
    """Add ``chat`` to ``kvedit``'s commands (imports no torch: :mod:`kvedit.cli.names`)."""
    p = sub.add_parser(
        "chat",
        help=CHAT_SUMMARY,
        description="Chat with a model; the conversation is a kvedit.Memory: each message is\n"
        "computed once, answers keep their decoded K/V, and --memory holds it between runs\n"
        "(loaded when the file exists, saved on exit).",
        epilog=CHAT_HELP,
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument(
        "--memory",
        default=None,
        type=nonempty("--memory"),
        metavar="FILE",
        help="the memory file: loaded when it exists (it must be a memory of --model), "
        "written on exit (default: none, the conversation is held in RAM only; /save PATH "
        "still writes it)",
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
    sampling_args(p)
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
    held.add_argument(
        "--keep",
        type=_fraction,
        default=None,
        metavar="F",
        help="a fraction in (0, 1], as kvedit eval memory's budgets: the memory holds at most "
        "round(F x E) entries per global layer on average, E the entries it holds when the "
        "chat starts (an existing --memory file's; a new memory is refused: give --max-tokens)",
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
        "--protect",
        action="append",
        default=None,
        type=nonempty("--protect"),
        metavar="TEXT",
        help="a text never forgotten where the memory holds it (repeatable)",
    )
    _layer_floor_arg(budget)
    _quantize_args(budget)


def _fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], not {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {text}")
    return value


def _layer_floor_arg(budget) -> None:
    """``--layer-floor``: ``kvedit.Memory``'s ``layer_floor`` (checked by :func:`_layer_floor`)."""
    budget.add_argument(
        "--layer-floor",
        default=None,
        metavar="F",
        help="a fraction in [0, 1) of each forgetting round's budget shared equally among the "
        "global layers before one ranking across them spends the rest, so that no layer "
        "starves (kvedit.Memory(layer_floor=); it changes what policies that rank every "
        "layer's entries together keep, such as kvzip and learned; default 0: one ranking "
        "alone, or a --memory file's own)",
    )


def _layer_floor(text: str) -> float:
    """``--layer-floor``'s value, a number in [0, 1); a one-line :class:`UsageError` (exit
    status 2, before the model loads) for anything else."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:  # NaN fails too
        raise UsageError(f"--layer-floor must be a number in [0, 1), not {text!r}")
    return value


def _quantize_args(budget) -> None:
    """``--exact-messages`` and ``--quantize``: ``kvedit.Memory``'s quantizing keywords."""
    budget.add_argument(
        "--exact-messages",
        "--recent",
        dest="exact_messages",
        type=positive("--exact-messages"),
        default=None,
        metavar="N",
        help="the last N messages --quantize holds exact (default 2; --recent, its older name)",
    )
    budget.add_argument(
        "--quantize",
        type=int,
        default=None,
        choices=QUANTIZE_BITS,
        metavar="BITS",
        help="hold the messages before the last --exact-messages in 2, 4 or 8 bits (fewer "
        "bytes for the same entries; with or without a budget)",
    )


def run_chat(args) -> int:
    """Open (or start) the memory, read questions until end of input, save it; the status.
    Without --memory the conversation is held in RAM only (no file, no lock). The memory
    file is held (:func:`~kvedit.cli.chat_file.lock_memory`) from before the model
    loads until the chat ends: a second chat on it is refused."""
    from ..models import load_model
    from .chat_file import check_memory_path, lock_memory, open_memory
    from .chat_loop import ChatLoop

    if args.system is not None and not args.system.strip():
        raise UsageError("--system is empty: give the system message, or leave --system out")
    path = None if args.memory is None else Path(args.memory)
    if path is not None:
        check_memory_path(path)
    budget = _budget(args)
    sampling = sampling_of(args)
    lock = None if path is None else lock_memory(path)
    try:
        model, tok = load_model(args.model)
        memory = open_memory(path, model, tok, args, budget)
        return ChatLoop(memory, path, args.max_new_tokens, args.focus, sampling).run()
    finally:
        if lock is not None:
            lock.release()


def _budget(args) -> dict:
    """``Memory``'s budget keywords from the forgetting and quantizing options; refused,
    before the model loads, where an option needs a budget that is not given."""
    budgeted = any(v is not None for v in (args.max_tokens, args.max_bytes, args.keep))
    needs = [("--forget", args.forget), ("--recent-tokens", args.recent_tokens)]
    floor = None if args.layer_floor is None else _layer_floor(args.layer_floor)
    needs += [("--protect", args.protect), ("--layer-floor", floor)]
    given = [name for name, value in needs if value is not None]
    if given and not budgeted:
        raise UsageError(
            f"{', '.join(given)} without a budget: give --max-tokens, --max-bytes or --keep "
            "(nothing is forgotten without one)"
        )
    if args.exact_messages is not None and args.quantize is None:
        raise UsageError(
            "--exact-messages says which messages --quantize holds exact: give --quantize"
        )
    if args.keep is not None and (args.memory is None or not Path(args.memory).exists()):
        raise UsageError(
            f"--keep {args.keep}: a fraction of the entries the memory holds when the chat "
            "starts, and a new memory holds only its system message; give --max-tokens or "
            "--max-bytes, or --memory an existing file"
        )
    if args.recent_tokens is not None and args.recent_tokens < 0:
        raise UsageError(f"--recent-tokens must be 0 or more, not {args.recent_tokens}")
    keywords = {
        "max_tokens": args.max_tokens,
        "max_bytes": args.max_bytes,
        "forget": args.forget,
        "exact_messages": args.exact_messages,
        "recent_tokens": args.recent_tokens,
        "protect": None if args.protect is None else list(args.protect),
        "quantize": args.quantize,
        "layer_floor": floor,
    }
    return {k: v for k, v in keywords.items() if v is not None}  # Memory's defaults for the rest
