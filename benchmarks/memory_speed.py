"""Time to first token per turn of a ``kvedit.Memory`` against re-reading the whole transcript
with plain transformers, and against a bare ``extend`` of the same ids, as a conversation grows
to thousands of tokens; the tokens each message runs through the model, peak RSS and the
memory's bytes.

A seeded conversation of user and assistant messages (30-90 tokens each, added with
``Memory.add``) grows to ``--tokens``. At ``--points`` turns spread evenly over it (the last
turn always among them) one fixed question is timed three ways, interleaved, ``--repeats`` times
each (median): ``memory``: ``Memory.ask(question, max_new_tokens=1, remember=False)``;
``extend``: :func:`kvedit.states.capturing.extend_ids` of the memory's state by the same ids
(the question and the generation prompt, rendered beforehand), its first token from
``last_logits``; ``reread``: the transcript with the question tokenized by plain transformers
(the chat template, or the plain format's text) and run through the model from scratch
(``model(input_ids, logits_to_keep=1)``, no cache). ``render`` times the rendering of the whole
conversation that every ``ask`` does. A forward pre-hook on the input embedding counts the
tokens each call runs: per ``add`` against the tokens the message added, per ``ask`` against the
question's. Peak RSS is taken per method at each point (``VmHWM`` reset before it).

Usage: ``python -m benchmarks.memory_speed --model smollm2-135m-instruct --tokens 7500
--report reports/memory/speed_smollm2``
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.common import (
    RUNS,
    add_model,
    command_line,
    markdown_table,
    parser,
    peak_rss_kb,
    reset_peak_rss,
    rss_kb,
    write_file,
    write_json,
)
from kvedit import Memory, checks
from kvedit.memory.rendering import Message
from kvedit.models import load_model
from kvedit.states.capturing import extend_ids

QUESTION = "Which of the things I mentioned earlier should I do first?"
SYSTEM = "You are a helpful assistant. Answer briefly."

_SUBJECTS = [
    "the garden",
    "my bike",
    "the quarterly report",
    "our trip to the coast",
    "the kitchen sink",
    "the new laptop",
    "my piano lessons",
    "the neighbours' dog",
    "the book club",
    "the tax forms",
    "the birthday party",
    "the broken window",
]
_VERBS = ["fix", "plan", "finish", "clean", "move", "check", "paint", "sort out", "schedule"]
_CLAUSES = [
    "because it has been on my mind all week",
    "before the weather turns cold",
    "although I am not sure where to start",
    "since my friends keep asking about it",
    "and I would like a simple plan",
    "but I only have a couple of hours each evening",
    "so that the weekend stays free",
    "even though it seems like a small thing",
]
_REPLIES = [
    "That sounds manageable.",
    "Start with the smallest step and build from there.",
    "A short list for each evening could help.",
    "It may be worth asking a friend to help.",
    "Try to set a clear deadline for it.",
    "Breaking it into parts usually makes it easier.",
    "Keep notes so you can see your progress.",
    "That is a good idea; plan an hour for it.",
]


def conversation(seed: int) -> Callable[[], Message]:
    """An endless seeded stream of alternating user and assistant messages (user first), each
    of two to five sentences."""
    rng = random.Random(seed)
    turn = [0]

    def nxt() -> Message:
        user = turn[0] % 2 == 0
        turn[0] += 1
        n = rng.randint(2, 5)
        if user:
            text = " ".join(
                f"I need to {rng.choice(_VERBS)} {rng.choice(_SUBJECTS)} {rng.choice(_CLAUSES)}."
                for _ in range(n)
            )
            return Message("user", text)
        return Message("assistant", " ".join(rng.choice(_REPLIES) for _ in range(n)))

    return nxt


class TokenCounter:
    """A forward pre-hook on the model's input embedding: the tokens each call runs."""

    def __init__(self, model) -> None:
        self.calls: list[int] = []
        self._handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        if args and isinstance(args[0], torch.Tensor):
            self.calls.append(int(args[0].numel()))

    def take(self) -> list[int]:
        out, self.calls = self.calls, []
        return out

    def close(self) -> None:
        self._handle.remove()


def reread_ids(memory: Memory, messages: Sequence[Message], question: str) -> list[int]:
    """The transcript and the question as plain transformers tokenizes them: the chat template
    with its generation prompt, or the plain format's text tokenized whole."""
    tok = memory.tokenizer
    asked = [*messages, Message("user", question)]
    if memory.prompt == "chat":
        text = tok.apply_chat_template(
            [m.as_dict() for m in asked], tokenize=False, add_generation_prompt=True
        )
        return list(tok(text, add_special_tokens=False)["input_ids"])
    text = memory.renderer.render(asked, generation_prompt=True).text
    bos = tok.bos_token or ""
    return list(tok(text[len(bos) :])["input_ids"])


