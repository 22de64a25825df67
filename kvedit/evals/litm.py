"""The lost-in-the-middle evaluation: run methods over examples, score, report.

``kvedit eval litm`` is the command-line front; :func:`run` is the library entry point.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvedit import checks
from kvedit.compat import text_config
from kvedit.errors import InvalidInputError
from kvedit.evals import resuming
from kvedit.evals.engines import VLLM_BATCH, check_engine, run_on_transformers, run_on_vllm
from kvedit.evals.jsonl import load_jsonl
from kvedit.evals.methods import Method, parse_spec, split_specs
from kvedit.evals.methods.context import check_prompt, format_prompt
from kvedit.evals.prompts import PROMPT_FORMATS
from kvedit.evals.report import (
    PLOT_HINT,
    format_table,
    plot_curves,
    plotting_available,
    summarize,
    write_results,
)
from kvedit.evals.schema import Example
from kvedit.evals.tasks import TASKS
from kvedit.models import default_prompt, load_model
from kvedit.version import __version__, source_digest

PROMPT_CHOICES = ("auto", *PROMPT_FORMATS)
"""What ``--prompt`` accepts: a format of :data:`~kvedit.evals.prompts.PROMPT_FORMATS`, or
``"auto"``, the model's own (:func:`kvedit.models.default_prompt`)."""


def resolve_prompt(prompt: str, model_name: str) -> str:
    """The prompt format a run uses: ``prompt``, or for ``"auto"`` the model's default
    (:func:`kvedit.models.default_prompt`: ``chat`` for instruct models, ``plain`` for base
    models)."""
    if prompt not in PROMPT_CHOICES:
        raise InvalidInputError(
            f"unknown prompt format {prompt!r}; choose one of {', '.join(PROMPT_CHOICES)}"
        )
    return default_prompt(model_name) if prompt == "auto" else prompt


def build_examples(
    task: str = "records",
    data: str | None = None,
    n_docs: int | None = None,
    positions: Sequence[int] | None = None,
    trials: int | None = None,
    seed: int = 0,
    limit: int | None = None,
) -> list[Example]:
    """The examples of a registered task (:data:`~kvedit.evals.tasks.TASKS`, each given the
    options as its own keywords), or of a custom JSONL file (``data`` replaces ``task``).

    Raises:
        InvalidInputError: an unknown task (naming the known ones), or options it refuses.
    """
    if data is not None:
        examples = load_jsonl(data)
    else:
        examples = TASKS.lookup(task).examples(
            seed=seed,
            n_docs=n_docs,
            positions=None if positions is None else tuple(positions),
            trials=trials,
        )
    examples = interleave_positions(examples)
    return examples[:limit] if limit is not None else examples


def interleave_positions(examples: Sequence[Example]) -> list[Example]:
    """Order examples round-robin over gold positions (same set, stable within a position), so
    a run that is stopped early, or capped with ``--limit``, still covers every position."""
    by_pos: dict[int, list[Example]] = {}
    for ex in examples:
        by_pos.setdefault(ex.gold_index, []).append(ex)
    queues = [by_pos[p] for p in sorted(by_pos)]
    out: list[Example] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def run(
    model,
    tokenizer,
    examples: Sequence[Example],
    methods: Sequence[str | Method],
    max_new_tokens: int = 32,
    progress: bool = True,
    on_record=None,
    done: dict[tuple[str, str], dict] | None = None,
    prompt: str = "chat",
    engine: str = "transformers",
    batch: int = VLLM_BATCH,
    timings: dict | None = None,
    approximate: bool = False,
) -> list[dict]:
    """Answer every example with every method. Returns one result record per pair.

    Records: ``{"id", "method", "gold_index", "prediction", "correct", "seconds"}``, and
    ``"chosen"`` (document indices) for methods that choose documents (``auto``), with
    ``"kept"`` (whether the edit answered) and ``"support"`` where a guard decided. With the
    ``"plain"`` format, a prediction is the generation's first line
    (:func:`~kvedit.evals.prompts.plain_answer`). ``seconds`` is the method's own time: the
    capture of the documents, shared by every method, is made before. Methods that
    need documents are skipped on examples without any. ``on_record(record)`` is called as each
    one is made (the CLI appends them to ``DIR/partial.jsonl``). Pairs found in ``done``
    (keyed by ``(id, method spec)``) are taken from there instead of recomputed. ``prompt``
    is the prompt format, ``"chat"`` or ``"plain"`` (:func:`~kvedit.evals.methods.split_prompt`).

    ``engine`` decodes the answers (:mod:`kvedit.evals.engines`): ``"transformers"``, or
    ``"vllm"`` (``batch`` examples per vLLM call; records also have ``"exact"``, and
    ``"approximation"`` when the state was served approximately, which only ``approximate``
    allows: see :mod:`kvedit.evals.engines`). ``timings``, if given, receives the engine's own
    timings (``engine_start_seconds``, ``serve_seconds``).
    """
    done = done or {}
    check_prompt(tokenizer, prompt)
    methods = [parse_spec(m) if isinstance(m, str) else m for m in methods]
    if check_engine(engine, methods, batch) == "transformers":
        return run_on_transformers(
            model, tokenizer, examples, methods, max_new_tokens, prompt, done, on_record, progress
        )
    records, spent = run_on_vllm(
        model,
        tokenizer,
        examples,
        methods,
        max_new_tokens,
        prompt,
        done,
        on_record,
        progress,
        batch,
        approximate=approximate,
    )
    if timings is not None:
        timings.update(spent)
    return records


