"""The ``kvedit`` command line: ``kvedit demo``, ``kvedit eval litm``, ``kvedit app``,
``kvedit publish`` and ``kvedit serve`` (vLLM)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shlex
import sys
from pathlib import Path
from types import ModuleType

# The highlight app's source is apps/highlight/ in the repository. The wheel installs apps/ as
# the package kvedit_apps (pyproject.toml: package-dir); a checkout has it next to kvedit/.
_APP_MODULE = "kvedit_apps.highlight"
_CHECKOUT_APPS = Path(__file__).resolve().parent.parent / "apps"


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


def _litm_parser(sub) -> None:
    from .evals.engines import ENGINES, VLLM_BATCH

    p = sub.add_parser(
        "litm",
        help="lost-in-the-middle accuracy by gold position",
        epilog=_LITM_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", default="records", choices=["records", "nq"])
    p.add_argument("--data", default=None, help="custom JSONL examples (replaces --task)")
    p.add_argument("--methods", default="none,auto,oracle", help="comma-separated method specs")
    p.add_argument("--n-docs", type=int, default=None, help="documents per prompt")
    p.add_argument("--positions", default=None, help="gold positions, e.g. 0,5,10")
    p.add_argument("--trials", type=int, default=None, help="examples per position")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--prompt",
        default="auto",
        choices=["auto", "chat", "plain"],
        help="prompt format: chat template or plain text with an answer cue; auto: the "
        "model's registered format (see below)",
    )
    p.add_argument("--out", default="runs/litm")
    p.add_argument("--limit", type=int, default=None, help="cap on the number of examples")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--engine",
        default="transformers",
        choices=list(ENGINES),
        help="what decodes the answers: kvedit on the Hugging Face model, or vLLM serving "
        "each method's published cache (methods none, oracle, auto, reread; needs "
        "kvedit[vllm])",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=VLLM_BATCH,
        help=f"--engine vllm: examples whose prompts vLLM answers in one batch (default "
        f"{VLLM_BATCH}; ignored by --engine transformers)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--resume", action="store_true", help="keep results in DIR/partial.jsonl, compute the rest"
    )
    p.add_argument(
        "--reuse",
        default=None,
        metavar="RESULTS_JSON",
        help="take (example, method) results from an earlier run's results.json (same model, "
        "task, seed and prompt format) instead of recomputing them: to add methods to a "
        "finished run",
    )
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
        prompt="auto",
    )
    print(
        f"kvedit demo: lost in the middle on {args.model}: 20 records, the gold record at "
        f"positions 0/5/10/15/19, {args.trials} trials each; methods none, auto, oracle."
    )
    return main(ns)


def _load_app() -> ModuleType:
    """The highlight app: the installed ``kvedit_apps.highlight``, else ``apps/`` of this checkout.

    From a checkout (kvedit imported from the repository, the app not installed) the ``apps/``
    folder next to ``kvedit/`` is imported under the installed name, ``kvedit_apps``.
    """
    try:
        return importlib.import_module(_APP_MODULE)
    except ModuleNotFoundError as e:
        if e.name not in ("kvedit_apps", _APP_MODULE):
            raise  # a dependency of the app is missing
    init = _CHECKOUT_APPS / "__init__.py"
    if not (init.is_file() and (_CHECKOUT_APPS / "highlight" / "__init__.py").is_file()):
        raise SystemExit(
            f"kvedit app: neither {_APP_MODULE} (installed with kvedit) nor {_CHECKOUT_APPS} "
            "(a kvedit checkout) was found; reinstall kvedit: pip install 'kvedit[app]'"
        )
    spec = importlib.util.spec_from_file_location(
        "kvedit_apps", init, submodule_search_locations=[str(_CHECKOUT_APPS)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(_APP_MODULE)


def _run_app(args) -> int:
    try:
        import gradio  # noqa: F401
    except ModuleNotFoundError:
        raise SystemExit(
            "kvedit app needs Gradio: pip install 'kvedit[app]' (in a checkout: make setup)"
        ) from None
    _load_app().serve(args.model, args.host, args.port)
    return 0


_SERVE_EPILOG = """\
Further arguments after -- go to vLLM's server as they are, e.g.
  kvedit serve --root published/ -- --max-model-len 8192 --tensor-parallel-size 2