def measure_point(memory: Memory, model, question: str, repeats: int, reread_repeats: int):
    """Median seconds and first tokens of the three ways (and the rendering) at this turn."""
    messages = memory.messages
    p = memory.renderer.render([*messages, Message("user", question)], generation_prompt=True)
    n = len(memory.state)

    def by_memory() -> int:
        text = memory.ask(question, max_new_tokens=1, remember=False)
        return len(text)

    def by_extend() -> int:
        s = extend_ids(memory.state, p.ids[n:], p.offsets[n:], p.text)
        return int(s.last_logits.argmax())

    def by_render() -> int:
        return len(memory.renderer.render([*messages, Message("user", question)], True).ids)

    def by_reread() -> int:
        ids = reread_ids(memory, messages, question)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), logits_to_keep=1, use_cache=False)
        return int(out.logits[0, -1].argmax())

    ways = {"memory": by_memory, "extend": by_extend, "render": by_render, "reread": by_reread}
    times: dict[str, list[float]] = {k: [] for k in ways}
    peaks: dict[str, int] = {}
    results: dict[str, int] = {}
    reset = False
    for r in range(max(repeats, reread_repeats)):
        for name, fn in ways.items():
            if r >= (reread_repeats if name == "reread" else repeats):
                continue
            reset = reset_peak_rss()
            t0 = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t0)
            peaks[name] = max(peaks.get(name, 0), peak_rss_kb(reset))
    same_ids = reread_ids(memory, messages, question) == p.ids
    return {
        "tokens": n,
        "question_tokens": len(p.ids) - n,
        "messages": len(messages),
        "seconds": {k: statistics.median(v) if v else math.nan for k, v in times.items()},
        "all_seconds": times,
        "peak_rss_kb": peaks,
        "reread_same_ids": same_ids,
        "extend_token": results["extend"],
        "reread_token": results.get("reread"),  # None with --reread-repeats 0
        "nbytes": memory.nbytes,
    }


def add_message(memory: Memory, m: Message, counter: TokenCounter, adds: list[dict]) -> None:
    """``memory.add`` one message; record its tokens, the tokens the model ran and seconds."""
    n0 = len(memory.state)
    t0 = time.perf_counter()
    turn = memory.add(m.role, m.content)
    seconds = time.perf_counter() - t0
    counted = counter.take()
    adds.append(
        {
            "index": turn.index,
            "role": m.role,
            "tokens_before": n0,
            "message_tokens": turn.n_tokens,
            "computed": turn.computed,
            "counted": sum(counted),
            "calls": len(counted),
            "seconds": seconds,
        }
    )


def time_point(memory: Memory, model, counter: TokenCounter, args, t_start: float) -> dict:
    """Time the question at this turn (:func:`measure_point`) after one untimed ask whose
    model input tokens are counted."""
    counter.take()
    memory.ask(args.question, max_new_tokens=1, remember=False)  # untimed warm-up
    ask_counted = counter.take()
    point = measure_point(memory, model, args.question, args.repeats, args.reread_repeats)
    counter.take()
    point["ask_counted"] = sum(ask_counted)
    point["ask_calls"] = len(ask_counted)
    point["rss_kb"] = rss_kb()
    s = point["seconds"]
    print(
        f"{point['tokens']:6d} tokens ({len(memory)} messages): memory "
        f"{s['memory'] * 1e3:8.1f} ms  extend {s['extend'] * 1e3:8.1f} ms  render "
        f"{s['render'] * 1e3:6.1f} ms  reread {s['reread'] * 1e3:9.1f} ms  "
        f"reread/memory {s['reread'] / s['memory']:6.1f}x  memory/extend "
        f"{s['memory'] / s['extend']:.3f}x  [{time.perf_counter() - t_start:.0f} s]",
        flush=True,
    )
    return point


def run(args) -> dict:
    model, tok = load_model(args.model)
    torch.set_grad_enabled(False)
    memory = Memory(model, tok, system=SYSTEM, prompt=args.prompt)
    positions = checks.positions_limit(model)
    counter = TokenCounter(model)
    counter.take()
    nxt = conversation(args.seed)
    step = args.tokens / max(args.points, 1)
    milestone = step
    adds, points = [], []
    t_start = time.perf_counter()

    def fits(pair: Sequence[Message]) -> bool:  # a few tokens of markup per message
        n = sum(len(tok(m.content, add_special_tokens=False)["input_ids"]) + 8 for m in pair)
        return len(memory.state) + n + 24 <= args.tokens  # and room for the question

    pair = [nxt(), nxt()]
    while fits(pair):
        for m in pair:
            add_message(memory, m, counter, adds)
        pair = [nxt(), nxt()]
        if len(memory.state) >= milestone or not fits(pair):
            while milestone <= len(memory.state):
                milestone += step
            points.append(time_point(memory, model, counter, args, t_start))
    counter.close()
    last = points[-1]["seconds"]
    mismatched = [a for a in adds if a["counted"] != a["computed"]]
    return {
        "command": command_line(__file__, args.argv),
        "model": args.model,
        "prompt": memory.prompt,
        "positions": positions or None,
        "threads": torch.get_num_threads(),
        "question": args.question,
        "repeats": args.repeats,
        "reread_repeats": args.reread_repeats,
        "seed": args.seed,
        "messages": len(memory),
        "tokens": len(memory.state),
        "nbytes": memory.nbytes,
        "peak_rss_kb": peak_rss_kb(False),
        "last": {
            "tokens": points[-1]["tokens"],
            "reread_over_memory": last["reread"] / last["memory"],
            "memory_over_extend": last["memory"] / last["extend"],
            "render_share_of_memory": last["render"] / last["memory"],
        },
        "adds_counted_equal_computed": not mismatched,
        "adds_mismatched": mismatched[:10],
        "adds": adds,
        "points": points,
    }


