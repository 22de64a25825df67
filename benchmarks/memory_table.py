"""One table from several ``kvedit eval memory`` runs of the same task and model (other seeds,
or a run stopped before its end), and each method's accuracy against ``reuse``'s.

Each RUN is a results folder: its ``results.json``, or, for a run that was stopped, its
``partial.jsonl`` (only the conversations whose records are whole for every method and budget
of that run are kept, so every method is compared on the same questions). The records are pooled
and summarized as ``kvedit eval memory`` summarizes one run
(:func:`kvedit.evals.memory.summarize_memory`, :func:`kvedit.evals.memory.format_memory_table`).
Below the table, per method and budget: its mean over ``reuse``'s, and per bucket the questions
lost against ``reuse`` with #28's rule (at most one question lost where a bucket holds 30 or
fewer, else at least ``reuse`` - 0.02).

A method whose spec sets the record's own budget (``window:budget=0.1`` run at 0.1) is named
without it, so it shares a row and a line with the same method run at that budget otherwise.
A method and budget run again in a later RUN on conversations an earlier RUN holds it on (a
changed policy, say) replaces all that earlier run's records of it (a question of the same id
must be the same conversation, by its digest, or the table is refused); runs of other
conversations (other seeds) pool whole. The table says how many records were replaced.

Usage: ``python -m benchmarks.memory_table runs/mem-facts-s1 runs/mem-facts-s2 --out
runs/memory_table.md [--plot runs/memory_table.png --title TITLE] [--bytes-plot
runs/memory_bytes.png]`` (the plot as ``kvedit eval memory`` draws one run's: accuracy by budget,
a line per method; ``--bytes-plot``: accuracy against the bytes the memory held when each
question came, its records' ``nbytes``, a point per method and budget)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import command_line, parser, read_partial, read_run, write_file
from kvedit.evals.memory import format_memory_table, plot_memory, summarize_memory
from kvedit.evals.tasks.memory_schema import BUCKETS


def budget_named(record: dict) -> dict:
    """``record`` with its method named without a ``budget=`` part that says the record's own
    budget (``window:budget=0.1`` at 0.1 is ``window`` at 0.1: one row and one line per
    method, whichever way a run set its budget); any other record as it is."""
    name, *parts = record["method"].split(":")
    kept = [
        part
        for part in parts
        if not (
            part.partition("=")[0].strip() == "budget"
            and float(part.partition("=")[2]) == float(record["budget"])
        )
    ]
    if len(kept) == len(parts):
        return record
    return {**record, "method": ":".join([name, *kept])}


def run_records(folder: str | Path) -> list[dict]:
    """The records of one run (methods named by :func:`budget_named`): ``results.json``'s,
    else ``partial.jsonl``'s whole conversations."""
    folder = Path(folder)
    done = folder / "results.json"
    if done.exists():
        return [budget_named(r) for r in read_run(done)["examples"]]
    partial = folder / "partial.jsonl"
    if not partial.exists():
        raise SystemExit(f"{folder}: no results.json or partial.jsonl (not a kvedit eval run)")
    records = read_partial(partial)
    pairs = {(r["method"], float(r["budget"])) for r in records}
    by_example: dict[str, set] = defaultdict(set)
    for r in records:
        by_example[r["example"]].add((r["method"], float(r["budget"])))
    whole = {e for e, got in by_example.items() if got == pairs}
    return [budget_named(r) for r in records if r["example"] in whole]


def latest(runs: Sequence[Sequence[dict]]) -> tuple[list[dict], int]:
    """The records of ``runs`` (each run's, in order), pooled; where a later run holds a method
    and budget on a conversation an earlier run holds it on, the earlier run's records of that
    method and budget are all dropped (a row never mixes two versions of a method), and how many
    that dropped; a question whose conversation differs between runs (another digest under the
    same id) is refused. Runs of other conversations (other seeds) pool whole."""
    digests: dict[str, str | None] = {}
    for r in (r for run in runs for r in run):
        if digests.setdefault(r["id"], r.get("digest")) != r.get("digest"):
            raise SystemExit(f"{r['id']}: another conversation under the same id in two runs")
    held: list[dict[tuple[str, float], set[str]]] = []  # per run: (method, budget) -> examples
    for run in runs:
        got: dict[tuple[str, float], set[str]] = defaultdict(set)
        for r in run:
            got[(r["method"], float(r["budget"]))].add(r["example"])
        held.append(got)
    dropped = {
        (j, key)
        for k in range(len(runs))
        for key, examples in held[k].items()
        for j in range(k)
        if held[j].get(key, set()) & examples
    }
    kept = [
        r
        for j, run in enumerate(runs)
        for r in run
        if (j, (r["method"], float(r["budget"]))) not in dropped
    ]
    return kept, sum(len(run) for run in runs) - len(kept)


