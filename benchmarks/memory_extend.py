"""Memory.extend of many messages against one Memory.add per message: the time of each, the
speedup, the forward passes each ran, and whether the two memories hold the same digest,
turns and K/V (largest difference).

A seeded conversation of ``--messages`` alternating user and assistant messages (two to five
short sentences each, :func:`benchmarks.memory_speed.conversation`) is added to two memories
with the same system message, no budget: one ``add`` at a time, then all at once with
``extend``. A forward pre-hook on the input embedding counts the passes and their tokens.

SmolLM2 attends to 8,192 positions, about 140 such messages: 300 fit with ``--sentences 1``
(each message its first sentence), or need ``--max-positions 32768`` (positions past its
training: fine for timing, not for answers).

Usage: ``python -m benchmarks.memory_extend --messages 300 --sentences 1 --threads 1``
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import RUNS, add_model, command_line, parser, write_json
from benchmarks.memory_speed import TokenCounter, conversation
from kvedit import Memory
from kvedit.models import load_model

SYSTEM = "You are a helpful assistant who keeps track of the user's plans."


def largest_kv_difference(a: Memory, b: Memory) -> float:
    """The largest absolute difference between the two memories' keys and values."""
    most = 0.0
    for x, y in zip(a.state.layers, b.state.layers, strict=True):
        (kx, vx), (ky, vy) = x.dense_kv(), y.dense_kv()
        most = max(most, (kx - ky).abs().max().item(), (vx - vy).abs().max().item())
    return most


def first_sentences(text: str, n: int) -> str:
    """The first ``n`` sentences of ``text`` (ended by ``.``, ``!`` or ``?``)."""
    parts = re.split(r"(?<=[.!?])\s+", text.strip())
    return " ".join(parts[:n])


def run(args) -> dict:
    model, tok = load_model(args.model)
    nxt = conversation(args.seed)
    messages = [nxt() for _ in range(args.messages)]
    if args.sentences is not None:  # shorter messages: 300 fit in SmolLM2's positions
        messages = [
            replace(m, content=first_sentences(m.content, args.sentences)) for m in messages
        ]
    counter = TokenCounter(model)
    try:
        one = Memory(model, tok, system=SYSTEM, max_positions=args.max_positions)
        counter.take()
        t0 = time.perf_counter()
        for m in messages:
            one.add(m.role, m.content)
        adds_s = time.perf_counter() - t0
        add_passes = counter.take()
        batch = Memory(model, tok, system=SYSTEM, max_positions=args.max_positions)
        counter.take()
        t0 = time.perf_counter()
        batch.extend(messages)
        extend_s = time.perf_counter() - t0
        extend_passes = counter.take()
    finally:
        counter.close()
    tokens = len(one.state) - one.turns[1].start
    return {
        "command": command_line(__file__, args.argv),
        "model": args.model,
        "messages": len(messages),
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "adds_seconds": adds_s,
        "extend_seconds": extend_s,
        "speedup": adds_s / extend_s,
        "add_passes": len(add_passes),
        "extend_passes": len(extend_passes),
        "extend_pass_tokens": extend_passes,
        "same_digest": one.state.digest == batch.state.digest,
        "same_turns": one.turns == batch.turns,
        "largest_kv_difference": largest_kv_difference(one, batch),
        "load_average": Path("/proc/loadavg").read_text().split()[:3]
        if Path("/proc/loadavg").exists()
        else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    p.add_argument("--messages", type=int, default=300, help="messages added (300)")
    p.add_argument(
        "--sentences", type=int, default=None, help="each message cut to its first N sentences"
    )
    p.add_argument("--seed", type=int, default=0, help="the conversation's seed (0)")
    p.add_argument(
        "--max-positions",
        type=int,
        default=None,
        help="positions the memories may use (the model's; SmolLM2's 8,192 hold about 140 "
        "messages: more need a larger value, past what the model was trained on)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (torch's default)")
    p.add_argument("--out", default=None, help="JSON (runs/memory_extend_MODEL.json)")
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    if args.messages < 1:
        p.error("--messages must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    out = args.out or RUNS / f"memory_extend_{Path(args.model).name}.json"
    write_json(out, result)
    print(
        f"{result['messages']} messages, {result['tokens']} tokens, {result['threads']} "
        f"thread(s): adds {result['adds_seconds']:.1f}s ({result['add_passes']} passes), "
        f"extend {result['extend_seconds']:.1f}s ({result['extend_passes']} passes): "
        f"{result['speedup']:.2f}x (target >= 2x); same digest: {result['same_digest']}, "
        f"same turns: {result['same_turns']}, largest K/V difference "
        f"{result['largest_kv_difference']:.2e}"
    )
    return 0 if result["same_digest"] and result["same_turns"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
