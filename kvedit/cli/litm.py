"""``kvedit eval litm`` and ``kvedit demo``: the lost-in-the-middle suite from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import check_out_free, holding_out, max_positions_arg, positions, positive
from .names import ENGINES, VLLM_BATCH, litm_tasks
from .status import UsageError

_LITM_EPILOG = """\
prompt formats (--prompt):
  chat   the tokenizer's chat template: one user turn (instruction, documents, question)
         and the generation prompt; an error if the tokenizer has no chat template
  plain  the raw user message followed by "\\nAnswer:", so the prompt ends
         "Question: ...\\nAnswer:" (for base models)
  auto   (default) the model's own format, stated in its registry entry
         (kvedit/models.py, ModelSpec.prompt): chat for smollm2-135m-instruct, plain for
         the base gemma3-270m; chat for the tiny test models and for any local folder or
         .gguf file. It never depends on whether the weights happen to carry a template.
The format used is recorded in results.json (extra.prompt); --reuse refuses a run made with
another format (files without it were made with chat).
"""


LITM_SUMMARY = "lost-in-the-middle accuracy by gold position"
"""``kvedit eval litm``'s line in ``kvedit eval --help``."""


def litm_parser(sub) -> None:
    p = sub.add_parser(
        "litm",
        help=LITM_SUMMARY,
        epilog=_LITM_EPILOG,
    )
    _add_example_arguments(p)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument(
        "--prompt",
        default="auto",
        choices=["auto", "chat", "plain"],
        help="prompt format: chat template or plain text with an answer cue; auto: the "
        "model's registered format (see below)",
    )
    p.add_argument("--out", default="runs/litm", help="the results folder")
    overwrite_arg(p)
    p.add_argument(
        "--limit",
        type=positive("--limit"),
        default=None,
        help="cap on the number of examples (default: no cap)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive("--max-new-tokens"),
        default=32,
        help="the longest answer, in tokens",
    )
    max_positions_arg(p)
    _add_engine_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _add_reuse_arguments(p)
    p.set_defaults(run=_run_litm)


def _add_example_arguments(p: argparse.ArgumentParser) -> None:
    """What is run: ``--task`` or ``--data``, ``--methods``, and the examples' sizes and seed."""
    p.add_argument(
        "--task", default="records", choices=litm_tasks(), help="the generated task's name"
    )
    p.add_argument(
        "--data",
        default=None,
        help="a JSONL file of your own examples, run instead of --task (default: none)",
    )
    p.add_argument(
        "--methods",
        default="none,auto,oracle",
        help="comma-separated method specs, name[:key=value...]",
    )
    p.add_argument(
        "--n-docs",
        type=positive("--n-docs"),
        default=None,
        help="documents per prompt (default: the task's own)",
    )
    p.add_argument(
        "--positions",
        type=positions,
        default=None,
        help="gold positions, e.g. 0,5,10 (default: the task's own)",
    )
    p.add_argument(
        "--trials",
        type=positive("--trials"),
        default=None,
        help="examples per position (default: the task's own)",
    )
    p.add_argument("--seed", type=int, default=0, help="the examples' random seed")


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """``--engine``, and vLLM's ``--batch`` and ``--approximate``."""
    p.add_argument(
        "--engine",
        default="transformers",
        choices=list(ENGINES),
        help="what decodes the answers: kvedit on the Hugging Face model (transformers), or "
        "vLLM serving each method's published cache (methods none, oracle, auto, reread; "
        "needs kvedit[vllm])",
    )
    p.add_argument(
        "--batch",
        type=positive("--batch"),
        default=VLLM_BATCH,
        help=f"--engine vllm: examples whose prompts vLLM answers in one batch (default "
        f"{VLLM_BATCH}; ignored by --engine transformers)",
    )
    p.add_argument(
        "--approximate",
        action="store_true",
        help="--engine vllm: allow methods whose edits vLLM realises only approximately (auto, "
        "oracle with a bias between copy counts); labelled per record and per method",
    )