def evaluate(
    model_name: str,
    methods: Sequence[str],
    out: str | Path,
    task: str = "records",
    data: str | None = None,
    n_docs: int | None = None,
    positions: Sequence[int] | None = None,
    trials: int | None = None,
    seed: int = 0,
    limit: int | None = None,
    max_new_tokens: int = 32,
    progress: bool = True,
    resume: bool = False,
    reuse: str | Path | None = None,
    reuse_methods: Sequence[str] | None = None,
    prompt: str = "auto",
    engine: str = "transformers",
    batch: int = VLLM_BATCH,
    approximate: bool = False,
    reuse_unchecked: bool = False,
    max_positions: int | None = None,
) -> dict:
    """Load a model, run the suite, write ``results.json`` and ``curve.png``; return the summary.

    With ``resume``, results already in ``DIR/partial.jsonl`` (from an interrupted run with the same
    settings, checked against ``DIR/partial.settings.json``: see
    :func:`kvedit.evals.resuming.resumable`) are kept and only the missing (example, method) pairs
    are computed. With ``reuse`` (an earlier run's ``results.json`` of the same model, task, seed
    and prompt format; ValueError otherwise), that run's answers are taken for the methods it ran
    with the same parameters (see :func:`kvedit.evals.jsonl.reused_records`): all of them when that
    run ran the same kvedit source (:func:`~kvedit.version.source_digest`, recorded as
    ``extra["kvedit"]``), else only the specs named in ``reuse_methods`` (an
    :class:`~kvedit.errors.InvalidInputError` when none is named: the caller says which answers the
    code change left alone). Answers are deterministic, so such a run writes what a full run would;
    ``extra["reused"]`` records the file and the methods taken from it. ``resume`` is refused across
    a change of source. ``prompt`` is ``"chat"``, ``"plain"`` or ``"auto"`` (the model's default,
    :func:`resolve_prompt`); the format used is recorded as ``extra["prompt"]``. ``engine`` decodes
    the answers (``"transformers"`` or ``"vllm"``, :mod:`kvedit.evals.engines`; recorded as
    ``extra["engine"]``, with the engine's timings and ``seconds_per_example``); ``--resume`` and
    ``--reuse`` never mix engines. Every record names its example's
    :meth:`~kvedit.evals.schema.Example.digest`, and a record is taken only for the same id *and*
    digest (:func:`kvedit.evals.jsonl.matching_records`): an earlier run with other ``n_docs``,
    ``trials``, ``limit`` or ``data`` asked other prompts under the same ids, and is refused. A
    ``reuse`` file made before records had digests is refused too, unless ``reuse_unchecked`` takes
    its answers by id (the caller vouches for the examples; ``extra["reused"]["unchecked"]``).
    ``approximate`` (vLLM only): serve states vLLM realises only approximately, labelled in each
    record and in the summary's ``exact_share`` (recorded as ``extra["approximate"]``).
    ``max_positions`` overrides the model config's maximum positions (the CLI's
    ``--max-positions``): the run's own model (loaded here, never shared) gets it as its text
    config's ``max_position_embeddings``, so every capture and check of the run reads it.
    """
    _check_specs(methods, "--methods", reuse_methods)
    check_engine(engine, [parse_spec(spec) for spec in methods], batch)  # before loading
    prompt = resolve_prompt(prompt, model_name)
    examples = build_examples(task, data, n_docs, positions, trials, seed, limit)
    task_name = f"data:{Path(data).name}" if data else task
    params = {spec: json.loads(json.dumps(parse_spec(spec).param_dict())) for spec in methods}
    code = {"version": __version__, "source": source_digest()}
    settings = {
        "model": model_name,
        "task": task_name,
        "seed": seed,
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
        "engine": engine,
        "params": params,
        "source": code["source"],
    }
    reused = resuming.reused(reuse, reuse_methods, reuse_unchecked, settings, examples)
    out = Path(out)
    done = resuming.resumed(out, settings, examples) if resume else {}
    model, tokenizer = load_model(model_name)
    if max_positions is not None:  # this run's own model object: nothing else sees it
        text_config(model).max_position_embeddings = max_positions
    check_prompt(tokenizer, prompt)  # before anything is written
    check_lengths(model, tokenizer, examples, prompt, max_positions=max_positions)
    partial, settings_path = resuming.start_partial(out, settings, done)
    done = {**reused, **done}
    keep = _appender(partial)
    t0 = time.perf_counter()
    timings: dict = {}
    records = run(
        model,
        tokenizer,
        examples,
        methods,
        max_new_tokens,
        progress,
        keep,
        done,
        prompt,
        engine=engine,
        batch=batch,
        timings=timings,
        approximate=approximate,
    )
    seconds = time.perf_counter() - t0
    summary = summarize(records)
    extra = _run_extra(settings, code, len(examples), seconds, timings)
    if reuse is not None:
        methods_reused = sorted({method for _, method in reused})
        extra["reused"] = {"from": str(reuse), "methods": methods_reused}
        extra["reused"]["unchecked"] = bool(reuse_unchecked)
    if engine == "vllm":
        extra.update(batch=batch, approximate=bool(approximate))
    write_results(out, model_name, task_name, records, extra=extra)
    _plot(summary, out / "curve.png", f"{model_name}: {task_name}")
    partial.unlink()
    settings_path.unlink(missing_ok=True)
    return summary


