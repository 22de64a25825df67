"""The memory suite (``kvedit eval memory``): what a :class:`kvedit.Memory` that forgets under a
budget still answers, by the age of what is asked.

Tasks (:data:`TASKS`): ``facts`` (:mod:`kvedit.evals.tasks.memory_facts`: facts stated across
a long chat, each asked with ``remember=False``) and ``nq-shared``
(:mod:`kvedit.evals.tasks.memory_nq`: NQ passages as tool messages, SCBench's multi-request
mode, the questions asked one after another and kept). Each question has a bucket, the third of
the conversation its answer sits in (``early``, ``middle``, ``late``).

Methods are specs in the ``name:key=value`` grammar (:func:`parse_memory_spec`):

================  ==============================================================================
``reuse``         the memory keeps everything (budget 1.0 only)
``window``        ``Memory(forget="window")``: the newest entries kept (with sinks, system
                  message, the last ``recent`` messages)
``knorm``         ``Memory(forget="knorm")``, and likewise ``tova``, ``snapkv``, ``h2o`` and
``reconstruct``   ``reconstruct`` (refused while its scorer is not registered)
``snapkv-first``  the whole conversation kept, compressed once with
                  ``kvedit.compress.select(state, SnapKV(query=first question), budget)`` when the
                  first question is asked, that state then reused for every question
================  ==============================================================================

Parameters: ``budget`` (in (0, 1]: the method runs at that budget only; without it, at every
``--budgets`` value), ``recent`` (the memory's ``recent``; default 2 for ``facts``, 1 for
``nq-shared`` so that one document message fits the smallest budgets) and ``quantize``
(refused: :class:`kvedit.Memory` has no quantize option yet).

The budget is a fraction of the conversation's global-layer entries when the first question is
asked (:func:`full_entries`, the rendering's tokens): the memory is made with
``max_tokens = round(budget * entries)`` from its first message, so it forgets as the
conversation grows. At budget 1.0 every method is ``reuse`` (nothing is forgotten): it is
computed once and its records say ``"as": "reuse"``. Re-reading the whole transcript at every
turn answers exactly as ``reuse``; it is only timed, on the first few turns of the first
conversation (``extra.reread``).

Records (one per question, method and budget): ``id``, ``example``, ``digest``, ``method``,
``budget``, ``bucket``, ``question``, ``answers``, ``prediction``, ``correct``, ``seconds`` (the
answer, with any forgetting it makes), ``max_entries`` (the budget in entries, None without),
``entries`` (what the memory held when the question was asked), ``full_entries``, ``rounds``
and ``forget_seconds`` (the forgetting rounds the memory kept so far, and their seconds) and
``build_seconds`` (adding the messages, rounds included). A question asked with
``remember=False`` may forget to make room for itself; that round is not kept (the memory is
left as it was), so its cost is in ``seconds`` only.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvedit.atomic import atomic_write
from kvedit.errors import InvalidInputError, KVEditError
from kvedit.evals.jsonl import read_json, read_records
from kvedit.evals.methods.params import check_count, check_fraction, from_text, to_dict
from kvedit.evals.methods.registry import split_specs
from kvedit.evals.metrics import best_subspan_em, bootstrap_ci
from kvedit.evals.report import PLOT_HINT, plotting_available
from kvedit.evals.tasks.memory_facts import facts_examples
from kvedit.evals.tasks.memory_nq import nq_shared_examples
from kvedit.evals.tasks.memory_schema import BUCKETS, Conversation

__all__ = [
    "MEMORY_METHODS",
    "MEMORY_RESULTS",
    "TASKS",
    "MemoryMethod",
    "MemoryParams",
    "build_conversations",
    "evaluate",
    "format_memory_table",
    "full_entries",
    "parse_budgets",
    "parse_memory_spec",
    "resumed_records",
    "plot_memory",
    "run_conversation",
    "summarize_memory",
]

TASKS = ("facts", "nq-shared")
MEMORY_METHODS = (
    "reuse",
    "window",
    "knorm",
    "tova",
    "snapkv",
    "h2o",
    "reconstruct",
    "snapkv-first",
)
"""The methods by name (module docstring)."""
MEMORY_RESULTS = ("results.json", "partial.jsonl")
"""The files of an earlier run that ``--out`` must not hold (unless --overwrite/--resume)."""
DEFAULT_RECENT = {"facts": 2, "nq-shared": 1}
REREAD_TURNS = 3
"""The turns re-reading the transcript is timed on."""


@dataclass(frozen=True)
class MemoryParams:
    """A memory method's parameters (module docstring)."""

    budget: float | None = None
    recent: int | None = None
    quantize: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None:
            check_fraction("budget", self.budget, open_low=True)
        if self.recent is not None:
            check_count("recent", self.recent)
        if self.quantize is not None:
            raise InvalidInputError(
                f"quantize={self.quantize}: quantize is not built yet (kvedit.Memory has no "
                "quantize option); leave it out"
            )


