"""``kvedit eval memory``: the memory suite (:mod:`kvedit.evals.memory`) from the command line.

Every argument is checked before the model loads (method specs, budgets, the task's sizes,
``--out``); each budget is checked against what the memories never forget once the tokenizer
is loaded, before anything is written. An ``--out`` holding results is refused unless
``--resume`` or ``--overwrite``; an empty ``--out`` is refused. One run per ``--out`` at a
time: a run holds ``out/.lock`` (a :class:`~kvedit.store.lock.WriterLock` naming its process)
while it runs, and another run on that folder is refused naming that process. A refusal writes
nothing and exits 2.
"""

from __future__ import annotations

import argparse

from .arguments import check_out_free, holding_out, positive
from .litm import overwrite_arg


def _epilog() -> str:
    """The methods and parameters, from the registry of policies."""
    from ..memory.forgetting import policies

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
  default 16), per_head=True|False (each KV head its own entries; default: where the policy
  allows), recent=N (the messages quantize=B holds exact, default 2), quantize=B (2, 4 or 8:
  the messages before the last recent held in B bits; with snapkv-first, the compressed state
  quantized), in_bytes=True (the budget a fraction of the bytes a memory that forgets nothing
  allocates: max_bytes)
budgets (--budgets): fractions in (0, 1] of the conversation's global-layer entries when the
first question is asked, held when each question comes (the question and answer on top); at
1.0 every method without quantize is reuse (computed once).
"""


def _task_help(option: str) -> str:
    """What ``option`` means for each registered memory task (its registered help)."""
    from ..evals.tasks import MEMORY_TASKS

    said = [f"{name}: {t.help[option]}" for name, t in MEMORY_TASKS.items() if option in t.help]
    return "; ".join(said) or option


def memory_parser(sub) -> None:
    p = sub.add_parser(
        "memory",
        help="what a forgetting kvedit.Memory still answers, by the age of what is asked",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from ..evals.tasks import MEMORY_TASKS

    p.add_argument("--task", default="facts", choices=MEMORY_TASKS.names())
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--methods", default="reuse,learned,kvzip,window,snapkv-first")
    p.add_argument("--budgets", default="1.0,0.5,0.25,0.1")
    p.add_argument("--n-examples", type=positive("--n-examples"), default=10)
    p.add_argument(
        "--size",
        type=positive("--size"),
        default=None,
        help=_task_help("size"),
    )
    p.add_argument(
        "--questions",
        type=positive("--questions"),
        default=None,
        help="questions per conversation, a multiple of 3 (" + _task_help("questions") + ")",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/memory")
    overwrite_arg(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the conversations done in DIR/partial.jsonl, compute the rest (a last line "
        "cut by a kill is dropped with a warning)",
    )
    p.add_argument("--max-new-tokens", type=positive("--max-new-tokens"), default=16)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=_run_memory)


def check_memory(args) -> None:
    """Refuse, before any model is loaded and before anything is written, a bad spec, budget,
    task size, or an ``--out`` holding an earlier run's results."""
    from ..errors import InvalidInputError
    from ..evals.memory import (
        MEMORY_RESULTS,
        build_conversations,
        parse_budgets,
        parse_memory_spec,
    )
    from ..evals.methods.registry import split_specs
    from ..evals.report import check_out

    check_out_free(args.out)
    check_out(args.out, MEMORY_RESULTS, overwrite=args.overwrite, resume=args.resume)
    specs = split_specs(args.methods)
    if not specs:
        raise InvalidInputError(f"--methods {args.methods!r} names no method")
    for spec in specs:
        parse_memory_spec(spec)
    parse_budgets(args.budgets)
    build_conversations(args.task, args.n_examples, args.seed, args.size, args.questions)


def _run_memory(args) -> int:
    from ..evals.memory import main

    check_memory(args)
    with holding_out(args.out, "kvedit eval memory"):  # one run per --out at a time
        return main(args)
