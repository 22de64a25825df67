"""Focus on a memory: accuracy of ``Memory.ask`` with ``focus=True`` against ``focus=False`` on
seeded conversations of 40+ messages whose facts are stated early, in the middle or late and
asked at the end, per age.

Each conversation (:func:`make_conversation`) has ``--pairs`` user/assistant pairs added with
``Memory.add``: in each third of it the user states ``--facts-per-third`` facts of distinct
kinds with generated values ("My locker code is 4821.", "My sister's name is Ana."...; the
assistant acknowledges it, "Noted, your locker code is 4821."), and the other pairs are unrelated small talk with short replies.
Then every fact is asked (``ask(question, max_new_tokens=16, remember=False)``), once without
focus and once with it; an answer is right when it holds the gold value (case-insensitive,
a number not followed by a digit, a word not followed by a letter). A fact's age is the third of the conversation it was
stated in. Rows go to ``OUT/rows.jsonl`` as they come (``--resume`` skips the conversations
done); ``OUT/results.{json,md}`` hold accuracy per age and #28's no-harm rule (a bucket loses
at most 0.02 of its questions, at least one question when a bucket has 30 or fewer).

Usage: ``python -m benchmarks.memory_focus --conversations 15 --out runs/memory_focus_smollm2``
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import (
    RUNS,
    add_model,
    command_line,
    markdown_table,
    parser,
    write_file,
    write_json,
)
from kvedit import Memory
from kvedit.models import load_model

AGES = ("early", "middle", "late")
SYSTEM = "You are a helpful assistant. Answer briefly."

_FIRST = ["Ana", "Boris", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas"]
_FIRST += ["Kemal", "Lucia", "Marta", "Nils", "Olga", "Pavel", "Rosa", "Stefan", "Tomas", "Vera"]
_PETS = ["Biscuit", "Pepper", "Rocket", "Mango", "Ziggy", "Noodle", "Shadow", "Waffles", "Pixel"]
_SURNAMES = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Novak", "Ferreira", "Kowalski", "Haddad"]
_CITIES = ["Lisbon", "Krakow", "Nairobi", "Osaka", "Valparaiso", "Tbilisi", "Halifax", "Bergen"]
_COLOURS = ["green", "orange", "silver", "purple", "yellow", "maroon", "turquoise", "beige"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August"]
_MONTHS += ["September", "October", "November", "December"]


def _digits(n: int):
    return lambda rng: str(rng.randint(10 ** (n - 1), 10**n - 1))


FACT_KINDS: dict[str, tuple] = {
    # kind: (value maker, statement, question, the assistant's acknowledgement)
    "locker": (
        _digits(4),
        "My locker code is {}.",
        "What is my locker code?",
        "your locker code is {}",
    ),
    "sister": (
        lambda r: r.choice(_FIRST),
        "My sister's name is {}.",
        "What is my sister's name?",
        "your sister's name is {}",
    ),
    "flight": (
        lambda r: f"{r.choice(_MONTHS)} {r.randint(1, 28)}",
        "My flight leaves on {}.",
        "On what date does my flight leave?",
        "your flight leaves on {}",
    ),
    "dog": (
        lambda r: r.choice(_PETS),
        "My dog is called {}.",
        "What is my dog called?",
        "your dog is called {}",
    ),
    "apartment": (
        _digits(3),
        "I live in apartment {}.",
        "What is my apartment number?",
        "you live in apartment {}",
    ),
    "dentist": (
        lambda r: r.choice(_SURNAMES),
        "My dentist is Dr. {}.",
        "What is my dentist's name?",
        "your dentist is Dr. {}",
    ),
    "city": (
        lambda r: r.choice(_CITIES),
        "My favourite city is {}.",
        "What is my favourite city?",
        "your favourite city is {}",
    ),
    "car": (
        lambda r: r.choice(_COLOURS),
        "My car is {}.",
        "What colour is my car?",
        "your car is {}",
    ),
    "manager": (
        lambda r: r.choice(_FIRST),
        "My manager's name is {}.",
        "What is my manager's name?",
        "your manager's name is {}",
    ),
}

_SMALL_TALK = [
    "Can you suggest a quick breakfast idea?",
    "What is a good way to relax after work?",
    "I was thinking about starting to run in the mornings.",
    "Any tips for keeping a houseplant alive?",
    "The weather has been strange this week.",
    "I am trying to read more books this year.",
    "What should I cook for dinner tonight?",
    "I might rearrange the furniture in the living room.",
    "How long should a good nap be?",
    "I keep forgetting to drink enough water.",
    "Do you have a tip for falling asleep faster?",
    "I want to learn a few words of a new language.",
    "What is a fun game to play with friends?",
    "My desk is getting cluttered again.",
    "I am not sure whether to take the bus or walk today.",
    "Could you recommend a simple stretching routine?",
]
_REPLIES = [
    "Sounds good.",
    "Try something light and simple.",
    "A short walk often helps.",
    "That is a nice plan.",
    "Keep it easy and steady.",
    "A little each day works well.",
    "Good idea; start small.",
    "That should be fine.",
]


@dataclass(frozen=True)
class Fact:
    kind: str
    value: str
    statement: str
    echo: str
    question: str
    pair: int
    age: str


@dataclass(frozen=True)
class Conversation:
    seed: int
    messages: list[tuple[str, str]]
    facts: list[Fact]


def make_conversation(seed: int, pairs: int = 24, facts_per_third: int = 2) -> Conversation:
    """A seeded conversation of ``pairs`` user/assistant pairs with ``facts_per_third`` facts of
    distinct kinds stated in each third (early, middle, late) and small talk elsewhere."""
    if pairs < 3 * facts_per_third or facts_per_third * 3 > len(FACT_KINDS):
        raise ValueError(
            f"{pairs} pairs cannot hold {facts_per_third} facts per third "
            f"({len(FACT_KINDS)} fact kinds)"
        )
    rng = random.Random(seed)
    kinds = rng.sample(sorted(FACT_KINDS), 3 * facts_per_third)
    thirds = [range(pairs * a // 3, pairs * (a + 1) // 3) for a in range(3)]
    slots = sorted(s for t in thirds for s in rng.sample(list(t), facts_per_third))
    facts: dict[int, Fact] = {}
    for slot, kind in zip(slots, kinds, strict=True):
        make, statement, question, echo = FACT_KINDS[kind]
        value = make(rng)
        age = next(AGES[a] for a, t in enumerate(thirds) if slot in t)
        facts[slot] = Fact(
            kind,
            value,
            statement.format(value),
            f"Noted, {echo.format(value)}.",
            question,
            slot,
            age,
        )
    messages: list[tuple[str, str]] = []
    for i in range(pairs):
        if i in facts:
            messages += [("user", facts[i].statement), ("assistant", facts[i].echo)]
        else:
            messages += [("user", rng.choice(_SMALL_TALK)), ("assistant", rng.choice(_REPLIES))]
    return Conversation(seed, messages, [facts[s] for s in slots])


def correct(answer: str, gold: str) -> bool:
    """Whether ``answer`` holds ``gold`` as a whole value (case-insensitive; a number may be
    followed by letters, "March 3rd", not by digits, "March 30")."""
    after = r"(?!\d)" if gold[-1:].isdigit() else r"(?!\w)"
    return re.search(rf"(?<!\w){re.escape(gold)}{after}", answer, re.IGNORECASE) is not None


def ask_both(memory: Memory, fact: Fact, max_new_tokens: int) -> dict:
    """One fact asked without and with focus; what focus chose."""
    row: dict = {"kind": fact.kind, "age": fact.age, "pair": fact.pair, "gold": fact.value}
    for name, on in (("none", False), ("focus", True)):
        t0 = time.perf_counter()
        answer = memory.ask(fact.question, max_new_tokens, focus=on, remember=False)
        row[f"{name}_seconds"] = time.perf_counter() - t0
        row[f"{name}_answer"] = answer
        row[f"{name}_correct"] = correct(answer, fact.value)
    f = memory.last_focus
    text = memory.state.text
    chosen = [text[f.passages[i][0] : f.passages[i][1]] for i in f.chosen] if f else []
    row["focus_abstained"] = not chosen
    row["focus_kept_edit"] = bool(f and chosen and f.kept)
    row["focus_hit"] = any(fact.statement in c or fact.echo in c for c in chosen)
    return row


def allowed_loss(n: int) -> int:
    """#28's no-harm rule in questions: 0.02 of ``n``, at least one."""
    return max(1, math.floor(0.02 * n))


