"""A live chat under a budget, scripted: does the memory keep what the chat itself needs?

A ``kvedit.Memory`` answers a scripted conversation turn by turn with ``Memory.ask`` (each
answer generated over what the memory kept, then committed, as ``kvedit chat`` does): three
facts told in the first turns, everyday chat after them, and each fact asked in its own turn
in two blocks (ending at turns 25 and 50 of 50 by default). Per policy and budget it reports what a user of the chat would
notice: how many distinct answers the chat gave, the longest run of one answer repeated turn
after turn (a chat that "locks in"), how many facts it recalled at each asking turn, and how
many entries each global layer held at the end (the fewest, the median, the most: a starved
layer holds little more than the last answer).

The budget is ``--budgets``: ``none`` (no budget), a size (``16MiB``, ``2MiB``, the sizes the
README and ``docs/memory.md`` show) or a fraction (``0.25``: a quarter of the bytes the memory
allocates without a budget at the last turn, measured on the ``none`` run). Greedy decoding,
the chat's defaults (``kvedit chat``'s system prompt in the README, 128 new tokens);
``--repeat-penalty`` as the chat's option of that name; ``--layer-floor`` as ``kvedit chat
--layer-floor`` (``kvedit.Memory(layer_floor=)``, recorded per row and shown as ``floor``).

Usage: ``python -m benchmarks.chat_lockin --policies learned,kvzip --budgets none,16MiB
--threads 1 --out runs/chat_lockin.json``
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks.common import add_model, command_line, markdown_table, parser, write_json
from kvedit import Memory
from kvedit.cli.arguments import byte_size
from kvedit.errors import InvalidInputError
from kvedit.memory.budget_checks import checked_layer_floor
from kvedit.models import load_model

SYSTEM = "You are a helpful assistant. Remember what the user tells you."
"""The README's ``kvedit.Memory`` system prompt, which the chat that locked in used."""

FACTS = (
    ("My locker code is 4821.", "What is my locker code?", "4821"),
    ("My sister's name is Ottilie.", "What is my sister's name?", "ottilie"),
    ("I parked the car on level 7 of the garage.", "On which level did I park the car?", "7"),
)
"""(told, asked, the answer's telling part): each told once, early; asked at ``--ask-at``."""

CHAT = (
    "How can I sleep better?",
    "What is 17 * 3?",
    "Give me a name for a grey cat.",
    "What should I cook tonight with rice and eggs?",
    "Tell me a fun fact about octopuses.",
    "How do I keep basil alive on a windowsill?",
    "What is the capital of Portugal?",
    "Suggest a short stretch for my back.",
    "How many minutes are in a day?",
    "Write one line of a poem about rain.",
    "What is a good way to learn new words?",
    "Why is the sky blue?",
    "Recommend a board game for four people.",
    "How do I boil an egg?",
    "What is the opposite of generous?",
    "Give me a tip for running in the cold.",
    "What rhymes with orange?",
    "How far is the Moon, roughly?",
    "What is a polite way to decline an invitation?",
    "Name three fruits that are red.",
)
"""Everyday messages between the facts and the questions, cycled."""


def script(turns: int, ask_at: Sequence[int]) -> list[tuple[str, str | None]]:
    """``turns`` user messages: ``(message, gold or None)``. The facts are told first; each
    turn of ``ask_at`` (1-based) ends a block of questions, one fact a turn (the last fact at
    that turn), the everyday messages fill the rest."""
    asked: dict[int, tuple[str, str]] = {}
    for end in ask_at:
        for k, (_, question, gold) in enumerate(FACTS):
            asked[end - len(FACTS) + 1 + k] = (f"Earlier I told you this. {question}", gold)
    out: list[tuple[str, str | None]] = [(told, None) for told, _, _ in FACTS]
    i = 0
    while len(out) < turns:
        turn = len(out) + 1
        if turn in asked:
            out.append(asked[turn])
        else:
            out.append((CHAT[i % len(CHAT)], None))
            i += 1
    return out[:turns]


def longest_run(answers: Sequence[str]) -> int:
    """The most consecutive turns that gave one answer (1 when no answer repeats at once)."""
    best = run = 0
    last = None
    for a in answers:
        run = run + 1 if a == last else 1
        best, last = max(best, run), a
    return best


def recalled(answer: str, gold: str) -> int:
    """1 if the answer holds the fact's telling part (``gold``) as a word, else 0."""
    return int(bool(re.search(rf"(?<![0-9a-z]){re.escape(gold)}(?![0-9a-z])", answer.lower())))


def layer_entries(mem: Memory) -> list[int]:
    """The entries each global-attention layer holds (the most over its KV heads)."""
    out = []
    for layer in mem.state.layers:
        if getattr(layer, "window", None):
            continue
        out.append(int(layer.kv_shape[2]))
    return out