def only_methods(records: Sequence[dict], methods: Sequence[str]) -> list[dict]:
    """The records of ``methods`` (names as :func:`budget_named` gives them) and ``reuse``'s;
    a name no record has is refused, naming the ones there are."""
    there = {r["method"] for r in records}
    wanted = {m.strip() for m in methods if m.strip()}
    if missing := sorted(wanted - there):
        raise SystemExit(f"--methods: no records of {missing}; the runs hold {sorted(there)}")
    return [r for r in records if r["method"] in wanted or r["method"] == "reuse"]


def versus_reuse(records: Sequence[dict]) -> list[str]:
    """Per method and budget: mean over ``reuse``'s and the questions lost per bucket."""
    reuse = {r["id"]: r["correct"] for r in records if r["method"] == "reuse"}
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in records:
        if r["method"] != "reuse" and r["id"] in reuse:
            groups[(r["method"], float(r["budget"]))].append(r)
    lines = [
        "| method | budget | mean / reuse | "
        + " | ".join(f"{b}: lost (n)" for b in BUCKETS)
        + " | no-harm rule |",
        "|---|---|---|" + "---|" * len(BUCKETS) + "---|",
    ]
    for (method, budget), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        cells, ok = [], True
        for b in BUCKETS:
            mine = [r for r in rs if r["bucket"] == b]
            if not mine:
                cells.append("-")
                continue
            have = sum(reuse[r["id"]] for r in mine)
            got = sum(r["correct"] for r in mine)
            lost = have - got
            n = len(mine)
            ok &= lost <= 1 if n <= 30 else got / n >= have / n - 0.02
            cells.append(f"{lost:+g} ({n})".replace("+", "") if lost else f"0 ({n})")
        base = sum(reuse[r["id"]] for r in rs)
        ratio = sum(r["correct"] for r in rs) / base if base else float("nan")
        lines.append(
            f"| {method} | {budget:g} | {ratio:.2f} | "
            + " | ".join(cells)
            + f" | {'kept' if ok else 'broken'} |"
        )
    return lines


def mean_bytes(records: Sequence[dict]) -> dict[tuple[str, float], tuple[float, float]]:
    """Per method and budget, ``(mean nbytes in MiB, accuracy)`` of its records."""
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["method"], float(r["budget"]))].append(r)
    return {
        key: (
            sum(r["nbytes"] for r in rs) / len(rs) / 2**20,
            sum(r["correct"] for r in rs) / len(rs),
        )
        for key, rs in groups.items()
    }


def plot_bytes(records: Sequence[dict], path: str | Path, title: str | None = None) -> Path:
    """Accuracy against the bytes held when each question came (log scale), a line per
    method through its budgets, saved as a PNG."""
    from kvedit.evals.report import accuracy_axes, save_accuracy_plot

    fig, ax = accuracy_axes(width=7.0)
    points = mean_bytes(records)
    for method in sorted({m for m, _ in points}):
        mine = sorted((mib, acc, b) for (m, b), (mib, acc) in points.items() if m == method)
        ax.plot([x for x, _, _ in mine], [y for _, y, _ in mine], marker="o", label=method)
        for x, y, b in mine:
            ax.annotate(
                f"{b:g}", (x, y), fontsize="x-small", xytext=(3, 3), textcoords="offset points"
            )
    ax.set_xscale("log")
    ax.set_xlabel("MiB the memory held when the question came (every layer, as allocated)")
    return save_accuracy_plot(fig, ax, path, title)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("runs", nargs="+", help="results folders of kvedit eval memory")
    p.add_argument("--out", default=None, help="write the tables to this markdown file")
    p.add_argument("--plot", default=None, help="write the pooled accuracy plot to this PNG")
    p.add_argument("--title", default=None, help="the plot's title")
    p.add_argument("--bytes-plot", default=None, help="write accuracy against bytes to this PNG")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated: only these methods, as the table names them (reuse always kept)",
    )
    args = p.parse_args(argv)
    records, replaced = latest([run_records(run) for run in args.runs])
    if args.methods:
        records = only_methods(records, args.methods.split(","))
    examples = sorted({r["example"] for r in records})
    summary = summarize_memory(records)
    table = format_memory_table(summary)
    if args.plot:
        plot_memory(summary, args.plot, args.title)
    if args.bytes_plot:
        plot_bytes(records, args.bytes_plot, args.title)
    lines = [
        f"`{command_line(__file__, argv)}`",
        "",
        f"{len(examples)} conversations: {', '.join(examples)}",
        "",
        *([f"{replaced} records replaced by a later run's", ""] if replaced else []),
        "```text",
        table,
        "```",
        "",
        *versus_reuse(records),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_file(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