def summarize(rows: Sequence[dict]) -> dict:
    ages = {}
    for age in AGES:
        sub = [r for r in rows if r["age"] == age]
        n = len(sub)
        none = sum(r["none_correct"] for r in sub)
        foc = sum(r["focus_correct"] for r in sub)
        ages[age] = {
            "n": n,
            "none": none,
            "focus": foc,
            "none_acc": none / n if n else None,
            "focus_acc": foc / n if n else None,
            "gained": sum(r["focus_correct"] and not r["none_correct"] for r in sub),
            "lost": sum(r["none_correct"] and not r["focus_correct"] for r in sub),
            "hit": sum(r["focus_hit"] for r in sub),
            "kept_edit": sum(r["focus_kept_edit"] for r in sub),
            "abstained": sum(r["focus_abstained"] for r in sub),
            "allowed_loss": allowed_loss(n),
            "no_harm": none - foc <= allowed_loss(n),
        }
    return {
        "questions": len(rows),
        "conversations": len({r["conversation"] for r in rows}),
        "ages": ages,
        "no_harm_every_age": all(a["no_harm"] for a in ages.values() if a["n"]),
        "gains_on_early": ages["early"]["focus"] > ages["early"]["none"],
        "seconds_per_question": {
            k: sum(r[f"{k}_seconds"] for r in rows) / max(len(rows), 1) for k in ("none", "focus")
        },
    }