def _add_reuse_arguments(p: argparse.ArgumentParser) -> None:
    """``--resume``, and ``--reuse`` with its ``--reuse-methods`` and ``--reuse-unchecked``."""
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep results in DIR/partial.jsonl, compute the rest (a last line cut by a kill "
        "is dropped with a warning)",
    )
    p.add_argument(
        "--reuse",
        default=None,
        metavar="RESULTS_JSON",
        help="take (example, method) results from an earlier run's results.json (same model, "
        "task, seed and prompt format) instead of recomputing them: to add methods to a "
        "finished run; only when it ran the same kvedit source (results.json extra.kvedit), "
        "unless --reuse-methods names the methods to take",
    )
    p.add_argument(
        "--reuse-methods",
        default=None,
        metavar="SPECS",
        help="with --reuse: take only these methods (comma-separated specs, as in --methods) "
        "from the earlier run (default: every method it ran); needed when it ran other kvedit code, to say which answers the "
        "change left alone",
    )
    p.add_argument(
        "--reuse-unchecked",
        action="store_true",
        help="with --reuse of a file whose records name no example digest (older runs): take "
        "its answers by id; you vouch that it ran the same examples (--n-docs, --trials, "
        "--limit, --data)",
    )


LITM_RESULTS = ("results.json", "partial.jsonl")
"""The files of an earlier run that ``--out`` must not hold (unless ``--overwrite``/``--resume``)."""


def overwrite_arg(p: argparse.ArgumentParser) -> None:
    """``--overwrite``: every eval suite's leave to replace an earlier run's results in --out."""
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results of an earlier run in --out (refused without it)",
    )


def _check_litm(args) -> None:
    """Refuse, before any model is loaded and before anything is written, a run whose input is
    bad, that has no examples, or whose ``--out`` holds an earlier run's results."""
    from ..evals.jsonl import load_jsonl
    from ..evals.litm import build_examples
    from ..evals.report import check_out

    check_out_free(args.out)
    check_out(
        args.out,
        LITM_RESULTS,
        overwrite=getattr(args, "overwrite", False),
        resume=getattr(args, "resume", False),
    )
    if args.data is not None:
        load_jsonl(args.data)  # names the file and the line of any problem
    reuse = getattr(args, "reuse", None)
    if reuse is not None and not Path(reuse).is_file():
        raise UsageError(f"--reuse {reuse}: no such file")
    if getattr(args, "reuse_methods", None) is not None and reuse is None:
        raise UsageError("--reuse-methods needs --reuse (the run to take the methods from)")
    if getattr(args, "reuse_unchecked", False) and reuse is None:
        raise UsageError("--reuse-unchecked needs --reuse (the run to take the answers from)")
    examples = build_examples(
        task=args.task,
        data=args.data,
        n_docs=args.n_docs,
        positions=args.positions,
        trials=args.trials,
        seed=args.seed,
        limit=args.limit,
    )
    if not examples:
        raise UsageError("this run has no examples (check --trials, --limit, --positions)")


def _litm_args(args) -> argparse.Namespace:
    """``args`` as :func:`kvedit.evals.litm.main` reads them (``--positions`` as text)."""
    ns = argparse.Namespace(**vars(args))
    if args.positions is not None:
        ns.positions = ",".join(str(p) for p in args.positions)
    return ns


def _run_litm(args) -> int:
    from ..evals.litm import main

    _check_litm(args)
    with holding_out(args.out, "kvedit eval litm"):  # one run per --out at a time
        return main(_litm_args(args))


def run_demo(args) -> int:
    from ..evals.litm import main

    ns = argparse.Namespace(
        task="records",
        data=None,
        methods="none,auto,oracle",
        n_docs=20,
        positions="0,5,10,15,19",
        trials=args.trials,
        seed=args.seed,
        model=args.model,
        out=args.out,
        limit=None,
        max_new_tokens=32,
        no_progress=False,
        prompt="auto",
        overwrite=True,  # the demo is run again and again: it replaces its own results
    )
    _check_litm(argparse.Namespace(**{**vars(ns), "positions": [0, 5, 10, 15, 19]}))
    print(
        f"kvedit demo: lost in the middle on {args.model}: 20 records, the gold record at "
        f"positions 0/5/10/15/19, {args.trials} trials each; methods none, auto, oracle."
    )
    with holding_out(args.out, "kvedit demo"):
        return main(ns)
