"""The ``kvedit`` command line: ``kvedit demo``, ``kvedit eval litm``."""

from __future__ import annotations

import argparse
import sys


def _litm_parser(sub) -> None:
    p = sub.add_parser("litm", help="lost-in-the-middle accuracy by gold position")
    p.add_argument("--task", default="records", choices=["records", "nq"])
    p.add_argument("--data", default=None, help="custom JSONL examples (replaces --task)")
    p.add_argument("--methods", default="none,auto,oracle", help="comma-separated method specs")
    p.add_argument("--n-docs", type=int, default=None, help="documents per prompt")
    p.add_argument("--positions", default=None, help="gold positions, e.g. 0,5,10")
    p.add_argument("--trials", type=int, default=None, help="examples per position")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", default="runs/litm")
    p.add_argument("--limit", type=int, default=None, help="cap on the number of examples")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=_run_litm)


def _run_litm(args) -> int:
    from .evals.litm import main

    return main(args)


def _run_demo(args) -> int:
    from .evals.litm import main

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
    )
    print(
        f"kvedit demo: lost in the middle on {args.model}: 20 records, the gold record at "
        f"positions 0/5/10/15/19, {args.trials} trials each; methods none, auto, oracle."
    )
    return main(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvedit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a short lost-in-the-middle run on the bundled model")
    demo.add_argument("--model", default="smollm2-135m-instruct")
    demo.add_argument("--trials", type=int, default=3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs/demo")
    demo.set_defaults(run=_run_demo)
    ev = sub.add_parser("eval", help="evaluations")
    ev_sub = ev.add_subparsers(dest="suite", required=True)
    _litm_parser(ev_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