def table(summary: dict) -> list[str]:
    head = ["age", "n", "none", "focus", "gained", "lost", "focus hit", "edit kept", "no harm"]
    rows = []
    for age, a in summary["ages"].items():
        if not a["n"]:
            continue
        rows.append(
            [
                age,
                a["n"],
                f"{a['none_acc']:.3f} ({a['none']})",
                f"{a['focus_acc']:.3f} ({a['focus']})",
                a["gained"],
                a["lost"],
                a["hit"],
                a["kept_edit"],
                f"{'yes' if a['no_harm'] else 'NO'} (loss {a['none'] - a['focus']}, "
                f"allowed {a['allowed_loss']})",
            ]
        )
    return markdown_table(head, rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    p.add_argument(
        "--prompt",
        default=None,
        help="chat or plain (default: chat when the tokenizer has a template)",
    )
    p.add_argument("--conversations", type=int, default=15, help="conversations (15)")
    p.add_argument("--seed", type=int, default=0, help="first conversation's seed (0)")
    p.add_argument("--pairs", type=int, default=24, help="user/assistant pairs (24: 48 messages)")
    p.add_argument("--facts-per-third", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (torch's default)")
    p.add_argument("--out", default=None, help="folder (runs/memory_focus_MODEL)")
    p.add_argument("--resume", action="store_true", help="skip conversations in OUT/rows.jsonl")
    p.add_argument("--summarize", action="store_true", help="only remake results from rows")
    args = p.parse_args(argv)
    out = Path(args.out or RUNS / f"memory_focus_{Path(args.model).name}")
    rows_path = out / "rows.jsonl"
    rows: list[dict] = []
    if (args.resume or args.summarize) and rows_path.exists():
        rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    if not args.summarize:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        model, tok = load_model(args.model)
        done = {r["conversation"] for r in rows}
        out.mkdir(parents=True, exist_ok=True)
        for seed in range(args.seed, args.seed + args.conversations):
            if seed in done:
                continue
            conv = make_conversation(seed, args.pairs, args.facts_per_third)
            memory = Memory(model, tok, system=SYSTEM, prompt=args.prompt)
            for role, content in conv.messages:
                memory.add(role, content)
            new = []
            for fact in conv.facts:
                row = {"conversation": seed, "messages": len(memory), "tokens": len(memory.state)}
                row |= ask_both(memory, fact, args.max_new_tokens)
                row["statement"] = asdict(fact)["statement"]
                new.append(row)
            rows += new
            with rows_path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
            s = summarize(rows)
            print(
                f"conversation {seed}: {len(memory)} messages, {len(memory.state)} tokens; "
                + "; ".join(
                    f"{age} none {a['none']}/{a['n']} focus {a['focus']}/{a['n']}"
                    for age, a in s["ages"].items()
                ),
                flush=True,
            )
    summary = summarize(rows)
    summary["model"] = args.model
    summary["command"] = command_line(__file__, argv)
    write_json(out / "results.json", summary)
    lines = table(summary)
    write_file(out / "results.md", "\n".join([f"`{summary['command']}`", "", *lines]) + "\n")
    print("\n".join(lines))
    print(
        f"no harm at every age: {summary['no_harm_every_age']}; gains on early facts: "
        f"{summary['gains_on_early']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
