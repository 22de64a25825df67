"""A memory past the model's window: a facts conversation about four times the model's positions
held in a fixed budget, its positions made compact whenever the next message would pass them.

The conversation is the memory suite's ``facts`` task (:mod:`kvedit.evals.tasks.memory_facts`:
``--facts`` facts over 200 messages, the facts spread over its thirds) stretched with the task's
own unrelated chat: ``--filler`` chat pairs after every pair of its first two thirds, so the early
and middle facts lie far back and the late third (its facts the last few thousand tokens) is
read last, dense. One ``kvedit.Memory(max_tokens=--max-tokens)`` reads it all, message by message
(:attr:`Memory.forgetting` rounds as it goes, compact positions at the limit), then every fact is
asked (``remember=False``, greedy). Reported:

- whether every message was taken (no refusal) and how far past the model's positions the
  conversation went (tokens read / positions), how often positions were made compact, and the
  seconds that took against all the messages' own (the cost target: at most 20%);
- **held facts**: the facts whose statement the memory still holds (at least half its tokens on
  the median global layer), recalled past the window, against **the same facts asked inside the
  window**: a memory with the same budget that read only the stretch of the conversation the
  fact is in (consecutive stretches of at most ``--window-tokens`` tokens, each after the system
  message), so it never passed the positions (run for the held facts only: the others are
  reported past the window alone);
- **the last tokens' facts**: the late facts recalled past the window against a memory with no
  budget that holds only the last ``--tail-tokens`` tokens (and the system message).

Usage: ``python -m benchmarks.memory_past_window --seeds 1,2 --threads 1
--out runs/memory_past_window.json``
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks.common import add_model, command_line, markdown_table, parser, write_json
from kvedit import Memory
from kvedit.evals.metrics import best_subspan_em
from kvedit.evals.tasks.memory_facts import CHAT, facts_examples
from kvedit.memory.holdings import MessageHeld, held_by_message
from kvedit.models import load_model


def stretched(seed: int, n_facts: int, filler: int) -> tuple[list[tuple[str, str]], list[dict]]:
    """``(messages, facts)``: the facts conversation of ``seed`` (system message first), with
    ``filler`` chat pairs after each pair of its first two thirds; each fact as ``{question,
    answers, bucket, message}`` (``message``: the index of its statement)."""
    conv = facts_examples(1, seed=seed, n_messages=200, n_facts=n_facts)[0]
    rng = random.Random(f"past-window-{seed}")
    pairs = [conv.messages[i : i + 2] for i in range(1, len(conv.messages), 2)]
    messages = [conv.messages[0]]
    where = {}  # the original message index -> the stretched one
    for p, pair in enumerate(pairs):
        where[2 * p + 1] = len(messages)
        messages += list(pair)
        if p < 2 * len(pairs) // 3:
            for _ in range(filler):
                user, reply = CHAT[rng.randrange(len(CHAT))]
                messages += [("user", user), ("assistant", reply)]
    facts = [
        {
            "question": probe.question,
            "answers": list(probe.answers),
            "bucket": probe.bucket,
            "message": where[probe.where],
        }
        for probe in conv.probes
    ]
    return messages, facts


def held_share(row: MessageHeld) -> float:
    """The share of a message's tokens the median counted layer holds (per KV head on average
    where each head holds its own)."""
    return statistics.median(x.held / max(row.n_tokens, 1) for x in row.layers)


def read(mem: Memory, messages: Sequence[tuple[str, str]]) -> dict:
    """Add ``messages`` one by one; the seconds and what the memory did."""
    t0 = time.perf_counter()
    for role, content in messages:
        mem.add(role, content)
    return {"seconds": time.perf_counter() - t0}


def ask(mem: Memory, facts: Sequence[dict], new_tokens: int) -> list[float]:
    return [
        best_subspan_em(mem.ask(f["question"], new_tokens, remember=False), f["answers"])
        for f in facts
    ]


def stretches(mem_turns, limit: int) -> list[tuple[int, int]]:
    """Consecutive ``[first, end)`` message ranges (after the system message) of at most
    ``limit`` tokens each, cut between a user message and the one before it."""
    out, first, tokens = [], 1, 0
    for i in range(1, len(mem_turns)):
        n = mem_turns[i].n_tokens
        if tokens + n > limit and mem_turns[i].role == "user" and i > first:
            out.append((first, i))
            first, tokens = i, 0
        tokens += n
    out.append((first, len(mem_turns)))
    return out


def run_seed(model, tok, seed: int, args) -> dict:
    messages, facts = stretched(seed, args.facts, args.filler)
    kw = {"max_tokens": args.max_tokens, "forget": args.forget}
    if args.recent_tokens is not None:
        kw["recent_tokens"] = args.recent_tokens
    mem = Memory(model, tok, system=messages[0][1], **kw)
    read_seconds = read(mem, messages[1:])["seconds"]
    tokens = sum(t.n_tokens for t in mem.turns)
    steps = [s for s in mem.state.history.steps if s.kind == "reposition"]
    past = ask(mem, facts, args.new_tokens)
    held_rows = held_by_message(
        mem.turns, mem.state.layers, mem.state.counted_layers, len(mem.state)
    )
    shares = [held_share(held_rows[f["message"]]) for f in facts]
    held = [k for k, s in enumerate(shares) if s >= 0.5]
    # the held facts inside the window: a memory of each stretch alone, same budget
    inside = [None] * len(facts)
    for first, end in stretches(mem.turns, args.window_tokens):
        mine = [k for k in held if first <= facts[k]["message"] < end]
        if not mine:
            continue
        ref = Memory(model, tok, system=messages[0][1], **kw)
        read(ref, messages[first:end])
        for k, score in zip(mine, ask(ref, [facts[k] for k in mine], args.new_tokens), strict=True):
            inside[k] = score
    # the last tokens' facts: a memory of only the last --tail-tokens tokens, no budget
    first, total = len(mem.turns), 0
    while first > 1 and total + mem.turns[first - 1].n_tokens <= args.tail_tokens:
        first -= 1
        total += mem.turns[first].n_tokens
    while first < len(mem.turns) and mem.turns[first].role != "user":
        first += 1
    tail = [k for k, f in enumerate(facts) if f["message"] >= first]
    tail_mem = Memory(model, tok, system=messages[0][1])
    read(tail_mem, messages[first:])
    tail_scores = ask(tail_mem, [facts[k] for k in tail], args.new_tokens)
    return {
        "seed": seed,
        "forget": mem.budget.policy,
        "recent_tokens": args.recent_tokens,
        "messages": len(messages),
        "tokens_read": tokens,
        "positions": mem.state.max_positions or model.config.max_position_embeddings,
        "next_position": mem.state.next_position,
        "compactions": len(steps),
        "read_seconds": round(read_seconds, 1),
        "reposition_seconds": round(mem.reposition_seconds, 2),
        "facts": [
            {**f, "past": p, "inside": i, "held_share": round(s, 3)}
            for f, p, i, s in zip(facts, past, inside, shares, strict=True)
        ],
        "held": held,
        "tail": tail,
        "tail_scores": tail_scores,
    }


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 3) if values else None


def summary(rows: list[dict]) -> dict:
    facts = [f for r in rows for f in r["facts"]]
    held = [r["facts"][k] for r in rows for k in r["held"]]
    tail = [r["facts"][k] for r in rows for k in r["tail"]]
    return {
        "facts": len(facts),
        "past_all": _mean(f["past"] for f in facts),
        "held_facts": len(held),
        "past_held": _mean(f["past"] for f in held),
        "inside_held": _mean(f["inside"] for f in held),
        "tail_facts": len(tail),
        "past_tail": _mean(f["past"] for f in tail),
        "tail_only": _mean(s for r in rows for s in r["tail_scores"]),
        "reposition_share": round(
            sum(r["reposition_seconds"] for r in rows) / sum(r["read_seconds"] for r in rows), 4
        ),
    }


def add_conversation_args(p) -> None:
    """The stretched facts conversation's options (:func:`stretched`): seeds, facts, filler."""
    p.add_argument("--seeds", default="1,2", help="facts conversations' seeds (1,2)")
    p.add_argument("--facts", type=int, default=15, help="facts stated (15)")
    p.add_argument("--filler", type=int, default=15, help="chat pairs after each early pair (15)")


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    add_conversation_args(p)
    p.add_argument("--max-tokens", type=int, default=2048, help="the memory's budget (2048)")
    p.add_argument("--forget", default=None, help="the policy (default: the memory's default)")
    p.add_argument(
        "--recent-tokens",
        type=int,
        default=None,
        help="the memory's recent_tokens, the last tokens never forgotten (default: Memory's)",
    )
    p.add_argument("--window-tokens", type=int, default=6000, help="stretch asked inside (6000)")
    p.add_argument("--tail-tokens", type=int, default=2048, help="the last tokens (2048)")
    p.add_argument("--new-tokens", type=int, default=16, help="most tokens per answer (16)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--out", default="runs/memory_past_window.json", help="JSON output")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        rows.append(run_seed(model, tok, seed, args))
        r = rows[-1]
        print(
            f"seed {seed}: {r['messages']} messages, {r['tokens_read']} tokens over "
            f"{r['positions']} positions, {r['compactions']} compactions "
            f"({r['reposition_seconds']} s of {r['read_seconds']} s)",
            flush=True,
        )
    s = summary(rows)
    table = markdown_table(
        ["facts", "past the window", "inside the window", "n"],
        [
            ["all", s["past_all"], "-", s["facts"]],
            ["held by the memory", s["past_held"], s["inside_held"], s["held_facts"]],
            [
                "last tokens' (vs a memory of them alone)",
                s["past_tail"],
                s["tail_only"],
                s["tail_facts"],
            ],
        ],
    )
    print("\n".join(table))
    print(f"repositioning: {100 * s['reposition_share']:.2f}% of the messages' time")
    write_json(
        args.out,
        {"command": command_line(__file__, argv), "model": args.model, "summary": s, "rows": rows},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