def _appender(partial: Path):
    """A function that appends one record to ``partial`` (JSON lines) as it is answered."""

    def keep(record: dict) -> None:
        with open(partial, "a") as f:
            f.write(json.dumps(record) + "\n")

    return keep


def _run_extra(settings: dict, code: dict, n: int, seconds: float, timings: dict) -> dict:
    """What ``results.json`` records of a run beside its records: its settings, timing (per
    example; with vLLM the engine's timings and the time per example after its start) and
    the kvedit source that ran it."""
    extra = {
        "seed": settings["seed"],
        "n_examples": n,
        "max_new_tokens": settings["max_new_tokens"],
        "prompt": settings["prompt"],
        "engine": settings["engine"],
        "seconds": round(seconds, 1),
        "seconds_per_example": round(seconds / max(1, n), 3),
        "params": settings["params"],
        "kvedit": code,
    }
    if settings["engine"] == "vllm":
        extra.update(timings)
        warm = seconds - timings.get("engine_start_seconds", 0.0)
        extra["seconds_per_example_after_start"] = round(warm / max(1, n), 3)
    return extra


def _plot(summary: dict, path: Path, title: str) -> None:
    """Draw ``path``; without Matplotlib, skip it with a note on stderr (the results are
    written by then: a missing plotting library must not lose an hour's run)."""
    if plotting_available():
        plot_curves(summary, path, title=title)
    else:
        path.unlink(missing_ok=True)  # an earlier run's, not this one's
        print(f"note: {path} not drawn: {PLOT_HINT}", file=sys.stderr)


def check_lengths(
    model,
    tokenizer,
    examples: Sequence[Example],
    prompt: str,
    *,
    max_positions: int | None = None,
) -> None:
    """Refuse a run with an example whose full prompt (format ``prompt``) is longer than
    ``model`` attends to (:func:`kvedit.checks.context_fits`; ``max_positions`` overrides the
    model config's maximum), before any answer is computed.

    Raises:
        InvalidInputError: naming the example, its length and the limit (``--max-positions``
            overrides it).
    """
    for example in examples:
        text = format_prompt(tokenizer, example.user_message(), prompt)
        what = f"prompt of example {example.id!r}"
        limits = {"max_positions": max_positions, "what": what, "keyword": None}
        checks.context_fits(model, n_chars=len(text), **limits)
        n_tokens = len(tokenizer(text)["input_ids"])
        checks.context_fits(model, n_tokens=n_tokens, **limits)


def _check_specs(specs: Sequence[str], option: str, reuse_methods=None) -> None:
    """Refuse an empty list of method specs or one that names a method twice (and the same of
    ``reuse_methods``, when given)."""
    if reuse_methods is not None:
        _check_specs(reuse_methods, "--reuse-methods")
    if not specs:
        raise InvalidInputError(f"{option} names no method (give comma-separated specs: none,auto)")
    seen = set()
    for spec in specs:
        if spec in seen:
            raise InvalidInputError(f"{option} names {spec!r} twice")
        seen.add(spec)


def main(args) -> int:
    summary = evaluate(
        model_name=args.model,
        methods=split_specs(args.methods),
        out=args.out,
        task=args.task,
        data=args.data,
        n_docs=args.n_docs,
        positions=[int(p) for p in args.positions.split(",")] if args.positions else None,
        trials=args.trials,
        seed=args.seed,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        progress=not args.no_progress,
        resume=getattr(args, "resume", False),
        reuse=getattr(args, "reuse", None),
        reuse_methods=split_specs(args.reuse_methods)
        if getattr(args, "reuse_methods", None)
        else None,
        prompt=getattr(args, "prompt", "auto"),
        engine=getattr(args, "engine", "transformers"),
        batch=getattr(args, "batch", VLLM_BATCH),
        approximate=getattr(args, "approximate", False),
        reuse_unchecked=getattr(args, "reuse_unchecked", False),
        max_positions=getattr(args, "max_positions", None),
    )
    print(format_table(summary))
    print(f"results: {Path(args.out) / 'results.json'}")
    if plotting_available():
        print(f"plot:    {Path(args.out) / 'curve.png'}")
    return 0