@dataclass(frozen=True)
class MemoryMethod:
    """A parsed spec: ``name``, its ``params`` and the ``spec`` text (the key in results)."""

    name: str
    params: MemoryParams
    spec: str

    def budgets(self, budgets: Sequence[float]) -> list[float]:
        """The budgets this method runs at: ``reuse`` at 1.0, a ``budget=`` at that one."""
        if self.name == "reuse":
            return [1.0]
        if self.params.budget is not None:
            return [float(self.params.budget)]
        return [float(b) for b in budgets]


def parse_memory_spec(spec: str) -> MemoryMethod:
    """``"name:key=value:..."`` -> a :class:`MemoryMethod` (names: :data:`MEMORY_METHODS`).

    Raises:
        InvalidInputError: an unknown method or parameter, a bad value, ``quantize``, a
            ``reuse`` with a budget below 1, or a policy whose scorer is not registered.
    """
    from kvedit.compress.scorers import SCORERS

    name, *parts = spec.strip().split(":")
    if name not in MEMORY_METHODS:
        raise InvalidInputError(
            f"unknown memory method {name!r}; known: {', '.join(MEMORY_METHODS)}"
        )
    texts = {}
    for part in parts:
        if "=" not in part:
            raise InvalidInputError(f"bad method spec {spec!r}: expected key=value after ':'")
        key, value = part.split("=", 1)
        texts[key.strip()] = value.strip()
    params = from_text(MemoryParams, texts, name)
    if name == "reuse" and params.budget is not None and params.budget != 1:
        raise InvalidInputError(
            f"method {spec!r}: reuse forgets nothing, so its budget is 1; name a policy "
            f"(window, knorm, ...) for budget {params.budget}"
        )
    if name not in ("reuse", "window", "snapkv-first") and name not in SCORERS:
        raise InvalidInputError(
            f"method {name!r}: the forgetting policy {name!r} needs the compression scorer "
            f"{name!r}, which is not registered in this kvedit (registered: "
            f"{', '.join(sorted(SCORERS))}); it is not built yet"
        )
    return MemoryMethod(name, params, spec.strip())


def parse_budgets(text: str) -> list[float]:
    """``--budgets``: comma-separated fractions in (0, 1], e.g. ``1.0,0.5,0.25,0.1``."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise InvalidInputError(f"--budgets {text!r}: give fractions such as 1.0,0.5,0.25")
    out = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise InvalidInputError(f"--budgets: {item!r} is not a number") from None
        if not math.isfinite(value) or not 0 < value <= 1:
            raise InvalidInputError(
                f"--budgets: {item} is not in (0, 1] (a fraction of the conversation's entries)"
            )
        if value in out:
            raise InvalidInputError(f"--budgets: {item} is given twice")
        out.append(value)
    return out


def build_conversations(
    task: str, n_examples: int, seed: int, size: int | None = None
) -> list[Conversation]:
    """The task's conversations. ``size``: messages after the system message (``facts``,
    default 60) or documents (``nq-shared``, default 18)."""
    if task == "facts":
        return facts_examples(n_examples, seed, **({} if size is None else {"n_messages": size}))
    if task == "nq-shared":
        return nq_shared_examples(n_examples, seed, **({} if size is None else {"n_docs": size}))
    raise InvalidInputError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")


def full_entries(memory_renderer, conversation: Conversation) -> int:
    """The global-layer entries a memory that forgets nothing holds when the first question
    is asked: the tokens of the conversation's rendering."""
    from kvedit.memory.rendering import Message

    messages = [Message(role, content) for role, content in conversation.messages]
    return len(memory_renderer.render(messages).ids)


