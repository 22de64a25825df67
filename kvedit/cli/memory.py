"""``kvedit eval memory``: the memory suite (:mod:`kvedit.evals.memory`) from the command line.

Every argument is checked before the model loads (method specs, budgets, the task's sizes,
``--out``); each budget is checked against what the memories never forget once the tokenizer
is loaded, before anything is written. An ``--out`` holding results is refused unless
``--resume`` or ``--overwrite``; an empty ``--out`` is refused. One run per ``--out`` at a
time: a run holds ``out/.lock`` (a :class:`~kvedit.store.lock.WriterLock` naming its process)
while it runs, and another run on that folder is refused naming that process. A refusal writes
nothing and exits 2.

``--conversations FILE`` runs on the conversations of a file
(:mod:`kvedit.evals.conversation_files`), checked whole before the model loads, its turns
rendered by ``--speakers``; a generated task's options (``--task``, ``--n-examples``,
``--seed``, ``--size``, ``--questions``) are refused with it.
"""

from __future__ import annotations

from .arguments import check_out_free, holding_out, positive
from .litm import overwrite_arg
from .names import RECENT_TOKENS, SPEAKER_MODES, memory_task_help, memory_tasks, policies

DEFAULT_TASK = "facts"
"""The generated task run when neither --task nor --conversations is given."""
DEFAULTS = {"n_examples": 10, "seed": 0}
"""A generated task's options left out."""


def _epilog() -> str:
    """The methods and parameters (the policies: every registered scorer)."""
    names = ", ".join(policies())
    return f"""\
methods (--methods, comma-separated specs name[:key=value...]):
  reuse         the memory keeps everything (run at budget 1.0 only)
  {names}
                kvedit.Memory(max_tokens=budget x entries, forget=NAME) from the first message
                (every registered scorer is a policy)
  snapkv-first  everything kept, compressed once by SnapKV with the first question as query,
                then reused for every question
  parameters: budget=F (this budget only), recent_tokens=N (the last tokens never forgotten;
  default {RECENT_TOKENS}), per_head=True|False (each KV head its own entries; default: where the policy
  allows), recent=N (the messages quantize=B holds exact, default 2), quantize=B (2, 4 or 8:
  the messages before the last recent held in B bits; with snapkv-first, the compressed state
  quantized), in_bytes=True (the budget a fraction of the bytes a memory that forgets nothing
  allocates: max_bytes)
budgets (--budgets): fractions in (0, 1] of the conversation's global-layer entries when the
first question is asked, held when each question comes (the question and answer on top); at
1.0 every method without quantize is reuse (computed once).
"""


def _conversation_args(p) -> None:
    """``--conversations FILE`` and ``--speakers``."""
    p.add_argument(
        "--conversations",
        metavar="FILE",
        default=None,
        help="run on the conversations of a JSON file instead of a generated task (the format: "
        "docs/evals.md; an example: kvedit/evals/data/example_conversation.json)",
    )
    p.add_argument(
        "--speakers",
        default=None,
        choices=SPEAKER_MODES,
        help="with --conversations, how turns become messages, each '[DATE] SPEAKER: TEXT': "
        "user (default: every turn a user message) or alternate (the first speaker the user, "
        "the second the assistant)",
    )


MEMORY_SUMMARY = "what a forgetting kvedit.Memory still answers, by the age of what is asked"
"""``kvedit eval memory``'s line in ``kvedit eval --help``."""


def memory_parser(sub) -> None:
    p = sub.add_parser(
        "memory",
        help=MEMORY_SUMMARY,
        epilog=_epilog(),
    )
    p.add_argument(
        "--task",
        default=None,
        choices=sorted(memory_tasks()),
        help=f"a generated task (default {DEFAULT_TASK}; not with --conversations)",
    )
    _conversation_args(p)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument(
        "--methods",
        default="reuse,learned,kvzip,window,snapkv-first",
        help="comma-separated method specs, name[:key=value...] (see below)",
    )
    p.add_argument(
        "--budgets",
        default="1.0,0.5,0.25,0.1",
        help="comma-separated fractions in (0, 1] (see below)",
    )
    _generated_task_args(p)
    p.add_argument("--out", default="runs/memory", help="the results folder")
    overwrite_arg(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the conversations done in DIR/partial.jsonl, compute the rest (a last line "
        "cut by a kill is dropped with a warning)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive("--max-new-tokens"),
        default=16,
        help="the longest answer, in tokens",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=_run_memory)


def _generated_task_args(p) -> None:
    """A generated task's sizes and seed (``--n-examples``, ``--size``, ``--questions``,
    ``--seed``; refused with ``--conversations``)."""
    p.add_argument(
        "--n-examples",
        type=positive("--n-examples"),
        default=None,
        help=f"conversations generated (default {DEFAULTS['n_examples']})",
    )
    p.add_argument(
        "--size",
        type=positive("--size"),
        default=None,
        help=memory_task_help("size"),
    )
    p.add_argument(
        "--questions",
        type=positive("--questions"),
        default=None,
        help=f"questions per conversation, a multiple of 3 ({memory_task_help('questions')})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help=f"a generated task's random seed (default {DEFAULTS['seed']})",
    )


def check_memory(args) -> None:
    """Refuse, before any model is loaded and before anything is written, a bad spec, budget,
    task size, or an ``--out`` holding an earlier run's results."""
    from ..errors import InvalidInputError
    from ..evals.conversation_files import load_conversations
    from ..evals.memory import (
        MEMORY_RESULTS,
        build_conversations,
        parse_budgets,
        parse_memory_spec,
    )
    from ..evals.methods.registry import split_specs
    from ..evals.report import check_out

    _resolve(args)
    check_out_free(args.out)
    check_out(args.out, MEMORY_RESULTS, overwrite=args.overwrite, resume=args.resume)
    specs = split_specs(args.methods)
    if not specs:
        raise InvalidInputError(f"--methods {args.methods!r} names no method")
    for spec in specs:
        parse_memory_spec(spec)
    parse_budgets(args.budgets)
    if args.conversations is not None:
        load_conversations(args.conversations, args.speakers)
    else:
        build_conversations(args.task, args.n_examples, args.seed, args.size, args.questions)


def _resolve(args) -> None:
    """Refuse a generated task's options with ``--conversations`` (and ``--speakers``
    without it); give the options left out their defaults."""
    from ..errors import InvalidInputError

    file = args.conversations is not None
    if file:
        given = [
            f"--{k.replace('_', '-')}"
            for k in ("task", "n_examples", "seed", "size", "questions")
            if getattr(args, k) is not None
        ]
        if given:
            raise InvalidInputError(
                f"--conversations {args.conversations} takes no {', '.join(given)} (those are "
                "for a generated --task): run every conversation and question of the file"
            )
        args.speakers = args.speakers or "user"
        return
    if args.speakers is not None:
        raise InvalidInputError("--speakers is for --conversations FILE (how its turns are said)")
    args.task = args.task or DEFAULT_TASK
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _run_memory(args) -> int:
    from ..evals.memory import main

    check_memory(args)
    with holding_out(args.out, "kvedit eval memory"):  # one run per --out at a time
        return main(args)
