"""A ``kvedit.Memory`` kept under a byte budget over a long conversation: the bytes it allocates
after every message (never above the budget), its forgetting rounds, and what forgetting costs
per message against each message's own cost.

The conversation is the ``facts`` task's (:func:`kvedit.evals.tasks.memory_facts.facts_examples`,
``--messages`` after the system message). The budget is ``--budget`` of the bytes a memory that
forgets nothing allocates for the whole conversation (``Memory.nbytes``: every layer, the
model's dtype), given as ``max_bytes``. For each policy (and each ``--quantize`` value, 0 meaning
none), every message is added with ``Memory.add`` and timed; forgetting's cost is the rounds it
ran (``Memory.forgetting``) plus what an arrival policy spent scoring the message
(``Memory.scoring_seconds``); the rest of the add is the message's own cost. After every
message the bytes the memory allocates (``Memory.nbytes``, packed where quantized, padding
included) are checked against the budget.

Usage: ``python -m benchmarks.memory_budget --messages 200 --budget 0.25 --threads 1
--out runs/memory_budget.json``
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks.common import add_model, command_line, markdown_table, parser, write_json
from kvedit import Memory
from kvedit.evals.tasks.memory_facts import facts_examples
from kvedit.memory.forgetting import global_entries
from kvedit.models import load_model


def run_policy(model, tok, messages, max_bytes: int, policy: str, bits: int | None) -> dict:
    """Add every message to a memory with ``max_bytes`` and ``policy`` (and ``quantize=bits``);
    per-message timings and bytes, and the summary."""
    mem = Memory(model, tok, max_bytes=max_bytes, forget=policy, quantize=bits)
    rows = []
    for role, content in messages:
        rounds, scored = len(mem.forgetting), mem.scoring_seconds
        t0 = time.perf_counter()
        mem.add(role, content)
        seconds = time.perf_counter() - t0
        forgot = math.fsum(r.seconds for r in mem.forgetting[rounds:])
        forgot += mem.scoring_seconds - scored
        rows.append(
            {
                "seconds": seconds,
                "forget_seconds": forgot,
                "own_seconds": seconds - forgot,
                "entries": global_entries(mem.state),
                "nbytes": mem.nbytes,
            }
        )
    n = len(rows)
    forget = math.fsum(r["forget_seconds"] for r in rows)
    own = math.fsum(r["own_seconds"] for r in rows)
    return {
        "policy": policy,
        "quantize": bits,
        "messages": n,
        "max_bytes": max_bytes,
        "per_head": mem.budget.per_head,
        "rounds": len(mem.forgetting),
        "over_budget": sum(r["nbytes"] > max_bytes for r in rows),
        "peak_nbytes": max(r["nbytes"] for r in rows),
        "final_nbytes": rows[-1]["nbytes"],
        "forget_seconds": round(forget, 3),
        "own_seconds": round(own, 3),
        "forget_per_message": round(forget / n, 4),
        "own_per_message": round(own / n, 4),
        "forget_over_own": round(forget / own, 4),
        "median_round_seconds": round(statistics.median([r.seconds for r in mem.forgetting]), 4)
        if mem.forgetting
        else None,
        "rows": rows,
    }


def table(results: Sequence[dict]) -> list[str]:
    head = [
        "policy",
        "quantize",
        "rounds",
        "peak held MiB / budget",
        "over budget",
        "forget s/msg",
        "own s/msg",
        "forget / own",
    ]
    rows = [
        [
            r["policy"],
            r["quantize"] or "-",
            r["rounds"],
            f"{r['peak_nbytes'] / 2**20:.2f} / {r['max_bytes'] / 2**20:.2f}",
            r["over_budget"],
            f"{r['forget_per_message']:.4f}",
            f"{r['own_per_message']:.4f}",
            f"{100 * r['forget_over_own']:.1f}%",
        ]
        for r in results
    ]
    return markdown_table(head, rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    p.add_argument("--messages", type=int, default=200, help="messages after the system (200)")
    p.add_argument("--budget", type=float, default=0.25, help="fraction of the bytes (0.25)")
    p.add_argument("--policies", default="learned,kvzip,window", help="comma-separated")
    p.add_argument("--quantize", default="0,4", help="bits, 0 for none (0,4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (torch's default)")
    p.add_argument("--out", default="runs/memory_budget.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    conv = facts_examples(1, args.seed, n_messages=args.messages, n_facts=15)[0]
    whole = Memory(model, tok)
    for role, content in conv.messages:
        whole.add(role, content)
    max_bytes = round(args.budget * whole.nbytes)
    results = []
    for policy in args.policies.split(","):
        for bits in (int(b) for b in args.quantize.split(",")):
            r = run_policy(model, tok, conv.messages, max_bytes, policy, bits or None)
            results.append(r)
            print(
                f"{policy} quantize={bits}: {r['rounds']} rounds, over budget {r['over_budget']}"
                f", forget/own {100 * r['forget_over_own']:.1f}%",
                flush=True,
            )
    lines = table(results)
    print("\n".join(lines))
    write_json(
        args.out,
        {
            "command": command_line(__file__, argv),
            "model": args.model,
            "full_nbytes": whole.nbytes,
            "tokens": len(whole.state),
            "results": results,
            "table": lines,
        },
    )
    print(f"raw: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