# ---------------------------------------------------------------------------------- running


def _renderer(tokenizer):
    """The renderer a :class:`kvedit.Memory` of ``tokenizer`` uses by default."""
    from kvedit.memory.rendering import renderer_for

    return renderer_for("chat" if getattr(tokenizer, "chat_template", None) else "plain", tokenizer)


def _memory(model, tokenizer, method: MemoryMethod, max_tokens: int | None, recent: int):
    from kvedit.memory.conversation import Memory

    if method.name in ("reuse", "snapkv-first") or max_tokens is None:
        return Memory(model, tokenizer)
    return Memory(model, tokenizer, max_tokens=max_tokens, forget=method.name, recent=recent)


def _snapkv_first_answers(memory, conversation: Conversation, budget: float, max_new_tokens: int):
    """Yield ``(answer, seconds, entries)`` per question: the memory's state compressed once
    by SnapKV with the first question as query, then reused (questions and answers appended to
    that state when the conversation keeps them)."""
    from kvedit.compress import SnapKV, select
    from kvedit.memory.answering import decode
    from kvedit.memory.forgetting import global_entries
    from kvedit.memory.rendering import Message
    from kvedit.states.capturing import extend_ids

    state = memory.state
    messages = list(memory.messages)
    renderer = memory.renderer
    for k, probe in enumerate(conversation.probes):
        t0 = time.perf_counter()
        if k == 0 and budget < 1:
            state = select(state, SnapKV(query=probe.question), budget)
        entries = global_entries(state)
        asked = [*messages, Message("user", probe.question)]
        p = renderer.render(asked, generation_prompt=True)
        n = len(state)
        prompt = extend_ids(state, p.ids[n:], p.offsets[n:], p.text)
        text = decode(prompt, max_new_tokens, renderer.stops).text.strip()
        if conversation.remember:
            messages = [*asked, Message("assistant", text or " ")]
            full = renderer.render(messages)
            state = extend_ids(state, full.ids[n:], full.offsets[n:], full.text)
        yield text, time.perf_counter() - t0, entries


def _reread(memory, question: str, max_new_tokens: int) -> tuple[str, float]:
    """The answer to ``question`` from a capture of the whole transcript made now, and its
    seconds (re-reading the transcript every turn)."""
    from kvedit.memory.answering import decode
    from kvedit.memory.rendering import Message
    from kvedit.states.capturing import empty_state, extend_ids

    t0 = time.perf_counter()
    asked = [*memory.messages, Message("user", question)]
    p = memory.renderer.render(asked, generation_prompt=True)
    state = extend_ids(empty_state(memory.model, memory.tokenizer), p.ids, p.offsets, p.text)
    text = decode(state, max_new_tokens, memory.renderer.stops).text.strip()
    return text, time.perf_counter() - t0