def table(result: dict) -> list[str]:
    head = [
        "tokens",
        "messages",
        "memory ms",
        "extend ms",
        "render ms",
        "reread ms",
        "reread / memory",
        "memory / extend",
        "ask's tokens run",
        "MiB held",
    ]
    rows = []
    for p in result["points"]:
        s = p["seconds"]
        rows.append(
            [
                p["tokens"],
                p["messages"],
                f"{s['memory'] * 1e3:.1f}",
                f"{s['extend'] * 1e3:.1f}",
                f"{s['render'] * 1e3:.1f}",
                f"{s['reread'] * 1e3:.0f}",
                f"{s['reread'] / s['memory']:.1f}x",
                f"{s['memory'] / s['extend']:.3f}x",
                f"{p['ask_counted']} of {p['question_tokens']}",
                f"{p['nbytes'] / 2**20:.1f}",
            ]
        )
    return markdown_table(head, rows)


def plot(result: dict, path: Path) -> str:
    """The plot of seconds against tokens, or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed"
    xs = [p["tokens"] for p in result["points"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = {
        "reread": "re-read the transcript (transformers)",
        "memory": "Memory.ask (first token)",
        "extend": "bare extend of the same ids",
    }
    for key, label in labels.items():
        ax.plot(xs, [p["seconds"][key] for p in result["points"]], marker="o", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the conversation")
    ax.set_ylabel("time to first token (s, median)")
    ax.set_title(f"{result['model']}: time to first token per turn")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_file(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)
    return f"plot: {path}"


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    p.add_argument(
        "--prompt",
        default=None,
        help="chat or plain (default: chat when the tokenizer has a template)",
    )
    p.add_argument("--tokens", type=int, default=7500, help="the conversation's length (7500)")
    p.add_argument("--points", type=int, default=8, help="turns timed, spread evenly (8)")
    p.add_argument("--repeats", type=int, default=3, help="timings per way per point (3)")
    p.add_argument(
        "--reread-repeats",
        type=int,
        default=None,
        help="timings of the re-read (--repeats; 0: no re-read, for the memory / extend ratio)",
    )
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--seed", type=int, default=0, help="the conversation's seed (0)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (torch's default)")
    p.add_argument("--out", default=None, help="raw JSON (runs/memory_speed_MODEL.json)")
    p.add_argument(
        "--report", default=None, help="PREFIX: write PREFIX.json (no per-add rows), .md, .png"
    )
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    if args.reread_repeats is None:
        args.reread_repeats = args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    out = args.out or RUNS / f"memory_speed_{Path(args.model).name}.json"
    write_json(out, result)
    lines = table(result)
    print("\n".join(lines))
    last = result["last"]
    print(
        f"last turn ({last['tokens']} tokens): re-read / memory {last['reread_over_memory']:.1f}x "
        f"(target >= 10x), memory / extend {last['memory_over_extend']:.3f}x (target <= 1.1x); "
        f"every add ran exactly its own tokens: {result['adds_counted_equal_computed']}; "
        f"peak RSS {result['peak_rss_kb'] / 1024:.0f} MiB; memory {result['nbytes'] / 2**20:.1f} "
        f"MiB; raw: {out}"
    )
    if args.report:
        prefix = Path(args.report)
        summary = {k: v for k, v in result.items() if k != "adds"}
        summary["adds_summary"] = {
            "adds": len(result["adds"]),
            "counted_equal_computed": result["adds_counted_equal_computed"],
            "tokens_counted": sum(a["counted"] for a in result["adds"]),
            "tokens_in_messages": sum(a["message_tokens"] for a in result["adds"]),
            "median_add_seconds": statistics.median(a["seconds"] for a in result["adds"]),
        }
        write_json(prefix.with_suffix(".json"), summary)
        write_file(
            prefix.with_suffix(".md"), "\n".join([f"`{result['command']}`", "", *lines]) + "\n"
        )
        print(plot(result, prefix.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