def run_chat(
    model,
    tok,
    turns,
    policy: str | None,
    max_bytes: int | None,
    new_tokens: int,
    repetition_penalty: float = 1.0,
    layer_floor: float = 0.0,
) -> dict:
    """One scripted chat; the answers and the measures (``repetition_penalty``: as
    ``kvedit chat --repeat-penalty``, 1.0 off; ``layer_floor``: ``Memory``'s, under a budget)."""
    kw = {} if max_bytes is None else {"max_bytes": max_bytes, "forget": policy}
    if max_bytes is not None:
        kw["layer_floor"] = layer_floor
    mem = Memory(model, tok, system=SYSTEM, **kw)
    answers, asked = [], []
    t0 = time.perf_counter()
    for turn, (message, gold) in enumerate(turns, 1):
        answer = mem.ask(message, max_new_tokens=new_tokens, repetition_penalty=repetition_penalty)
        answers.append(answer)
        if gold is not None:
            asked.append({"turn": turn, "recalled": recalled(answer, gold), "answer": answer})
    entries = layer_entries(mem)
    return {
        "policy": policy if max_bytes is not None else None,
        "max_bytes": max_bytes,
        "repetition_penalty": repetition_penalty,
        "layer_floor": layer_floor if max_bytes is not None else None,
        "turns": len(turns),
        "distinct_answers": len(set(answers)),
        "longest_run": longest_run(answers),
        "recall": asked,
        "recalled": sum(a["recalled"] for a in asked),
        "facts_asked": len(asked),
        "entries_min": min(entries),
        "entries_median": statistics.median(entries),
        "entries_max": max(entries),
        "entries_per_layer": entries,
        "nbytes": mem.nbytes,
        "seconds": round(time.perf_counter() - t0, 1),
        "answers": answers,
    }


def budgets_of(text: str) -> list[str]:
    return [b.strip() for b in text.split(",") if b.strip()]


def _parser():
    p = parser(__doc__)
    add_model(p)
    p.add_argument("--policies", default="learned,kvzip,knorm,window", help="forgetting policies")
    p.add_argument("--budgets", default="none,16MiB,2MiB", help="none, a size, or a fraction")
    p.add_argument("--turns", type=int, default=50, help="user messages in the chat")
    p.add_argument("--ask-at", default="25,50", help="turns that ask the facts (1-based)")
    p.add_argument("--new-tokens", type=int, default=128, help="most tokens per answer")
    p.add_argument(
        "--repeat-penalty",
        type=float,
        default=1.0,
        help="as kvedit chat --repeat-penalty (1.0: off, greedy decoding's default)",
    )
    p.add_argument(
        "--layer-floor",
        type=float,
        default=0.0,
        help="as kvedit chat --layer-floor: the fraction of each round's budget shared equally "
        "among the global layers first (0: one ranking alone)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--out", default="runs/chat_lockin.json", help="JSON output")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:  # refused before the model loads
        floor = checked_layer_floor(args.layer_floor, "--layer-floor")
    except InvalidInputError as e:
        raise SystemExit(str(e)) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    turns = script(args.turns, [int(t) for t in args.ask_at.split(",")])
    rows: list[dict] = []
    full_bytes = None
    for budget in budgets_of(args.budgets):
        if budget == "none":
            rows.append(
                run_chat(model, tok, turns, None, None, args.new_tokens, args.repeat_penalty)
            )
            full_bytes = rows[-1]["nbytes"]
            _progress(rows[-1], "none")
            continue
        if re.fullmatch(r"0?\.\d+", budget):
            if full_bytes is None:
                raise SystemExit("a fractional budget needs 'none' first in --budgets")
            max_bytes = int(float(budget) * full_bytes)
        else:
            max_bytes = byte_size("--budgets")(budget)
        for policy in args.policies.split(","):
            how = (args.new_tokens, args.repeat_penalty, floor)
            row = run_chat(model, tok, turns, policy, max_bytes, *how)
            row["budget"] = budget
            rows.append(row)
            _progress(row, budget)
    print("\n".join(_table(rows)))
    write_json(
        args.out, {"command": command_line(__file__, argv), "model": args.model, "rows": rows}
    )
    return 0


def _table(rows: list[dict]) -> list[str]:
    """The rows as a markdown table (``floor``: ``layer_floor``, ``-`` without a budget)."""
    return markdown_table(
        [
            "budget",
            "policy",
            "floor",
            "distinct answers",
            "longest run",
            "facts recalled",
            "entries min/median/max",
        ],
        [
            [
                r.get("budget", "none"),
                r["policy"] or "-",
                "-" if r["layer_floor"] is None else f"{r['layer_floor']:g}",
                f"{r['distinct_answers']}/{r['turns']}",
                r["longest_run"],
                f"{r['recalled']}/{r['facts_asked']}",
                f"{r['entries_min']}/{r['entries_median']:g}/{r['entries_max']}",
            ]
            for r in rows
        ],
    )


def _progress(row: dict, budget: str) -> None:
    print(
        f"{budget} {row['policy']}: {row['distinct_answers']} distinct, run {row['longest_run']}, "
        f"recalled {row['recalled']}/{row['facts_asked']}, entries {row['entries_min']}-"
        f"{row['entries_max']} ({row['seconds']} s)",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