def run_conversation(
    model,
    tokenizer,
    conversation: Conversation,
    method: MemoryMethod,
    budget: float,
    *,
    task: str,
    max_new_tokens: int = 16,
    reread: list[dict] | None = None,
) -> list[dict]:
    """One method at one budget on one conversation: a record per question (module
    docstring). With ``reread`` (a list), the first :data:`REREAD_TURNS` questions are also
    answered by re-reading the transcript, timed, each appended to it as
    ``{"seconds", "reuse_seconds", "same_answer"}``."""
    from kvedit.memory.forgetting import global_entries

    recent = method.params.recent if method.params.recent is not None else DEFAULT_RECENT[task]
    full = full_entries(_renderer(tokenizer), conversation)
    max_tokens = None if budget >= 1 else max(1, round(budget * full))
    memory = _memory(model, tokenizer, method, max_tokens, recent)
    t0 = time.perf_counter()
    for role, content in conversation.messages:
        memory.add(role, content)
    build = time.perf_counter() - t0
    digest = conversation.digest()

    def record(k: int, prediction: str, seconds: float, entries: int) -> dict:
        probe = conversation.probes[k]
        rounds = memory.forgetting
        return {
            "id": f"{conversation.id}-q{k}",
            "example": conversation.id,
            "digest": digest,
            "method": method.spec,
            "budget": budget,
            "bucket": probe.bucket,
            "where": probe.where,
            "question": probe.question,
            "answers": list(probe.answers),
            "prediction": prediction,
            "correct": best_subspan_em(prediction, probe.answers),
            "seconds": round(seconds, 4),
            "max_entries": None if memory.budget is None else memory.budget.max_entries,
            "entries": entries,
            "full_entries": full,
            "rounds": len(rounds),
            "forget_seconds": round(math.fsum(r.seconds for r in rounds), 4),
            "build_seconds": round(build, 4),
        }

    records = []
    if method.name == "snapkv-first":
        answers = _snapkv_first_answers(memory, conversation, budget, max_new_tokens)
        for k, (text, seconds, entries) in enumerate(answers):
            records.append(record(k, text, seconds, entries))
        return records
    for k, probe in enumerate(conversation.probes):
        timed = reread is not None and k < REREAD_TURNS
        again = _reread(memory, probe.question, max_new_tokens) if timed else None
        entries = global_entries(memory.state)
        t = time.perf_counter()
        text = memory.ask(probe.question, max_new_tokens, remember=conversation.remember)
        records.append(record(k, text, time.perf_counter() - t, entries))
        if again is not None:
            reread.append(
                {
                    "seconds": round(again[1], 4),
                    "reuse_seconds": records[-1]["seconds"],
                    "same_answer": again[0] == text,
                }
            )
    return records


# ---------------------------------------------------------------------------------- summary


def summarize_memory(records: Sequence[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{method: {budget: {"mean", "ci95", "n", "by_bucket", "seconds", "rounds",
    "forget_seconds", "max_entries"}}}``: accuracy over the questions, and by bucket (the
    buckets measured); ``seconds`` the mean per answer, ``rounds`` and ``forget_seconds`` the
    mean per conversation (kept rounds), ``max_entries`` the mean budget in entries (None at
    1.0). Budgets are keys as text (``"0.5"``), in descending order.

    Raises:
        InvalidInputError: a ``(method, budget, id)`` given twice.
    """
    groups: dict[str, dict[float, list[dict]]] = {}
    seen = set()
    for r in records:
        key = (r["method"], float(r["budget"]), r["id"])
        if key in seen:
            raise InvalidInputError(
                f"duplicate record for method {key[0]!r}, budget {key[1]}, id {key[2]!r}"
            )
        seen.add(key)
        groups.setdefault(r["method"], {}).setdefault(float(r["budget"]), []).append(r)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for method, by_budget in groups.items():
        out[method] = {}
        for budget in sorted(by_budget, reverse=True):
            rs = by_budget[budget]
            values = [float(r["correct"]) for r in rs]
            low, high = bootstrap_ci(values, n_resamples=1000, seed=0)
            per_conv = {r["example"]: r for r in rs}  # the last question's record of each
            entries = [r["max_entries"] for r in rs if r.get("max_entries") is not None]
            out[method][f"{budget:g}"] = {
                "mean": math.fsum(values) / len(values),
                "ci95": [low, high],
                "n": len(values),
                "by_bucket": {
                    b: math.fsum(float(r["correct"]) for r in rs if r["bucket"] == b)
                    / sum(r["bucket"] == b for r in rs)
                    for b in BUCKETS
                    if any(r["bucket"] == b for r in rs)
                },
                "seconds": math.fsum(r["seconds"] for r in rs) / len(rs),
                "rounds": math.fsum(r["rounds"] for r in per_conv.values()) / len(per_conv),
                "forget_seconds": math.fsum(r["forget_seconds"] for r in per_conv.values())
                / len(per_conv),
                "max_entries": math.fsum(entries) / len(entries) if entries else None,
            }
    return out


def format_memory_table(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The summary as a plain-text table: a row per method and budget, the accuracy by bucket,
    the mean with its 95% CI, ``n``, seconds per answer and forgetting rounds per
    conversation."""
    header = ["method", "budget", *BUCKETS, "mean", "95% CI", "n", "s/answer", "rounds"]
    rows = [header]
    for method, by_budget in summary.items():
        for budget, s in by_budget.items():
            low, high = s["ci95"]
            rows.append(
                [
                    method,
                    budget,
                    *(f"{s['by_bucket'][b]:.3f}" if b in s["by_bucket"] else "-" for b in BUCKETS),
                    f"{s['mean']:.3f}",
                    f"[{low:.3f}, {high:.3f}]",
                    str(s["n"]),
                    f"{s['seconds']:.3f}",
                    f"{s['rounds']:.1f}",
                ]
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:]))
        return "  ".join([cells[0].ljust(widths[0]), *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows[1:])])


