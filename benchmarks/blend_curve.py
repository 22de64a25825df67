"""Accuracy and time-to-first-token of ``kvedit.blend``'s rules across recompute fractions.

Lost-in-the-middle NQ examples (the gold passage among ``--n-docs`` documents, at each of
``--positions``; ``kvedit.evals.tasks.nq_examples``) are cut into blend parts as the eval's
``blend`` method does (``kvedit.evals.methods.blend.document_parts``: the instruction, then one
part per document). The parts are stored first (a blend at ``recompute=0``, not timed). Then,
for every rule and every recompute fraction, the example is answered from the blend and
compared with a full prefill of the same token ids:

* accuracy: the task's metric (best subspan EM) of the greedy answer, per gold position too;
* time to first token: ``kvedit.blend`` (parts from the store's memory tier) and the question's
  forward on the blended state, against one plain forward over the same ids + question with
  ``logits_to_keep=1`` (median of ``--repeats``); speed-up is full / blend.

``--previous TEXT`` caches every document after the first behind the prefix and ``TEXT``
(``kvedit.blend``'s ``previous=``, for every rule). A rule is a blend spec's rule part,
``:``-separated: ``default`` (no rule), ``gradual=2``, ``leading=4``, ``rescale=0.8``, ``gradual=2:leading=4`` ... (see ``kvedit.reusing.blend_rules``). The
plot (``OUT/blend_curve.png``) has one line per rule, accuracy and speed-up against the
fraction, the full prefill's accuracy dashed; ``OUT/blend_curve.json`` holds the rows and every
answer, ``OUT/blend_curve.md`` a table. Each example's records are appended to
``OUT/partial.jsonl`` as it finishes (its settings in ``OUT/partial.settings.json``);
``--resume`` keeps those of an interrupted run with the same settings and computes the rest.

``--merge A/blend_curve.json B/blend_curve.json ... --out DIR`` joins runs that differ only in
their gold positions or limit (the same model, seed, rules, fractions and kvedit source; two
processes on two cores), and adds ``OUT/paired.md``: per rule and gold position, how many
questions the blend lost and won against the prefill of the same ids.

Usage::

    python -m benchmarks.blend_curve --model smollm2-135m-instruct --limit 30 \\
        --rules default,gradual=2,leading=4,rescale=0.8 --fractions 0,0.05,0.15,0.3,0.5,1
    python -m benchmarks.blend_curve --model tiny-llama --limit 2 --n-docs 3 --out /tmp/bc
    python -m benchmarks.blend_curve --merge runs/a/blend_curve.json runs/b/blend_curve.json \
        --out runs/blend_curve-merged

``--out`` defaults to ``runs/blend_curve``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

import kvedit
from benchmarks.common import RUNS, add_model, markdown_table, parser, timed, write_file
from kvedit.cli.arguments import positions as position_list
from kvedit.errors import InvalidInputError
from kvedit.evals.litm import interleave_positions, resolve_prompt
from kvedit.evals.methods.blend import BlendParams, document_parts
from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.params import from_text
from kvedit.evals.schema import Example, score
from kvedit.evals.tasks import nq_examples
from kvedit.reusing.blend_rules import BLEND_RULES
from kvedit.states.capturing import empty_state, extend_ids
from kvedit.version import source_digest

DEFAULT_RULES = "default,gradual=2,leading=4,rescale=0.8,gradual=2:leading=4"
DEFAULT_FRACTIONS = "0,0.05,0.15,0.3,0.5,1"


def parse_rule(text: str) -> dict[str, float | int]:
    """``"gradual=2:leading=4"`` -> ``{"gradual": 2, "leading": 4}`` (checked); ``"default"``
    -> ``{}``."""
    text = text.strip()
    if text in ("", "default", "none"):
        return {}
    texts = {}
    for part in text.split(":"):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in BLEND_RULES:
            raise InvalidInputError(
                f"bad rule {text!r}: expected name=value parts with names in {sorted(BLEND_RULES)}"
            )
        texts[key.strip()] = value.strip()
    return from_text(BlendParams, texts, "blend").rules()


def parse_fractions(text: str) -> list[float]:
    out = [float(x) for x in text.split(",") if x.strip()]
    if not out or any(not 0.0 <= f <= 1.0 for f in out):
        raise InvalidInputError(f"--fractions must be numbers in [0, 1], not {text!r}")
    return out


def load_examples(args) -> list[Example]:
    """``--limit`` NQ examples, round-robin over the gold positions (default: first, middle
    and last document)."""
    last = args.n_docs - 1
    positions = (
        tuple(args.positions) if args.positions else tuple(dict.fromkeys((0, last // 2, last)))
    )
    trials = -(-args.limit // len(positions))
    examples = nq_examples(
        n_docs=args.n_docs, positions=positions, trials=trials, seed=args.seed, path=args.data
    )
    return interleave_positions(examples)[: args.limit]


@torch.no_grad()
def run_example(model, tok, example: Example, store, rules, fractions, args) -> list[dict]:
    """One record per (rule, fraction), plus the full prefill's (``rule`` None)."""
    ctx = ExampleContext(model, tok, example, args.max_new_tokens, args.prompt_format)
    parts = document_parts(ctx)
    placed, _ = kvedit.blend(
        model, tok, parts, store, recompute=0.0, context=args.context, previous=args.previous
    )
    ids = placed.token_ids.tolist()
    question = placed.encode(ctx.continuation)
    device = next(model.parameters()).device
    whole = torch.tensor([ids + question], device=device)
    t_full, _ = timed(lambda: model(whole, logits_to_keep=1), args.repeats)
    full = extend_ids(empty_state(model, tok), ids, placed.offsets, placed.text)
    answer = full.generate(ctx.continuation, args.max_new_tokens)
    base = {
        "id": example.id,
        "example": example.digest(),  # the id does not say the distractors: --resume checks this
        "gold_index": example.gold_index,
        "tokens": len(ids),
    }
    records = [{**base, "rule": None, "recompute": 1.0, "prediction": answer, "seconds": t_full}]
    records[0]["correct"] = score(example, answer)
    for label, rule in rules:
        for fraction in fractions:

            def first_token(fraction=fraction, rule=rule):
                state, report = kvedit.blend(
                    model, tok, parts, store, fraction, context=args.context,
                    previous=args.previous, **rule,
                )  # fmt: skip
                state.run(question, logits_to_keep=1)
                return state, report

            seconds, (state, report) = timed(first_token, args.repeats)
            answer = state.generate(ctx.continuation, args.max_new_tokens)
            records.append(
                {
                    **base,
                    "rule": label,
                    "recompute": fraction,
                    "prediction": answer,
                    "correct": score(example, answer),
                    "seconds": seconds,
                    "speedup": t_full / seconds,
                    "tokens_recomputed": report.tokens_recomputed,
                    "recomputed_per_layer": report.recomputed_per_layer,
                    "tokens_rescaled": report.tokens_rescaled,
                    "rules": list(report.rules),
                }
            )
    return records


