"""The memory suite (``kvedit eval memory``): what a :class:`kvedit.Memory` that forgets under a
budget still answers, by the age of what is asked.

Tasks (:data:`TASKS`): ``facts`` (:mod:`kvedit.evals.tasks.memory_facts`: facts stated across
a long chat, each asked with ``remember=False``) and ``nq-shared``
(:mod:`kvedit.evals.tasks.memory_nq`: NQ passages as tool messages, SCBench's multi-request
mode, the questions asked one after another and kept). Each question has a bucket, the third of
the conversation its answer sits in (``early``, ``middle``, ``late``).

``--conversations FILE`` runs instead on the conversations of a file
(:mod:`kvedit.evals.conversation_files`: dated sessions of turns between named speakers, and
questions with gold answers, evidence turns and categories); the task is then
:data:`FILE_TASK`, a question's bucket is the third of the turns its oldest evidence turn sits
in, and the summary adds exact match and token F1 (SQuAD's), by category and by the age of the
evidence in tokens (:mod:`kvedit.evals.conversation_scores`).

Methods are specs in the ``name:key=value`` grammar (:func:`parse_memory_spec`; the names:
:func:`memory_methods`):

================  ==============================================================================
``reuse``         the memory keeps everything (budget 1.0 only)
a policy          ``Memory(forget=NAME)`` for every registered scorer
                  (:func:`kvedit.memory.forgetting.policies`: ``window``, the newest entries kept;
                  ``knorm``, ``tova``, ``snapkv``, ``h2o``, ``reconstruct``, ``kvzip``,
                  ``learned``...), forgetting what the memory does not protect (the first tokens,
                  the system message, the last ``recent_tokens`` tokens)
``snapkv-first``  the whole conversation kept, compressed once with
                  ``kvedit.compress.select(state, SnapKV(query=first question), budget)`` when the
                  first question is asked, that state then reused for every question
================  ==============================================================================

Parameters: ``budget`` (in (0, 1]: the method runs at that budget only; without it, at every
``--budgets`` value); ``recent``, ``recent_tokens`` and ``per_head`` (the memory's keywords;
its defaults where not given); ``in_bytes`` (the budget counts bytes: ``max_bytes`` that
fraction of what a memory forgetting nothing allocates, instead of ``max_tokens``); and
``quantize`` (2, 4 or 8: ``Memory(quantize=)``, the messages before the last ``recent`` held in
that many bits; for ``snapkv-first``, the compressed state quantized but for its last input,
:func:`kvedit.compress.quantize`). A method with ``quantize`` runs at budget 1.0 too (nothing
forgotten, the older messages quantized), so it is not ``reuse`` there.

The budget is a fraction of the conversation's global-layer entries when the first question is
asked (:func:`full_entries`, the rendering's tokens): the memory is made with
``max_tokens = max(1, round(budget * entries))`` from its first message, so it forgets as the
conversation grows. At budget 1.0 every method without ``quantize`` is ``reuse`` (nothing is
forgotten): it is computed once and its records say ``"as": "reuse"``. Re-reading the whole
transcript at every turn answers exactly as ``reuse``; it is only timed, on the first few turns
of the first conversation (``extra.reread``).

Records (one per question, method and budget): ``id``, ``example``, ``digest``, ``method``,
``budget``, ``bucket``, ``where`` (the index of what the question asks about), ``question``,
``answers``, ``prediction``, ``correct``, ``seconds`` (the answer, with any forgetting it
makes), ``max_entries`` (the budget in entries, None at 1.0 and with ``in_bytes``; for
``snapkv-first`` the entries each KV head keeps), ``max_bytes`` (the memory's byte budget, None
without one), ``entries`` (the global-layer entries the memory held when the question was
asked; for ``snapkv-first`` the union of the entries any head keeps,
:mod:`kvedit.compress.selection`, so above ``max_entries`` when heads disagree),
``entries_per_layer`` (each global layer's, per KV head on average), ``nbytes`` (the bytes
the memory held), ``own_entries_fraction`` and ``own_bytes_fraction`` (what the memory held
as a fraction of the entries and bytes of the model's own cache for its tokens, sliding windows
as the model holds them: :mod:`kvedit.memory.footprint`; comparable across families and with
kvpress where the budget's fraction of the global entries is not), ``full_entries``, ``rounds`` and ``forget_seconds`` (the forgetting rounds the
memory kept so far, and their seconds) and ``build_seconds`` (adding the messages, rounds
included); and ``em``, ``f1`` (exact match and token F1, normalised as SQuAD does),
``category``, ``evidence``, ``age_turns`` and ``age_tokens`` (the turns, and the rendering's
tokens, after its oldest evidence turn; None without evidence and for the generated tasks).
A question asked with ``remember=False`` may forget to make room for itself; that round is not
kept (the memory is left as it was), so its cost is in ``seconds`` only.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from kvedit.atomic import atomic_write
from kvedit.errors import InvalidInputError
from kvedit.evals.conversation_files import FILE_TASK, load_conversations
from kvedit.evals.conversation_scores import add_file_scores, format_file_tables
from kvedit.evals.jsonl import PartialRecords, read_json, read_numbered_records
from kvedit.evals.memory_answers import REREAD_TURNS, default_renderer, run_conversation
from kvedit.evals.memory_report import (
    check_memory_record,
    format_memory_table,
    plot_memory,
    reread_summary,
    summarize_memory,
)
from kvedit.evals.memory_specs import (
    MEMORY_RESULTS,
    TASKS,
    MemoryMethod,
    MemoryParams,
    build_conversations,
    check_budgets_fit,
    check_model_serves,
    full_entries,
    memory_methods,
    parse_budgets,
    parse_memory_spec,
)
from kvedit.evals.methods.params import to_dict
from kvedit.evals.methods.registry import split_specs
from kvedit.evals.report import PLOT_HINT, plotting_available
from kvedit.evals.tasks.memory_schema import Conversation

__all__ = [
    "memory_methods",
    "MEMORY_RESULTS",
    "REREAD_TURNS",
    "TASKS",
    "MemoryMethod",
    "MemoryParams",
    "build_conversations",
    "evaluate",
    "format_memory_table",
    "full_entries",
    "parse_budgets",
    "parse_memory_spec",
    "plot_memory",
    "resumed_records",
    "run_settings",
    "run_conversation",
    "summarize_memory",
]

# ---------------------------------------------------------------------------------- the run


def run_settings(
    model_name: str,
    task: str,
    methods: Sequence[MemoryMethod],
    budgets: Sequence[float],
    **sizes: int | None,
) -> dict:
    """What ``partial.settings.json`` records of a run, and ``--resume`` compares: the model,
    the task, ``sizes`` (``seed``, ``n_examples``, ``size``, ``questions``,
    ``max_new_tokens``), the methods (their specs, sorted), the budgets (descending), each
    method's parameters as they resolved, and kvedit's source."""
    from kvedit.version import source_digest

    return {
        "model": model_name,
        "task": task,
        **sizes,
        "methods": sorted(m.spec for m in methods),
        "budgets": sorted((float(b) for b in budgets), reverse=True),
        "params": {m.spec: to_dict(m.params) for m in methods},
        "source": source_digest(),
    }


def resumed_records(
    out: Path,
    settings: dict,
    conversations: Sequence[Conversation],
    asked: Collection[tuple[str, float]],
) -> list[dict]:
    """The records ``--resume`` keeps from ``out/partial.jsonl``: those of the same settings
    (``partial.settings.json``, :func:`run_settings`: the same methods and budgets included)
    and of a conversation with the same digest. ``asked``: the ``(method spec, budget)`` pairs
    this run computes; a record of any other is refused, never reported.

    Raises:
        InvalidInputError: naming the file (and the line): settings missing or of another run
            (what differs), a line that is not a whole memory record
            (:func:`check_memory_record`) or a record of a method or budget not asked.
    """
    partial = out / "partial.jsonl"
    if not partial.exists():
        return []
    _check_resumed_settings(partial, out / "partial.settings.json", settings)
    digests = {c.id: c.digest() for c in conversations}
    sizes = {c.id: len(c.probes) for c in conversations}
    records = []
    for line, r in read_numbered_records(partial, "--resume"):
        check_memory_record(r, f"--resume {partial}:{line}")
        if (r["method"], float(r["budget"])) not in asked:
            raise InvalidInputError(
                f"--resume {partial}:{line}: a record of method {r['method']!r} at budget "
                f"{r['budget']!r}, which this run does not ask (methods "
                f"{', '.join(settings['methods'])}); the file was edited: delete it or pass "
                "--overwrite"
            )
        records.append(r)
    kept = [r for r in records if digests.get(r["example"]) == r["digest"]]
    groups: dict[tuple, list[dict]] = {}
    for r in kept:  # a conversation's records are kept whole or not at all
        groups.setdefault((r["example"], r["method"], float(r["budget"])), []).append(r)
    return [r for key, rs in groups.items() if len(rs) == sizes[key[0]] for r in rs]


def _check_resumed_settings(partial: Path, settings_path: Path, settings: dict) -> None:
    """Refuse ``settings_path`` missing, lacking a key of ``settings`` or differing from it
    (naming each key that differs: methods, budgets, parameters...)."""
    if not settings_path.exists():
        raise InvalidInputError(
            f"--resume: {partial} has no {settings_path.name}, so the run it came from cannot "
            "be checked; delete it or run without --resume"
        )
    theirs = read_json(settings_path, "--resume")
    missing = [k for k in settings if k not in theirs]
    if missing:
        raise InvalidInputError(
            f"--resume {settings_path}: it lacks {', '.join(missing)}, so it is not the settings "
            "of this kvedit's eval memory run; pass --overwrite to start again"
        )
    keys = [k for k, v in settings.items() if theirs.get(k) != v]
    if "methods" in keys:  # their parameters differ too: the methods say it
        keys.remove("params")
    differ = [f"{k} {theirs.get(k)!r} (now {settings[k]!r})" for k in keys]
    if differ:
        raise InvalidInputError(
            f"--resume: {partial} came from another run: " + ", ".join(differ) + "; run it "
            "with its settings, or pass --overwrite to start again"
        )


def _pairs(
    methods: Sequence[MemoryMethod], budgets: Sequence[float]
) -> list[tuple[MemoryMethod, float]]:
    return [(m, b) for m in methods for b in m.budgets(budgets)]


def _records(
    model,
    tokenizer,
    conv: Conversation,
    method: MemoryMethod,
    budget: float,
    shared: dict[str, list[dict]],
    task: str,
    max_new_tokens: int,
    reread: list[dict] | None,
) -> list[dict]:
    """The records of ``method`` at ``budget`` on ``conv``; at budget 1 a method other than
    ``reuse`` without ``quantize`` is ``reuse`` (computed once per conversation, kept in
    ``shared``, and labelled ``"as": "reuse"``). ``reread`` is passed to the ``reuse`` run (:func:`run_conversation`)."""
    if budget >= 1 and method.name != "reuse" and method.params.quantize is None:
        if "reuse" not in shared:
            reuse = parse_memory_spec("reuse")
            shared["reuse"] = run_conversation(
                model, tokenizer, conv, reuse, 1.0, task=task, max_new_tokens=max_new_tokens
            )
        return [{**r, "method": method.spec, "as": "reuse"} for r in shared["reuse"]]
    new = run_conversation(
        model,
        tokenizer,
        conv,
        method,
        budget,
        task=task,
        max_new_tokens=max_new_tokens,
        reread=reread if method.name == "reuse" and method.params.quantize is None else None,
    )
    if method.name == "reuse" and method.params.quantize is None:
        shared["reuse"] = new
    return new


def _parse_methods(methods: Sequence[str]) -> list[MemoryMethod]:
    parsed = [parse_memory_spec(s) for s in methods]
    if not parsed:
        raise InvalidInputError("--methods names no method")
    if len({m.spec for m in parsed}) != len(parsed):
        raise InvalidInputError("--methods names a method twice")
    return parsed


def _conversations(
    task: str, sizes: dict, path: str | Path | None, speakers: str
) -> tuple[list[Conversation], dict]:
    """The conversations of the run and what the settings record of them: the registered task's
    for ``sizes`` (``seed``, ``n_examples``, ``size``, ``questions``), or those of the
    conversation file at ``path`` (its path and ``speakers``; ``task`` must be
    :data:`FILE_TASK` and the sizes unset but the defaults).

    Raises:
        InvalidInputError: a task other than :data:`FILE_TASK` with a file, or a file task
            without one.
        InvalidExampleError: a malformed file (:func:`load_conversations`).
    """
    if path is None:
        if task == FILE_TASK:
            raise InvalidInputError(
                f"task {FILE_TASK!r} needs a conversation file (--conversations)"
            )
        return build_conversations(task, **sizes), sizes
    if task != FILE_TASK:
        raise InvalidInputError(
            f"--conversations {path} runs the file's conversations, not task {task!r}: leave "
            "--task out"
        )
    return load_conversations(path, speakers), {"conversations": str(path), "speakers": speakers}


def evaluate(
    model_name: str,
    task: str,
    methods: Sequence[str],
    budgets: Sequence[float],
    out: str | Path,
    *,
    n_examples: int = 10,
    seed: int = 0,
    size: int | None = None,
    questions: int | None = None,
    max_new_tokens: int = 16,
    resume: bool = False,
    progress: Callable[[str], None] | None = None,
    conversations: str | Path | None = None,
    speakers: str = "user",
) -> dict:
    """Run the suite and write ``out/results.json`` and ``out/curve.png`` (skipped with a
    note without Matplotlib); return the summary (:func:`summarize_memory`).

    Records are appended to ``out/partial.jsonl`` as each conversation is done (its settings in
    ``partial.settings.json``); ``resume`` keeps those of an interrupted run with the same
    settings and computes the rest. Arguments are checked before the model loads, and each
    policy against what the model's configuration rules out (:func:`check_model_serves`), each
    method's budget against what its memories never forget (:func:`check_budgets_fit`) once
    the tokenizer is there: a refusal writes nothing (the partial files are written with the
    first records).

    ``conversations``: a conversation file (:mod:`kvedit.evals.conversation_files`, its turns
    rendered by ``speakers``) to run on instead of generated ones; ``task`` is then
    :data:`FILE_TASK`, and the summary adds exact match and token F1, by category and by the
    age of the evidence (:func:`~kvedit.evals.conversation_scores.add_file_scores`).
    """
    from kvedit.models import load_model
    from kvedit.version import __version__

    parsed = _parse_methods(methods)
    budgets = parse_budgets(",".join(str(b) for b in budgets))
    sizes = {"seed": seed, "n_examples": n_examples, "size": size, "questions": questions}
    convs, sizes = _conversations(task, sizes, conversations, speakers)
    settings = run_settings(
        model_name, task, parsed, budgets, **sizes, max_new_tokens=max_new_tokens
    )
    out = Path(out)
    asked = {(m.spec, b) for m, b in _pairs(parsed, budgets)}
    done = resumed_records(out, settings, convs, asked) if resume else []
    check_model_serves(model_name, parsed)  # what the model's configuration rules out
    model, tokenizer = load_model(model_name)
    check_budgets_fit(
        default_renderer(tokenizer), convs, _pairs(parsed, budgets), task, max_new_tokens
    )
    partial = PartialRecords(out, settings, done)  # written with the first records
    have = {(r["example"], r["method"], float(r["budget"])) for r in done}
    records = list(done)
    reread: list[dict] = []
    t0 = time.perf_counter()
    for i, conv in enumerate(convs):
        shared: dict[str, list[dict]] = {}  # the conversation's reuse records, once made
        for method, budget in _pairs(parsed, budgets):
            if (conv.id, method.spec, budget) in have:
                continue
            timed = reread if i == 0 else None
            new = _records(
                model, tokenizer, conv, method, budget, shared, task, max_new_tokens, timed
            )
            partial.add(new)
            records += new
            if progress is not None:
                acc = sum(r["correct"] for r in new) / len(new)
                progress(f"{conv.id} {method.spec} @{budget:g}: {acc:.2f}")
    summary = summarize_memory(records)
    if task == FILE_TASK:
        add_file_scores(summary, records)
    extra = {
        **sizes,
        "budgets": budgets,
        "max_new_tokens": max_new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "params": {m.spec: to_dict(m.params) for m in parsed},
        "reread": reread_summary(reread),
        "kvedit": {"version": __version__, "source": settings["source"]},
    }
    payload = {"model": model_name, "task": task, "methods": summary, "examples": records}
    _write_results(out, {**payload, "extra": extra})
    partial.remove()
    return summary


def _write_results(out: Path, payload: dict) -> None:
    """``out/results.json`` and ``out/curve.png`` (a note instead without Matplotlib)."""
    atomic_write(out / "results.json", json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    if plotting_available():
        title = f"{payload['model']}: memory {payload['task']}"
        plot_memory(payload["methods"], out / "curve.png", title)
    else:
        (out / "curve.png").unlink(missing_ok=True)
        print(f"note: {out / 'curve.png'} not drawn: {PLOT_HINT}", file=sys.stderr)


def main(args) -> int:
    """``kvedit eval memory`` after its checks (:mod:`kvedit.cli.memory`)."""
    file = getattr(args, "conversations", None)
    summary = evaluate(
        model_name=args.model,
        task=FILE_TASK if file is not None else args.task,
        methods=split_specs(args.methods),
        budgets=parse_budgets(args.budgets),
        out=args.out,
        n_examples=args.n_examples,
        seed=args.seed,
        size=args.size,
        questions=args.questions,
        max_new_tokens=args.max_new_tokens,
        resume=args.resume,
        progress=None if args.no_progress else (lambda line: print(line, file=sys.stderr)),
        conversations=file,
        speakers=getattr(args, "speakers", "user"),
    )
    print(format_memory_table(summary))
    if file is not None:
        print()
        print(format_file_tables(summary))
    print(f"results: {Path(args.out) / 'results.json'}")
    if plotting_available():
        print(f"plot:    {Path(args.out) / 'curve.png'}")
    return 0