def plot_memory(summary: dict, path: str | Path, title: str | None = None) -> Path:
    """Accuracy against budget, one line per method (``reuse`` as a dashed level), saved as a
    PNG atomically.

    Raises:
        KVEditError: Matplotlib is not installed.
    """
    import io

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise KVEditError(f"plotting needs Matplotlib ({e}); {PLOT_HINT}") from e
    fig = Figure(figsize=(7.0, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    budgets = sorted({float(b) for s in summary.values() for b in s})
    for method, by_budget in summary.items():
        points = sorted((float(b), s["mean"]) for b, s in by_budget.items())
        if len(points) == 1 and method == "reuse":
            ax.plot(budgets, [points[0][1]] * len(budgets), "--", color="gray", label=method)
        else:
            ax.plot([b for b, _ in points], [a for _, a in points], marker="o", label=method)
    ax.set_xscale("log")
    ax.set_xticks(budgets)
    ax.set_xticklabels([f"{b:g}" for b in budgets])
    ax.set_xlabel("Budget (fraction of the conversation's global-layer entries)")
    ax.set_ylabel("Accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    if title:
        ax.set_title(title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    return atomic_write(Path(path), buffer.getvalue())


# ---------------------------------------------------------------------------------- the run


def resumed_records(out: Path, settings: dict, conversations: Sequence[Conversation]) -> list[dict]:
    """The records ``--resume`` keeps from ``out/partial.jsonl``: those of the same settings
    (``partial.settings.json``) and of a conversation with the same digest."""
    partial = out / "partial.jsonl"
    if not partial.exists():
        return []
    settings_path = out / "partial.settings.json"
    if not settings_path.exists():
        raise InvalidInputError(
            f"--resume: {partial} has no {settings_path.name}, so the run it came from cannot "
            "be checked; delete it or run without --resume"
        )
    theirs = read_json(settings_path, "--resume")
    differ = [
        f"{k} {theirs.get(k)!r} (now {v!r})" for k, v in settings.items() if theirs.get(k) != v
    ]
    if differ:
        raise InvalidInputError(f"--resume: {partial} came from another run: " + ", ".join(differ))
    digests = {c.id: c.digest() for c in conversations}
    sizes = {c.id: len(c.probes) for c in conversations}
    kept = [
        r
        for r in read_records(partial, "--resume")
        if digests.get(r.get("example")) == r.get("digest")
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in kept:  # a conversation's records are kept whole or not at all
        groups.setdefault((r["example"], r["method"], float(r["budget"])), []).append(r)
    return [r for key, rs in groups.items() if len(rs) == sizes[key[0]] for r in rs]


def _pairs(
    methods: Sequence[MemoryMethod], budgets: Sequence[float]
) -> list[tuple[MemoryMethod, float]]:
    return [(m, b) for m in methods for b in m.budgets(budgets)]


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
    max_new_tokens: int = 16,
    resume: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the suite and write ``out/results.json`` and ``out/curve.png`` (skipped with a
    note without Matplotlib); return the summary (:func:`summarize_memory`).

    Records are appended to ``out/partial.jsonl`` as each conversation is done (its settings in
    ``partial.settings.json``); ``resume`` keeps those of an interrupted run with the same
    settings and computes the rest. Arguments are checked before the model loads.
    """
    from kvedit.models import load_model
    from kvedit.version import __version__, source_digest

    parsed = [parse_memory_spec(s) for s in methods]
    if not parsed:
        raise InvalidInputError("--methods names no method")
    if len({m.spec for m in parsed}) != len(parsed):
        raise InvalidInputError("--methods names a method twice")
    budgets = parse_budgets(",".join(str(b) for b in budgets))
    conversations = build_conversations(task, n_examples, seed, size)
    settings = {
        "model": model_name,
        "task": task,
        "seed": seed,
        "n_examples": n_examples,
        "size": size,
        "max_new_tokens": max_new_tokens,
        "source": source_digest(),
    }
    out = Path(out)
    done = resumed_records(out, settings, conversations) if resume else []
    model, tokenizer = load_model(model_name)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "partial.jsonl"
    settings_path = out / "partial.settings.json"
    atomic_write(settings_path, json.dumps(settings, sort_keys=True).encode())
    atomic_write(partial, "".join(json.dumps(r) + "\n" for r in done))
    have = {(r["example"], r["method"], float(r["budget"])) for r in done}
    records = list(done)
    reread: list[dict] = []
    t0 = time.perf_counter()
    for i, conv in enumerate(conversations):
        reuse_records: list[dict] | None = None
        for method, budget in _pairs(parsed, budgets):
            if (conv.id, method.spec, budget) in have:
                continue
            if budget >= 1 and method.name != "reuse":
                if reuse_records is None:
                    reuse_records = run_conversation(
                        model,
                        tokenizer,
                        conv,
                        parse_memory_spec("reuse"),
                        1.0,
                        task=task,
                        max_new_tokens=max_new_tokens,
                    )
                new = [{**r, "method": method.spec, "as": "reuse"} for r in reuse_records]
            else:
                timed = reread if (i == 0 and method.name == "reuse") else None
                new = run_conversation(
                    model,
                    tokenizer,
                    conv,
                    method,
                    budget,
                    task=task,
                    max_new_tokens=max_new_tokens,
                    reread=timed,
                )
                if method.name == "reuse":
                    reuse_records = new
            with open(partial, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
            records += new
            if progress is not None:
                acc = sum(r["correct"] for r in new) / len(new)
                progress(f"{conv.id} {method.spec} @{budget:g}: {acc:.2f}")
    summary = summarize_memory(records)
    extra = {
        "seed": seed,
        "n_examples": n_examples,
        "size": size,
        "budgets": budgets,
        "max_new_tokens": max_new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "params": {m.spec: to_dict(m.params) for m in parsed},
        "reread": _reread_summary(reread),
        "kvedit": {"version": __version__, "source": settings["source"]},
    }
    payload = {
        "model": model_name,
        "task": task,
        "methods": summary,
        "examples": records,
        "extra": extra,
    }
    atomic_write(out / "results.json", json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    if plotting_available():
        plot_memory(summary, out / "curve.png", f"{model_name}: memory {task}")
    else:
        (out / "curve.png").unlink(missing_ok=True)
        print(f"note: {out / 'curve.png'} not drawn: {PLOT_HINT}", file=sys.stderr)
    partial.unlink()
    settings_path.unlink(missing_ok=True)
    return summary


def _reread_summary(turns: list[dict]) -> dict | None:
    """Re-reading the transcript each turn, timed (None when ``reuse`` did not run)."""
    if not turns:
        return None
    return {
        "turns": len(turns),
        "seconds_per_turn": round(math.fsum(t["seconds"] for t in turns) / len(turns), 4),
        "reuse_seconds_per_turn": round(
            math.fsum(t["reuse_seconds"] for t in turns) / len(turns), 4
        ),
        "same_answers": sum(t["same_answer"] for t in turns),
    }


def main(args) -> int:
    """``kvedit eval memory`` after its checks (:mod:`kvedit.cli.memory`)."""
    summary = evaluate(
        model_name=args.model,
        task=args.task,
        methods=split_specs(args.methods),
        budgets=parse_budgets(args.budgets),
        out=args.out,
        n_examples=args.n_examples,
        seed=args.seed,
        size=args.size,
        max_new_tokens=args.max_new_tokens,
        resume=args.resume,
        progress=None if args.no_progress else (lambda line: print(line, file=sys.stderr)),
    )
    print(format_memory_table(summary))
    print(f"results: {Path(args.out) / 'results.json'}")
    if plotting_available():
        print(f"plot:    {Path(args.out) / 'curve.png'}")
    return 0