Then publish contexts into the same root (kvedit publish) and POST their token ids to
http://HOST:PORT/v1/completions. Needs kvedit[vllm]; in a checkout: make vllm-setup, then
.venv-vllm/bin/kvedit serve ...
"""


def _serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server, answering from the caches published under ROOT",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument("--root", default="published", help="the folder kvedit publish writes to")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: this machine)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name requests give (default: --model as given, as kvedit publish uses)",
    )
    p.add_argument(
        "--on-load-failure",
        default="fail",
        choices=["fail", "recompute"],
        help="a published cache a worker cannot load: end the request with an error (default), "
        "or let vLLM compute the prompt (the right answer only for unedited caches)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command, do not run it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(run=_run_serve)


def _run_serve(args) -> int:
    from .integrations.vllm.server import serve

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
    )
    if args.dry_run:  # serve() printed the command (quoted) to stderr; stdout gets it too
        print(shlex.join(argv))
    return 0


def _publish_parser(sub) -> None:
    p = sub.add_parser(
        "publish",
        help="capture a context, edit it, publish it for kvedit serve; prints what to send",
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument("--root", default="published", help="the folder kvedit serve serves")
    p.add_argument("--context", required=True, help="a text file with the context (- for stdin)")
    p.add_argument("--question", default=None, help="the question requests ask")
    p.add_argument(
        "--focus",
        default=None,
        metavar="QUESTION",
        help="emphasize the passage QUESTION points at (kvedit.focus); also the question",
    )
    p.add_argument("--emphasize", action="append", default=[], metavar="TEXT")
    p.add_argument("--suppress", action="append", default=[], metavar="TEXT")
    p.add_argument("--duplicate", action="append", default=[], metavar="TEXT")
    p.add_argument("--strength", type=float, default=2.0, help="--emphasize bias, nats")
    p.add_argument(
        "--suppress-strength",
        type=float,
        default=1e4,
        help="--suppress bias, nats (at least 20: vLLM realises a suppress as a removal)",
    )
    p.add_argument("--copies", type=int, default=3, help="--duplicate extra copies")
    p.add_argument("--prompt", default="auto", choices=["auto", "chat", "plain"])
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name in the request (default: --model as given, as kvedit serve does)",
    )
    p.add_argument("--port", type=int, default=8000, help="the server's port, for the curl hint")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of the request")
    p.add_argument(
        "--request", default=None, metavar="FILE", help="also write the request body to FILE"
    )
    p.set_defaults(run=_run_publish)


def _run_publish(args) -> int:
    import json

    from .atomic import atomic_write
    from .errors import InvalidInputError
    from .evals.litm import resolve_prompt
    from .integrations.vllm.contexts import publish_context
    from .models import load_model

    if args.request and args.question is None and args.focus is None:
        raise InvalidInputError("--request needs --question or --focus (a whole prompt)")
    path = args.context
    context = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    prompt = resolve_prompt(args.prompt, args.model)
    model, tok = load_model(args.model)
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
        prompt=prompt,
        served_model_name=args.served_model_name or args.model,
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
    from .evals.project import add_parser as _project_parser

    _project_parser(ev_sub)
    app = sub.add_parser("app", help="the highlight app (Gradio) on http://HOST:PORT")
    app.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    app.add_argument("--port", type=int, default=7860)
    app.add_argument(
        "--host", default="127.0.0.1", help="interface to bind (default: this machine only)"
    )
    app.set_defaults(run=_run_app)
    _publish_parser(sub)
    _serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
