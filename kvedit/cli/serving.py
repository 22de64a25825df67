"""``kvedit serve`` and ``kvedit publish``: vLLM serving kvedit caches."""

from __future__ import annotations

import argparse
import shlex
import sys

from .arguments import byte_size, max_positions_arg, nonempty, port, positive, read_input
from .names import servable_policies

_SERVE_EPILOG = """\
Further arguments after -- go to vLLM's server as they are, e.g.
  kvedit serve --root published/ -- --max-model-len 8192 --tensor-parallel-size 2
Then publish contexts into the same root (kvedit publish) and POST their token ids to
http://HOST:PORT/v1/completions. Needs kvedit[vllm]; in a checkout: make vllm-setup, then
.venv-vllm/bin/kvedit serve ...
"""


SERVE_SUMMARY = "vLLM's OpenAI-compatible server, answering from the caches published under ROOT"
"""``kvedit serve``'s line in ``kvedit --help``."""
PUBLISH_SUMMARY = "capture a context, edit it, publish it for kvedit serve; prints what to send"
"""``kvedit publish``'s line in ``kvedit --help``."""


def serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help=SERVE_SUMMARY,
        epilog=_SERVE_EPILOG,
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument(
        "--root",
        type=nonempty("--root"),
        default="published",
        help="the folder kvedit publish writes to",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default: %(default)s, this machine only)",
    )
    p.add_argument("--port", type=port, default=8000, help="the port to serve on")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name requests give (default: --model as given, as kvedit publish uses)",
    )
    p.add_argument(
        "--on-load-failure",
        default="fail",
        choices=["fail", "recompute"],
        help="a published cache a worker cannot load: fail (the default) ends the request with "
        "an error, recompute lets vLLM compute the prompt (the right answer only for unedited "
        "caches)",
    )
    p.add_argument(
        "--no-memories",
        dest="memories",
        action="store_false",
        help="serve /v1/chat/completions as vLLM does (default: from each conversation's memory)",
    )
    p.add_argument(
        "--memory-max-bytes",
        type=byte_size("--memory-max-bytes"),
        default=None,
        metavar="SIZE",
        help="each conversation's memory holds at most this (e.g. 8MiB; default: no budget)",
    )
    p.add_argument("--forget", default=None, help=_forget_help())
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command, do not run it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(run=_run_serve)


def _forget_help() -> str:
    """--forget's help: the policies a served memory may use (the scorers that do not run
    the model)."""
    names = ", ".join(servable_policies())
    return (
        f"what a memory over its budget forgets: one of {names} (the registered scorers that "
        "do not run the model; default learned)"
    )


