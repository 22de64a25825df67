"""``kvedit memory fit-scorer``: fit the learned forgetting scorer for a model
(:mod:`kvedit.evals.fitting`), written where ``Memory(forget="learned")`` finds it."""

from __future__ import annotations

import sys
from pathlib import Path

from .arguments import positive


def memory_parser(sub) -> None:
    """``kvedit memory`` and its one subcommand, ``fit-scorer``."""
    memory = sub.add_parser("memory", help="a memory's tools (fit the learned scorer)")
    memory_sub = memory.add_subparsers(dest="tool", required=True)
    p = memory_sub.add_parser(
        "fit-scorer",
        help="fit the learned forgetting scorer for a model (a few minutes on CPU for 135M)",
        description=(
            "Runs the model over transcripts kvedit makes (the memory suite's facts and "
            "nq-shared conversations of its tuning seeds), scores every entry with KVzip, and "
            "fits per layer a ridge map from the entry's key and value to its log score. The "
            "fit is written to --out, by default where Memory(forget='learned') looks for it."
        ),
    )
    p.add_argument("--model", required=True, help="model name or path")
    p.add_argument(
        "--facts", type=positive("--facts"), default=4, help="facts transcripts per seed"
    )
    p.add_argument("--nq", type=int, default=2, help="nq-shared transcripts per seed (0: none)")
    p.add_argument(
        "--size", type=positive("--size"), default=90, help="messages of a facts transcript (90)"
    )
    p.add_argument(
        "--out", default=None, help="the fit's file (default: kvedit's cache, scorers/MODEL)"
    )
    p.set_defaults(run=_run_fit)


def _run_fit(args) -> int:
    from ..compress.scorers.learned import fit_folders
    from ..errors import InvalidInputError
    from ..evals.fitting import fit_scorer
    from ..models import load_model

    if args.nq < 0:
        raise InvalidInputError(f"--nq must be 0 or more, not {args.nq}")
    name = Path(args.model).name or args.model
    out = Path(args.out) if args.out else fit_folders()[1] / f"{name}.safetensors"
    if out.exists() and out.is_dir():
        raise InvalidInputError(f"--out {out} is a folder: give the fit's file")
    model, tok = load_model(args.model)
    fitted = fit_scorer(
        model,
        tok,
        model_name=args.model,
        n_facts=args.facts,
        n_nq=args.nq,
        size=args.size,
        progress=lambda line: print(line, file=sys.stderr),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fitted.save(out)
    fit = fitted.meta["fit"]
    print(
        f"fit of {args.model}: held-out R2 {fit['held_out_r2']:.3f} over "
        f"{len(fitted.layers)} layers, {fit['samples_per_layer']:,} samples per layer, "
        f"{fit['seconds']} s\nwritten: {out}"
    )
    return 0
