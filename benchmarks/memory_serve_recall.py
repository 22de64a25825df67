"""Recall of facts conversations answered through ``kvedit serve`` under a byte budget, against
an in-process ``kvedit.Memory`` with the same budget (the ``kvedit eval memory --task facts``
conversations: facts stated among small talk, then questions about them, each question asked
of the same memory).

Through the server, the conversation's messages are sent turn by turn (each user message with
``max_tokens=1``; the conversation's own assistant message follows it in the next request, so
the memory holds the task's text, forgotten down to the budget at every turn); then each
question is asked over the whole conversation (the memory of the last message serves every
question). In process: a ``kvedit.Memory(max_bytes=..., forget="learned", per_head=False,
per_layer=False)`` adds the messages and asks each question without remembering it. The budget
is ``--budget`` of the bytes the conversation takes when nothing is forgotten.

Run in the vLLM venv::

    .venv-vllm/bin/python -m benchmarks.memory_serve_recall --n-examples 4 --facts 9 \\
        --budget 0.25 [--out runs/memory_serve_recall.json]
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import DEFAULT_MODEL, RUNS, parser, write_json
from benchmarks.memory_serve import free_port, running_server

START_TIMEOUT_S = 600


def serve_conversation(client, model: str, conv, budget: int, tokens: int) -> list[str]:
    """The answers to ``conv``'s questions through the server (see the module doc)."""
    params = {"kv_transfer_params": {"kvedit": {"max_bytes": budget}}}
    messages: list[dict] = []
    for role, content in conv.messages:
        messages.append({"role": role, "content": content})
        if role == "user":
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=1, temperature=0, extra_body=params
            )
    answers = []
    for probe in conv.probes:
        r = client.chat.completions.create(
            model=model,
            messages=[*messages, {"role": "user", "content": probe.question}],
            max_tokens=tokens,
            temperature=0,
            extra_body=params,
        )
        said = (r.model_extra or {}).get("kv_transfer_params", {}).get("kvedit", {})
        if said.get("error"):
            raise RuntimeError(f"{conv.id}: {said['error']}")
        answers.append((r.choices[0].message.content or "").strip())
    return answers


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--n-examples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--messages", type=int, default=60, help="messages per conversation")
    ap.add_argument("--facts", type=int, default=9, help="facts (and questions) per conversation")
    ap.add_argument("--budget", type=float, default=0.25, help="fraction of the bytes")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument(
        "--layers",
        choices=["same", "own"],
        default="same",
        help="the in-process memory: the same tokens on every layer (per_layer=False, what the "
        "server serves) or each layer its own count (per_layer=True)",
    )
    ap.add_argument("--in-process-only", action="store_true", help="no server")
    ap.add_argument("--out", default=str(RUNS / "memory_serve_recall.json"))
    args = ap.parse_args(argv)
    import kvedit
    from kvedit.evals.metrics import best_subspan_em
    from kvedit.evals.tasks.memory_facts import facts_examples

    convs = facts_examples(args.n_examples, args.seed, args.messages, args.facts)
    model, tok = kvedit.load_model(args.model)
    rows, budgets = [], {}
    for conv in convs:
        full = kvedit.Memory(model, tok)
        for role, content in conv.messages:
            full.add(role, content)
        budgets[conv.id] = int(args.budget * full.nbytes)
        mem = kvedit.Memory(
            model,
            tok,
            max_bytes=budgets[conv.id],
            forget="learned",
            per_head=False,
            per_layer=args.layers == "own",
        )
        for role, content in conv.messages:
            mem.add(role, content)
        for probe in conv.probes:
            answer = mem.ask(probe.question, max_new_tokens=args.answer_tokens, remember=False)
            rows.append(
                {
                    "id": conv.id,
                    "question": probe.question,
                    "bucket": probe.bucket,
                    "answers": list(probe.answers),
                    "in_process": answer,
                    "in_process_correct": best_subspan_em(answer, probe.answers),
                    "budget_bytes": budgets[conv.id],
                }
            )
    summary = {
        "model": args.model,
        "questions": len(rows),
        "budget": args.budget,
        "layers": args.layers,
        "in_process_correct": sum(r["in_process_correct"] for r in rows),
    }
    if args.in_process_only:
        write_json(args.out, {"summary": summary, "rows": rows, "command": sys.argv})
        print(summary)
        return 0
    import openai

    root = Path(tempfile.mkdtemp(prefix="kvedit-recall-"))
    port = free_port()
    cmd = [sys.executable, "-m", "kvedit", "serve", "--model", args.model, "--root", str(root)]
    cmd += ["--port", str(port)]
    with running_server(cmd, port, root.with_suffix(".log"), START_TIMEOUT_S) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
        served = []
        for conv in convs:
            served += serve_conversation(
                client, args.model, conv, budgets[conv.id], args.answer_tokens
            )
    for row, answer in zip(rows, served, strict=True):
        row["served"] = answer
        row["served_correct"] = best_subspan_em(answer, row["answers"])
    summary["served_correct"] = sum(r["served_correct"] for r in rows)
    summary["same_answers"] = sum(r["in_process"] == r["served"] for r in rows)
    write_json(args.out, {"summary": summary, "rows": rows, "command": sys.argv})
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