def _run_serve(args) -> int:
    from ..integrations.vllm.server import serve

    extra = list(args.vllm_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    argv = serve(
        args.model,
        args.root,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        vllm_args=extra,
        dry_run=args.dry_run,
        load_failure=args.on_load_failure,
        memories=args.memories,
        memory_max_bytes=args.memory_max_bytes,
        forget=args.forget,
    )
    if args.dry_run:  # serve() printed the command (quoted) to stderr; stdout gets it too
        print(shlex.join(argv))
    return 0


def publish_parser(sub) -> None:
    p = sub.add_parser("publish", help=PUBLISH_SUMMARY)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument(
        "--root",
        type=nonempty("--root"),
        default="published",
        help="the folder kvedit serve serves",
    )
    p.add_argument("--context", required=True, help="a text file with the context (- for stdin)")
    p.add_argument("--question", default=None, help="the question requests ask")
    p.add_argument(
        "--focus",
        default=None,
        metavar="QUESTION",
        help="emphasize the passage QUESTION points at (kvedit.focus); also the question",
    )
    p.add_argument(
        "--guard",
        default=None,
        choices=["support", "none"],
        help="with --focus, the answer guard: support (the default, kvedit.DEFAULT_GUARD: no "
        "edit where the unedited answer already comes from the chosen passage) or none (the "
        "edit always stands)",
    )
    _edit_args(p)
    p.add_argument(
        "--prompt",
        default="auto",
        choices=["auto", "chat", "plain"],
        help="prompt format: chat template or plain text with an answer cue; auto: the "
        "model's registered format (as kvedit eval litm --prompt)",
    )
    p.add_argument(
        "--approximate",
        action="store_true",
        help="allow an edit vLLM's kernels realise only approximately (per-layer focus "
        "strengths, a bias between copy counts); the approximation is labelled in the state's "
        "history and digest",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name in the request (default: --model as given, as kvedit serve does)",
    )
    p.add_argument("--port", type=port, default=8000, help="the server's port, for the curl hint")
    p.add_argument(
        "--max-tokens",
        type=positive("--max-tokens"),
        default=32,
        help="max_tokens of the request (the context must leave room for it)",
    )
    max_positions_arg(p)
    p.add_argument(
        "--request", default=None, metavar="FILE", help="also write the request body to FILE"
    )
    p.set_defaults(run=_run_publish)


def _edit_args(p) -> None:
    """``kvedit publish``'s span edits: what to emphasize, suppress or duplicate, and how much."""
    p.add_argument(
        "--emphasize",
        action="append",
        default=[],
        metavar="TEXT",
        help="a span of the context the model attends to more (repeatable)",
    )
    p.add_argument(
        "--suppress",
        action="append",
        default=[],
        metavar="TEXT",
        help="a span of the context the model does not attend to (repeatable)",
    )
    p.add_argument(
        "--duplicate",
        action="append",
        default=[],
        metavar="TEXT",
        help="a span of the context held again, --copies more times (repeatable)",
    )
    p.add_argument("--strength", type=float, default=2.0, help="--emphasize bias, nats")
    p.add_argument(
        "--suppress-strength",
        type=float,
        default=1e4,
        help="--suppress bias, nats (at least 20: vLLM realises a suppress as a removal)",
    )
    p.add_argument(
        "--copies", type=positive("--copies"), default=3, help="--duplicate extra copies"
    )


def _run_publish(args) -> int:
    import json

    from ..atomic import atomic_write
    from ..errors import InvalidInputError
    from ..evals.litm import resolve_prompt
    from ..focusing.choice import DEFAULT_GUARD
    from ..integrations.vllm.contexts import publish_context
    from ..models import load_model

    for flag, value in (("--question", args.question), ("--focus", args.focus)):
        if value is not None and not value.strip():
            raise InvalidInputError(f"{flag} is empty: give the question requests ask")
    if args.request and args.question is None and args.focus is None:
        raise InvalidInputError("--request needs --question or --focus (a whole prompt)")
    if args.guard is not None and args.focus is None:
        raise InvalidInputError("--guard needs --focus: only focus's edit is guarded")
    context = read_input(args.context, "--context")
    prompt = resolve_prompt(args.prompt, args.model)
    model, tok = load_model(args.model)
    _check_context_length(model, tok, context, args)
    published = publish_context(
        model,
        tok,
        context,
        args.root,
        question=args.question,
        focus_on=args.focus,
        emphasize=args.emphasize,
        suppress=args.suppress,
        duplicate=args.duplicate,
        strength=args.strength,
        suppress_strength=args.suppress_strength,
        copies=args.copies,
        approximate=args.approximate,
        guard=None if args.guard == "none" else DEFAULT_GUARD,
        prompt=prompt,
        served_model_name=args.served_model_name or args.model,
        max_positions=args.max_positions,
    )
    out = published.to_dict()
    if published.prompt_token_ids is not None:
        out["request"] = published.request(args.max_tokens)
        if args.request:
            atomic_write(args.request, json.dumps(out["request"]).encode())
    print(json.dumps(out))
    print(published.report, file=sys.stderr)
    if args.request:
        print(
            f"send: curl -s http://127.0.0.1:{args.port}/v1/completions -H 'Content-Type: "
            f"application/json' -d @{args.request}  (check kv_transfer_params.kvedit.served"
            f" == {published.served})",
            file=sys.stderr,
        )
    return 0


def _check_context_length(model, tok, context: str, args) -> None:
    """Refuse a context the model cannot attend to with the question and the answer after it
    (before the model runs; from the characters alone when they decide it)."""
    from .. import checks

    question = args.focus if args.focus is not None else args.question
    reserve = args.max_tokens if question is not None else 0
    if question:
        reserve += len(tok(question, add_special_tokens=False)["input_ids"])
    what = f"--context {'stdin' if args.context == '-' else args.context}"
    limits = {"reserve": reserve, "max_positions": args.max_positions, "keyword": None}
    checks.context_fits(model, n_chars=len(context), what=what, **limits)
    n_tokens = len(tok(context)["input_ids"])
    checks.context_fits(model, n_tokens=n_tokens, what=what, **limits)