@torch.no_grad()
def warm_up(model, tok, example: Example, store, args) -> None:
    """One untimed blend and prefill, so that the first timed point pays no one-time cost."""
    ctx = ExampleContext(model, tok, example, args.max_new_tokens, args.prompt_format)
    parts = document_parts(ctx)
    state, _ = kvedit.blend(
        model, tok, parts, store, 0.5, context=args.context, previous=args.previous
    )
    model(state.token_ids[None].to(next(model.parameters()).device), logits_to_keep=1)


def summarize(records: Sequence[dict]) -> list[dict]:
    """Mean accuracy (overall and per gold position), median seconds and speed-up per
    (rule, fraction); the full prefill is the row with ``rule`` None."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["rule"], r["recompute"]), []).append(r)
    rows = []
    for (rule, fraction), rs in groups.items():
        by_position: dict[int, list[float]] = {}
        for r in rs:
            by_position.setdefault(r["gold_index"], []).append(r["correct"])
        rows.append(
            {
                "rule": rule,
                "recompute": fraction,
                "n": len(rs),
                "accuracy": statistics.fmean(r["correct"] for r in rs),
                "by_position": {p: statistics.fmean(v) for p, v in sorted(by_position.items())},
                "seconds": statistics.median(r["seconds"] for r in rs),
                "speedup": statistics.median(r.get("speedup", 1.0) for r in rs),
                "tokens_recomputed": statistics.fmean(r.get("tokens_recomputed", 0) for r in rs),
            }
        )
    return rows


def plot(rows: Sequence[dict], path: Path, title: str) -> None:
    """Three panels, one line per rule: accuracy against time-to-first-token speed-up (each
    point labelled with its recompute fraction; the full prefill is the star at 1x), then
    accuracy and speed-up against the recompute fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, (curve_ax, acc_ax, speed_ax) = plt.subplots(1, 3, figsize=(16, 4.6))
    full = next(r for r in rows if r["rule"] is None)
    for rule in dict.fromkeys(r["rule"] for r in rows if r["rule"] is not None):
        line = sorted((r for r in rows if r["rule"] == rule), key=lambda r: r["recompute"])
        xs = [r["recompute"] for r in line]
        (drawn,) = curve_ax.plot(
            [r["speedup"] for r in line], [r["accuracy"] for r in line], marker="o", label=rule
        )
        for r in line:
            curve_ax.annotate(
                f"{r['recompute']:g}",
                (r["speedup"], r["accuracy"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=drawn.get_color(),
            )
        acc_ax.plot(xs, [r["accuracy"] for r in line], marker="o", label=rule)
        speed_ax.plot(xs, [r["speedup"] for r in line], marker="o", label=rule)
    curve_ax.plot(
        [1.0],
        [full["accuracy"]],
        marker="*",
        markersize=12,
        color="black",
        linestyle="none",
        label="full prefill",
    )
    acc_ax.axhline(full["accuracy"], color="black", linestyle="--", label="full prefill")
    speed_ax.axhline(1.0, color="black", linestyle="--", label="full prefill")
    curve_ax.set(
        xlabel="time-to-first-token speed-up (x; labels: recompute fraction)",
        ylabel="accuracy (best subspan EM)",
    )
    curve_ax.set_xscale("log")
    acc_ax.set(xlabel="recompute fraction", ylabel="accuracy (best subspan EM)", ylim=(-0.02, 1.02))
    speed_ax.set(xlabel="recompute fraction", ylabel="time-to-first-token speed-up (x)")
    speed_ax.set_yscale("log")
    for axis in (curve_ax.xaxis, speed_ax.yaxis):  # 0.5, 2, 5 rather than 5x10^-1
        axis.set_major_formatter(FormatStrFormatter("%g"))
    speed_ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    for ax in (curve_ax, acc_ax, speed_ax):
        ax.grid(alpha=0.3)
    curve_ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    write_file(path, lambda tmp: fig.savefig(tmp, dpi=120))
    plt.close(fig)


def markdown(rows: Sequence[dict], title: str) -> str:
    positions = sorted({p for r in rows for p in r["by_position"]})
    head = ["rule", "recompute", "n", "accuracy", *(f"pos {p}" for p in positions)]
    head += ["TTFT s", "speed-up", "recomputed"]
    table = []
    for r in sorted(rows, key=lambda r: (r["rule"] is not None, str(r["rule"]), r["recompute"])):
        cells = [r["rule"] or "full prefill", f"{r['recompute']:g}", str(r["n"])]
        cells += [f"{r['accuracy']:.3f}"]
        cells += [f"{r['by_position'].get(p, float('nan')):.3f}" for p in positions]
        cells += [f"{r['seconds']:.3f}", f"{r['speedup']:.2f}", f"{r['tokens_recomputed']:.0f}"]
        table.append(cells)
    return "\n".join([f"# {title}", "", *markdown_table(head, table)]) + "\n"


RESUME_KEYS = (
    "model", "n_docs", "positions", "seed", "data", "rules", "fractions", "context",
    "prompt_format", "max_new_tokens", "repeats", "previous",
)  # fmt: skip
"""The settings an interrupted run must share with ``--resume``'s (``--limit`` may grow), and
kvedit's source (:func:`kvedit.version.source_digest`): other code may answer otherwise."""


def paired(records: Sequence[dict]) -> list[dict]:
    """Per (rule, fraction, gold position): questions, prefill accuracy, blend accuracy, and the
    questions the blend lost (prefill right, blend wrong) and won against the prefill."""
    full = {r["id"]: r["correct"] for r in records if r["rule"] is None}
    cells: dict[tuple, list[tuple[float, float]]] = {}
    for r in records:
        if r["rule"] is not None:
            key = (r["rule"], r["recompute"], r["gold_index"])
            cells.setdefault(key, []).append((full[r["id"]], r["correct"]))
    return [
        {
            "rule": rule,
            "recompute": fraction,
            "position": position,
            "n": len(pairs),
            "prefill": statistics.fmean(f for f, _ in pairs),
            "blend": statistics.fmean(b for _, b in pairs),
            "lost": sum(f > b for f, b in pairs),
            "won": sum(b > f for f, b in pairs),
        }
        for (rule, fraction, position), pairs in sorted(cells.items(), key=lambda kv: str(kv[0]))
    ]


def paired_markdown(rows: Sequence[dict], title: str) -> str:
    head = ["rule", "recompute", "gold position", "n", "prefill", "blend", "blend − prefill"]
    head += ["lost", "won"]
    table = [
        [r["rule"], f"{r['recompute']:g}", r["position"], r["n"], f"{r['prefill']:.3f}"]
        + [f"{r['blend']:.3f}", f"{r['blend'] - r['prefill']:+.3f}", r["lost"], r["won"]]
        for r in rows
    ]
    return (
        "\n".join([f"# {title}: paired with the prefill", "", *markdown_table(head, table)]) + "\n"
    )


MERGE_KEYS = (*(k for k in RESUME_KEYS if k != "positions"), "source")
"""The settings every run joined by ``--merge`` must share: a resume's, and kvedit's source,
but not the gold positions."""


def differences(theirs: dict, ours: dict, keys, label: str) -> list[str]:
    """``"key THEIRS (LABEL: OURS)"`` for each of ``keys`` whose values differ."""
    return [
        f"{k} {theirs.get(k)!r} ({label}: {ours.get(k)!r})"
        for k in keys
        if theirs.get(k) != ours.get(k)
    ]


def merged(paths: Sequence[str]) -> tuple[dict, list[dict]]:
    """``(settings, records)`` of finished runs that differ only in positions and limit.

    Raises:
        InvalidInputError: a file is missing or not a finished run, the runs' settings differ
            (named), or two runs answered the same example.
    """
    settings: dict | None = None
    records: list[dict] = []
    for path in paths:
        try:
            payload = json.loads(Path(path).read_text())
            theirs, mine = payload["settings"], payload["records"]
        except (OSError, ValueError, KeyError) as e:
            raise InvalidInputError(
                f"--merge: {path} is not a finished blend_curve.json ({e})"
            ) from e
        if settings is None:
            settings = theirs
        differ = differences(theirs, settings, MERGE_KEYS, "first run")
        if differ:
            raise InvalidInputError(
                f"--merge: {path} differs from {paths[0]}: " + ", ".join(differ)
            )
        twice = {r["id"] for r in records} & {r["id"] for r in mine}
        if twice:
            raise InvalidInputError(
                f"--merge: {path} repeats {len(twice)} examples, e.g. {min(twice)}"
            )
        records += mine
    assert settings is not None
    settings = {k: settings.get(k) for k in MERGE_KEYS} | {"merged": list(paths)}
    return settings, records


def write_report(out: Path, settings: dict, records: list[dict]) -> None:
    """``blend_curve.{json,md,png}`` and ``paired.md`` of ``records`` in ``out``."""
    rows = summarize(records)
    n = len({r["id"] for r in records})
    title = f"kvedit.blend rules: {settings['model']}, NQ-{settings['n_docs']}, {n} examples"
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / "blend_curve.png", title)
    payload = {"settings": settings, "rows": rows, "records": records, "paired": paired(records)}
    write_file(out / "blend_curve.json", json.dumps(payload, indent=1))
    write_file(out / "blend_curve.md", markdown(rows, title))
    write_file(out / "paired.md", paired_markdown(payload["paired"], title))
    print(markdown(rows, title))
    print(paired_markdown(payload["paired"], title))


def resumed(out: Path, settings: dict) -> dict[str, list[dict]]:
    """``example id -> records`` an interrupted run in ``out`` left with the same settings.

    Raises:
        InvalidInputError: ``out`` holds no such run, or one with other settings (named).
    """
    partial, saved = out / "partial.jsonl", out / "partial.settings.json"
    if not partial.exists() or not saved.exists():
        raise InvalidInputError(f"--resume: {out} holds no partial.jsonl with its settings")
    theirs = json.loads(saved.read_text())
    differ = differences(theirs, settings, settings, "now")
    if differ:
        raise InvalidInputError(f"--resume: {partial} came from another run: " + ", ".join(differ))
    done: dict[str, list[dict]] = {}
    for line in partial.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            done.setdefault(record["id"], []).append(record)
    return done


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p, device=True)
    p.add_argument("--limit", type=int, default=30, help="examples in all")
    p.add_argument("--n-docs", type=int, default=10)
    p.add_argument(
        "--positions", type=position_list, default=None, help="gold positions (default 0,4,9)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="an NQ file (default: the bundled one)")
    p.add_argument("--rules", default=DEFAULT_RULES, help="comma-separated rules")
    p.add_argument("--fractions", default=DEFAULT_FRACTIONS)
    p.add_argument("--context", default="prefix", choices=("prefix", "alone"))
    p.add_argument(
        "--previous",
        default=None,
        help="a neutral passage every document after the first is cached behind (blend's previous=)",
    )
    p.add_argument("--prompt", default="auto", help="chat, plain or auto")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per point (median)")
    p.add_argument(
        "--out", default=str(RUNS / "blend_curve"), help="folder of the png, json and md"
    )
    p.add_argument(
        "--resume", action="store_true", help="keep what an interrupted run in --out finished"
    )
    p.add_argument(
        "--merge", nargs="+", metavar="JSON", help="join finished runs' blend_curve.json into --out"
    )
    args = p.parse_args(argv)
    if args.merge:
        settings, records = merged(args.merge)
        write_report(Path(args.out), settings, records)
        return 0
    rules = [(text.strip() or "default", parse_rule(text)) for text in args.rules.split(",")]
    fractions = parse_fractions(args.fractions)
    args.prompt_format = resolve_prompt(args.prompt, args.model)
    model, tok = kvedit.load_model(args.model, device=args.device)
    examples = load_examples(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in RESUME_KEYS} | {"source": source_digest()}
    done = resumed(out, settings) if args.resume else {}
    for example in examples:  # an id names the question and position, not the distractors
        if any(r.get("example") != example.digest() for r in done.get(example.id, [])):
            raise InvalidInputError(
                f"--resume: {out}'s {example.id!r} is another example than this run's (its "
                "distractors depend on --limit and --positions): run it again without --resume"
            )
    write_file(out / "partial.settings.json", json.dumps(settings, sort_keys=True))
    partial = out / "partial.jsonl"
    write_file(partial, "".join(json.dumps(r) + "\n" for rs in done.values() for r in rs))
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvedit-blend-curve-") as tmp:
        store = kvedit.KVStore(tmp, memory_bytes=2**30)
        warm_up(model, tok, examples[0], store, args)
        for i, example in enumerate(examples):
            if example.id in done:
                records += done[example.id]
                continue
            mine = run_example(model, tok, example, store, rules, fractions, args)
            with open(partial, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in mine))
            records += mine
            print(f"[{i + 1}/{len(examples)}] {example.id}", file=sys.stderr, flush=True)
    write_report(out, vars(args) | {"source": settings["source"]}, records)
    partial.unlink()
    (out / "partial.settings.json").unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
