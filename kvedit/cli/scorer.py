"""``kvedit memory``'s tools: ``fit-scorer`` fits the learned forgetting scorer for a model
(:mod:`kvedit.evals.fitting`), written where ``Memory(forget="learned")`` finds it; ``show``
prints what a memory file holds (:mod:`kvedit.cli.memory_show`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .arguments import positive
from .memory_show import add_show_parser

TOOLS_SUMMARY = "a memory's tools (fit the learned scorer, show what a memory file holds)"
"""``kvedit memory``'s line in ``kvedit --help``."""


def memory_parser(sub) -> None:
    """``kvedit memory`` and its subcommands, ``fit-scorer`` and ``show``."""
    memory = sub.add_parser("memory", help=TOOLS_SUMMARY)
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
        "--size",
        type=positive("--size"),
        default=90,
        help="messages of a facts transcript (even, 40-200; default 90)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="the fit's file (default: kvedit's cache, scorers/MODEL.safetensors, where "
        "forget='learned' looks first)",
    )
    p.set_defaults(run=_run_fit)
    add_show_parser(memory_sub)


def fit_out(args) -> Path:
    """The fit's file: ``--out``, else the user's fits folder (where ``learned`` looks first),
    checked before any work: not empty, not a folder, its first existing parent a folder.

    Raises:
        InvalidInputError: ``--model`` empty, ``--nq`` below 0, ``--size`` not a facts
            transcript's size, or an ``--out`` that could not be written.
    """
    from ..compress.scorers.fits import user_dir
    from ..errors import InvalidInputError
    from ..evals.fitting import check_size

    if not args.model.strip():
        raise InvalidInputError("--model is empty: name a model (a bundled name or a path)")
    if args.nq < 0:
        raise InvalidInputError(f"--nq must be 0 or more, not {args.nq}")
    check_size(args.size, "--size")
    if args.out is not None and not args.out.strip():
        raise InvalidInputError("--out is empty: name the fit's file (or leave --out out)")
    name = Path(args.model).name or args.model
    out = Path(args.out) if args.out is not None else user_dir() / f"{name}.safetensors"
    if out.is_dir():
        raise InvalidInputError(f"--out {out} is a folder: give the fit's file")
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InvalidInputError(f"--out {out}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidInputError(f"--out {out}: {parent} cannot be written to")
    return out


def _run_fit(args) -> int:
    from ..evals.fitting import fit_scorer
    from ..models import load_model

    out = fit_out(args)  # before the model loads: a refusal does no work
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
